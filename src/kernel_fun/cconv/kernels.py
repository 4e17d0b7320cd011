"""The short convolution's forward and backward, each one pass over the tokens.

Replaces fla's ``causal_conv1d`` Triton kernels (0.5.2). fla's forward loads each [64, BD]
tile of x W times, once per tap, shifted by a row; its backward first re-runs the forward to
get the pre-activation (a full read of x and write of it), then loads dy and that
pre-activation W times each and evaluates the SiLU derivative W times an element.

This design: a program owns a strip of BD channels over a segment of TS tokens of one
sequence and walks the segment, each thread holding its channels' last three rows of x in
registers that shift by assignment, so a token costs one load of x, W multiply-adds, one
activation and one store (the taps padded to four). The backward walks the same way: z (the
pre-activation) is recomputed from the x it holds, g = dy * act'(z) once a token, and dx[t] =
sum_k w_k g[t + k] is emitted three tokens late from the last four g in registers; each
program writes its strip's dw and db over its own tokens as one partial, summed in a fixed
order afterwards (no atomics). The first segment of a sequence also forms dh0; the final
state's gradient lands on the last W tokens' dx. The loop takes eight tokens an iteration,
their loads issued together before their outputs and stores: the compiler cannot tell that x
and y do not overlap, so a load written after a store is never issued before it (a token at
a time, a memory latency a token: fwd+bwd 1.707 ms at D=2048 against 1.038).

Numerics: fp32 inside, the output rounded once to its dtype (bf16: round to nearest even);
sigmoid as 1 / (1 + exp2(-z log2 e)) with a fast reciprocal (a few ulp of fp32). The backward
takes SiLU's derivative at z rounded to x's dtype, as fla's does: y, dx and dweight within
1.4e-5, 1.7e-5 and 5e-6 of fla's in bf16 at D=2048, and their float64 errors fla's to three
digits.

Packed sequences: segments never cross a sequence's end. The (sequence, segment) list is
built on the device from ``cu_seqlens`` (a few small torch ops, no host copy or sync), its
length the host's bound ceil(tokens / TS) + N, the spare slots running no token; it is kept
per offsets tensor (``op.segments``), so a layer's q, k and v convolutions build it once.

Measured: the README's causal_conv1d table (fwd+bwd 2.8x fla's at D=2048 back to back, the
forward 1.14x its memory floor); the rounds, and the designs measured slower (a token at a
time, the next eight tokens' loads ahead, eight channels a lane), are in docs/log/cconv.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import to

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _sigmoid(z):
    return tl.fdiv(1.0, 1.0 + tl.exp2(-z * LOG2E), ieee_rounding=False)


@triton.jit
def _tap(w, o_d, m_d, W: tl.constexpr, k: tl.constexpr):
    """The weight of x[t - k] in y[t] for the strip's channels, fp32 (w[:, W - 1 - k]; 0
    for a tap past W)."""
    if k < W:
        return tl.load(w + o_d * W + (W - 1 - k), mask=m_d, other=0).to(tl.float32)
    return tl.zeros(o_d.shape, dtype=tl.float32)


@triton.jit
def _x_row(x, h0, r, n, T, o_d, m_d, stride_t, stride_d: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
           HAS_H0: tl.constexpr):
    """Row r of the sequence's x for the strip (fp32): x itself for 0 <= r < T, the initial
    state's slot W + r for -W < r < 0 (when given), else 0."""
    v = tl.load(x + r.to(tl.int64) * stride_t + o_d * stride_d, mask=m_d & (r >= 0) & (r < T), other=0).to(tl.float32)
    if HAS_H0:
        v += tl.load(h0 + n.to(tl.int64) * (D * W) + o_d * W + (W + r), mask=m_d & (r < 0) & (r > -W),
                     other=0).to(tl.float32)
    return v


@triton.jit
def _segment(i_s, i_b, seg_index, cu_seqlens, T, TS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence index, its first row in the flat token order, its length, the segment's
    first row within it)."""
    if IS_VARLEN:
        n = tl.load(seg_index + i_s * 2).to(tl.int32)
        s0 = tl.load(seg_index + i_s * 2 + 1).to(tl.int32) * TS
        # clamped to x's rows whatever the offsets hold (the op rejects bad ones before a launch)
        bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + n).to(tl.int64), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(cu_seqlens + n + 1).to(tl.int64), bos), T)
        T_seq = (eos - bos).to(tl.int32)
    else:
        n = i_b
        s0 = i_s * TS
        bos = i_b.to(tl.int64) * T
        T_seq = T
    return n, bos, T_seq, s0


@triton.jit
def _strip(x, w, h0, seg_index, cu_seqlens, T, stride_b, stride_t, stride_d: tl.constexpr, D: tl.constexpr,
           W: tl.constexpr, BD: tl.constexpr, TS: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr):
    """This program's strip and segment, both directions: (sequence, its first flat row, its
    length, the segment's rows s0 .. s1 - 1, the channels and their mask, x at the
    sequence's first row, the four taps, and x's three rows before s0)."""
    i_d, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, bos, T_seq, s0 = _segment(i_s, i_b, seg_index, cu_seqlens, T, TS, IS_VARLEN)
    s1 = tl.minimum(s0 + TS, T_seq)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x += i_b.to(tl.int64) * stride_b + (bos - i_b.to(tl.int64) * T) * stride_t  # dense: the batch's rows; packed: the sequence's
    w0 = _tap(w, o_d, m_d, W, 0)
    w1 = _tap(w, o_d, m_d, W, 1)
    w2 = _tap(w, o_d, m_d, W, 2)
    w3 = _tap(w, o_d, m_d, W, 3)
    xm1 = _x_row(x, h0, s0 - 1, n, T_seq, o_d, m_d, stride_t, stride_d, D, W, HAS_H0)
    xm2 = _x_row(x, h0, s0 - 2, n, T_seq, o_d, m_d, stride_t, stride_d, D, W, HAS_H0)
    xm3 = _x_row(x, h0, s0 - 3, n, T_seq, o_d, m_d, stride_t, stride_d, D, W, HAS_H0)
    return n, bos, T_seq, s0, s1, o_d, m_d, x, w0, w1, w2, w3, xm1, xm2, xm3


@triton.jit
def _ld8(ptr, t0, lim, stride_t, o_d, stride_d: tl.constexpr, m_d):
    """Rows t0 .. t0 + 7 of one strip (fp32; 0 at rows >= lim), all eight loads issued before anything that depends on them: a store between two
    loads would keep the second from being issued early (the compiler cannot tell that the
    tensors do not overlap)."""
    base = ptr + t0.to(tl.int64) * stride_t + o_d * stride_d
    r0 = tl.load(base, mask=m_d & (t0 < lim), other=0)
    r1 = tl.load(base + stride_t, mask=m_d & (t0 + 1 < lim), other=0)
    r2 = tl.load(base + 2 * stride_t, mask=m_d & (t0 + 2 < lim), other=0)
    r3 = tl.load(base + 3 * stride_t, mask=m_d & (t0 + 3 < lim), other=0)
    r4 = tl.load(base + 4 * stride_t, mask=m_d & (t0 + 4 < lim), other=0)
    r5 = tl.load(base + 5 * stride_t, mask=m_d & (t0 + 5 < lim), other=0)
    r6 = tl.load(base + 6 * stride_t, mask=m_d & (t0 + 6 < lim), other=0)
    r7 = tl.load(base + 7 * stride_t, mask=m_d & (t0 + 7 < lim), other=0)
    r0, r1, r2, r3 = r0.to(tl.float32), r1.to(tl.float32), r2.to(tl.float32), r3.to(tl.float32)
    r4, r5, r6, r7 = r4.to(tl.float32), r5.to(tl.float32), r6.to(tl.float32), r7.to(tl.float32)
    return r0, r1, r2, r3, r4, r5, r6, r7


@triton.jit
def _z(x0, xm1, xm2, xm3, w0, w1, w2, w3, b, HAS_BIAS: tl.constexpr):
    """The pre-activation of one token from its row and the three before it."""
    z = w0 * x0 + w1 * xm1 + w2 * xm2 + w3 * xm3
    if HAS_BIAS:
        z += b
    return z


@triton.jit
def _fwd_token(t, s1, x0, xm1, xm2, xm3, w0, w1, w2, w3, b, y, res, o_d, m_d, D: tl.constexpr,
               SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """y of token t; res its residual row (fp32, loaded by the caller) when HAS_RESIDUAL."""
    z = _z(x0, xm1, xm2, xm3, w0, w1, w2, w3, b, HAS_BIAS)
    if SILU:
        z = z * _sigmoid(z)
    p = t.to(tl.int64) * D + o_d
    live = m_d & (t < s1)
    if HAS_RESIDUAL:
        z += res
    tl.store(y + p, to(z, y.dtype.element_ty), mask=live)


@triton.jit
def causal_conv1d_fwd_kernel(
    x, w, bias, residual, h0, y, seg_index, cu_seqlens, T, stride_b, stride_t, stride_d: tl.constexpr,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, TS: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_H0: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """y = act(sum_k w_k x[t - k] + bias) + residual on one (strip, segment): x strided
    ([B, T, D] by stride_b, stride_t, stride_d; packed: B = 1), y and residual dense. The
    channel stride is a constant (1 for any x whose channels are dense, as a split of a fused
    projection's are), so the loads vectorize without relying on the launch's specialization."""
    n, bos, T_seq, s0, s1, o_d, m_d, x, w0, w1, w2, w3, xm1, xm2, xm3 = _strip(
        x, w, h0, seg_index, cu_seqlens, T, stride_b, stride_t, stride_d, D, W, BD, TS, HAS_H0, IS_VARLEN)
    y += bos * D
    if HAS_RESIDUAL:
        residual += bos * D
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0).to(tl.float32)
    bb = w0
    if HAS_BIAS:
        bb = b
    # eight tokens' loads issued together, then their outputs
    for t8 in range(s0, s1, 8):
        t0 = tl.cast(t8, tl.int32)  # a tensor in the interpreter too
        x0, x1, x2, x3, x4, x5, x6, x7 = _ld8(x, t0, s1, stride_t, o_d, stride_d, m_d)
        r0, r1, r2, r3, r4, r5, r6, r7 = x0, x1, x2, x3, x4, x5, x6, x7  # (unused without a residual)
        if HAS_RESIDUAL:
            r0, r1, r2, r3, r4, r5, r6, r7 = _ld8(residual, t0, s1, D, o_d, 1, m_d)
        xm1, xm2, xm3 = _fwd8(t0, s1, x0, x1, x2, x3, x4, x5, x6, x7, xm1, xm2, xm3, r0, r1, r2, r3, r4, r5,
                              r6, r7, w0, w1, w2, w3, bb, y, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _fwd8(t0, s1, x0, x1, x2, x3, x4, x5, x6, x7, xm1, xm2, xm3, r0, r1, r2, r3, r4, r5, r6, r7,
          w0, w1, w2, w3, bb, y, o_d, m_d, D: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
          HAS_RESIDUAL: tl.constexpr):
    """Tokens t0 .. t0 + 7 of the forward from their rows (fp32) and the three before; the
    rows the next eight read as their three before (xm1, xm2, xm3)."""
    _fwd_token(t0, s1, x0, xm1, xm2, xm3, w0, w1, w2, w3, bb, y, r0, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    _fwd_token(t0 + 1, s1, x1, x0, xm1, xm2, w0, w1, w2, w3, bb, y, r1, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    _fwd_token(t0 + 2, s1, x2, x1, x0, xm1, w0, w1, w2, w3, bb, y, r2, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    _fwd_token(t0 + 3, s1, x3, x2, x1, x0, w0, w1, w2, w3, bb, y, r3, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    _fwd_token(t0 + 4, s1, x4, x3, x2, x1, w0, w1, w2, w3, bb, y, r4, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    _fwd_token(t0 + 5, s1, x5, x4, x3, x2, w0, w1, w2, w3, bb, y, r5, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    _fwd_token(t0 + 6, s1, x6, x5, x4, x3, w0, w1, w2, w3, bb, y, r6, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    _fwd_token(t0 + 7, s1, x7, x6, x5, x4, w0, w1, w2, w3, bb, y, r7, o_d, m_d, D, SILU, HAS_BIAS, HAS_RESIDUAL)
    return x7, x6, x5


@triton.jit
def _bwd_g(x0, xm1, xm2, xm3, dy0, w0, w1, w2, w3, b, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
           ZT: tl.constexpr):
    """g = dy * act'(z) of one token (dy itself without the activation), the derivative taken
    at z rounded to x's dtype ZT (fla's rounding, below)."""
    g = dy0
    if SILU:
        z = to(_z(x0, xm1, xm2, xm3, w0, w1, w2, w3, b, HAS_BIAS), ZT).to(tl.float32)
        s = _sigmoid(z)
        g = g * (s * (1.0 + z * (1.0 - s)))
    return g


@triton.jit
def _bwd_token(t, s0, s1, T_seq, n, first, g, gm1, gm2, gm3, x0, xm1, xm2, xm3, w0, w1, w2, w3,
               dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
               HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr):
    """Token t's share of the strip's dw, db and dh0, and dx of token t - 3 (the last four
    g in hand); (g is 0 past the sequence: dy's load; a token past s1 + 2 feeds only masked
    rows)."""
    go = tl.where(t < s1, g, 0.0)
    dw0 += go * x0
    dw1 += go * xm1
    dw2 += go * xm2
    dw3 += go * xm3
    db += go
    if HAS_H0:
        # token t < W - 1 of the sequence reads slot c (x[c - W]) through tap t - c + W
        ft = first & (t < W - 1)
        if W > 1:
            dh1 += tl.where(ft & (t < 1), g * tl.where(t == 0, w3 if W == 4 else (w2 if W == 3 else w1), 0.0), 0.0)
        if W > 2:
            dh2 += tl.where(ft & (t < 2), g * tl.where(t == 0, w2 if W == 4 else w1, tl.where(t == 1, w3 if W == 4 else w2, 0.0)), 0.0)
        if W > 3:
            dh3 += tl.where(ft & (t < 3), g * tl.where(t == 0, w1, tl.where(t == 1, w2, w3)), 0.0)
    # dx for token r = t - 3: sum_k w_k g[r + k]
    r = t - 3
    acc = w0 * gm3 + w1 * gm2 + w2 * gm1 + w3 * g
    if HAS_DHT:
        # the final state's slot c = r - T + W holds x[r]
        c = r - T_seq + W
        acc += tl.load(dht + n.to(tl.int64) * (D * W) + o_d * W + c, mask=m_d & (c >= 0) & (c < W) & (r >= 0),
                       other=0).to(tl.float32)
    tl.store(dx + r.to(tl.int64) * D + o_d, to(acc, dx.dtype.element_ty), mask=m_d & (r >= s0) & (r < s1))
    return dw0, dw1, dw2, dw3, db, dh1, dh2, dh3


@triton.jit
def _bwd8(t0, s0, s1, T_seq, n, first, x0, x1, x2, x3, x4, x5, x6, x7, e0, e1, e2, e3, e4, e5, e6, e7,
          xm1, xm2, xm3, gm1, gm2, gm3, w0, w1, w2, w3, bb, dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d,
          D: tl.constexpr, W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
          HAS_DHT: tl.constexpr, ZT: tl.constexpr):
    """Tokens t0 .. t0 + 7 of the backward from their x and dy rows (fp32), the three rows
    and g before them: their shares of dw, db and dh0, dx of tokens t0 - 3 .. t0 + 4; the
    sums, then the three g and rows the next eight read."""
    g0 = _bwd_g(x0, xm1, xm2, xm3, e0, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    g1 = _bwd_g(x1, x0, xm1, xm2, e1, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    g2 = _bwd_g(x2, x1, x0, xm1, e2, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    g3 = _bwd_g(x3, x2, x1, x0, e3, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    g4 = _bwd_g(x4, x3, x2, x1, e4, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    g5 = _bwd_g(x5, x4, x3, x2, e5, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    g6 = _bwd_g(x6, x5, x4, x3, e6, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    g7 = _bwd_g(x7, x6, x5, x4, e7, w0, w1, w2, w3, bb, SILU, HAS_BIAS, ZT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0, s0, s1, T_seq, n, first, g0, gm1, gm2, gm3, x0, xm1, xm2, xm3, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0 + 1, s0, s1, T_seq, n, first, g1, g0, gm1, gm2, x1, x0, xm1, xm2, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0 + 2, s0, s1, T_seq, n, first, g2, g1, g0, gm1, x2, x1, x0, xm1, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0 + 3, s0, s1, T_seq, n, first, g3, g2, g1, g0, x3, x2, x1, x0, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0 + 4, s0, s1, T_seq, n, first, g4, g3, g2, g1, x4, x3, x2, x1, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0 + 5, s0, s1, T_seq, n, first, g5, g4, g3, g2, x5, x4, x3, x2, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0 + 6, s0, s1, T_seq, n, first, g6, g5, g4, g3, x6, x5, x4, x3, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    dw0, dw1, dw2, dw3, db, dh1, dh2, dh3 = _bwd_token(
        t0 + 7, s0, s1, T_seq, n, first, g7, g6, g5, g4, x7, x6, x5, x4, w0, w1, w2, w3,
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx, o_d, m_d, D, W, HAS_H0, HAS_DHT)
    gm3 = g5
    gm2 = g6
    gm1 = g7
    xm3 = x5
    xm2 = x6
    xm1 = x7
    return dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, gm3, gm2, gm1, xm3, xm2, xm1


@triton.jit
def causal_conv1d_bwd_kernel(
    x, w, bias, h0, dy, dht, dx, dw_part, db_part, dh0, seg_index, cu_seqlens, T,
    stride_b, stride_t, stride_d: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr,
    TS: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """dx on one (strip, segment), its partials of dw ([P, D, W] at program P) and db
    ([P, D]), and, on a sequence's first segment, dh0 [N, D, W] (slot 0 is 0: the forward
    never reads it). dy and dx dense, x strided as in the forward."""
    ZT: tl.constexpr = x.dtype.element_ty
    i_s, i_b = tl.program_id(1), tl.program_id(2)
    n, bos, T_seq, s0, s1, o_d, m_d, x, w0, w1, w2, w3, xm1, xm2, xm3 = _strip(
        x, w, h0, seg_index, cu_seqlens, T, stride_b, stride_t, stride_d, D, W, BD, TS, HAS_H0, IS_VARLEN)
    dy += bos * D
    dx += bos * D
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0).to(tl.float32)
    zero = tl.zeros([BD], dtype=tl.float32)
    gm1, gm2, gm3 = zero, zero, zero
    dw0, dw1, dw2, dw3, db = zero, zero, zero, zero, zero
    dh1, dh2, dh3 = zero, zero, zero  # the initial state's slots 1..3 (of W)
    first = s0 == 0
    # tokens s0 .. s1 + 2: g for every one, dx for t - 3 once t - 3 >= s0
    bb = w0
    if HAS_BIAS:
        bb = b
    # eight tokens' x and dy loads issued together, then their dx
    for t8 in range(s0, s1 + 3, 8):
        t0 = tl.cast(t8, tl.int32)  # a tensor in the interpreter too
        x0, x1, x2, x3, x4, x5, x6, x7 = _ld8(x, t0, T_seq, stride_t, o_d, stride_d, m_d)
        e0, e1, e2, e3, e4, e5, e6, e7 = _ld8(dy, t0, T_seq, D, o_d, 1, m_d)
        dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, gm3, gm2, gm1, xm3, xm2, xm1 = _bwd8(
            t0, s0, s1, T_seq, n, first, x0, x1, x2, x3, x4, x5, x6, x7, e0, e1, e2, e3, e4, e5, e6, e7,
            xm1, xm2, xm3, gm1, gm2, gm3, w0, w1, w2, w3, bb, dw0, dw1, dw2, dw3, db, dh1, dh2, dh3, dht, dx,
            o_d, m_d, D, W, SILU, HAS_BIAS, HAS_H0, HAS_DHT, ZT)
    seg = (i_b * tl.num_programs(1) + i_s).to(tl.int64)  # this program's partial (its strip's channels)
    part = dw_part + seg * (D * W) + o_d * W
    tl.store(part + (W - 1), dw0, mask=m_d)
    if W > 1:
        tl.store(part + (W - 2), dw1, mask=m_d)
    if W > 2:
        tl.store(part + (W - 3), dw2, mask=m_d)
    if W > 3:
        tl.store(part + (W - 4), dw3, mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + seg * D + o_d, db, mask=m_d)
    if HAS_H0:
        if first:
            if HAS_DHT:
                # a sequence shorter than W: final slot c holds the initial state's slot c + T
                base = dht + n.to(tl.int64) * (D * W) + o_d * W
                if W > 1:
                    dh1 += tl.load(base + (1 - T_seq), mask=m_d & (1 - T_seq >= 0), other=0).to(tl.float32)
                if W > 2:
                    dh2 += tl.load(base + (2 - T_seq), mask=m_d & (2 - T_seq >= 0), other=0).to(tl.float32)
                if W > 3:
                    dh3 += tl.load(base + (3 - T_seq), mask=m_d & (3 - T_seq >= 0), other=0).to(tl.float32)
            out = dh0 + n.to(tl.int64) * (D * W) + o_d * W
            tl.store(out, zero.to(dh0.dtype.element_ty), mask=m_d)
            if W > 1:
                tl.store(out + 1, to(dh1, dh0.dtype.element_ty), mask=m_d)
            if W > 2:
                tl.store(out + 2, to(dh2, dh0.dtype.element_ty), mask=m_d)
            if W > 3:
                tl.store(out + 3, to(dh3, dh0.dtype.element_ty), mask=m_d)


# Pinned: strips of 256 channels at 2 warps (8 bytes a lane a row in bf16), segments of 256
# tokens: the best fwd+bwd of the bench's sweep at d2048 (back to back 0.787 ms; 4 warps
# 0.815, 512 channels at 4 warps 0.795, 128 at 1 warp 0.813, 1024-token segments 0.804,
# 8 channels a lane 0.886 and 0.870; the forwards within 0.288-0.325; docs/log/cconv.md).
# sm_90a (D=2048, bf16, W=4, SiLU, x dense as a launch specializes it: 8-byte loads and
# stores): the forward 60 registers, the backward 128, no spills; a strided x whose token
# stride is not a multiple of 16 loads 2 bytes a lane.
DEFAULT_CONFIG = dict(BD=256, TS=256, num_warps=2)
W_MAX = 4  # the register ring holds four taps


class use_config:
    """``with use_config(BD=..., ...)``: calls of ``causal_conv1d`` made inside launch with
    this config (their backward too, wherever it runs); the bench's sweep."""

    def __init__(self, **config):
        self.config = config

    def __enter__(self):
        self.saved = dict(DEFAULT_CONFIG)
        DEFAULT_CONFIG.update(self.config)

    def __exit__(self, *exc):
        DEFAULT_CONFIG.clear()
        DEFAULT_CONFIG.update(self.saved)


def segment_index(cu_seqlens: torch.Tensor, total: int, TS: int) -> torch.Tensor:
    """[S, 2] int32 (sequence, segment) pairs of packed sequences cut into TS-token
    segments, built on the device from the offsets alone (no host copy, no sync). S is the
    bound ceil(total / TS) + N known on the host; the slots past the real segments map to
    the last sequence at a segment past its end, whose programs run no token (and write
    zero partials)."""
    cu = cu_seqlens.long()
    counts = ((cu[1:] - cu[:-1]).clamp(min=0) + TS - 1) // TS
    ends = counts.cumsum(0)
    slot = torch.arange(-(-total // TS) + counts.numel(), device=cu.device)
    n = torch.searchsorted(ends, slot, right=True).clamp_(max=counts.numel() - 1)
    return torch.stack((n, slot - (ends - counts)[n]), 1).to(torch.int32)


def _grid_segments(x3, cu_seqlens, seg_index, TS):
    if cu_seqlens is None:
        return triton.cdiv(x3.shape[1], TS), x3.shape[0]
    return seg_index.shape[0], 1


def conv_fwd(x3, weight, bias, residual, initial_state, silu, cu_seqlens, seg_index, TS, config=None):
    """y [B, T, D] (dense, x's dtype) from x3 [B, T, D] of any strides."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    B, T, D = x3.shape
    W = weight.shape[1]
    y = torch.empty(B, T, D, device=x3.device, dtype=x3.dtype)
    NS, NB = _grid_segments(x3, cu_seqlens, seg_index, TS)
    causal_conv1d_fwd_kernel[(triton.cdiv(D, cfg["BD"]), NS, NB)](
        x3, weight, bias, residual, initial_state, y, seg_index, cu_seqlens, T, *x3.stride(),
        D=D, W=W, BD=cfg["BD"], TS=TS, SILU=silu, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, HAS_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        num_warps=cfg["num_warps"],
    )
    return y


def conv_bwd(x3, weight, bias, initial_state, dy, dht, silu, cu_seqlens, seg_index, TS, want_dh0, config=None):
    """(dx [B, T, D] in x's dtype, dw in the weight's dtype, db in the bias's or None, dh0 in
    the initial state's or None)."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    B, T, D = x3.shape
    W = weight.shape[1]
    NS, NB = _grid_segments(x3, cu_seqlens, seg_index, TS)
    dx = torch.empty(B, T, D, device=x3.device, dtype=x3.dtype)
    dw_part = torch.empty(NB * NS, D, W, device=x3.device, dtype=torch.float32)
    db_part = torch.empty(NB * NS, D, device=x3.device, dtype=torch.float32) if bias is not None else None
    # zeros: a packed sequence of no tokens has no segment (its dh0 is the final state's gradient alone)
    dh0 = torch.zeros_like(initial_state) if initial_state is not None else None
    causal_conv1d_bwd_kernel[(triton.cdiv(D, cfg["BD"]), NS, NB)](
        x3, weight, bias, initial_state, dy, dht, dx, dw_part, db_part, dh0, seg_index, cu_seqlens, T, *x3.stride(),
        D=D, W=W, BD=cfg["BD"], TS=TS, SILU=silu, HAS_BIAS=bias is not None,
        HAS_H0=initial_state is not None, HAS_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
        num_warps=cfg["num_warps"],
    )
    if dh0 is not None and dht is not None and cu_seqlens is not None:
        empty = (cu_seqlens[1:] == cu_seqlens[:-1])[:, None, None]  # its final state is its initial state
        dh0 = torch.where(empty, dht.to(dh0.dtype), dh0)
    dw = dw_part.sum(0).to(weight.dtype)  # the partials in a fixed order: deterministic
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db, (dh0 if want_dh0 else None)
