"""The B7-B9 unit's entry (``kda/kernels/b7_b9_intra_bwd.py``): B7 with B8 (dg's reverse chunk
cumsum) and B9 (the gate's backward) in one launch, against fla's three stages in turn.

Inputs: random, of the magnitudes a real chain gives: unit q/k rows, a Kimi-style gate
cumsum, beta in (0, 1), fp32 dAqk/dAkk with B6's zeros (dAqk above the diagonal, dAkk on and
above it), the dq, dk, db, dg B6 hands on, and the raw gate (bf16) with A_log and dt_bias
initialised as Kimi-Linear does and the problem's lower bound. Parity
(``parity.tail_misses``): fla's budgets against fla's stages and the float64 stages, and
within 10% of fla's own error.
"""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.stages.common import StageBench, qk_and_gate
from kernel_fun.kda.problems import dt_bias_init

# Beside the pin: 16-channel K slices (no spills, twice the programs) and 8 warps.
SWEEP = (dict(BK=16, num_warps=4, num_stages=1), dict(BK=32, num_warps=8, num_stages=1))


def b7_reads(p) -> int:
    """The bytes B7 reads at the fewest: q, k, gc, beta, dAqk, dAkk and the incoming dq, dk,
    db, dg once each."""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    return 2 * tok_h * p.K * 2 + tok_hv * p.K * 4 + tok_hv * 2 + 2 * tok_hv * 64 * 4 + 3 * tok_hv * p.K * 4 + tok_hv * 4


def b7_bytes(p) -> int:
    """The fewest bytes B7 alone moves: its reads, and dq, dk, db, dg (fp32) written once."""
    tok_hv = p.B * p.T * p.HV
    return b7_reads(p) + 3 * tok_hv * p.K * 4 + tok_hv * 4


def b7b9_bytes(p) -> int:
    """The fewest bytes the unit moves: B7's reads and the raw gate (bf16) read once; dq, dk
    and db written in fp32, the raw gate's gradient in its dtype (bf16)."""
    tok_hv = p.B * p.T * p.HV
    return b7_reads(p) + tok_hv * p.K * 2 + 2 * tok_hv * p.K * 4 + tok_hv * 4 + tok_hv * p.K * 2


def make_inputs(p, device, seed: int = 0) -> dict:
    randn, q, k, gc = qk_and_gate(p, device, seed)
    B, T, HV, K = p.B, p.T, p.HV, p.K
    f32 = torch.float32
    # dA as B6 writes it: zero above the diagonal, and dAkk on it too (Akk is strictly lower).
    # fla's B7 reads dAkk's diagonal and relies on that zero; ours reads only s < r.
    pos = torch.arange(T, device=device) % 64
    col = torch.arange(64, device=device)
    lower = (col[None, :] <= pos[:, None]).view(1, T, 1, 64)
    strict = (col[None, :] < pos[:, None]).view(1, T, 1, 64)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(HV * K, device=device).uniform_(-6.9, -2.3, generator=gen))
    return dict(
        q=q, k=k, gc=gc, beta=torch.sigmoid(randn(B, T, HV, dtype=f32)).bfloat16(),
        dAqk=randn(B, T, HV, 64, scale=0.1, dtype=f32) * lower,
        dAkk=randn(B, T, HV, 64, scale=0.1, dtype=f32) * strict,
        dq=randn(B, T, HV, K, dtype=f32), dk=randn(B, T, HV, K, dtype=f32), db=randn(B, T, HV, dtype=f32),
        dg=randn(B, T, HV, K, dtype=f32), safe_gate=p.safe_gate,
        g=torch.randn(B, T, HV, K, generator=gen, device=device).bfloat16(), A_log=A_log,
        dt_bias=dt_bias_init(dt, p.strong_gate), lower_bound=p.lower_bound,
        chunk_size=64, cu_seqlens=None, chunk_indices=None,
    )


# The level counts ``level_shares`` reports, by ``levels``' value (4 and more together).
LEVEL_NAMES = ("1 level", "2 levels", "3 levels", "4+ levels")


def levels(gc: torch.Tensor, guard: float | None = None, BK: int = 32) -> torch.Tensor:
    """How many levels each (batch, chunk, value head, K slice) program takes, as the kernel's
    loop counts them, from the chunk cumsum [B, T, HV, K] of a dense batch (the kernel's
    arithmetic in torch, fp32): per channel a level runs from its first row u to the first
    row whose factor through the level's anchor (row u's gate, less ``guard`` for the first
    level) leaves 2^+-guard; the program loops until every channel of its slice is done."""
    from kernel_fun._triton import GUARD_SPAN

    guard = float(GUARD_SPAN.value) if guard is None else guard
    B, T, HV, K = gc.shape
    out = torch.zeros(B, -(-T // 64), HV, -(-K // BK), dtype=torch.long, device=gc.device)
    for i_c in range(out.shape[1]):
        x = gc[:, 64 * i_c:64 * i_c + 64].float()
        n_t = x.shape[1]
        x = torch.nn.functional.pad(x, (0, out.shape[3] * BK - K)).unflatten(3, (-1, BK))  # [B, n_t, HV, NK, BK]
        real = (torch.arange(out.shape[3] * BK, device=x.device) < K).view(out.shape[3], BK)
        u = torch.where(real, 0, n_t).expand(B, HV, -1, -1).clone()  # [B, HV, NK, BK]
        shift = guard
        rows = torch.arange(n_t, device=x.device).view(1, n_t, 1, 1, 1)
        while (u.amin(-1) < n_t).any():
            out[:, i_c] += (u.amin(-1) < n_t).long()
            a = torch.gather(x, 1, u.clamp(max=n_t - 1).unsqueeze(1)).squeeze(1) - shift
            past = (rows > u.unsqueeze(1)) & real & ((a.unsqueeze(1) - x).abs() > guard)
            u = torch.where(past, rows, n_t).amin(1)
            shift = 0.0
    return out


def level_shares(gc: torch.Tensor, BK: int = 32) -> dict:
    """The share of programs taking each count of levels (names as ``LEVEL_NAMES``)."""
    n = levels(gc, BK=BK).clamp(max=len(LEVEL_NAMES))
    return {name: (n == i + 1).float().mean().item() for i, name in enumerate(LEVEL_NAMES)}


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    b7 = {n: t for n, t in inputs.items() if n not in ("chunk_indices", "safe_gate", "g", "A_log", "dt_bias",
                                                         "lower_bound")}
    return ref.intra_bwd_tail(**b7, g=inputs["g"], A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
                              lower_bound=inputs["lower_bound"], exact=True)


def _ours(inputs, config):
    from kernel_fun.kda.kernels import b7_b9_intra_bwd

    return b7_b9_intra_bwd.intra_bwd(**inputs, config=config)


def _launch_config(p, overrides):
    from kernel_fun.kda.kernels import b7_b9_intra_bwd

    return {**b7_b9_intra_bwd.CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from benchmarks.parity import tail_misses

    return tail_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B7-B9", label="wide-halves-pf", make_inputs=make_inputs, bytes=b7b9_bytes, exact=_exact,
                   ours=_ours, launch_config=_launch_config, misses=_misses, sweep=SWEEP)


def _declines_sm90(inputs):
    from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90

    return b7_b10_intra_bwd_sm90.supports(**inputs)


def _ours_sm90(inputs, config):
    from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90

    why = _declines_sm90(inputs)
    if why:  # (a row that says so, never the Triton unit's time under this kernel's name)
        raise RuntimeError(f"B7-B9's CuTe kernel declines: {why}")
    return b7_b10_intra_bwd_sm90.intra_bwd(**inputs)


# B7-B9's CuTe DSL kernel (``kda/kernels/b7_b10_intra_bwd_sm90.py``), what B7-B9's ``ours`` runs on
# an sm_90 GPU with the sm90 extra: the same inputs, bytes and bars; one pinned build, compiled in
# the bench's process.
BENCH_SM90 = dataclasses.replace(BENCH, key="B7-B9-sm90", label="cute-sm90", ours=_ours_sm90,
                                 launch_config=lambda p, overrides: {}, sweep=(), precompile=False,
                                 declines=_declines_sm90)
