"""B2's entry (``kda/kernels/b2_wy_recompute.py``): the WY vectors from Akk_inv without u
(kernel-fun's B3 forms u itself), against fla's ``recompute_w_u_fwd`` (which writes u too: its
time counts it).

The inputs are the chain's own: one forward through the reference stages at the shape, q, k,
v, beta and the cumsum from F3-F6's inputs and Akk_inv from its outputs (what B2 reads in the
backward). Parity (``parity.wy_misses``): w, qg and kg against fla's and against the float64
WY within o's budget and within 10% of fla's own error; u is not compared (not written).
"""

from __future__ import annotations

from benchmarks.stages.common import StageBench, chain_runs

# Beside the pin (sm_90a, K=128, V=256, no spills): BK=64 at 4 warps 174 registers (2 stages,
# 40 KB) and 180 (3 stages, 64 KB); BK=64 at 8 warps 97; BK=32 at 4 warps 89 (3 stages, 36 KB).
SWEEP = (dict(BK=64, num_warps=4, num_stages=2), dict(BK=64, num_warps=8, num_stages=2),
         dict(BK=32, num_warps=4, num_stages=3), dict(BK=64, num_warps=4, num_stages=3),
         dict(BK=32, num_warps=8, num_stages=2))


def wy_bytes(p) -> int:
    """The fewest bytes the stage moves without u: q, k (bf16), the cumsum (fp32), beta and
    Akk_inv (bf16, 64 a row) read once; w, qg and kg (bf16) written once."""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    return 2 * tok_h * p.K * 2 + tok_hv * p.K * 4 + tok_hv * 2 + tok_hv * 64 * 2 + 3 * tok_hv * p.K * 2


def make_inputs(p, device, seed: int = 0) -> dict:
    (f36, out), = chain_runs(p, device, seed, ("F3-F6",)).values()
    return dict(q=f36["q"], k=f36["k"], v=f36["v"], beta=f36["beta"], A=out[4], gc=f36["gc"], want_u=False,
                chunk_size=f36["chunk_size"], cu_seqlens=f36["cu_seqlens"], chunk_indices=f36["chunk_indices"])


def _without_u(out) -> tuple:
    return (out[0], None, out[2], out[3])


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    i = inputs
    return _without_u(ref.wy_fwd(i["k"], i["v"], i["beta"], i["A"], i["gc"], i["q"], i["chunk_size"], i["cu_seqlens"],
                                 exact=True))


def _ours(inputs, config):
    from kernel_fun.kda.kernels import b2_wy_recompute

    return b2_wy_recompute.wy_recompute(**inputs, config=config)


def _launch_config(p, overrides):
    from kernel_fun.kda.kernels import b2_wy_recompute

    return {**b2_wy_recompute.CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from benchmarks.parity import wy_misses

    return wy_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B2", label="wy", make_inputs=make_inputs, bytes=wy_bytes, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, fla_outputs=_without_u)
