"""F7 + F8, the forward's state scan with its output: one kernel that computes o from the
state it holds instead of writing h and v_new for a separate output pass.

Replaces fla's ``chunk_gated_delta_rule_fwd_h`` (F7, 1.77 ms at prod8192_gate on the H200)
and ``chunk_gla_fwd_o_gk`` (F8, 1.93 ms): F7 writes every chunk's state h (bf16, 2.1 GB at
prod8192_gate) and v_new for F8 to read back. Here one program per (sequence, value head,
V slice) carries the state S [K, BV] in fp32 through the sequence's chunks and per chunk:

    h_c = bf16(S);  v_new = bf16(u - w h_c)
    o   = scale (bf16(q * exp2(g)) h_c) + bf16(tril(Aqk)) v_new
    S   = exp2(g_last) * S + kg^T v_new

with the roundings where fla's two kernels make them (h, v_new, q*exp2(g) and Aqk in the
input dtype before their dots; fp32 accumulation). The chain's unit reads F6's qg (q exp2(g)
in q's dtype, which fla's F3-F6 writes when asked: ``scan_output.reads_qg``) in place of q
and the fp32 cumsum.

The pin (``scan-vk``, ``scan_vk_kernel``) holds the state transposed, S^T [V slice, K], in
two halves of K: the V slice is every dot's M side and every dot's N side is 64, so h^T and
v_new^T feed the tensor cores from registers in their accumulators' layout, and only the
chunk's rows (w, qg, kg, g's last row: staged a chunk ahead by the pipeliner; Aqk at the
top of the step) pass through shared memory. The kernel before it (``scan_fwd_kernel``, S
[K, V slice]) stages h and v_new through shared memory as B operands every step; it stays
for K > 128 (``scan-hoist``: a chunk's loads before the step's first dot) and as the
candidates ``scan``, ``scan-pf``, ``scan-hoist-pf`` and ``scan-forms-qg`` (``DESIGNS``). ``save_states`` also writes h and v_new
(``disable_recompute``'s saved tensors). ``scan_states`` is the backward's B3 (F7
recomputed): the transposed kernel with o compiled out, forming each chunk's u from v, beta
and Akk_inv (``U_FROM_V``, during the step before) so that B2 writes no u (``wy_fwd``).

Numerics: the chunk loop is the sequential recurrence, in fla's order; only the blocking
inside each dot reassociates fp32 sums (o within 2e-3 of fla's on the H200; the in-order
kernel's o is bit for bit fla's).

Falls back (``supports``): chunk size other than 64, K > 256; as B3 (``supports_states``) K
> 128 too (only the transposed kernel forms u). No CTA floor: at the V slice
the launch picks (``launch_config``: the least waves x measured step latency, from
``VK_STEP_CONFIGS`` / ``QG_STEP_CONFIGS`` / ``STEP_CONFIGS``) it measured at least fla's
F7 + F8 down to one chain.

B3 (stages.jsonl at f2fd3c0 and 7e65710): 2.16-2.21 ms against fla's 1.92-1.97 and 1.80 reading
u, but B2 without u saves more (1.26 against 1.77); in the whole op (chunk_kda.jsonl at
7e65710) B3 2.06 and B2 1.21 against fla's 1.78 and 1.67. F7-F8 forming u measured slower
than F6 writing it (2.48 ms at BV=128 against 1.82 reading u: VKU_STEP_CONFIGS), so the
unit reads F6's u.

Measured (H200, bench/results/stages.jsonl at e203f26; the rounds in docs/log/scan.md):
alone, prod8192_gate 1.75 ms (BV=64, 4 warps, two stages; sm_90a 242 registers, no spills,
112 KB of shared memory) against fla's F7 + F8 3.81 (2.18x) and scan-hoist's 2.26;
step8192 (one head, 128 chunk steps) 0.272 at BV=32 against 0.275; kimi 1.04 against 2.35
(stages.jsonl at f5e9618). In the whole op (chunk_kda.jsonl at f5e9618) the unit takes 1.69
ms, the forward 8.28 against fla's 9.78, fwd+bwd 31.68 against 47.43. The unit is 1.46x its
1.20 ms floor; a step at one chain takes ~2.1 us, a chain of seven waited wgmma groups and
the layout conversions of u^T in and o out (barrier rounds through shared memory).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernel_fun._triton import dot, prefetch_rows, to
from kernel_fun.kda.stages import add_impl


@triton.jit
def _sequence(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence i_n's first token row, its length and its first chunk's index."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_seq = T
        boh = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, T_seq, boh


@triton.jit
def scan_fwd_kernel(
    q, qg, kg, w, u, g, Aqk, h0, o, ht, h, v_new, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, SAVE_STATES: tl.constexpr, WITH_O: tl.constexpr = True, QG: tl.constexpr = False,
    HOIST: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """The scan on one (sequence, value head, V slice); without WITH_O (the backward's B3)
    only the states: h and v_new written, o's loads and dots compiled out."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T_seq, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(T_seq, BT)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_S += tl.load(h0 + i_nh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0).to(tl.float32)

    for i_c in range(0, NT):
        row0 = bos + i_c * BT
        n_t = T_seq - i_c * BT
        m_t = o_t < n_t
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_hk = (row0 + o_t)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        p_hv = (row0 + o_t)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        i_last = tl.minimum(n_t, BT) - 1
        if HOIST:  # every load of the chunk issued before the step's first dot
            b_w = tl.load(w + p_hk, mask=m_tk, other=0)
            b_u = tl.load(u + p_hv, mask=m_tv, other=0)
            if WITH_O:
                if QG:
                    b_qg = tl.load(qg + p_hk, mask=m_tk, other=0)
                else:
                    b_q = tl.load(q + (row0 + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0)
                    b_g = tl.load(g + p_hk, mask=m_tk, other=0).to(tl.float32)
                    b_qg = to(b_q.to(tl.float32) * tl.exp2(b_g), q.dtype.element_ty)
                b_A = tl.load(Aqk + (row0 + o_t)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=m_t[:, None],
                              other=0)
            b_gl = tl.load(g + (row0 + i_last) * (HV * K) + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_kg = tl.load(kg + p_hk, mask=m_tk, other=0)
        if PREFETCH:  # the next chunk's rows asked of L2 while this step runs
            r_n = row0 + BT + o_t
            m_n = o_t < n_t - BT
            prefetch_rows(w + i_hv * K, r_n, HV * K, m_n, K)
            prefetch_rows(kg + i_hv * K, r_n, HV * K, m_n, K)
            prefetch_rows(u + i_hv * V + i_v * BV, r_n, HV * V, m_n, BV)
            if WITH_O:
                if QG:
                    prefetch_rows(qg + i_hv * K, r_n, HV * K, m_n, K)
                else:
                    prefetch_rows(q + i_h * K, r_n, H * K, m_n, K)
                    prefetch_rows(g + i_hv * K, r_n, HV * K, m_n, K)
                prefetch_rows(Aqk + i_hv * BT, r_n, HV * BT, m_n, BT)
            r_gl = row0 + BT + tl.minimum(n_t - BT, BT) - 1 + tl.zeros([1], dtype=tl.int64)
            prefetch_rows(g + i_hv * K, r_gl, HV * K, r_gl < bos + T_seq, K)

        b_Sb = to(b_S, kg.dtype.element_ty)
        if SAVE_STATES:
            tl.store(h + ((boh + i_c) * HV + i_hv) * K * V + p_kv, b_Sb, mask=m_kv)
        if not HOIST:
            b_w = tl.load(w + p_hk, mask=m_tk, other=0)
            b_u = tl.load(u + p_hv, mask=m_tv, other=0)
        b_vn = to(b_u.to(tl.float32) - dot(b_w, b_Sb), u.dtype.element_ty)
        if SAVE_STATES:
            tl.store(v_new + p_hv, b_vn, mask=m_tv)

        if WITH_O:
            if HOIST:
                b_A = to(tl.where(o_t[None, :] <= o_t[:, None], b_A, 0), u.dtype.element_ty)
            else:
                if QG:  # q exp2(g) as F6 rounded it, read instead of q and g
                    b_qg = tl.load(qg + p_hk, mask=m_tk, other=0)
                else:
                    b_q = tl.load(q + (row0 + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0)
                    b_g = tl.load(g + p_hk, mask=m_tk, other=0).to(tl.float32)
                    b_qg = to(b_q.to(tl.float32) * tl.exp2(b_g), q.dtype.element_ty)
                m_A = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
                b_A = to(tl.load(Aqk + (row0 + o_t)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=m_A,
                                 other=0), u.dtype.element_ty)
            b_o = scale * dot(b_qg, b_Sb) + dot(b_A, b_vn)
            tl.store(o + p_hv, to(b_o, o.dtype.element_ty), mask=m_tv)

        if not HOIST:
            b_gl = tl.load(g + (row0 + i_last) * (HV * K) + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_kg = tl.load(kg + p_hk, mask=m_tk, other=0)
        b_S = b_S * tl.exp2(b_gl)[:, None] + dot(tl.trans(b_kg), b_vn)

    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_kv, b_S, mask=m_kv)


@triton.jit
def _vk_side_rows(Aqk, g, row0, n_t, i_hv, o_t, o_k1, o_k2, m_k1, m_k2, HV: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, WITH_O: tl.constexpr):
    """A chunk's Aqk^T [s, t] (its rows t < n_t, unmasked above the diagonal) and g's last
    row in two halves of K. The n_t <= 0 guards are inert at its one call (the current
    chunk); without them sm_90a code differs from the build measured on the H200 (sass
    e6bb8af5c61f82a7 at BV=64), so they go with the next measured build."""
    m_t = o_t < n_t
    if WITH_O:
        b_At = tl.load(Aqk + (row0 + o_t)[None, :] * (HV * BT) + i_hv * BT + o_t[:, None], mask=m_t[None, :], other=0)
    else:
        b_At = tl.zeros([1, 1], dtype=tl.float32)
    r_l = (row0 + tl.maximum(tl.minimum(n_t, BT) - 1, 0)) * (HV * K) + i_hv * K
    b_g1 = tl.load(g + r_l + o_k1, mask=m_k1 & (n_t > 0), other=0).to(tl.float32)
    b_g2 = tl.load(g + r_l + o_k2, mask=m_k2 & (n_t > 0), other=0).to(tl.float32)
    return b_At, b_g1, b_g2


@triton.jit
def _vk_u(v, beta, Akk, row0, n_t, i_hv, o_t, o_v, m_v, HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """u^T [V slice, BT] of the chunk at row0 (its rows t < n_t; none past the sequence) as F6
    forms u, unrounded: (Akk_inv bf16(beta v))^T = bf16(beta v)^T Akk_inv^T, fp32 sums."""
    m_t = o_t < n_t
    b_b = tl.load(beta + (row0 + o_t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    p_vt = (row0 + o_t)[None, :] * (HV * V) + i_hv * V + o_v[:, None]
    b_vb = to(tl.load(v + p_vt, mask=m_v[:, None] & m_t[None, :], other=0).to(tl.float32) * b_b[None, :],
              v.dtype.element_ty)
    b_Xt = tl.load(Akk + (row0 + o_t)[None, :] * (HV * BT) + i_hv * BT + o_t[:, None], mask=m_t[None, :], other=0)
    return dot(b_vb, b_Xt)


@triton.jit
def scan_vk_kernel(
    q, qg, kg, w, u, g, Aqk, h0, o, ht, h, v_new, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, SAVE_STATES: tl.constexpr, WITH_O: tl.constexpr, QG: tl.constexpr, v=None,
    beta=None, Akk=None, U_FROM_V: tl.constexpr = False,
):
    """The same scan with the state held transposed, S^T [V slice, K], in two halves of K
    (BK/2 channels each, K <= 128): the V slice is every dot's M side and every dot's N side
    is 64, so h^T = bf16(S^T) and v_new^T are register (A) operands in their accumulators'
    layout and only the chunk's rows (w, qg, Aqk, kg) go through shared memory, where the
    pipeliner stages the next chunk's while this one runs:

        v_new^T = u^T - h^T w^T;  o^T = scale h^T qg^T + v_new^T tril(Aqk)^T
        S^T     = S^T exp2(g_last) + v_new^T kg

    The same roundings at the same points as ``scan_fwd_kernel``; with U_FROM_V u^T is
    formed here (``_vk_u``), each chunk's during the step before, after that step's last
    dots on the chain are issued, and rounded as F6 rounds u where it is used."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T_seq, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(T_seq, BT)
    BKH: tl.constexpr = BK // 2

    o_t = tl.arange(0, BT)
    o_k1 = tl.arange(0, BKH)
    o_k2 = BKH + tl.arange(0, BKH)
    m_k1, m_k2 = o_k1 < K, o_k2 < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_vk1, p_vk2 = o_v[:, None] + o_k1[None, :] * V, o_v[:, None] + o_k2[None, :] * V  # S^T[v, k] of [K, V]
    m_vk1, m_vk2 = m_v[:, None] & m_k1[None, :], m_v[:, None] & m_k2[None, :]

    b_S1 = tl.zeros([BV, BKH], dtype=tl.float32)
    b_S2 = tl.zeros([BV, BKH], dtype=tl.float32)
    if HAS_H0:
        p_h0 = h0 + i_nh.to(tl.int64) * K * V
        b_S1 += tl.load(p_h0 + p_vk1, mask=m_vk1, other=0).to(tl.float32)
        b_S2 += tl.load(p_h0 + p_vk2, mask=m_vk2, other=0).to(tl.float32)

    if U_FROM_V:
        b_Un = _vk_u(v, beta, Akk, bos, T_seq, i_hv, o_t, o_v, m_v, HV, V, BT)
    for i_c in range(0, NT):
        row0 = bos + i_c * BT
        n_t = T_seq - i_c * BT
        m_t = o_t < n_t
        # Aqk's rows and g's last row first (their latency behind the step's first dots:
        # neither depends on the state)
        b_At, b_g1, b_g2 = _vk_side_rows(Aqk, g, row0, n_t, i_hv, o_t, o_k1, o_k2, m_k1, m_k2, HV, K, BT, WITH_O)
        m_vt = m_v[:, None] & m_t[None, :]
        r_t = (row0 + o_t) * (HV * K) + i_hv * K  # the chunk's rows of [T, HV, K]
        p_vt = (row0 + o_t)[None, :] * (HV * V) + i_hv * V + o_v[:, None]  # [BV, BT] views of [T, V] rows

        b_w1 = tl.load(w + r_t[None, :] + o_k1[:, None], mask=m_k1[:, None] & m_t[None, :], other=0)  # w^T
        b_w2 = tl.load(w + r_t[None, :] + o_k2[:, None], mask=m_k2[:, None] & m_t[None, :], other=0)
        if U_FROM_V:  # this chunk's u^T, formed during the step before (off the chain)
            b_ut = to(b_Un, v.dtype.element_ty)
        else:
            b_ut = tl.load(u + p_vt, mask=m_vt, other=0)
        b_H1 = to(b_S1, kg.dtype.element_ty)  # h^T
        b_H2 = to(b_S2, kg.dtype.element_ty)
        if SAVE_STATES:
            p_h = h + ((boh + i_c) * HV + i_hv) * K * V
            tl.store(p_h + p_vk1, b_H1, mask=m_vk1)
            tl.store(p_h + p_vk2, b_H2, mask=m_vk2)
        b_vn = to(b_ut.to(tl.float32) - dot(b_H2, b_w2, dot(b_H1, b_w1)), b_ut.dtype)  # v_new^T
        if SAVE_STATES:
            tl.store(v_new + p_vt, b_vn, mask=m_vt)
        if WITH_O:
            if QG:
                b_q1 = tl.load(qg + r_t[None, :] + o_k1[:, None], mask=m_k1[:, None] & m_t[None, :], other=0)
                b_q2 = tl.load(qg + r_t[None, :] + o_k2[:, None], mask=m_k2[:, None] & m_t[None, :], other=0)
            else:
                r_q = (row0 + o_t) * (H * K) + i_h * K
                b_q1 = to(tl.load(q + r_q[None, :] + o_k1[:, None], mask=m_k1[:, None] & m_t[None, :], other=0)
                          .to(tl.float32) * tl.exp2(tl.load(g + r_t[None, :] + o_k1[:, None],
                                                            mask=m_k1[:, None] & m_t[None, :], other=0)),
                          q.dtype.element_ty)
                b_q2 = to(tl.load(q + r_q[None, :] + o_k2[:, None], mask=m_k2[:, None] & m_t[None, :], other=0)
                          .to(tl.float32) * tl.exp2(tl.load(g + r_t[None, :] + o_k2[:, None],
                                                            mask=m_k2[:, None] & m_t[None, :], other=0)),
                          q.dtype.element_ty)
            b_A = tl.where(o_t[:, None] <= o_t[None, :], b_At, 0).to(b_ut.dtype)  # Aqk^T, s <= t
            b_o = scale * dot(b_H2, b_q2, dot(b_H1, b_q1)) + dot(b_vn, b_A)
            tl.store(o + p_vt, to(b_o, o.dtype.element_ty), mask=m_vt)
        b_k1 = tl.load(kg + r_t[:, None] + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0)
        b_k2 = tl.load(kg + r_t[:, None] + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0)
        if U_FROM_V:  # the next chunk's u^T, its dot behind this step's state update
            b_Un = _vk_u(v, beta, Akk, row0 + BT, n_t - BT, i_hv, o_t, o_v, m_v, HV, V, BT)
        b_S1 = b_S1 * tl.exp2(b_g1)[None, :] + dot(b_vn, b_k1)
        b_S2 = b_S2 * tl.exp2(b_g2)[None, :] + dot(b_vn, b_k2)

    if STORE_HT:
        p_ht = ht + i_nh.to(tl.int64) * K * V
        tl.store(p_ht + p_vk1, b_S1, mask=m_vk1)
        tl.store(p_ht + p_vk2, b_S2, mask=m_vk2)

# Compiled for sm_90a offline (K=128, V=256, H=HV=16; tools' compile_sm90), no spills:
# num_stages=2 BV=128/8 warps 246 registers and 188 KB of shared memory, BV=64/8 242 and
# 156 KB, BV=64/4 255 and 156 KB, BV=32/4 252 and 139 KB (one program an SM, every one);
# num_stages=1 BV=64/4 254 and 57 KB, BV=32/4 246 and 45 KB (two an SM).
# Measured at prod8192_gate: BV=128 3.28 ms, BV=64 4.77, BV=32 (4 warps) 6.75; at one head
# (step8192) BV=32 0.411, BV=64 0.621, BV=128 0.790.
DEFAULT_CONFIG = dict(BV=128, num_warps=8, num_stages=2)
# The measured configs by V slice, each one program an SM, with its chunk step's latency at
# one head (step8192, us): the launch takes the slice whose waves x latency is least.
STEP_CONFIGS = {32: (dict(BV=32, num_warps=4, num_stages=2), 3.2), 64: (dict(BV=64, num_warps=8, num_stages=2), 4.9),
                128: (dict(BV=128, num_warps=8, num_stages=2), 6.2)}


# Reading F6's qg (q exp2(g) in q's dtype) instead of q and the fp32 cumsum: 72 KB a chunk
# step at BV=64 against 104, and no exp2 in the chain; every load of the chunk issued before
# the step's first dot (``hoist``, the pin). Step latency at one chain (us, step8192 / 128,
# H200, stages.jsonl at 9a888c5) and programs an SM (sm_90a: BV=32 192 registers, BV=64 255
# with 44 B of spills, both 4 warps and one stage; BV=128 8 warps, 255):
QG_STEP_CONFIGS = {32: (dict(BV=32, num_warps=4, num_stages=1), 2.2, 2),
                   64: (dict(BV=64, num_warps=4, num_stages=1), 2.7, 2),
                   128: (dict(BV=128, num_warps=8, num_stages=1), 4.7, 1)}


# The transposed kernel (``scan-vk``, the pin where K <= 128) by V slice: its config, its
# chunk step's latency at one chain (us, step8192 / 128, H200, stages.jsonl at e203f26) and
# programs an SM (sm_90a, K=128, V=256, reading qg, no spills: BV=32 244 registers, 68 KB of
# shared memory, mma.sync (an M side of 32); BV=64 at 4 warps 242 and 112 KB; BV=128 at 8
# warps 246, 112 KB). Measured at prod8192_gate: BV=64 1.75 ms, BV=128 1.77, BV=32 3.18.
VK_STEP_CONFIGS = {32: (dict(BV=32, num_warps=4, num_stages=2), 2.1, 2),
                   64: (dict(BV=64, num_warps=4, num_stages=2), 2.2, 2),
                   128: (dict(BV=128, num_warps=8, num_stages=2), 3.0, 1)}


# Forming u (``U_FROM_V``: v, beta and Akk_inv read instead of F6's u, each chunk's u^T
# formed during the step before) in the transposed kernel, by V slice: the config, its step
# latency at one chain (us, step8192 / 128, stages.jsonl at f2fd3c0) and programs an SM
# (sm_90a, K=128, V=256, reading qg, no spills: BV=64 at 4 warps 246 registers and 136 KB of
# shared memory, BV=128 at 8 warps 249 and 144 KB, one program an SM each; BV=32 80 KB, two).
# Measured at prod8192_gate: BV=128 2.48 ms, BV=32 3.38, BV=64 3.63, against 1.82 reading u
# (BV=64, two programs an SM) and fla's 3.98: the F7-F8 unit reads u. As B3 (no o: 90 KB at
# BV=64, two programs an SM) it is the pin, B2 then writing no u.
VKU_STEP_CONFIGS = {32: (dict(BV=32, num_warps=4, num_stages=2), 2.6, 2),
                    64: (dict(BV=64, num_warps=4, num_stages=2), 3.1, 1),
                    128: (dict(BV=128, num_warps=8, num_stages=2), 4.1, 1)}


def launch_config(sequence_heads: int, V: int, sms: int = 132, reads_qg: bool = False, vk: bool = False,
                  forms_u: bool = False) -> dict:
    """The config for ``sequence_heads`` chains of V columns on ``sms`` SMs: the V slice
    whose waves times its step latency is least (forming qg, one program an SM:
    prod8192_gate's 256 chains BV=128, one chain BV=32; reading qg: BV=64 at two programs
    an SM, one chain BV=32; the transposed kernel likewise, and forming u BV=128). ``sms``
    defaults to the H200's 132."""
    table = ((VKU_STEP_CONFIGS if forms_u else VK_STEP_CONFIGS) if vk else QG_STEP_CONFIGS if reads_qg
             else {bv: (c, us, 1) for bv, (c, us) in STEP_CONFIGS.items()})

    def cost(bv):
        return -(-sequence_heads * -(-V // bv) // (sms * table[bv][2])) * table[bv][1]
    return dict(table[min((bv for bv in table if bv <= max(32, V)), key=cost)][0])


def scan_fwd(q, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, chunk_size, cu_seqlens,
             save_states: bool = False, BV: int = DEFAULT_CONFIG["BV"], num_warps: int = DEFAULT_CONFIG["num_warps"],
             num_stages: int = DEFAULT_CONFIG["num_stages"], qg=None, hoist: bool = False, prefetch: bool = False,
             vk: bool = False, v=None, beta=None, Akk=None):
    """F7 + F8 with fla's contracts: returns (o in v's dtype, the final state fp32 or None,
    h [B, NT, HV, K, V] and v_new when ``save_states``, else None, None). States in [K, V].
    ``u`` None: formed in the scan from ``v``, ``beta`` and Akk_inv ``Akk`` as F6 forms it.
    ``hoist``: every load of a chunk issued before its step's first dot; ``prefetch``: the
    next chunk's rows asked of L2 at the top of each step; ``vk``: the kernel holding the
    state transposed (``scan_vk_kernel``; hoist and prefetch do not apply to it)."""
    return _scan(q, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, chunk_size, cu_seqlens, save_states,
                 BV, num_warps, num_stages, qg=qg, hoist=hoist, prefetch=prefetch, vk=vk, v=v, beta=beta, Akk=Akk)


def _scan(q, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, chunk_size, cu_seqlens, save_states,
          BV, num_warps, num_stages, with_o: bool = True, qg=None, hoist: bool = False, prefetch: bool = False,
          vk: bool = False, v=None, beta=None, Akk=None):
    B, T, HV, K = kg.shape
    H = q.shape[2] if with_o else HV
    u_from_v = u is None
    if u_from_v and (v is None or beta is None or Akk is None):
        raise ValueError("the scan forms u from v, beta and Akk_inv when u is not given: pass all three")
    if u_from_v and not vk:
        raise ValueError("only the transposed-state scan (vk) forms u; the other kernel reads it")
    vals = v if u_from_v else u  # u's shape and dtype are v's
    V = vals.shape[3]
    BT = chunk_size
    for name, t in dict(q=q, qg=qg, kg=kg, w=w, u=u, gc=gc, Aqk=Aqk, v=v if u_from_v else None,
                        beta=beta if u_from_v else None, Akk=Akk if u_from_v else None).items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"the scan kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    if cu_seqlens is None:
        N, NT_total, chunk_offsets = B, B * triton.cdiv(T, BT), None
    else:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        counts = (lens + BT - 1) // BT
        chunk_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        N, NT_total = len(cu_seqlens) - 1, int(chunk_offsets[-1])
    o = torch.empty_like(vals) if with_o else None
    ht = torch.empty(N, HV, K, V, device=vals.device, dtype=torch.float32) if output_final_state else None
    h = v_new = None
    if save_states:
        h = torch.empty(B, NT_total // B, HV, K, V, device=vals.device, dtype=kg.dtype)  # B = 1 when packed
        v_new = torch.empty_like(vals)
    BV = min(BV, triton.next_power_of_2(V))
    args = dict(q=q, qg=qg, kg=kg, w=w, u=u, g=gc, Aqk=Aqk, h0=initial_state, o=o, ht=ht, h=h, v_new=v_new,
                cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=BT,
                BK=triton.next_power_of_2(K), BV=BV, IS_VARLEN=cu_seqlens is not None,
                HAS_H0=initial_state is not None, STORE_HT=output_final_state, SAVE_STATES=save_states,
                WITH_O=with_o, QG=qg is not None, num_warps=num_warps, num_stages=num_stages)
    if u_from_v:  # (absent otherwise: the u-reading builds are the ones measured)
        args.update(v=v, beta=beta, Akk=Akk, U_FROM_V=True)
    grid = (triton.cdiv(V, BV), N * HV)
    if vk:  # two halves of K, each at least 32 channels wide (no 32-byte wgmma operand rows)
        if K > 128:
            raise ValueError(f"the transposed-state scan holds K <= 128 in two halves; got K={K}")
        scan_vk_kernel[grid](**{**args, "BK": max(64, args["BK"])})
    else:
        scan_fwd_kernel[grid](**args, HOIST=hoist, PREFETCH=prefetch)
    return o, ht, h, v_new


def scan_output(q, qg, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, save_states, cu_seqlens_cpu,
                state_v_first, chunk_size, cu_seqlens, chunk_indices, v=None, beta=None, Akk=None, **config):
    """The chain's F7-F8 unit (fla's two stages' contracts in one, and F6's qg: q exp2(g) in
    q's dtype, read in place of q and the cumsum when given; u formed from v, beta and
    Akk_inv when F6 wrote none): (o, the final state, h and v_new when ``save_states``, else
    None, None); states in [K, V]."""
    if state_v_first:
        raise ValueError("the scan kernel keeps its states in [K, V]; the chain passes them so")
    # the pin: scan-vk where it holds K (<= 128) and q exp2(g) is given, else scan-hoist
    pin_vk = qg is not None and kg.shape[3] <= 128
    flags = dict(hoist=config.pop("hoist", not pin_vk), prefetch=config.pop("prefetch", False),
                 vk=config.pop("vk", pin_vk))
    if not config:
        N = kg.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        sms = {"sms": torch.cuda.get_device_properties(kg.device).multi_processor_count} if kg.is_cuda else {}
        config = launch_config(N * kg.shape[2], (v if u is None else u).shape[3], reads_qg=qg is not None,
                               vk=flags["vk"], forms_u=u is None, **sms)
    return scan_fwd(q, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, chunk_size, cu_seqlens,
                    save_states=save_states, qg=qg, **config, **flags, v=v, beta=beta, Akk=Akk)


scan_output.reads_qg = True  # the chain has F6 write qg for it (Dispatcher.wants)
# (the unit reads F6's u: forming it here measured slower than F6 writing it, STEP note)


def scan_output_forming_qg(**inputs):
    """The unit forming q exp2(g) from q and the cumsum itself (the design before
    ``scan_output`` read F6's qg; a candidate for measuring the two side by side)."""
    return scan_output(**{**inputs, "qg": None, **DESIGNS["scan-forms-qg"]})


# B3 reading u (a B2 that wrote it; candidates): BV=64 at 4 warps, two programs an SM, measured
# best at prod8192_gate (1.87 ms against fla's 1.95; BV=128 at 8 warps 2.06). At one chain
# BV=32 is (step8192: 0.213 ms against fla's 0.345); not picked by grid yet.
STATES_CONFIG = dict(BV=64, num_warps=4, num_stages=2)
# B3's pin, forming u (B2 writes none): the transposed kernel, BV=64 at 4 warps (sm_90a, K=128,
# V=256: 246 registers, no spills, 90 KB of shared memory: two programs an SM). Measured at
# prod8192_gate 2.16-2.21 ms (BV=128 at 8 warps 2.67; stages.jsonl at cab86c7 and f2fd3c0).
STATES_U_CONFIG = dict(BV=64, num_warps=4, num_stages=2, vk=True)


def scan_states(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens, cu_seqlens_cpu,
                chunk_indices, state_v_first, v=None, beta=None, Akk=None, **config):
    """B3 (F7 recomputed in the backward) with fla's contract: (h [B, NT, HV, K, V], v_new,
    the final state or None), from the same kernel without o; u formed from v, beta and
    Akk_inv when B2 wrote none. States in [K, V]."""
    if state_v_first:
        raise ValueError("the scan kernel keeps its states in [K, V]; the chain passes them so")
    cfg = {**(STATES_U_CONFIG if u is None else STATES_CONFIG), **config}
    _, ht, h, v_new = _scan(None, kg, w, u, gc, None, 1.0, initial_state, output_final_state, chunk_size, cu_seqlens,
                            True, cfg["BV"], cfg["num_warps"], cfg["num_stages"], with_o=False,
                            hoist=cfg.get("hoist", False), prefetch=cfg.get("prefetch", False),
                            vk=cfg.get("vk", False), v=v, beta=beta, Akk=Akk)
    return h, v_new, ht


scan_states.forms_u = True  # the chain has B2 write no u for it (Dispatcher.wants)


def supports(q, chunk_size, state_v_first=False, vk=False, **_) -> str | None:
    """None when ``scan_fwd`` takes the call, else why F7 and F8 stay on fla (``vk``: the
    transposed-state kernel forced, as a candidate; the pinned unit takes K > 128 with the
    other kernel)."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the scan kernel is built for 64)"
    if q.shape[-1] > 256:
        return f"K={q.shape[-1]} > 256"
    if vk and q.shape[-1] > 128:
        return f"K={q.shape[-1]} > 128 (the transposed-state scan holds K in two halves of at most 64)"
    if state_v_first:
        return "states in [V, K] (the kernel's are [K, V])"
    return None


# The designs by their load schedule (the flags of ``scan_fwd``): ``scan`` as the source
# reads (sm_90a: a step's loads issued in three groups, each after the last group's dots),
# ``-hoist`` every load of the chunk before the first dot, ``-pf`` the next chunk's rows
# asked of L2 a step ahead; ``scan-vk`` the kernel holding the state transposed.
DESIGNS = {"scan": dict(hoist=False, prefetch=False), "scan-forms-qg": dict(hoist=False, prefetch=False),
           "scan-hoist": dict(hoist=True, prefetch=False), "scan-pf": dict(hoist=False, prefetch=True),
           "scan-hoist-pf": dict(hoist=True, prefetch=True), "scan-vk": dict(hoist=False, prefetch=False, vk=True)}


def candidate(stage: str, design: str):
    """(implementation, supports) of the scan as the ``ours`` of ``stage`` ("F7-F8" with o,
    "B3" without), for a bench run that measures it in the whole op before it is registered
    (``python -m kernel_fun.bench --candidate F7-F8=scan``)."""
    if design not in DESIGNS or (design == "scan-forms-qg" and stage != "F7-F8"):
        raise ValueError(f"unknown scan design {design!r} for {stage}")
    flags = DESIGNS[design]
    vk = flags.get("vk", False)
    f7f8 = scan_output_forming_qg if design == "scan-forms-qg" else functools.partial(scan_output, **flags)
    units = {"F7-F8": (f7f8, functools.partial(supports, vk=vk)),
             "B3": (functools.partial(scan_states, **flags), lambda kg, **kw: supports(q=kg, vk=vk, **kw))}
    if stage not in units:
        raise ValueError(f"scan_fwd has candidates for {sorted(units)}, not {stage!r}")
    return units[stage]


def supports_states(kg, chunk_size, state_v_first, **_) -> str | None:
    """None when ``scan_states`` takes B3 (forming u: the transposed-state kernel, K <= 128),
    else why B3 stays on fla."""
    return supports(q=kg, chunk_size=chunk_size, state_v_first=state_v_first, vk=True)


add_impl("F7-F8", "ours", scan_output, supports)
add_impl("B3", "ours", scan_states, supports_states)
