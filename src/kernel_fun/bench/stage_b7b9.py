"""The B7-B9 unit's entry in the stage bench: B7 with B8 (dg's reverse chunk cumsum) and B9
(the gate's backward) in one launch (kda/kernels/intra_bwd.py's ``intra_bwd_tail``, the
chain's registered unit) against fla's three stages on the same inputs.

``python -m kernel_fun.bench.stage --stage B7-B9 --shapes prod8192_gate,prod8192_layer_safe``

Inputs: B7's (``stage_b7.make_inputs``) with the raw gate (bf16), A_log and dt_bias
initialised as Kimi-Linear does and the problem's lower bound. Timed beside ``--stage B7``
on the same shapes it separates what the tail costs in the pass from B7's own time
(prod8192_gate, the pin wide-halves-pf: the unit 8.93 ms, B7 alone 7.30; stages.jsonl at
3c7ec7f).
"""

from __future__ import annotations

import torch

from kernel_fun.bench import stage_b7
from kernel_fun.bench.stage import StageBench
from kernel_fun.bench.stage import main as _stage_main
from kernel_fun.kda.kernels import intra_bwd
from kernel_fun.kda.kernels.intra_bwd import PIN

# the pin (wide-halves-pf), the same with two-product dots (wide-halves-pf-x2), the pin
# without the prefetch, and the form without the half-chunk tier, at the same build
SWEEP = {d: [stage_b7.SWEEP[d][0]] for d in ("wide-halves-pf", "wide-halves-pf-x2", "wide-halves", "wide-chunk")}


def b7b9_bytes(p) -> int:
    """The fewest bytes the unit moves: B7's reads and the raw gate (bf16) read once; dq, dk
    and db written in fp32, the raw gate's gradient in its dtype (bf16)."""
    tok_hv = p.B * p.T * p.HV
    return stage_b7.b7_reads(p) + tok_hv * p.K * 2 + 2 * tok_hv * p.K * 4 + tok_hv * 4 + tok_hv * p.K * 2


def make_inputs(p, device, seed: int = 0) -> dict:
    x = stage_b7.make_inputs(p, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    B, T, HV, K = p.B, p.T, p.HV, p.K
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(HV * K, device=device).uniform_(-6.9, -2.3, generator=gen))
    return dict(x, g=torch.randn(B, T, HV, K, generator=gen, device=device).bfloat16(), A_log=A_log,
                dt_bias=dt + torch.log(-torch.expm1(-dt)), lower_bound=p.lower_bound)


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_intra_tail

    return _fla_intra_tail(**inputs)


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    b7 = {n: t for n, t in inputs.items() if n not in ("chunk_indices", "safe_gate", "g", "A_log", "dt_bias",
                                                         "lower_bound")}
    return ref.intra_bwd_tail(**b7, g=inputs["g"], A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
                              lower_bound=inputs["lower_bound"], exact=True)


def _ours(inputs, design, config):
    return intra_bwd.intra_bwd_tail(**inputs, **(config or intra_bwd.DEFAULT_CONFIG), design=design)


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import tail_misses

    return tail_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B7-B9", make_inputs=make_inputs, bytes=b7b9_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=stage_b7.BENCH.launch_config, misses=_misses, sweep=SWEEP, designs=(PIN,))


def main(argv=None) -> int:
    return _stage_main(argv, stage="B7-B9")


if __name__ == "__main__":
    raise SystemExit(main())
