"""A candidate for the forward prep's core (F3-F5): the intra-chunk scores and the solve on
16x16 blocks, one program per (chunk, value head). Not registered; the design and its
prediction are in docs/log/prep.md ("The next design").

- Aqk and Akk by row block r (rows 16r..16r+15). The off-diagonal blocks are [16, BK] x
  [BK, 16] dots per K slice and column block, anchored at the row block's first row a:
  q_r 2^(g_r - g_a) against k_s 2^(g_a - g_s) for s < a, both factors at most 1 for any gate.
- The diagonal block is anchored at the block's middle row m (clamped to the chunk's last
  row). Every factor there is at most 2^span, where span = g_a - g_last is the block's decay
  in that K slice. While span <= SPAN_MAX (B7's GUARD_SPAN, 64) that is one dot;
  beyond it, the block's slice takes the element-wise form, one row at a time.
- The solve (I + Akk)^-1: each diagonal block's inverse by the Neumann product
  (I - D)(I + D^2)(I + D^4)(I + D^8), exact for a strictly lower 16x16 D, then block
  forward substitution, X_rc = -X_rr sum_c<=j<r A_rj X_jc: every operand a [16, 16] tile
  (two registers a thread at 4 warps), written out block by block.

``intra16(q, k, gc, beta, scale)`` -> (Aqk, Akk_inv): ``kernel_fun.kda.reference.intra_scores``'s
contract (dense batches, chunk 64; q and k already normalized, gc the log2 chunk cumsum).
Modes of the same program, each a constexpr:

- F6 (``v=``): w, u, kg and qg from the inverse's blocks still in registers.
- F2 in front (``g_raw=``): the gate's activation (or a given log-decay) and the chunk
  cumsum, written to gc and read back after a barrier.
- F1 in front (``l2norm=True``): each row's rstd into a per-(token, value head) scratch,
  every q/k load normalized and rounded to the input dtype on the way in (as F1's output
  is); the first value head of a group writes F1's outputs (q, k at q/k heads, the rstds),
  so GVA groups never race on them.
- B1-B2 (``Akk_inv=`` given): the inverse's blocks read from the saved Akk_inv, gc and the
  WY vectors recomputed, no scores.

``f1_f6`` and ``b1_b2`` are the chain's F1-F6 and B1-B2 units on this program (candidates).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernel_fun._triton import GUARD_SPAN, chunk_coords, to

SPAN_MAX = GUARD_SPAN.value  # (B7's anchor bound: factors within 2^+-64)


@triton.jit
def _neumann_inverse(D):
    """(I + D)^-1 for a strictly lower [16, 16] D (fp32): (I - D)(I + D^2)(I + D^4)(I + D^8)."""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    D2 = tl.dot(D, D)
    D4 = tl.dot(D2, D2)
    D8 = tl.dot(D4, D4)
    X = tl.dot(eye - D, eye + D2)
    X = tl.dot(X, eye + D4)
    return tl.dot(X, eye + D8)


@triton.jit
def _diag_elementwise(acc_q, acc_k, q_r, k_r, g_r, t16, m_r):
    """The diagonal block's slice term by term: row i's scores against the block's rows s <= i
    (strictly below for Akk), each with its own exp2(g_i - g_s); rows past the chunk's end
    get zeros (their gate is no gate: they must stay finite for the solve's products)."""
    for i in range(16):
        sel = (t16 == i)[:, None]
        q_i = tl.sum(tl.where(sel, q_r, 0.0), axis=0)
        k_i = tl.sum(tl.where(sel, k_r, 0.0), axis=0)
        g_i = tl.sum(tl.where(sel, g_r, 0.0), axis=0)
        live = tl.sum(tl.where(t16 == i, m_r.to(tl.int32), 0)) > 0
        lower = ((t16 <= i) & m_r & live)[:, None]
        e = tl.where(lower, tl.exp2(tl.where(lower, g_i[None, :] - g_r, 0.0)), 0.0) * k_r
        row_q = tl.sum(q_i[None, :] * e, axis=1)
        row_k = tl.sum(k_i[None, :] * e, axis=1)
        at = (t16 == i)[:, None]
        acc_q = tl.where(at, acc_q + row_q[None, :], acc_q)
        acc_k = tl.where(at, acc_k + row_k[None, :], acc_k)
    return acc_q, acc_k


@triton.jit
def _qk(ptr, rs, rows, m_rows, cols, m_c, STRIDE: tl.constexpr, NORM: tl.constexpr, WHICH: tl.constexpr,
        HV: tl.constexpr):
    """Rows of q or k (fp32). With NORM, the raw rows times their rstd (this program's scratch
    ``rs``: [token, HV, 2] fp32, q's then k's), rounded to the input dtype as F1 writes them."""
    m = m_rows[:, None] & m_c[None, :]
    x = tl.load(ptr + rows[:, None] * STRIDE + cols[None, :], mask=m, other=0).to(tl.float32)
    if NORM:
        r = tl.load(rs + rows * (HV * 2) + WHICH, mask=m_rows, other=0)
        x = to(x * r[:, None], ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _pair(q, k, g, rs, n_t, R: tl.constexpr, C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
          BK: tl.constexpr, SPAN: tl.constexpr, NORM: tl.constexpr):
    """The [16, 16] blocks (row block R, column block C <= R) of Aqk (unscaled) and Akk (no
    beta), every K slice summed; the diagonal (R == C) with both triangles, masked later."""
    t16 = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    rows = R * 16 + t16
    m_r = rows < n_t
    a = R * 16
    acc_q = tl.zeros([16, 16], dtype=tl.float32)
    acc_k = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in tl.static_range(0, K, BK):
        cols = i_k + o_k
        m_c = cols < K
        m_rc = m_r[:, None] & m_c[None, :]
        q_r = _qk(q, rs, rows, m_r, cols, m_c, H * K, NORM, 0, HV)
        k_r = _qk(k, rs, rows, m_r, cols, m_c, H * K, NORM, 1, HV)
        g_r = tl.load(g + rows[:, None] * (HV * K) + cols[None, :], mask=m_rc, other=0).to(tl.float32)
        # (a block past the chunk's end anchors at its last row: every factor stays at most 1)
        g_a = tl.load(g + tl.minimum(a, n_t - 1) * (HV * K) + cols, mask=m_c, other=0).to(tl.float32)
        if C < R:  # anchored at the row block's first row: both factors at most 1
            rows_c = C * 16 + t16
            m_s = (rows_c < n_t)[:, None] & m_c[None, :]
            k_c = _qk(k, rs, rows_c, rows_c < n_t, cols, m_c, H * K, NORM, 1, HV)
            g_c = tl.load(g + rows_c[:, None] * (HV * K) + cols[None, :], mask=m_s, other=0).to(tl.float32)
            down = tl.exp2(tl.where(m_rc, g_r - g_a[None, :], float("-inf")))
            kb = tl.trans(k_c * tl.exp2(tl.where(m_s, g_a[None, :] - g_c, float("-inf"))))
            acc_q += tl.dot(q_r * down, kb)
            acc_k += tl.dot(k_r * down, kb)
        else:  # the diagonal block: anchored at its middle row while the span allows
            last = tl.minimum(a + 15, n_t - 1)
            g_last = tl.load(g + last * (HV * K) + cols, mask=m_c, other=0).to(tl.float32)
            if tl.max(g_a - g_last) <= SPAN:
                mid = tl.minimum(a + 8, n_t - 1)
                g_m = tl.load(g + mid * (HV * K) + cols, mask=m_c & (a < n_t), other=0).to(tl.float32)
                up = tl.exp2(tl.where(m_rc, g_r - g_m[None, :], float("-inf")))
                back = tl.trans(k_r * tl.exp2(tl.where(m_rc, g_m[None, :] - g_r, float("-inf"))))
                acc_q += tl.dot(q_r * up, back)
                acc_k += tl.dot(k_r * up, back)
            else:
                acc_q, acc_k = _diag_elementwise(acc_q, acc_k, q_r, k_r, g_r, t16, m_r)
    return acc_q, acc_k


@triton.jit
def _store_block(ptr, R: tl.constexpr, C: tl.constexpr, x, n_t, HV: tl.constexpr):
    t16 = tl.arange(0, 16)
    rows = R * 16 + t16
    tl.store(ptr + rows[:, None] * (HV * 64) + (C * 16 + t16)[None, :], to(x, ptr.dtype.element_ty),
             mask=(rows < n_t)[:, None])


@triton.jit
def _scores_row(q, k, g, rs, Aqk, scale, n_t, R: tl.constexpr, C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr, NORM: tl.constexpr):
    """Aqk's block (R, C) stored, Akk's returned (no beta yet)."""
    t16 = tl.arange(0, 16)
    bq, bk = _pair(q, k, g, rs, n_t, R, C, H, HV, K, BK, SPAN, NORM)
    if C == R:
        bq = tl.where(t16[:, None] >= t16[None, :], bq, 0.0)
        bk = tl.where(t16[:, None] > t16[None, :], bk, 0.0)
    _store_block(Aqk, R, C, bq * scale, n_t, HV)
    return bk


@triton.jit
def _tril_apply(X0, X1, X2, X3, src, rs, beta, g, n_t, R: tl.constexpr, cols, m_c, STRIDE: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr):
    """Row block R of Akk_inv @ (beta * src [* exp2(gc)]) for one column slice: sum over the
    column blocks c <= R of X_Rc [16, 16] @ the source's rows of block c (rounded to the
    source's dtype before the product, as fla's F6 rounds them)."""
    t16 = tl.arange(0, 16)
    acc = tl.zeros([16, cols.shape[0]], dtype=tl.float32)
    for c in tl.static_range(R + 1):
        rows_c = c * 16 + t16
        m_s = (rows_c < n_t)[:, None] & m_c[None, :]
        x = _qk(src, rs, rows_c, rows_c < n_t, cols, m_c, STRIDE, NORM, 1, HV)
        b = tl.load(beta + rows_c * HV, mask=rows_c < n_t, other=0).to(tl.float32)
        # (rounded to the source's dtype, as fla's F6 rounds beta * k in bf16: the exact product
        # of two bf16 values fits fp32, so one rounding gives the same bits)
        xb = to(x * b[:, None], src.dtype.element_ty)
        if GATED:
            g_c = tl.load(g + rows_c[:, None] * (HV * K) + cols[None, :], mask=m_s, other=0).to(tl.float32)
            xb = to(xb.to(tl.float32) * tl.exp2(g_c), src.dtype.element_ty)
        if c == 0:
            Xc = X0
        elif c == 1:
            Xc = X1
        elif c == 2:
            Xc = X2
        else:
            Xc = X3
        acc += tl.dot(to(Xc, src.dtype.element_ty).to(tl.float32), xb.to(tl.float32))
    return acc


@triton.jit
def _row_apply(X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, src, rs, beta, g, n_t, R: tl.constexpr, cols,
               m_c, STRIDE: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
               NORM: tl.constexpr):
    """``_tril_apply`` with row block R's blocks of the inverse."""
    if R == 0:
        out = _tril_apply(X00, X00, X00, X00, src, rs, beta, g, n_t, 0, cols, m_c, STRIDE, HV, K, GATED, NORM)
    elif R == 1:
        out = _tril_apply(X10, X11, X11, X11, src, rs, beta, g, n_t, 1, cols, m_c, STRIDE, HV, K, GATED, NORM)
    elif R == 2:
        out = _tril_apply(X20, X21, X22, X22, src, rs, beta, g, n_t, 2, cols, m_c, STRIDE, HV, K, GATED, NORM)
    else:
        out = _tril_apply(X30, X31, X32, X33, src, rs, beta, g, n_t, 3, cols, m_c, STRIDE, HV, K, GATED, NORM)
    return out


@triton.jit
def _load_block(ptr, R: tl.constexpr, C: tl.constexpr, n_t, HV: tl.constexpr):
    """Block (R, C) of a stored [T, HV, 64] chunk matrix (fp32; rows past the end: 0)."""
    t16 = tl.arange(0, 16)
    rows = R * 16 + t16
    return tl.load(ptr + rows[:, None] * (HV * 64) + (C * 16 + t16)[None, :], mask=(rows < n_t)[:, None],
                   other=0).to(tl.float32)


@triton.jit
def intra16_kernel(q, k, g, beta, Aqk, Akk_inv, scale, cu_seqlens, chunk_indices, T,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   SPAN: tl.constexpr, IS_VARLEN: tl.constexpr,
                   v=None, w=None, u=None, kg=None, qg=None, V: tl.constexpr = 0, BV: tl.constexpr = 32,
                   WY: tl.constexpr = False, g_raw=None, A_log=None, dt_bias=None, lower_bound=0.0,
                   GATE: tl.constexpr = False, ACT: tl.constexpr = True, HAS_BIAS: tl.constexpr = False,
                   USE_LB: tl.constexpr = False, qn=None, kn=None, q_rstd=None, k_rstd=None, rs=None,
                   L2NORM: tl.constexpr = False, FROM_INV: tl.constexpr = False, WANT_U: tl.constexpr = True,
                   WANT_QG: tl.constexpr = True):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    BT: tl.constexpr = 64
    if IS_VARLEN:
        if tl.load(chunk_indices + i_t * 2) < 0:  # a capacity-shaped index's spare row
            return
    i_c, i_tg, bos, T_seq = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    n_t = tl.minimum(T_seq - i_c * BT, BT).to(tl.int32)
    base = bos + i_c * BT
    q += base * H * K + i_h * K
    k += base * H * K + i_h * K
    g += base * HV * K + i_hv * K
    beta += base * HV + i_hv
    Akk_inv += base * HV * BT + i_hv * BT
    t16 = tl.arange(0, 16)
    t64 = tl.arange(0, 64)
    m_t = t64 < n_t
    if L2NORM:  # F1 here: each row's rstd into this program's scratch (read back by every q/k load)
        rs += base * HV * 2 + i_hv * 2
        ssq = tl.zeros([64], dtype=tl.float32)
        ssk = tl.zeros([64], dtype=tl.float32)
        for i_k in tl.static_range(0, K, BK):
            cols = i_k + tl.arange(0, BK)
            m = m_t[:, None] & (cols < K)[None, :]
            x = tl.load(q + t64[:, None] * (H * K) + cols[None, :], mask=m, other=0).to(tl.float32)
            ssq += tl.sum(x * x, axis=1)
            x = tl.load(k + t64[:, None] * (H * K) + cols[None, :], mask=m, other=0).to(tl.float32)
            ssk += tl.sum(x * x, axis=1)
        r_q = 1.0 / tl.sqrt(ssq + 1e-6)
        r_k = 1.0 / tl.sqrt(ssk + 1e-6)
        tl.store(rs + t64 * (HV * 2), r_q, mask=m_t)
        tl.store(rs + t64 * (HV * 2) + 1, r_k, mask=m_t)
        if i_hv % (HV // H) == 0:  # the group's first value head writes F1's outputs (at q/k heads)
            qn += base * H * K + i_h * K
            kn += base * H * K + i_h * K
            tl.store(q_rstd + (base + t64) * H + i_h, r_q, mask=m_t)
            tl.store(k_rstd + (base + t64) * H + i_h, r_k, mask=m_t)
            for i_k in tl.static_range(0, K, BK):
                cols = i_k + tl.arange(0, BK)
                m = m_t[:, None] & (cols < K)[None, :]
                offs = t64[:, None] * (H * K) + cols[None, :]
                x = tl.load(q + offs, mask=m, other=0).to(tl.float32)
                tl.store(qn + offs, to(x * r_q[:, None], qn.dtype.element_ty), mask=m)
                x = tl.load(k + offs, mask=m, other=0).to(tl.float32)
                tl.store(kn + offs, to(x * r_k[:, None], kn.dtype.element_ty), mask=m)
    if GATE:  # F2 here: the gate's activation and the chunk's cumsum (log2 units) into g, read back below
        g_raw += base * HV * K + i_hv * K
        A = 1.0
        if ACT:
            A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        for i_k in tl.static_range(0, K, BK):
            cols = i_k + tl.arange(0, BK)
            m_c = cols < K
            m = m_t[:, None] & m_c[None, :]
            x = tl.load(g_raw + t64[:, None] * (HV * K) + cols[None, :], mask=m, other=0).to(tl.float32)
            if HAS_BIAS:
                x += tl.load(dt_bias + i_hv * K + cols, mask=m_c, other=0).to(tl.float32)[None, :]
            if not ACT:  # a log-decay given: a reset (-inf) taken as -200, as the reference takes it
                act = tl.where(x < -200.0, -200.0, x)
            elif USE_LB:
                act = lower_bound * tl.sigmoid(A * x)
            else:
                act = -A * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            gcs = tl.cumsum(tl.where(m, act, 0.0), axis=0) * 1.4426950408889634
            tl.store(g + t64[:, None] * (HV * K) + cols[None, :], gcs, mask=m)
    if L2NORM or GATE:
        tl.debug_barrier()  # (the other threads read these rows back)
    if FROM_INV:  # B1-B2: the inverse's blocks from the saved Akk_inv
        X00 = _load_block(Akk_inv, 0, 0, n_t, HV)
        X10 = _load_block(Akk_inv, 1, 0, n_t, HV)
        X11 = _load_block(Akk_inv, 1, 1, n_t, HV)
        X20 = _load_block(Akk_inv, 2, 0, n_t, HV)
        X21 = _load_block(Akk_inv, 2, 1, n_t, HV)
        X22 = _load_block(Akk_inv, 2, 2, n_t, HV)
        X30 = _load_block(Akk_inv, 3, 0, n_t, HV)
        X31 = _load_block(Akk_inv, 3, 1, n_t, HV)
        X32 = _load_block(Akk_inv, 3, 2, n_t, HV)
        X33 = _load_block(Akk_inv, 3, 3, n_t, HV)
    else:
        Aqk += base * HV * BT + i_hv * BT
        zero = tl.zeros([16, 16], dtype=tl.float32)
        for R in tl.static_range(3):  # the zero blocks above the diagonal
            for C in tl.static_range(R + 1, 4):
                _store_block(Aqk, R, C, zero, n_t, HV)
                _store_block(Akk_inv, R, C, zero, n_t, HV)
        # Akk's blocks, rows times beta (rows past the end: 0)
        b0 = tl.load(beta + (0 + t16) * HV, mask=(0 + t16) < n_t, other=0).to(tl.float32)[:, None]
        b1 = tl.load(beta + (16 + t16) * HV, mask=(16 + t16) < n_t, other=0).to(tl.float32)[:, None]
        b2 = tl.load(beta + (32 + t16) * HV, mask=(32 + t16) < n_t, other=0).to(tl.float32)[:, None]
        b3 = tl.load(beta + (48 + t16) * HV, mask=(48 + t16) < n_t, other=0).to(tl.float32)[:, None]
        D0 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 0, 0, H, HV, K, BK, SPAN, L2NORM) * b0
        A10 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 1, 0, H, HV, K, BK, SPAN, L2NORM) * b1
        D1 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 1, 1, H, HV, K, BK, SPAN, L2NORM) * b1
        A20 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 2, 0, H, HV, K, BK, SPAN, L2NORM) * b2
        A21 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 2, 1, H, HV, K, BK, SPAN, L2NORM) * b2
        D2 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 2, 2, H, HV, K, BK, SPAN, L2NORM) * b2
        A30 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 3, 0, H, HV, K, BK, SPAN, L2NORM) * b3
        A31 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 3, 1, H, HV, K, BK, SPAN, L2NORM) * b3
        A32 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 3, 2, H, HV, K, BK, SPAN, L2NORM) * b3
        D3 = _scores_row(q, k, g, rs, Aqk, scale, n_t, 3, 3, H, HV, K, BK, SPAN, L2NORM) * b3
        # (I + Akk)^-1 by 16x16 blocks: the diagonal inverses, then block forward substitution
        X00 = _neumann_inverse(D0)
        X11 = _neumann_inverse(D1)
        X22 = _neumann_inverse(D2)
        X33 = _neumann_inverse(D3)
        X10 = -tl.dot(X11, tl.dot(A10, X00))
        X21 = -tl.dot(X22, tl.dot(A21, X11))
        X20 = -tl.dot(X22, tl.dot(A20, X00) + tl.dot(A21, X10))
        X32 = -tl.dot(X33, tl.dot(A32, X22))
        X31 = -tl.dot(X33, tl.dot(A31, X11) + tl.dot(A32, X21))
        X30 = -tl.dot(X33, tl.dot(A30, X00) + tl.dot(A31, X10) + tl.dot(A32, X20))
        _store_block(Akk_inv, 0, 0, X00, n_t, HV)
        _store_block(Akk_inv, 1, 0, X10, n_t, HV)
        _store_block(Akk_inv, 1, 1, X11, n_t, HV)
        _store_block(Akk_inv, 2, 0, X20, n_t, HV)
        _store_block(Akk_inv, 2, 1, X21, n_t, HV)
        _store_block(Akk_inv, 2, 2, X22, n_t, HV)
        _store_block(Akk_inv, 3, 0, X30, n_t, HV)
        _store_block(Akk_inv, 3, 1, X31, n_t, HV)
        _store_block(Akk_inv, 3, 2, X32, n_t, HV)
        _store_block(Akk_inv, 3, 3, X33, n_t, HV)
    if WY:  # F6 (or B2) from the inverse in registers: w, u, kg, qg
        v += base * HV * V + i_hv * V
        w += base * HV * K + i_hv * K
        kg += base * HV * K + i_hv * K
        last = n_t - 1
        for i_k in tl.static_range(0, K, BK):
            cols = i_k + tl.arange(0, BK)
            m_c = cols < K
            g_last = tl.load(g + last * (HV * K) + cols, mask=m_c, other=0).to(tl.float32)
            for R in tl.static_range(4):
                rows = R * 16 + t16
                m_r = rows < n_t
                m_rc = m_r[:, None] & m_c[None, :]
                w_r = _row_apply(X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, k, rs, beta, g, n_t, R, cols, m_c,
                                 H * K, HV, K, True, L2NORM)
                tl.store(w + rows[:, None] * (HV * K) + cols[None, :], to(w_r, w.dtype.element_ty), mask=m_rc)
                k_r = _qk(k, rs, rows, m_r, cols, m_c, H * K, L2NORM, 1, HV)
                g_r = tl.load(g + rows[:, None] * (HV * K) + cols[None, :], mask=m_rc, other=0).to(tl.float32)
                tl.store(kg + rows[:, None] * (HV * K) + cols[None, :],
                         to(k_r * tl.exp2(g_last[None, :] - g_r), kg.dtype.element_ty), mask=m_rc)
                if WANT_QG:
                    qg_p = qg + base * HV * K + i_hv * K
                    q_r = _qk(q, rs, rows, m_r, cols, m_c, H * K, L2NORM, 0, HV)
                    tl.store(qg_p + rows[:, None] * (HV * K) + cols[None, :],
                             to(q_r * tl.exp2(g_r), qg.dtype.element_ty), mask=m_rc)
        if WANT_U:
            u += base * HV * V + i_hv * V
            for i_v in tl.static_range(0, V, BV):
                cols = i_v + tl.arange(0, BV)
                m_c = cols < V
                for R in tl.static_range(4):
                    rows = R * 16 + t16
                    m_rc = (rows < n_t)[:, None] & m_c[None, :]
                    u_r = _row_apply(X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, v, rs, beta, g, n_t, R, cols,
                                     m_c, HV * V, HV, K, False, False)
                    tl.store(u + rows[:, None] * (HV * V) + cols[None, :], to(u_r, u.dtype.element_ty), mask=m_rc)


def intra16(q, k, gc, beta, scale: float, cu_seqlens=None, chunk_indices=None, BK: int = 64,
            span_max: float = SPAN_MAX, v=None, g_raw=None, A_log=None, dt_bias=None, lower_bound=None,
            num_warps: int = 4, maxnreg: int | None = None, l2norm: bool = False, activate: bool = True,
            Akk_inv=None, want_u: bool = True, want_qg: bool = True):
    """(Aqk, Akk_inv), [B, T, HV, 64] each in k's dtype; packed batches (B = 1) with fla's
    chunk index. Given ``v``, F6 too: (Aqk, Akk_inv, w, u, kg, qg) as ``reference.wy_fwd``
    forms them from that inverse (u and qg None where not wanted). Given ``g_raw`` (with
    ``A_log``, ``dt_bias``, ``lower_bound``; ``activate=False`` for a log-decay given), F2
    too, into ``gc`` (an fp32 [B, T, HV, K] it writes). ``l2norm``: F1 too, q and k raw in,
    (q, q_rstd, k, k_rstd) as ``reference.l2norm_fwd`` forms them put in front of the result.
    ``Akk_inv`` given (B1-B2): the inverse read, not formed, and Aqk not written (None)."""
    B, T, H, K = q.shape
    HV = gc.shape[2]
    dev = q.device
    gate = {}
    if g_raw is not None:
        gate = dict(g_raw=g_raw, A_log=A_log, dt_bias=dt_bias, lower_bound=0.0 if lower_bound is None else lower_bound,
                    GATE=True, ACT=activate, HAS_BIAS=dt_bias is not None, USE_LB=lower_bound is not None)
    norm = {}
    if l2norm:
        norm = dict(qn=torch.empty_like(q), kn=torch.empty_like(k), q_rstd=torch.empty(B, T, H, device=dev),
                    k_rstd=torch.empty(B, T, H, device=dev), rs=torch.empty(B, T, HV, 2, device=dev), L2NORM=True)
    from_inv = Akk_inv is not None
    Aqk = None if from_inv else torch.empty(B, T, HV, 64, device=dev, dtype=k.dtype)
    if not from_inv:
        Akk_inv = torch.empty(B, T, HV, 64, device=dev, dtype=k.dtype)
    NT = triton.cdiv(T, 64) if cu_seqlens is None else chunk_indices.shape[0]
    wy = {}
    if v is not None:
        V = v.shape[-1]
        wy = dict(v=v, w=torch.empty(B, T, HV, K, device=dev, dtype=k.dtype),
                  u=torch.empty_like(v) if want_u else None,
                  kg=torch.empty(B, T, HV, K, device=dev, dtype=k.dtype),
                  qg=torch.empty(B, T, HV, K, device=dev, dtype=k.dtype) if want_qg else None)
    intra16_kernel[(NT, B * HV)](q, k, gc, beta, Aqk, Akk_inv, scale, cu_seqlens,
                                 chunk_indices, T, H=H, HV=HV, K=K, BK=min(BK, triton.next_power_of_2(K)),
                                 SPAN=span_max, IS_VARLEN=cu_seqlens is not None, num_warps=num_warps, **gate, **norm,
                                 FROM_INV=from_inv, **({"maxnreg": maxnreg} if maxnreg else {}),
                                 **wy, **(dict(V=V, BV=min(32, triton.next_power_of_2(V)), WY=True, WANT_U=want_u,
                                               WANT_QG=want_qg) if wy else {}))
    front = (norm["qn"], norm["q_rstd"], norm["kn"], norm["k_rstd"]) if l2norm else ()
    if not wy:
        return front + (Aqk, Akk_inv)
    return front + (Aqk, Akk_inv, wy["w"], wy["u"], wy["kg"], wy["qg"])


# --------------------------------------------------------------------------------------
# Offline compile rows and the GPU run (parity, then time against fla's F3-F5)
# --------------------------------------------------------------------------------------
CONFIGS = [dict(BK=32, num_warps=4, maxnreg=None), dict(BK=32, num_warps=4, maxnreg=168),
           dict(BK=64, num_warps=8, maxnreg=None)]
# F3-F6 in one program (WY=True), BV 32
WY_CONFIGS = [dict(BK=32, num_warps=4, maxnreg=168), dict(BK=64, num_warps=8, maxnreg=None)]


def compile_rows(K: int = 128, HV: int = 16) -> list[dict]:
    """sm_90a builds of the kernel (registers, spills, shared memory, SASS size) per config."""
    from benchmarks.compile_report import compile_sm90

    types = dict(q="*bf16", k="*bf16", g="*fp32", beta="*bf16", Aqk="*bf16", Akk_inv="*bf16", scale="fp32", T="i32",
                 v="*bf16", w="*bf16", u="*bf16", kg="*bf16", qg="*bf16", lower_bound="fp32",
                 g_raw="*bf16", A_log="*fp32", dt_bias="*fp32", qn="*bf16", kn="*bf16", q_rstd="*fp32",
                 k_rstd="*fp32", rs="*fp32")
    rows = []
    builds = [(False, False, False, False, CONFIGS), (True, False, False, False, WY_CONFIGS),
              (True, True, False, False, WY_CONFIGS), (True, True, True, False, WY_CONFIGS),
              (True, True, False, True, WY_CONFIGS)]
    for wy, gate, norm, from_inv, configs in builds:
        for cfg in configs:
            ce = dict(H=HV, HV=HV, K=K, BK=cfg["BK"], SPAN=SPAN_MAX, IS_VARLEN=False, cu_seqlens=None,
                      chunk_indices=None, WY=wy, **(dict(V=256, BV=32) if wy else dict(V=0, BV=32, v=None, w=None,
                                                                                         u=None, kg=None, qg=None)),
                      GATE=gate, ACT=True, HAS_BIAS=gate, USE_LB=False, L2NORM=norm, FROM_INV=from_inv,
                      WANT_U=not from_inv, WANT_QG=True,  # (kernel-fun's B3 forms u: B2 writes none)
                      **({} if gate else dict(g_raw=None, A_log=None, dt_bias=None)),
                      **({} if norm else dict(qn=None, kn=None, q_rstd=None, k_rstd=None, rs=None)))
            r = compile_sm90(intra16_kernel, types, ce, cfg["num_warps"], 1, maxnreg=cfg["maxnreg"])
            name = "prep16.intra16" + (" B1-B2 (from Akk_inv, gate, WY V256 without u)" if from_inv else
                                       (" +F1 (l2norm)" if norm else "") + (" +F2 (gate)" if gate else "")
                                       + (" +F6 (V256)" if wy else ""))
            rows.append({"kind": "compile_sm90", "kernel": name, "K": K, **cfg,
                         **{n: r[n] for n in ("registers", "spill_stores", "spill_loads", "stack", "shared",
                                              "sass_instructions", "sass_code_sha")}})
    return rows


def fla_f3_f5(q, k, gc, beta, scale):
    """fla 0.5.2's F3-F5 (its token-parallel diagonal kernel, then its off-diagonal and solve
    kernel), as ``chunk_kda_fwd_intra`` launches them without safe_gate: (Aqk, Akk_inv)."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_kernel_inter_solve_fused
    from fla.ops.kda.chunk_intra_token_parallel import chunk_kda_fwd_intra_token_parallel

    B, T, H, K = k.shape
    HV = gc.shape[2]
    Aqk = torch.empty(B, T, HV, 64, device=k.device, dtype=k.dtype)
    Akk = torch.zeros(B, T, HV, 64, device=k.device, dtype=k.dtype)
    Akkd = torch.empty(B, T, HV, 16, device=k.device, dtype=torch.float32)
    Aqk, Akkd = chunk_kda_fwd_intra_token_parallel(q=q, k=k, gk=gc, beta=beta, Aqk=Aqk, Akk=Akkd, scale=scale,
                                                   cu_seqlens=None, chunk_size=64, sub_chunk_size=16)
    chunk_kda_fwd_kernel_inter_solve_fused[(triton.cdiv(T, 64), B * HV)](
        q=q, k=k, g=gc, beta=beta, Aqk=Aqk, Akkd=Akkd, Akk=Akk, scale=scale, cu_seqlens=None, chunk_indices=None,
        T=T, H=H, HV=HV, K=K, BT=64, BC=16, NC=4, USE_SAFE_GATE=False)
    return Aqk, Akk


def _emit(rows: list[dict], out) -> None:
    """Each row (the GPU named) printed as a JSON line and appended to ``out`` when given."""
    import json

    for r in rows:
        line = json.dumps({**r, "gpu": torch.cuda.get_device_name()})
        print(line, flush=True)
        if out:
            with open(out, "a") as f:
                f.write(line + "\n")


def gpu_run(shape: str, out) -> list[dict]:
    """At ``shape``: q and k normalized, gc the chain's gate cumsum (the reference F1, F2);
    parity of each config against the float64 reference (a 1,024-token slice) and against
    fla's F3-F5, then CUDA-event times of each against fla's in the same process."""

    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import make_inputs, problem

    p = problem(shape)
    kw = make_inputs(p, device="cuda", seed=0, requires_grad=False)
    q = torch.nn.functional.normalize(kw["q"].float(), dim=-1).to(p.dtype)
    k = torch.nn.functional.normalize(kw["k"].float(), dim=-1).to(p.dtype)
    gc = ref.gate_cumsum(kw["g"], True, kw["A_log"], kw["dt_bias"], None, 64)
    beta = kw["beta"]
    scale = p.K ** -0.5
    small = (q[:1, :1024], k[:1, :1024], gc[:1, :1024].contiguous(), beta[:1, :1024])
    want = ref.intra_scores(*small, scale, 64, exact=True)
    fla_full = fla_f3_f5(q, k, gc, beta, scale)
    rows = []
    fns = {"fla": lambda: fla_f3_f5(q, k, gc, beta, scale)}
    for cfg in CONFIGS:
        name = f"BK{cfg['BK']}-{cfg['num_warps']}w" + (f"-r{cfg['maxnreg']}" if cfg["maxnreg"] else "")
        call = functools.partial(intra16, scale=scale, **cfg)
        got_small, got = call(*small), call(q, k, gc, beta)
        rows.append({"impl": name, "vs_f64": [ref.rel_rms(got_small[i].double(), want[i]) for i in range(2)],
                     "fla_vs_f64": [ref.rel_rms(fla_f3_f5(*small, scale)[i].double(), want[i]) for i in range(2)],
                     "vs_fla": [ref.rel_rms(got[i].float(), fla_full[i].float()) for i in range(2)]})
        fns[name] = functools.partial(call, q, k, gc, beta)
    # F3-F6 in one program against fla's F3-F6 (chunk_kda_fwd_intra: its two kernels and its F6)
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

    v = kw["v"]
    fla_f6 = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gc, beta=beta, scale=scale)  # (w, u, qg, kg, Aqk, Akk)
    fns["fla F3-F6"] = lambda: chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gc, beta=beta, scale=scale)
    for cfg in WY_CONFIGS:
        name = f"F3-F6 BK{cfg['BK']}-{cfg['num_warps']}w" + (f"-r{cfg['maxnreg']}" if cfg["maxnreg"] else "")
        call = functools.partial(intra16, q, k, gc, beta, scale, v=v, **cfg)
        _, _, w, u, kg, _ = call()
        rows.append({"impl": name, "vs_fla_w_u_kg": [ref.rel_rms(w.float(), fla_f6[0].float()),
                                                      ref.rel_rms(u.float(), fla_f6[1].float()),
                                                      ref.rel_rms(kg.float(), fla_f6[3].float())]})
        fns[name] = call
    for fn in fns.values():
        fn()
    times = {n: [] for n in fns}
    for _ in range(5):
        for n, fn in fns.items():
            times[n] += cuda_times(fn, 10)
    fla_ms = {"F3-F5": summary(times["fla"])["median"], "F3-F6": summary(times["fla F3-F6"])["median"]}
    table = [{"kind": "stage", "stage": st, "shape": shape, "impl": "fla", "ms": ms} for st, ms in fla_ms.items()]
    for r in rows:
        stage = "F3-F6" if r["impl"].startswith("F3-F6") else "F3-F5"
        ms = summary(times[r["impl"]])["median"]
        table.append({"kind": "stage", "stage": stage, "shape": shape, **r, "ms": ms, "vs_fla_x": fla_ms[stage] / ms})
    _emit(table, out)
    return table


def units_run(shape: str, out) -> list[dict]:
    """At ``shape`` (the gate and l2norm in the op): the F1-F6 unit (``f1_f6``) against fla's
    F1, F2 and F3-F6 in turn, and the B1-B2 unit (``b1_b2``, from fla's saved Akk_inv)
    against fla's B1 and B2: each output against fla's, and on a 1,024-token slice both
    against the float64 reference stages; then CUDA-event times, interleaved, one process."""

    from benchmarks.parity import tril_mask
    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import make_inputs, problem
    from kernel_fun.kda.stages import stages

    p = problem(shape)
    kw = make_inputs(p, device="cuda", seed=0, requires_grad=False)
    q, k, v, g, beta, A_log, dt_bias = (kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))
    scale = p.K ** -0.5
    lb = p.lower_bound
    args = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lb, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                scale=scale, safe_gate=False, disable_recompute=True, chunk_size=64, cu_seqlens=None,
                chunk_indices=None)
    names = ("q", "q_rstd", "k", "k_rstd", "gc", "w", "u", "kg", "Aqk", "Akk_inv", "qg")

    # fla's side of each unit: its stages in turn, as the chain registers them
    fla_f1_f6 = stages()["F1-F6"].impls["fla"]
    fla_b1_b2 = stages()["B1-B2"].impls["fla"]
    ours, theirs = f1_f6(q, k, v, g, beta, **args), fla_f1_f6(q, k, v, g, beta, **args)
    sl = [x[:1, :1024].contiguous() for x in (q, k, v, g, beta)]
    small = f1_f6(*sl, **args)
    fla_small = fla_f1_f6(*sl, **args)
    (rq, _), (rk, _) = ref.l2norm_fwd(sl[0]), ref.l2norm_fwd(sl[1])
    rgc = ref.gate_cumsum(sl[3], True, A_log, dt_bias, lb, 64)
    rqk, rinv = ref.intra_scores(rq, rk, rgc, sl[4], scale, 64, exact=True)
    rw, ru, rqg, rkg = ref.wy_fwd(rk, sl[2], sl[4], rinv, rgc, rq, 64, exact=True)
    f64 = dict(gc=rgc, Aqk=rqk, Akk_inv=rinv, w=rw, u=ru, qg=rqg, kg=rkg)

    def err(name, a, b):  # (Aqk's upper triangle is left unwritten, by fla as by us: not compared)
        if name == "Aqk":
            keep = tril_mask(b, 64, None)
            a, b = torch.where(keep, a, 0), torch.where(keep, b, 0)
        return ref.rel_rms(a, b)

    row = {"kind": "unit", "unit": "F1-F6", "shape": shape,
           "vs_fla": {n: err(n, a.float(), b.float()) for n, a, b in zip(names, ours, theirs) if a is not None},
           "vs_f64": {n: err(n, small[names.index(n)].double(), e) for n, e in f64.items()},
           "fla_vs_f64": {n: err(n, fla_small[names.index(n)].double(), e) for n, e in f64.items()}}
    # B1-B2 from fla's saved inverse, against fla's B1 then B2
    qn, kn, Akk = theirs[0], theirs[2], theirs[9]
    b_args = (g, True, A_log, dt_bias, lb, qn, kn, v, beta, Akk, True, 64, None, None)

    b_ours, b_fla = b1_b2(*b_args), fla_b1_b2(*b_args)
    brow = {"kind": "unit", "unit": "B1-B2", "shape": shape,
            "vs_fla": {n: ref.rel_rms(a.float(), b.float())
                       for n, a, b in zip(("gc", "w", "u", "qg", "kg"), b_ours, b_fla)}}
    fns = {"F1-F6 ours": lambda: f1_f6(q, k, v, g, beta, **args),
           "F1-F6 fla": lambda: fla_f1_f6(q, k, v, g, beta, **args),
           "B1-B2 ours": lambda: b1_b2(*b_args), "B1-B2 fla": lambda: fla_b1_b2(*b_args),
           "B1-B2 ours no u": lambda: b1_b2(*b_args[:10], False, *b_args[11:])}
    times = {n: [] for n in fns}
    for fn in fns.values():
        fn()
    for _ in range(5):
        for n, fn in fns.items():
            times[n] += cuda_times(fn, 10)
    ms = {n: summary(t)["median"] for n, t in times.items()}
    row.update(ms={"ours": ms["F1-F6 ours"], "fla": ms["F1-F6 fla"]}, vs_fla_x=ms["F1-F6 fla"] / ms["F1-F6 ours"])
    brow.update(ms={"ours": ms["B1-B2 ours"], "ours_no_u": ms["B1-B2 ours no u"], "fla": ms["B1-B2 fla"]},
                vs_fla_x=ms["B1-B2 fla"] / ms["B1-B2 ours"])
    _emit([row, brow], out)
    return [row, brow]


def main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m research.prep16")
    parser.add_argument("what", choices=["compile", "gpu", "units"])
    parser.add_argument("--shapes", default="prod8192_gate,kimi,small")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.what == "compile":
        for row in compile_rows():
            print(json.dumps(row))
        return 0
    for shape in args.shapes.split(","):
        (units_run if args.what == "units" else gpu_run)(shape, args.out)
    return 0



# --------------------------------------------------------------------------------------
# As the chain's F3-F6 (a candidate: python -m benchmarks.op --candidate
# F3-F6=research.prep16:f3_f6:supports)
# --------------------------------------------------------------------------------------
def supports(q, k, v, gc, beta, scale, safe_gate, disable_recompute, chunk_size, cu_seqlens,
             chunk_indices) -> str | None:
    """None when ``f3_f6`` takes the call."""
    why = _common_support(q, k, v, chunk_size)
    if why is None and not gc.is_contiguous():
        why = "a strided gate cumsum"
    return why


def f3_f6(q, k, v, gc, beta, scale, safe_gate, disable_recompute, chunk_size, cu_seqlens, chunk_indices):
    """F3-F6 with the chain's contract: (w, u, kg, Aqk, Akk_inv, qg), qg only with
    ``disable_recompute`` (the chain's ask for it). Exact for any gate: ``safe_gate`` changes
    nothing here."""
    Aqk, Akk_inv, w, u, kg, qg = intra16(q, k, gc, beta, scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                         v=v)
    return w, u, kg, Aqk, Akk_inv, (qg if disable_recompute else None)


# --------------------------------------------------------------------------------------
# As the chain's F1-F6 and B1-B2 units (candidates: python -m benchmarks.op --candidate
# F1-F6=research.prep16:f1_f6:supports_f1_f6 --candidate B1-B2=research.prep16:b1_b2:supports_b1_b2)
# --------------------------------------------------------------------------------------
def _common_support(q, k, v, chunk_size) -> str | None:
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (built for 64)"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (bf16/fp16, q, k and v alike)"
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return "a strided input"
    return None


def supports_f1_f6(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, scale,
                   safe_gate, disable_recompute, chunk_size, cu_seqlens, chunk_indices) -> str | None:
    """None when ``f1_f6`` takes the call."""
    why = _common_support(q, k, v, chunk_size)
    if why is None and not g.is_contiguous():
        why = "a strided gate"
    return why


def f1_f6(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, scale,
          safe_gate, disable_recompute, chunk_size, cu_seqlens, chunk_indices):
    """F1, F2 and F3-F6 in one program a (chunk, value head), the chain's F1-F6 contract:
    (q, q_rstd, k, k_rstd, gc, w, u, kg, Aqk, Akk_inv, qg); the rstds None without the l2norm,
    qg only with ``disable_recompute``. Exact for any gate: ``safe_gate`` changes nothing."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    gc = torch.empty(B, T, HV, K, device=q.device, dtype=torch.float32)
    out = intra16(q, k, gc, beta, scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, v=v, g_raw=g,
                  A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
                  lower_bound=lower_bound if use_gate_in_kernel else None, activate=use_gate_in_kernel,
                  l2norm=use_qk_l2norm_in_kernel, want_qg=disable_recompute)
    front = out[:4] if use_qk_l2norm_in_kernel else (q, None, k, None)
    Aqk, Akk_inv, w, u, kg, qg = out[-6:]
    return front + (gc, w, u, kg, Aqk, Akk_inv, qg)


def supports_b1_b2(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, q, k, v, beta, A, want_u, chunk_size,
                   cu_seqlens, chunk_indices) -> str | None:
    """None when ``b1_b2`` takes the call."""
    why = _common_support(q, k, v, chunk_size)
    if why is None and not (g.is_contiguous() and A.is_contiguous()):
        why = "a strided gate or inverse"
    return why


def b1_b2(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, q, k, v, beta, A, want_u, chunk_size, cu_seqlens,
          chunk_indices):
    """B1 and B2 in one program a (chunk, value head), the chain's B1-B2 contract: (gc, w, u,
    qg, kg) from the raw gate and the saved Akk_inv, u only when ``want_u``."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    gc = torch.empty(B, T, HV, K, device=q.device, dtype=torch.float32)
    _, _, w, u, kg, qg = intra16(q, k, gc, beta, 1.0, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, v=v, g_raw=g,
                                 A_log=A_log if use_gate_in_kernel else None,
                                 dt_bias=dt_bias if use_gate_in_kernel else None,
                                 lower_bound=lower_bound if use_gate_in_kernel else None,
                                 activate=use_gate_in_kernel, Akk_inv=A, want_u=want_u)
    return gc, w, u, qg, kg


if __name__ == "__main__":
    import sys

    sys.exit(main())
