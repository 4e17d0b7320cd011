"""B7-B9, the intra-chunk backward with dg's chunk cumsum and the gate's backward in the same
pass: the gradients through Aqk and Akk into dq, dk, db and dg (fla's
``chunk_kda_bwd_intra``), then dg's reverse cumsum within each chunk (B8) and, with the gate
in the op, the raw gate's gradient with dA_log's and dt_bias's (B9, ``kda_gate_bwd``).

Where fla loses time: one program per (16-row sub-chunk, 32-channel K slice, chunk, head),
524,288 at prod8192_gate, each reloading its neighbours' q, k, g and dA tiles; the diagonal
16x16 blocks run two 16-step loops on CUDA cores; B8 and B9 then read dg back twice.

For a row r and an earlier column s the factor is exp2(g_r - g_s), g the chunk cumsum (log2
units, non-increasing along the chunk). This kernel: one program per (32-channel K slice,
chunk, head), 4 warps, the chunk as one [64, 32] tile per output, dA read along its rows
only (the column role's tiles are the row role's transposed on chip). The factor goes
through an anchor row as two one-sided halves; three tiers, chosen per program from the
slice's gate span so that every factor stays within 2^GUARD_SPAN (far inside fp32):
- the chunk anchor (its middle row): each role one [64, 64] x [64, 32] dot per dA;
- the half-chunk anchors: each role two [64, 32] x [32, 32] dots per dA;
- the per-block form: four [64, 16] x [16, 32] dots, each 16-row block through its last row
  (row role) or its first (column role); a block whose own span passes the guard takes its
  diagonal pairwise on CUDA cores. So any gate is exact, and ``safe_gate`` changes nothing.
On the chain's gate at prod8192_gate the chunk anchor takes 31-52% of the programs and the
halves lift the anchored share to 80%; a lower-bounded gate takes the chunk anchor everywhere.
Every dot is three tf32 products (``dot3``). db sums the K slices' partials in slice order;
dg's reverse cumsum runs over the chunk tile in registers; dA_log's and dt_bias's partials
are per chunk, summed in order (no atomics). The incoming dq, dk and dg are asked of L2 at
the program's start.

Numerics: fp32 throughout, the dots at fp32 level: ~3e-8 relative RMS of the float64 stage at
prod8192_gate, where fla's (tf32 off the diagonal) is ~2e-5. Outputs are fresh tensors
(input + intra part), so a relaunch is idempotent.

Falls back (``supports``): chunk size other than 64.

Measured: the README's stage table (B7-B9 rows; 1.90x fla's three stages at prod8192_gate).
The time is two 255-register programs an SM, each a dependent chain of fenced and waited
wgmma groups. The rounds, and the designs measured slower (two-product dots, a Gluon kernel,
8 warps, 16-channel slices, prefetching for the next wave), are in docs/log/b7.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import GUARD_SPAN, chunk_coords, config_over, dot3, prefetch_rows, to

BC = 16  # the anchor block


@triton.jit
def _row(ptr, r, stride, ok, o_k, m_k):
    return tl.load(ptr + r * stride + o_k, mask=m_k & ok, other=0).to(tl.float32)


@triton.jit
def _last(st, BC: tl.constexpr, n_t):
    """Block st's last row within the chunk."""
    return tl.minimum(st + BC, n_t) - 1


@triton.jit
def _half_span(g, st, n_t, o_k, m_k, SG: tl.constexpr):
    """The 32-row block st's gate span in this K slice through its middle row: the largest
    of (first row - middle, middle - last) over the channels (0 for a block past the end)."""
    ok = st < n_t
    mid = _row(g, tl.minimum(st + 15, n_t - 1), SG, ok, o_k, m_k)
    lo = tl.maximum(tl.max(_row(g, st, SG, ok, o_k, m_k) - mid, axis=0),
                    tl.max(mid - _row(g, tl.minimum(st + 31, n_t - 1), SG, ok, o_k, m_k), axis=0))
    return tl.where(ok, lo, 0.0)


@triton.jit
def _gate_bwd(st, n_t, dy, g_raw, dt_bias, dg_out, A, lower_bound, o_k, m_k,
              HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
              USE_LOWER_BOUND: tl.constexpr):
    """B9 on rows st .. st + BC - 1 (the kernel passes the whole chunk): dy (d loss / d
    log-decay, fp32) to the raw gate's gradient, written in the raw gate's dtype; returns
    these rows' dA_log sum and their [BK] sum of the written (rounded) gradient, dt_bias's."""
    rows = st + tl.arange(0, BC)
    m_rk = (rows < n_t)[:, None] & m_k[None, :]
    p = rows[:, None] * (HV * K) + o_k[None, :]
    x = tl.load(g_raw + p, mask=m_rk, other=0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dt_bias + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
    if USE_LOWER_BOUND:
        sg = tl.sigmoid(A * x)
        dx = dy * (lower_bound * sg * (1.0 - sg)) * A
        da = tl.sum(tl.sum(tl.where(m_rk, dx * x, 0.0), axis=1), axis=0)
    else:
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        dx = -A * (dy * tl.sigmoid(x))
        da = tl.sum(tl.sum(tl.where(m_rk, dy * (-A * softplus), 0.0), axis=1), axis=0)
    dx_out = to(dx, dg_out.dtype.element_ty)
    tl.store(dg_out + p, dx_out, mask=m_rk)
    return da, tl.sum(tl.where(m_rk, dx_out.to(tl.float32), 0.0), axis=0)


@triton.jit
def _block_rows(dAqk, dAkk, k, g, st, lo, ar, n_t, o_k, m_k, g_c, acc_q, acc_kr,
               HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr):
    """The row role of column block j (columns st .. st + BC - 1) for every row r >= lo,
    through the block's row ar, e_j: sum_s dA[r, s] k_s exp2(e_j - g_s) as one [BT, BC] x
    [BC, BK] dot, times exp2(g_r - e_j). With ar the block's last row every k factor is <= 1
    and every row factor past the block too; within the block a row factor reaches 2^span,
    which is why lo is the block's own first row only when its span passed the guard. With
    ar the block's middle row (the half-chunk blocks) both reach 2^(half span) within it.
    ar comes from the caller, as _block_cols's does: computed in here, the same arithmetic
    is scheduled differently (the pairwise tier's sm_90a code changes)."""
    rows = tl.arange(0, BT)
    pos = tl.arange(0, BC)
    cols = st + pos
    m_c = cols < n_t
    e = _row(g, ar, SG, st < n_t, o_k, m_k)
    k_j = tl.load(k + cols[:, None] * SK + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0).to(tl.float32)
    g_j = tl.load(g + cols[:, None] * SG + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0)
    kx = k_j * tl.exp2(tl.where(m_c[:, None] & m_k[None, :], e[None, :] - g_j, float("-inf")))
    m_r = (rows < n_t) & (rows >= lo)
    m_q = m_r[:, None] & m_c[None, :] & (rows[:, None] >= cols[None, :])
    p_A = rows[:, None] * (HV * BT) + cols[None, :]
    a_q = tl.load(dAqk + p_A, mask=m_q, other=0)
    a_k = tl.load(dAkk + p_A, mask=m_q & (rows[:, None] > cols[None, :]), other=0)
    f = tl.exp2(tl.where(m_r[:, None] & m_k[None, :], g_c - e[None, :], float("-inf")))
    acc_q += f * dot3(a_q, kx)
    acc_kr += f * dot3(a_k, kx)
    return acc_q, acc_kr


@triton.jit
def _block_cols(dAqk, dAkk, q, k, g, beta, st, hi, ar, n_t, o_k, m_k, g_c, acc_c,
               HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr):
    """The column role of row block i (rows st .. st + BC - 1) for every column s < hi,
    through the block's row ar, a_i: sum_r dA[r, s] (q_r, beta_r k_r) exp2(g_r - a_i) as
    [BT, BC] x [BC, BK] dots of dA's rows of block i transposed, times exp2(a_i - g_s).
    With ar the block's first row every row factor is <= 1 and every column factor before
    the block too (at most 2^GUARD_SPAN within it); with its middle row both reach 2^(half
    span) within the block."""
    cols = tl.arange(0, BT)
    pos = tl.arange(0, BC)
    rows = st + pos
    m_r = rows < n_t
    a = _row(g, ar, SG, st < n_t, o_k, m_k)
    m_rk = m_r[:, None] & m_k[None, :]
    q_i = tl.load(q + rows[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
    k_i = tl.load(k + rows[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
    g_i = tl.load(g + rows[:, None] * SG + o_k[None, :], mask=m_rk, other=0)
    b_i = tl.load(beta + rows * HV, mask=m_r, other=0).to(tl.float32)
    f = tl.exp2(tl.where(m_rk, g_i - a[None, :], float("-inf")))
    m_s = (cols < n_t) & (cols < hi) & (st < n_t)  # (a is 0 for a block past the end)
    # dA's rows of block i, read along its rows (coalesced) and transposed on chip: [s, r]
    m_q = m_r[:, None] & m_s[None, :] & (rows[:, None] >= cols[None, :])
    p_A = rows[:, None] * (HV * BT) + cols[None, :]
    part = dot3(tl.trans(tl.load(dAqk + p_A, mask=m_q, other=0)), q_i * f)
    part = dot3(tl.trans(tl.load(dAkk + p_A, mask=m_q & (rows[:, None] > cols[None, :]), other=0)),
                (b_i[:, None] * k_i) * f, part)
    h = tl.exp2(tl.where(m_s[:, None] & m_k[None, :], a[None, :] - g_c, float("-inf")))
    acc_c += h * part
    return acc_c


@triton.jit
def _pairwise_diag_step(jj, q, k, g, beta, dAqk, dAkk, n_t, g_c, pair, o_k, m_k, acc_q, acc_kr, acc_c,
                    HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr):
    """Step jj of the pairwise diagonal, for the blocks whose span failed the guard (``pair``
    per row): every row r against s = (r's block start) + jj with exp2(g_r - g_s) <= 1 (row
    role), every column s against r = (s's block start) + jj with exp2(g_r - g_s) (column
    role); rows and columns gathered (L1), one exp2 tile per role."""
    t = tl.arange(0, BT)
    o = (t // BC) * BC + jj  # the partner row of each row
    m_o = (o < n_t) & (t < n_t) & pair
    m_ok = m_o[:, None] & m_k[None, :]
    k_o = tl.load(k + o[:, None] * SK + o_k[None, :], mask=m_ok, other=0).to(tl.float32)
    g_o = tl.load(g + o[:, None] * SG + o_k[None, :], mask=m_ok, other=0)
    # row role: r = t against s = o (o <= t)
    on = m_o & (o <= t)
    a_q = tl.load(dAqk + t * (HV * BT) + o, mask=on, other=0)
    a_k = tl.load(dAkk + t * (HV * BT) + o, mask=on & (o < t), other=0)
    e = tl.exp2(tl.where(on[:, None] & m_k[None, :], g_c - g_o, float("-inf")))
    acc_q += a_q[:, None] * k_o * e
    acc_kr += a_k[:, None] * k_o * e
    # column role: s = t against r = o (o >= t)
    on_c = m_o & (o >= t)
    q_o = tl.load(q + o[:, None] * SK + o_k[None, :], mask=m_ok, other=0).to(tl.float32)
    b_o = tl.load(beta + o * HV, mask=m_o, other=0).to(tl.float32)
    c_q = tl.load(dAqk + o * (HV * BT) + t, mask=on_c, other=0)
    c_k = tl.load(dAkk + o * (HV * BT) + t, mask=on_c & (o > t), other=0)
    e_c = tl.exp2(tl.where(on_c[:, None] & m_k[None, :], g_o - g_c, float("-inf")))
    acc_c += (c_q[:, None] * q_o + (c_k * b_o)[:, None] * k_o) * e_c
    return acc_q, acc_kr, acc_c


@triton.jit
def _chunk_sums(q, k, g, beta, dAqk, dAkk, n_t, t, g_c, gm, o_k, m_k,
                HV: tl.constexpr, BT: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr):
    """B7's three sums through one anchor for the whole chunk, its middle row gm (the caller
    checked every factor exp2(+-(g - gm)) within 2^GUARD_SPAN): each role one [BT, BT] x
    [BT, BK] dot per dA, the factor's other half applied once after."""
    m_t = t < n_t
    m_tk = m_t[:, None] & m_k[None, :]
    up = tl.exp2(tl.where(m_tk, gm[None, :] - g_c, float("-inf")))  # exp2(gm - g): <= 1 before the middle row
    down = tl.exp2(tl.where(m_tk, g_c - gm[None, :], float("-inf")))
    k_c = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    q_c = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_c = tl.load(beta + t * HV, mask=m_t, other=0).to(tl.float32)
    m_2 = m_t[:, None] & m_t[None, :]
    lower = m_2 & (t[:, None] >= t[None, :])
    strict = m_2 & (t[:, None] > t[None, :])
    p_A = t[:, None] * (HV * BT) + t[None, :]
    kx = k_c * up
    # each dA tile read along its rows for the row role; the column role's tiles ([s, r]) are
    # those transposed on chip, one tile live at a time
    a = tl.load(dAqk + p_A, mask=lower, other=0)
    acc_q = down * dot3(a, kx)
    acc_c = dot3(tl.trans(a), q_c * down)
    a = tl.load(dAkk + p_A, mask=strict, other=0)
    acc_kr = down * dot3(a, kx)
    acc_c = up * dot3(tl.trans(a), (b_c[:, None] * k_c) * down, acc_c)
    return acc_q, acc_kr, acc_c


@triton.jit
def _span(g, st, n_t, o_k, m_k, SG: tl.constexpr, BC: tl.constexpr, PAIRWISE: tl.constexpr):
    """Block st's gate span in this K slice: its first row minus its last, the largest over
    the channels (log2 units; inf with PAIRWISE, which sends every block pairwise)."""
    if PAIRWISE:
        return float("inf")
    first = _row(g, st, SG, st < n_t, o_k, m_k)
    last = _row(g, tl.minimum(st + BC, n_t) - 1, SG, st < n_t, o_k, m_k)
    return tl.max(first - last, axis=0)


@triton.jit
def intra_bwd_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg,
    dq2, dk2, dg2, db_part,
    g_raw, A_log, dt_bias, dA_part, dbias_part, lower_bound,
    cu_seqlens, chunk_indices, T, NT_ROWS, NT_ALL,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, PAIRWISE: tl.constexpr, CHUNK_ANCHOR: tl.constexpr,
    HALVES: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    """B7 and B8 on one (K slice, chunk, head), the chunk as one [BT, BK] tile per output, dg
    reverse-cumsummed within the chunk (fp32) into dg2; with GATE also B9: the raw gate's
    gradient into dg2 in its dtype, dA_log's and dt_bias's per-chunk partials into dA_part
    [NK, NT_ALL, HV] and dbias_part [NT_ALL, HV, K]. The tier flags (PAIRWISE, CHUNK_ANCHOR,
    HALVES) are the launcher's ``TIERS`` on every call; tests switch tiers off to hold each
    path to the others."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    row0 = bos + i_c * BT
    n_t = tl.minimum(T - i_c * BT, BT).to(tl.int32)
    tl.static_assert(BT == 4 * BC, "the per-block form is written for four blocks a chunk")
    SK: tl.constexpr = H * K
    SG: tl.constexpr = HV * K

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    dAqk += (row0 * HV + i_hv) * BT
    dAkk += (row0 * HV + i_hv) * BT
    off = (row0 * HV + i_hv) * K
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    t = tl.arange(0, BT)
    m_t = t < n_t
    m_tk = m_t[:, None] & m_k[None, :]
    g_c = tl.load(g + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0)
    # the epilogue's incoming dq, dk, dg asked of L2 while the dots run (7.15 ms against 7.36
    # without at prod8192_gate; the same bits)
    prefetch_rows(dq + off + i_k * BK, t, SG, m_t, BK)
    prefetch_rows(dk + off + i_k * BK, t, SG, m_t, BK)
    prefetch_rows(dg + off + i_k * BK, t, SG, m_t, BK)

    # Each block's gate span in this K slice (first row minus last): within GUARD_SPAN the
    # block's diagonal goes through the anchors with the rest (factors inside 2^+-GUARD_SPAN,
    # far inside fp32's normal range), past it pairwise (below).
    s0 = _span(g, 0, n_t, o_k, m_k, SG, BC, PAIRWISE)
    s1 = _span(g, BC, n_t, o_k, m_k, SG, BC, PAIRWISE)
    s2 = _span(g, 2 * BC, n_t, o_k, m_k, SG, BC, PAIRWISE)
    s3 = _span(g, 3 * BC, n_t, o_k, m_k, SG, BC, PAIRWISE)
    d0, d1, d2, d3 = s0 <= GUARD_SPAN, s1 <= GUARD_SPAN, s2 <= GUARD_SPAN, s3 <= GUARD_SPAN

    if CHUNK_ANCHOR:
        # one anchor for the whole chunk (its middle row) where every factor of the slice
        # stays within 2^GUARD_SPAN; the per-block sums below otherwise
        gm = _row(g, tl.minimum(BT // 2, n_t) - 1, SG, 0 < n_t, o_k, m_k)
        whole = tl.maximum(tl.max(_row(g, 0, SG, 0 < n_t, o_k, m_k) - gm, axis=0),
                           tl.max(gm - _row(g, n_t - 1, SG, 0 < n_t, o_k, m_k), axis=0)) <= GUARD_SPAN
    else:
        whole: tl.constexpr = False
    if HALVES:
        # the chunk's two 32-row halves, each through its own middle row, where the whole
        # chunk's anchor would pass the guard but each half's stays within it
        halves = tl.maximum(_half_span(g, 0, n_t, o_k, m_k, SG), _half_span(g, 2 * BC, n_t, o_k, m_k, SG)) <= GUARD_SPAN
    else:
        halves: tl.constexpr = False
    if whole:
        acc_q, acc_kr, acc_c = _chunk_sums(q, k, g, beta, dAqk, dAkk, n_t, t, g_c, gm, o_k, m_k, HV, BT, SK, SG)
    elif halves:
        acc_q = tl.zeros([BT, BK], dtype=tl.float32)
        acc_kr = tl.zeros([BT, BK], dtype=tl.float32)
        acc_c = tl.zeros([BT, BK], dtype=tl.float32)
        m0, m1 = tl.minimum(15, n_t - 1), tl.minimum(2 * BC + 15, n_t - 1)
        acc_q, acc_kr = _block_rows(dAqk, dAkk, k, g, 0, 0, m0, n_t, o_k, m_k, g_c, acc_q, acc_kr,
                                   HV, BT, 2 * BC, SK, SG)
        acc_q, acc_kr = _block_rows(dAqk, dAkk, k, g, 2 * BC, 2 * BC, m1, n_t, o_k, m_k, g_c, acc_q, acc_kr,
                                   HV, BT, 2 * BC, SK, SG)
        acc_c = _block_cols(dAqk, dAkk, q, k, g, beta, 0, 2 * BC, m0, n_t, o_k, m_k, g_c, acc_c, HV, BT, 2 * BC, SK, SG)
        acc_c = _block_cols(dAqk, dAkk, q, k, g, beta, 2 * BC, 4 * BC, m1, n_t, o_k, m_k, g_c, acc_c,
                           HV, BT, 2 * BC, SK, SG)
    else:
        acc_q = tl.zeros([BT, BK], dtype=tl.float32)
        acc_kr = tl.zeros([BT, BK], dtype=tl.float32)
        acc_c = tl.zeros([BT, BK], dtype=tl.float32)
        # row role: column block j's columns for rows from j's own block (guard passed) or the next
        acc_q, acc_kr = _block_rows(dAqk, dAkk, k, g, 0, tl.where(d0, 0, BC), _last(0, BC, n_t), n_t, o_k, m_k, g_c, acc_q, acc_kr,
                                   HV, BT, BC, SK, SG)
        acc_q, acc_kr = _block_rows(dAqk, dAkk, k, g, BC, tl.where(d1, BC, 2 * BC), _last(BC, BC, n_t), n_t, o_k, m_k, g_c, acc_q, acc_kr,
                                   HV, BT, BC, SK, SG)
        acc_q, acc_kr = _block_rows(dAqk, dAkk, k, g, 2 * BC, tl.where(d2, 2 * BC, 3 * BC), _last(2 * BC, BC, n_t), n_t, o_k, m_k, g_c, acc_q,
                                   acc_kr, HV, BT, BC, SK, SG)
        if d3:
            acc_q, acc_kr = _block_rows(dAqk, dAkk, k, g, 3 * BC, 3 * BC, _last(3 * BC, BC, n_t), n_t, o_k, m_k, g_c, acc_q, acc_kr,
                                       HV, BT, BC, SK, SG)
        # column role: row block i's rows for columns up to i's own block (guard passed) or before it
        acc_c = _block_cols(dAqk, dAkk, q, k, g, beta, BC, tl.where(d1, 2 * BC, BC), BC, n_t, o_k, m_k, g_c, acc_c,
                           HV, BT, BC, SK, SG)
        acc_c = _block_cols(dAqk, dAkk, q, k, g, beta, 2 * BC, tl.where(d2, 3 * BC, 2 * BC), 2 * BC, n_t, o_k, m_k, g_c, acc_c,
                           HV, BT, BC, SK, SG)
        acc_c = _block_cols(dAqk, dAkk, q, k, g, beta, 3 * BC, tl.where(d3, 4 * BC, 3 * BC), 3 * BC, n_t, o_k, m_k, g_c, acc_c,
                           HV, BT, BC, SK, SG)
        if d0:
            acc_c = _block_cols(dAqk, dAkk, q, k, g, beta, 0, BC, 0, n_t, o_k, m_k, g_c, acc_c, HV, BT, BC, SK, SG)
        if tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)) > GUARD_SPAN:
            blk = t // BC
            pair = tl.where(blk == 0, s0, tl.where(blk == 1, s1, tl.where(blk == 2, s2, s3))) > GUARD_SPAN
            for jj in range(0, BC):
                acc_q, acc_kr, acc_c = _pairwise_diag_step(jj, q, k, g, beta, dAqk, dAkk, n_t, g_c, pair, o_k, m_k,
                                                       acc_q, acc_kr, acc_c, HV, BT, BC, SK, SG)

    # outputs: db's partial for this K slice; dq, dk, dg (input + intra part)
    p = off + t[:, None] * SG + o_k[None, :]
    q_c = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    k_c = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_c = tl.load(beta + t * HV, mask=m_t, other=0).to(tl.float32)
    tl.store(db_part + i_k * NT_ROWS + (row0 + t) * HV + i_hv, tl.sum(acc_kr * k_c, axis=1), mask=m_t)
    acc_kr *= b_c[:, None]
    tl.store(dq2 + p, tl.load(dq + p, mask=m_tk, other=0) + acc_q, mask=m_tk)
    tl.store(dk2 + p, tl.load(dk + p, mask=m_tk, other=0) + acc_kr + acc_c, mask=m_tk)
    b_dg = tl.load(dg + p, mask=m_tk, other=0) + q_c * acc_q + k_c * (acc_kr - acc_c)
    # B8: each row's dg summed with every later row's of the chunk (rows past the end are 0)
    b_dg = tl.cumsum(tl.where(m_tk, b_dg, 0.0), axis=0, reverse=True)
    if GATE:
        # B9 (dg2 has the raw gate's dtype here), its parameter sums per chunk
        A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_BIAS:
            dt_bias += i_hv * K
        da, dbias = _gate_bwd(0, n_t, b_dg, g_raw + off, dt_bias, dg2 + off, A, lower_bound, o_k, m_k, HV, K, BT,
                              HAS_BIAS, USE_LOWER_BOUND)
        tl.store(dA_part + (i_k * NT_ALL + i_tg) * HV + i_hv, da)
        if HAS_BIAS:
            tl.store(dbias_part + (i_tg * HV + i_hv) * K + o_k, dbias, mask=m_k)
    else:
        tl.store(dg2 + p, b_dg, mask=m_tk)


# The pinned config. sm_90a (K=128, H=HV=16): 255 registers, 144 B of spills (152 reloaded with
# B9; K=64: 136), 40 KB of shared memory: two programs an SM. Measured at prod8192_gate:
# 16-channel slices 10.53 ms and 8 warps 13.41 against 7.49 at this config (docs/log/b7.md).
CONFIG = dict(BK=32, num_warps=4, num_stages=1)
# What ``config`` may set (the benchmarks' sweeps; a call runs the pinned config).
CONFIG_KEYS = frozenset({"BK", "num_warps", "num_stages", "maxnreg"})
# The tiers every call takes: the chunk anchor, the half-chunk anchors and the per-block form
# (with a block's diagonal pairwise past the guard). Without the halves the unit measured 9.16
# ms against 9.03 at prod8192_gate, the whole op 33.40 against 33.00 (docs/log/b7.md). The
# tests switch tiers off (``_tiers``) to hold each path to the others bit for bit where both
# take it.
TIERS = dict(PAIRWISE=False, CHUNK_ANCHOR=True, HALVES=True)


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
              cu_seqlens, chunk_indices, config: dict | None = None, _tiers: dict | None = None):
    """B7, B8 and (with ``A_log``) B9 with fla's contracts: (dq, dk, db, dg, dA_log, ddt_bias).
    dq, dk and db (fp32, at value heads) are the inputs plus the vector-Jacobian product of
    Aqk and Akk with dAqk and dAkk. Without ``A_log`` (a pre-computed gate) dg is B8's, the
    within-chunk reverse cumsum of B7's dg (fp32), and the last two are None; with it (the
    gate in the op: ``g`` the raw gate, ``dt_bias`` or None, ``lower_bound`` or None) dg is
    B9's in g's dtype, with dA_log's and dt_bias's gradients. Exact for any gate
    (``safe_gate`` changes nothing). ``config`` overrides the pinned launch config
    (``CONFIG_KEYS``)."""
    for name, t in dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, g=g,
                        A_log=A_log, dt_bias=dt_bias).items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"B7-B9's kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    cfg = config_over(CONFIG, config, CONFIG_KEYS, "B7-B9")
    B, T, H, K = k.shape
    HV = gc.shape[2]
    BK = min(cfg["BK"], triton.next_power_of_2(K))
    NK = triton.cdiv(K, BK)
    NT = triton.cdiv(T, chunk_size) if cu_seqlens is None else len(chunk_indices)
    NT_ALL = NT * (B if cu_seqlens is None else 1)
    dev = k.device
    gate = A_log is not None
    dq2 = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
    dk2 = torch.empty_like(dq2)
    dg2 = torch.empty(B, T, HV, K, device=dev, dtype=g.dtype if gate else torch.float32)
    # db's per-slice partials and the gate parameters' per-chunk partials, summed in a fixed
    # order below: deterministic, no atomics
    db_part = torch.empty(NK, B, T, HV, device=dev, dtype=torch.float32)
    dA_part = torch.empty(NK, NT_ALL, HV, device=dev, dtype=torch.float32) if gate else None
    dbias_part = torch.empty(NT_ALL, HV, K, device=dev, dtype=torch.float32) if gate and dt_bias is not None else None
    intra_bwd_kernel[(NK, NT, B * HV)](
        q=q, k=k, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, dg=dg, dq2=dq2, dk2=dk2, dg2=dg2,
        db_part=db_part, g_raw=g if gate else None, A_log=A_log, dt_bias=dt_bias if gate else None,
        dA_part=dA_part, dbias_part=dbias_part, lower_bound=0.0 if lower_bound is None or not gate else float(lower_bound),
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, NT_ROWS=B * T * HV, NT_ALL=NT_ALL,
        H=H, HV=HV, K=K, BT=chunk_size, BC=BC, BK=BK, IS_VARLEN=cu_seqlens is not None, **{**TIERS, **(_tiers or {})},
        GATE=gate, HAS_BIAS=gate and dt_bias is not None, USE_LOWER_BOUND=gate and lower_bound is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    db2 = db.float() + (db_part[0] if NK == 1 else db_part.sum(0))
    dA_log = ddt_bias = None
    if gate:
        dA_log = dA_part.sum((0, 1)).view_as(A_log).to(A_log.dtype)
        if dt_bias is not None:
            ddt_bias = dbias_part.sum(0).view_as(dt_bias).to(dt_bias.dtype)
    return dq2, dk2, db2, dg2, dA_log, ddt_bias


def supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
             cu_seqlens, chunk_indices):
    """None when ``intra_bwd`` takes the B7-B9 unit, else why B7, B8 and B9 run as fla's."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (B7's kernel is built for 64)"
    return None
