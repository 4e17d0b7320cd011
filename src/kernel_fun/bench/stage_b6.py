"""B6's entry in the stage bench (``kernel_fun.bench.stage``): its inputs, its bytes, the
configs worth timing, and its parity bars.

``python -m kernel_fun.bench.stage_b6 --shapes prod8192_gate,kimi --configs sweep`` (the same
as ``python -m kernel_fun.bench.stage --stage B6 ...``)

B6's inputs are random, of the magnitudes a real chain gives: unit q/k rows, a Kimi-style
gate cumsum (``bench.stage.qk_and_gate``), a unit-lower-triangular Akk_inv; h and dh in [K, V]. Parity
(``kda.parity.b6_misses``): against fla's stage dq, dk, dv2 within 1e-4 relative RMS, db,
dg, dA within fla's budgets; against the float64 stage without intermediate roundings
within the budgets and within 10% of fla's own error.
"""

from __future__ import annotations

import sys

import torch

from kernel_fun.bench.stage import StageBench, main as _stage_main, qk_and_gate

# The configs worth timing, chosen from the sm_90a compile report (tools/compile_report.py,
# docs/log/b6.md): fullk spills at every width, least at 8 warps.
SWEEP = {
    "fullk": [dict(BV=64, num_warps=8, num_stages=3),
              dict(BV=32, num_warps=8, num_stages=2), dict(BV=64, num_warps=8, num_stages=1),
              dict(BV=64, num_warps=8, num_stages=2), dict(BV=64, num_warps=16, num_stages=2),
              dict(BV=128, num_warps=8, num_stages=1), dict(BV=32, num_warps=16, num_stages=2)],
}


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


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_wy_dqkg

    return _fla_wy_dqkg(**inputs)


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    return ref.wy_dqkg_bwd(**{n: t for n, t in inputs.items() if n != "chunk_indices"}, exact=True)


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import wy_bwd

    return wy_bwd.wy_dqkg_bwd(**inputs, design=design, config=config)


def _launch_config(p, design, overrides):
    from kernel_fun.kda.kernels import wy_bwd

    return wy_bwd.launch_config(design, p.K, p.V, p.B * p.HV, overrides)


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import b6_misses

    return b6_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B6", make_inputs=make_inputs, bytes=b6_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=("fullk",))


def main(argv=None) -> int:
    return _stage_main(argv, stage="B6")


if __name__ == "__main__":
    sys.exit(main())
