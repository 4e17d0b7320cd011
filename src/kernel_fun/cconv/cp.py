"""Context parallel for ``causal_conv1d``: fla's contract (``cp_context``), kernel-fun's
convolution. A rank's first local sequence may have begun on the rank before: its W - 1
tokens before the rank's first come from there, as the convolution's initial state (slot
W - 1 the token just before; at most as many as the sequence has there,
``pre_num_conv_tokens``). One all-gather of every rank's last W - 1 tokens carries them; the
backward returns the initial state's gradient the same way, added to those tokens' dx on the
rank before. Every rank calls both collectives. Handled: the contiguous layout of fla 0.5.2's
and 0.6's contexts and fla 0.6's zigzag layout (a rank's two runs, each with the run before
it in the chain: ``kernel_fun.kda.cp.parts``); an initial or final state with a context goes
to fla (fla's asserts)."""

from __future__ import annotations

import torch

from kernel_fun.kda.cp import gather_chain, parts


def _tail_rows(T: int, runs, W: int, part_len: int):
    """Each run's last W - 1 rows (fewer where the run is shorter): (start, end) a run."""
    ends = [T] if len(runs) == 1 else [part_len, T]
    starts = [0] if len(runs) == 1 else [0, part_len]
    return [(max(e - (W - 1), s), e) for s, e in zip(starts, ends)]


class _Halo(torch.autograd.Function):
    """x [1, T, D] -> the [N, D, W] initial state of the local sequences: in each run's first
    sequence's row, the run before's last tokens where the sequence continues from there
    (at most as many as it has there), zeros elsewhere."""

    @staticmethod
    def forward(fctx, x, W: int, N: int, ctx):
        runs = parts(ctx, N)
        T, D = x.shape[1], x.shape[2]
        rows = _tail_rows(T, runs, W, int(getattr(ctx, "part_len", 0) or 0))
        n_tail = min(e - s for s, e in rows)
        tails = torch.stack([x[0, e - n_tail:e] for _, e in rows])  # [P, n_tail, D]
        chain = gather_chain(tails, ctx.group)
        h0 = x.new_zeros(N, D, W)
        valid = []
        for r in runs:
            n = 0 if r.is_first else min(W - 1, r.pre_tokens, n_tail)
            if n:
                h0[r.first, :, W - n:] = chain[r.pos - 1, n_tail - n:].transpose(0, 1)
            valid.append(n)
        fctx.meta = (W, runs, valid, rows, n_tail, x.shape, ctx.group)
        return h0

    @staticmethod
    def backward(fctx, dh0):
        W, runs, valid, rows, n_tail, shape, group = fctx.meta
        d_init = dh0.new_zeros(len(runs), n_tail, shape[2])
        for i, (r, n) in enumerate(zip(runs, valid)):
            if n:
                d_init[i, n_tail - n:] = dh0[r.first, :, W - n:].transpose(0, 1)
        chain = gather_chain(d_init, group)
        dx = dh0.new_zeros(shape)
        for r, (_, e) in zip(runs, rows):
            if r.pos + 1 < chain.shape[0]:
                dx[0, e - n_tail:e] += chain[r.pos + 1]
        return dx, None, None, None


def halo_state(x3: torch.Tensor, W: int, ctx) -> torch.Tensor:
    """The local sequences' initial state from the runs before (``_Halo``)."""
    return _Halo.apply(x3, W, ctx.cu_seqlens.numel() - 1, ctx)
