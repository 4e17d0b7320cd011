"""B4-B5: the reverse state-gradient scan (B5) with B4's dv formed in it, and B4's dAqk.

Replaces fla's ``chunk_kda_bwd_dAv`` (B4), which writes dv = tril(Aqk)^T do (bf16, 1.07 GB at
prod8192_gate) for B5 to read back and dAqk for B7, and ``chunk_gated_delta_rule_bwd_dhu``
(B5). Here one program per (sequence, value head, V slice) carries the state gradient dS in
fp32 from the sequence's last chunk to its first and per chunk computes

    dh_c = bf16(dS);  dv = bf16(tril(Aqk)^T do);  dv2 = bf16(dv + kg dh_c)
    dS   = exp2(g_last) dS + scale qg^T do - w^T dv2

with the roundings where fla's two kernels make them; dv is formed from the step's do tile and
the chunk's Aqk (8 KB), off the state's chain, and never written. dAqk = scale tril(do v_new^T)
(fp32, the diagonal included) comes from a chunk-parallel kernel that reads do and v_new once.

dS is held transposed, dS^T [V slice, K], in two halves of K (``dhu_transposed_kernel``), as
the forward scan holds its state: the V slice is every dot's M side, dv2^T is the next dot's
register operand in its accumulator's layout, and the chunk's rows (kg^T, qg, w, Aqk, do^T) pass
through shared memory. Each dot accumulates onto the last (dv2^T onto dv^T; the update onto
dS^T exp2(g_last) with -bf16(dv2^T) as its operand): the same sums in another fp32 order, and
no spills at any 4-warp width (the update written as fla writes it spilled 88-100 B).

Falls back (``supports``): fp32 inputs, chunk size other than 64, K > 128, states in [V, K];
the chain keeps fla's B4 and B5 under context parallel (its exchange reads B4's dv).

The V slice follows the chains (``launch_config``): BV=128 on many, one program an SM; BV=32 on
few (K > 64), where the step's latency decides.

Measured: the README's stage table (B4-B5 rows, on an H100: 3.41-3.49 ms against fla's B4 + B5
4.59-4.73 at prod8192_gate, 1.34-1.36x at kimi and b8 at BV=128; BV=32 1.17x at small, 0.93x at
layer2x8192, where BV=128 took 0.95x and 0.68x) and whole-op rows (30.80 ms against 31.70 at the
earlier one-stage BV=64 pin). The rounds are in docs/log/b5.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import (chains, check_dense, config_over, dot, least_waves, sequence_span, sm_count, to,
                                v_slice)


@triton.jit
def dhu_transposed_kernel(
    qg, kg, w, g, do, Aqk, dht, dh0, dh, dv2, cu_seqlens, chunk_offsets, scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr,
):
    """The reverse scan on one (sequence, value head, V slice), dS^T [BV, K] in two halves
    (BK/2 channels each, K <= 128):

        dh_c^T  = bf16(dS^T);  dv^T = bf16(do^T tril(Aqk));  dv2^T = bf16(dv^T + dh_c^T kg^T)
        dS^T    = dS^T exp2(g_last) + scale do^T qg - dv2^T w

    with B4's rounding of dv."""
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
    p_vk1, p_vk2 = o_v[:, None] + o_k1[None, :] * V, o_v[:, None] + o_k2[None, :] * V  # dS^T[v, k] of [K, V]
    m_vk1, m_vk2 = m_v[:, None] & m_k1[None, :], m_v[:, None] & m_k2[None, :]

    b_D1 = tl.zeros([BV, BKH], dtype=tl.float32)
    b_D2 = tl.zeros([BV, BKH], dtype=tl.float32)
    if HAS_DHT:
        p_dht = dht + i_nh.to(tl.int64) * K * V
        b_D1 += tl.load(p_dht + p_vk1, mask=m_vk1, other=0).to(tl.float32)
        b_D2 += tl.load(p_dht + p_vk2, mask=m_vk2, other=0).to(tl.float32)

    for i_r in range(0, NT):
        i_c = NT - 1 - i_r
        row0 = bos + i_c * BT
        n_t = T_seq - i_c * BT
        m_t = o_t < n_t
        m_vt = m_v[:, None] & m_t[None, :]
        r_t = (row0 + o_t) * (HV * K) + i_hv * K  # the chunk's rows of [T, HV, K]
        p_vt = (row0 + o_t)[None, :] * (HV * V) + i_hv * V + o_v[:, None]  # [BV, BT] views of [T, V] rows
        r_l = (row0 + tl.minimum(n_t, BT) - 1) * (HV * K) + i_hv * K
        b_g1 = tl.load(g + r_l + o_k1, mask=m_k1, other=0).to(tl.float32)
        b_g2 = tl.load(g + r_l + o_k2, mask=m_k2, other=0).to(tl.float32)
        b_do = tl.load(do + p_vt, mask=m_vt, other=0)  # do^T [BV, BT]
        # dv^T [v, s] = sum over t >= s of do^T[v, t] Aqk[t, s], rounded as B4 stores it
        b_A = tl.load(Aqk + (row0 + o_t)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=m_t[:, None], other=0)
        b_A = tl.where(o_t[None, :] <= o_t[:, None], b_A, 0).to(b_do.dtype)
        b_dv = to(dot(b_do, b_A), b_do.dtype).to(tl.float32)
        b_k1 = tl.load(kg + r_t[None, :] + o_k1[:, None], mask=m_k1[:, None] & m_t[None, :], other=0)  # kg^T
        b_k2 = tl.load(kg + r_t[None, :] + o_k2[:, None], mask=m_k2[:, None] & m_t[None, :], other=0)
        b_H1 = to(b_D1, kg.dtype.element_ty)  # dh_c^T
        b_H2 = to(b_D2, kg.dtype.element_ty)
        p_dh = dh + ((boh + i_c) * HV + i_hv).to(tl.int64) * K * V
        tl.store(p_dh + p_vk1, b_H1, mask=m_vk1)
        tl.store(p_dh + p_vk2, b_H2, mask=m_vk2)
        b_dv2f = dot(b_H2, b_k2, dot(b_H1, b_k1, b_dv))  # dv2^T
        tl.store(dv2 + p_vt, to(b_dv2f, b_do.dtype), mask=m_vt)
        b_ndv2 = to(-b_dv2f, b_do.dtype)  # -bf16(dv2^T): the state's update accumulates onto it
        b_q1 = tl.load(qg + r_t[:, None] + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0)
        b_q2 = tl.load(qg + r_t[:, None] + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0)
        b_w1 = tl.load(w + r_t[:, None] + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0)
        b_w2 = tl.load(w + r_t[:, None] + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0)
        b_D1 = dot(b_ndv2, b_w1, b_D1 * tl.exp2(b_g1)[None, :]) + scale * dot(b_do, b_q1)
        b_D2 = dot(b_ndv2, b_w2, b_D2 * tl.exp2(b_g2)[None, :]) + scale * dot(b_do, b_q2)

    if HAS_DH0:
        p_dh0 = dh0 + i_nh.to(tl.int64) * K * V
        tl.store(p_dh0 + p_vk1, b_D1, mask=m_vk1)
        tl.store(p_dh0 + p_vk2, b_D2, mask=m_vk2)


@triton.jit
def dAqk_kernel(do, v_new, dAqk, chunk_indices, scale, T, HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BV: tl.constexpr, IS_VARLEN: tl.constexpr, cu_seqlens=None):
    """B4's dAqk on one chunk-head: scale tril(do v_new^T) (the diagonal included), fp32, over
    V in slices of BV; zero above the diagonal, as B4 writes it."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T
        T_seq = T
    o_t = tl.arange(0, BT)
    row0 = bos + i_t * BT
    m_t = o_t < T_seq - i_t * BT
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p = (row0 + o_t)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_do = tl.load(do + p, mask=m_tv, other=0)
        b_vn = tl.load(v_new + p, mask=m_tv, other=0)
        b_A = dot(b_do, tl.trans(b_vn), b_A)
    b_A = tl.where(o_t[None, :] <= o_t[:, None], b_A * scale, 0)
    tl.store(dAqk + (row0 + o_t)[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], b_A, mask=m_t[:, None])


# The scan's config by V slice: the config, the chunk step's latency at one chain (us: the
# step8192 shape's time over its 128 steps, H100) and programs an SM (sm_90a, K=128, V=256, no
# spills: BV=32 at 4 warps, two stages, 215 registers and 70 KB, an mma.sync kernel; BV=64 at 4
# warps 232 and 128 KB; BV=128 at 8 warps 234 and 144 KB). ``launch_config`` takes the least
# waves x latency. Measured on an H100 (the unit with dAqk, fla's B4 + B5 in the same process):
# BV=128 3.41-3.49 ms at prod8192_gate against 4.59-4.73, 1.97-2.03 at kimi against 2.60-2.72,
# 1.75 at b8 against 2.38; on 32 chains BV=32: 0.562 at small against fla's 0.657 (BV=128 0.697)
# and 0.446 at layer2x8192 against 0.417 (BV=128 0.613, BV=64 0.511). The sweep at prod8192_gate:
# BV=64 at 4 warps 4.35 (one stage) and 4.47 (two), at 8 warps 6.34 and 4.71, BV=32 5.99, BV=128
# at one stage 4.42. (At K <= 64, BV=64 at 8 warps and a wgmma slice at one stage gave NaN on
# the GPU: ``declines``.)
STEPS = {32: (dict(BV=32, num_warps=4, num_stages=2), 2.6, 2),
         64: (dict(BV=64, num_warps=4, num_stages=2), 3.1, 1),
         128: (dict(BV=128, num_warps=8, num_stages=2), 4.2, 1)}
DAQK_CONFIG = dict(BV=64, num_warps=4, num_stages=2)
# What ``config`` may set (the stage bench's sweep).
CONFIG_KEYS = frozenset({"BV", "num_warps", "num_stages"})


def launch_config(sequence_heads: int, V: int, K: int = 128, sms: int = 132) -> dict:
    """The scan's config for ``sequence_heads`` chains of V columns on ``sms`` SMs: the V slice
    whose waves times its step latency is least (prod8192_gate's 256 chains and kimi's: BV=128,
    one program an SM; 32 chains, as in fla's layer at B2 T8192: BV=32). At K <= 64 (halves of
    32 channels) by V alone: BV=128's config where V > 64, else BV=64's at 4 warps. BV=64 at 8
    warps splits a 32-channel half's products into m64n16k16 wgmmas, whose 32-byte operand rows
    Triton 3.6 reads past the shared allocation: NaN at K=64 V=64 on an H100 (docs/log/b5.md).
    BV=32 has not been held to fla there on a GPU."""
    if K <= 64:
        return dict(STEPS[128][0] if V > 64 else STEPS[64][0])
    return least_waves(STEPS, sequence_heads, V, sms)


def declines(config: dict, V: int, K: int) -> str | None:
    """Why the scan will not launch ``config`` for V columns at head dim K, or None. Over halves
    of 32 channels (K <= 64): BV=64 (after the clip to V) at 8 warps splits the products into
    m64n16k16 wgmmas, whose 32-byte operand rows Triton 3.6 reads past the shared allocation
    (NaN on an H100). A wgmma slice (BV >= 64) at one stage gave NaN at k64v64 and an illegal
    address at T=500 K=64 V=64 on the H200 (2026-12-06); why is not known: that build has no
    32-byte operand rows (m64n64k16 and m64n32k16, as at two stages), only 24 KB of shared
    memory against two stages' 80. Two stages held to fla there, and at K=128 one stage too."""
    if K > 64:
        return None
    bv = v_slice(config, V)
    if bv == 64 and config["num_warps"] == 8:
        return (f"BV=64 at 8 warps with K={K} (halves of 32 channels: m64n16k16 wgmmas, whose operands Triton "
                "3.6 reads past their shared allocation)")
    if bv >= 64 and config.get("num_stages", 2) == 1:
        return (f"BV={bv} at one stage with K={K} (halves of 32 channels: this build gave NaN and an illegal "
                "address on the H200)")
    return None


def dAqk(v_new, do, scale, chunk_size, cu_seqlens, chunk_indices) -> torch.Tensor:
    """B4's dAqk: scale tril(do v_new^T), fp32 [B, T, HV, BT] (Aqk's shape)."""
    B, T, HV, V = do.shape
    BT = chunk_size
    out = torch.empty(B, T, HV, BT, device=do.device, dtype=torch.float32)
    NT = chunk_indices.shape[0] if cu_seqlens is not None else triton.cdiv(T, BT)
    dAqk_kernel[(NT, (1 if cu_seqlens is not None else B) * HV)](
        do=do, v_new=v_new, dAqk=out, chunk_indices=chunk_indices, scale=scale, T=T, HV=HV, V=V, BT=BT,
        BV=min(DAQK_CONFIG["BV"], max(16, triton.next_power_of_2(V))), IS_VARLEN=cu_seqlens is not None,
        cu_seqlens=cu_seqlens, num_warps=DAQK_CONFIG["num_warps"], num_stages=DAQK_CONFIG["num_stages"],
    )
    return out


def dav_dhu(q, k, v_new, do, Aqk, qg, kg, w, gc, h0, dht, scale, state_v_first, chunk_size, cu_seqlens,
            chunk_indices, config: dict | None = None):
    """The B4-B5 unit: (dAqk fp32, dh [B, NT, HV, K, V] in kg's dtype, dh0 fp32 where h0 is given,
    dv2 in do's dtype) as fla's B4 then B5 return them, B4's dv formed inside the scan; states in
    [K, V]. ``config`` overrides the launcher's pick (``CONFIG_KEYS``)."""
    if state_v_first:
        raise ValueError("the reverse scan keeps its states in [K, V]; the chain passes them so")
    B, T, HV, K = kg.shape
    V = do.shape[3]
    BT = chunk_size
    if K > 128:
        raise ValueError(f"the transposed reverse scan holds K <= 128 in two halves; got K={K}")
    do = do.contiguous()
    check_dense(qg=qg, kg=kg, w=w, gc=gc, v_new=v_new, Aqk=Aqk, dht=dht)
    dA = dAqk(v_new, do, scale, chunk_size, cu_seqlens, chunk_indices)
    N, NT_total, offsets = chains(B, T, BT, cu_seqlens, chunk_indices)
    cfg = config_over(launch_config(N * HV, V, K, **sm_count(kg)), config, CONFIG_KEYS, "B4-B5")
    why = declines(cfg, V, K)  # (before anything is allocated)
    if why:
        raise ValueError(f"B4-B5's scan: {why}")
    dh = torch.empty(B, NT_total // B, HV, K, V, device=do.device, dtype=kg.dtype)  # B = 1 when packed
    dh0 = torch.empty(N, HV, K, V, device=do.device, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(do)
    BV = v_slice(cfg, V)
    dhu_transposed_kernel[(triton.cdiv(V, BV), N * HV)](
        qg=qg, kg=kg, w=w, g=gc, do=do, Aqk=Aqk, dht=dht, dh0=dh0, dh=dh, dv2=dv2, cu_seqlens=cu_seqlens,
        chunk_offsets=offsets, scale=scale, T=T, HV=HV, K=K, V=V, BT=BT, BK=max(64, triton.next_power_of_2(K)),
        BV=BV, IS_VARLEN=cu_seqlens is not None, HAS_DHT=dht is not None, HAS_DH0=h0 is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dA, dh, dh0, dv2


def supports(kg=None, chunk_size=64, state_v_first=False, q=None, **_) -> str | None:
    """None when the transposed reverse scan takes the call, else why fla's runs."""
    x = kg if kg is not None else q
    K = x.shape[-1]
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"{x.dtype} inputs (the scan's dots are 16-bit; timed and held to fla at bf16 only)"
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the scan kernel is built for 64)"
    if K > 128:
        return f"K={K} > 128 (the transposed reverse scan holds K in two halves of at most 64)"
    if state_v_first:
        return "states in [V, K] (the kernel's are [K, V])"
    return None
