"""B7's chunk-anchor tier in Gluon: one CTA a chunk-head, dA split once, the K slices looped.

A candidate beside ``intra_bwd.py`` (design ``gluon-chunk``; sm_90 only, dense sequences,
B7 alone; not registered). The Triton kernel runs one program per (K slice, chunk, head):
each of a chunk-head's four programs at K=128 reloads the two [64, 64] fp32 dA tiles,
splits them into tf32 halves and transposes them through shared memory, with its dot
operands in registers (255 a thread, two programs an SM). Here one CTA of 4 warps (one
warpgroup) takes the chunk-head: dAqk and dAkk are read once, split into their tf32 halves
and written to shared memory once, row-major for the row role and transposed for the column
role (tf32 wgmma reads A only K-major): 128 KB. For each K slice of 32 channels whose
factors through the chunk's middle row pass the guard (the Triton kernel's chunk tier,
the same test), the slice's B operands (k times exp2(g_m - g), q and beta k times exp2(g -
g_m), hi and lo: 48 KB) go to shared memory and twelve m64n32k8 wgmma chains (three tf32
products a dot, the Triton kernel's order) form the row and column roles; the epilogue is
the Triton kernel's. Slices that fail the guard are left to the Triton kernel, launched
after this one with ``SKIP_CHUNK`` (its programs on passing slices return at once), so
every (slice, chunk, head) is written by exactly one of the two.

Numerics: the Triton chunk tier's: the same anchor, the same three tf32 products a dot,
fp32 elsewhere; the sums' order inside a wgmma chain is the hardware's either way.

Not yet on the H200: this is the design's first measurement (prediction below). Offline
(sm_90a, K=128, ``python -m tools.compile_report --design gluon-b7``): 255 registers, no
spills, 96 wgmma (twelve chains of eight m64n32k8), 184 KB of shared memory. Held out of the
loop, the operands' per-k-step shared-memory descriptors (112) were hoisted by the compiler
and took 224 registers (784 B of spills); the operand index is now an opaque zero computed
in the loop (``_opaque_zero``), so they are formed where used.

Prediction (prod8192_layer_safe, every slice on the chunk tier): the Triton kernel's 6.36
ms is ~16 us a program at two programs an SM; here a chunk-head's four slices run in one
CTA, one an SM, without the three reloads, splits and transposes of dA: 3.5-5 ms if the
slices' loads and wgmmas do not overlap (no pipelining in this version), the gap to the 2.28
ms floor being the serial slice loop.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

GUARD = gl.constexpr(64.0)  # the Triton kernel's GUARD_SPAN


@gluon.jit
def _split(x):
    """x's tf32 half (the low 13 mantissa bits cleared) and the exact remainder."""
    hi = (x.to(gl.uint32, bitcast=True) & 0xFFFFE000).to(gl.float32, bitcast=True)
    return hi, x - hi


@gluon.jit
def _opaque_zero(i):
    """0, as an instruction the compiler cannot move out of the loop that computes i."""
    return gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dot3(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + a b in three tf32 products from shared memory, a_hi b_lo + a_lo b_hi + a_hi b_hi."""
    acc = hopper.warpgroup_mma(a_hi, b_lo, acc)
    acc = hopper.warpgroup_mma(a_lo, b_hi, acc)
    return hopper.warpgroup_mma(a_hi, b_hi, acc)


@gluon.jit
def intra_bwd_chunk_gluon_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, dg2, db_part, T, NT_ROWS,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
):
    """B7's chunk tier on one (chunk, head) of a dense batch: every K slice of BK channels
    whose factors through the chunk's middle row stay within 2^GUARD."""
    gl.static_assert(BT == 64, "one warpgroup's M is 64 rows: the chunk")
    NK: gl.constexpr = K // BK
    SK: gl.constexpr = H * K
    SG: gl.constexpr = HV * K
    i_t, i_bh = gl.program_id(0), gl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    row0 = (i_b * T + i_t * BT).to(gl.int64)
    n_t = gl.minimum(T - i_t * BT, BT)

    # register layouts: [64, 64] for dA, [64, BK] for a K slice (4 warps)
    la: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    lk: gl.constexpr = gl.BlockedLayout([1, 4], [32 // BK * 4, BK // 4], [4, 1], [1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 8])
    a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2, transposed=True)

    # dA once: rows r, columns s, along the rows; lower (dAqk) and strictly lower (dAkk)
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, la))
    s = gl.arange(0, BT, layout=gl.SliceLayout(0, la))
    m_r = r < n_t
    lower = m_r[:, None] & (s[None, :] < n_t) & (r[:, None] >= s[None, :])
    strict = lower & (r[:, None] > s[None, :])
    p_A = (row0 + r[:, None]) * (HV * BT) + i_hv * BT + s[None, :]
    # the eight A tiles in one allocation: [0..3] dAqk hi, lo and transposed hi, lo; [4..7] dAkk's
    s_a = gl.allocate_shared_memory(gl.float32, [8, BT, BT], a_sl)
    a_hi, a_lo = _split(gl.load(dAqk + p_A, mask=lower, other=0.0))
    s_a.index(0).store(a_hi)
    s_a.index(1).store(a_lo)
    s_a.index(2).store(gl.permute(a_hi, (1, 0)))
    s_a.index(3).store(gl.permute(a_lo, (1, 0)))
    a_hi, a_lo = _split(gl.load(dAkk + p_A, mask=strict, other=0.0))
    s_a.index(4).store(a_hi)
    s_a.index(5).store(a_lo)
    s_a.index(6).store(gl.permute(a_hi, (1, 0)))
    s_a.index(7).store(gl.permute(a_lo, (1, 0)))
    # a slice's B operands, reused slice to slice: k x, beta k x', q x' (hi, lo each)
    s_b = gl.allocate_shared_memory(gl.float32, [6, BT, BK], b_sl)
    t = gl.arange(0, BT, layout=gl.SliceLayout(1, lk))
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, lk))
    m_t = t < n_t
    m_tk = m_t[:, None] & (c[None, :] < BK)
    b_c = gl.load(beta + (row0 + t) * HV + i_hv, mask=m_t, other=0.0).to(gl.float32)
    mid = gl.minimum(BT // 2, n_t) - 1
    # the chunk-head's base pointers once, and int32 tile offsets (64-bit ones, hoisted out
    # of the slice loop, cost 32 registers a tile)
    g += row0 * SG + i_hv * K
    dq += row0 * SG + i_hv * K
    dk += row0 * SG + i_hv * K
    dg += row0 * SG + i_hv * K
    dq2 += row0 * SG + i_hv * K
    dk2 += row0 * SG + i_hv * K
    dg2 += row0 * SG + i_hv * K
    q += row0 * SK + i_h * K
    k += row0 * SK + i_h * K
    db_part += row0 * HV + i_hv
    o_g = t[:, None] * SG + c[None, :]
    o_qk = t[:, None] * SK + c[None, :]
    for i_k in range(NK):
        c0 = i_k * BK
        g_c = gl.load(g + c0 + o_g, mask=m_tk, other=0.0)
        g0 = gl.load(g + c0 + c)
        gm = gl.load(g + mid * SG + c0 + c)
        ge = gl.load(g + (n_t - 1) * SG + c0 + c)
        span = gl.maximum(gl.max(g0 - gm, axis=0), gl.max(gm - ge, axis=0))
        if span <= GUARD:
            # each operand split and stored as soon as it is formed: few tiles live at once
            gl.thread_barrier()  # the previous slice's wgmmas have read the buffers
            k_c = gl.load(k + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32)
            hi, lo = _split(k_c * gl.exp2(gl.where(m_tk, gm[None, :] - g_c, float("-inf"))))
            s_b.index(0).store(hi)
            s_b.index(1).store(lo)
            down = gl.exp2(gl.where(m_tk, g_c - gm[None, :], float("-inf")))
            hi, lo = _split((b_c[:, None] * k_c) * down)
            s_b.index(2).store(hi)
            s_b.index(3).store(lo)
            hi, lo = _split(gl.load(q + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32) * down)
            s_b.index(4).store(hi)
            s_b.index(5).store(lo)
            hopper.fence_async_shared()
            gl.thread_barrier()
            # the descriptors from an index the compiler cannot hoist: hoisted out of the loop,
            # the 14 operands' 112 per-k-step descriptors held 224 registers
            z = _opaque_zero(i_k)
            zero = gl.zeros([BT, BK], gl.float32, acc_l)
            acc_c = _dot3(s_a.index(2 + z), s_a.index(3 + z), s_b.index(4 + z), s_b.index(5 + z), zero)
            acc_c = _dot3(s_a.index(6 + z), s_a.index(7 + z), s_b.index(2 + z), s_b.index(3 + z), acc_c)
            acc_q = _dot3(s_a.index(0 + z), s_a.index(1 + z), s_b.index(0 + z), s_b.index(1 + z), zero)
            acc_kr = _dot3(s_a.index(4 + z), s_a.index(5 + z), s_b.index(0 + z), s_b.index(1 + z), zero)
            # the epilogue, in the slice's row layout: the factors again from g (cheaper than held)
            g_c = gl.load(g + c0 + o_g, mask=m_tk, other=0.0)
            down = gl.exp2(gl.where(m_tk, g_c - gm[None, :], float("-inf")))
            k_c = gl.load(k + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32)
            q_c = gl.load(q + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32)
            acc_q = gl.convert_layout(acc_q, lk) * down
            gl.store(dq2 + c0 + o_g, gl.load(dq + c0 + o_g, mask=m_tk, other=0.0) + acc_q, mask=m_tk)
            acc_kr = gl.convert_layout(acc_kr, lk) * down
            gl.store(db_part + i_k * NT_ROWS + t * HV, gl.sum(acc_kr * k_c, axis=1), mask=m_t)
            acc_kr = acc_kr * b_c[:, None]
            acc_c = gl.convert_layout(acc_c, lk) * gl.exp2(gl.where(m_tk, gm[None, :] - g_c, float("-inf")))
            gl.store(dk2 + c0 + o_g, gl.load(dk + c0 + o_g, mask=m_tk, other=0.0) + acc_kr + acc_c, mask=m_tk)
            gl.store(dg2 + c0 + o_g, gl.load(dg + c0 + o_g, mask=m_tk, other=0.0) + q_c * acc_q
                     + k_c * (acc_kr - acc_c), mask=m_tk)

def launch(q, k, gc, beta, dAqk, dAkk, dq, dk, dq2, dk2, dg2, db_part, dg, BK: int = 32):
    """The chunk tier's CTAs over a dense batch (outputs preallocated by the caller)."""
    B, T, H, K = k.shape
    HV = gc.shape[2]
    NT = -(-T // 64)
    intra_bwd_chunk_gluon_kernel[(NT, B * HV)](
        q, k, gc, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, dg2, db_part, T, B * T * HV,
        H=H, HV=HV, K=K, BT=64, BK=BK, num_warps=4)


def supports(q, k, gc, cu_seqlens, BK: int = 32) -> str | None:
    """None where the Gluon tier can run, else why not."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return "the Gluon tier is built for sm_90"
    if cu_seqlens is not None:
        return "packed sequences (the Gluon tier takes dense batches)"
    if k.shape[-1] % BK:
        return f"K={k.shape[-1]} is not a multiple of {BK}"
    return None

