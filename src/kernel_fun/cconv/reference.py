"""Torch references for the short causal convolution: the CPU path and the float64 oracle.

``conv_reference`` is the math, token by token per sequence, in float32 (float64 when x
is float64: the oracle; every gradient from torch autograd through it):

    y[t, d] = act(sum_i w[d, i] x[t - (W - 1) + i, d] + bias[d]) + residual[t, d]

with x[j] for j < 0 read from the initial state's slot W + j (zero without one), act SiLU
or none; the final state [N, D, W] holds each sequence's last W rows of that stream
(slot W - 1 the last token; the initial state's slots where the sequence is shorter
than W). Outputs in x's dtype. For a bf16 or fp16 x the float32 path takes SiLU's
derivative at z rounded to x's dtype, as fla's backward does (it re-runs the forward
without the activation and reads that pre-activation back in x's dtype) and as the kernels
do; the float64 oracle takes it at z itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SiluRoundedGrad(torch.autograd.Function):
    """SiLU whose backward takes the derivative at z rounded to ``dtype``."""

    @staticmethod
    def forward(ctx, z, dtype):
        ctx.save_for_backward(z)
        ctx.dtype = dtype
        return F.silu(z)

    @staticmethod
    def backward(ctx, dy):
        (z,) = ctx.saved_tensors
        zr = z.to(ctx.dtype).to(z.dtype)
        s = torch.sigmoid(zr)
        return dy * (s * (1 + zr * (1 - s))), None


def _sequences(x3: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """(sequence index, its [T_n, D] rows) for a dense batch or a packed one."""
    if cu_seqlens is None:
        for b in range(x3.shape[0]):
            yield b, slice(None), x3[b]
    else:
        bounds = cu_seqlens.tolist()
        for n in range(len(bounds) - 1):
            yield n, slice(bounds[n], bounds[n + 1]), x3[0, bounds[n]:bounds[n + 1]]


def conv_reference(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                   activation=None, cu_seqlens=None):
    """(y in x's shape and dtype, the final state [N, D, W] in x's dtype or None)."""
    shape = x.shape
    D, W = weight.shape
    x3 = x.reshape(shape[0], shape[1], D)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.to(cdt)
    ys, finals, rows = [], [], []
    for n, rows_n, xs in _sequences(x3, cu_seqlens):
        xs = xs.to(cdt)
        T = xs.shape[0]
        if initial_state is not None:
            stream = torch.cat([initial_state[n].to(cdt).t(), xs], 0)  # [W + T, D]: slots 0..W-1, then x
        else:
            stream = torch.cat([xs.new_zeros(W, D), xs], 0)
        z = sum(w[:, i] * stream[1 + i:1 + i + T] for i in range(W))  # row t + 1 + i of the stream is x[t - W + 1 + i]
        if bias is not None:
            z = z + bias.to(cdt)
        if activation in ("silu", "swish"):
            z = F.silu(z) if x.dtype in (torch.float32, torch.float64) else _SiluRoundedGrad.apply(z, x.dtype)
        ys.append(z)
        rows.append(rows_n)
        if output_final_state:
            finals.append(stream[T:T + W].t())
    if cu_seqlens is None:
        y = torch.stack(ys, 0)
    else:
        y = torch.cat(ys, 0)[None]
    if residual is not None:
        y = y + residual.reshape(y.shape).to(cdt)
    final = torch.stack(finals, 0).to(x.dtype) if output_final_state else None
    return y.to(x.dtype).reshape(shape), final
