"""A candidate for the forward prep's core (F3-F5): the intra-chunk scores and the solve on
16x16 blocks, one program per (chunk, value head). Not registered; the design and its
prediction are in docs/log/prep.md ("The next design").

- Aqk and Akk by row block r (rows 16r..16r+15). The off-diagonal blocks are [16, BK] x
  [BK, 16] dots per K slice and column block, anchored at the row block's first row a:
  q_r 2^(g_r - g_a) against k_s 2^(g_a - g_s) for s < a, both factors at most 1 for any gate.
- The diagonal block is anchored at the block's middle row m (clamped to the chunk's last
  row). Every factor there is at most 2^span, where span = g_a - g_last is the block's decay
  in that K slice. While span <= SPAN_MAX (60: a product stays inside fp32) that is one dot;
  beyond it, the block's slice takes the element-wise form, one row at a time.
- The solve (I + Akk)^-1: each diagonal block's inverse by the Neumann product
  (I - D)(I + D^2)(I + D^4)(I + D^8), exact for a strictly lower 16x16 D, then block
  forward substitution by row blocks, X_r = N_r (E_r - L_r X). The rows of X are placed
  and taken by 0/1 selection dots, since the language has no register slicing.

``intra16(q, k, gc, beta, scale)`` -> (Aqk, Akk_inv): ``kernel_fun.kda.reference.intra_scores``'s
contract (dense batches, chunk 64; q and k already normalized, gc the log2 chunk cumsum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPAN_MAX = 60.0


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
def _diag_elementwise(acc_q, acc_k, q_r, k_r, g_r, t16):
    """The diagonal block's slice term by term: row i's scores against the block's rows s <= i
    (strictly below for Akk), each with its own exp2(g_i - g_s)."""
    for i in range(16):
        sel = (t16 == i)[:, None]
        q_i = tl.sum(tl.where(sel, q_r, 0.0), axis=0)
        k_i = tl.sum(tl.where(sel, k_r, 0.0), axis=0)
        g_i = tl.sum(tl.where(sel, g_r, 0.0), axis=0)
        lower = (t16 <= i)[:, None]
        e = tl.where(lower, tl.exp2(tl.where(lower, g_i[None, :] - g_r, 0.0)), 0.0) * k_r
        row_q = tl.sum(q_i[None, :] * e, axis=1)
        row_k = tl.sum(k_i[None, :] * e, axis=1)
        at = (t16 == i)[:, None]
        acc_q = tl.where(at, acc_q + row_q[None, :], acc_q)
        acc_k = tl.where(at, acc_k + row_k[None, :], acc_k)
    return acc_q, acc_k


@triton.jit
def intra16_kernel(q, k, g, beta, Aqk, Akk_inv, scale, T,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   SPAN: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    BT: tl.constexpr = 64
    row0 = i_t * BT
    n_t = tl.minimum(T - row0, BT)
    base = (i_b * T + row0).to(tl.int64)
    q += base * H * K + i_h * K
    k += base * H * K + i_h * K
    g += base * HV * K + i_hv * K
    beta += base * HV + i_hv
    Aqk += base * HV * BT + i_hv * BT
    Akk_inv += base * HV * BT + i_hv * BT

    t16 = tl.arange(0, 16)
    t64 = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    X = tl.zeros([64, 64], dtype=tl.float32)  # Akk_inv, its row blocks placed as they are solved
    for r in tl.static_range(4):
        a = r * 16
        rows = a + t16
        m_r = rows < n_t
        last = tl.minimum(a + 15, n_t - 1)  # (the block's last real row; a block past the end is masked)
        mid = tl.minimum(a + 8, n_t - 1)
        off_q = tl.zeros([16, 64], dtype=tl.float32)
        off_k = tl.zeros([16, 64], dtype=tl.float32)
        dia_q = tl.zeros([16, 16], dtype=tl.float32)
        dia_k = tl.zeros([16, 16], dtype=tl.float32)
        for i_k in tl.static_range(0, K, BK):
            cols = i_k + o_k
            m_c = cols < K
            m_rc = m_r[:, None] & m_c[None, :]
            q_r = tl.load(q + rows[:, None] * (H * K) + cols[None, :], mask=m_rc, other=0).to(tl.float32)
            k_r = tl.load(k + rows[:, None] * (H * K) + cols[None, :], mask=m_rc, other=0).to(tl.float32)
            g_r = tl.load(g + rows[:, None] * (HV * K) + cols[None, :], mask=m_rc, other=0).to(tl.float32)
            if r > 0:
                g_a = tl.load(g + a * (HV * K) + cols, mask=m_c & (a < n_t), other=0).to(tl.float32)
                down = tl.exp2(tl.where(m_rc, g_r - g_a[None, :], float("-inf")))
                qd, kd = q_r * down, k_r * down
                for c in tl.static_range(r):  # the column blocks before the row block, 16 rows each
                    rows_c = c * 16 + t16
                    m_s = (rows_c < n_t)[:, None] & m_c[None, :]
                    k_c = tl.load(k + rows_c[:, None] * (H * K) + cols[None, :], mask=m_s, other=0).to(tl.float32)
                    g_c = tl.load(g + rows_c[:, None] * (HV * K) + cols[None, :], mask=m_s, other=0).to(tl.float32)
                    kb = k_c * tl.exp2(tl.where(m_s, g_a[None, :] - g_c, float("-inf")))
                    place_c = tl.where((t16[:, None] + c * 16) == t64[None, :], 1.0, 0.0)
                    off_q += tl.dot(tl.dot(qd, tl.trans(kb)), place_c)
                    off_k += tl.dot(tl.dot(kd, tl.trans(kb)), place_c)
            # the diagonal block: one anchored dot while the span allows, else term by term
            g_first = tl.load(g + a * (HV * K) + cols, mask=m_c & (a < n_t), other=0).to(tl.float32)
            g_last = tl.load(g + last * (HV * K) + cols, mask=m_c & (a < n_t), other=0).to(tl.float32)
            span = tl.max(g_first - g_last)
            if span <= SPAN:
                g_m = tl.load(g + mid * (HV * K) + cols, mask=m_c & (a < n_t), other=0).to(tl.float32)
                up = tl.exp2(tl.where(m_rc, g_r - g_m[None, :], float("-inf")))
                back = tl.exp2(tl.where(m_rc, g_m[None, :] - g_r, float("-inf")))
                dia_q += tl.dot(q_r * up, tl.trans(k_r * back))
                dia_k += tl.dot(k_r * up, tl.trans(k_r * back))
            else:
                dia_q, dia_k = _diag_elementwise(dia_q, dia_k, q_r, k_r, g_r, t16)
        b_r = tl.load(beta + rows * HV, mask=m_r, other=0).to(tl.float32)
        # Aqk: row block r, r >= s
        keep_q = (t16[:, None] >= t16[None, :])
        dia_q = tl.where(keep_q, dia_q, 0.0)
        place = tl.where((t16[:, None] + a) == t64[None, :], 1.0, 0.0)  # [16, 64]: column s of the block at a + s
        a_qk = tl.where(t64[None, :] < a, off_q, 0.0) + tl.dot(dia_q, place)
        tl.store(Aqk + rows[:, None] * (HV * BT) + t64[None, :], (a_qk * scale).to(Aqk.dtype.element_ty),
                 mask=m_r[:, None])
        # Akk's row block: strictly lower, rows times beta; then this block's rows of the inverse
        D = tl.where(t16[:, None] > t16[None, :], dia_k, 0.0) * b_r[:, None]
        L = tl.where(t64[None, :] < a, off_k, 0.0) * b_r[:, None]
        N = _neumann_inverse(tl.where(m_r[:, None], D, 0.0))
        X_r = tl.dot(N, place - tl.dot(tl.where(m_r[:, None], L, 0.0), X))
        X += tl.dot(tl.trans(place), X_r)
        tl.store(Akk_inv + rows[:, None] * (HV * BT) + t64[None, :], X_r.to(Akk_inv.dtype.element_ty),
                 mask=m_r[:, None])


def intra16(q, k, gc, beta, scale: float, BK: int = 64, span_max: float = SPAN_MAX):
    """(Aqk, Akk_inv) of a dense batch, [B, T, HV, 64] each in k's dtype."""
    B, T, H, K = q.shape
    HV = gc.shape[2]
    Aqk = torch.empty(B, T, HV, 64, device=q.device, dtype=k.dtype)
    Akk_inv = torch.empty(B, T, HV, 64, device=q.device, dtype=k.dtype)
    grid = (triton.cdiv(T, 64), B * HV)
    intra16_kernel[grid](q, k, gc, beta, Aqk, Akk_inv, scale, T, H=H, HV=HV, K=K,
                         BK=min(BK, triton.next_power_of_2(K)), SPAN=span_max, num_warps=4)
    return Aqk, Akk_inv
