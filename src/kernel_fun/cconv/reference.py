"""Torch references for the short causal convolution: the CPU path and the float64 oracle.

``conv_reference`` is the math, per token, in float32 (float64 when x
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


def _apply(stream, w, bias, T: int, activation, dtype):
    """The convolution over a stream [..., W + T, D] (the W state slots, then T rows of x):
    its T outputs, before the residual."""
    W = w.shape[1]
    z = sum(w[:, i] * stream[..., 1 + i:1 + i + T, :] for i in range(W))  # row t + 1 + i is x[t - W + 1 + i]
    if bias is not None:
        z = z + bias.to(w.dtype)
    if activation in ("silu", "swish"):
        z = F.silu(z) if dtype in (torch.float32, torch.float64) else _SiluRoundedGrad.apply(z, dtype)
    return z


def conv_reference(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                   activation=None, cu_seqlens=None):
    """(y in x's shape and dtype, the final state [N, D, W] in x's dtype or None): a dense
    batch at once, packed sequences one at a time."""
    shape = x.shape
    D, W = weight.shape
    x3 = x.reshape(shape[0], shape[1], D)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.to(cdt)

    def stream_of(xs, state):  # xs [..., T, D], state [..., D, W] or None
        head = state.to(cdt).transpose(-1, -2) if state is not None else xs.new_zeros(*xs.shape[:-2], W, D, dtype=cdt)
        return torch.cat([head, xs.to(cdt)], -2)

    if cu_seqlens is None:
        T = x3.shape[1]
        stream = stream_of(x3, initial_state)
        y = _apply(stream, w, bias, T, activation, x.dtype)
        final = stream[:, T:T + W].transpose(1, 2) if output_final_state else None
    else:
        bounds = cu_seqlens.tolist()
        ys, finals = [], []
        for n in range(len(bounds) - 1):
            xs = x3[0, bounds[n]:bounds[n + 1]]
            T = xs.shape[0]
            stream = stream_of(xs, initial_state[n] if initial_state is not None else None)
            ys.append(_apply(stream, w, bias, T, activation, x.dtype))
            finals.append(stream[T:T + W].t())
        y = torch.cat(ys, 0)[None]
        final = torch.stack(finals, 0) if output_final_state else None
    if residual is not None:
        y = y + residual.reshape(y.shape).to(cdt)
    return y.to(x.dtype).reshape(shape), (final.to(x.dtype) if final is not None else None)
