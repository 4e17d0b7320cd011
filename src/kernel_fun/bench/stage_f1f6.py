"""The F1-F6 unit's entry in the stage bench (``kernel_fun.bench.stage``): from the raw q, k
and gate to w, u, kg, Aqk and Akk_inv, kernel-fun's F1-F4 kernel with fla's F5 (``diag``)
or kernel-fun's (``diag-solve``) and fla's F6 after it, or F5 and F6 in one kernel-fun
kernel (``diag-solve-wy``) (``kda/kernels/diag_fwd.py``'s ``prep_f1_f6``) against fla's F1,
F2 and F3-F6 in turn.

``python -m kernel_fun.bench.stage --stage F1-F6 --shapes prod8192_gate,prod8192_layer_safe --configs sweep``

The inputs are the chain's own: one forward through the reference stages at the shape, the
raw q, k and gate from F1's and F2's inputs, v and beta from F3-F6's. Parity
(``kda.parity.unit_misses``): F3-F6's bars for its outputs, the normalized rows, their
rstds and the cumsum within 2e-3 of fla's; against the float64 stages (F1 in float64, F2
the reference's fp32 cumsum, F3-F6 in float64 on F1's rows rounded as every F3-F6 reads
them) within o's budget and within 10% of fla's own error.
"""

from __future__ import annotations

import sys

from kernel_fun.bench.stage import StageBench, chain_inputs, main as _stage_main

# The configs worth timing (the notes at diag_fwd.DEFAULT_CONFIG and SOLVE_CONFIG): the F1-F4
# kernel at 32- and 16-channel slices at 4 warps (two programs an SM), each with the slice
# loop's loads pipelined (two stages), and at 8 warps, with fla's F5 (diag); with this
# module's F5 too (diag-solve) at its 16-channel default and 32-channel slices.
_F14 = [dict(BKS=32, num_warps=4, num_stages=1), dict(BKS=16, num_warps=4, num_stages=1),
        dict(BKS=32, num_warps=4, num_stages=2), dict(BKS=16, num_warps=4, num_stages=2),
        dict(BKS=32, num_warps=8, num_stages=1), dict(BKS=16, num_warps=8, num_stages=1)]
SWEEP = {"diag": _F14, "diag-solve": [dict(_F14[0]), dict(_F14[0], SOLVE_BKS=32), dict(_F14[0], SOLVE_STAGES=2)],
         "diag-solve-wy": [dict(_F14[0]), dict(_F14[0], SOLVE_BKS=32)]}


def unit_bytes(p) -> int:
    """The fewest bytes F1-F6 move: the raw q, k, gate (bf16), v (bf16) and beta read once;
    the normalized q, k (bf16), their rstds, the gate's cumsum (fp32), w, kg (bf16), u (bf16),
    Aqk and Akk_inv (bf16, 64 a row) written once."""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    reads = 2 * tok_h * p.K * 2 + tok_hv * p.K * 2 + tok_hv * p.V * 2 + tok_hv * 2
    writes = 2 * tok_h * p.K * 2 + 2 * tok_h * 4 + tok_hv * p.K * 4 + 2 * tok_hv * p.K * 2 + tok_hv * p.V * 2 \
        + 2 * tok_hv * 64 * 2
    return reads + writes


def make_inputs(p, device, seed: int = 0) -> dict:
    runs = chain_inputs(p, device, seed, ("F1", "F2", "F3-F6"))
    f1, f2, f36 = runs.get("F1"), runs["F2"], runs["F3-F6"]
    return dict(q=f1["q"] if f1 else f36["q"], k=f1["k"] if f1 else f36["k"], v=f36["v"], g=f2["g"],
                beta=f36["beta"], A_log=f2["A_log"], dt_bias=f2["dt_bias"], lower_bound=f2["lower_bound"],
                use_gate_in_kernel=f2["use_gate_in_kernel"], use_qk_l2norm_in_kernel=f1 is not None,
                scale=f36["scale"], safe_gate=f36["safe_gate"], disable_recompute=f36["disable_recompute"],
                chunk_size=f36["chunk_size"], cu_seqlens=f36["cu_seqlens"], chunk_indices=f36["chunk_indices"])


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_prep

    return _fla_prep(**inputs)


def _exact(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, scale,
           safe_gate, disable_recompute, chunk_size, cu_seqlens, chunk_indices):
    """The float64 stages: F1 in float64, F2 the reference's cumsum, and F3-F6 in float64 on
    the rows F1 rounds to the input dtype (the rows every implementation's F3-F6 reads)."""
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.chain import _ref_gate, _ref_intra

    f1 = (ref.l2norm_fwd(q.double()) + ref.l2norm_fwd(k.double())) if use_qk_l2norm_in_kernel else (q, None, k, None)
    qn, kn = (ref.l2norm_fwd(q)[0], ref.l2norm_fwd(k)[0]) if use_qk_l2norm_in_kernel else (q, k)
    gc = _ref_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices)
    rest = _ref_intra(qn, kn, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate,
                      disable_recompute, exact=True)
    return tuple(f1) + (gc,) + tuple(rest)


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import diag_fwd

    return diag_fwd.prep_f1_f6(**inputs, **(config or diag_fwd.DEFAULT_CONFIG), design=design)


def _launch_config(p, design, overrides):
    from kernel_fun.kda.kernels import diag_fwd

    if design not in diag_fwd.DESIGNS:
        raise ValueError(f"unknown F1-F6 design {design!r}")
    return {**diag_fwd.DEFAULT_CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import unit_misses

    return unit_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="F1-F6", make_inputs=make_inputs, bytes=unit_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP,
                   designs=("diag", "diag-solve", "diag-solve-wy"))


def main(argv=None) -> int:
    return _stage_main(argv, stage="F1-F6")


if __name__ == "__main__":
    sys.exit(main())
