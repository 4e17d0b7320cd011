"""Stage-bench entry of the B7-B10 unit: B7, B8, B9 and B10 in one launch (B7's kernel in
kda/kernels/intra_bwd.py with B10 by each chunk-head's last K slice, H == HV) against fla's
four stages on the same inputs.

``python -m kernel_fun.bench.stage --stage B7-B10 --shapes prod8192_gate,prod8192_layer_safe``

Inputs: B7's (stage_b7.make_inputs) with the raw gate (bf16), A_log and dt_bias initialised
as Kimi-Linear does, the problem's lower bound, and the reciprocal norms of q and k. Not
registered for users: no design ships until the H200 has measured one.
"""

from __future__ import annotations

import torch

from kernel_fun.bench import stage_b7
from kernel_fun.bench.stage import StageBench
from kernel_fun.bench.stage import main as _stage_main

# B7's default build; wide-halves, the candidate tier, at 4 warps (32- and 16-channel slices)
SWEEP = {"wide-chunk": [dict(BK=32, num_warps=4, num_stages=1)],
         "wide-halves": [dict(BK=32, num_warps=4, num_stages=1), dict(BK=16, num_warps=4, num_stages=1)]}


def b7b10_bytes(p) -> int:
    """The fewest bytes the unit moves: B7's reads, the raw gate and the two reciprocal norms
    read once; dq and dk written in q's dtype (bf16), db in fp32, the gate's gradient in the
    raw gate's dtype (bf16). (The kernel also writes and reads back the fp32 dq and dk its
    K slices leave for the last one: 2 x 4 bytes a channel more, mostly in L2.)"""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    reads = stage_b7.b7_reads(p) + tok_hv * p.K * 2 + 2 * tok_h * 4
    writes = 2 * tok_h * p.K * 2 + tok_hv * 4 + tok_hv * p.K * 2
    return reads + writes


def make_inputs(p, device, seed: int = 0) -> dict:
    if p.H != p.HV:
        raise ValueError("the B7-B10 unit takes H == HV only")
    x = stage_b7.make_inputs(p, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    B, T, H, HV, K = p.B, p.T, p.H, p.HV, p.K
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(HV * K, device=device).uniform_(-6.9, -2.3, generator=gen))
    rstd = lambda: torch.empty(B, T, H, device=device).uniform_(0.5, 2.0, generator=gen)  # noqa: E731
    return dict(x, g=torch.randn(B, T, HV, K, generator=gen, device=device).bfloat16(), A_log=A_log,
                dt_bias=dt + torch.log(-torch.expm1(-dt)), lower_bound=p.lower_bound, q_rstd=rstd(), k_rstd=rstd())


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_intra_l2

    return _fla_intra_l2(**inputs)


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    b7 = {n: t for n, t in inputs.items() if n not in ("chunk_indices", "safe_gate", "g", "A_log", "dt_bias",
                                                         "lower_bound", "q_rstd", "k_rstd")}
    out = list(ref.intra_bwd_tail(**b7, g=inputs["g"], A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
                                  lower_bound=inputs["lower_bound"], exact=True))
    out[0] = ref.l2norm_bwd(inputs["q"].double(), inputs["q_rstd"].double(), out[0])
    out[1] = ref.l2norm_bwd(inputs["k"].double(), inputs["k_rstd"].double(), out[1])
    return tuple(out)


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import intra_bwd

    return intra_bwd.intra_bwd_l2(**inputs, **(config or intra_bwd.DEFAULT_CONFIG), design=design)


def _launch_config(p, design, overrides):
    from kernel_fun.kda.kernels import intra_bwd

    if design not in intra_bwd.DESIGNS:
        raise ValueError(f"unknown B7 design {design!r}")
    return {**intra_bwd.DEFAULT_CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.parity import B7_BARS, bar_misses

    bars = {**B7_BARS, "dA_log": ref.BUDGETS["dA_log"], "ddt_bias": ref.BUDGETS["ddt_bias"]}
    return bar_misses(vs_exact, fla_exact, vs_fla, bars, bars)


BENCH = StageBench(stage="B7-B10", make_inputs=make_inputs, bytes=b7b10_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=())


def main(argv=None) -> int:
    return _stage_main(argv, stage="B7-B10")


if __name__ == "__main__":
    raise SystemExit(main())
