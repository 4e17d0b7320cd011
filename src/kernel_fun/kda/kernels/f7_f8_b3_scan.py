"""F7-F8 and B3: the state scan, with the forward's output in the same pass (F7-F8) or, as
the backward's recompute, the states alone (B3).

Replaces fla's ``chunk_gated_delta_rule_fwd_h`` (F7) and ``chunk_gla_fwd_o_gk`` (F8): F7
writes every chunk's state h (bf16, 2.1 GB at prod8192_gate) and v_new for F8 to read back.
Here one program per (sequence, value head, V slice) carries the state S in fp32 through the
sequence's chunks and per chunk computes

    h_c = bf16(S);  v_new = bf16(u - w h_c)
    o   = scale (qg h_c) + bf16(tril(Aqk)) v_new
    S   = exp2(g_last) * S + kg^T v_new

with the roundings where fla's two kernels make them; qg = q exp2(g) is read as F6 rounded
it (the ``reads_qg`` capability). h and v_new are written only with ``save_states``.

For K <= 128 the state is held transposed, S^T [V slice, K], in two halves of K
(``scan_transposed_kernel``): the V slice is every dot's M side and every N side is 64, so
h^T and v_new^T feed the tensor cores from registers in their accumulators' layout and only
the chunk's rows (w, qg, kg, g's last row, Aqk) pass through shared memory, staged a chunk
ahead by the pipeliner. For 128 < K <= 256 the state is [K, V slice] (``scan_kernel``), every
load of a chunk issued before the step's first dot. The V slice is picked per grid, the
least waves x measured step latency (``launch_config``; B3's own table, ``states_config``).

B3 is the transposed kernel with o compiled out, forming each chunk's u = Akk_inv bf16(beta v)
itself during the step before, after that step's dots on the chain (the ``forms_u``
capability: B2 then writes no u, 1.07 GB less at prod8192_gate).

Numerics: the chunk loop is the sequential recurrence, in fla's order; only the blocking
inside each dot reassociates fp32 sums (o within 2e-3 of fla's on the H200). Causal to the
bit: a non-finite v_new value is selected away from the tokens before it in the masked
intra-chunk dot (0 * NaN is NaN) and makes its outputs NaN from its token on; the check
costs 0.23 ms at prod8192_gate (1.99 against 1.76 without, same run: docs/log/trust.md).
Falls back (``supports``): chunk size other than 64, K > 256; as B3 also K > 128.

Measured: the README's stage table (F7-F8 rows, 2.19x fla's two stages at prod8192_gate, 1.52x
the floor; B3 rows: 0.89x fla's F7 at prod8192_gate, which B2's unwritten u pays for; on 32
chains 0.97x at BV=32, where BV=64 took 0.83x; F7-F8 there 0.96x). A step at one chain takes
~2.1 us: seven waited wgmma groups and the layout conversions of u^T in and o out. The rounds,
and the designs measured slower (F7-F8 forming qg or u itself, prefetching the next chunk, the
[K, V] state at K <= 128), are in docs/log/scan.md and docs/log/wy.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import (chains, check_dense, config_over, dot, least_waves, sequence_span, sm_count, to,
                                v_slice)


@triton.jit
def _first_non_finite(x, o_t, BT: tl.constexpr, AXIS: tl.constexpr):
    """Along AXIS of the [., BT] or [BT, .] tile x, the first index whose value is NaN or
    +-inf, else BT; read from a 16-bit value's exponent bits (no conversion to fp32)."""
    if x.dtype.is_bf16():
        finite = (x.to(tl.int16, bitcast=True) & 0x7F80) != 0x7F80
    elif x.dtype.is_fp16():
        finite = (x.to(tl.int16, bitcast=True) & 0x7C00) != 0x7C00
    else:
        finite = tl.abs(x.to(tl.float32)) < float("inf")
    if AXIS == 0:
        return tl.min(tl.where(finite, BT, o_t[:, None]), axis=0)
    else:
        return tl.min(tl.where(finite, BT, o_t[None, :]), axis=1)


@triton.jit
def scan_kernel(
    qg, kg, w, u, g, Aqk, h0, o, ht, h, v_new, cu_seqlens, chunk_offsets, scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, SAVE_STATES: tl.constexpr,
):
    """The scan with its output on one (sequence, value head, V slice), the state S [K, BV]
    (for 128 < K <= 256): every load of a chunk issued before the step's first dot."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_seq, boh = sequence_span(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
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
        b_w = tl.load(w + p_hk, mask=m_tk, other=0)
        b_u = tl.load(u + p_hv, mask=m_tv, other=0)
        b_qg = tl.load(qg + p_hk, mask=m_tk, other=0)
        b_A = tl.load(Aqk + (row0 + o_t)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=m_t[:, None],
                      other=0)
        b_gl = tl.load(g + (row0 + i_last) * (HV * K) + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_kg = tl.load(kg + p_hk, mask=m_tk, other=0)

        b_Sb = to(b_S, kg.dtype.element_ty)
        if SAVE_STATES:
            tl.store(h + ((boh + i_c) * HV + i_hv) * K * V + p_kv, b_Sb, mask=m_kv)
        b_vn = to(b_u.to(tl.float32) - dot(b_w, b_Sb), u.dtype.element_ty)
        if SAVE_STATES:
            tl.store(v_new + p_hv, b_vn, mask=m_tv)

        b_A = to(tl.where(o_t[None, :] <= o_t[:, None], b_A, 0), u.dtype.element_ty)
        # causal to the bit: from a column's first non-finite v_new row on, its rows are
        # selected away from the masked dot (0 * NaN would reach the rows before) and its
        # outputs are NaN; the state takes v_new as it is
        b_first = _first_non_finite(b_vn, o_t, BT, 0)  # [BV]
        b_late = o_t[:, None] >= b_first[None, :]
        b_o = scale * dot(b_qg, b_Sb) + dot(b_A, tl.where(b_late, 0, b_vn))
        tl.store(o + p_hv, to(tl.where(b_late, float("nan"), b_o), o.dtype.element_ty), mask=m_tv)

        b_S = b_S * tl.exp2(b_gl)[:, None] + dot(tl.trans(b_kg), b_vn)

    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_kv, b_S, mask=m_kv)


@triton.jit
def _side_rows(Aqk, g, row0, n_t, i_hv, o_t, o_k1, o_k2, m_k1, m_k2, HV: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, WITH_O: tl.constexpr):
    """A chunk's Aqk^T [s, t] (its rows t < n_t, unmasked above the diagonal) and g's last
    row in two halves of K. The n_t <= 0 guards are inert at its one call (the current
    chunk); without them the sm_90a code differs from the build measured on the H200, so
    they go with the next measured build."""
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
def _u_transposed(v, beta, Akk, row0, n_t, i_hv, o_t, o_v, m_v, HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
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
def scan_transposed_kernel(
    qg, kg, w, u, g, Aqk, h0, o, ht, h, v_new, cu_seqlens, chunk_offsets, scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, SAVE_STATES: tl.constexpr, RECOMPUTE: tl.constexpr, v=None,
    beta=None, Akk=None,
):
    """The scan with the state held transposed, S^T [V slice, K], in two halves of K (BK/2
    channels each, K <= 128): the V slice is every dot's M side and every dot's N side is
    64, so h^T = bf16(S^T) and v_new^T are register (A) operands in their accumulators'
    layout and only the chunk's rows (w, qg, Aqk, kg) go through shared memory, where the
    pipeliner stages the next chunk's while this one runs:

        v_new^T = u^T - h^T w^T;  o^T = scale h^T qg^T + v_new^T tril(Aqk)^T
        S^T     = S^T exp2(g_last) + v_new^T kg

    The same roundings at the same points as ``scan_kernel``. With RECOMPUTE (B3) o is
    compiled out and u^T is formed here from v, beta and Akk_inv (``_u_transposed``), each
    chunk's during the step before, after that step's last dots on the chain are issued,
    rounded as F6 rounds u where it is used."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_seq, boh = sequence_span(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
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

    if RECOMPUTE:
        b_Un = _u_transposed(v, beta, Akk, bos, T_seq, i_hv, o_t, o_v, m_v, HV, V, BT)
    for i_c in range(0, NT):
        row0 = bos + i_c * BT
        n_t = T_seq - i_c * BT
        m_t = o_t < n_t
        # Aqk's rows and g's last row first (their latency behind the step's first dots:
        # neither depends on the state)
        b_At, b_g1, b_g2 = _side_rows(Aqk, g, row0, n_t, i_hv, o_t, o_k1, o_k2, m_k1, m_k2, HV, K, BT, not RECOMPUTE)
        m_vt = m_v[:, None] & m_t[None, :]
        r_t = (row0 + o_t) * (HV * K) + i_hv * K  # the chunk's rows of [T, HV, K]
        p_vt = (row0 + o_t)[None, :] * (HV * V) + i_hv * V + o_v[:, None]  # [BV, BT] views of [T, V] rows

        b_w1 = tl.load(w + r_t[None, :] + o_k1[:, None], mask=m_k1[:, None] & m_t[None, :], other=0)  # w^T
        b_w2 = tl.load(w + r_t[None, :] + o_k2[:, None], mask=m_k2[:, None] & m_t[None, :], other=0)
        if RECOMPUTE:  # this chunk's u^T, formed during the step before (off the chain)
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
        if not RECOMPUTE:  # qg^T (q exp2(g) as F6 rounded it) and the output
            b_q1 = tl.load(qg + r_t[None, :] + o_k1[:, None], mask=m_k1[:, None] & m_t[None, :], other=0)
            b_q2 = tl.load(qg + r_t[None, :] + o_k2[:, None], mask=m_k2[:, None] & m_t[None, :], other=0)
            b_A = tl.where(o_t[:, None] <= o_t[None, :], b_At, 0).to(b_ut.dtype)  # Aqk^T, s <= t
            # causal to the bit: from a V row's first non-finite v_new token on, its tokens are
            # selected away from the masked dot (0 * NaN would reach the tokens before) and
            # its outputs are NaN; the state takes v_new as it is
            b_first = _first_non_finite(b_vn, o_t, BT, 1)  # [BV]
            b_late = o_t[None, :] >= b_first[:, None]
            b_o = scale * dot(b_H2, b_q2, dot(b_H1, b_q1)) + dot(tl.where(b_late, 0, b_vn), b_A)
            b_o = tl.where(b_late, float("nan"), b_o)
            tl.store(o + p_vt, to(b_o, o.dtype.element_ty), mask=m_vt)
        b_k1 = tl.load(kg + r_t[:, None] + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0)
        b_k2 = tl.load(kg + r_t[:, None] + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0)
        if RECOMPUTE:  # the next chunk's u^T, its dot behind this step's state update
            b_Un = _u_transposed(v, beta, Akk, row0 + BT, n_t - BT, i_hv, o_t, o_v, m_v, HV, V, BT)
        b_S1 = b_S1 * tl.exp2(b_g1)[None, :] + dot(b_vn, b_k1)
        b_S2 = b_S2 * tl.exp2(b_g2)[None, :] + dot(b_vn, b_k2)

    if STORE_HT:
        p_ht = ht + i_nh.to(tl.int64) * K * V
        tl.store(p_ht + p_vk1, b_S1, mask=m_vk1)
        tl.store(p_ht + p_vk2, b_S2, mask=m_vk2)


# --------------------------------------------------------------------------------------
# The pinned configs and the launchers
# --------------------------------------------------------------------------------------
# F7-F8 at K <= 128 (the transposed kernel), by V slice: the config, the chunk step's latency
# at one chain (us: the step8192 shape's time over its 128 steps, H200) and programs an SM
# (sm_90a, K=128, V=256, no spills: BV=32 244 registers and 68 KB of shared memory, an
# mma.sync kernel (an M side of 32); BV=64 at 4 warps 242 and 112 KB; BV=128 at 8 warps 246,
# 112 KB). Measured at prod8192_gate: BV=64 1.75 ms, BV=128 1.77, BV=32 3.18.
TRANSPOSED_STEPS = {32: (dict(BV=32, num_warps=4, num_stages=2), 2.1, 2),
                    64: (dict(BV=64, num_warps=4, num_stages=2), 2.2, 2),
                    128: (dict(BV=128, num_warps=8, num_stages=2), 3.0, 1)}
# F7-F8 at 128 < K <= 256 (the [K, V] kernel), the same by V slice (measured at K=128, where
# this kernel was the pin before the transposed one; sm_90a: BV=32 192 registers, BV=64 255
# with 44 B of spills, both 4 warps and one stage; BV=128 8 warps, 255).
WIDE_K_STEPS = {32: (dict(BV=32, num_warps=4, num_stages=1), 2.2, 2),
                64: (dict(BV=64, num_warps=4, num_stages=1), 2.7, 2),
                128: (dict(BV=128, num_warps=8, num_stages=1), 4.7, 1)}
# B3 (the transposed kernel, o compiled out, u formed), the same by V slice: the step's latency
# at one chain is step8192's time over 128 (H200: BV=32 0.266-0.333 ms, BV=64 0.315-0.397,
# BV=128 0.456-0.519); programs an SM from sm_90a at K=128 (no spills: BV=32 206 registers and
# 54 KB, an mma.sync kernel; BV=64 254 and 90 KB; BV=128 at 8 warps 248 and 100 KB). Measured:
# prod8192_gate (256 chains) BV=64 2.16-2.21 ms, BV=128 2.48-2.67, BV=32 3.33-3.38; on 32
# chains (H200, 2026-12-06) BV=32 0.384 ms at layer2x8192 against BV=64's 0.449 and fla's
# 0.373, 0.509 at small against 0.548 and fla's 0.459.
STATES_STEPS = {32: (dict(BV=32, num_warps=4, num_stages=2), 2.3, 2),
                64: (dict(BV=64, num_warps=4, num_stages=2), 2.8, 2),
                128: (dict(BV=128, num_warps=8, num_stages=2), 3.8, 1)}
# What ``config`` may set (the benchmarks' sweeps; a call runs the config picked here).
CONFIG_KEYS = frozenset({"BV", "num_warps", "num_stages"})


def launch_config(sequence_heads: int, V: int, K: int, sms: int = 132) -> dict:
    """F7-F8's config for ``sequence_heads`` chains of V columns at head dim K on ``sms`` SMs
    (the H200's 132 by default): the V slice whose waves times its step latency is least
    (prod8192_gate's 256 chains: BV=64 at two programs an SM; one chain: BV=32)."""
    return least_waves(TRANSPOSED_STEPS if K <= 128 else WIDE_K_STEPS, sequence_heads, V, sms)


def states_config(sequence_heads: int, V: int, sms: int = 132) -> dict:
    """B3's config, by the same rule from ``STATES_STEPS`` (prod8192_gate's 256 chains: BV=64;
    32 chains, as in fla's layer at B2 T8192: BV=32)."""
    return least_waves(STATES_STEPS, sequence_heads, V, sms)


def scan_output(q, qg, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, save_states, cu_seqlens_cpu,
                state_v_first, chunk_size, cu_seqlens, chunk_indices, config: dict | None = None):
    """The F7-F8 unit with fla's two stages' contracts in one: (o in u's dtype, the final state
    fp32 or None, h [B, NT, HV, K, V] and v_new when ``save_states``, else None, None). It
    reads ``qg`` (q exp2(g) in q's dtype, as F6 writes it when asked) in place of q and the
    cumsum; states in [K, V]. ``config`` overrides the picked launch config
    (``CONFIG_KEYS``)."""
    if state_v_first:
        raise ValueError("the scan kernel keeps its states in [K, V]; the chain passes them so")
    if qg is None:
        raise ValueError("kernel-fun's F7-F8 reads q exp2(g) (qg) as F6 writes it when asked; got none")
    B, T, HV, K = kg.shape
    V = u.shape[3]
    BT = chunk_size
    check_dense(qg=qg, kg=kg, w=w, u=u, gc=gc, Aqk=Aqk)
    N, NT_total, chunk_offsets = chains(B, T, BT, cu_seqlens, chunk_indices)
    cfg = config_over(launch_config(N * HV, V, K, **sm_count(kg)), config, CONFIG_KEYS, "F7-F8")
    o = torch.empty_like(u)
    ht = torch.empty(N, HV, K, V, device=u.device, dtype=torch.float32) if output_final_state else None
    h = v_new = None
    if save_states:
        h = torch.empty(B, NT_total // B, HV, K, V, device=u.device, dtype=kg.dtype)  # B = 1 when packed
        v_new = torch.empty_like(u)
    BV = v_slice(cfg, V)
    args = dict(qg=qg, kg=kg, w=w, u=u, g=gc, Aqk=Aqk, h0=initial_state, o=o, ht=ht, h=h, v_new=v_new,
                cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, scale=scale, T=T, HV=HV, K=K, V=V, BT=BT,
                BV=BV, IS_VARLEN=cu_seqlens is not None, HAS_H0=initial_state is not None,
                STORE_HT=output_final_state, SAVE_STATES=save_states, num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    grid = (triton.cdiv(V, BV), N * HV)
    if K <= 128:  # two halves of K, each at least 32 channels wide (no 32-byte wgmma operand rows)
        scan_transposed_kernel[grid](**args, BK=max(64, triton.next_power_of_2(K)), RECOMPUTE=False)
    else:
        scan_kernel[grid](**args, BK=triton.next_power_of_2(K))
    return o, ht, h, v_new


def scan_states(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens, cu_seqlens_cpu,
                chunk_indices, state_v_first, v, beta, Akk, config: dict | None = None):
    """B3 (F7 recomputed in the backward) with fla's contract: (h [B, NT, HV, K, V], v_new, the
    final state or None). u is formed in the scan from v, beta and Akk_inv as F6 forms it (a
    u given by B2 is not read); states in [K, V]."""
    if state_v_first:
        raise ValueError("the scan kernel keeps its states in [K, V]; the chain passes them so")
    if v is None or beta is None or Akk is None:
        raise ValueError("kernel-fun's B3 forms u from v, beta and Akk_inv: pass all three")
    B, T, HV, K = kg.shape
    V = v.shape[3]
    BT = chunk_size
    if K > 128:
        raise ValueError(f"the transposed-state scan holds K <= 128 in two halves; got K={K}")
    check_dense(kg=kg, w=w, gc=gc, v=v, beta=beta, Akk=Akk)
    N, NT_total, chunk_offsets = chains(B, T, BT, cu_seqlens, chunk_indices)
    cfg = config_over(states_config(N * HV, V, **sm_count(kg)), config, CONFIG_KEYS, "B3")
    ht = torch.empty(N, HV, K, V, device=v.device, dtype=torch.float32) if output_final_state else None
    h = torch.empty(B, NT_total // B, HV, K, V, device=v.device, dtype=kg.dtype)  # B = 1 when packed
    v_new = torch.empty_like(v)
    BV = v_slice(cfg, V)
    scan_transposed_kernel[(triton.cdiv(V, BV), N * HV)](
        qg=None, kg=kg, w=w, u=None, g=gc, Aqk=None, h0=initial_state, o=None, ht=ht, h=h, v_new=v_new,
        cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, scale=1.0, T=T, HV=HV, K=K, V=V, BT=BT,
        BK=max(64, triton.next_power_of_2(K)), BV=BV, IS_VARLEN=cu_seqlens is not None,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, SAVE_STATES=True, RECOMPUTE=True,
        v=v, beta=beta, Akk=Akk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return h, v_new, ht


def supports(q, chunk_size, state_v_first=False, **_) -> str | None:
    """None when ``scan_output`` takes the F7-F8 unit, else why F7 and F8 run as fla's."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the scan kernel is built for 64)"
    if q.shape[-1] > 256:
        return f"K={q.shape[-1]} > 256"
    if state_v_first:
        return "states in [V, K] (the kernel's are [K, V])"
    return None


def supports_states(kg, chunk_size, state_v_first, **_) -> str | None:
    """None when ``scan_states`` takes B3 (the transposed kernel, forming u: K <= 128), else
    why B3 runs as fla's."""
    if kg.shape[-1] > 128:
        return f"K={kg.shape[-1]} > 128 (the transposed-state scan holds K in two halves of at most 64)"
    return supports(q=kg, chunk_size=chunk_size, state_v_first=state_v_first)
