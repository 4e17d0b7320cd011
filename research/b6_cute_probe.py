"""B6's V loop as a 2-CTA cluster in CuTe DSL (sm_90a): the first steps of the cluster design
in docs/log/bwd-fused.md, up to the whole B6 persistent and, with ``fused``, B6 and the B7-B9
unit in one kernel. Not registered. Measured on an H100 (2026-12-06, docs/log/bwd-fused.md):
every build right, the persistent B6 7.02 ms against the registered B6's 5.77, the fused
kernel 41.3 against the registered B6 and unit's 15.19 (B7's code, fetch-bound, serial behind
B6). Every build compiles without spills and without ptxas's notes that cost speed: the
warp-specialized builds had their setmaxnreg dropped (no .minnctapersm, so ptxas could not
know the register count at entry) and every wgmma serialised (accumulators zeroed by stores
the compiler sank past the fence; a branch between a group's wgmmas; an accumulator read
while a later group ran, inside the loop over chunk-heads).

A chunk-head is one cluster of two CTAs, CTA j owning channels 64j..64j+63 of K=128. Per V
tile of 64, the tiles both CTAs need -- v_new, do and dv ([64, 64] bf16 at the chunk's rows)
-- cross from memory once: each CTA loads half of each and multicasts it to both (TMA
multicast); h and dh's [64, 64] slices of the CTA's K half are its own. One warpgroup a CTA
then accumulates, with async wgmma, over the V tiles:

    dq[:, Kj]  += do    @ h[Kj, :]^T
    dkh[:, Kj] += v_new @ dh[Kj, :]^T
    dw[:, Kj]  += dv    @ h[Kj, :]^T

(B6's V sums of dq, dk and dw without the epilogue: the same sums as research/b6_ws_probe.py,
whose Gluon form cannot multicast). Warp 0 issues the copies into a ring of STAGES stages
(40 KB a stage); the fp32 sums go to memory at the end. With ``exchange``, the step the
design needs distributed shared memory for: dA's K-contracted part ``dw kg^T``, each CTA its
K half's, CTA 1's sent by one bulk copy into CTA 0's shared memory, CTA 0 writing the sum.
With ``vside``, B6's sums over V that need no K, CTA j taking the V tiles of parity j (v
multicast with the rest, the chunk's Akk read once): dA's V part ``dv v^T``, ``dvb = A^T dv``
per tile with ``dv2 = beta dvb`` written in bf16, and db's V part, the row sums of dvb v.
With ``ws`` as well, those sums warp-specialized: a producer warpgroup (one warp issuing
every copy, 40 registers) and two consumer warpgroups (232 each), one for dq and dk_h, one
for dw and the V-side sums, both releasing every stage. With ``full`` as well, the whole of
B6 on that split (``_epi_k``, ``_epi_a``), checked against the package's reference B6. With
``persist`` as well, that build as one cluster a pair of SMs looping over chunk-heads, the
ring running on across them so the next chunk-head's loads overlap the last one's epilogues.

What the probe answers on a GPU: whether the cluster's V loop runs near its traffic floor
with the V side read once for both K halves (the Gluon probe read it twice, once a CTA, or
held the whole K in one CTA).

Layout: h and dh as [NCH * K, V] (a chunk-head's [K, V] state block after another), v_new,
do and dv as [NCH * 64, V], kg as [NCH * 64, K], the outputs [NCH * 64, K] fp32 and dA's
part [NCH * 64, 64] fp32; with ``vside`` v and dv2 as [NCH * 64, V] bf16, Akk as [NCH * 64,
64] bf16, beta [NCH * 64] fp32, and each CTA's partials of dA's and db's V parts as
[NCH * 2 * 64, 64] and [NCH * 2 * 64] fp32 (chunk-head c's CTA j at row block 2c + j); all
row-major.

    python -m research.b6_cute_probe compile     # sm_90a PTX and cubin offline (CuTe DSL installed)
    python -m research.b6_cute_probe gpu [i ...] # the sums against torch's, then timed (BUILDS[i])
"""

import os
import sys

from research.cute_kit import cute_unavailable, ptxas_report, quad_row_sums, regs, warp_col_sums

BT, KH, BV = 64, 64, 64  # chunk rows, a CTA's K half, the V tile
# (``fused``) B7's twelve [64, 64] bf16 tiles, 8 KB each and 1024-aligned, so one after another in
# shared memory: dA's four split tiles, then the B operands kx, kxu, yq, yk, each split. Before B7
# the epilogue's buffers lie over them (kg, dwb and dAb over the first three, dkgb's fp32 over kl and
# xh, the peer's dA partial over xl and uh); during B7 the tail's sums over xh, and x_c's hand-off
# over yqh and yql.
B7_TILES = ("qh", "ql", "kh", "kl", "xh", "xl", "uh", "ul", "yqh", "yql", "ykh", "ykl")
# (ring stages, two tiles' products in flight, dA's K-contracted part exchanged, B6's V-side
# sums, warp-specialized, the whole of B6, persistent): compiled and timed
BUILDS = ((2, True, False, False, False, False, False), (3, True, False, False, False, False, False),
          (3, False, False, False, False, False, False), (2, True, True, False, False, False, False),
          (2, True, False, True, False, False, False), (3, True, False, True, True, False, False),
          (4, True, False, True, True, False, False), (2, True, False, True, True, True, False),
          (2, True, False, True, True, True, True))


def build(K: int = 128, V: int = 256, stages: int = 3, overlap: bool = True, exchange: bool = False,
          vside: bool = False, ws: bool = False, full: bool = False, persist: bool = False,
          scale: float = 128 ** -0.5, clusters: int = 66, H: int = 1, both: bool = False, fused: bool = False,
          raw: str = "bf16", has_bias: bool = True, lower_bound: float | None = None):
    """The probe's host function (a ``cute.jit``), for K = 2 KH and V a multiple of BV.
    ``overlap``: a tile's stage is released once the next tile's products are issued (the
    wgmmas of two tiles in flight); else each tile's products are waited for at once.
    ``exchange``: then the K-contracted part of dA, ``dw kg^T`` over both K halves (dw
    rounded to bf16): each CTA its half's [64, 64] product, CTA 1's sent to CTA 0 by a bulk
    copy into its shared memory (completing on CTA 0's mbarrier), CTA 0 writes the sum.
    ``vside``: then also B6's sums over V that need no K, split between the pair by V tile
    (CTA j the tiles of parity j; v multicast with the other three): dA's V part ``dv v^T``
    and, per tile, ``dvb = A^T dv`` (A the chunk's Akk, read once; its [64, 64] tile in shared
    memory is the MN-major A operand of A^T as it lies), ``dv2 = beta dvb`` written in bf16,
    and db's V part, the row sums of ``dvb * v``: each CTA its partial [64, 64] and [64].
    ``ws`` (with ``vside``, without ``exchange``): the same sums warp-specialized, three
    warpgroups a CTA: a producer (its first warp issues every copy, 40 registers), one
    consumer for the sums that feed dq, dk and dg (dq, dk_h) and one for those that feed dA,
    db and dv2 (dw and the V-side sums), 232 registers each, every stage released by both.
    ``full`` (with ``ws``): the whole of B6 for a chunk-head, the sums' epilogues on each
    consumer (``_epi_k``, ``_epi_a``): dq, dk and dg of the K half, dA on CTA 0 after the
    pair's partials are exchanged, db as four partials (each CTA's V and K parts), dv2.
    ``persist`` (with ``full``): ``clusters`` clusters, each taking chunk-heads in turn, the
    ring running on across them (the producer streams the next chunk-head's tiles while the
    consumers finish the last one's epilogues); Akk in two slots, each with a full and an
    empty barrier; the consumers' hand-offs (kg, dkgb) each handed back by a named barrier;
    the pair's dA exchange armed again on CTA 0 after each read, CTA 1 sending the next
    partial only after CTA 0's remote arrive says the last one was read.
    ``both`` (with ``full``): the pair's dA partials exchanged both ways (each CTA's into the
    same place of the other's, CTA r's partial in slot r), and both CTAs run dA's products on
    the sum, the same bits in each (x0 + x1 either way round), each writing the rows of its
    two warps' blocks: dAkk in both K halves, as a kernel with B7 after B6 needs it.
    ``fused`` (with ``persist`` and ``both``): the backward's chunk kernel, B6 and then the B7-B9
    unit for each chunk-head in the same CTAs (research.b7_cute_probe's body, its two roles on
    the two consumer warpgroups: the first, which holds dq and dk, the column role; the second,
    which formed dA, the row role and the tail, with the gate form ``raw``, ``has_bias``,
    ``lower_bound``). dAkk goes from the second consumer's registers into B7's split tiles in
    shared memory; B7's tiles lie over the epilogue's buffers and the peer's dA slot (``U``), so
    every epilogue buffer is handed on only once B7 is done with it: the two consumers meet
    before B7 writes (barrier 8), the next kg waits for the tail (barrier 5), and the peer is
    told its partial was read only after the tail. dq, dk and dg go to memory from the epilogue
    and come back into the tail (from L2) as in the unit; dA is written whole by both CTAs (the
    tail's elements past the guard read it).
    ``H`` (warp-specialized builds): the token tensors hold H heads side by side, as the op's
    [B, T, H, C] tensors viewed [B * T, H * C] (beta [B * T * H]); chunk-head c is the chunk of
    rows c // H at head c % H, h and dh's [K, V] block c as the op's [B, NT, H, K, V] has it."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass._mlir.dialects.nvvm import MemScopeKind

    CLUSTER = MemScopeKind.CLUSTER

    assert K == 2 * KH and V % BV == 0
    assert not ws or (vside and not exchange)
    assert not full or ws
    assert not persist or full
    assert not both or full
    assert not fused or (persist and both)
    assert H == 1 or ws
    NA = 2 if persist else 1  # Akk's slots
    if fused:  # B7's body, its two roles on the consumers (barriers: the tail's is the second consumer's, 1;
        # the roles' 7), dAkk's split tiles written by the second consumer
        from research.b7_cute_probe import build as b7_build

        b7 = b7_build(K, True, True, True, raw, has_bias, lower_bound, H, wg2=True, body_only=True, stm=True,
                      dakk_global=False, bars=(1, 7))
    NV = V // BV
    assert not vside or NV % 2 == 0  # (each CTA of the pair has V tiles, the first at v = rank)
    tile = (BT, KH, BV)  # (M, N, K) of each wgmma product: rows, channels, the V tile
    stage_bytes = ((4 if vside else 3) * BT * BV + 2 * KH * BV) * 2

    class _Mma:
        """A tiled MMA as two, their accumulate field set once at the kernel's top: ``acc``
        adds to the accumulator, ``fresh`` overwrites it (the wgmma's scale-d off). (Setting
        the field inside a dynamic branch defines the MMA's value there, and no use after the
        branch may take it.) Partitions and fragments come from ``acc``."""

        def __init__(self, acc, fresh):
            acc.set(warpgroup.Field.ACCUMULATE, True)
            fresh.set(warpgroup.Field.ACCUMULATE, False)
            self.acc, self.fresh = acc, fresh

        def __getattr__(self, name):
            return getattr(self.acc, name)

    def _mac(tmma, acc, a, b, fresh):
        """acc += a b, one wgmma; or, ``fresh``, acc = a b. Never zero an accumulator by
        storing to it: the compiler may sink those stores between the wgmma fence and the
        wgmma, and ptxas then serialises every wgmma of the function (C7514/C7515) or waits
        on the group before (C7517)."""
        cute.gemm(tmma.fresh if fresh else tmma.acc, acc, a, b, acc)

    def _sums(tmma, terms):
        """Products over one tile's K blocks, interleaved by block: for each (acc, a, b, first)
        term, acc += a b (acc = a b where ``first``), a and b the stage's fragments."""
        for kb in range(cute.size(terms[0][1], mode=[2])):
            for acc, a, b, first in terms:
                _mac(tmma, acc, a[(None, None, kb)], b[(None, None, kb)], first and kb == 0)

    def _smem_type(a_smem, b_smem):
        """Both kernels' shared memory (a field a build does not use takes 8 elements)."""

        @cute.struct
        class Smem:
            bars: cute.struct.MemRange[cutlass.Int64, stages * 2]
            vn: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem)], 1024]
            do: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem)], 1024]
            dv: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem)], 1024]
            h: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem)], 1024]
            dh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem)], 1024]
            v: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem) if vside else 8], 1024]
            At: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * BT * NA], 1024]  # the chunk's Akk
            # kg's load, the peer's dA part, Akk's slots full and empty, the sent dA part read
            xbars: cute.struct.MemRange[cutlass.Int64, 7]
            part: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 8 if ws else BT * BT], 128]  # sent / received; row sums
            # (full) kg and dw in bf16, dA's two staged products, dkgb, the first consumer's sums
            # and the peer's dA partial (fp32)
            kg: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if full and not fused else 8],
                                  1024 if full and not fused else 16]
            dwb: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if full and not fused else 8],
                                  1024 if full and not fused else 16]
            dAb: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * BT if full and not fused else 8],
                                  1024 if full and not fused else 16]
            dkgb: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BT * KH if full and not fused else 8], 128]
            part_k: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 5 * KH if full else 8], 128]
            xch: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, (1 if fused else 2 if both else 1) * BT * BT
                                                         if full else 8], 128]
            # (``fused``) B7's tiles, the epilogue's buffers over them (B7_TILES)
            qh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            kh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            kl: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            xh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            xl: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            uh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            ul: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            yqh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            yql: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            ykh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]
            ykl: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BT * KH if fused else 8], 1024]

        return Smem

    def _stage_views(storage, a_smem, b_smem, bmn_smem, a1, at1):
        """The ring's tiles and Akk's as the products read them: v_new, do, dv, h, dh; with
        ``vside`` also v as an A and as a B operand, dv as the MN-major B operand of A^T dv,
        Akk as read ([r, s]) and as A^T (MN-major A); else None for those. A [64, 64] tile lies
        as rows of 64 contiguous values under one swizzle, so the same bytes serve either role
        (offset r * 64 + j read as (M = r, K = j) or as (N = j, K = r))."""
        ring = tuple(getattr(storage, n).get_tensor(lay.outer, swizzle=lay.inner)
                     for n, lay in (("vn", a_smem), ("do", a_smem), ("dv", a_smem), ("h", b_smem), ("dh", b_smem)))
        if not vside:
            return ring + (None,) * 5
        return ring + (storage.v.get_tensor(a_smem.outer, swizzle=a_smem.inner),
                       storage.v.get_tensor(b_smem.outer, swizzle=b_smem.inner),
                       storage.dv.get_tensor(bmn_smem.outer, swizzle=bmn_smem.inner),
                       storage.At.get_tensor(a1.outer, swizzle=a1.inner),
                       storage.At.get_tensor(at1.outer, swizzle=at1.inner))

    def _ring(storage, consumer_warps):
        """The ring of stages: filled by one thread's copies (``stage_bytes`` a stage, half of
        the multicast ones from the peer), released by each consumer warp of both CTAs (each
        CTA's copies fill both)."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * consumer_warps),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 2, 1)))

    def _pair(rank):
        """(this CTA's coordinate in the (1, 2, 1) cluster, the multicast mask to both CTAs)."""
        cluster = cute.make_layout((1, 2, 1))  # (M, N, K): the two K halves side by side
        coord = cluster.get_flat_coord(rank)
        return coord, cute.make_layout_image_mask(cluster, coord, mode=1)

    def _copy_parts(multicast, own, coord, chunk, rank):
        """Each copy's (atom, shared part, global part): the ``multicast`` (atom, stage tensor,
        TMA tensor) triples loaded half by each CTA of the pair for both (the chunk's rows, its
        tiles across every head: a head's V tile v is tile head * NV + v), ``own`` this CTA's K
        half's of the chunk-head's state block."""

        def rows_tiles(t, row_tile, height):  # this chunk-head's tiles: (rows, V tile, tile index)
            return cute.local_tile(t, (height, BV), (row_tile, None))

        a_parts = [(atom, *cpasync.tma_partition(atom, coord[1], cute.make_layout(2), cute.group_modes(s, 0, 2),
                                                 cute.group_modes(rows_tiles(t, chunk // H, BT), 0, 2)))
                   for atom, s, t in multicast]
        b_parts = [(atom, *cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                                 cute.group_modes(rows_tiles(t, chunk * 2 + rank, KH), 0, 2)))
                   for atom, s, t in own]
        return a_parts, b_parts

    @cute.jit
    def _fill(ring, state, a_parts, b_parts, mask, v, head=0):
        """Warp 0: V tile v's copies into the next stage (v_new, do and dv multicast to both
        CTAs, at ``head``'s columns; this CTA's h and dh), on the stage's barrier, each through
        its own tensor's TMA atom (an atom holds its tensor's descriptor: the partitions give
        coordinates only)."""
        ring.producer_acquire(state)
        bar = ring.producer_get_barrier(state)
        for atom, s_part, g_part in a_parts:
            cute.copy(atom, g_part[(None, head * NV + v)], s_part[(None, state.index)], tma_bar_ptr=bar,
                      mcast_mask=mask)
        for atom, s_part, g_part in b_parts:
            cute.copy(atom, g_part[(None, v)], s_part[(None, state.index)], tma_bar_ptr=bar)
        ring.producer_commit(state)

    @cute.kernel
    def kernel(tma_vn, vn_t, tma_do, do_t, tma_dv, dv_t, tma_h, h_t, tma_dh, dh_t, tma_kg, kg_t, dq, dkh, dw, dA,
               tma_v, v_t, tma_A, A_t, beta, dv2, dAv, dbv, mma: cute.TiledMma, mma_t: cute.TiledMma,
               mma_z: cute.TiledMma, mma_tz: cute.TiledMma,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, bmn_smem: cute.ComposedLayout,
               a1: cute.ComposedLayout, at1: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        mma, mma_t = _Mma(mma, mma_z), _Mma(mma_t, mma_tz)
        _, _, chunk = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        coord, mask = _pair(rank)

        if warp == 0:
            for atom in (tma_vn, tma_do, tma_dv, tma_h, tma_dh):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(vside):
                cpasync.prefetch_descriptor(tma_v)
                cpasync.prefetch_descriptor(tma_A)

        storage = SmemAllocator().allocate(_smem_type(a_smem, b_smem))
        ring = _ring(storage, 4)  # the warpgroup's 4 warps consume
        xbar = storage.xbars.data_ptr()
        if cutlass.const_expr(exchange):
            if tidx == 0:
                cute.arch.mbarrier_init(xbar, 1)
                cute.arch.mbarrier_init(xbar + 1, 1)
                cute.arch.mbarrier_init_fence()
                if rank == 0:  # (the peer's bytes may land before this CTA waits: counted from here)
                    cute.arch.mbarrier_arrive_and_expect_tx(xbar + 1, BT * BT * 4)
        if cutlass.const_expr(vside):
            if tidx == 0:
                cute.arch.mbarrier_init(xbar + 2, 1)
                cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        s_vn, s_do, s_dv, s_h, s_dh, s_v, s_vb, s_dvb, s_A, s_At = _stage_views(storage, a_smem, b_smem, bmn_smem, a1,
                                                                                at1)
        a_parts, b_parts = _copy_parts([(tma_vn, s_vn, vn_t), (tma_do, s_do, do_t), (tma_dv, s_dv, dv_t)]
                                       + ([(tma_v, s_v, v_t)] if vside else []),
                                       ((tma_h, s_h, h_t), (tma_dh, s_dh, dh_t)), coord, chunk, rank)

        thr = mma.get_slice(0)  # (the operands' partition: one for the warpgroup)
        thr_c = mma.get_slice(tidx)  # (the accumulators': each thread's own rows and columns)
        r_vn, r_do, r_dv = (mma.make_fragment_A(thr.partition_A(s)) for s in (s_vn, s_do, s_dv))
        r_h, r_dh = (mma.make_fragment_B(thr.partition_B(s)) for s in (s_h, s_dh))
        outs = [cute.local_tile(o, (BT, KH), (chunk, rank)) for o in (dq, dkh, dw)]
        acc_shape = thr_c.partition_C(outs[0]).shape
        acc_q = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        acc_k = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        acc_w = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        if cutlass.const_expr(vside):
            thr_t = mma_t.get_slice(0)
            thr_tc = mma_t.get_slice(tidx)
            r_At = mma_t.make_fragment_A(thr_t.partition_A(s_At))
            r_dvb = mma_t.make_fragment_B(thr_t.partition_B(s_dvb))
            r_vb = mma.make_fragment_B(thr.partition_B(s_vb))
            acc_a = cute.make_rmem_tensor(acc_shape, cutlass.Float32)  # dA's V part, this CTA's tiles
            acc_b = cute.make_rmem_tensor(thr_tc.partition_C(outs[0]).shape, cutlass.Float32)  # a tile's dvb
            prod = cute.make_rmem_tensor(thr_tc.partition_C(outs[0]).shape, cutlass.Float32)  # sum of dvb * v
            prod.fill(0.0)
            # beta by row, broadcast along the tile's columns, in the accumulator's partition
            beta_rows = thr_tc.partition_C(cute.local_tile(beta, (BT, BV), (chunk, 0)))
            if warp == 0:
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(xbar + 2, BT * BT * 2)
                a_s, a_g = cpasync.tma_partition(tma_A, 0, cute.make_layout(1), cute.group_modes(s_A, 0, 2),
                                                 cute.group_modes(cute.local_tile(A_t, (BT, BT), (chunk, None)), 0, 2))
                cute.copy(tma_A, a_g[(None, 0)], a_s[(None, 0)], tma_bar_ptr=xbar + 2)
        cute.arch.cluster_wait()

        put = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        get = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

        if warp == 0:
            for _ in cutlass.range(min(stages, NV), unroll=1):
                _fill(ring, put, a_parts, b_parts, mask, put.count)
                put.advance()
        if cutlass.const_expr(vside):
            cute.arch.mbarrier_wait(xbar + 2, 0)
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        for v in cutlass.range_constexpr(NV):  # (unrolled: NV is 4 at V=256)
            ring.consumer_wait(get)
            at = (None, None, None, get.index)
            terms = [(acc_q, r_do[at], r_h[at], v == 0), (acc_k, r_vn[at], r_dh[at], v == 0),
                     (acc_w, r_dv[at], r_h[at], v == 0)]
            if cutlass.const_expr(vside):
                if rank == v % 2:  # (each branch whole, its fence in it: a branch between wgmmas makes
                    # each its own group, and ptxas adds a fence where the branch lacks one)
                    # dvb = A^T dv first, its own group, so its epilogue runs under the rest; and dA's
                    # V part, whose first tile on this CTA is v = rank
                    warpgroup.fence()
                    _sums(mma_t, [(acc_b, r_At[(None, None, None, 0)], r_dvb[at], True)])
                    warpgroup.commit_group()
                    warpgroup.fence()
                    _sums(mma, terms + [(acc_a, r_dv[at], r_vb[at], v < 2)])
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)  # dvb done, this tile's sums still running
                    tile_out = thr_tc.partition_C(cute.local_tile(dv2, (BT, BV), (chunk, v)))
                    tile_out.store((acc_b.load() * beta_rows.load()).to(cutlass.BFloat16))
                    v_here = thr_tc.partition_C(s_v[(None, None, get.index)]).load().to(cutlass.Float32)
                    prod.store(prod.load() + acc_b.load() * v_here)
                else:
                    warpgroup.fence()
                    _sums(mma, terms)
                    warpgroup.commit_group()
            else:
                warpgroup.fence()
                _sums(mma, terms)
                warpgroup.commit_group()
            get.advance()
            # a stage is refilled only after this CTA released it: warp 0 is a consumer too, and
            # waiting there for a release it has yet to make would stall the warpgroup's wgmmas
            if cutlass.const_expr(overlap):  # the previous tile's products done and its stage
                warpgroup.wait_group(1)      # released, this tile's still running
                if cutlass.const_expr(v > 0):
                    ring.consumer_release(done)
                    done.advance()
                    if warp == 0 and put.count < NV:
                        _fill(ring, put, a_parts, b_parts, mask, put.count)
                        put.advance()
            else:
                warpgroup.wait_group(0)
                ring.consumer_release(done)
                done.advance()
                if warp == 0 and put.count < NV:
                    _fill(ring, put, a_parts, b_parts, mask, put.count)
                    put.advance()
        warpgroup.wait_group(0)

        for acc, out in zip((acc_q, acc_k, acc_w), outs):
            thr_c.partition_C(out).store(acc.load())
        if cutlass.const_expr(vside):
            # this CTA's partials: dA's V part, and db's V part as row sums of prod (through
            # shared memory: a row's columns lie across a quad of threads and the tile)
            thr_c.partition_C(cute.local_tile(dAv, (BT, BT), (chunk * 2 + rank, 0))).store(acc_a.load())
            part = cute.make_tensor(storage.part.data_ptr(), cute.make_layout((BT, BV), stride=(BV, 1)))
            thr_tc.partition_C(part).store(prod.load())
            cute.arch.sync_threads()
            if tidx < BT:
                total = cutlass.Float32(0.0)
                for j in cutlass.range(BV, unroll=8):
                    total += part[tidx, j]
                dbv[(chunk * 2 + rank) * BT + tidx] = total
            cute.arch.sync_threads()

        if cutlass.const_expr(exchange):
            # dw (bf16) into stage 0's dv slot, kg's K-half tile into stage 0's h slot (every
            # copy into them, the peer's multicast ones included, has landed and been read)
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(xbar, KH * BT * 2)
                kg_s, kg_g = cpasync.tma_partition(tma_kg, 0, cute.make_layout(1), cute.group_modes(s_h, 0, 2),
                                                   cute.group_modes(cute.local_tile(kg_t, (BT, KH), (chunk, None)),
                                                                    0, 2))
                cute.copy(tma_kg, kg_g[(None, rank)], kg_s[(None, 0)], tma_bar_ptr=xbar)
            thr_c.partition_C(s_dv[(None, None, 0)]).store(acc_w.load().to(cutlass.BFloat16))
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            cute.arch.mbarrier_wait(xbar, 0)
            acc_p = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            warpgroup.fence()
            _sums(mma, [(acc_p, r_dv[(None, None, None, 0)], r_h[(None, None, None, 0)], True)])
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            part = cute.make_tensor(storage.part.data_ptr(), cute.make_layout((BT, BT), stride=(BT, 1)))
            if rank == 1:  # this half's product to CTA 0, into the same offset of its shared memory
                thr_c.partition_C(part).store(acc_p.load())
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                if tidx == 0:
                    send = cute.make_copy_atom(cpasync.CopyBulkS2SOp(), cutlass.Float32,
                                               num_bits_per_copy=BT * BT * 32)
                    flat = cute.make_tensor(storage.part.data_ptr(), cute.make_layout(BT * BT))
                    cute.copy(send, flat, flat, mbar_ptr=xbar + 1, cta_rank=cutlass.Int32(0))
            else:
                cute.arch.mbarrier_wait(xbar + 1, 0)
                got = thr_c.partition_C(part).load()
                thr_c.partition_C(cute.local_tile(dA, (BT, BT), (chunk, 0))).store(acc_p.load() + got)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def _produce(ring, tma_A, A_t, s_A, abar, multicast, own, coord, mask, rank, first, step, nch, tidx):
        """The warp-specialized build's producer warp: per chunk-head of this cluster's (first,
        first + step, ...), its Akk into the next of the NA slots (once the epilogue NA
        chunk-heads back has released it), then its V tiles' stages, the ring's state running
        on across chunk-heads."""
        put = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        for it in cutlass.range((nch - first + step - 1) // step, unroll=1):
            chunk = first + it * step
            slot = it % NA
            if it >= NA:  # (persist) the slot's last Akk read: released by that chunk-head's epilogue
                cute.arch.mbarrier_wait(abar + 2 + slot, (it // NA - 1) % 2)
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(abar + slot, BT * BT * 2)
            a_s, a_g = cpasync.tma_partition(tma_A, 0, cute.make_layout(1), cute.group_modes(s_A, 0, 2),
                                             cute.group_modes(cute.local_tile(A_t, (BT, BT), (chunk // H, None)),
                                                              0, 2))
            cute.copy(tma_A, a_g[(None, chunk % H)], a_s[(None, slot)], tma_bar_ptr=abar + slot)
            a_parts, b_parts = _copy_parts(multicast, own, coord, chunk, rank)
            for v in cutlass.range(NV, unroll=1):
                _fill(ring, put, a_parts, b_parts, mask, v, chunk % H)
                put.advance()

    @cute.jit
    def _epi_k(thr_c, acc_q, acc_k, acc_s, o_q, o_k, chunk, rank, wtid, it, more, q, k, gc, beta2K, dg, dbk, s_kg,
               part_k, dkgb_s):
        """``full``, the first consumer after the V loop (K half j, chunk rows r): dq = (do h^T)
        exp2(g) scale; dk_h = (v_new dh^T) exp2(g_last - g); kg = k exp2(g) (bf16, to shared
        memory for dw kg^T); then, with dkgb = A^T dw from the other consumer, dk = dk_h +
        dkgb exp2(g) beta, dg = q dq - k dk_h + kg dkgb beta and, on the last row, + the sum
        over V of h dh (exp2(g_last)) + the column sums of k dk_h; and db's K part, the row
        sums of dkgb kg. (``persist``: kg is written once the other consumer has handed the
        last one back, and dkgb handed back once read; ``it`` counts this CTA's chunk-heads,
        ``more`` says another follows.)"""
        # (ordered so that few [64, 64] fragments are live at once: each is 32 registers a thread)
        rt, kt = chunk // H, chunk % H * 2 + rank  # the chunk's row tile, this K half's column tile
        tile = lambda t: thr_c.partition_C(cute.local_tile(t, (BT, KH), (rt, kt)))  # noqa: E731
        o_g = cute.local_tile(gc, (BT, KH), (rt, kt))
        eg = cute.math.exp2(thr_c.partition_C(o_g).load())
        dq_v = acc_q.load() * eg * scale
        thr_c.partition_C(o_q).store(dq_v)
        pre = tile(q).load().to(cutlass.Float32) * dq_v  # dg's q dq term
        kf = tile(k).load().to(cutlass.Float32)
        kg = kf * eg  # (eg read again at the end, from g: its registers free meanwhile)
        if cutlass.const_expr(persist):
            if it > 0:  # the other consumer's dw kg^T of the last chunk-head done
                cute.arch.barrier(barrier_id=5, number_of_threads=256)
        thr_c.partition_C(s_kg).store(kg.to(cutlass.BFloat16))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=2, number_of_threads=256)  # kg ready for dw kg^T
        g_last = thr_c.partition_C(cute.make_tensor(o_g.iterator + (BT - 1) * H * K,
                                                    cute.make_layout((BT, KH), stride=(0, 1))))
        dk_h = lambda: acc_k.load() * cute.math.exp2(g_last.load() - thr_c.partition_C(o_g).load())  # noqa: E731
        kdk = kf * dk_h()  # (dk_h formed again at the end from acc_k: its registers free meanwhile)
        lane, w = wtid % 32, wtid // 32
        # dg's last row: + the diagonal of h dh^T times exp2(g_last) and the column sums of k dk_h
        # (each warp's through its lanes, then the four warps' through shared memory)
        s_col = cute.make_tensor(part_k.iterator, cute.make_layout((4, KH), stride=(KH, 1)))
        s_diag = cute.make_tensor(part_k.iterator + 4 * KH, cute.make_layout(KH))
        pre_r = regs(pre - kdk)
        cols = warp_col_sums(kdk)
        if lane < 4:
            for i in cutlass.range_constexpr(cute.size(cols)):
                if cutlass.const_expr(i // 2 % 2 == 0):
                    s_col[w, i // 4 * 8 + lane * 2 + i % 2] = cols[i]
        coords = thr_c.partition_C(cute.make_identity_tensor((BT, KH)))
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            r, c = coords[i]
            if r == c:
                s_diag[c] = acc_s[i] * cute.math.exp2(o_g[BT - 1, c])
        cute.arch.barrier(barrier_id=4, number_of_threads=128)
        if wtid >= 124:  # (the threads holding row 63: warp 3's last quad, b = 1)
            for i in cutlass.range_constexpr(cute.size(pre_r)):
                if cutlass.const_expr(i // 2 % 2 == 1):
                    c = i // 4 * 8 + lane % 4 * 2 + i % 2
                    pre_r[i] = pre_r[i] + (s_diag[c] + (s_col[0, c] + s_col[1, c] + s_col[2, c] + s_col[3, c]))
        cute.arch.barrier(barrier_id=4, number_of_threads=128)  # (read before the next chunk-head's writes)
        cute.arch.barrier(barrier_id=3, number_of_threads=256)  # dkgb written by the other consumer
        dkgb = thr_c.partition_C(dkgb_s).load()
        if cutlass.const_expr(persist):
            if more:  # dkgb read: the other consumer may write the next
                cute.arch.barrier_arrive(barrier_id=6, number_of_threads=256)
        beta_k = cute.make_tensor(beta2K.iterator + rt * BT * H + chunk % H, cute.make_layout((BT, KH), stride=(H, 0)))
        dkgb_b = dkgb * thr_c.partition_C(beta_k).load()
        thr_c.partition_C(o_k).store(dk_h() + dkgb_b * cute.math.exp2(thr_c.partition_C(o_g).load()))
        thr_c.partition_C(cute.local_tile(dg, (BT, KH), (rt, kt))).store(pre_r.load() + kg * dkgb_b)
        s0, s1 = quad_row_sums(dkgb * kg)  # db's K part, by row
        if lane % 4 == 0:
            dbk[(chunk * 2 + rank) * BT + w * 16 + lane // 4] = s0
            dbk[(chunk * 2 + rank) * BT + w * 16 + lane // 4 + 8] = s1

    @cute.jit
    def _tile_product(tmma, s_a, s_b, acc, ia=0, ib=0, fresh=True):
        """acc = (or, not ``fresh``, +=) the product of two [64, 64] operand tiles in shared
        memory (stage ``ia`` of s_a, ``ib`` of s_b), as ``tmma`` reads them, issued and
        committed as one group (the caller waits on it)."""
        thr = tmma.get_slice(0)
        r_a = tmma.make_fragment_A(thr.partition_A(s_a))
        r_b = tmma.make_fragment_B(thr.partition_B(s_b))
        warpgroup.fence()
        _sums(tmma, [(acc, r_a[(None, None, None, ia)], r_b[(None, None, None, ib)], fresh)])
        warpgroup.commit_group()

    @cute.jit
    def _epi_a(mma, mma_t, thr_c, acc_w, acc_a, s_At, chunk, rank, wtid, it, more, slot, s_dw, s_dwB, s_kgB,
               dkgb_s, xch, xbar, beta1, s_dAb, s_dAbB, s_AB, dA_out, peer_f, kh_f, kl_f):
        """``full``, the second consumer after the V loop: dw = r(-(dv h^T)) into shared memory;
        dkgb = A^T dw (to the other consumer); dA's partial dv v^T (this CTA's tiles) + dw kg^T
        (this K half), CTA 1's sent into CTA 0's shared memory; on CTA 0 the sum, masked below
        the diagonal, times beta by column, rounded; r(. A^T); A^T .; negated below the
        diagonal into dA. Akk is read from its ``slot``. (``persist``: the barriers after xbar,
        the peer's dA part, are Akk's two slots full, their two empties, and on CTA 1 the sent
        part read; dkgb is written once the other consumer has handed the last one back, and
        kg handed back once read.)"""
        thr_tc = mma_t.get_slice(wtid)
        thr_c.partition_C(s_dw[(None, None, 0)]).store((acc_w.load() * -1.0).to(cutlass.BFloat16))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=1, number_of_threads=128)
        acc_g = cute.make_rmem_tensor(acc_w.shape, cutlass.Float32)
        _tile_product(mma_t, s_At, s_dwB, acc_g, slot)  # dkgb = A^T dw
        cute.arch.barrier(barrier_id=2, number_of_threads=256)  # kg written by the other consumer
        _tile_product(mma, s_dw, s_kgB, acc_a, fresh=False)  # + dw kg^T
        warpgroup.wait_group(1)
        if cutlass.const_expr(persist):
            if it > 0:  # the other consumer done with the last dkgb
                cute.arch.barrier(barrier_id=6, number_of_threads=256)
        thr_tc.partition_C(dkgb_s).store(acc_g.load())
        cute.arch.barrier_arrive(barrier_id=3, number_of_threads=256)  # dkgb ready
        warpgroup.wait_group(0)
        if cutlass.const_expr(persist and not fused):  # (``fused``: once B7 is done with kg's space)
            if more:  # kg read: the other consumer may write the next
                cute.arch.barrier_arrive(barrier_id=5, number_of_threads=256)
        # (``both``: CTA r's partial in slot r of both CTAs, sent by each to the other)
        # (``fused``: this CTA's own slot here, the peer's partial lands over B7's tiles)
        own = cute.make_tensor(xch.iterator + (rank * BT * BT if both and not fused else 0), xch.layout)
        peer = peer_f if fused else cute.make_tensor(xch.iterator + ((1 - rank) * BT * BT if both else 0), xch.layout)
        if rank >= (0 if both else 1):  # this CTA's partial to the other (CTA 1's to CTA 0, or both ways)
            if cutlass.const_expr(persist):
                if it > 0:  # the other has read the last one
                    cute.arch.mbarrier_wait(xbar + 5, (it - 1) % 2)
            thr_c.partition_C(own).store(acc_a.load())
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            if wtid == 0:
                send = cute.make_copy_atom(cpasync.CopyBulkS2SOp(), cutlass.Float32, num_bits_per_copy=BT * BT * 32)
                flat = cute.make_tensor(own.iterator, cute.make_layout(BT * BT))
                to = cute.make_tensor(peer.iterator, cute.make_layout(BT * BT)) if fused else flat  # (the peer's slot)
                cute.copy(send, flat, to, mbar_ptr=xbar, cta_rank=cutlass.Int32(1 - rank))
        if rank <= (1 if both else 0):  # the other's partial (on CTA 0, or on both)
            cute.arch.mbarrier_wait(xbar, it % 2)
            coords = thr_c.partition_C(cute.make_identity_tensor((BT, BT)))
            d = regs(acc_a.load() + thr_c.partition_C(peer).load())  # (x0 + x1 either way round: the same bits)
            cute.arch.barrier(barrier_id=1, number_of_threads=128)  # (every thread's share of the peer's read)
            if cutlass.const_expr(persist and not fused):  # (``fused``: after B7, whose tiles the slot lies under)
                if more:
                    if wtid == 0:  # armed for the next partial, then the other told this one was read
                        cute.arch.mbarrier_arrive_and_expect_tx(xbar, BT * BT * 4)
                        cute.arch.mbarrier_arrive(xbar + 5, peer_cta_rank_in_cluster=1 - rank, scope=CLUSTER)
            d1 = s_dAb[(None, None, 0)]
            beta_c = thr_c.partition_C(cute.make_tensor(beta1.iterator + chunk // H * BT * H + chunk % H,
                                                        cute.make_layout((BT, BT), stride=(0, H)))).load()
            for i in cutlass.range_constexpr(cute.size(d)):  # below the diagonal, times beta of the column
                r, c = coords[i]
                d[i] = cutlass.Float32(cutlass.select_(r > c, d[i], cutlass.Float32(0.0)))
            thr_c.partition_C(d1).store((d.load() * beta_c).to(cutlass.BFloat16))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            acc_2 = cute.make_rmem_tensor(acc_w.shape, cutlass.Float32)
            _tile_product(mma, s_dAb, s_AB, acc_2, 0, slot)  # . A^T
            warpgroup.wait_group(0)
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            thr_c.partition_C(d1).store(acc_2.load().to(cutlass.BFloat16))  # r(dA1 A^T), as [r, t]
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            acc_3 = cute.make_rmem_tensor(acc_w.shape, cutlass.Float32)
            _tile_product(mma_t, s_At, s_dAbB, acc_3, slot)  # A^T .
            warpgroup.wait_group(0)
            coords_t = thr_tc.partition_C(cute.make_identity_tensor((BT, BT)))
            for i in cutlass.range_constexpr(cute.size(acc_3)):  # negated below the diagonal
                r, c = coords_t[i]
                acc_3[i] = cutlass.Float32(cutlass.select_(r > c, -acc_3[i], cutlass.Float32(0.0)))
            if (wtid // 64 - rank) * (1 if both and not fused else 0) == 0:  # (``both``: each CTA its two warps'
                # row blocks; ``fused``: both the whole tile, the same bits, for the tail's slow path)
                thr_tc.partition_C(cute.local_tile(dA_out, (BT, BT), (chunk // H, chunk % H))).store(acc_3.load())
            if cutlass.const_expr(fused):  # dAkk's split tiles for B7, once both consumers are done with the buffers
                cute.arch.barrier(barrier_id=8, number_of_threads=256)
                d_hi = acc_3.load().to(cutlass.BFloat16)
                thr_tc.partition_C(kh_f).store(d_hi)
                thr_tc.partition_C(kl_f).store((acc_3.load() - d_hi.to(cutlass.Float32)).to(cutlass.BFloat16))
        if cutlass.const_expr(persist):  # every Akk product of this warpgroup waited: the slot is free
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            if wtid == 0:
                cute.arch.mbarrier_arrive(xbar + 3 + slot)

    @cute.jit
    def _sums_k(ring, mma, s_vn, s_do, s_h, s_dh, dq, dkh, first, step, nch, rank, wtid, s_hA, ek, b7c):
        """The warp-specialized build's first consumer, per chunk-head of this cluster's: dq
        and dk_h of this CTA's K half (with ``full``, also h dh^T, whose diagonal is dg's
        last-row term, and then ``_epi_k``)."""
        thr = mma.get_slice(0)
        thr_c = mma.get_slice(wtid)
        r_vn = mma.make_fragment_A(thr.partition_A(s_vn))
        r_do = mma.make_fragment_A(thr.partition_A(s_do))
        r_h = mma.make_fragment_B(thr.partition_B(s_h))
        r_dh = mma.make_fragment_B(thr.partition_B(s_dh))
        r_hA = mma.make_fragment_A(thr.partition_A(s_hA))
        shape = thr_c.partition_C(cute.local_tile(dq, (BT, KH), (0, 0))).shape
        acc_q = cute.make_rmem_tensor(shape, cutlass.Float32)
        acc_k = cute.make_rmem_tensor(shape, cutlass.Float32)
        acc_s = cute.make_rmem_tensor(shape, cutlass.Float32)
        get = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        mine_n = (nch - first + step - 1) // step
        for it in cutlass.range(mine_n, unroll=1):
            chunk = first + it * step
            o_q = cute.local_tile(dq, (BT, KH), (chunk // H, chunk % H * 2 + rank))
            o_k = cute.local_tile(dkh, (BT, KH), (chunk // H, chunk % H * 2 + rank))
            for v in cutlass.range_constexpr(NV):
                ring.consumer_wait(get)
                at = (None, None, None, get.index)
                warpgroup.fence()
                _sums(mma, [(acc_q, r_do[at], r_h[at], v == 0), (acc_k, r_vn[at], r_dh[at], v == 0)]
                      + ([(acc_s, r_hA[at], r_dh[at], v == 0)] if full else []))
                warpgroup.commit_group()
                get.advance()
                warpgroup.wait_group(1)  # the previous tile's products done: its stage released
                if cutlass.const_expr(v > 0):
                    ring.consumer_release(done)
                    done.advance()
            warpgroup.wait_group(0)
            ring.consumer_release(done)  # the last tile's stage
            done.advance()
            if cutlass.const_expr(full):
                _epi_k(thr_c, acc_q, acc_k, acc_s, o_q, o_k, chunk, rank, wtid, it, it < mine_n - 1, *ek)
                if cutlass.const_expr(fused):  # B7's column role, once both consumers are done with the buffers
                    cute.arch.barrier(barrier_id=8, number_of_threads=256)
                    # (B6's accumulators, dead here, as B7's: two accumulators and x_c; this role
                    # never touches the row role's sums, given acc_s's registers as well)
                    b7(1, wtid, cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4, cute.arch.lane_idx(), chunk,
                       rank, *b7c, (acc_q, acc_k, acc_s, acc_s, acc_s))
            else:
                thr_c.partition_C(o_q).store(acc_q.load())
                thr_c.partition_C(o_k).store(acc_k.load())

    @cute.jit
    def _sums_a(ring, mma, mma_t, s_dv, s_h, s_vb, s_v, s_At, s_dvb, dw, dv2, dAv, dbv, beta, abar,
                first, step, nch, rank, wtid, ea, b7c):
        """The warp-specialized build's second consumer, per chunk-head of this cluster's: dw of
        this CTA's K half, and the V-side sums of its V tiles (dA's and db's partials, dv2);
        with ``full``, then ``_epi_a``. Akk from slot it % NA, once its load has landed."""
        thr = mma.get_slice(0)
        thr_c = mma.get_slice(wtid)
        thr_t = mma_t.get_slice(0)
        thr_tc = mma_t.get_slice(wtid)
        r_dv = mma.make_fragment_A(thr.partition_A(s_dv))
        r_h = mma.make_fragment_B(thr.partition_B(s_h))
        r_vb = mma.make_fragment_B(thr.partition_B(s_vb))
        r_At = mma_t.make_fragment_A(thr_t.partition_A(s_At))
        r_dvb = mma_t.make_fragment_B(thr_t.partition_B(s_dvb))
        shape = thr_c.partition_C(cute.local_tile(dw, (BT, KH), (0, 0))).shape
        shape_t = thr_tc.partition_C(cute.local_tile(dw, (BT, KH), (0, 0))).shape
        acc_w = cute.make_rmem_tensor(shape, cutlass.Float32)
        acc_a = cute.make_rmem_tensor(shape, cutlass.Float32)
        acc_b = cute.make_rmem_tensor(shape_t, cutlass.Float32)
        prod = cute.make_rmem_tensor(shape_t, cutlass.Float32)
        get = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        mine_n = (nch - first + step - 1) // step
        for it in cutlass.range(mine_n, unroll=1):
            chunk = first + it * step
            slot = it % NA
            prod.fill(0.0)
            beta_rows = thr_tc.partition_C(cute.make_tensor(beta.iterator + chunk // H * BT * H + chunk % H,
                                                            cute.make_layout((BT, BV), stride=(H, 0))))
            cute.arch.mbarrier_wait(abar + slot, (it // NA) % 2)
            for v in cutlass.range_constexpr(NV):
                ring.consumer_wait(get)
                at = (None, None, None, get.index)
                if rank == v % 2:  # this CTA's tile (each branch whole: see the one-warpgroup loop)
                    # dvb = A^T dv, its own group; dw and dA's V part (its first tile here is v = rank)
                    warpgroup.fence()
                    _sums(mma_t, [(acc_b, r_At[(None, None, None, slot)], r_dvb[at], True)])
                    warpgroup.commit_group()
                    warpgroup.fence()
                    _sums(mma, [(acc_w, r_dv[at], r_h[at], v == 0), (acc_a, r_dv[at], r_vb[at], v < 2)])
                    warpgroup.commit_group()
                    # dvb's epilogue once this tile's products are done: read while the tile's other
                    # sums ran, inside the loop over chunk-heads, ptxas serialises every wgmma
                    # (C7514); the other consumer's products keep the tensor cores busy meanwhile
                    warpgroup.wait_group(0)
                    tile_out = thr_tc.partition_C(cute.local_tile(dv2, (BT, BV), (chunk // H, chunk % H * NV + v)))
                    tile_out.store((acc_b.load() * beta_rows.load()).to(cutlass.BFloat16))
                    v_here = thr_tc.partition_C(s_v[(None, None, get.index)]).load().to(cutlass.Float32)
                    prod.store(prod.load() + acc_b.load() * v_here)
                else:  # the other CTA's: dw only
                    warpgroup.fence()
                    _sums(mma, [(acc_w, r_dv[at], r_h[at], v == 0)])
                    warpgroup.commit_group()
                get.advance()
                warpgroup.wait_group(1)
                if cutlass.const_expr(v > 0):
                    ring.consumer_release(done)
                    done.advance()
            warpgroup.wait_group(0)
            ring.consumer_release(done)  # the last tile's stage
            done.advance()
            if cutlass.const_expr(not full):
                thr_c.partition_C(cute.local_tile(dw, (BT, KH), (chunk // H, chunk % H * 2 + rank))).store(
                    acc_w.load())
                thr_c.partition_C(cute.local_tile(dAv, (BT, BT), (chunk * 2 + rank, 0))).store(acc_a.load())
            s0, s1 = quad_row_sums(prod.load())  # db's V part, by row
            if wtid % 4 == 0:
                dbv[(chunk * 2 + rank) * BT + wtid // 32 * 16 + wtid % 32 // 4] = s0
                dbv[(chunk * 2 + rank) * BT + wtid // 32 * 16 + wtid % 32 // 4 + 8] = s1
            if cutlass.const_expr(full):
                _epi_a(mma, mma_t, thr_c, acc_w, acc_a, s_At, chunk, rank, wtid, it, it < mine_n - 1, slot, *ea)
                if cutlass.const_expr(fused):  # B7's row role and the tail; then the buffers handed on
                    # (B6's accumulators, dead here, as B7's: two accumulators, x_q and x_kr, and x_c
                    # over the first accumulator, which it is read into only once the stream is done)
                    b7(2, wtid, cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4, cute.arch.lane_idx(), chunk,
                       rank, *b7c, (acc_w, acc_a, acc_b, prod, acc_w))
                    if it < mine_n - 1:
                        cute.arch.barrier_arrive(barrier_id=5, number_of_threads=256)  # the next kg may be written
                        if wtid == 0:  # armed for the peer's next partial, then the peer told this one was read
                            cute.arch.mbarrier_arrive_and_expect_tx(abar - 1, BT * BT * 4)
                            cute.arch.mbarrier_arrive(abar + 4, peer_cta_rank_in_cluster=1 - rank, scope=CLUSTER)

    @cute.kernel
    def kernel_ws(tma_vn, vn_t, tma_do, do_t, tma_dv, dv_t, tma_h, h_t, tma_dh, dh_t, tma_v, v_t, tma_A, A_t,
                  beta, dq, dkh, dw, dv2, dAv, dbv, q, k, gc, beta2K, beta1, dg, dbk, dA_out,
                  mma: cute.TiledMma, mma_t: cute.TiledMma, mma_z: cute.TiledMma, mma_tz: cute.TiledMma,
                  a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, bmn_smem: cute.ComposedLayout,
                  a1: cute.ComposedLayout, b1: cute.ComposedLayout, bmn1: cute.ComposedLayout,
                  aA: cute.ComposedLayout, atA: cute.ComposedLayout, bA: cute.ComposedLayout, nch: cutlass.Int32,
                  dAqk, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part, m7: cute.TiledMma,
                  m7z: cute.TiledMma, m7t: cute.TiledMma, m7tz: cute.TiledMma, l7a: cute.ComposedLayout,
                  l7at: cute.ComposedLayout, l7b: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        mma, mma_t = _Mma(mma, mma_z), _Mma(mma_t, mma_tz)
        if cutlass.const_expr(fused):  # (B7's MMAs, each twice, the field set here once: see _Mma)
            for m, on in ((m7, True), (m7z, False), (m7t, True), (m7tz, False)):
                m.set(warpgroup.Field.ACCUMULATE, on)
        _, _, first = cute.arch.block_idx()  # the cluster's first chunk-head; then every step-th
        _, _, step = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        wtid = tidx % 128  # the thread within its warpgroup
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        coord, mask = _pair(rank)
        if warp == 0:
            for atom in (tma_vn, tma_do, tma_dv, tma_h, tma_dh, tma_v, tma_A):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(_smem_type(a_smem, b_smem))
        ring = _ring(storage, 8)  # two consumer warpgroups
        # Akk's slots loaded, then (persist) the slots released and on CTA 1 the sent dA part
        # read; the one before them, the peer's dA partial landed
        abar = storage.xbars.data_ptr() + 2
        if tidx == 0:
            for i in cutlass.range_constexpr(-1, 5):
                cute.arch.mbarrier_init(abar + i, 1)
            cute.arch.mbarrier_init_fence()
            if cutlass.const_expr(full):
                if rank <= (1 if both else 0):  # (the peer's bytes may land before this CTA waits: counted from here)
                    cute.arch.mbarrier_arrive_and_expect_tx(abar - 1, BT * BT * 4)
        cute.arch.cluster_arrive_relaxed()

        s_vn, s_do, s_dv, s_h, s_dh, s_v, s_vb, s_dvb, s_A, s_At = _stage_views(storage, a_smem, b_smem, bmn_smem, aA,
                                                                                atA)
        cute.arch.cluster_wait()

        if wg == 0:  # the producer: its first warp issues the copies, the rest only wait at the end
            cute.arch.setmaxregister_decrease(40)
            if warp == 0:
                _produce(ring, tma_A, A_t, s_A, abar,
                         [(tma_vn, s_vn, vn_t), (tma_do, s_do, do_t), (tma_dv, s_dv, dv_t), (tma_v, s_v, v_t)],
                         [(tma_h, s_h, h_t), (tma_dh, s_dh, dh_t)], coord, mask, rank, first, step, nch, tidx)
        # (full) the epilogues' shared tensors: each [64, 64] tile in the layout its products read,
        # and the same bytes in the other operand role where one is needed (their offsets agree)
        s_hA = storage.h.get_tensor(a_smem.outer, swizzle=a_smem.inner)  # h as A (rows k, K = V)
        f32 = cute.make_layout((BT, KH), stride=(KH, 1))
        as_f32 = lambda field: cute.recast_ptr(field.data_ptr(), dtype=cutlass.Float32)  # noqa: E731
        # (``fused``: kg, dwb and dAb over B7's first three tiles, dkgb over kl and xh, the peer's dA
        # partial over xl and uh: B7_TILES)
        kg_f, dwb_f, dAb_f = (storage.qh, storage.ql, storage.kh) if fused else (storage.kg, storage.dwb, storage.dAb)
        dkgb_p = as_f32(storage.kl if fused else storage.dkgb)
        ek = (q, k, gc, beta2K, dg, dbk, kg_f.get_tensor(a1.outer, swizzle=a1.inner)[(None, None, 0)],
              cute.make_tensor(storage.part_k.data_ptr(), f32), cute.make_tensor(dkgb_p, f32))
        b7c, b7_ea = None, (None, None, None)  # (B7's context; and what the dA epilogue hands B7)
        if cutlass.const_expr(fused):
            s7a = [getattr(storage, n).get_tensor(l7a.outer, swizzle=l7a.inner) for n in B7_TILES[:4]]
            s7at = [getattr(storage, n).get_tensor(l7at.outer, swizzle=l7at.inner) for n in B7_TILES[:4]]
            s7b = [getattr(storage, n).get_tensor(l7b.outer, swizzle=l7b.inner) for n in B7_TILES[4:]]
            # (B7's tensors in research.b7_cute_probe.ARGS's order: its sums' outputs unused, dq for
            # them; the rstds unused without B10, beta for them)
            tens = (dAqk, dA_out, q, k, gc, beta1, dq, dq, dq, dq, dkh, dg, g_raw, a_log, dt_bias, dq2, dk2, dg2,
                    db_part, dA_part, dbias_part, beta1, beta1)
            # (the tail's sums over xh, x_c's hand-off over yqh and yql; B10's exchange unused)
            sm = (s7a, s7at, s7b, as_f32(storage.xh), as_f32(storage.xh), storage.xbars.data_ptr(), as_f32(storage.yqh))
            b7c = (tens, sm, (m7, m7z, m7t, m7tz))
            # (the peer's dA partial over xl and uh; dAkk's split tiles)
            b7_ea = (cute.make_tensor(as_f32(storage.xl), f32), s7a[2][None, None, 0], s7a[3][None, None, 0])
        ea = (dwb_f.get_tensor(a1.outer, swizzle=a1.inner), dwb_f.get_tensor(bmn1.outer, swizzle=bmn1.inner),
              kg_f.get_tensor(b1.outer, swizzle=b1.inner), cute.make_tensor(dkgb_p, f32),
              cute.make_tensor(storage.xch.data_ptr(), f32), abar - 1, beta1,
              dAb_f.get_tensor(a1.outer, swizzle=a1.inner), dAb_f.get_tensor(bmn1.outer, swizzle=bmn1.inner),
              storage.At.get_tensor(bA.outer, swizzle=bA.inner), dA_out, *b7_ea)
        if wg == 1:  # dq and dk_h over V
            cute.arch.setmaxregister_increase(232)
            _sums_k(ring, mma, s_vn, s_do, s_h, s_dh, dq, dkh, first, step, nch, rank, wtid, s_hA, ek, b7c)
        if wg == 2:  # dw over V, and the V-side sums of this CTA's tiles
            cute.arch.setmaxregister_increase(232)
            _sums_a(ring, mma, mma_t, s_dv, s_h, s_vb, s_v, s_At, s_dvb, dw, dv2, dAv, dbv, beta, abar, first, step,
                    nch, rank, wtid, ea, b7c)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def probe(h: cute.Tensor, dh: cute.Tensor, vn: cute.Tensor, do: cute.Tensor, dv: cute.Tensor,
              kg: cute.Tensor, dq: cute.Tensor, dkh: cute.Tensor, dw: cute.Tensor, dA: cute.Tensor,
              v: cute.Tensor, A: cute.Tensor, beta: cute.Tensor, dv2: cute.Tensor, dAv: cute.Tensor,
              dbv: cute.Tensor, q: cute.Tensor, k: cute.Tensor, gc: cute.Tensor, dg: cute.Tensor,
              dbk: cute.Tensor, dA_out: cute.Tensor, dAqk: cute.Tensor, g_raw: cute.Tensor, a_log: cute.Tensor,
              dt_bias: cute.Tensor, dq2: cute.Tensor, dk2: cute.Tensor, dg2: cute.Tensor, db_part: cute.Tensor,
              dA_part: cute.Tensor, dbias_part: cute.Tensor, stream: cuda.CUstream):
        k_major = LayoutEnum.ROW_MAJOR
        mn_major = LayoutEnum.COL_MAJOR
        # (``fused``) B7's MMAs and tile layouts, as research.b7_cute_probe makes them
        m7, m7z = (sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, k_major.sm90_mma_major_mode(),
                                               mn_major.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1),
                                               tiler_mn=(BT, KH)) for _ in range(2))
        m7t, m7tz = (sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, mn_major.sm90_mma_major_mode(),
                                                 mn_major.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1),
                                                 tiler_mn=(BT, KH)) for _ in range(2))
        l7a = sm90.make_smem_layout_a(k_major, (BT, KH, BT), cutlass.BFloat16, 1)
        l7at = sm90.make_smem_layout_a(mn_major, (BT, KH, BT), cutlass.BFloat16, 1)
        l7b = sm90.make_smem_layout_b(mn_major, (BT, KH, BT), cutlass.BFloat16, 1)
        a_sm = sm90.make_smem_layout_a(k_major, tile, cutlass.BFloat16, stages)
        SMEM_BYTES["last"] = _smem_type(a_sm, sm90.make_smem_layout_b(k_major, tile, cutlass.BFloat16, stages)).size_in_bytes()
        # (two of each: see _Mma) K-major operands, [64, 64] outputs; and MN-major (A^T products)
        mma, mma_z = (sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, k_major.sm90_mma_major_mode(),
                                                  k_major.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1),
                                                  tiler_mn=(BT, KH)) for _ in range(2))
        mma_t, mma_tz = (sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, mn_major.sm90_mma_major_mode(),
                                                     mn_major.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1),
                                                     tiler_mn=(BT, BV)) for _ in range(2))
        a_smem = sm90.make_smem_layout_a(k_major, tile, cutlass.BFloat16, stages)
        b_smem = sm90.make_smem_layout_b(k_major, tile, cutlass.BFloat16, stages)
        a_one = cute.slice_(a_smem, (None, None, 0))
        b_one = cute.slice_(b_smem, (None, None, 0))
        bmn_smem = sm90.make_smem_layout_b(mn_major, (BT, BV, BT), cutlass.BFloat16, stages)
        a1 = sm90.make_smem_layout_a(k_major, tile, cutlass.BFloat16, 1)  # Akk's [r, s] tile: (M = r, K = s)
        at1 = sm90.make_smem_layout_a(mn_major, (BT, BV, BT), cutlass.BFloat16, 1)  # as A^T: (M = s, K = r)
        beta2 = cute.make_tensor(beta.iterator, cute.make_layout((cute.size(beta), BV), stride=(1, 0)))
        beta2K = cute.make_tensor(beta.iterator, cute.make_layout((cute.size(beta), KH), stride=(1, 0)))
        b1 = sm90.make_smem_layout_b(k_major, tile, cutlass.BFloat16, 1)  # a [64, 64] tile as B: (N, K = its columns)
        bmn1 = sm90.make_smem_layout_b(mn_major, (BT, BV, BT), cutlass.BFloat16, 1)  # as B: (N = its columns, K = rows)
        # Akk's NA slots, in the three roles: as read, as A^T, as B of . A^T
        aA = sm90.make_smem_layout_a(k_major, tile, cutlass.BFloat16, NA)
        atA = sm90.make_smem_layout_a(mn_major, (BT, BV, BT), cutlass.BFloat16, NA)
        bA = sm90.make_smem_layout_b(k_major, tile, cutlass.BFloat16, NA)
        # one atom a tensor: an atom carries its tensor's TMA descriptor (the first run reused
        # v_new's atom for do and dv and h's for dh, so it read v_new and h twice over)
        tma_vn, vn_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), vn, a_one, (BT, BV), 2)
        tma_do, do_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), do, a_one, (BT, BV), 2)
        tma_dv, dv_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), dv, a_one, (BT, BV), 2)
        tma_h, h_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), h, b_one, (KH, BV))
        tma_dh, dh_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), dh, b_one, (KH, BV))
        tma_kg, kg_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), kg, b_one, (BT, KH))
        tma_v, v_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), v, a_one, (BT, BV), 2)
        tma_A, A_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), A, a_one, (BT, BT))
        nch = cute.size(vn, mode=[0]) // BT * H  # (chunk-heads: the chunks' rows at each head)
        if cutlass.const_expr(ws):
            kernel_ws(tma_vn, vn_t, tma_do, do_t, tma_dv, dv_t, tma_h, h_t, tma_dh, dh_t, tma_v, v_t, tma_A, A_t,
                      beta2, dq, dkh, dw, dv2, dAv, dbv, q, k, gc, beta2K, beta, dg, dbk, dA_out, mma, mma_t,
                      mma_z, mma_tz, a_smem, b_smem, bmn_smem, a1, b1, bmn1, aA, atA, bA, nch, dAqk, g_raw, a_log,
                      dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part, m7, m7z, m7t, m7tz, l7a, l7at, l7b).launch(
                grid=(1, 2, min(nch, clusters) if persist else nch), block=(384, 1, 1), cluster=(1, 2, 1),
                min_blocks_per_mp=1, stream=stream)
        else:
            kernel(tma_vn, vn_t, tma_do, do_t, tma_dv, dv_t, tma_h, h_t, tma_dh, dh_t, tma_kg, kg_t, dq, dkh, dw, dA,
                   tma_v, v_t, tma_A, A_t, beta2, dv2, dAv, dbv, mma, mma_t, mma_z, mma_tz, a_smem, b_smem,
                   bmn_smem, a1, at1).launch(
                grid=(1, 2, nch), block=(128, 1, 1), cluster=(1, 2, 1), stream=stream)

    return probe


SMEM_BYTES: dict = {}  # (the last build traced: its kernel's shared memory, bytes)

ARGS = ("h", "dh", "vn", "do", "dv", "kg", "dq", "dkh", "dw", "dA", "v", "A", "beta", "dv2", "dAv", "dbv", "q", "k",
        "gc", "dg", "dbk", "dA_out", "dAqk", "g_raw", "A_log", "dt_bias", "dq2", "dk2", "dg2", "db_part", "dA_part",
        "dbias_part")  # the probe's tensors, in its order (from dAqk on, the ``fused`` build's B7 tensors)


def probe_shapes(nrt: int, H: int = 1, K: int = 128, V: int = 256) -> dict:
    """Each of the probe's tensors' (shape, dtype) for nrt chunks of rows at H heads (nrt * H
    chunk-heads): the op's [B, T, H, C] tensors as [B * T, H * C], h and dh as [chunk-heads *
    K, V], beta [B * T * H]; the pair's partials by chunk-head."""
    import torch

    bf, f32 = torch.bfloat16, torch.float32
    R, nch = nrt * BT, nrt * H
    tok = lambda C, dtype: ((R, H * C), dtype)  # noqa: E731
    return {"h": ((nch * K, V), bf), "dh": ((nch * K, V), bf), "vn": tok(V, bf), "do": tok(V, bf), "dv": tok(V, bf),
            "kg": tok(K, bf), "dq": tok(K, f32), "dkh": tok(K, f32), "dw": tok(K, f32), "dA": tok(BT, f32),
            "v": tok(V, bf), "A": tok(BT, bf), "beta": ((R * H,), f32), "dv2": tok(V, bf),
            "dAv": ((2 * nch * BT, BT), f32), "dbv": ((2 * nch * BT,), f32), "q": tok(K, bf), "k": tok(K, bf),
            "gc": tok(K, f32), "dg": tok(K, f32), "dbk": ((2 * nch * BT,), f32), "dA_out": tok(BT, f32),
            **fused_shapes(nrt, H, K)}


def unused_fused(dev) -> tuple:
    """Placeholders for the ``fused`` build's B7 tensors, for the builds that never read them."""
    import torch

    return tuple(torch.empty(16, device=dev) for _ in ARGS[22:])


def fused_shapes(nrt: int, H: int = 1, K: int = 128, raw=None) -> dict:
    """The ``fused`` build's B7 tensors' (shape, dtype), as research.b7_cute_probe.unit_views makes
    them (dq2 and dk2 in fp32, no B10; the raw gate and dg2 in ``raw``, bf16 by default)."""
    import torch

    raw = raw or torch.bfloat16
    f32 = torch.float32
    R, nch = nrt * BT, nrt * H
    return {"dAqk": ((R, H * BT), f32), "g_raw": ((R, H * K), raw), "A_log": ((H,), f32), "dt_bias": ((H * K,), f32),
            "dq2": ((R, H * K), f32), "dk2": ((R, H * K), f32), "dg2": ((R, H * K), raw),
            "db_part": ((2 * R * H,), f32), "dA_part": ((2 * nch,), f32), "dbias_part": ((nch, K), f32)}


def compile_offline(nch: int = 4, K: int = 128, V: int = 256, stages: int = 3, overlap: bool = True,
                    exchange: bool = False, vside: bool = False, ws: bool = False, full: bool = False,
                    persist: bool = False, dump: str | None = None, H: int = 1, both: bool = False,
                    fused: bool = False):
    """Trace and compile for sm_90a on any machine with CuTe DSL (no GPU): the PTX and cubin
    land in ``dump`` (``CUTE_DSL_KEEP``). ``nch`` chunks of rows at ``H`` heads."""
    if dump:
        os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=dump)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    tensors = [from_dlpack(torch.zeros(shape, dtype=dtype), assumed_align=16)
               for shape, dtype in probe_shapes(nch, H, K, V).values()]
    compiled = cute.compile(build(K, V, stages, overlap, exchange, vside, ws, full, persist, H=H, both=both,
                                  fused=fused), *tensors, cuda.CUstream(0))
    if dump:
        with open(os.path.join(dump, "smem_bytes"), "w") as f:
            f.write(str(SMEM_BYTES["last"]))
    return compiled


_COMPILED: dict = {}


def supports(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
             state_v_first=False):
    """None when ``wy_dqkg_bwd`` (the probe as B6) takes the call, else why not: an sm_90 GPU
    with CuTe DSL, chunks of 64 over dense sequences of whole chunks, K=128, V=256, one q/k
    head a v head, bf16 tensors and fp32 gates, [K, V] states."""
    import torch

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    why = cute_unavailable(k)
    if why:
        return why
    if chunk_size != BT or cu_seqlens is not None or T % BT:
        return f"chunk_size={chunk_size}, cu_seqlens {'given' if cu_seqlens is not None else 'none'}, T={T} " \
               f"(the probe takes dense sequences of whole chunks of {BT})"
    if (K, V) != (2 * KH, 256) or HV != H or state_v_first:
        return f"K={K}, V={V}, H={H}, HV={HV}, state_v_first={state_v_first} (the probe: K=128, V=256, H=HV, [K, V])"
    if any(x.dtype != torch.bfloat16 for x in (q, k, v, v_new, A, h, do, dh, dv)) or gc.dtype != torch.float32:
        return "the probe takes bf16 tensors and an fp32 gate"
    if not all(x.is_contiguous() for x in (q, k, v, v_new, gc, A, h, do, dh, dv)):
        return "the probe views its tensors as dense [B * T, H * C]"
    if h.numel() >= 2 ** 31:
        return "more than 2^31 state elements"
    return None


def op_tensors(q, k, v, v_new, gc, beta, A, h, do, dh, dv) -> tuple:
    """The probe's tensors (``ARGS``) for the op's [B, T, H, C] tensors viewed [B * T, H * C] (h
    and dh [chunk-heads * K, V]), with B6's outputs allocated (dq, dk, dg and dA fp32, dv2 as v,
    db's four partials) and placeholders for what the whole-B6 builds never read; and those
    outputs (dq, dk, dg, dv2, dA, dbv, dbk)."""
    import torch

    q, k, v, v_new, gc, beta, A, h, do, dh, dv = (x.detach() for x in (q, k, v, v_new, gc, beta, A, h, do, dh, dv))
    B, T, H, K = k.shape  # (the views above for dlpack, which refuses a tensor that requires grad)
    V = v.shape[-1]
    R = B * T
    nch, dev, f32 = R // BT * H, k.device, torch.float32
    dq, dk, dg = (torch.empty(B, T, H, K, device=dev, dtype=f32) for _ in range(3))
    dv2 = torch.empty_like(v)
    dA = torch.empty(B, T, H, BT, device=dev, dtype=f32)
    dbv, dbk = (torch.empty(2 * nch * BT, device=dev, dtype=f32) for _ in range(2))
    small = lambda *shape, dtype=f32: torch.empty(*shape, device=dev, dtype=dtype)  # noqa: E731 (never read)
    flat = lambda x: x.view(R, -1)  # noqa: E731
    tensors = dict(h=h.view(nch * K, V), dh=dh.view(nch * K, V), vn=flat(v_new), do=flat(do), dv=flat(dv),
                   kg=small(BT, KH, dtype=torch.bfloat16), dq=flat(dq), dkh=flat(dk), dw=small(BT, KH),
                   dA=small(BT, BT), v=flat(v), A=flat(A), beta=beta.to(f32).contiguous().view(-1), dv2=flat(dv2),
                   dAv=small(2 * BT, BT), dbv=dbv, q=flat(q), k=flat(k), gc=flat(gc), dg=flat(dg), dbk=dbk,
                   dA_out=flat(dA), **dict(zip(ARGS[22:], unused_fused(dev))))
    return tensors, (dq, dk, dg, dv2, dA, dbv, dbk)


def _run_build(form_key: tuple, build_index: int, k, v, scale, args: list, **form) -> None:
    """The probe's ``BUILDS[build_index]`` (``form``: the build's other arguments) at the op's
    shape, a cluster of two SMs a pair of CTAs, compiled once a shape, scale and ``form_key``,
    run on ``args`` (``launch_args``)."""
    import cutlass.cute as cute
    import torch

    B, T, H, K = k.shape
    key = (B * T, H, K, v.shape[-1], float(scale), form_key, k.device.index)
    if key not in _COMPILED:
        stages, overlap, exchange, vside, ws, full, persist = BUILDS[build_index]
        sms = torch.cuda.get_device_properties(k.device).multi_processor_count
        _COMPILED[key] = cute.compile(build(K, v.shape[-1], stages, overlap, exchange, vside, ws, full, persist,
                                            float(scale), sms // 2, H, **form), *args)
    _COMPILED[key](*args)


def pair_db(dbv, dbk, shape):
    """B6's db ([B, T, H]) from the pair's four partials by chunk-head (each CTA's V and K parts)."""
    B, T, H, _ = shape
    return (dbv + dbk).view(B * T // BT, H, 2, BT).sum(2).transpose(1, 2).reshape(B, T, H)


def launch_args(tensors: dict, dev) -> list:
    """The probe's arguments (``ARGS``, then torch's current stream on ``dev``) from ``tensors``."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    return [from_dlpack(tensors[name], assumed_align=16) for name in ARGS] + [
        cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)]


def wy_dqkg_bwd(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                state_v_first=False, build_index: int = 8):
    """B6 with fla's contract (the stage registry's: dq, dk, dv2, db, dg, dA, fp32 but dv2) from
    the probe's ``BUILDS[build_index]`` (the persistent whole B6 by default), compiled once a
    shape: a candidate for ``python -m benchmarks.op --candidate
    B6=research.b6_cute_probe:wy_dqkg_bwd:supports``. db is the sum of the pair's four
    partials, added here."""

    why = supports(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                   state_v_first)
    if why:
        raise ValueError(why)
    assert BUILDS[build_index][5], "B6's contract needs a whole-B6 build"
    tensors, (dq, dk, dg, dv2, dA, dbv, dbk) = op_tensors(q, k, v, v_new, gc, beta, A, h, do, dh, dv)
    _run_build((build_index,), build_index, k, v, scale, launch_args(tensors, k.device))
    db = pair_db(dbv, dbk, k.shape)
    return dq, dk, dv2, db, dg, dA


def supports_fused(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, state_v_first, chunk_size, cu_seqlens,
                   chunk_indices, dAqk, safe_gate, g, A_log, dt_bias, lower_bound):
    """None when ``wy_intra_bwd`` (the ``fused`` build as the op's B6-B9 unit) takes the call,
    else why not: as ``supports`` (B6), with the gate in the op and the B7-B9 unit's own needs
    (research.b7_cute_probe.supports)."""
    from research.b7_cute_probe import supports as b7_supports

    why = supports(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                   state_v_first)
    if why:
        return why
    # (B7's dAkk, dq, dk and dg are this kernel's own, dense: A, q, k and gc stand for them here)
    return b7_supports(q, k, gc, beta, dAqk, A, q, k, beta, gc, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                       cu_seqlens, chunk_indices)


def wy_intra_bwd(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, state_v_first, chunk_size, cu_seqlens,
                 chunk_indices, dAqk, safe_gate, g, A_log, dt_bias, lower_bound):
    """B6 through B9 with the stage registry's contract ((dq, dk, dv, db, dg, dA_log, ddt_bias))
    from the ``fused`` build, compiled once a shape and gate form: a candidate for ``python -m
    benchmarks.op --candidate B6-B9=research.b6_cute_probe:wy_intra_bwd:supports_fused``. dAkk
    never leaves the kernel; db is B6's four partials and B7's two, added here."""
    import torch

    from research.b7_cute_probe import unit_outputs, unit_views

    why = supports_fused(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, state_v_first, chunk_size, cu_seqlens,
                         chunk_indices, dAqk, safe_gate, g, A_log, dt_bias, lower_bound)
    if why:
        raise ValueError(why)
    tensors, (dq, dk, dg, dv2, dA, dbv, dbk) = op_tensors(q, k, v, v_new, gc, beta, A, h, do, dh, dv)
    # (B7's tensors as the unit build takes them; its dq, dk, dg and dAkk are this kernel's B6 outputs)
    seven = unit_views(q, k, gc, beta, dAqk, dA, dq, dk, dg, g, A_log, dt_bias)
    tensors.update({n: seven[n] for n in ARGS[22:]})
    raw = "bf16" if g.dtype == torch.bfloat16 else "fp32"
    _run_build(("fused", raw, dt_bias is not None, lower_bound), 8, k, v, scale, launch_args(tensors, k.device),
               both=True, fused=True, raw=raw, has_bias=dt_bias is not None,
               lower_bound=None if lower_bound is None else float(lower_bound))
    db6 = pair_db(dbv, dbk, k.shape)
    dq2, dk2, db, dg2, dA_log, ddt_bias = unit_outputs(seven, db6, A_log, dt_bias)
    return dq2, dk2, dv2, db, dg2, dA_log, ddt_bias


def sm90_row(dump: str, stages: int = 3, overlap: bool = True, exchange: bool = False, vside: bool = False,
             ws: bool = False, full: bool = False, persist: bool = False, both: bool = False,
             fused: bool = False) -> dict:
    """What the offline build is (``ptxas_report``), with its wgmma, TMA and bulk-copy counts and
    (where the build recorded it) its shared memory."""
    report = ptxas_report(dump)
    ptx = report.pop("ptx")
    return {"kind": "compile_sm90", "kernel": "b6_cute_probe", "stages": stages, "overlap": overlap,
            "exchange": exchange, "vside": vside, "ws": ws, "full": full, "persist": persist, "both": both,
            **({"fused": True} if fused else {}), **report,
            "bulk_s2s": ptx.count("cp.async.bulk.shared::cluster.shared::cta"),
            "shared_ring": stages * ((4 if vside else 3) * BT * BV + 2 * KH * BV) * 2,
            "wgmma": ptx.count("wgmma.mma_async"),
            "tma_multicast": ptx.count("multicast::cluster"), "tma_own": ptx.count(".global.tile.mbarrier") -
            ptx.count("multicast::cluster"), "cluster": "(1, 2, 1)", "threads": 384 if ws else 128,
            "shared_bytes": int(open(os.path.join(dump, "smem_bytes")).read())
            if os.path.exists(os.path.join(dump, "smem_bytes")) else None}


def _rel(got, want) -> float:
    return ((got - want).square().mean() / want.square().mean()).sqrt().item()


def diagnose(got, lefts: dict, rights: dict, K: int, V: int) -> dict:
    """For a [n, 64, K] sum far from its product: per K half (CTA j's), the product of a left
    ([n, 64, V]) and a right ([n, K, V]) operand over the subset of the V tiles that it is
    nearest to, with that error and the share of finite values: which operands and tiles
    the kernel actually summed."""
    import itertools

    NV = V // BV
    out = {}
    for j in range(2):
        half = got[..., j * KH:(j + 1) * KH]
        keep = half.isfinite()  # (compared where finite; the finite share reported beside)
        best = (float("inf"), None)
        for (ln, lt), (rn, rt) in itertools.product(lefts.items(), rights.items()):
            tiles = [lt[..., t * BV:(t + 1) * BV] @ rt[:, j * KH:(j + 1) * KH, t * BV:(t + 1) * BV].transpose(1, 2)
                     for t in range(NV)]
            for r in range(1, NV + 1):
                for subset in itertools.combinations(range(NV), r):
                    err = _rel(half[keep], sum(tiles[t] for t in subset)[keep])
                    if err < best[0]:
                        best = (err, f"{ln} {rn}^T over tiles {list(subset)}")
        out[f"K half {j}"] = {"nearest": best[1], "error": best[0], "finite": half.isfinite().float().mean().item()}
    return out


def b6_want(q, k, gc, beta, Akk, h, dh, vn, do, dv, v, scale) -> dict:
    """B6's outputs for the probe's chunk-heads from ``kernel_fun.kda.reference.wy_dqkg_bwd``
    (fp32, fla's roundings): the chunk-heads as the chunks of one sequence of one head, so
    q, k, gc [n * 64, K], beta [n * 64], Akk [n * 64, 64], h and dh [n * K, V], v_new, do,
    dv and v [n * 64, V] map onto its [1, T, 1, ...] and [1, n, 1, K, V] layouts. Each
    output as [n, 64, ...]."""
    from kernel_fun.kda import reference as ref

    n, K = q.shape[0] // BT, q.shape[1]
    V = v.shape[1]
    tok = lambda x: x.view(1, n * BT, 1, *x.shape[1:])  # noqa: E731
    dq, dk, dv2, db, dg, dA = ref.wy_dqkg_bwd(tok(q), tok(k), tok(v), tok(vn), tok(gc), tok(beta), tok(Akk),
                                                h.view(1, n, 1, K, V), tok(do), dh.view(1, n, 1, K, V), tok(dv), scale)
    return {"dq": dq.view(n, BT, K), "dk": dk.view(n, BT, K), "dg": dg.view(n, BT, K),
            "dv2": dv2.float().view(n, BT, V), "db": db.view(n, BT), "dA": dA.view(n, BT, BT)}


def gpu_run(nch: int = 32768, K: int = 128, V: int = 256, stages: int = 3, overlap: bool = True,
            exchange: bool = False, vside: bool = False, ws: bool = False, full: bool = False,
            persist: bool = False, reps: int = 20, both: bool = False, fused: bool = False) -> dict:
    """On a GPU: the probe's sums against torch's on 64 chunk-heads spread evenly over all
    ``nch`` (so a persistent cluster's later chunk-heads are among them), relative RMS; then
    its CUDA-event time at ``nch`` chunk-heads (32,768: prod8192_gate's) against the bytes it
    must move. ``fused``: also the B7-B9 unit's outputs against the registered Triton unit run on
    this kernel's own B6 outputs (B7 alone), and against the registered B6 then the registered
    unit (the whole chain); timed against the two registered kernels back to back."""
    import time

    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    h, dh = (torch.randn(nch * K, V, generator=g, **bf) * 0.1 for _ in range(2))
    vn, do, dv = (torch.randn(nch * BT, V, generator=g, **bf) for _ in range(3))
    kg = torch.randn(nch * BT, K, generator=g, **bf) * 0.1
    outs = [torch.full((nch * BT, K), float("nan"), device="cuda") for _ in range(3)]
    dA = torch.full((nch * BT, BT), float("nan"), device="cuda")
    v = torch.randn(nch * BT, V, generator=g, **bf)
    Akk = torch.randn(nch * BT, BT, generator=g, **bf) * 0.1
    beta = torch.rand(nch * BT, generator=g, device="cuda")
    dv2 = torch.full((nch * BT, V), float("nan"), **bf)
    dAv = torch.full((2 * nch * BT, BT), float("nan"), device="cuda")
    dbv = torch.full((2 * nch * BT,), float("nan"), device="cuda")
    # (full) q and k as unit-scale rows, the chunk cumsum of a log2 decay of 0-0.1 a token
    q, k = (torch.randn(nch * BT, K, generator=g, **bf) * K ** -0.5 for _ in range(2))
    gc = -(torch.rand(nch, BT, K, generator=g, device="cuda") * 0.1).cumsum(1).view(nch * BT, K)
    dg = torch.full((nch * BT, K), float("nan"), device="cuda")
    dbk = torch.full((2 * nch * BT,), float("nan"), device="cuda")
    dA_out = torch.full((nch * BT, BT), float("nan"), device="cuda")
    b7t = unused_fused(dev="cuda")
    if fused:  # B7's own inputs (dAqk lower with its diagonal, the raw gate, its parameters) and outputs
        rows = torch.arange(BT, device="cuda")
        dAqk = (torch.randn(nch, BT, BT, generator=g, device="cuda") * (rows[:, None] >= rows[None, :])).view(-1, BT)
        b7t = (dAqk, (torch.randn(nch * BT, K, generator=g, device="cuda") * 2).bfloat16(),
               torch.randn(1, generator=g, device="cuda") * 0.5, torch.randn(K, generator=g, device="cuda") * 0.5,
               *(torch.full((nch * BT, K), float("nan"), device="cuda") for _ in range(2)),
               torch.full((nch * BT, K), float("nan"), **bf), torch.full((2 * nch * BT,), float("nan"), device="cuda"),
               torch.full((2 * nch,), float("nan"), device="cuda"), torch.full((nch, K), float("nan"), device="cuda"))
    # (launched on torch's stream, so the events below bracket the kernel itself)
    args = [from_dlpack(t, assumed_align=16) for t in (h, dh, vn, do, dv, kg, *outs, dA, v, Akk, beta, dv2, dAv, dbv,
                                                       q, k, gc, dg, dbk, dA_out, *b7t)]
    args.append(cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    scale = K ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    run = cute.compile(build(K, V, stages, overlap, exchange, vside, ws, full, persist, scale, sms // 2, both=both,
                             fused=fused), *args)
    run(*args)
    torch.cuda.synchronize()
    n = min(nch, 64)
    sel = torch.linspace(0, nch - 1, n, device="cuda").round().long()

    def pick(x, rows):  # the chunk-heads sel of x, laid out [nch * rows, ...], as [n * rows, ...]
        return x.view(nch, rows, *x.shape[1:])[sel].reshape(n * rows, *x.shape[1:])

    hs, dhs = (pick(x, K).float().view(n, K, V) for x in (h, dh))
    vns, dos, dvs = (pick(x, BT).float().view(n, BT, V) for x in (vn, do, dv))
    want = [dos @ hs.transpose(1, 2), vns @ dhs.transpose(1, 2), dvs @ hs.transpose(1, 2)]
    errors, diagnosis = {}, {}
    if full:  # B6 whole: the package's reference stage (fp32, rounded where fla's B6 rounds)
        wants = b6_want(pick(q, BT), pick(k, BT), pick(gc, BT), pick(beta, BT), pick(Akk, BT), pick(h, K),
                        pick(dh, K), pick(vn, BT), pick(do, BT), pick(dv, BT), pick(v, BT), scale)
        gots = {"dq": pick(outs[0], BT).view(n, BT, K), "dk": pick(outs[1], BT).view(n, BT, K),
                "dg": pick(dg, BT).view(n, BT, K), "dv2": pick(dv2, BT).float().view(n, BT, V),
                "db": (pick(dbv, 2 * BT).view(n, 2, BT) + pick(dbk, 2 * BT).view(n, 2, BT)).sum(1),
                "dA": pick(dA_out, BT).view(n, BT, BT)}
        for name, w in wants.items():
            errors[name] = _rel(gots[name], w)
            if not errors[name] < 1e-2 and gots[name].shape[-1] == K:  # by K half (CTA)
                diagnosis[name] = [_rel(gots[name][..., j * KH:(j + 1) * KH], w[..., j * KH:(j + 1) * KH])
                                   for j in range(2)]
    for name, got, w in zip(("dq", "dkh", "dw"), outs, want):
        if full:
            break
        got = pick(got, BT).view(n, BT, K)
        errors[name] = _rel(got, w)
        if not errors[name] < 1e-2:  # (NaN too) which operands and tiles it did sum
            diagnosis[name] = diagnose(got, {"do": dos, "v_new": vns, "dv": dvs}, {"h": hs, "dh": dhs}, K, V)
    if exchange:  # dw rounded to bf16 per K half, times kg's half, the halves summed
        dw16 = pick(outs[2], BT).view(n, BT, K).to(torch.bfloat16).float()
        kgs = pick(kg, BT).float().view(n, BT, K)
        w = sum(dw16[..., j * KH:(j + 1) * KH] @ kgs[..., j * KH:(j + 1) * KH].transpose(1, 2) for j in range(2))
        got = pick(dA, BT).view(n, BT, BT)
        errors["dA"] = ((got - w).square().mean() / w.square().mean()).sqrt().item()
    if vside and not full:  # dvb = A^T dv, dv2 = beta dvb (bf16), dA's V part dv v^T, db's V part sum_j dvb v
        A_s, v_s = pick(Akk, BT).float().view(n, BT, BT), pick(v, BT).float().view(n, BT, V)
        dvb = A_s.transpose(1, 2) @ dvs
        wants = {"dv2": dvb * pick(beta, BT).view(n, BT, 1), "dAv": dvs @ v_s.transpose(1, 2),
                 "dbv": (dvb * v_s).sum(-1)}
        gots = {"dv2": pick(dv2, BT).float().view(n, BT, V),
                "dAv": pick(dAv, 2 * BT).view(n, 2, BT, BT).sum(1), "dbv": pick(dbv, 2 * BT).view(n, 2, BT).sum(1)}
        for name, w in wants.items():
            errors[name] = _rel(gots[name], w)
        if not max(errors[name] for name in wants) < 1e-2:  # by V tile, and by CTA (tile parity)
            tiles = [slice(t * BV, (t + 1) * BV) for t in range(V // BV)]
            diagnosis["dv2 by tile"] = [_rel(gots["dv2"][..., t], wants["dv2"][..., t]) for t in tiles]
            for j in range(2):
                mine = [t for i, t in enumerate(tiles) if i % 2 == j]
                w_a = sum(dvs[..., t] @ v_s[..., t].transpose(1, 2) for t in mine)
                w_b = sum((dvb[..., t] * v_s[..., t]).sum(-1) for t in mine)
                diagnosis[f"CTA {j} partials"] = {
                    "dAv": _rel(pick(dAv, 2 * BT).view(n, 2, BT, BT)[:, j], w_a),
                    "dbv": _rel(pick(dbv, 2 * BT).view(n, 2, BT)[:, j], w_b)}
    import statistics

    from kernel_fun.bench.timing import cuda_times

    timed = lambda fn: statistics.median(cuda_times(fn, reps))  # noqa: E731
    registered = {}
    if full:  # the registered Triton B6 on the same tensors (the chunk-heads as one sequence of one
        # head): every output of every chunk-head against it, and its time in this process
        from kernel_fun.kda.kernels import b6_wy_bwd

        tok = lambda x: x.view(1, nch * BT, 1, *x.shape[1:])  # noqa: E731
        reg_args = (tok(q), tok(k), tok(v), tok(vn), tok(gc), tok(beta), tok(Akk), h.view(1, nch, 1, K, V), tok(do),
                    dh.view(1, nch, 1, K, V), tok(dv), scale, BT, None, None)
        r_dq, r_dk, r_dv2, r_db, r_dg, r_dA = b6_wy_bwd.wy_dqkg_bwd(*reg_args)
        ours = {"dq": outs[0], "dk": outs[1], "dg": dg, "dv2": dv2.float(),
                "db": (dbv.view(nch, 2, BT) + dbk.view(nch, 2, BT)).sum(1).view(-1), "dA": dA_out}
        theirs = {"dq": r_dq, "dk": r_dk, "dg": r_dg, "dv2": r_dv2.float(), "db": r_db, "dA": r_dA}
        registered = {"vs_registered": {name: _rel(ours[name].reshape(-1), theirs[name].reshape(-1))
                                        for name in ours},
                      "registered_ms": timed(lambda: b6_wy_bwd.wy_dqkg_bwd(*reg_args))}
        if fused:  # the registered B7-B9 unit on this kernel's B6 outputs (B7 alone), then on the
            # registered B6's (the whole chain); the unit's db from zero, so db is B7's part alone
            from kernel_fun.kda.kernels import b7_b9_intra_bwd

            dAqk, g_raw, A_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part = b7t
            ours7 = (dq2, dk2, db_part.view(2, -1).sum(0), dg2.float(), dA_part.sum().view(1), dbias_part.sum(0))
            names7 = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")

            four = lambda x: x.reshape(1, nch * BT, 1, -1)  # noqa: E731  (this kernel's [rows, C] or the op's)

            def unit(dq_, dk_, dg_, dA_):
                return b7_b9_intra_bwd.intra_bwd(
                    q=tok(q), k=tok(k), gc=tok(gc), beta=tok(beta), dAqk=tok(dAqk), dAkk=four(dA_), dq=four(dq_),
                    dk=four(dk_), db=torch.zeros(1, nch * BT, 1, device="cuda"), dg=four(dg_), safe_gate=False,
                    g=tok(g_raw), A_log=A_log, dt_bias=dt_bias, lower_bound=None, chunk_size=BT, cu_seqlens=None,
                    chunk_indices=None)

            for key, theirs7 in (("b7_vs_registered", unit(outs[0], outs[1], dg, dA_out)),
                                 ("chain_vs_registered", unit(r_dq, r_dk, r_dg, r_dA))):
                registered[key] = {n: _rel(a.reshape(-1).float(), b.reshape(-1).float())
                                   for n, a, b in zip(names7, ours7, theirs7)}

            def chain():
                o = b6_wy_bwd.wy_dqkg_bwd(*reg_args)
                return unit(o[0], o[1], o[4], o[5])

            registered["registered_chain_ms"] = timed(chain)
        del r_dq, r_dk, r_dv2, r_db, r_dg, r_dA, ours, theirs
    ms = timed(lambda: run(*args))
    torch.cuda.synchronize()
    wall = time.perf_counter()
    for _ in range(reps):  # (a cross-check: reps back to back, wall clock over all of them)
        run(*args)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - wall) * 1e3 / reps
    moved = nch * ((2 * K * V + 3 * BT * V) * 2 + 3 * BT * K * 4)
    if vside:  # v and Akk read, dv2 written (bf16), the partials of dA and db (fp32)
        moved += nch * ((2 * BT * V + BT * BT) * 2 + 2 * BT * BT * 4 + 2 * BT * 4)
    if full:  # B6's own traffic: h, dh, v_new, do, dv, v, Akk, q, k (bf16), g, beta in; dq, dk, dg, dA, db's
        # four partials (fp32) and dv2 (bf16) out
        moved = nch * ((2 * K * V + 4 * BT * V + BT * BT + 2 * BT * K + BT * V) * 2
                       + (BT * K + BT + 3 * BT * K + BT * BT + 4 * BT) * 4)
    if fused:  # and B7's: dAqk and the raw gate in, dq, dk and dg back in, dq2 and dk2 (fp32), dg2 and the
        # partials out
        moved += nch * (BT * BT * 4 + BT * K * 2 + 3 * BT * K * 4 + 2 * BT * K * 4 + BT * K * 2 + 2 * BT * 4 + K * 4)
    return {"kind": "gpu", "kernel": "b6_cute_probe", "chunk_heads": nch, "stages": stages, "overlap": overlap,
            "errors": errors,
            "exchange": exchange, "vside": vside, "ws": ws, "full": full, "persist": persist, "both": both,
            "fused": fused, "diagnosis": diagnosis,
            "finite": all(bool(torch.isfinite(o).all()) for o in (outs[:2] if full else outs) + ([dA] if exchange else [])
                          + ([dv2, dbv, dg, dbk, dA_out] if full else [dv2, dAv, dbv] if vside else [])
                          + (list(b7t[4:]) if fused else [])),
            "ms": ms, "wall_ms": wall_ms, "bytes": moved, **registered,
            "TB_s": moved / ms / 1e9, "gpu": torch.cuda.get_device_name()}


def main(argv=None) -> int:
    import json

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:  # each build in a process of its own (CuTe DSL reads its dump folder once)
        import subprocess

        dump = argv[1] if len(argv) > 1 else "/tmp/b6_cute_probe"
        for stages, overlap, exchange, vside, ws, full, persist in BUILDS:
            sub = os.path.join(dump, f"stages{stages}{'' if overlap else '-serial'}{'-exchange' if exchange else ''}"
                               f"{'-vside' if vside else ''}{'-ws' if ws else ''}{'-full' if full else ''}"
                               f"{'-persist' if persist else ''}")
            os.makedirs(sub, exist_ok=True)
            for old in os.listdir(sub):
                os.remove(os.path.join(sub, old))
            subprocess.run([sys.executable, "-m", "research.b6_cute_probe", "compile-one", str(stages),
                            str(int(overlap)), str(int(exchange)), str(int(vside)), str(int(ws)), str(int(full)),
                            str(int(persist)), sub], check=True, stdout=subprocess.DEVNULL)
            print(json.dumps(sm90_row(sub, stages, overlap, exchange, vside, ws, full, persist)))
        return 0
    if argv[:1] == ["compile-one"]:
        compile_offline(stages=int(argv[1]), overlap=bool(int(argv[2])), exchange=bool(int(argv[3])),
                        vside=bool(int(argv[4])), ws=bool(int(argv[5])), full=bool(int(argv[6])),
                        persist=bool(int(argv[7])), dump=argv[8], H=int(argv[9]) if len(argv) > 9 else 1,
                        both="both" in argv[10:] or "fused" in argv[10:], fused="fused" in argv[10:])
        return 0
    if argv[:1] == ["gpu"]:  # every build, or those whose indices in BUILDS follow (8:both: build 8 with
        # the dA exchange both ways; 8:fused: that with the B7-B9 unit after B6)
        for arg in argv[1:] or [str(i) for i in range(len(BUILDS))]:
            index, *form = arg.split(":")
            stages, overlap, exchange, vside, ws, full, persist = BUILDS[int(index)]
            print(json.dumps(gpu_run(stages=stages, overlap=overlap, exchange=exchange, vside=vside, ws=ws, full=full,
                                     persist=persist, both="both" in form or "fused" in form,
                                     fused="fused" in form)), flush=True)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
