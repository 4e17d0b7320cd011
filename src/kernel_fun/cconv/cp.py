"""Context parallel for ``causal_conv1d``: fla's contract (``cp_context``), kernel-fun's
convolution. A rank's first local sequence may have begun on the rank before: its W - 1
tokens before the rank's first come from there, as the convolution's initial state (slot
W - 1 the token just before; at most as many as the sequence has there,
``pre_num_conv_tokens``). One all-gather of every rank's last W - 1 tokens carries them; the
backward returns the initial state's gradient the same way, added to those tokens' dx on the
rank before. Every rank calls both collectives. Handled: the contiguous layout of fla 0.5.2's
and 0.6's contexts; fla 0.6's zigzag layout goes to fla, as do an initial or final state
with a context (fla's asserts)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernel_fun.kda.cp import all_gather


def unsupported(ctx, initial_state, output_final_state) -> str | None:
    layout = getattr(ctx, "layout", "contiguous")
    if layout != "contiguous":
        return f"cp_context with layout={layout!r} (kernel-fun takes the contiguous layout)"
    if getattr(ctx, "group", None) is None or getattr(ctx, "cu_seqlens", None) is None:
        return "cp_context without a process group or cu_seqlens (fla's own check)"
    if initial_state is not None or output_final_state:
        return "cp_context with an initial or final state (fla's own check)"
    if not dist.is_available() or not dist.is_initialized():
        return "cp_context without an initialized torch.distributed"
    return None


class _Halo(torch.autograd.Function):
    """x [1, T, D] -> the [N, D, W] initial state of the local sequences: the rank before's
    last tokens in row 0 where the first sequence continues from there, zeros elsewhere."""

    @staticmethod
    def forward(fctx, x, W: int, N: int, ctx):
        group = ctx.group
        rank = dist.get_rank(group)
        D = x.shape[2]
        tails = x[0, max(x.shape[1] - (W - 1), 0):]
        gathered = all_gather(tails, group)
        h0 = x.new_zeros(N, D, W)
        valid = 0 if ctx.is_first_rank else min(W - 1, int(ctx.pre_num_conv_tokens), tails.shape[0])
        if valid:
            h0[0, :, W - valid:] = gathered[rank - 1, tails.shape[0] - valid:].transpose(0, 1)
        fctx.meta = (W, valid, rank, tails.shape[0], x.shape, group)
        return h0

    @staticmethod
    def backward(fctx, dh0):
        W, valid, rank, n_tail, shape, group = fctx.meta
        d_init = dh0.new_zeros(n_tail, shape[2])
        if valid:
            d_init[n_tail - valid:] = dh0[0, :, W - valid:].transpose(0, 1)
        gathered = all_gather(d_init, group)
        dx = dh0.new_zeros(shape)
        if rank + 1 < gathered.shape[0]:
            dx[0, shape[1] - n_tail:] = gathered[rank + 1]
        return dx, None, None, None


def halo_state(x3: torch.Tensor, W: int, ctx) -> torch.Tensor:
    """The local sequences' initial state from the rank before (``_Halo``)."""
    return _Halo.apply(x3, W, ctx.cu_seqlens.numel() - 1, ctx)
