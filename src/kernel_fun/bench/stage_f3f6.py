"""The F3-F6 unit's entry in the stage bench (``kernel_fun.bench.stage``): the intra-chunk
scores, their solve and the WY vectors, kernel-fun's one-pass kernel
(``kda/kernels/prep_fwd.py``) against fla's ``chunk_kda_fwd_intra``.

``python -m kernel_fun.bench.stage --stage F3-F6 --shapes prod8192_gate,prod8192_layer_safe --configs sweep``

The inputs are the chain's own: one forward through the reference stages (torch, on the
same device) at the shape, and F3-F6's inputs taken from it (q, k, v, the gate's chunk
cumsum, beta). Parity (``kda.parity.prep_misses``): every output within o's budget (0.005)
of fla's, and against the float64 stage within it and within 10% of fla's own error.
"""

from __future__ import annotations

import sys

from kernel_fun.bench.stage import StageBench, chain_inputs, main as _stage_main

# The configs worth timing (the note at prep_fwd.DEFAULT_CONFIG): the default (8 warps, the
# K sum in slices of 64), slices of 32, u in 32-wide V tiles (176 B of spills against the
# default's 204), and 4 warps.
SWEEP = {"prep": [dict(BKS=64, BV=64, num_warps=8, num_stages=1), dict(BKS=32, BV=64, num_warps=8, num_stages=1),
                  dict(BKS=64, BV=32, num_warps=8, num_stages=1), dict(BKS=64, BV=64, num_warps=4, num_stages=1)]}


def prep_bytes(p) -> int:
    """The fewest bytes F3-F6 move: q, k (bf16), v (bf16), the gate's cumsum (fp32) and beta
    read once; w, kg (bf16), u (bf16), Aqk and Akk_inv (bf16, 64 a row) written once."""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    reads = 2 * tok_h * p.K * 2 + tok_hv * p.V * 2 + tok_hv * p.K * 4 + tok_hv * 2
    writes = 2 * tok_hv * p.K * 2 + tok_hv * p.V * 2 + 2 * tok_hv * 64 * 2
    return reads + writes


def make_inputs(p, device, seed: int = 0) -> dict:
    return chain_inputs(p, device, seed, ("F3-F6",))["F3-F6"]


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_intra

    return _fla_intra(**inputs)


def _exact(**inputs):
    from kernel_fun.kda.chain import _ref_intra

    return _ref_intra(**inputs, exact=True)


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import prep_fwd

    return prep_fwd.prep_fwd(**inputs, **(config or prep_fwd.DEFAULT_CONFIG))


def _launch_config(p, design, overrides):
    from kernel_fun.kda.kernels import prep_fwd

    if design != "prep":
        raise ValueError(f"unknown F3-F6 design {design!r}")
    return {**prep_fwd.DEFAULT_CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import prep_misses

    return prep_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="F3-F6", make_inputs=make_inputs, bytes=prep_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=("prep",))


def main(argv=None) -> int:
    return _stage_main(argv, stage="F3-F6")


if __name__ == "__main__":
    sys.exit(main())
