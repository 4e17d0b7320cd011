"""B6's entry (the WY backward, ``kda/kernels/b6_wy_bwd.py``).

Inputs: random, of the magnitudes a real chain gives: unit q/k rows, a Kimi-style gate
cumsum, a unit-lower-triangular Akk_inv, h and dh in [K, V]. Parity (``parity.b6_misses``):
against fla's stage dq, dk, dv2 within 1e-4 relative RMS, db, dg, dA within fla's budgets;
against the float64 stage within the budgets and within 10% of fla's own error.
"""

from __future__ import annotations

import torch

from benchmarks.stages.common import StageBench, qk_and_gate

# The configs worth timing beside the pin (the sm_90a compile report: spills at every width,
# least at 8 warps).
SWEEP = (dict(BV=32, num_warps=8, num_stages=2), dict(BV=64, num_warps=8, num_stages=1),
         dict(BV=64, num_warps=8, num_stages=2), dict(BV=64, num_warps=16, num_stages=2),
         dict(BV=128, num_warps=8, num_stages=1), dict(BV=32, num_warps=16, num_stages=2))


def b6_bytes(p) -> int:
    """The fewest bytes B6 moves: every input read once, every output written once."""
    tok_h, tok_hv, nt = p.B * p.T * p.H, p.B * p.T * p.HV, p.B * -(-p.T // 64) * p.HV
    reads = 2 * tok_h * p.K * 2 + 4 * tok_hv * p.V * 2 + tok_hv * p.K * 4 + tok_hv * 2 + tok_hv * 64 * 2
    reads += 2 * nt * p.K * p.V * 2
    writes = 3 * tok_hv * p.K * 4 + tok_hv * p.V * 2 + tok_hv * 4 + tok_hv * 64 * 4
    return reads + writes


def make_inputs(p, device, seed: int = 0) -> dict:
    randn, q, k, gc = qk_and_gate(p, device, seed)
    B, T, HV, K, V = p.B, p.T, p.HV, p.K, p.V
    NT = -(-T // 64)
    r = torch.arange(64, device=device)
    A = torch.where(r[:, None] > r[None, :], randn(B, NT, HV, 64, 64, scale=0.1, dtype=torch.float32), 0.0)
    A = (A + torch.eye(64, device=device)).permute(0, 1, 3, 2, 4).reshape(B, NT * 64, HV, 64)[:, :T]
    return dict(
        q=q, k=k, v=randn(B, T, HV, V), v_new=randn(B, T, HV, V, scale=0.5), gc=gc,
        beta=torch.sigmoid(randn(B, T, HV, dtype=torch.float32)).bfloat16(), A=A.bfloat16().contiguous(),
        h=randn(B, NT, HV, K, V, scale=0.1), do=randn(B, T, HV, V), dh=randn(B, NT, HV, K, V, scale=0.1),
        dv=randn(B, T, HV, V), scale=K ** -0.5, chunk_size=64, cu_seqlens=None, chunk_indices=None,
        state_v_first=False,
    )


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    return ref.wy_dqkg_bwd(**{n: t for n, t in inputs.items() if n != "chunk_indices"}, exact=True)


def _ours(inputs, config):
    from kernel_fun.kda.kernels import b6_wy_bwd

    return b6_wy_bwd.wy_dqkg_bwd(**inputs, config=config)


def _launch_config(p, overrides):
    from kernel_fun.kda.kernels import b6_wy_bwd

    return b6_wy_bwd.launch_config(p.K, p.V, p.B * p.HV, overrides)


def _misses(vs_exact, fla_exact, vs_fla):
    from benchmarks.parity import b6_misses

    return b6_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B6", label="fullk", make_inputs=make_inputs, bytes=b6_bytes, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP)
