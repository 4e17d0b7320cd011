"""B7, the intra-chunk backward: gradients through Aqk and Akk into dq, dk, db and dg.

Replaces fla's ``chunk_kda_bwd_kernel_intra`` (15.1 ms at prod8192_gate on the H200, 37%
of kernel-fun's fwd+bwd, 6.6x its 2.28 ms memory floor; 7.9 ms with safe_gate). fla runs
one program per (16-row sub-chunk, 32-channel K slice, chunk, head): 524,288 programs at
prod8192_gate, each reloading its neighbours' q, k, g and dA tiles, and the diagonal 16x16
blocks run two 16-step loops on CUDA cores over the whole square.

For a row r and an earlier column s the factor is e^(G_r - G_s) = exp2(g_r - g_s), with g
the chunk cumsum (log2 units, non-increasing along the chunk). Across 16-row blocks it is
taken through the block boundaries, where every factor is one-sided: block i's rows
against earlier columns through i's first row a_i (exp2(g_r - a_i) * exp2(a_i - g_s), both
<= 1), block j's columns against later rows through j's last row e_j.

This design (the block form): one program per (K slice, chunk-head), 4 warps; the chunk's
four 16-row blocks as separate [16, BK] tiles and all 20 [16, 16] dA blocks of the lower
triangle loaded at the start, each block pair (i, j < i) one [16, 16] x [16, BK] dot per
role (mma.sync), no global load between dots. The diagonal blocks: pairwise on CUDA cores,
the four blocks' 16 steps interleaved, one exp2 per (r >= s, channel) and role
(``blocks``) or one per pair with the column role summed over the block
(``blocks-shared``); through the anchors with safe_gate (``blocks-anchored``, tf32 dots,
as fla's safe_gate form); or ``blocks-guarded``: through the anchors, in tf32x3, where
every block's gate span in the slice is at most GUARD_SPAN (2^96: fp32 holds every
factor), pairwise otherwise, so any gate is exact. db is summed over the K slices'
partials in slice order (no atomics). ``intra_bwd_tail`` adds B8 and B9 in the same pass
(the chain's B7-B9 unit).

Where the first form lost (bench/results/stages.jsonl at a7cdba7; docs/log/b7.md, which
keeps its record): one program per chunk-head walking K with [64, 64] x [64, BK] dots
masked to one block at a time measured 20.1 ms at best at prod8192_gate (fla 15.1) and
16.0 anchored with safe_gate (fla 7.9): every block iteration reloaded its dA tiles and
waited on them, one 255-register program per SM with nothing to hide the wait.

Numerics: fp32 throughout; the off-diagonal dots in tf32 as fla's. The pairwise and
guarded designs keep the one-sided law for any gate; the anchored one rests on safe_gate's
bound and the launcher refuses it without it. Outputs are fresh tensors (input + intra
part): no output is read back, so relaunching is idempotent.

Falls back (``supports``): chunk size other than 64.

Resources (sm_90a, K=128, BK=32, 4 warps): 255 registers, 16-84 B of spills (anchored
264), two programs an SM. Predicted (docs/log/b7.md): blocks 4-6 ms, blocks-guarded
2.5-3.5 at prod8192_gate; not yet measured.

Not registered: the chain keeps fla's B7 until a design beats it on the H200
(tests/test_gpu.py holds every design to fla's stage; tests/test_intra_bwd.py to the
float64 stage in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import chunk_coords, dot, to

BC = 16  # the diagonal block
GUARD_SPAN = tl.constexpr(64.0)  # blocks-guarded: the largest in-block gate span (log2) taken through anchors


# --------------------------------------------------------------------------------------
# The block form: one program per (K slice, chunk, head), the chunk as four 16-row tiles
# --------------------------------------------------------------------------------------
@triton.jit
def _tile(ptr, st, stride, n_t, o_k, m_k, BC: tl.constexpr):
    """Rows st .. st + BC - 1 of the chunk (zeros past its end), channels o_k, in the input's
    dtype (q and k stay bf16 in registers: half the registers of fp32)."""
    rows = st + tl.arange(0, BC)
    return tl.load(ptr + rows[:, None] * stride + o_k[None, :], mask=(rows < n_t)[:, None] & m_k[None, :], other=0)


@triton.jit
def _row(ptr, r, stride, ok, o_k, m_k):
    return tl.load(ptr + r * stride + o_k, mask=m_k & ok, other=0).to(tl.float32)


@triton.jit
def _dot(a, b, PRECISE: tl.constexpr):
    """fp32 x fp32 on the tensor cores: tf32 (as fla's off-diagonal dots), or with PRECISE
    three tf32 products (tf32x3: fp32-level accuracy, as fla's CUDA-core diagonal)."""
    if PRECISE:
        return tl.dot(a, b, input_precision="tf32x3")
    return tl.dot(a, b)


@triton.jit
def _pair(dAqk, dAkk, st_i, st_j, n_t, k_j, g_j, q_i, k_i, g_i, beta_i, a_i, e_j, acc_q, acc_kr, acc_c,
          HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SAME: tl.constexpr, PRECISE: tl.constexpr = False):
    """Block i's rows against block j's columns (j < i; or j == i, SAME, anchored form only):
    the row role through a_i (block i's first row: exp2(g_r - a_i) * exp2(a_i - g_s)), the
    column role through e_j (block j's last row: exp2(g_r - e_j) * exp2(e_j - g_s)). For
    j < i every factor is <= 1; the scales exp2(g_r - a_i) and exp2(e_j - g_s) are applied
    once per block afterwards."""
    pos = tl.arange(0, BC)
    rows, cols = st_i + pos, st_j + pos
    m_r, m_c = rows < n_t, cols < n_t
    m_q = m_r[:, None] & m_c[None, :]
    m_kk = m_q
    if SAME:
        m_q = m_q & (pos[:, None] >= pos[None, :])
        m_kk = m_q & (pos[:, None] > pos[None, :])
    p_A = rows[:, None] * (HV * BT) + cols[None, :]
    b_Aq = tl.load(dAqk + p_A, mask=m_q, other=0).to(tl.float32)
    b_Ak = tl.load(dAkk + p_A, mask=m_kk, other=0).to(tl.float32)
    kx = k_j.to(tl.float32) * tl.exp2(tl.where(m_c[:, None] & (st_i < n_t), a_i[None, :] - g_j, float("-inf")))
    acc_q += _dot(b_Aq, kx, PRECISE)
    acc_kr += _dot(b_Ak, kx, PRECISE)
    f = tl.exp2(tl.where(m_r[:, None], g_i - e_j[None, :], float("-inf")))
    acc_c += (_dot(tl.trans(b_Aq), q_i.to(tl.float32) * f, PRECISE)
              + _dot(tl.trans(b_Ak), (beta_i[:, None] * k_i.to(tl.float32)) * f, PRECISE))
    return acc_q, acc_kr, acc_c


@triton.jit
def _diag_step(jj, q, k, g, beta, dAqk, dAkk, st, n_t, q_i, k_i, g_i, beta_i, o_k, m_k, dq_i, dkr_i, dkc_i,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               SHARED_EXP: tl.constexpr):
    """Step jj of block i's own pairs (r >= s, both in the block), pairwise: s = st + jj
    against every row r >= s with the one-sided factor exp2(g_r - g_s) <= 1 for any gate.
    The row role adds to rows r; the column role of s either sums those same terms over r
    (SHARED_EXP: one exp2 tile a step) or takes row s's own pairs (r = s, columns s' <= s:
    their own exp2 tile, no reduction)."""
    pos = tl.arange(0, BC)
    m_i = st + pos < n_t
    s = st + jj
    m_s = s < n_t
    k_s = _row(k, s, H * K, m_s, o_k, m_k)
    g_s = _row(g, s, HV * K, m_s, o_k, m_k)
    on = m_i & (pos >= jj) & m_s
    a_q = tl.load(dAqk + (st + pos) * (HV * BT) + s, mask=on, other=0).to(tl.float32)
    a_k = tl.load(dAkk + (st + pos) * (HV * BT) + s, mask=on & (pos > jj), other=0).to(tl.float32)
    e = tl.exp2(tl.where(on[:, None] & m_k[None, :], g_i - g_s[None, :], float("-inf")))
    dq_i += a_q[:, None] * k_s[None, :] * e
    dkr_i += a_k[:, None] * k_s[None, :] * e
    if SHARED_EXP:
        col = tl.sum((a_q[:, None] * q_i.to(tl.float32) + (a_k * beta_i)[:, None] * k_i.to(tl.float32)) * e, axis=0)
        dkc_i += tl.where((pos == jj)[:, None], col[None, :], 0.0)
    else:
        q_s = _row(q, s, H * K, m_s, o_k, m_k)
        b_s = tl.load(beta + s * HV, mask=m_s, other=0).to(tl.float32)
        on_c = m_i & (pos <= jj) & m_s
        c_q = tl.load(dAqk + s * (HV * BT) + st + pos, mask=on_c, other=0).to(tl.float32)  # dA's row s, contiguous
        c_k = tl.load(dAkk + s * (HV * BT) + st + pos, mask=on_c & (pos < jj), other=0).to(tl.float32)
        e_c = tl.exp2(tl.where(on_c[:, None] & m_k[None, :], g_s[None, :] - g_i, float("-inf")))
        dkc_i += (c_q[:, None] * q_s[None, :] + (c_k * b_s)[:, None] * k_s[None, :]) * e_c
    return dq_i, dkr_i, dkc_i


@triton.jit
def _scale(st, n_t, g_i, a_i, e_i, acc_q, acc_kr, acc_c, m_k, BC: tl.constexpr):
    """Block i's anchored sums at their true scale: the row role's times exp2(g_r - a_i) <= 1,
    the column role's times exp2(e_i - g_s) <= 1."""
    m_rk = ((st + tl.arange(0, BC)) < n_t)[:, None] & m_k[None, :]
    f = tl.exp2(tl.where(m_rk, g_i - a_i[None, :], float("-inf")))
    h = tl.exp2(tl.where(m_rk, e_i[None, :] - g_i, float("-inf")))
    return acc_q * f, acc_kr * f, acc_c * h


@triton.jit
def _finish(st, n_t, row0, i_k, q_i, k_i, beta_i, b_dq, b_dkr, b_dkc,
            dq, dk, dg, dq2, dk2, dg2, db_part, o_k, m_k, NT_ROWS,
            HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, TAIL: tl.constexpr):
    """Block i's outputs: db's partial for this K slice, dq and dk (input + intra part)
    written; dg (input + intra part) written, or returned for the tail (TAIL > 0)."""
    rows = st + tl.arange(0, BC)
    m_r = rows < n_t
    m_rk = m_r[:, None] & m_k[None, :]
    q_i = q_i.to(tl.float32)
    k_i = k_i.to(tl.float32)
    tl.store(db_part + i_k * NT_ROWS + (row0 + rows) * HV, tl.sum(b_dkr * k_i, axis=1), mask=m_r)
    b_dkr *= beta_i[:, None]
    p = rows[:, None] * (HV * K) + o_k[None, :]
    tl.store(dq2 + p, tl.load(dq + p, mask=m_rk, other=0) + b_dq, mask=m_rk)
    tl.store(dk2 + p, tl.load(dk + p, mask=m_rk, other=0) + b_dkr + b_dkc, mask=m_rk)
    b_dg = tl.load(dg + p, mask=m_rk, other=0) + q_i * b_dq + k_i * (b_dkr - b_dkc)
    if TAIL == 0:
        tl.store(dg2 + p, b_dg, mask=m_rk)
    return tl.where(m_rk, b_dg, 0.0)


@triton.jit
def _gate_bwd(st, n_t, dy, g_raw, dt_bias, dg_out, A, lower_bound, o_k, m_k,
              HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
              USE_LOWER_BOUND: tl.constexpr):
    """B9 on block i: dy (d loss / d log-decay, fp32) to the raw gate's gradient, written in
    the raw gate's dtype; returns this block's dA_log sum and its [BK] sum of the written
    (rounded) gradient, dt_bias's."""
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
def intra_bwd_blocks_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg,
    dq2, dk2, dg2, db_part,
    g_raw, A_log, dt_bias, dA_part, dbias_part, lower_bound,
    cu_seqlens, chunk_indices, T, NT_ROWS, NT_ALL,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, ANCHORED: tl.constexpr, SHARED_EXP: tl.constexpr,
    GUARDED: tl.constexpr, TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    """B7 on one (K slice, chunk, head); with TAIL 1 also B8 (dg reverse-cumsummed within the
    chunk, fp32, into dg2), with TAIL 2 also B9 (the raw gate's gradient into dg2 in its
    dtype; dA_log's and dt_bias's per-chunk partials into dA_part [NK, NT_ALL, HV] and
    dbias_part [NT_ALL, HV, K])."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    row0 = bos + i_c * BT
    n_t = tl.minimum(T - i_c * BT, BT).to(tl.int32)
    tl.static_assert(BT == 4 * BC, "the block form is written for four blocks a chunk")

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    dAqk += (row0 * HV + i_hv) * BT
    dAkk += (row0 * HV + i_hv) * BT
    off = (row0 * HV + i_hv) * K
    db_part += i_hv
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    pos = tl.arange(0, BC)
    SQ: tl.constexpr = H * K
    SG: tl.constexpr = HV * K

    q0, k0, g0 = _tile(q, 0, SQ, n_t, o_k, m_k, BC), _tile(k, 0, SQ, n_t, o_k, m_k, BC), _tile(g, 0, SG, n_t, o_k, m_k, BC)
    q1, k1, g1 = _tile(q, BC, SQ, n_t, o_k, m_k, BC), _tile(k, BC, SQ, n_t, o_k, m_k, BC), _tile(g, BC, SG, n_t, o_k, m_k, BC)
    q2, k2, g2 = (_tile(q, 2 * BC, SQ, n_t, o_k, m_k, BC), _tile(k, 2 * BC, SQ, n_t, o_k, m_k, BC),
                  _tile(g, 2 * BC, SG, n_t, o_k, m_k, BC))
    q3, k3, g3 = (_tile(q, 3 * BC, SQ, n_t, o_k, m_k, BC), _tile(k, 3 * BC, SQ, n_t, o_k, m_k, BC),
                  _tile(g, 3 * BC, SG, n_t, o_k, m_k, BC))
    b0 = tl.load(beta + pos * HV, mask=pos < n_t, other=0).to(tl.float32)
    b1 = tl.load(beta + (BC + pos) * HV, mask=BC + pos < n_t, other=0).to(tl.float32)
    b2 = tl.load(beta + (2 * BC + pos) * HV, mask=2 * BC + pos < n_t, other=0).to(tl.float32)
    b3 = tl.load(beta + (3 * BC + pos) * HV, mask=3 * BC + pos < n_t, other=0).to(tl.float32)
    # each block's first row (a_i) and last row inside the chunk (e_i)
    a0, e0 = _row(g, 0, SG, 0 < n_t, o_k, m_k), _row(g, tl.minimum(BC, n_t) - 1, SG, 0 < n_t, o_k, m_k)
    a1, e1 = _row(g, BC, SG, BC < n_t, o_k, m_k), _row(g, tl.minimum(2 * BC, n_t) - 1, SG, BC < n_t, o_k, m_k)
    a2, e2 = _row(g, 2 * BC, SG, 2 * BC < n_t, o_k, m_k), _row(g, tl.minimum(3 * BC, n_t) - 1, SG, 2 * BC < n_t, o_k, m_k)
    a3, e3 = _row(g, 3 * BC, SG, 3 * BC < n_t, o_k, m_k), _row(g, tl.minimum(4 * BC, n_t) - 1, SG, 3 * BC < n_t, o_k, m_k)

    z = tl.zeros([BC, BK], dtype=tl.float32)
    aq0, ar0, ac0 = z, z, z
    aq1, ar1, ac1 = z, z, z
    aq2, ar2, ac2 = z, z, z
    aq3, ar3, ac3 = z, z, z
    if ANCHORED:  # safe_gate: the diagonal blocks through the same anchors
        aq0, ar0, ac0 = _pair(dAqk, dAkk, 0, 0, n_t, k0, g0, q0, k0, g0, b0, a0, e0, aq0, ar0, ac0, HV, BT, BC, True)
        aq1, ar1, ac1 = _pair(dAqk, dAkk, BC, BC, n_t, k1, g1, q1, k1, g1, b1, a1, e1, aq1, ar1, ac1, HV, BT, BC, True)
        aq2, ar2, ac2 = _pair(dAqk, dAkk, 2 * BC, 2 * BC, n_t, k2, g2, q2, k2, g2, b2, a2, e2, aq2, ar2, ac2,
                              HV, BT, BC, True)
        aq3, ar3, ac3 = _pair(dAqk, dAkk, 3 * BC, 3 * BC, n_t, k3, g3, q3, k3, g3, b3, a3, e3, aq3, ar3, ac3,
                              HV, BT, BC, True)
    # (i, j): row accumulators of i, column accumulator of j
    aq1, ar1, ac0 = _pair(dAqk, dAkk, BC, 0, n_t, k0, g0, q1, k1, g1, b1, a1, e0, aq1, ar1, ac0, HV, BT, BC, False)
    aq2, ar2, ac0 = _pair(dAqk, dAkk, 2 * BC, 0, n_t, k0, g0, q2, k2, g2, b2, a2, e0, aq2, ar2, ac0, HV, BT, BC, False)
    aq2, ar2, ac1 = _pair(dAqk, dAkk, 2 * BC, BC, n_t, k1, g1, q2, k2, g2, b2, a2, e1, aq2, ar2, ac1, HV, BT, BC, False)
    aq3, ar3, ac0 = _pair(dAqk, dAkk, 3 * BC, 0, n_t, k0, g0, q3, k3, g3, b3, a3, e0, aq3, ar3, ac0, HV, BT, BC, False)
    aq3, ar3, ac1 = _pair(dAqk, dAkk, 3 * BC, BC, n_t, k1, g1, q3, k3, g3, b3, a3, e1, aq3, ar3, ac1, HV, BT, BC, False)
    aq3, ar3, ac2 = _pair(dAqk, dAkk, 3 * BC, 2 * BC, n_t, k2, g2, q3, k3, g3, b3, a3, e2, aq3, ar3, ac2,
                          HV, BT, BC, False)

    span = 0.0
    if GUARDED:
        # The diagonal blocks through the anchors where every block's gate spans at most
        # GUARD_SPAN (log2) over its rows in this K slice: its factors then stay inside
        # 2^(+-GUARD_SPAN), far inside fp32; the dots in tf32x3. Else pairwise, below.
        span = tl.maximum(tl.maximum(tl.max(a0 - e0, axis=0), tl.max(a1 - e1, axis=0)),
                          tl.maximum(tl.max(a2 - e2, axis=0), tl.max(a3 - e3, axis=0)))
        if span <= GUARD_SPAN:
            aq0, ar0, ac0 = _pair(dAqk, dAkk, 0, 0, n_t, k0, g0, q0, k0, g0, b0, a0, e0, aq0, ar0, ac0,
                                  HV, BT, BC, True, True)
            aq1, ar1, ac1 = _pair(dAqk, dAkk, BC, BC, n_t, k1, g1, q1, k1, g1, b1, a1, e1, aq1, ar1, ac1,
                                  HV, BT, BC, True, True)
            aq2, ar2, ac2 = _pair(dAqk, dAkk, 2 * BC, 2 * BC, n_t, k2, g2, q2, k2, g2, b2, a2, e2, aq2, ar2, ac2,
                                  HV, BT, BC, True, True)
            aq3, ar3, ac3 = _pair(dAqk, dAkk, 3 * BC, 3 * BC, n_t, k3, g3, q3, k3, g3, b3, a3, e3, aq3, ar3, ac3,
                                  HV, BT, BC, True, True)
    aq0, ar0, ac0 = _scale(0, n_t, g0, a0, e0, aq0, ar0, ac0, m_k, BC)
    aq1, ar1, ac1 = _scale(BC, n_t, g1, a1, e1, aq1, ar1, ac1, m_k, BC)
    aq2, ar2, ac2 = _scale(2 * BC, n_t, g2, a2, e2, aq2, ar2, ac2, m_k, BC)
    aq3, ar3, ac3 = _scale(3 * BC, n_t, g3, a3, e3, aq3, ar3, ac3, m_k, BC)
    if (not ANCHORED) and ((not GUARDED) or span > GUARD_SPAN):
        # the four diagonal blocks pairwise, one step of each per iteration (independent work)
        for jj in range(0, BC):
            aq0, ar0, ac0 = _diag_step(jj, q, k, g, beta, dAqk, dAkk, 0, n_t, q0, k0, g0, b0, o_k, m_k,
                                       aq0, ar0, ac0, H, HV, K, BT, BC, SHARED_EXP)
            aq1, ar1, ac1 = _diag_step(jj, q, k, g, beta, dAqk, dAkk, BC, n_t, q1, k1, g1, b1, o_k, m_k,
                                       aq1, ar1, ac1, H, HV, K, BT, BC, SHARED_EXP)
            aq2, ar2, ac2 = _diag_step(jj, q, k, g, beta, dAqk, dAkk, 2 * BC, n_t, q2, k2, g2, b2, o_k, m_k,
                                       aq2, ar2, ac2, H, HV, K, BT, BC, SHARED_EXP)
            aq3, ar3, ac3 = _diag_step(jj, q, k, g, beta, dAqk, dAkk, 3 * BC, n_t, q3, k3, g3, b3, o_k, m_k,
                                       aq3, ar3, ac3, H, HV, K, BT, BC, SHARED_EXP)

    dq += off
    dk += off
    dg += off
    dq2 += off
    dk2 += off
    dg2 += off
    t0 = _finish(0, n_t, row0, i_k, q0, k0, b0, aq0, ar0, ac0, dq, dk, dg, dq2, dk2, dg2, db_part, o_k, m_k,
                 NT_ROWS, HV, K, BC, TAIL)
    t1 = _finish(BC, n_t, row0, i_k, q1, k1, b1, aq1, ar1, ac1, dq, dk, dg, dq2, dk2, dg2, db_part, o_k, m_k,
                 NT_ROWS, HV, K, BC, TAIL)
    t2 = _finish(2 * BC, n_t, row0, i_k, q2, k2, b2, aq2, ar2, ac2, dq, dk, dg, dq2, dk2, dg2, db_part, o_k, m_k,
                 NT_ROWS, HV, K, BC, TAIL)
    t3 = _finish(3 * BC, n_t, row0, i_k, q3, k3, b3, aq3, ar3, ac3, dq, dk, dg, dq2, dk2, dg2, db_part, o_k, m_k,
                 NT_ROWS, HV, K, BC, TAIL)
    if TAIL > 0:
        # B8: each row's dg summed with every later row's of the chunk (rows past the end are 0)
        s3 = tl.sum(t3, axis=0)
        s2 = s3 + tl.sum(t2, axis=0)
        s1 = s2 + tl.sum(t1, axis=0)
        t3 = tl.cumsum(t3, axis=0, reverse=True)
        t2 = tl.cumsum(t2, axis=0, reverse=True) + s3[None, :]
        t1 = tl.cumsum(t1, axis=0, reverse=True) + s2[None, :]
        t0 = tl.cumsum(t0, axis=0, reverse=True) + s1[None, :]
        if TAIL == 1:
            p = pos[:, None] * (HV * K) + o_k[None, :]
            tl.store(dg2 + p, t0, mask=(pos < n_t)[:, None] & m_k[None, :])
            tl.store(dg2 + BC * (HV * K) + p, t1, mask=(BC + pos < n_t)[:, None] & m_k[None, :])
            tl.store(dg2 + 2 * BC * (HV * K) + p, t2, mask=(2 * BC + pos < n_t)[:, None] & m_k[None, :])
            tl.store(dg2 + 3 * BC * (HV * K) + p, t3, mask=(3 * BC + pos < n_t)[:, None] & m_k[None, :])
        else:
            # B9 (dg2 has the raw gate's dtype here), its parameter sums per chunk
            g_raw += off
            A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
            if HAS_BIAS:
                dt_bias += i_hv * K
            da0, db0 = _gate_bwd(0, n_t, t0, g_raw, dt_bias, dg2, A, lower_bound, o_k, m_k, HV, K, BC, HAS_BIAS,
                                 USE_LOWER_BOUND)
            da1, db1 = _gate_bwd(BC, n_t, t1, g_raw, dt_bias, dg2, A, lower_bound, o_k, m_k, HV, K, BC, HAS_BIAS,
                                 USE_LOWER_BOUND)
            da2, db2 = _gate_bwd(2 * BC, n_t, t2, g_raw, dt_bias, dg2, A, lower_bound, o_k, m_k, HV, K, BC,
                                 HAS_BIAS, USE_LOWER_BOUND)
            da3, db3 = _gate_bwd(3 * BC, n_t, t3, g_raw, dt_bias, dg2, A, lower_bound, o_k, m_k, HV, K, BC,
                                 HAS_BIAS, USE_LOWER_BOUND)
            tl.store(dA_part + (i_k * NT_ALL + i_tg) * HV + i_hv, (da0 + da1) + (da2 + da3))
            tl.store(dbias_part + (i_tg * HV + i_hv) * K + o_k, (db0 + db1) + (db2 + db3), mask=m_k)


# --------------------------------------------------------------------------------------
# The wide form: one program per (K slice, chunk, head), every dot over the whole chunk
# --------------------------------------------------------------------------------------
@triton.jit
def _wide_rows(dAqk, dAkk, k, g, st, lo, n_t, o_k, m_k, g_c, acc_q, acc_kr,
               HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr,
               PRECISE: tl.constexpr):
    """The row role of column block j (columns st .. st + BC - 1) for every row r >= lo,
    through the block's last row e_j: sum_s dA[r, s] k_s exp2(e_j - g_s) (every factor <= 1)
    as one [BT, BC] x [BC, BK] dot, times exp2(g_r - e_j) (<= 1 past the block; within it
    at most 2^GUARD_SPAN, which is why lo is the block's own first row only when its span
    passed the guard)."""
    rows = tl.arange(0, BT)
    pos = tl.arange(0, BC)
    cols = st + pos
    m_c = cols < n_t
    e = _row(g, tl.minimum(st + BC, n_t) - 1, SG, st < n_t, o_k, m_k)
    k_j = tl.load(k + cols[:, None] * SK + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0).to(tl.float32)
    g_j = tl.load(g + cols[:, None] * SG + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0)
    kx = k_j * tl.exp2(tl.where(m_c[:, None] & m_k[None, :], e[None, :] - g_j, float("-inf")))
    m_r = (rows < n_t) & (rows >= lo)
    m_q = m_r[:, None] & m_c[None, :] & (rows[:, None] >= cols[None, :])
    p_A = rows[:, None] * (HV * BT) + cols[None, :]
    a_q = tl.load(dAqk + p_A, mask=m_q, other=0)
    a_k = tl.load(dAkk + p_A, mask=m_q & (rows[:, None] > cols[None, :]), other=0)
    f = tl.exp2(tl.where(m_r[:, None] & m_k[None, :], g_c - e[None, :], float("-inf")))
    acc_q += f * _dot(a_q, kx, PRECISE)
    acc_kr += f * _dot(a_k, kx, PRECISE)
    return acc_q, acc_kr


@triton.jit
def _wide_cols(dAqk, dAkk, q, k, g, beta, st, hi, n_t, o_k, m_k, g_c, acc_c,
               HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr,
               PRECISE: tl.constexpr):
    """The column role of row block i (rows st .. st + BC - 1) for every column s < hi,
    through the block's first row a_i: sum_r dA[r, s] (q_r, beta_r k_r) exp2(g_r - a_i)
    (every factor <= 1) as [BT, BC] x [BC, BK] dots of dA's transposed rows, times
    exp2(a_i - g_s) (<= 1 before the block, at most 2^GUARD_SPAN within it)."""
    cols = tl.arange(0, BT)
    pos = tl.arange(0, BC)
    rows = st + pos
    m_r = rows < n_t
    a = _row(g, st, SG, st < n_t, o_k, m_k)
    m_rk = m_r[:, None] & m_k[None, :]
    q_i = tl.load(q + rows[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
    k_i = tl.load(k + rows[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
    g_i = tl.load(g + rows[:, None] * SG + o_k[None, :], mask=m_rk, other=0)
    b_i = tl.load(beta + rows * HV, mask=m_r, other=0).to(tl.float32)
    f = tl.exp2(tl.where(m_rk, g_i - a[None, :], float("-inf")))
    m_s = (cols < n_t) & (cols < hi) & (st < n_t)  # (a is 0 for a block past the end)
    m_q = m_s[:, None] & m_r[None, :] & (rows[None, :] >= cols[:, None])
    p_At = rows[None, :] * (HV * BT) + cols[:, None]  # [s, r]: dA's rows of block i, transposed
    at_q = tl.load(dAqk + p_At, mask=m_q, other=0)
    at_k = tl.load(dAkk + p_At, mask=m_q & (rows[None, :] > cols[:, None]), other=0)
    h = tl.exp2(tl.where(m_s[:, None] & m_k[None, :], a[None, :] - g_c, float("-inf")))
    acc_c += h * (_dot(at_q, q_i * f, PRECISE) + _dot(at_k, (b_i[:, None] * k_i) * f, PRECISE))
    return acc_c


@triton.jit
def _wide_diag_step(jj, q, k, g, beta, dAqk, dAkk, n_t, g_c, pair, o_k, m_k, acc_q, acc_kr, acc_c,
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
def intra_bwd_wide_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg,
    dq2, dk2, dg2, db_part,
    g_raw, A_log, dt_bias, dA_part, dbias_part, lower_bound,
    cu_seqlens, chunk_indices, T, NT_ROWS, NT_ALL,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISE: tl.constexpr,
    TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    """B7 on one (K slice, chunk, head), the chunk as one [BT, BK] tile per output; with
    TAIL 1 also B8 (dg reverse-cumsummed within the chunk, fp32, into dg2), with TAIL 2 also
    B9 (the raw gate's gradient into dg2 in its dtype; dA_log's and dt_bias's per-chunk
    partials into dA_part [NK, NT_ALL, HV] and dbias_part [NT_ALL, HV, K])."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    row0 = bos + i_c * BT
    n_t = tl.minimum(T - i_c * BT, BT).to(tl.int32)
    tl.static_assert(BT == 4 * BC, "the wide form is written for four blocks a chunk")
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

    # Each block's gate span in this K slice (first row minus last): within GUARD_SPAN the
    # block's diagonal goes through the anchors with the rest (factors inside 2^+-GUARD_SPAN,
    # far inside fp32's normal range), past it pairwise (below).
    s0 = tl.max(_row(g, 0, SG, 0 < n_t, o_k, m_k) - _row(g, tl.minimum(BC, n_t) - 1, SG, 0 < n_t, o_k, m_k), axis=0)
    s1 = tl.max(_row(g, BC, SG, BC < n_t, o_k, m_k) - _row(g, tl.minimum(2 * BC, n_t) - 1, SG, BC < n_t, o_k, m_k),
                axis=0)
    s2 = tl.max(_row(g, 2 * BC, SG, 2 * BC < n_t, o_k, m_k)
                - _row(g, tl.minimum(3 * BC, n_t) - 1, SG, 2 * BC < n_t, o_k, m_k), axis=0)
    s3 = tl.max(_row(g, 3 * BC, SG, 3 * BC < n_t, o_k, m_k)
                - _row(g, tl.minimum(4 * BC, n_t) - 1, SG, 3 * BC < n_t, o_k, m_k), axis=0)
    d0, d1, d2, d3 = s0 <= GUARD_SPAN, s1 <= GUARD_SPAN, s2 <= GUARD_SPAN, s3 <= GUARD_SPAN

    acc_q = tl.zeros([BT, BK], dtype=tl.float32)
    acc_kr = tl.zeros([BT, BK], dtype=tl.float32)
    acc_c = tl.zeros([BT, BK], dtype=tl.float32)
    # row role: column block j's columns for rows from j's own block (guard passed) or the next
    acc_q, acc_kr = _wide_rows(dAqk, dAkk, k, g, 0, tl.where(d0, 0, BC), n_t, o_k, m_k, g_c, acc_q, acc_kr,
                               HV, BT, BC, SK, SG, PRECISE)
    acc_q, acc_kr = _wide_rows(dAqk, dAkk, k, g, BC, tl.where(d1, BC, 2 * BC), n_t, o_k, m_k, g_c, acc_q, acc_kr,
                               HV, BT, BC, SK, SG, PRECISE)
    acc_q, acc_kr = _wide_rows(dAqk, dAkk, k, g, 2 * BC, tl.where(d2, 2 * BC, 3 * BC), n_t, o_k, m_k, g_c, acc_q,
                               acc_kr, HV, BT, BC, SK, SG, PRECISE)
    if d3:
        acc_q, acc_kr = _wide_rows(dAqk, dAkk, k, g, 3 * BC, 3 * BC, n_t, o_k, m_k, g_c, acc_q, acc_kr,
                                   HV, BT, BC, SK, SG, PRECISE)
    # column role: row block i's rows for columns up to i's own block (guard passed) or before it
    acc_c = _wide_cols(dAqk, dAkk, q, k, g, beta, BC, tl.where(d1, 2 * BC, BC), n_t, o_k, m_k, g_c, acc_c,
                       HV, BT, BC, SK, SG, PRECISE)
    acc_c = _wide_cols(dAqk, dAkk, q, k, g, beta, 2 * BC, tl.where(d2, 3 * BC, 2 * BC), n_t, o_k, m_k, g_c, acc_c,
                       HV, BT, BC, SK, SG, PRECISE)
    acc_c = _wide_cols(dAqk, dAkk, q, k, g, beta, 3 * BC, tl.where(d3, 4 * BC, 3 * BC), n_t, o_k, m_k, g_c, acc_c,
                       HV, BT, BC, SK, SG, PRECISE)
    if d0:
        acc_c = _wide_cols(dAqk, dAkk, q, k, g, beta, 0, BC, n_t, o_k, m_k, g_c, acc_c, HV, BT, BC, SK, SG, PRECISE)
    if tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)) > GUARD_SPAN:
        blk = t // BC
        pair = tl.where(blk == 0, s0, tl.where(blk == 1, s1, tl.where(blk == 2, s2, s3))) > GUARD_SPAN
        for jj in range(0, BC):
            acc_q, acc_kr, acc_c = _wide_diag_step(jj, q, k, g, beta, dAqk, dAkk, n_t, g_c, pair, o_k, m_k,
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
    if TAIL == 0:
        tl.store(dg2 + p, b_dg, mask=m_tk)
    else:
        # B8: each row's dg summed with every later row's of the chunk (rows past the end are 0)
        b_dg = tl.cumsum(tl.where(m_tk, b_dg, 0.0), axis=0, reverse=True)
        if TAIL == 1:
            tl.store(dg2 + p, b_dg, mask=m_tk)
        else:
            # B9 (dg2 has the raw gate's dtype here), its parameter sums per chunk
            A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
            if HAS_BIAS:
                dt_bias += i_hv * K
            da, dbias = _gate_bwd(0, n_t, b_dg, g_raw + off, dt_bias, dg2 + off, A, lower_bound, o_k, m_k, HV, K, BT,
                                  HAS_BIAS, USE_LOWER_BOUND)
            tl.store(dA_part + (i_k * NT_ALL + i_tg) * HV + i_hv, da)
            tl.store(dbias_part + (i_tg * HV + i_hv) * K + o_k, dbias, mask=m_k)


# Compiled for sm_90a offline (``python -m tools.compile_report --design blocks --BV 32
# --warps 4 --stages 1``, K=128, H=HV=16): 255 registers at 4 warps, blocks 28 B of spills,
# blocks-shared 16, blocks-guarded 84, blocks-anchored 264; 2 warps 284-1,192 B; BK=16
# 36-108 B; capped at 168 registers (3 programs an SM) blocks 72 B, at 128 (4) 472 B.
DEFAULT_CONFIG = dict(BK=32, num_warps=4, num_stages=1)
# The diagonal blocks: pairwise with an exp2 per role (``blocks``), one exp2 per pair with
# the column role summed over the block (``blocks-shared``), through the anchors with
# safe_gate (``blocks-anchored``), or through the anchors where the gate span allows and
# pairwise elsewhere (``blocks-guarded``). The names keep the prefix of the measured rows:
# the first form's rows (pairwise, pairwise-shared, anchored) stay in the record.
DESIGNS = ("blocks", "blocks-shared", "blocks-anchored", "blocks-guarded", "wide", "wide-tf32")
WIDE = ("wide", "wide-tf32")
ANCHORED = ("blocks-anchored",)


def _launch_args(design, safe_gate, tensors: dict, chunk_size, cu_seqlens, chunk_indices, BK, num_warps, num_stages,
                 maxnreg) -> dict:
    """The checks and the keyword arguments both forms' kernels share."""
    if design not in DESIGNS:
        raise ValueError(f"unknown B7 design {design!r}")
    if design in ANCHORED and not safe_gate:
        raise ValueError(f"the {design} design needs safe_gate=True: an unbounded gate can overflow its factors")
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"B7 kernels index {name} as a dense tensor; got strides {t.stride()}")
    q, k, gc = tensors["q"], tensors["k"], tensors["gc"]
    B, T, H, K = k.shape
    HV = gc.shape[2]
    cfg = DEFAULT_CONFIG
    dq2 = torch.empty(B, T, HV, K, device=k.device, dtype=torch.float32)
    return dict(
        q=q, k=k, g=gc, beta=tensors["beta"], dAqk=tensors["dAqk"], dAkk=tensors["dAkk"], dq=tensors["dq"],
        dk=tensors["dk"], dg=tensors["dg"], dq2=dq2, dk2=torch.empty_like(dq2), dg2=torch.empty_like(dq2),
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, BT=chunk_size, BC=BC,
        BK=BK or min(cfg["BK"], triton.next_power_of_2(K)), IS_VARLEN=cu_seqlens is not None,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
        **({"maxnreg": maxnreg} if maxnreg else {}))


def _n_chunks(args: dict) -> int:
    return triton.cdiv(args["T"], args["BT"]) if args["cu_seqlens"] is None else len(args["chunk_indices"])


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate,
              BK: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
              maxnreg: int | None = None, design: str = "blocks-guarded"):
    """B7 with fla's contract: returns (dq, dk, db, dg), fp32, at value heads: the inputs
    plus the vector-Jacobian product of Aqk and Akk with dAqk and dAkk. ``design`` is one
    of ``DESIGNS``: all but blocks-anchored are exact for any gate; blocks-anchored needs
    ``safe_gate``, whose lower bound keeps a block's factors within fp32's range."""
    tensors = dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg)
    args = _launch_args(design, safe_gate, tensors, chunk_size, cu_seqlens, chunk_indices, BK, num_warps,
                        num_stages, maxnreg)
    return _blocks(args, db, design)[:4]


def intra_bwd_tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate,
                   g=None, A_log=None, dt_bias=None, lower_bound=None, BK: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, maxnreg: int | None = None,
                   design: str = "blocks-guarded"):
    """B7 + B8 (+ B9) in one pass of the block form: (dq, dk, db, dg, dA_log, ddt_bias).
    Without ``A_log`` dg is B8's (the intra-chunk reverse cumsum of B7's dg, fp32) and the
    last two are None; with it (the gate in the op: ``g`` the raw gate, ``dt_bias`` or None,
    ``lower_bound`` or None) dg is B9's, in g's dtype, with dA_log's and dt_bias's gradients."""
    tensors = dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, g=g,
                   A_log=A_log, dt_bias=dt_bias)
    args = _launch_args(design, safe_gate, tensors, chunk_size, cu_seqlens, chunk_indices, BK, num_warps,
                        num_stages, maxnreg)
    gate = dict(g=g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound) if A_log is not None else None
    return _blocks(args, db, design, tail=2 if gate else 1, gate=gate)


def _blocks(args: dict, db, design, tail: int = 0, gate: dict | None = None):
    """Launch the block form; (dq, dk, db, dg, dA_log, ddt_bias), the last two None unless
    the tail includes the gate's backward."""
    B, T, HV, K, BK = db.shape[0], db.shape[1], args["HV"], args["K"], args["BK"]
    NK, NT = triton.cdiv(K, BK), _n_chunks(args)
    dev = db.device
    # db's per-slice partials and the gate parameters' per-chunk partials, summed in a fixed
    # order below: deterministic, no atomics
    db_part = torch.empty(NK, B, T, HV, device=dev, dtype=torch.float32)
    gate = gate or {}
    g_raw, A_log, dt_bias, lower_bound = (gate.get(n) for n in ("g", "A_log", "dt_bias", "lower_bound"))
    NT_ALL = NT * (B if args["cu_seqlens"] is None else 1)
    dA_part = dbias_part = None
    if tail == 2:
        args["dg2"] = torch.empty(B, T, HV, K, device=dev, dtype=g_raw.dtype)
        dA_part = torch.empty(NK, NT_ALL, HV, device=dev, dtype=torch.float32)
        dbias_part = torch.empty(NT_ALL, HV, K, device=dev, dtype=torch.float32) if dt_bias is not None else None
    if design in WIDE:
        kernel, form = intra_bwd_wide_kernel, dict(PRECISE=design == "wide")
    else:
        kernel, form = intra_bwd_blocks_kernel, dict(ANCHORED=design in ANCHORED, SHARED_EXP=design == "blocks-shared",
                                                      GUARDED=design == "blocks-guarded")
    kernel[(NK, NT, B * HV)](
        **args, **form, db_part=db_part, NT_ROWS=B * T * HV, NT_ALL=NT_ALL,
        g_raw=g_raw, A_log=A_log, dt_bias=dt_bias, dA_part=dA_part, dbias_part=dbias_part,
        lower_bound=0.0 if lower_bound is None else float(lower_bound), TAIL=tail, HAS_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None)
    db2 = db.float() + (db_part[0] if NK == 1 else db_part.sum(0))
    dA_log = ddt_bias = None
    if tail == 2:
        dA_log = dA_part.sum((0, 1)).view_as(A_log).to(A_log.dtype)
        if dt_bias is not None:
            ddt_bias = dbias_part.sum(0).view_as(dt_bias).to(dt_bias.dtype)
    return args["dq2"], args["dk2"], db2, args["dg2"], dA_log, ddt_bias


def supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate):
    """None when ``intra_bwd`` takes the call, else why the stage stays on fla."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (B7's kernel is built for 64)"
    return None


def supports_tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate,
                  g, A_log, dt_bias, lower_bound):
    """None when ``intra_bwd_tail`` takes the B7-B9 unit, else why the three stages run
    separately."""
    return supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate)


def candidate(stage: str, design: str):
    """(implementation, supports) of ``design`` as the ``ours`` of ``stage`` ("B7" or the
    "B7-B9" unit), for a bench run that measures a design before it is registered
    (``python -m kernel_fun.bench --candidate B7-B9=blocks-guarded``)."""
    import functools

    if design not in DESIGNS:
        raise ValueError(f"unknown B7 design {design!r}")
    units = {"B7": (intra_bwd, supports), "B7-B9": (intra_bwd_tail, supports_tail)}
    if stage not in units:
        raise ValueError(f"intra_bwd has candidates for {sorted(units)}, not {stage!r}")
    fn, sup = units[stage]
    return functools.partial(fn, design=design), sup
