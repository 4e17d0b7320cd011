"""The backward's B1-B2 unit in the stage bench (``kernel_fun.bench.stage``): the gate's
chunk cumsum from the raw gate and w, u, qg, kg from the saved Akk_inv, kernel-fun's one
kernel (``kda/kernels/diag_fwd.py``'s ``recompute_b1_b2``) against fla's B1
(``kda_gate_chunk_cumsum``) and B2 (``recompute_w_u_fwd``) in turn.

``python -m kernel_fun.bench.stage --stage B1-B2 --shapes prod8192_gate --configs sweep``

The inputs are the chain's own (``recompute_args``): one forward through the reference
stages at the shape, the raw gate and its parameters from F2's inputs, q, k, v and beta from
F3-F6's, Akk_inv from F3-F6's outputs (what the backward's B1 and B2 read: the forward's
saved tensors). Parity (``kda.parity.recompute_misses``): the cumsum within fp32 rounding of
fla's, w, u, qg and kg within F3-F6's bars; against the float64 WY on the reference's
cumsum within o's budget and within 10% of fla's own error.
"""

from __future__ import annotations

import sys

from kernel_fun.bench.stage import StageBench, chain_runs, main as _stage_main

SWEEP = {"recompute": [dict(BKS=64, BV=64, num_warps=4), dict(BKS=64, BV=64, num_warps=8),
                       dict(BKS=64, BV=32, num_warps=4)]}


def recompute_bytes(p) -> int:
    """The fewest bytes B1-B2 move: the raw gate, q, k, v (bf16), beta and Akk_inv (bf16, 64 a
    row) read once; the cumsum (fp32), w, qg, kg (bf16) and u (bf16) written once."""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    reads = tok_hv * p.K * 2 + 2 * tok_h * p.K * 2 + tok_hv * p.V * 2 + tok_hv * 2 + tok_hv * 64 * 2
    writes = tok_hv * p.K * 4 + 3 * tok_hv * p.K * 2 + tok_hv * p.V * 2
    return reads + writes


def recompute_args(f2: dict, f36: dict, Akk) -> dict:
    """The B1-B2 unit's keyword inputs from F2's and F3-F6's inputs and F3-F6's Akk_inv."""
    return dict(g=f2["g"], use_gate_in_kernel=True, A_log=f2["A_log"], dt_bias=f2["dt_bias"],
                lower_bound=f2["lower_bound"], q=f36["q"], k=f36["k"], v=f36["v"], beta=f36["beta"], A=Akk,
                chunk_size=f36["chunk_size"], cu_seqlens=f36["cu_seqlens"], chunk_indices=f36["chunk_indices"])


def make_inputs(p, device, seed: int = 0) -> dict:
    if not p.gate_in_kernel:
        raise ValueError(f"{p.name}: a pre-computed gate (B1 does not run)")
    runs = chain_runs(p, device, seed, ("F2", "F3-F6"))
    (f2, _), (f36, out) = runs["F2"], runs["F3-F6"]
    return recompute_args(f2, f36, out[4])  # F3-F6's outputs (w, u, kg, Aqk, Akk_inv, qg)


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_gate, _fla_wy, _recompute_in_turn

    return _recompute_in_turn(_fla_gate, _fla_wy)(**inputs)


def _exact(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, q, k, v, beta, A, chunk_size, cu_seqlens,
           chunk_indices):
    """The float64 stages: the reference's cumsum (fp32), then the WY in float64 on it."""
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.chain import _ref_gate

    gc = _ref_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices)
    return (gc,) + tuple(ref.wy_fwd(k, v, beta, A, gc, q, chunk_size, cu_seqlens, exact=True))


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import diag_fwd

    return diag_fwd.recompute_b1_b2(**inputs, **(config or diag_fwd.RECOMPUTE_CONFIG))


def _launch_config(p, design, overrides):
    from kernel_fun.kda.kernels import diag_fwd

    if design != "recompute":
        raise ValueError(f"unknown B1-B2 design {design!r}")
    return {**diag_fwd.RECOMPUTE_CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import recompute_misses

    return recompute_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B1-B2", make_inputs=make_inputs, bytes=recompute_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=("recompute",))


def main(argv=None) -> int:
    return _stage_main(argv, stage="B1-B2")


if __name__ == "__main__":
    sys.exit(main())
