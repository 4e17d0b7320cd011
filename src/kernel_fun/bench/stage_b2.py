"""F6 / B2's entry in the stage bench (``kernel_fun.bench.stage``): the WY vectors from
Akk_inv, kernel-fun's kernel without u (``kda/kernels/wy_fwd.py``: the chain's scans form u
themselves) against fla's ``recompute_w_u_fwd`` (which writes u too: its time counts it).

``python -m kernel_fun.bench.stage --stage B2 --shapes prod8192_gate --configs sweep``

The inputs are the chain's own: one forward through the reference stages at the shape, q,
k, v, beta and the cumsum from F3-F6's inputs and Akk_inv from its outputs (what F6 reads
in the forward and B2 in the backward). Parity (``kda.parity.prep_misses``): w, qg and kg
against fla's within F3-F6's bars and against the float64 WY within o's budget and within
10% of fla's own error; u is not compared (not written).
"""

from __future__ import annotations

import sys

from kernel_fun.bench.stage import StageBench, chain_runs, main as _stage_main

# The configs worth timing (sm_90a offline, K=128, V=256, no spills): BK=64 at 4 warps 174
# registers (2 stages, 40 KB) and 180 (3 stages, 64 KB); BK=64 at 8 warps 97; BK=32 at 4
# warps 89 (3 stages, 36 KB); BK=128 at 8 warps and one stage 143.
# ``wy-u`` the same kernel writing u too (fla's contract in full: timed with u, compared without
# it here; the GPU test holds its u to fla's)
SWEEP = {"wy-u": [dict(BK=128, num_warps=8, num_stages=1), dict(BK=64, num_warps=4, num_stages=3)],
         "wy": [dict(BK=64, num_warps=4, num_stages=2), dict(BK=64, num_warps=8, num_stages=2),
                dict(BK=32, num_warps=4, num_stages=3), dict(BK=64, num_warps=4, num_stages=3),
                dict(BK=128, num_warps=8, num_stages=1), dict(BK=32, num_warps=8, num_stages=2)]}


def wy_bytes(p) -> int:
    """The fewest bytes the stage moves without u: q, k (bf16), the cumsum (fp32), beta and
    Akk_inv (bf16, 64 a row) read once; w, qg and kg (bf16) written once."""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    return 2 * tok_h * p.K * 2 + tok_hv * p.K * 4 + tok_hv * 2 + tok_hv * 64 * 2 + 3 * tok_hv * p.K * 2


def make_inputs(p, device, seed: int = 0) -> dict:
    (f36, out), = chain_runs(p, device, seed, ("F3-F6",)).values()
    return dict(q=f36["q"], k=f36["k"], v=f36["v"], beta=f36["beta"], A=out[4], gc=f36["gc"], want_u=False,
                chunk_size=f36["chunk_size"], cu_seqlens=f36["cu_seqlens"], chunk_indices=f36["chunk_indices"])


def _without_u(out, want_u):
    return tuple(out) if want_u else (out[0], None, out[2], out[3])


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_wy

    return _without_u(_fla_wy(**inputs), inputs["want_u"])


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    i = inputs
    out = ref.wy_fwd(i["k"], i["v"], i["beta"], i["A"], i["gc"], i["q"], i["chunk_size"], i["cu_seqlens"], exact=True)
    return _without_u(out, i["want_u"])


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import wy_fwd

    if design == "wy-u":
        return _without_u(wy_fwd.wy_vectors(**{**inputs, "want_u": True}, **(config or wy_fwd.DEFAULT_CONFIG)), False)
    return wy_fwd.wy_vectors(**inputs, **(config or wy_fwd.DEFAULT_CONFIG))


def _launch_config(p, design, overrides):
    from kernel_fun.kda.kernels import wy_fwd

    if design not in SWEEP:
        raise ValueError(f"unknown B2 design {design!r}")
    return {**wy_fwd.DEFAULT_CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import prep_misses

    return prep_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B2", make_inputs=make_inputs, bytes=wy_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=("wy",))


def main(argv=None) -> int:
    return _stage_main(argv, stage="B2")


if __name__ == "__main__":
    sys.exit(main())
