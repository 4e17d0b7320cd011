"""B7's anchored tiers in Gluon: one CTA a chunk-head, dA split once, the K slices looped.

A candidate beside ``intra_bwd.py`` (designs ``gluon-chunk``, ``gluon-halves`` and
``gluon-blocks``; sm_90 only; dense or packed sequences; B7 alone or the B7-B9 unit; not
registered).
The Triton kernel runs one program per (K slice, chunk, head): each of a chunk-head's four
programs at K=128 reloads the two [64, 64] fp32 dA tiles, splits them into tf32 halves and
transposes them through shared memory, with its dot operands in registers (255 a thread,
two programs an SM). Here one CTA of 4 warps (one warpgroup) takes the chunk-head: dAqk and
dAkk are read once, split into their tf32 halves and written to shared memory once,
row-major for the row role and transposed for the column role (tf32 wgmma reads A only
K-major): 128 KB. For each K slice of 32 channels that takes an anchored tier (the Triton
kernel's guards, the same arithmetic), the slice's B operands (k times exp2(g_r - g), q and
beta k times exp2(g - g_s), hi and lo: 48 KB) go to shared memory, g_r and g_s each row's
anchors for the row and the column role:
- the chunk tier (``TIERS`` >= 1; the chunk's middle row for every row): each role one wgmma
  chain of eight m64n32k8 steps a dA and tf32 product, the anchor's other half once after;
- the half-chunk tier (``TIERS`` >= 2; each 32-row half's middle row, both roles): each role
  two chains of four steps a dA and product;
- the per-block tier (``TIERS`` = 3, where every 16-row block's own span passes the guard:
  no pairwise diagonal; each block's last row for the row role, its first for the column
  role, both one-sided past the block): each role four chains of two steps.
The split tiers run on shared-memory sub-views of the A tiles and B operands, each block's
factor on its own result. A tier's chains are issued together (async) and waited for once a
block; the epilogue's incoming dq, dk and dg rows are asked of L2 when the slice starts.
Then the Triton kernel's epilogue, with the tail where asked (B8's reverse cumsum of dg over
the chunk's rows, B9's gate backward and its per-chunk partials). The slices that take none
of these tiers are left to the Triton kernel, launched after this one with ``SKIP_CHUNK``
(``SKIP_HALVES``, ``SKIP_BLOCKS``): its programs on the slices taken here return at once,
so every (slice, chunk, head) is written by one of the two.

Numerics: the Triton tiers': the same anchors, the same three tf32 products a dot (hi lo,
lo hi, hi hi), fp32 elsewhere.

Not yet on the H200: the design's first measurement (prediction below). Offline (sm_90a,
K=128, ``python -m tools.compile_report --design gluon-b7`` / ``gluon-b7-halves`` /
``gluon-b7-chunk``): 255 registers; 288 wgmma with all three tiers (8 B of spills, 48 with
the tail; 5,984 SASS instructions, 8dd581574122fbaa), 192 with two (no spills; 4 B with
the tail), 96 with the chunk tier alone (none); 184 KB of shared memory: one CTA an SM (the
Triton pin's program for one slice: 8,248 instructions, 144 B of spills). Held out of the
loop, the operands' per-k-step shared-memory descriptors (112) were hoisted by the compiler
and took 224 registers (784 B of spills); the operand index is an opaque zero computed in
the loop (``_opaque_zero``), so they are formed where used; the anchors' row offsets too.

Prediction (no pipelining across slices yet: a slice's operand loads wait on the previous
slice's wgmmas): at prod8192_layer_safe (every slice on the chunk tier) 3.5-5 ms against
the Triton pin's 6.36; at prod8192_gate (31-52% of the slices on the chunk tier, ~80% on
one of the first two, the rest on the per-block tier) gluon-blocks 4-5.5 ms against 7.49,
gluon-halves 4.5-6 (the per-block slices in Triton).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

from kernel_fun._triton import GUARD_SPAN  # the Triton kernel's guard, the same constant



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
def _half_span(g, st: gl.constexpr, n_t, c, SG: gl.constexpr):
    """The 32-row half st's gate span in this slice through its middle row (the Triton
    kernel's ``_half_span``, the same arithmetic): 0 for a half past the end."""
    ok = st < n_t
    m = (c >= 0) & ok
    mid = gl.load(g + gl.minimum(st + 15, n_t - 1) * SG + c, mask=m, other=0.0)
    first = gl.load(g + st * SG + c, mask=m, other=0.0)
    last = gl.load(g + gl.minimum(st + 31, n_t - 1) * SG + c, mask=m, other=0.0)
    span = gl.maximum(gl.max(first - mid, axis=0), gl.max(mid - last, axis=0))
    return gl.where(ok, span, 0.0)


@gluon.jit
def _chunk_tier(s_a, s_b, z, g_c, gm, m_tk, BT: gl.constexpr, BK: gl.constexpr, lk: gl.constexpr,
                acc_l: gl.constexpr):
    """The chunk tier's sums: one [64, 64] x [64, BK] dot a role and dA, the four chains in
    flight together; the anchor's other half once after. (acc_q, acc_kr, acc_c) in lk."""
    zero = gl.zeros([BT, BK], gl.float32, acc_l)
    b_hi, b_lo = s_b.index(0 + z), s_b.index(1 + z)
    acc_c = _dot3(s_a.index(2 + z), s_a.index(3 + z), s_b.index(4 + z), s_b.index(5 + z), zero, True)
    acc_c = _dot3(s_a.index(6 + z), s_a.index(7 + z), s_b.index(2 + z), s_b.index(3 + z), acc_c, True)
    acc_q = _dot3(s_a.index(0 + z), s_a.index(1 + z), b_hi, b_lo, zero, True)
    acc_kr = _dot3(s_a.index(4 + z), s_a.index(5 + z), b_hi, b_lo, zero, True)
    acc_c, acc_q, acc_kr = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc_c, acc_q, acc_kr))
    down = gl.exp2(gl.where(m_tk, g_c - gm[None, :], float("-inf")))
    return (gl.convert_layout(acc_q, lk) * down, gl.convert_layout(acc_kr, lk) * down,
            gl.convert_layout(acc_c, lk) * gl.exp2(gl.where(m_tk, gm[None, :] - g_c, float("-inf"))))


@gluon.jit
def _split_tier(s_a, s_b, z, g, g_c, t, n_t, c, m_tk, SG: gl.constexpr, W: gl.constexpr, BT: gl.constexpr,
                BK: gl.constexpr, lk: gl.constexpr, acc_l: gl.constexpr):
    """The half-chunk tier's sums (W=32: each half through its middle row, both roles) or
    the per-block tier's (W=16: each block through its last row for the row role, its first
    for the column role): a [64, W] x [W, BK] dot a block, role and dA, on shared-memory
    sub-views of the A tiles and B operands, each block's factor on its own result (rows
    from the block's first for the row role, columns before its end for the column role)."""
    zero = gl.zeros([BT, BK], gl.float32, acc_l)
    acc_q = gl.zeros([BT, BK], gl.float32, lk)
    acc_kr = gl.zeros([BT, BK], gl.float32, lk)
    acc_c = gl.zeros([BT, BK], gl.float32, lk)
    for j in gl.static_range(BT // W):
        if W == 32:
            e = gl.load(g + gl.minimum(32 * j + 15, n_t - 1) * SG + c)[None, :]
            a = e
        else:
            e = gl.load(g + gl.minimum(W * j + W - 1, n_t - 1) * SG + c)[None, :]
            a = gl.load(g + gl.minimum(W * j, n_t - 1) * SG + c)[None, :]
        kb_hi, kb_lo = s_b.index(0 + z).slice(W * j, W, 0), s_b.index(1 + z).slice(W * j, W, 0)
        part_q = _dot3(s_a.index(0 + z).slice(W * j, W, 1), s_a.index(1 + z).slice(W * j, W, 1), kb_hi, kb_lo, zero,
                       True)
        part_kr = _dot3(s_a.index(4 + z).slice(W * j, W, 1), s_a.index(5 + z).slice(W * j, W, 1), kb_hi, kb_lo, zero,
                        True)
        part_c = _dot3(s_a.index(2 + z).slice(W * j, W, 1), s_a.index(3 + z).slice(W * j, W, 1),
                       s_b.index(4 + z).slice(W * j, W, 0), s_b.index(5 + z).slice(W * j, W, 0), zero, True)
        part_c = _dot3(s_a.index(6 + z).slice(W * j, W, 1), s_a.index(7 + z).slice(W * j, W, 1),
                       s_b.index(2 + z).slice(W * j, W, 0), s_b.index(3 + z).slice(W * j, W, 0), part_c, True)
        part_q, part_kr, part_c = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(part_q, part_kr, part_c))
        f = gl.exp2(gl.where(m_tk & (t >= W * j)[:, None], g_c - e, float("-inf")))
        acc_q += f * gl.convert_layout(part_q, lk)
        acc_kr += f * gl.convert_layout(part_kr, lk)
        h = gl.exp2(gl.where(m_tk & (t < W * j + W)[:, None], a - g_c, float("-inf")))
        acc_c += h * gl.convert_layout(part_c, lk)
    return acc_q, acc_kr, acc_c


@gluon.jit
def _block_span(g, st: gl.constexpr, n_t, c, SG: gl.constexpr):
    """The 16-row block st's gate span in this slice, its first row minus its last (the
    Triton kernel's ``_span``, the same arithmetic): 0 for a block past the end."""
    ok = st < n_t
    m = (c >= 0) & ok
    first = gl.load(g + st * SG + c, mask=m, other=0.0)
    last = gl.load(g + (gl.minimum(st + 16, n_t) - 1) * SG + c, mask=m, other=0.0)
    return gl.max(first - last, axis=0)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _dot3(a_hi, a_lo, b_hi, b_lo, acc, ASYNC: gl.constexpr = False):
    """acc + a b in three tf32 products from shared memory, a_hi b_lo + a_lo b_hi + a_hi b_hi
    (issued without waiting with ASYNC: the caller waits)."""
    acc = hopper.warpgroup_mma(a_hi, b_lo, acc, is_async=ASYNC)
    acc = hopper.warpgroup_mma(a_lo, b_hi, acc, is_async=ASYNC)
    return hopper.warpgroup_mma(a_hi, b_hi, acc, is_async=ASYNC)


@gluon.jit
def _prefetch_rows(ptr, rows):
    """Asks L2 for the 128-byte line at ptr + rows (one a row; a hint, returns nothing)."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [ptr + rows], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def intra_bwd_chunk_gluon_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, dg2, db_part, T, NT_ROWS,
    g_raw, A_log, dt_bias, dA_part, dbias_part, lower_bound, NT_ALL, cu_seqlens, chunk_indices,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
    TIERS: gl.constexpr, TAIL: gl.constexpr, HAS_BIAS: gl.constexpr, USE_LOWER_BOUND: gl.constexpr,
    IS_VARLEN: gl.constexpr,
):
    """B7 (with TAIL 1 B8, with TAIL 2 B8 and B9) on one (chunk, head): every K slice of BK
    channels that takes one of the first TIERS tiers (the module docstring); the others are
    left unwritten for the Triton kernel."""
    gl.static_assert(BT == 64, "one warpgroup's M is 64 rows: the chunk")
    NK: gl.constexpr = K // BK
    SK: gl.constexpr = H * K
    SG: gl.constexpr = HV * K
    i_t, i_bh = gl.program_id(0), gl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:  # packed sequences: the chunk's sequence and place in it (B = 1)
        i_n = gl.load(chunk_indices + i_t * 2).to(gl.int64)
        i_c = gl.load(chunk_indices + i_t * 2 + 1).to(gl.int64)
        bos = gl.load(cu_seqlens + i_n).to(gl.int64)
        T_seq = (gl.load(cu_seqlens + i_n + 1).to(gl.int64) - bos).to(gl.int32)
        row0 = bos + i_c * BT
        n_t = gl.minimum(T_seq - i_c.to(gl.int32) * BT, BT)
        i_tg = i_t  # the chunk's index in the batch (the tail's partials)
    else:
        row0 = (i_b * T + i_t * BT).to(gl.int64)
        n_t = gl.minimum(T - i_t * BT, BT)
        i_tg = i_b * gl.cdiv(T, BT) + i_t

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
    if TAIL == 2:
        g_raw += row0 * SG + i_hv * K
        A = gl.exp(gl.load(A_log + i_hv).to(gl.float32))
    o_g = t[:, None] * SG + c[None, :]
    o_qk = t[:, None] * SK + c[None, :]
    mh0 = gl.minimum(15, n_t - 1)  # the halves' middle rows
    mh1 = gl.minimum(47, n_t - 1)
    for i_k in range(NK):
        c0 = i_k * BK
        g0 = gl.load(g + c0 + c)
        gm = gl.load(g + mid * SG + c0 + c)
        ge = gl.load(g + (n_t - 1) * SG + c0 + c)
        whole = gl.maximum(gl.max(g0 - gm, axis=0), gl.max(gm - ge, axis=0)) <= GUARD_SPAN
        if TIERS >= 2:
            halves = gl.maximum(_half_span(g + c0, 0, n_t, c, SG), _half_span(g + c0, 32, n_t, c, SG)) <= GUARD_SPAN
        else:
            halves = whole
        if TIERS >= 3:  # every 16-row block's own span within the guard: no pairwise diagonal
            blocks = gl.maximum(gl.maximum(_block_span(g + c0, 0, n_t, c, SG), _block_span(g + c0, 16, n_t, c, SG)),
                                gl.maximum(_block_span(g + c0, 32, n_t, c, SG),
                                           _block_span(g + c0, 48, n_t, c, SG))) <= GUARD_SPAN
        else:
            blocks = whole
        if whole | halves | blocks:
            # the epilogue's incoming rows into L2 while the operands form and the dots run
            o_pf = gl.minimum(t, n_t - 1) * SG + c0
            _prefetch_rows(dq, o_pf)
            _prefetch_rows(dk, o_pf)
            _prefetch_rows(dg, o_pf)
            # the operand index and the anchors' row offsets from a value the compiler cannot
            # hoist out of the loop: hoisted, the 14 operands' 112 per-k-step descriptors held
            # 224 registers, and every loop-invariant [64, BK] offset tile holds 16 more
            z = _opaque_zero(i_k)
            g_c = gl.load(g + c0 + o_g, mask=m_tk, other=0.0)
            # each row's anchor: the chunk's middle row; its half's middle row; its 16-row
            # block's last row for the row role, its first row for the column role
            if whole:
                g_r = gl.zeros([BT, BK], gl.float32, lk) + gm[None, :]
                g_s = g_r
            elif halves:
                g_r = gl.load(g + c0 + z + gl.where(t < 32, mh0, mh1)[:, None] * SG + c[None, :])
                g_s = g_r
            else:
                g_r = gl.load(g + c0 + z + gl.minimum((t // 16) * 16 + 15, n_t - 1)[:, None] * SG + c[None, :])
                g_s = gl.load(g + c0 + z + gl.minimum((t // 16) * 16, n_t - 1)[:, None] * SG + c[None, :])
            # each operand split and stored as soon as it is formed: few tiles live at once
            gl.thread_barrier()  # the previous slice's wgmmas have read the buffers
            k_c = gl.load(k + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32)
            hi, lo = _split(k_c * gl.exp2(gl.where(m_tk, g_r - g_c, float("-inf"))))
            s_b.index(0).store(hi)
            s_b.index(1).store(lo)
            down = gl.exp2(gl.where(m_tk, g_c - g_s, float("-inf")))
            hi, lo = _split((b_c[:, None] * k_c) * down)
            s_b.index(2).store(hi)
            s_b.index(3).store(lo)
            hi, lo = _split(gl.load(q + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32) * down)
            s_b.index(4).store(hi)
            s_b.index(5).store(lo)
            hopper.fence_async_shared()
            gl.thread_barrier()
            g_c = gl.load(g + c0 + o_g, mask=m_tk, other=0.0)
            if whole:
                acc_q, acc_kr, acc_c = _chunk_tier(s_a, s_b, z, g_c, gm, m_tk, BT, BK, lk, acc_l)
            elif TIERS >= 3:
                if halves:
                    acc_q, acc_kr, acc_c = _split_tier(s_a, s_b, z, g + c0, g_c, t, n_t, c, m_tk, SG, 32, BT, BK, lk,
                                                       acc_l)
                else:
                    acc_q, acc_kr, acc_c = _split_tier(s_a, s_b, z, g + c0, g_c, t, n_t, c, m_tk, SG, 16, BT, BK, lk,
                                                       acc_l)
            else:
                acc_q, acc_kr, acc_c = _split_tier(s_a, s_b, z, g + c0, g_c, t, n_t, c, m_tk, SG, 32, BT, BK, lk, acc_l)
            # the epilogue, in the slice's row layout
            k_c = gl.load(k + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32)
            q_c = gl.load(q + c0 + o_qk, mask=m_tk, other=0.0).to(gl.float32)
            gl.store(dq2 + c0 + o_g, gl.load(dq + c0 + o_g, mask=m_tk, other=0.0) + acc_q, mask=m_tk)
            gl.store(db_part + i_k * NT_ROWS + t * HV, gl.sum(acc_kr * k_c, axis=1), mask=m_t)
            acc_kr = acc_kr * b_c[:, None]
            gl.store(dk2 + c0 + o_g, gl.load(dk + c0 + o_g, mask=m_tk, other=0.0) + acc_kr + acc_c, mask=m_tk)
            b_dg = gl.load(dg + c0 + o_g, mask=m_tk, other=0.0) + q_c * acc_q + k_c * (acc_kr - acc_c)
            if TAIL == 0:
                gl.store(dg2 + c0 + o_g, b_dg, mask=m_tk)
            else:
                # B8: each row's dg summed with every later row's of the chunk
                b_dg = gl.associative_scan(gl.where(m_tk, b_dg, 0.0), 0, _add, reverse=True)
                if TAIL == 1:
                    gl.store(dg2 + c0 + o_g, b_dg, mask=m_tk)
                else:
                    # B9: the raw gate's gradient in its dtype, dA_log's and dt_bias's per-chunk partials
                    x = gl.load(g_raw + c0 + o_g, mask=m_tk, other=0.0).to(gl.float32)
                    if HAS_BIAS:
                        x += gl.load(dt_bias + i_hv * K + c0 + c).to(gl.float32)[None, :]
                    if USE_LOWER_BOUND:
                        sg = _sigmoid(A * x)
                        dx = b_dg * (lower_bound * sg * (1.0 - sg)) * A
                        da = gl.sum(gl.sum(gl.where(m_tk, dx * x, 0.0), axis=1), axis=0)
                    else:
                        softplus = gl.where(x > 20.0, x, gl.log(1.0 + gl.exp(gl.minimum(x, 20.0))))
                        dx = -A * (b_dg * _sigmoid(x))
                        da = gl.sum(gl.sum(gl.where(m_tk, b_dg * (-A * softplus), 0.0), axis=1), axis=0)
                    dx_out = dx.to(dg2.dtype.element_ty)
                    gl.store(dg2 + c0 + o_g, dx_out, mask=m_tk)
                    gl.store(dA_part + (i_k * NT_ALL + i_tg) * HV + i_hv, da)
                    if HAS_BIAS:
                        gl.store(dbias_part + (i_tg * HV + i_hv) * K + c0 + c,
                                 gl.sum(gl.where(m_tk, dx_out.to(gl.float32), 0.0), axis=0))


def launch(q, k, gc, beta, dAqk, dAkk, dq, dk, dq2, dk2, dg2, db_part, dg, BK: int = 32, tiers: int = 3,
           tail: int = 0, g_raw=None, A_log=None, dt_bias=None, dA_part=None, dbias_part=None, lower_bound=None,
           cu_seqlens=None, chunk_indices=None):
    """The CTAs over a dense or packed batch, into the caller's outputs: the chunk tier's slices (tiers
    1), the half-chunk tier's too (2), and the per-block tier's where no diagonal needs the
    pairwise form (3); ``tail`` as the Triton kernel's (1: B8, 2: B8 and B9)."""
    B, T, H, K = k.shape
    HV = gc.shape[2]
    NT = -(-T // 64) if cu_seqlens is None else len(chunk_indices)
    intra_bwd_chunk_gluon_kernel[(NT, B * HV)](
        q, k, gc, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, dg2, db_part, T, B * T * HV,
        g_raw, A_log, dt_bias, dA_part, dbias_part, 0.0 if lower_bound is None else float(lower_bound),
        B * NT if cu_seqlens is None else NT, cu_seqlens, chunk_indices,
        H=H, HV=HV, K=K, BT=64, BK=BK, TIERS=tiers, TAIL=tail, HAS_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None, IS_VARLEN=cu_seqlens is not None, num_warps=4)


def supports(q, k, gc, cu_seqlens=None, BK: int = 32) -> str | None:
    """None where the Gluon tier can run, else why not."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return "the Gluon tier is built for sm_90"
    if BK != 32 or k.shape[-1] % BK:
        return f"K={k.shape[-1]} is not a multiple of the Gluon tier's 32-channel slice"
    return None

