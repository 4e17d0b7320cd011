"""The whole B6 stage (``kernel_fun.kda.kernels.b6_wy_bwd.wy_dqkg_bwd``) as one persistent,
warp-specialized Gluon kernel for sm_90a: step 1's split form (research/b6_ws_probe.py) with
the V side completed and the epilogue, per docs/log/bwd-fused.md.

Scope: dense batches (no packed sequences), T a multiple of 64, K=128, V a multiple of 64,
bf16 inputs, states [B, NT, HV, K, V], chunk 64. Same inputs and outputs as ``wy_dqkg_bwd``
(dq, dk, dv2, db, dg, dA; dq, dk, dg, db, dA fp32, dv2 bf16).

One CTA an SM takes chunk-heads ``i = pid, pid + nprog, ...`` (b*hv fastest, as the Triton
kernel's HEADS_FAST order). Three partitions:

* the producer warp (worker 1): per chunk-head, A ([64, 64] bf16, two buffers so the
  producer runs a whole chunk-head ahead), then per V tile of BV=64 h and dh ([K, BV] of
  h viewed [B*NT*HV*K, V]) and v_new, do, dv, v ([64, BV] of the token-major tensors viewed
  [B*T, HV*V], box at column i_hv*V + iv*BV) by TMA into a ring of STAGES stages; then one
  more ring stage for the epilogues (EPI_TMA, ``_epi_views``): q and k ([64, 64] bf16 K halves
  of [B*T, H*K], column i_h*K + 64j) into its four token-major tiles, g ([64, 64] fp32 K halves
  of [B*T, HV*K], column i_hv*K + 64j) into its h and dh tiles reinterpreted as fp32;
* consumer 0 (the default partition, one warpgroup) and consumer 1 (worker 0, one warpgroup),
  consumer j owning channels 64j..64j+63 of dq, dk_h and dw ([64, 64] fp32 each).

The V-side sums are split, not duplicated: consumer 0 accumulates dA's ``dvn v^T`` (a wgmma
a tile); consumer 1 forms ``A^T dvn`` a tile (A^T the wgmma's A operand, from shared memory;
in registers with EPI_TMA=False),
stores dv2 = bf16(beta (A^T dvn)) and sums db's v-side ``(A^T dvn) * v`` over each tile's
columns (the Triton kernel sums element by element and over V once after the loop: fp32
reassociation, ~1e-7 on db by its own log); each consumer sums
``h * dh`` over V for its own 64 channels (K-local, read from the stage's tiles).

The epilogue, per consumer on its K half, is the Triton kernel's math in its order: dq =
dq_acc exp2(g) scale; dg = q dq; dk_h = dk_acc exp2(g_last - g); dg -= k dk_h; dgk =
sum_V(h dh) exp2(g_last) + colsum(k dk_h); dwb = bf16(-dw); kg = k exp2(g) (fp32, bf16 for
the dot); the partial ``dwb kg^T`` of dA (consumer 0 accumulates it onto its ``dvn v^T``);
the k-side terms (``_k_side_terms``: dkgb = A^T dwb, db's k-side row sum, dg and dk's
terms); dk and dg stored. The K-contracted sums cross through shared memory: consumer 1
writes its [64, 64] fp32 dA partial and its two db row sums (v-side, k-side) and arrives on
an mbarrier; consumer 0 waits, sums, runs the dA chain (``_da_chain``: two dependent
[64, 64] bf16 dots, the second's B operand through shared memory) and stores dA and db.
q, k and g are read from that ring stage at each use (``smem.load`` in the accumulators'
layout, exp2(g) recomputed rather than held), the stage released after dk's and dg's last
terms (so through an epilogue the producer has one stage, not two, of the next chunk-head
loaded); A^T is read by the wgmmas as a shared-memory operand (not held in registers).
``EPI_TMA=False`` (variant ``plain_epi``) is the former build: q, k, g by plain global loads,
A^T in registers.

Numerics: every bf16 rounding at the Triton kernel's points (dwb, kg before its dot, dA
before each chain dot, dv2 at the store). Reassociated fp32 sums only: dA = (dvn v^T +
dwb0 kg0^T) + dwb1 kg1^T, db = v-side + (k-side half 0 + half 1), and the blocking of the
dots and row sums, db's v-side per tile.

State (Triton 3.6, offline, sm_90a; nothing run on a GPU yet, so no value or barrier phase is
checked): the main build (2 ring stages, EPI_TMA) compiles warp-specialized (setmaxnreg:
consumers 232, producer 40), 56 HGMMAs, 215,648 B of shared memory (unchanged: the epilogue's
q, k, g reuse a ring stage), and spills 8 B a thread (stores and loads: one loop-invariant word
a consumer, num_programs in consumer 1, a convert_layout scratch address in consumer 0, each
reloaded once a chunk-head), down from 200 B stores / 216 B loads with plain q, k, g loads
(``plain_epi``, which still builds so) that ptxas issued early and held beside the accumulators.
What took it there: q, k, g by TMA into the ring stage after the chunk-head's V tiles and read
from shared memory at each use, exp2(g) recomputed at each use (the same fp32 value), A^T a
shared-memory wgmma operand (epilogue and consumer 1's V loop). Tried and worse (ptxas's
allocation is sensitive to order): dwb stored at the epilogue's start (28-76 B), dk finished
and stored before dg (12 B), gn from the stage's last 8 rows (12 B), the b_dgk conversion
hoisted (12 B), setmaxnreg 240/24 splits (12-68 B), ``_store_pairs`` checking adjacency on
the int32 offsets (1,280 B). Before that, from 1,232 B: db's v-side
summed a tile (not [64, BV] held), consumer 0's ``dvn v^T`` parked in shared memory through the
epilogue, its dA partial's wgmma issued after dk and dg are stored, fp32 tiles stored by pairs
with in-asm addresses (``_store_pairs``), tile offsets made where used (``_fresh``). Three ring
stages do not fit (281,216 B).

BV=32 builds (``bv32``: 4 stages; ``bv32_s2``, ``bv32_s6``): V tiles of 32 columns, 32 KB a ring
stage; the epilogue's q, k, g (64 KB) take a stage pair 2p, 2p + 1 (``_pair``: each of the six ring
buffers' pair reinterpreted as one [64, 64] tile; the ring needs an even number of stages, V a
multiple of 64 keeps the pair from wrapping), the first stage's ready barrier counting all 64 KB,
the second's arrived on without bytes. Consumer 1's A^T dvn, v and dv2 tiles are [64, 32] (their
own wgmma layout), the rest as at BV=64. Offline: ``bv32`` 215,680 B of shared memory, 20 B spill
stores / 20 B loads a thread, 42 HGMMAs; ``bv32_s2`` 150,112 B, 4 B / 4 B; ``bv32_s6`` 281,248 B
(does not fit). What it buys: during an epilogue the producer has 2 of 4 stages, i.e. 2 BV=32 tiles
(64 KB, a quarter of a V=256 chunk-head) of the next chunk-head loaded: the same bytes ahead as the
main build's one BV=64 stage, not a whole chunk-head (256 KB of V-side tiles); in the V loop 3 stages
(96 KB) can be in flight beside the one being read, against the main build's one (64 KB).
Not yet run on a GPU.

The ping-pong form (two consumers on different chunk-heads, each whole in two K-half passes
over V, one three-stage ring) ran at 0.48x the Triton B6 on an H100 (docs/log/bwd-fused.md) and
was removed; the last commit holding it is 2400689.

``python -m research.b6_gluon [variant ...]`` compiles offline (no GPU) and prints one JSON
row a build. ``python -m research.b6_gluon gpu --builds main,bv32 --out FILE`` runs the builds
beside the registered Triton B6 on benchmarks.stages.b6's inputs (``gpu_main``), each checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from research.b6_ws_probe import (SM90_SHARED_BYTES, compile_main, cuda_ms, desc_type, error_text, sm90_report,
                                 wait_or_hang)

__all__ = ["SM90_SHARED_BYTES", "b6_gluon_kernel", "wy_dqkg_bwd_gluon", "compile_rows", "main"]


# st.global of a thread's element pair (pack=2: two adjacent elements of the accumulators'
# layout, columns c and c+1), the address formed inside the asm from one base pointer ($2, $3)
# and int32 element offsets ($4, $5), so no [64, 64] tile of 64-bit pointers is ever live; the
# values are $6, $7. One 8-byte store when the second address is the first + 4 and the first is
# 8-byte aligned (always, in these layouts and tensors), else two 4-byte stores.
_PAIR_F32 = gl.constexpr(
    "{ .reg .b64 a0, a1, d, lo; .reg .pred adj, al;"
    " mul.wide.s32 a0, $4, 4; add.s64 a0, a0, $2; mul.wide.s32 a1, $5, 4; add.s64 a1, a1, $3;"
    " sub.s64 d, a1, a0; and.b64 lo, a0, 7; setp.eq.s64 adj, d, 4; setp.eq.and.s64 adj, lo, 0, adj;"
    " @adj st.global.v2.f32 [a0], {$6, $7}; @!adj st.global.f32 [a0], $6; @!adj st.global.f32 [a1], $7;"
    " mov.b32 $0, 0; mov.b32 $1, 0; }")


@gluon.jit
def _store_pairs(base, off, x):
    """gl.store(base + off, x) for a tile in the accumulators' layout (int32 ``off``): fp32 by pairs,
    anything else by gl.store (a bf16 pair through inline asm crashed the LLVM backend of Triton 3.6)."""
    if x.dtype == gl.float32:
        base64 = base.to(gl.int64, bitcast=True) + off * 0  # the base pointer, broadcast
        gl.inline_asm_elementwise(_PAIR_F32, "=r,=r,l,l,r,r,r,r", [base64, off, x], dtype=gl.int32, is_pure=False,
                                  pack=2)
    else:
        gl.store(base + off, x)


@gluon.jit
def _fresh(x):
    """x (int32) through an opaque move: the tile offsets built from it are formed where they are
    used, not hoisted out of the persistent loop as 32 live registers a thread each (which spilled)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_offsets(r, cc, STRIDE: gl.constexpr):
    """r[:, None] * STRIDE + cc[None, :], both index vectors passed through ``_fresh`` at the use."""
    return _fresh(r)[:, None] * STRIDE + _fresh(cc)[None, :]


@gluon.jit
def _pair(buf, p, dtype: gl.constexpr, layout: gl.constexpr):
    """Stages 2p and 2p + 1 of a ring buffer ([STAGES, R, BV], contiguous) as one [64, 64] tile of dtype."""
    S: gl.constexpr = buf.shape[0]
    R: gl.constexpr = buf.shape[1]
    BV: gl.constexpr = buf.shape[2]
    BT: gl.constexpr = 64
    pairs = buf._reinterpret(buf.dtype, [S // 2, 2 * R, BV], buf.layout)
    return pairs.index(p)._reinterpret(dtype, [BT, BT], layout)


@gluon.jit
def _epi_views(h_s, dh_s, vn_s, do_s, dv_s, v_s, s, J: gl.constexpr):
    """Ring stage s as consumer J's epilogue operands (EPI_TMA): q's and k's [64, 64] bf16 K halves in
    its four token-major tiles (q_0 vn, q_1 do, k_0 dv, k_1 v: the same [64, 64] bf16 layout), g's
    [64, 64] fp32 K half in its h (J=0) or dh (J=1) tile, reinterpreted (16 KB each). At BV=32 (a paired
    ring, 32 KB a stage) the epilogue takes the two stages s, s + 1 (s even) of pair s // 2: each of the
    six buffers' pair is one contiguous tile twice the size (8 KB a token-major pair, 16 KB an h pair)."""
    f32_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    bf16_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    BT: gl.constexpr = vn_s.shape[1]
    if vn_s.shape[2] != BT:
        p = s // 2
        if J == 0:
            q_j = _pair(vn_s, p, gl.bfloat16, bf16_l)
            k_j = _pair(dv_s, p, gl.bfloat16, bf16_l)
            g_j = _pair(h_s, p, gl.float32, f32_l)
        else:
            q_j = _pair(do_s, p, gl.bfloat16, bf16_l)
            k_j = _pair(v_s, p, gl.bfloat16, bf16_l)
            g_j = _pair(dh_s, p, gl.float32, f32_l)
    elif J == 0:
        q_j = vn_s.index(s)
        k_j = dv_s.index(s)
        g_j = h_s.index(s)._reinterpret(gl.float32, [BT, BT], f32_l)
    else:
        q_j = do_s.index(s)
        k_j = v_s.index(s)
        g_j = dh_s.index(s)._reinterpret(gl.float32, [BT, BT], f32_l)
    return q_j, k_j, g_j


@gluon.jit
def _producer(d_h, d_dh, d_vn, d_do, d_dv, d_v, d_A, d_q, d_k, d_g, h_s, dh_s, vn_s, do_s, dv_s, v_s, a_s,
              ready, empty, a_ready, a_empty, T, NT, NBH, NCH,
              H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
              BV: gl.constexpr, STAGES: gl.constexpr, EPI_TMA: gl.constexpr):
    """The producer warp: a chunk-head's A, then six TMA loads a V tile into the ring; with EPI_TMA
    one more ring stage a chunk-head: q, k and g for the epilogues (``_epi_views``)."""
    NV: gl.constexpr = V // BV
    KH: gl.constexpr = K // 2
    nbytes: gl.constexpr = 2 * K * BV * 2 + 4 * BT * BV * 2
    ebytes: gl.constexpr = 2 * BT * K * 2 + BT * K * 4
    EPI_STAGES: gl.constexpr = BT // BV  # ring stages the epilogue's q, k, g take (64 KB)
    gl.static_assert(EPI_STAGES == 1 or (EPI_STAGES == 2 and STAGES % 2 == 0 and NV % 2 == 0),
                     "BV=32: the epilogue's stage pair must not wrap the ring")
    abytes: gl.constexpr = BT * BT * 2
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    c = 0
    n = 0
    for i in range(pid, NCH, nprog):
        i_t = i // NBH
        i_bh = i % NBH
        i_b = i_bh // HV
        i_hv = i_bh % HV
        row0 = i_b * T + i_t * BT
        hrow = ((i_b * NT + i_t) * HV + i_hv) * K
        ab = n % 2
        # empty barriers start with phase 1 complete: the first pass goes straight on
        mbarrier.wait(a_empty.index(ab), ((n // 2) & 1) ^ 1)
        mbarrier.expect(a_ready.index(ab), abytes)
        tma.async_copy_global_to_shared(d_A, [row0, i_hv * BT], a_ready.index(ab), a_s.index(ab))
        for iv in range(NV):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            col = i_hv * V + iv * BV
            tma.async_copy_global_to_shared(d_h, [hrow, iv * BV], bar, h_s.index(s))
            tma.async_copy_global_to_shared(d_dh, [hrow, iv * BV], bar, dh_s.index(s))
            tma.async_copy_global_to_shared(d_do, [row0, col], bar, do_s.index(s))
            tma.async_copy_global_to_shared(d_vn, [row0, col], bar, vn_s.index(s))
            tma.async_copy_global_to_shared(d_dv, [row0, col], bar, dv_s.index(s))
            tma.async_copy_global_to_shared(d_v, [row0, col], bar, v_s.index(s))
            c += 1
        if EPI_TMA:
            i_h = i_hv // (HV // H)
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            if EPI_STAGES == 2:  # the pair's second stage: s is even (NV and STAGES even), s + 1 in the ring
                mbarrier.wait(empty.index(s + 1), (((c + 1) // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, ebytes)
            for j in gl.static_range(2):
                q_j, k_j, g_j = _epi_views(h_s, dh_s, vn_s, do_s, dv_s, v_s, s, j)
                tma.async_copy_global_to_shared(d_q, [row0, i_h * K + j * KH], bar, q_j)
                tma.async_copy_global_to_shared(d_k, [row0, i_h * K + j * KH], bar, k_j)
                tma.async_copy_global_to_shared(d_g, [row0, i_hv * K + j * KH], bar, g_j)
            if EPI_STAGES == 2:
                mbarrier.arrive(ready.index(s + 1))  # no bytes of its own: stage s's barrier counts them all
            c += EPI_STAGES
        n += 1


@gluon.jit
def _consumer(h_s, dh_s, vn_s, do_s, dv_s, v_s, a_s, dw_s, kg_s, xp_s, xa_s, xdbv_s, xdbk_s,
              ready, empty, a_ready, a_empty, x_full, x_empty,
              q, k, g, beta, dq, dk, dv2, dg, db, dA, scale, T, NBH, NCH,
              H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
              BV: gl.constexpr, STAGES: gl.constexpr, J: gl.constexpr, EPI_TMA: gl.constexpr):
    """Consumer warpgroup J: channels 64J..64J+63; the V side's share (module docstring) and the
    epilogue on its K half; consumer 0 also the dA chain, dA and db."""
    NV: gl.constexpr = V // BV
    KH: gl.constexpr = K // 2
    EPI_STAGES: gl.constexpr = BT // BV  # ring stages the epilogue's q, k, g take (``_producer``)
    gl.static_assert(KH == BT and (BV == BT or BV == BT // 2), "[64, 64] accumulators; V tiles of 64 or 32")
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    opa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    red_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 * 8 // BV, BV // 8],
                                           warps_per_cta=[4, 1], order=[1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    # consumer 1's [64, BV] tiles (A^T dvn, v, dv2): acc_l itself at BV=64
    accv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    rowv_l: gl.constexpr = gl.SliceLayout(1, accv_l)
    r = gl.arange(0, BT, layout=row_l)
    cc = gl.arange(0, BT, layout=col_l)
    zero = gl.zeros([BT, BT], gl.float32, acc_l)
    if BV != BT:
        rv = gl.arange(0, BT, layout=rowv_l)
        ccv = gl.arange(0, BV, layout=gl.SliceLayout(0, accv_l))
        zerov = gl.zeros([BT, BV], gl.float32, accv_l)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    c = 0
    n = 0
    for i in range(pid, NCH, nprog):
        i_t = i // NBH
        i_bh = i % NBH
        i_b = i_bh // HV
        i_hv = i_bh % HV
        i_h = i_hv // (HV // H)
        row0 = (i_b * T + i_t * BT).to(gl.int64)
        p_beta = beta + row0 * HV + i_hv
        b_beta = gl.load(p_beta + r * HV).to(gl.float32)
        ab = n % 2
        a_q = gl.zeros([BT, KH], gl.float32, acc_l)
        a_k = gl.zeros([BT, KH], gl.float32, acc_l)
        a_w = gl.zeros([BT, KH], gl.float32, acc_l)
        # consumer 0: dA's V sum dvn v^T; consumer 1: A^T dvn of the tile ([64, BV])
        if J == 0 or BV == BT:
            a_x = gl.zeros([BT, BT], gl.float32, acc_l)
        else:
            a_x = gl.zeros([BT, BV], gl.float32, accv_l)
        b_dgk = gl.zeros([KH], gl.float32, gl.SliceLayout(1, red_l))
        mbarrier.wait(a_ready.index(ab), (n // 2) & 1)
        a_t = a_s.index(ab).permute((1, 0))  # [s, t] view of A[t, s]: A^T, and the K-major B of X A^T
        if J == 1:
            if not EPI_TMA:
                b_At = a_t.load(opa_l)
            b_dbv = gl.zeros([BT], gl.float32, rowv_l)
            p_dv2 = dv2 + (row0 * HV + i_hv) * V
        for iv in range(NV):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            h_j = h_s.index(s).slice(J * KH, KH, dim=0)  # [KH, BV]
            dh_j = dh_s.index(s).slice(J * KH, KH, dim=0)
            h_t = h_j.permute((1, 0))  # [BV, KH], BV contiguous: a K-major B operand
            a_q = warpgroup_mma(do_s.index(s), h_t, a_q, is_async=True)
            a_k = warpgroup_mma(vn_s.index(s), dh_j.permute((1, 0)), a_k, is_async=True)
            a_w = warpgroup_mma(dv_s.index(s), h_t, a_w, is_async=True)
            if J == 0:
                a_x = warpgroup_mma(dv_s.index(s), v_s.index(s).permute((1, 0)), a_x, is_async=True)
            elif BV != BT:
                a_x = warpgroup_mma(a_t, dv_s.index(s), zerov, use_acc=False, is_async=True)
            elif EPI_TMA:
                a_x = warpgroup_mma(a_t, dv_s.index(s), zero, use_acc=False, is_async=True)
            else:
                a_x = warpgroup_mma(b_At, dv_s.index(s), zero, use_acc=False, is_async=True)
            # while the wgmmas run: this half's sum_V h dh from the stage's tiles
            b_dgk += gl.sum(h_j.load(red_l).to(gl.float32) * dh_j.load(red_l).to(gl.float32), axis=1)
            if J == 1:
                if BV == BT:
                    b_v = v_s.index(s).load(acc_l)
                else:
                    b_v = v_s.index(s).load(accv_l)
            a_q, a_k, a_w, a_x = warpgroup_mma_wait(0, deps=[a_q, a_k, a_w, a_x])
            mbarrier.arrive(empty.index(s))  # the stage's empty barrier counts both consumers
            if J == 1:
                b_v = b_v.to(gl.float32)
                if BV == BT:
                    _store_pairs(p_dv2 + iv * BV, _tile_offsets(r, cc, HV * V),
                                 (a_x * b_beta[:, None]).to(gl.bfloat16))
                else:
                    _store_pairs(p_dv2 + iv * BV, _tile_offsets(rv, ccv, HV * V),
                                 (a_x * gl.convert_layout(b_beta, rowv_l)[:, None]).to(gl.bfloat16))
                b_dbv += gl.sum(a_x * b_v, axis=1)
            c += 1

        # ---- the epilogue on channels 64J..64J+63
        base_hk = (row0 * HV + i_hv) * K + J * KH
        base_qk = (row0 * H + i_h) * K + J * KH
        # (each value's live range kept short: the accumulators, g, exp2(g), dg and dk at once
        # would not fit a warpgroup's 232 registers a thread)
        if J == 0:
            xa_s.store(a_x)  # dvn v^T waits in shared memory for the dA partial's wgmma
        if EPI_TMA:
            # q, k and g by TMA into the ring stage after this chunk-head's V tiles
            se = c % STAGES
            mbarrier.wait(ready.index(se), (c // STAGES) & 1)
            if EPI_STAGES == 2:  # the pair's second stage (its phase only: stage se's barrier had the bytes)
                mbarrier.wait(ready.index(se + 1), ((c + 1) // STAGES) & 1)
            q_j, k_j, g_j = _epi_views(h_s, dh_s, vn_s, do_s, dv_s, v_s, se, J)
            b_g = g_j.load(acc_l)
        else:
            # int32 offsets inside a chunk-head's tiles (the chunk-head's base is int64), formed
            # here: [64, 64] offsets in the accumulators' layout are 32 registers a thread each
            b_g = gl.load(g + base_hk + _tile_offsets(r, cc, HV * K))
        b_gn = gl.load(g + base_hk + (BT - 1) * (HV * K) + _fresh(cc))
        if EPI_TMA:
            # every use reads q, k, g from the stage again: nothing of them held between uses
            # (exp2(g) recomputed: the same fp32 value)
            b_dq = a_q * gl.exp2(b_g) * scale
            _store_pairs(dq + base_hk, _tile_offsets(r, cc, HV * K), b_dq)
            b_dg = q_j.load(acc_l).to(gl.float32) * b_dq
            b_dk = a_k * gl.exp2(b_gn[None, :] - g_j.load(acc_l))
            b_kdk = k_j.load(acc_l).to(gl.float32) * b_dk
        else:
            b_dk = a_k * gl.exp2(b_gn[None, :] - b_g)
            b_gexp = gl.exp2(b_g)
            b_dq = a_q * b_gexp * scale
            _store_pairs(dq + base_hk, _tile_offsets(r, cc, HV * K), b_dq)
            b_q = gl.load(q + base_qk + _tile_offsets(r, cc, H * K))
            b_dg = b_q.to(gl.float32) * b_dq
            b_k = gl.load(k + base_qk + _tile_offsets(r, cc, H * K))
            b_kdk = b_k.to(gl.float32) * b_dk
        b_dg -= b_kdk
        b_dgk = gl.convert_layout(b_dgk, col_l) * gl.exp2(b_gn) + gl.sum(b_kdk, axis=0)

        dw_s.index(J).store((-a_w).to(gl.bfloat16))  # dwb
        if EPI_TMA:
            kg_s.index(J).store((k_j.load(acc_l).to(gl.float32) * gl.exp2(g_j.load(acc_l))).to(gl.bfloat16))
        else:
            kg_s.index(J).store((b_k.to(gl.float32) * b_gexp).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        if J == 1:
            # this half's dA partial, handed to consumer 0 as soon as it is formed
            mbarrier.wait(x_empty, (n & 1) ^ 1)
            a_p = warpgroup_mma(dw_s.index(J), kg_s.index(J).permute((1, 0)), zero, use_acc=False, is_async=True)
            a_p = warpgroup_mma_wait(0, deps=[a_p])
            xp_s.store(a_p)
        # _k_side_terms: dkgb = A^T dwb (A^T again from shared memory: not held through the epilogue)
        if EPI_TMA:
            a_d = warpgroup_mma(a_t, dw_s.index(J), zero, use_acc=False, is_async=True)
        else:
            b_At = a_t.load(opa_l)
            a_d = warpgroup_mma(b_At, dw_s.index(J), zero, use_acc=False, is_async=True)
        b_dkgb = warpgroup_mma_wait(0, deps=[a_d])
        if EPI_TMA:
            b_k = k_j.load(acc_l)
            b_gexp = gl.exp2(g_j.load(acc_l))
        b_kg = b_k.to(gl.float32) * b_gexp  # the same fp32 kg again (a bf16 copy went to the dot)
        b_dbk = gl.sum(b_dkgb * b_kg, axis=1)
        b_dg += b_kg * b_dkgb * b_beta[:, None] + gl.where((r == BT - 1)[:, None], b_dgk[None, :], 0)
        b_dk += b_dkgb * b_gexp * b_beta[:, None]
        if EPI_TMA:
            gl.thread_barrier()  # the whole warpgroup has read the stage
            mbarrier.arrive(empty.index(se))
            if EPI_STAGES == 2:
                mbarrier.arrive(empty.index(se + 1))
            c += EPI_STAGES
        _store_pairs(dk + base_hk, _tile_offsets(r, cc, HV * K), b_dk)
        _store_pairs(dg + base_hk, _tile_offsets(r, cc, HV * K), b_dg)

        if J == 1:
            # hand dA's and db's partials to consumer 0
            xdbv_s.store(b_dbv)
            xdbk_s.store(b_dbk)
            mbarrier.arrive(x_full)
            mbarrier.arrive(a_empty.index(ab))
        else:
            # dA's K-contracted partial dwb kg^T onto dvn v^T (dwb and kg still in shared memory)
            a_p = warpgroup_mma(dw_s.index(J), kg_s.index(J).permute((1, 0)), xa_s.load(acc_l))
            mbarrier.wait(x_full, n & 1)
            b_dA = a_p + xp_s.load(acc_l)
            b_db = xdbv_s.load(row_l) + (b_dbk + xdbk_s.load(row_l))
            mbarrier.arrive(x_empty)
            # _da_chain: dA = -A^T strict_lower(X Diag(beta)) A^T, bf16 before each dot
            b_betac = gl.load(p_beta + _fresh(cc) * HV).to(gl.float32)
            b_dA = gl.where(_fresh(r)[:, None] > _fresh(cc)[None, :], b_dA * b_betac[None, :], 0)
            b_dA = warpgroup_mma(gl.convert_layout(b_dA.to(gl.bfloat16), opa_l), a_t, zero, use_acc=False)
            kg_s.index(0).store(b_dA.to(gl.bfloat16))  # consumer 0's kg buffer, its dot done
            fence_async_shared()
            gl.thread_barrier()
            if EPI_TMA:
                b_dA = warpgroup_mma(a_t, kg_s.index(0), zero, use_acc=False)
            else:
                b_dA = warpgroup_mma(b_At, kg_s.index(0), zero, use_acc=False)
            mbarrier.arrive(a_empty.index(ab))
            b_dA = gl.where(_fresh(r)[:, None] > _fresh(cc)[None, :], -b_dA, 0)
            _store_pairs(dA + (row0 * HV + i_hv) * BT, _tile_offsets(r, cc, HV * BT), b_dA)
            gl.store(db + row0 * HV + i_hv + r * HV, b_db)
        n += 1


@gluon.jit
def b6_gluon_kernel(d_h, d_dh, d_vn, d_do, d_dv, d_v, d_A, d_q, d_k, d_g, q, k, g, beta, dq, dk, dv2, dg, db, dA,
                    scale, T, NT, NBH, NCH,
                    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                    BV: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    CONSUMER1_REGS: gl.constexpr, EPI_TMA: gl.constexpr):
    """B6, persistent (launch one CTA an SM), num_warps=4: consumer 0 the default partition,
    consumer 1 (4 warps) and the producer warp the workers."""
    # (at BV=32 the epilogue takes stages 2p, 2p + 1 of each buffer as one tile: ``_pair``)
    gl.static_assert(BV == BT or STAGES % 2 == 0, "BV=32 needs an even number of ring stages (stage pairs)")
    h_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, K, BV], d_h.layout)
    dh_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, K, BV], d_dh.layout)
    vn_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_vn.layout)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_do.layout)
    dv_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_dv.layout)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_v.layout)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], d_A.layout)
    # the consumers' own bf16 operands (dwb, kg; consumer 0's kg buffer also takes the chain's Y)
    dw_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], d_A.layout)
    kg_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], d_A.layout)
    # consumer 1 -> consumer 0: dA's partial and db's two row sums
    f32_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    xp_s = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_l)
    # consumer 0's dvn v^T through the epilogue
    xa_s = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_l)
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    xdbv_s = gl.allocate_shared_memory(gl.float32, [BT], vec_l)
    xdbk_s = gl.allocate_shared_memory(gl.float32, [BT], vec_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    for s in gl.static_range(2):
        mbarrier.init(a_ready.index(s), count=1)
        mbarrier.init(a_empty.index(s), count=2)
    mbarrier.init(x_full, count=1)
    mbarrier.init(x_empty, count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (h_s, dh_s, vn_s, do_s, dv_s, v_s, a_s, dw_s, kg_s, xp_s, xa_s, xdbv_s, xdbk_s,
                     ready, empty, a_ready, a_empty, x_full, x_empty,
                     q, k, g, beta, dq, dk, dv2, dg, db, dA, scale, T, NBH, NCH, H, HV, K, V, BT, BV, STAGES, 0,
                     EPI_TMA)),
        (_consumer, (h_s, dh_s, vn_s, do_s, dv_s, v_s, a_s, dw_s, kg_s, xp_s, xa_s, xdbv_s, xdbk_s,
                     ready, empty, a_ready, a_empty, x_full, x_empty,
                     q, k, g, beta, dq, dk, dv2, dg, db, dA, scale, T, NBH, NCH, H, HV, K, V, BT, BV, STAGES, 1,
                     EPI_TMA)),
        (_producer, (d_h, d_dh, d_vn, d_do, d_dv, d_v, d_A, d_q, d_k, d_g, h_s, dh_s, vn_s, do_s, dv_s, v_s, a_s,
                     ready, empty, a_ready, a_empty, T, NT, NBH, NCH, H, HV, K, V, BT, BV, STAGES, EPI_TMA)),
    ], [4, 1], [CONSUMER1_REGS, PRODUCER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for s in gl.static_range(2):
        mbarrier.invalidate(a_ready.index(s))
        mbarrier.invalidate(a_empty.index(s))
    mbarrier.invalidate(x_full)
    mbarrier.invalidate(x_empty)


# --------------------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------------------
OUTPUTS = ("dq", "dk", "dv2", "db", "dg", "dA")  # wy_dqkg_bwd's return order
BT = 64
DEFAULT_BUILD = dict(BV=64, stages=2, producer_regs=40, consumer1_regs=232, epi_tma=True)


def supports(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
             state_v_first=False) -> str | None:
    """None when ``wy_dqkg_bwd_gluon`` takes the call, else why not."""
    import torch

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if chunk_size != BT:
        return f"chunk_size={chunk_size}, not 64"
    if cu_seqlens is not None:
        return "packed sequences (cu_seqlens)"
    if state_v_first:
        return "state_v_first=True (the kernel reads [K, V] states)"
    if K != 128 or V % 64 or T % BT or HV % H:
        return f"K={K}, V={V}, T={T}, H={H}, HV={HV}: needs K=128, V and T multiples of 64, H dividing HV"
    if any(t.dtype != torch.bfloat16 for t in (q, k, v, v_new, beta, A, h, do, dh, dv)) or gc.dtype != torch.float32:
        return "dtypes: bf16 tensors and an fp32 gate cumsum"
    named = dict(q=q, k=k, v=v, v_new=v_new, gc=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv)
    bad = [n for n, t in named.items() if not t.is_contiguous()]
    if bad:
        return f"not contiguous: {bad}"
    if tuple(h.shape) != (B, T // BT, HV, K, V) or tuple(dh.shape) != tuple(h.shape):
        return f"h/dh are {list(h.shape)}/{list(dh.shape)}, not [B, NT, HV, K, V]"
    return None


def _build(BV=64, stages=2, producer_regs=40, consumer1_regs=232, epi_tma=True):
    """(kernel, the constexprs but H, HV, K, V, num_warps) of a build."""
    ce = dict(BT=BT, BV=BV, STAGES=stages, PRODUCER_REGS=producer_regs, CONSUMER1_REGS=consumer1_regs,
              EPI_TMA=epi_tma)
    return b6_gluon_kernel, ce, 4


def wy_dqkg_bwd_gluon(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                      state_v_first=False, *, build=None, n_ctas=None, fill=None):
    """``wy_dqkg_bwd``'s contract on the Gluon kernel: (dq, dk, dv2, db, dg, dA). ``fill`` prefills
    the outputs (NaN: an unwritten element shows); ``n_ctas`` the persistent grid (SM count)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    why = supports(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                   state_v_first)
    if why is not None:
        raise ValueError(f"b6_gluon does not take the call: {why}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    NT = T // BT
    b = {**DEFAULT_BUILD, **(build or {})}
    kernel, ce, num_warps = _build(**b)
    BV = ce["BV"]

    def desc(x2d, block, dtype=gl.bfloat16):
        return TensorDescriptor.from_tensor(x2d, block, gl.NVMMASharedLayout.get_default_for(block, dtype))

    def token_major(x):  # [B, T, HV, W] -> [B*T, HV*W]: a chunk-head's tile is a [64, BV] box
        return desc(x.view(B * T, HV * x.shape[-1]), [BT, BV])

    dev = k.device

    def out(shape, dtype):
        t = torch.empty(shape, device=dev, dtype=dtype)
        return t if fill is None else t.fill_(fill)

    dq, dk, dg = (out((B, T, HV, K), torch.float32) for _ in range(3))
    dv2 = out(tuple(v.shape), v.dtype)
    db = out((B, T, HV), torch.float32)
    dA = out((B, T, HV, BT), torch.float32)
    nch = B * NT * HV
    if n_ctas is None:
        n_ctas = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel[(max(1, min(n_ctas, nch)),)](
        desc(h.view(-1, V), [K, BV]), desc(dh.view(-1, V), [K, BV]), token_major(v_new), token_major(do),
        token_major(dv), token_major(v), desc(A.view(B * T, HV * BT), [BT, BT]),
        # the epilogue's q, k (bf16 [B*T, H*K]) and g (fp32 [B*T, HV*K]): a [64, 64] box a K half
        desc(q.view(B * T, H * K), [BT, K // 2]), desc(k.view(B * T, H * K), [BT, K // 2]),
        desc(gc.view(B * T, HV * K), [BT, K // 2], gl.float32),
        q, k, gc, beta, dq, dk, dv2, dg, db, dA, float(scale), T, NT, B * HV, nch,
        H=H, HV=HV, K=K, V=V, **ce, num_warps=num_warps)
    return dq, dk, dv2, db, dg, dA


# --------------------------------------------------------------------------------------
# The offline compile (no GPU)
# --------------------------------------------------------------------------------------
# (three ring stages need 281,216 B of shared memory at BV=64, six 281,248 B at BV=32: over the SM's 232,448)
VARIANTS = {
    "main": dict(BV=64, stages=2),
    "plain_epi": dict(BV=64, stages=2, epi_tma=False),  # q, k, g by plain loads in the epilogues (spilled)
    # BV=32 tiles (32 KB a stage), the ring by stage pairs, the epilogue's q, k, g in one pair (two stages)
    "bv32": dict(BV=32, stages=4),
    "bv32_s2": dict(BV=32, stages=2),
    "bv32_s6": dict(BV=32, stages=6),
}


def compile_b6_gluon(H=16, HV=16, K=128, V=256, **build) -> dict:
    """Compile ``b6_gluon_kernel`` for sm_90a and assemble it with Triton's ptxas: one row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    b = {**DEFAULT_BUILD, **build}
    kernel, ce, num_warps = _build(**b)
    ce = dict(H=H, HV=HV, K=K, V=V, **ce)
    BV = ce["BV"]
    f32_layout = gl.NVMMASharedLayout.get_default_for([BT, K // 2], gl.float32)
    sig = {"d_h": desc_type([K, BV]), "d_dh": desc_type([K, BV]),
           **{n: desc_type([BT, BV]) for n in ("d_vn", "d_do", "d_dv", "d_v")}, "d_A": desc_type([BT, BT]),
           "d_q": desc_type([BT, K // 2]), "d_k": desc_type([BT, K // 2]),
           "d_g": f"tensordesc<fp32[{BT}, {K // 2}],{f32_layout!r}>",
           "q": "*bf16", "k": "*bf16", "g": "*fp32", "beta": "*bf16",
           "dq": "*fp32", "dk": "*fp32", "dv2": "*bf16", "dg": "*fp32", "db": "*fp32", "dA": "*fp32",
           "scale": "fp32", "T": "i32", "NT": "i32", "NBH": "i32", "NCH": "i32", **dict.fromkeys(ce, "constexpr")}
    names = list(sig)
    ptrs = ("q", "k", "g", "beta", "dq", "dk", "dv2", "dg", "db", "dA")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    row = dict(H=H, HV=HV, K=K, V=V, **b, num_warps=num_warps)
    try:
        compiled = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=ce, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    except Exception as e:  # the compiler's error is the row
        return {**row, "ok": False, "error": error_text(e)}
    return {**row, "ok": True, **sm90_report(compiled)}


def compile_rows(names=None) -> list[dict]:
    """One row a build variant (``VARIANTS``; all of them unless ``names``)."""
    return [{"variant": n, "kind": "b6_gluon_compile", **compile_b6_gluon(**VARIANTS[n])} for n in (names or VARIANTS)]


# --------------------------------------------------------------------------------------
# The GPU run (``gpu``): every output against the registered Triton B6, both timed
# --------------------------------------------------------------------------------------
GPU_SHAPES = ("prod8192_gate", "b8", "grid1024")
BARS = dict(dq=1e-5, dk=1e-5, dv2=1e-2, db=1e-5, dg=1e-5, dA=1e-5)  # relative RMS against the Triton B6


def rel_rms(got, ref) -> float:
    """||got - ref|| / ||ref|| over the whole tensor, in float64, in slices (NaN anywhere gives NaN)."""
    num = den = 0.0
    for a, b in zip(got.reshape(-1).split(1 << 26), ref.reshape(-1).split(1 << 26)):
        a, b = a.double(), b.double()
        num += float((a - b).pow(2).sum())
        den += float(b.pow(2).sum())
    if den > 0 or num != num:
        return (num / den) ** 0.5 if den > 0 else num
    return 0.0 if num == 0 else float("inf")


class _NanEmpty:
    """Inside: torch.empty and torch.empty_like return NaN-filled floating tensors, so the registered
    B6's outputs (allocated in its launcher) show an unwritten element as NaN too."""

    def __enter__(self):
        import torch

        self._saved = torch.empty, torch.empty_like
        empty, empty_like = self._saved

        def nan_fill(t):
            return t.fill_(float("nan")) if t.is_floating_point() else t

        torch.empty = lambda *a, **kw: nan_fill(empty(*a, **kw))
        torch.empty_like = lambda *a, **kw: nan_fill(empty_like(*a, **kw))
        return self

    def __exit__(self, *exc):
        import torch

        torch.empty, torch.empty_like = self._saved
        return False


def run_shape(name: str, warmup: int, reps: int, hang_s: float, seed: int = 0, builds=("main",)) -> list[dict]:
    """One shape: the registered B6 and each Gluon build (``VARIANTS``) on benchmarks.stages.b6's inputs,
    outputs compared (``BARS``), all timed in this process; one row a build (the Triton B6's time in
    each). Exceptions and a hang end up in the rows; after a hang or a fault no further build runs."""
    import torch

    from benchmarks.stages.b6 import b6_bytes, make_inputs
    from kernel_fun.kda.kernels import b6_wy_bwd
    from kernel_fun.kda.problems import problem

    p = problem(name)
    row = dict(kind="b6_gluon_gpu", shape=name, B=p.B, T=p.T, H=p.H, HV=p.HV, K=p.K, V=p.V,
               gpu=torch.cuda.get_device_name(), ok=False)
    rows = [{"variant": b, **row, "build": {**DEFAULT_BUILD, **VARIANTS[b]}} for b in builds]
    inputs = make_inputs(p, "cuda", seed)
    nch = p.B * (p.T // BT) * p.HV
    row["chunk_heads"] = nch
    row["floor_ms"] = round(b6_bytes(p) / 4.25e12 * 1e3, 4)
    why = supports(**inputs)
    for r in rows:
        r.update(chunk_heads=row["chunk_heads"], floor_ms=row["floor_ms"])
    if why is not None:
        return [{**r, "error": f"b6_gluon refuses: {why}"} for r in rows]
    try:
        with _NanEmpty():
            ref = b6_wy_bwd.wy_dqkg_bwd(**inputs)
        torch.cuda.synchronize()
        ref_finite = {n: bool(torch.isfinite(t).all()) for n, t in zip(OUTPUTS, ref)}
        fn = lambda: b6_wy_bwd.wy_dqkg_bwd(**inputs)  # noqa: E731
        triton_ms = cuda_ms(fn, warmup, reps)
    except Exception as e:
        return [{**r, "error": f"registered B6: {error_text(e)}"} for r in rows]
    done = []
    for row in rows:
        done.append(row)
        row.update(ref_finite=ref_finite, triton=triton_ms)
        build = VARIANTS[row["variant"]]
        try:
            got = wy_dqkg_bwd_gluon(**inputs, build=build, fill=float("nan"))
            if not wait_or_hang(hang_s):
                row.update(hung=True, error=f"hung: the Gluon kernel still ran after {hang_s:g} s")
                break
            row["errors"] = {n: rel_rms(a, b) for n, a, b in zip(OUTPUTS, got, ref)}
            row["finite"] = {n: bool(torch.isfinite(a).all()) for n, a in zip(OUTPUTS, got)}
            del got
            row["ok"] = (all(row["errors"][n] <= BARS[n] for n in OUTPUTS) and all(row["finite"].values())
                         and all(row["ref_finite"].values()))
            fn = lambda: wy_dqkg_bwd_gluon(**inputs, build=build)  # noqa: E731
            row["gluon"] = cuda_ms(fn, warmup, reps)
        except Exception as e:
            row["error"] = f"gluon: {error_text(e)}"
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # a fault is sticky: later builds and shapes would fail with it
                row["dead"] = error_text(e2)[:200]
                break
    return done


def gpu_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m research.b6_gluon gpu",
                                description="The Gluon B6 beside the registered Triton B6: every output compared "
                                            "(relative RMS), both timed (CUDA events, median).")
    p.add_argument("shapes", nargs="*", help=f"problems (default: {', '.join(GPU_SHAPES)})")
    p.add_argument("--builds", default="main",
                   help=f"comma-separated build variants, of {', '.join(VARIANTS)} (default: main), each checked "
                        "and timed beside the one Triton B6 timing a shape")
    p.add_argument("--out", default=None, help="a jsonl file to append the rows to")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hang-s", type=float, default=60.0, help="seconds before the checking call counts as hung")
    args = p.parse_args(argv)
    builds = [b for b in args.builds.split(",") if b]
    for b in builds:
        if b not in VARIANTS:
            p.error(f"no variant {b!r}")
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (sm_90a: an H100 or H200)")
    os.environ.pop("TRITON_INTERPRET", None)
    rows = []
    for name in args.shapes or GPU_SHAPES:
        shape_rows = run_shape(name, args.warmup, args.reps, args.hang_s, builds=builds)
        for row in shape_rows:
            try:
                from benchmarks import rows as results

                row.update(commit=results.commit(), date=results.now())
            except Exception:
                pass
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row, sort_keys=True) + "\n")
        torch.cuda.empty_cache()
        if any(row.get("hung") or row.get("dead") for row in shape_rows):
            break
    print(f"\n{'shape':14s} {'build':10s} {'ok':5s} " + " ".join(f"{n:>9s}" for n in OUTPUTS)
          + f" {'triton ms':>10s} {'gluon ms':>9s} {'speedup':>8s} {'floor ms':>9s}")
    for r in rows:
        errs = r.get("errors") or {}
        cells = " ".join(f"{errs[n]:9.2e}" if n in errs else f"{'-':>9s}" for n in OUTPUTS)
        t = (r.get("triton") or {}).get("ms")
        gm = (r.get("gluon") or {}).get("ms")
        sp = f"{t / gm:8.2f}" if t and gm else f"{'-':>8s}"
        print(f"{r['shape']:14s} {r['variant']:10s} {str(r['ok']):5s} {cells} {t if t else '-':>10} "
              f"{gm if gm else '-':>9} {sp} {r.get('floor_ms', '-'):>9}"
              + (f"  {r['error'][:160]}" if r.get("error") else ""))
    print("bars (relative RMS against the Triton B6): " + ", ".join(f"{n} {b:g}" for n, b in BARS.items()))
    if any(r.get("hung") for r in rows):  # don't wait on the deadlocked kernel at exit
        sys.stdout.flush()
        os._exit(3)
    return 0 if rows and all(r.get("ok") for r in rows) else 1


def main(argv=None):
    return compile_main(argv, "research.b6_gluon", __doc__, VARIANTS, compile_rows, gpu_main)

if __name__ == "__main__":
    raise SystemExit(main())
