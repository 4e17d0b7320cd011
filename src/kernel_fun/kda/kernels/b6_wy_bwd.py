"""B6, the WY backward (fla's ``chunk_kda_bwd_wy_dqkg_fused``): dq, dk, dv, db, dg and dA
of every chunk from the state h, its gradient dh and B5's dv.

Per chunk of 64 tokens and value head (S = h[c], dS = dh[c], dvn = B5's dv, A = Akk_inv,
kg = k exp2 gc): ``dq = scale (do S^T) exp2 gc``; ``dk_h = (v_new dS^T) exp2(gc_last - gc)``;
``dw = -dvn S^T``; ``dv2 = beta (A^T dvn)``; ``dk = dk_h + beta exp2(gc) (A^T dw)``;
``db = rowsum(A^T dvn v) + rowsum(A^T dw kg)``;
``dA = -A^T strict_lower([dvn v^T + dw kg^T] Diag(beta)) A^T``;
``dg = q dq - k dk_h + beta kg (A^T dw)``, plus ``exp2(gc_last) sum_V S dS + sum_rows k dk_h``
on the chunk's last row.

Where fla's kernel loses time: it loops over K slabs of 32 or 64 and, inside, over V tiles,
so v_new, do and dv are read once per slab; every dot is [64, BV] @ [BV, 32|64]; a barrier
every inner iteration defeats software pipelining; the epilogue runs once per slab.

This kernel: one program per (chunk, b*hv) and no K-slab loop. h and dh load as [BV, K]
tiles (a transposed view of fla's [K, V]), the V-shaped tiles are read once, the dots widen
to [64, BV] @ [BV, K] and the epilogue runs once. dq, dk, dw [64, K] and dA [64, 64]
accumulate in fp32 registers, so one 8-warp program fills an SM (255 registers) and the
order of its loads is the design: A^T and beta come with every V tile, db's v-side is
summed once after the loop, the epilogue's k, q and g are asked of L2 two tiles before the
end (``prefetch_rows``), the epilogue issues its loads in one batch, pins g and beta to the
layouts their uses need (``opaque_zeros_like``) and stores dq and dA from the accumulators'
layout in 8-byte pairs (``store_pairs``). The V tile is halved until V spans two tiles
(``v_tile``); at K=128 with enough (b, hv) pairs the grid runs b*hv fastest.

Numerics: the V accumulation keeps fla's order (V tiles ascending, fp32 accumulators); only
the blocking inside each dot reassociates fp32 sums. Every bf16 rounding fla makes is made
at the same point (dw and kg before their dots, dA before each chain dot, dv2 at the
store). Both launch orders give the same bits.

Falls back (``supports``): K not 64 or 128, V not a multiple of 32, fp32 inputs, chunk size
other than 64, states in [V, K] (the chain passes [K, V] for either caller layout).

Measured: the README's stage table (B6 rows; 2.58x fla's stage at prod8192_gate, 1.31x its
memory floor). The rounds that shaped it, and the designs it beat, are in docs/log/b6.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import chunk_coords, config_over, dot, opaque_zeros_like, prefetch_rows, store_pairs, to


# --------------------------------------------------------------------------------------
# B6's epilogue pieces
# --------------------------------------------------------------------------------------
@triton.jit
def _k_side_terms(b_At, b_dwb, b_kg, b_gexp, b_beta, b_dgk, m_last, b_dg, b_dk, b_db):
    """The epilogue's terms through kg = k exp2(g) and -dw (bf16):
    dkgb = A^T (-dw), then db += rowsum(dkgb kg), dg += kg dkgb beta (+ dgk on the chunk's
    last row), dk += dkgb exp2(g) beta."""
    b_dkgb = dot(b_At, b_dwb)
    b_db += tl.sum(b_dkgb * b_kg, axis=1)
    b_dg += b_kg * b_dkgb * b_beta[:, None] + tl.where(m_last[:, None], b_dgk[None, :], 0)
    b_dk += b_dkgb * b_gexp * b_beta[:, None]
    return b_dg, b_dk, b_db


@triton.jit
def _da_chain(b_dA, b_At, b_beta, m_strict):
    """dA = -A^T strict_lower(X Diag(beta)) A^T, rounding to A's dtype before each dot as fla does."""
    b_dA = tl.where(m_strict, b_dA * b_beta[None, :], 0)
    b_dA = dot(to(b_dA, b_At.dtype), b_At)
    b_dA = dot(b_At, to(b_dA, b_At.dtype))
    return tl.where(m_strict, -b_dA, 0)


# --------------------------------------------------------------------------------------
# The kernel: full K, one pass over V
# --------------------------------------------------------------------------------------
@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T", "NBH"])
def wy_dqkg_kernel(
    q, k, v, v_new, g, beta, A, h, do, dh, dv,
    dq, dk, dv2, dg, db, dA,
    cu_seqlens, chunk_indices, scale, T, NBH,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
    PF_ITER: tl.constexpr, HEADS_FAST: tl.constexpr,
):
    if HEADS_FAST:
        # 1D grid, b*hv (NBH of them) fastest: the programs in flight work on one chunk
        # index of every sequence and head rather than on consecutive chunks of one head
        pid = tl.program_id(0).to(tl.int64)
        i_t, i_bh = pid // NBH, pid % NBH
    else:
        i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        if tl.load(chunk_indices + i_t * 2) < 0:  # a capacity-shaped index's spare row
            return
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)

    # Every pointer starts at this chunk's first row, so the offsets inside the tile are
    # int32 (an int64 offset tensor costs twice the registers).
    row0 = bos + i_c * BT
    n_t = (T - i_c * BT).to(tl.int32)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    i_last = tl.minimum(n_t, BT) - 1
    m_last = o_t == i_last

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    v += (row0 * HV + i_hv) * V
    v_new += (row0 * HV + i_hv) * V
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    A += (row0 * HV + i_hv) * BT
    h += (i_tg * HV + i_hv) * K * V
    dh += (i_tg * HV + i_hv) * K * V
    do += (row0 * HV + i_hv) * V
    dv += (row0 * HV + i_hv) * V
    dq += (row0 * HV + i_hv) * K
    dk += (row0 * HV + i_hv) * K
    dv2 += (row0 * HV + i_hv) * V
    dg += (row0 * HV + i_hv) * K
    db += row0 * HV + i_hv
    dA += (row0 * HV + i_hv) * BT

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgk = tl.zeros([BK], dtype=tl.float32)
    # db's v-side, sum_V (A dv)*v, accumulated element by element over the V tiles (in
    # ascending order) and summed over its columns once after the loop: a row sum per tile
    # is a cross-thread reduction through shared memory, three of the loop's five CTA
    # barriers per tile (502 -> 468 SASS instructions in the loop). Same terms, fp32
    # reassociated: db moves by ~1e-7 relative, every other output is bit for bit the same.
    b_dbv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        # beta comes with every V tile (an L2 hit after the first): loaded once before the
        # loop, it would hold the first tile requests behind a DRAM round trip (5.75 against
        # 5.41 ms). Written first in the body, its load is issued ahead of the tile wait and
        # the CTA barrier rather than among the dots (5.20 against 5.23 ms at prod8192_gate,
        # b8 2.70 against 2.73, small 0.745 against 0.759; the same outputs bit for bit).
        b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0)
        b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0)
        b_dvn = tl.load(dv + p_tv, mask=m_tv, other=0)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0)
        # [BV, BK] tiles of the state and its gradient: a transposed view of fla's [K, V]
        p_vk = o_v[:, None] + o_k[None, :] * V
        m_vk = m_v[:, None] & m_k[None, :]
        b_hT = tl.load(h + p_vk, mask=m_vk, other=0)
        b_dhT = tl.load(dh + p_vk, mask=m_vk, other=0)
        # A^T too comes with every V tile, through the tile pipeline
        b_At = tl.trans(tl.load(A + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0))
        if PF_ITER >= 0:
            if i_v == PF_ITER:  # the epilogue's k, q, g into L2 while the last tiles stream
                prefetch_rows(k, o_t, H * K, m_t, K)
                prefetch_rows(q, o_t, H * K, m_t, K)
                prefetch_rows(g, o_t, HV * K, m_t, K)

        b_dgk += tl.sum(b_hT.to(tl.float32) * b_dhT.to(tl.float32), axis=0)
        b_dq += dot(b_do, b_hT)
        b_dk += dot(b_vn, b_dhT)
        b_dw += dot(b_dvn, b_hT)
        b_dA += dot(b_dvn, tl.trans(b_v))
        b_dvb = dot(b_At, b_dvn)
        tl.store(dv2 + p_tv, to(b_dvb * b_beta[:, None], dv2.dtype.element_ty), mask=m_tv)
        b_dbv += b_dvb * b_v.to(tl.float32)

    b_db += tl.sum(b_dbv, axis=1)
    # Every epilogue load (A^T and beta again, g's last row, k, q, g) is issued here, in one
    # batch, g last. Each use of a loaded tile starts with a layout conversion, which is a
    # CTA barrier that the compiler places right after the load, so a load written next to
    # its use waits out its own DRAM round trip: three in a row per chunk-head (g, then q,
    # then k) before this ordering.
    p_tk = o_t[:, None] * (HV * K) + o_k[None, :]
    p_qk = o_t[:, None] * (H * K) + o_k[None, :]
    # beta pinned to db's row layout, two loads per thread; its column copy for the dA
    # chain then comes through one shared-memory conversion. Left to itself the compiler
    # loads that copy straight in the chain's layout, 16 two-byte loads per thread whose
    # addresses and values it spills (104 -> 48 B of spills, 125 -> 109 global loads;
    # 5.29 -> 5.12 ms side by side at prod8192_gate, b8 2.76 -> 2.66).
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32) + opaque_zeros_like(b_db)
    b_At = tl.load(A + o_t[None, :] * (HV * BT) + o_t[:, None], mask=m_t[None, :], other=0)
    b_gn = tl.load(g + i_last * (HV * K) + o_k, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(k + p_qk, mask=m_tk, other=0)
    b_q = tl.load(q + p_qk, mask=m_tk, other=0)
    b_g = tl.load(g + p_tk, mask=m_tk, other=0).to(tl.float32)
    # g in the accumulators' layout, converted once: left to itself the compiler computes
    # exp2(g), exp2(gn - g) and k exp2(g) in the load's layout and converts each of them
    # (exp2(g) twice), which took three fp32 [64, K] round trips through shared memory and
    # 124 B more spills per thread (5.41 against 6.03 ms at prod8192_gate).
    b_g = b_g + opaque_zeros_like(b_dq)
    b_gexp = tl.exp2(b_g)

    b_dq = b_dq * b_gexp * scale
    b_dg = b_q.to(tl.float32) * b_dq
    # stored from the accumulators' layout: 104 B of spills per thread instead of 164 (5.38
    # against 5.53 ms at prod8192_gate); by a pointer per element, not offsets (5.00 ->
    # 4.89 ms at prod8192_gate, 3.81 -> 3.75 at kimi, side by side)
    store_pairs(dq + p_tk, None, b_dq, m_tk)

    b_dk = b_dk * tl.where(m_t[:, None], tl.exp2(b_gn[None, :] - b_g), 0)
    b_kdk = b_k.to(tl.float32) * b_dk
    b_dg -= b_kdk
    b_dgk = b_dgk * tl.exp2(b_gn) + tl.sum(b_kdk, axis=0)

    b_dwb = to(-b_dw, b_k.dtype)
    b_kg = b_k * b_gexp
    b_dA += dot(b_dwb, tl.trans(to(b_kg, b_k.dtype)))
    b_dg, b_dk, b_db = _k_side_terms(b_At, b_dwb, b_kg, b_gexp, b_beta, b_dgk, m_last, b_dg, b_dk, b_db)
    tl.store(dk + p_tk, b_dk, mask=m_tk)
    tl.store(dg + p_tk, b_dg, mask=m_tk)

    m_strict = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_dA = _da_chain(b_dA, b_At, b_beta, m_strict)
    # from the accumulators' layout too (one fp32 [64, 64] conversion fewer): with db's
    # v-side summed after the loop, 72 -> 36 B of spills and 4.96 -> 4.77 ms side by side;
    # alone, on the kernel before, 5.12 -> 5.02 and within noise before that
    store_pairs(dA, o_t[:, None] * (HV * BT) + o_t[None, :], b_dA, tl.broadcast_to(m_t[:, None], (BT, BT)))
    tl.store(db + o_t * HV, b_db, mask=m_t)


# --------------------------------------------------------------------------------------
# The pinned configs and the launcher
# --------------------------------------------------------------------------------------
# By K, from the H200 sweeps (docs/log/b6.md). K=128, V=256 at prod8192_gate: BV=64, 8 warps,
# 3 stages 6.74 ms against 7.37 at 2 stages, 7.93 at BV=32 and 9.28-14.76 for the sweep's
# other configs (the kernel of that day; 4.88 ms now). PF_AT, the V tile counted from the end
# during which the epilogue's k, q and g are prefetched into L2: 2 measured 6.26-6.45 ms, 1
# 6.34-6.44, 3 6.51, the first tile 6.95, none 6.47-6.50. K=64 (the k64 shape): the same
# config 1.60 ms, the best measured (4 warps 1.67-1.76, BV=32 or 128 1.88, 2 stages 1.85).
CONFIGS = {
    64: dict(BV=64, num_warps=8, num_stages=3, PF_AT=2),
    128: dict(BV=64, num_warps=8, num_stages=3, PF_AT=2),
}
# The launch order (HEADS_FAST): a 1D grid with b*hv fastest when K = 128 and there are at
# least this many (b, hv) pairs, else fla's order (a 2D grid, chunks fastest). Side by side on
# the H200 (bitwise-equal outputs, ms 2D -> 1D): prod8192_gate 6.31 -> 6.09, kimi 5.36 -> 4.99,
# b8 3.24 -> 3.14 (B*HV 256, 256, 128); small (B*HV 32) 0.94 -> 0.99; k64 (K=64) 1.61 -> 1.62;
# 1,024 chunk-heads (B*HV 16) 0.332 -> 0.326. Why the order matters was not isolated.
HEADS_FAST_MIN_BHV = 128
# What ``config`` may set (the benchmarks' sweeps; a call runs the pinned config).
CONFIG_KEYS = frozenset({"BV", "num_warps", "num_stages", "PF_AT", "HEADS_FAST", "maxnreg"})
# No CTA floor: the kernel beat fla's at every grid measured, down to 64 chunk-heads. Grids
# below this many chunk-heads would go to fla.
MIN_CTAS = 0
_SMALLEST_BV = 32


def heads_fast_order(K: int, n_bhv: int) -> bool:
    """The launch order for K and B*HV (n_bhv) (b, hv) pairs: True for the 1D grid with b*hv
    fastest, False for fla's order."""
    return K == 128 and n_bhv >= HEADS_FAST_MIN_BHV


def v_tile(V: int, pinned: int) -> int:
    """The V tile for V: the pinned width, halved (down to 16) until V spans at least two
    tiles. With a single tile the V loop is peeled and everything in it is live at once: at
    K=128 ~3 KB of spills per thread (measured on the H200 at V=64: 9.20 ms at BV=64 against
    1.88 at BV=32 and fla's 4.67; at K=64, V=64, BV=32 1.22 ms against 1.53 at BV=64)."""
    bv = pinned
    while bv > 16 and triton.cdiv(V, bv) < 2:
        bv //= 2
    return bv


def launch_config(K: int, V: int, n_bhv: int, config: dict | None = None) -> dict:
    """The effective launch config: the pinned one for K, ``config`` over it, and the V tile
    (``v_tile``) and the launch order (HEADS_FAST) the rules pick unless ``config`` sets
    them."""
    cfg = config_over(CONFIGS[K], config, CONFIG_KEYS, "B6")
    if "BV" not in (config or {}):
        cfg["BV"] = v_tile(V, cfg["BV"])
    if cfg.get("HEADS_FAST") is None:
        cfg["HEADS_FAST"] = heads_fast_order(K, n_bhv)
    return cfg


def prefetch_iter(V: int, BV: int, pf_at: int | None) -> int:
    """PF_ITER: the V tile (from 0) during which the epilogue's k, q and g are prefetched
    into L2, ``pf_at`` tiles before the end (the first tile if there are fewer); -1, no
    prefetch, without ``pf_at``."""
    return max(triton.cdiv(V, BV) - pf_at, 0) if pf_at else -1


def wy_dqkg_bwd(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                state_v_first: bool = False, config: dict | None = None):
    """B6 with fla's contract: returns (dq, dk, dv2, db, dg, dA); dq/dk/dg/db/dA fp32. h and
    dh are ``[B, NT, HV, K, V]`` (``state_v_first`` is refused: ``supports``). ``config``
    overrides the pinned launch config (``CONFIG_KEYS``)."""
    if state_v_first:
        raise ValueError("B6's kernel reads h and dh in [K, V]; the chain passes that layout for either caller layout")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    for name, t in dict(q=q, k=k, v=v, v_new=v_new, gc=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv).items():
        if not t.is_contiguous():
            raise ValueError(f"B6's kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    cfg = launch_config(K, V, B * HV, config)
    BK = triton.next_power_of_2(K)
    dq = torch.empty(B, T, HV, K, device=k.device, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dg = torch.empty_like(dq)
    dv2 = torch.empty_like(v)
    db = torch.empty(B, T, HV, device=k.device, dtype=torch.float32)
    dA = torch.empty(B, T, HV, BT, device=k.device, dtype=torch.float32)
    grid = (NT * B * HV,) if cfg["HEADS_FAST"] else (NT, B * HV)
    wy_dqkg_kernel[grid](
        q=q, k=k, v=v, v_new=v_new, g=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv,
        dq=dq, dk=dk, dv2=dv2, dg=dg, db=db, dA=dA,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, NBH=B * HV,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=cfg["BV"],
        PF_ITER=prefetch_iter(V, cfg["BV"], cfg.get("PF_AT")),
        HEADS_FAST=bool(cfg["HEADS_FAST"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return dq, dk, dv2, db, dg, dA


def supports(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
             state_v_first=False):
    """None when ``wy_dqkg_bwd`` takes the call, else why the stage stays on fla."""
    K, V, HV = k.shape[-1], v.shape[-1], v.shape[2]
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (B6 kernels are built for 64)"
    if K not in CONFIGS:
        return f"K={K} (B6 kernels take K in 64, 128)"
    if V % _SMALLEST_BV:
        return f"V={V} is not a multiple of {_SMALLEST_BV}"
    if k.dtype not in (torch.bfloat16, torch.float16) or h.dtype != k.dtype or v.dtype != k.dtype:
        return f"dtype {str(k.dtype).replace('torch.', '')} (B6 kernels take bf16/fp16)"
    if state_v_first:
        return "state_v_first=True (B6's kernel reads [K, V] states, which the chain passes for either caller layout)"
    if tuple(h.shape[-2:]) != (K, V) or tuple(dh.shape[-2:]) != (K, V):
        return f"h/dh are {list(h.shape[-2:])}/{list(dh.shape[-2:])}, not the [K, V] layout"
    n_chunks = triton.cdiv(k.shape[1], chunk_size) * k.shape[0] if cu_seqlens is None else len(chunk_indices)
    if n_chunks * HV < MIN_CTAS:
        return f"{n_chunks * HV} chunk-heads < the B6 floor of {MIN_CTAS}"
    return None
