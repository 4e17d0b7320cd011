"""B7's three sums on chip in CuTe DSL (sm_90a), and the B7-B9 unit on them (with B10 too):
the backward's candidate for B7-B10 (docs/log/bwd-fused.md). Not registered yet. Measured on
an H100 (2026-12-06, rows in benchmarks/results/):
- in the whole op at prod8192_gate: 31.3 ms against 37.3 with the registered stages and fla's
  52.8 (1.69x), the unit's kernel 7.4 ms there;
- that is with the pair-by-pair path as a run-time loop: unrolled (~5,100 of the kernel's
  13,400 SASS instructions between the products and the tail) the kernel took 12.0 ms in the op,
  its straight-line code past what the instruction cache holds; the same bits either way;
- unrolled, and on one head (the probe's ``gpu``): 9.9 ms at the op bench's gates against 11.3
  for the registered Triton unit, and 25.6 against 25.2 under gates past the guard (the loop's
  times there not yet measured).

Its time follows its instruction count (a straight-line body and tail of ~8,000 SASS
instructions, each executed once a warp). Its body also runs inside research.b6_cute_probe's
fused kernel.

CuTe DSL 4.8.1 has no tf32 warpgroup MMA for Hopper: its warpgroup ops take bf16/fp16, fp8
and int8; tf32 is only in the sm80 warp MMA and in Blackwell's tcgen05. So where the Triton
kernels take three tf32 products (``dot3``), this takes three bf16 ones. Each fp32 operand
is split into a bf16 high part and a bf16 remainder, and the product is hi*hi + hi*lo + lo*hi
(``split``; the lo*lo term, about 2^-16 of the product, is dropped). Without ``split``, one
bf16 product (kept for the CPU twin's comparison).

For one chunk-head's K half (a CTA of one warpgroup), g is the chunk cumsum in log2
(non-increasing) and f(r, s) = exp2(g_r - g_s). The sums are B7's, over the pairs s <= r:

    x_q[r]  = sum_{s <= r} dAqk[r, s] k_s f(r, s)                          (dq's part)
    x_kr[r] = sum_{s < r} dAkk[r, s] k_s f(r, s)             (dk's row part, beta_r not applied)
    x_c[s]  = sum_{r >= s} dAqk[r, s] q_r f(r, s) + sum_{r > s} dAkk[r, s] beta_r k_r f(r, s)
                                                                          (dk's column part)

The rows fall in four blocks of 16; a(r) is the first row of r's block and n(s) the first of
the block after s's. Each sum is made of products of 16-row blocks through anchors, each
anchor a row at or before the rows it serves, so a row's sums follow from it and the rows
before it, to the bit:
- **Pairs across blocks** (s before r's block; the blocks form of research/b7_blocks.py),
  every factor at most 1:
  - Row role, per block j < 3 (n_j = 16 (j + 1)): dA's columns of block j times kx_j = k
    exp2(g[n_j] - g) on block j's rows. The rows after block j take it times exp2(g[a(r)] -
    g[n_j]); at the end every row takes exp2(g_r - g[a(r)]).
  - Column role, per block i > 0 (a_i = 16 i): dA's rows of block i, transposed, times yq_i =
    q exp2(g - g[a_i]) and yk_i = beta k exp2(g - g[a_i]). The columns before block i take it
    times exp2(g[a_i] - g[n(s)]); at the end every column takes exp2(g[n(s)] - g_s).
- **Pairs within a block** (``within``), through the block's first row u = a(r):
  - per block, dA's columns of the block times kxu = k exp2(g[u] - g) (row role), or its
    rows, transposed, times yq and yk above (column role, the same operands as across);
  - the block's own rows (columns) of that product, each row then times exp2(g_r - g[u]),
    each column times exp2(g[u] - g_s).
  - That takes an element (row or column, channel) whose span g[u] - g is within GUARD (64:
    kxu at most 2^64; at 0 where it is past, read only by rows past it). An element past it
    (a decay of more than 4 log2 units a token over its block, or a NaN gate) takes its pairs
    within the block one by one, each with its own exp2, read from memory, added to its
    sums. Exact for any gate, and the choice follows from the row and its block's first row.

dA's tiles, split and with their upper triangles zeroed, lie once in shared memory. They are
the A operand of the row role as they lie (M = r, K = s) and of the column role read MN-major
(M = s, K = r), the same bytes. The B operands are built on chip, split, as [64 rows, 64
channels] MN-major tiles (128-byte rows, never the 32-byte rows that read past their end on
the H200): kx, kxu, yq and yk, each warp writing its own block's rows (in the wgmma layout warp
w holds rows 16 w .. 16 w + 15, so a(r) is the same row for all of a thread's elements).

The elementwise work is on register fragments in that layout: g, q, k and the anchors' rows
(g[a], g[n], read with a row stride of 0) are loaded once a phase as whole fragments, never an
element at a time, and exp2 is the hardware's ex2 with no side effects declared. The products
run as one stream of 18 groups (three bf16 wgmmas a block and dA), alternating between two
accumulators so that the next group is issued before this one's epilogue: the column role's
blocks 3 .. 0, then the row role's blocks 0 .. 3, kx and kxu each. A group's epilogue is
warp-uniform: a block earlier (column role) or later (row role) than the warp's takes its
across factor; the warp's own block adds its within products and its own factor. No pass
zeroes dA's off-diagonal blocks: the within products' rows outside the warp's block are never
read.

With ``unit`` as well, the rest of the B7-B9 unit in the same kernel (the registered kernel's
tail: dq2, dk2, db's part, B8's reverse cumsum, B9's gate backward and its parameters'
partials; dAqk's diagonal, each row's pair (r, r), added there in fp32 rather than in the split
products, and left out of dg's terms, where its two cancel: dA_log under strong gates is a sum
that shows every product's rounding), and ``intra_bwd`` / ``supports`` give it the stage
registry's contract on the op's layout: a candidate for ``python -m benchmarks.op --candidate
B7-B9=research.b7_cute_probe:intra_bwd:supports``.

Layout (one head; the op's [B, T, H, C] tensors are viewed [B * T, H * C] at H heads):
dAqk, dAkk [NCH * 64, 64] fp32; q, k [NCH * 64, K] bf16; g [NCH * 64, K] fp32; beta [NCH * 64]
fp32; the sums x_q, x_kr, x_c [NCH * 64, K] fp32; with ``unit`` also dq, dk, dg [NCH * 64, K]
fp32 in and dq2, dk2 out, the raw gate and dg2 [NCH * 64, K] in its dtype, A_log [H], dt_bias
[H * K], and the partials db_part [2 * NCH * 64], dA_part [2 * NCH], dbias_part [NCH, K]; with
``l2`` (B10 in the unit, a chunk-head's K halves as a 2-CTA cluster) q_rstd and k_rstd [NCH * 64]
in, dq2 and dk2 in bf16.

    python -m research.b7_cute_probe compile [dir]   # sm_90a offline (CuTe DSL installed): rows
    python -m research.b7_cute_probe gpu             # against float64 and the twin, then timed
"""


import json
import os
import sys

BT, KH, BC = 64, 64, 16  # chunk rows, a CTA's K half, the row block
NB = BT // BC
GUARD = 64  # the pairs within a block go through its first row where its factor stays within 2^GUARD
# (split, within, unit): the whole sums, the sums across blocks alone, the B7-B9 unit
BUILDS = ((True, True, False), (True, False, False), (True, True, True))


def build(K: int = 128, split: bool = True, within: bool = True, unit: bool = False, raw: str = "bf16",
          has_bias: bool = True, lower_bound: float | None = None, H: int = 1, l2: bool = False,
          phased: bool = False, wg2: bool = False, ws: bool = False, body_only: bool = False, stm: bool = False,
          dakk_global: bool = True, bars: tuple = (1, 2), G: int = 1,
          var: bool = False):
    """The probe's host function (a ``cute.jit``) for K = 2 KH: one CTA of 128 threads a
    (K half, chunk-head). ``within``: the pairs within a block too. ``unit`` (with ``within``):
    then the rest of the B7-B9 unit, as the registered kernel's tail: dq2 = dq + x_q, dk2 = dk +
    beta x_kr + x_c, db's part (per K half) the row sums of x_kr k, dg = dg + q x_q + k (beta
    x_kr - x_c) reverse-cumsummed over the chunk (B8), then the gate's backward (B9) from the
    raw gate (``raw`` its dtype, bf16 or fp32; ``has_bias``: dt_bias added; ``lower_bound``: the
    sigmoid form) into dg2, with dA_log's partial per (K half, chunk-head) and dt_bias's per
    (chunk-head, channel). ``H``: the token tensors hold H heads side by side, as the op's [B, T, H,
    C] viewed [B * T, H * C] (beta [B * T * H], A_log [H], dt_bias [H * K]); chunk-head c is the
    chunk of rows c // H at head c % H, its partials by chunk-head (db's as the op's [B, T, H]).
    ``l2`` (with ``unit``): B10 too, the l2norm backward of dq2 and dk2 (q and k the normalized
    rows, q_rstd and k_rstd [NCH * 64] by row), written in bf16. A row's dot product over K takes
    both K halves, so the two CTAs of a chunk-head run as a cluster and swap their halves' row
    sums (one 512-byte copy each way, shared memory to shared memory); both add them in the same
    order, so both halves scale by the same number. ``phased``: the B operands in two phases
    through the same 32 KB, yq and yk for the column role, then kx and kxu for the row role once
    the column products are done (64 KB of shared memory where the unit takes 96: the form a
    kernel that also holds B6's ring needs). ``wg2``: two warpgroups a CTA, the roles split
    between them as a kernel whose two consumer warpgroups are at most 232 registers each needs
    them: warpgroup 0 the column role (x_c: yq and yk, the column groups), warpgroup 1 the row
    role (x_q and x_kr: kx and kxu, the row groups), each with its own two accumulators; with
    ``unit``, warpgroup 0 hands x_c to warpgroup 1 through a 16 KB fp32 tile in shared memory
    and warpgroup 1 runs the tail. Each sum's groups run in the same order as in one warpgroup,
    so the bits are the same. ``ws`` (with ``wg2``): a third warpgroup, idle here, standing for the
    persistent B6's producer, and the registers as that kernel sets them (384 threads, one CTA an
    SM, setmaxnreg 40 for it and 232 for each role): whether B7's roles fit a B6 consumer's
    registers without spilling.

    ``stm``: the bf16 tiles (dA's split tiles, the B operands) written to shared memory by
    stmatrix, four 8x8 blocks an instruction, where the fragment's 2-element stores each
    computed their own swizzled address (the unit 13,840 to 13,152 SASS instructions).

    ``G``: value heads a q/k head (GVA): ``H`` counts the value heads (gc, beta, dA, the incoming
    and outgoing gradients, the gate), q and k hold H / G heads, and chunk-head c reads q's and
    k's head c % H // G. dq2 and dk2 stay by value head (the chain sums each group after the
    unit). Not with ``l2`` (B10 needs the group's sum first), ``wg2`` or ``body_only``.

    ``var`` (with ``unit``): chunks of any length up to 64 anywhere in the rows (packed sequences,
    or T not a multiple of 64): ``chunk_rows`` [chunks, 2] gives each chunk's first row and
    length, the grid takes chunks x H chunk-heads. Rows past a chunk's end are never read or
    written: the loads of rows are predicated (their values 0), the stores too, and g past the
    end reads as the chunk's last row's (a flat continuation: every factor stays finite, and the
    zero rows and columns of dA, q, k and beta add nothing). The pair-by-pair path takes the
    chunk's rows alone; with ``l2``, B10's rstd and outputs too. Not with ``wg2`` or ``body_only``.

    With ``unit``, one warpgroup and not ``phased`` (every unit build the op runs), the
    pair-by-pair path is one run-time loop over a thread's 32 elements, its three sums waiting in
    the B operands' shared memory (dead once the products are done): ~5,100 SASS instructions of
    cold code between the products and the tail become ~400, and the kernel 13,400 to 8,480 with
    B10. The same operations in the same order, so the sums to the bit; in the op on an H100 the
    unit's kernel went 12.0 ms to 7.4 (the straight-line body and tail now fit the instruction
    cache, docs/log/bwd-fused.md).

    ``body_only``: return the B7 body alone (``body``, a ``cute.jit`` function) for a kernel that
    runs it on its own shared memory, with ``bars`` the named barriers it may take (the tail's,
    128 threads; the two roles', 256) and ``dakk_global`` off where that kernel has written dAkk's
    split tiles already."""
    assert not unit or within
    assert not l2 or unit
    assert not (wg2 and phased)  # (the two roles run at once: their operands are all live)
    assert not ws or wg2
    assert not wg2 or within
    LOG2E = 1.4426950408889634
    # dAqk's diagonal out of the products, added in the unit's tail (not in a fused kernel's body,
    # whose registers are full: research.b6_cute_probe's spills 28 bytes with it)
    DIAG = unit and not body_only
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import cpasync, warp, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    from research.cute_kit import quad_row_sums, regs, warp_col_sums

    NS = K // KH  # (the CTAs a chunk-head: K's halves, or one at K = 64)
    assert K == NS * KH and NS in (1, 2) and (NS == 2 or not (wg2 or body_only))
    XCH = l2 and NS == 2  # (B10's row sums swapped between the K halves; at K = 64 one CTA holds the row)
    assert G == 1 or not (l2 or wg2 or body_only)
    assert not var or (unit and not (wg2 or body_only or phased))
    ROLLED = unit and not (wg2 or body_only or phased)  # (the pair-by-pair path a run-time loop)
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    raw = {"bf16": bf16, "fp32": f32}[raw]

    def _ex2(x):
        """2^x (fp32 values) as the hardware's fast ex2, with no side effects declared (the inline-asm
        cute.arch.exp2 declares some, which pins every one, and the loads around it, in
        program order, and keeps equal ones from being shared)."""
        return cute.math.exp2(x, fastmath=True)

    def _tail_bar():
        """The tail's barrier: the CTA's, or (``wg2``, where warpgroup 1 runs the tail alone) warpgroup 1's."""
        if cutlass.const_expr(wg2):
            cute.arch.barrier(barrier_id=bars[0], number_of_threads=128)
        else:
            cute.arch.sync_threads()

    def _roles_bar():
        """The two role warpgroups' barrier (``wg2``; ``ws``'s idle warpgroup never takes it)."""
        cute.arch.barrier(barrier_id=bars[1], number_of_threads=256)

    # (each helper below defined for the build it is in: the DSL takes no closure over a Python
    # flag into staged control flow)
    if var:
        def _tile(x, rt, row0, ctile, width=KH):
            """x's [64, width] tile at column tile ``ctile`` of the 64 rows from row0 (those past the
            chunk's end never touched)."""
            C = cute.size(x, mode=[1])
            assert not isinstance(C, int) or C % width == 0  # (what the assumption below rests on)
            # (the offset a whole number of tiles' widths: the tile's rows keep the tensor's
            # alignment, so a thread's two adjacent channels load as one 8-byte access)
            return cute.make_tensor(x.iterator + cute.assume(row0 * C + ctile * width, divby=width),
                                    cute.make_layout((BT, width), stride=(C, 1)))

        # (a thread's fragment holds two rows, element i = a + 2 b + 4 n on row b: each row read
        # or written whole under one branch on its ``ok``, so that its pairs of adjacent channels
        # stay 8-byte accesses, where a predicate an element made every access a scalar one)
        @cute.jit
        def _ld(f, ok):
            """A thread's fragment of a global view, loaded: the rows past the chunk's end (``ok``
            false) not read, 0."""
            r = cute.make_rmem_tensor(f.shape, f.element_type)
            r.fill(0)
            for b in cutlass.range_constexpr(2):
                if ok[2 * b]:
                    r[(None, b, None), 0, 0].store(f[(None, b, None), 0, 0].load())
            return r.load()

        @cute.jit
        def _st(f, vals, ok):
            """vals into a thread's fragment of a global view, not past the chunk's end."""
            r = cute.make_rmem_tensor(f.shape, f.element_type)
            r.store(vals)
            for b in cutlass.range_constexpr(2):
                if ok[2 * b]:
                    f[(None, b, None), 0, 0].store(r[(None, b, None), 0, 0].load())
    else:
        def _tile(x, rt, row0, ctile, width=KH):
            """x's [64, width] tile at row tile rt, column tile ``ctile``."""
            return cute.local_tile(x, (BT, width), (rt, ctile))

        def _ld(f, ok):
            return f.load()

        def _st(f, vals, ok):
            f.store(vals)

    def _split(x):
        """x (fp32 values) as its bf16 rounding and the bf16 rounding of what that left."""
        hi = x.to(bf16)
        return hi, (x - hi.to(f32)).to(bf16)

    def _specs():
        """The groups in order: ("c", i, 0, 0) the column role's block i; ("r", j, mat, tile) the
        row role's block j, dAqk (mat 0) or dAkk (1), times kx (tile 0) or kxu (1)."""
        specs = [("c", i, 0, 0) for i in range(NB - 1, -1 if within else 0, -1)]
        for j in range(NB):
            for tile in ((0,) if j < NB - 1 else ()) + ((1,) if within else ()):
                specs += [("r", j, 0, tile), ("r", j, 1, tile)]
        return specs

    def _fragments(tmma, a_tiles, b_tiles):
        """The wgmma fragments of the A tiles (as ``tmma`` reads them) and of the B tiles."""
        thr = tmma.get_slice(0)
        return ([tmma.make_fragment_A(thr.partition_A(t)) for t in a_tiles],
                [tmma.make_fragment_B(thr.partition_B(t)) for t in b_tiles])

    def _products(tmma, zmma, acc, a_hi, a_lo, b_hi, b_lo, ka, kb, fresh):
        """acc (+)= a b over one block: k block ka of a, kb of b; hi*hi, and with
        ``split`` hi*lo and lo*hi; ``fresh``: the first overwrites acc (``zmma``'s scale-d off)."""
        at_a, at_b = (None, None, ka, 0), (None, None, kb, 0)
        cute.gemm(zmma if fresh else tmma, acc, a_hi[at_a], b_hi[at_b], acc)
        if split:
            cute.gemm(tmma, acc, a_hi[at_a], b_lo[at_b], acc)
            cute.gemm(tmma, acc, a_lo[at_a], b_hi[at_b], acc)

    @cute.kernel
    def kernel(dAqk: cute.Tensor, dAkk: cute.Tensor, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor,
               beta: cute.Tensor, x_q: cute.Tensor, x_kr: cute.Tensor, x_c: cute.Tensor, dq: cute.Tensor,
               dk: cute.Tensor, dg: cute.Tensor, g_raw: cute.Tensor, a_log: cute.Tensor, dt_bias: cute.Tensor,
               dq2: cute.Tensor, dk2: cute.Tensor, dg2: cute.Tensor, db_part: cute.Tensor, dA_part: cute.Tensor,
               dbias_part: cute.Tensor, q_rstd: cute.Tensor, k_rstd: cute.Tensor, chunk_rows: cute.Tensor,
               mma: cute.TiledMma,
               mma_z: cute.TiledMma, mma_t: cute.TiledMma, mma_tz: cute.TiledMma, a_l: cute.ComposedLayout,
               at_l: cute.ComposedLayout, b_l: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        half, chunk, _ = cute.arch.block_idx()
        wid = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        w = wid % NB  # (its rows, or columns s, are block w)
        wg = wid // NB  # (``wg2``: 0 the column role, 1 the row role; ``ws``: 2 idle)
        lane = cute.arch.lane_idx()
        for m, on in ((mma, True), (mma_z, False), (mma_t, True), (mma_tz, False)):  # (each MMA twice, its
            m.set(warpgroup.Field.ACCUMULATE, on)  # field set here once: see research.b6_cute_probe's _Mma)

        @cute.struct
        class Smem:
            # dA's tiles, split: the A operand of the row role as they lie (M = r, K = s) and of the
            # column role read MN-major (M = s, K = r), the same bytes
            qh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            kh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            kl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            # the B operands [64 channels, 64 rows], MN-major (a row's 64 channels one 128-byte
            # row: no operand with 32-byte rows, the shape read past its end on the H200,
            # docs/log/prep.md), a block's rows its k block: kx (across blocks, row role), kxu
            # (within a block, row role), yq and yk (column role)
            # (``phased``: kx and kxu in yq's and yk's space, these 8 elements each)
            xh: cute.struct.Align[cute.struct.MemRange[bf16, 8 if phased else cute.cosize(b_l)], 1024]
            xl: cute.struct.Align[cute.struct.MemRange[bf16, 8 if phased else cute.cosize(b_l)], 1024]
            uh: cute.struct.Align[cute.struct.MemRange[bf16, 8 if phased else cute.cosize(b_l)], 1024]
            ul: cute.struct.Align[cute.struct.MemRange[bf16, 8 if phased else cute.cosize(b_l)], 1024]
            yqh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            yql: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            ykh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            ykl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            # (unit) the warps' column sums for B8's cumsum and dt_bias's partial, and their dA_log sums
            red: cute.struct.Align[cute.struct.MemRange[f32, 2 * NB * KH + NB], 128]
            # (l2) the K halves' row sums of dq2 q and dk2 k, [half, q or k, row]: this CTA's half
            # written here, the peer's copied in, and the barrier that copy completes on
            xch: cute.struct.Align[cute.struct.MemRange[f32, 4 * BT], 128]
            xbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 1], 8]
            # (``wg2`` with ``unit``) x_c, handed from warpgroup 0 to warpgroup 1's tail
            xc: cute.struct.Align[cute.struct.MemRange[f32, BT * KH if wg2 and unit else 4], 128]

        storage = SmemAllocator().allocate(Smem)
        if cutlass.const_expr(XCH):  # the barrier armed for the peer's 512 bytes before the peer can send
            if tidx == 0:
                cute.arch.mbarrier_init(storage.xbar.data_ptr(), 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(storage.xbar.data_ptr(), 2 * BT * 4)
            cute.arch.cluster_arrive_relaxed()
        s_a = [getattr(storage, n).get_tensor(a_l.outer, swizzle=a_l.inner) for n in ("qh", "ql", "kh", "kl")]
        s_b = [getattr(storage, n).get_tensor(b_l.outer, swizzle=b_l.inner)
               for n in (("yqh", "yql", "ykh", "ykl") if phased else ("xh", "xl", "uh", "ul"))
               + ("yqh", "yql", "ykh", "ykl")]
        s_at = [getattr(storage, n).get_tensor(at_l.outer, swizzle=at_l.inner) for n in ("qh", "ql", "kh", "kl")]
        tens = (dAqk, dAkk, q, k, g, beta, x_q, x_kr, x_c, dq, dk, dg, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part,
                dA_part, dbias_part, q_rstd, k_rstd, chunk_rows)
        sm = (s_a, s_at, s_b, storage.red.data_ptr(), storage.xch.data_ptr(), storage.xbar.data_ptr(),
              storage.xc.data_ptr(), cute.recast_ptr(storage.xh.data_ptr(), dtype=f32))
        mmas = (mma, mma_z, mma_t, mma_tz)
        if cutlass.const_expr(not wg2):
            body(0, tidx, w, lane, chunk, half, tens, sm, mmas)
        elif wg < 2:
            if cutlass.const_expr(ws):
                cute.arch.setmaxregister_increase(232)
            if wg == 0:
                body(1, tidx % 128, w, lane, chunk, half, tens, sm, mmas)
            else:
                body(2, tidx % 128, w, lane, chunk, half, tens, sm, mmas)
        elif cutlass.const_expr(ws):  # (the idle warpgroup; with ``l2``, the cluster's barriers too)
            cute.arch.setmaxregister_decrease(40)
            if cutlass.const_expr(l2):
                cute.arch.cluster_wait()
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()

    @cute.jit
    def body(roles, tid, w, lane, chunk, half, tens, sm, mmas, regs_in=None):
        """B7 (with ``unit`` the B7-B9 unit, with ``l2`` B7-B10) for one (chunk-head, K half), as one
        warpgroup (``roles`` 0) or as one of two (``wg2``: 1 the column role, 2 the row role, ``tid``
        the thread within its warpgroup). ``tens``: the global tensors in ``ARGS``'s order; ``sm``:
        the shared tiles and pointers (dA's split tiles, A and as read MN-major; the B operand
        tiles; the tail's sums, the l2 exchange and its barrier, x_c's hand-off); ``mmas``: the
        four MMAs. A kernel that holds dAkk's split tiles already (``dakk_global`` off) skips
        writing them. ``regs_in``: [64, 64] fp32 register fragments of the kernel's (two for the
        accumulators, three for the sums) to take for B7's, where the kernel's own are dead by
        now: ptxas then needs no registers beyond them."""
        (dAqk, dAkk, q, k, g, beta, x_q, x_kr, x_c, dq, dk, dg, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part,
         dA_part, dbias_part, q_rstd, k_rstd) = tens[:23]
        s_a, s_at, s_b, red, xch, xbar, xc = sm[:7]
        mma, mma_z, mma_t, mma_tz = mmas
        rt, ct = chunk // H, chunk % H * NS + half  # the chunk's row tile; this K slice's column tile
        head = chunk % H
        # (``var``: the chunk's first row and its length from chunk_rows; else whole chunks)
        row0, nval = (tens[23][chunk // H, 0], tens[23][chunk // H, 1]) if cutlass.const_expr(var) else (rt * BT, BT)
        g_q = _tile(dAqk, rt, row0, head, BT)
        g_k = _tile(dAkk, rt, row0, head, BT)
        ctq = chunk % H // G * NS + half  # (q's and k's column tile: the value head's q/k head)
        g_qq = _tile(q, rt, row0, ctq)
        g_kk = _tile(k, rt, row0, ctq)
        g_g = _tile(g, rt, row0, ct)
        g_b = cute.make_tensor(beta.iterator + row0 * H + head, cute.make_layout(BT, stride=H))  # beta by row

        thr_c = mma.get_slice(tid)
        frag = thr_c.partition_C  # (a thread's 32 elements of a [64, 64] tile: its rows are block w's)
        shape = frag(g_g).shape
        coords = frag(cute.make_identity_tensor((BT, KH)))
        ok = None  # (``var``: which of the thread's elements are the chunk's rows)
        if cutlass.const_expr(var):
            ok = cute.make_rmem_tensor(shape, cutlass.Boolean)
            for i in cutlass.range_constexpr(cute.size(shape)):
                ok[i] = coords[i][0] < nval
        lay = cute.make_layout((BT, KH), stride=(0, 1))
        rows_of = lambda ptr: frag(cute.make_tensor(ptr, cute.make_layout((BT, KH), stride=(H, 0))))  # noqa: E731
        if cutlass.const_expr(var):  # (an anchor past the chunk's end is its last row; so is g)
            anchor = lambda row: frag(cute.make_tensor(g_g[cutlass.min(row, nval - 1), None].iterator,  # noqa: E731
                                                       lay)).load()
            gload = lambda: cute.where(ok.load(), _ld(frag(g_g), ok), anchor(nval - 1))  # noqa: E731
        else:
            anchor = lambda row: frag(cute.make_tensor(g_g[row, None].iterator, lay)).load()  # noqa: E731
            gload = lambda: frag(g_g).load()  # noqa: E731
        mn = lambda t: t[None, None, 0]  # noqa: E731  (an A tile as (M, K))
        kn = lambda t: cute.make_tensor(t.iterator, cute.select(t[None, None, 0].layout, mode=[1, 0]))  # noqa: E731
        # (``stm``: the bf16 tiles written by stmatrix, four 8x8 blocks an instruction, where a
        # fragment's 2-element stores each computed their own swizzled address)
        st_copy = (cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), bf16), mma)
                   if stm else None)

        def put(view, vals):
            """vals (bf16, this thread's elements of a [64, 64] tile in the wgmma layout) into the
            shared tile ``view`` (rows, columns)."""
            if cutlass.const_expr(stm):
                st_thr = st_copy.get_slice(tid)
                r = cute.make_rmem_tensor(shape, bf16)
                r.store(vals)
                cute.copy(st_copy, st_thr.retile(r), st_thr.partition_D(view))
            else:
                frag(view).store(vals)

        # dA's tiles, split, their upper triangles zeroed (dAqk keeps its diagonal but in the unit,
        # whose tail adds the pairs (r, r) in fp32): the row role reads them as they lie, the column
        # role MN-major
        # (``wg2``: warpgroup 0 writes dAqk's, warpgroup 1 dAkk's)
        def da_tiles(mats):
            for mat in mats:
                v = regs(_ld(frag((g_q, g_k)[mat]), ok))
                for i in cutlass.range_constexpr(cute.size(shape)):
                    r, s = coords[i]
                    v[i] = f32(cutlass.select_(s <= r if mat == 0 and not DIAG else s < r, v[i], f32(0.0)))
                parts = _split(v.load())
                put(mn(s_a[2 * mat]), parts[0])
                put(mn(s_a[2 * mat + 1]), parts[1])
        # the B operands, each warp its own block's rows: kx = k exp2(g[n(r)] - g) (at most 1;
        # block 3's never read), kxu = k exp2(g[a(r)] - g) (at most 2^GUARD: 0 past it, where only
        # rows past the guard read it), yq = q exp2(g - g[a(r)]) and yk = beta k exp2(g - g[a(r)])
        # (``phased``: yq and yk here, kx and kxu after the column role; ``wg2``: warpgroup 0 writes
        # yq and yk, warpgroup 1 kx and kxu)
        def operands(roles, sync=True):
            gv = gload()
            span = anchor(w * BC) - gv  # g[u] - g, u = a(r)
            kf = _ld(frag(g_kk), ok).to(f32)
            if cutlass.const_expr(roles[0] == 0):
                ops = [kf * _ex2(anchor(cutlass.select_(w < NB - 1, (w + 1) * BC, w * BC)) - gv),
                       cute.where(span <= GUARD, kf * _ex2(span), f32(0.0))]
            else:
                ops = [None, None]
            if cutlass.const_expr(roles[-1] == 3):
                down = _ex2(-span)
                ops += [_ld(frag(g_qq), ok).to(f32) * down,
                        _ld(rows_of(beta.iterator + row0 * H + head), ok) * kf * down]
            for n in roles:
                parts = _split(ops[n])
                put(kn(s_b[2 * n]), parts[0])
                put(kn(s_b[2 * n + 1]), parts[1])
            if cutlass.const_expr(sync):
                cute.arch.fence_view_async_shared()  # (the generic proxy's stores seen by the wgmmas)
                cute.arch.sync_threads()

        if cutlass.const_expr(roles == 0):
            da_tiles((0, 1) if dakk_global else (0,))
            operands((2, 3) if phased else (0, 1, 2, 3))


        def sums(names):
            """The wgmma accumulators, and the sums (registers the wgmmas never touch), those named zeroed."""
            if cutlass.const_expr(regs_in is not None):
                accs, o = regs_in[:2], list(regs_in[2:])
            else:
                accs = (cute.make_rmem_tensor(shape, f32), cute.make_rmem_tensor(shape, f32))
                o = [cute.make_rmem_tensor(shape, f32) for _ in range(3)]
            for n in names:
                o[n].fill(0.0)
            return accs, o

        # Each group is one block's products into one of two accumulators, the next group issued
        # before this one's epilogue. Column role, blocks i = 3 .. 0 (dA's rows of block i,
        # transposed, times yq, yk on them): the columns s of an earlier block w take it through
        # the anchors g[a_i] and g[n(s)] (every factor at most 1); at i = w every column takes
        # exp2(g[n(s)] - g_s), then its pairs within the block times exp2(g[a(s)] - g_s) where that
        # is within the guard. Row role, blocks j = 0 .. 3 (dA's columns of block j times kx, and
        # times kxu): the rows of a later block w take the kx product through g[a(r)] and g[n_j];
        # at j = w each row adds its kxu product where within the guard, then takes exp2(g_r - g[a(r)]).
        specs = _specs()

        def issue(spec, acc, r_a, r_b, t_a, t_b):
            kind, i, mat, tile = spec
            if kind == "c":
                _products(mma_t, mma_tz, acc, t_a[0], t_a[1], t_b[4], t_b[5], i, i, True)
                _products(mma_t, mma_tz, acc, t_a[2], t_a[3], t_b[6], t_b[7], i, i, False)
            else:
                _products(mma, mma_z, acc, r_a[2 * mat], r_a[2 * mat + 1], r_b[2 * tile], r_b[2 * tile + 1], i, i,
                          True)

        def stream(specs, accs, o_q, o_k, o_c):  # (the sums as arguments: the DSL rebinds what a branch writes)
            r_a, r_b = _fragments(mma, s_a, s_b)  # (the operands' descriptors, made where they are used)
            t_a, t_b = _fragments(mma_t, s_at, s_b)
            frags = (r_a, r_b, t_a, t_b)
            warpgroup.fence()
            issue(specs[0], accs[0], *frags)
            warpgroup.commit_group()
            for n in cutlass.range_constexpr(len(specs)):
                kind, i, mat, tile = specs[n]
                acc = accs[n % 2]
                # (``phased``: the last column group is waited for, and the row role's operands
                # written over the column role's, before the first row group is issued)
                boundary = phased and n + 1 < len(specs) and kind == "c" and specs[n + 1][0] == "r"
                if cutlass.const_expr(n + 1 < len(specs) and not boundary):
                    warpgroup.fence()
                    issue(specs[n + 1], accs[(n + 1) % 2], *frags)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                if cutlass.const_expr(kind == "c"):
                    if cutlass.const_expr(i > 0):
                        if w < i:
                            o_c.store(o_c.load() + _ex2(anchor(i * BC) - anchor((w + 1) * BC)) * acc.load())
                    if w == i:
                        if cutlass.const_expr(i < NB - 1):
                            o_c.store(o_c.load() * _ex2(anchor((i + 1) * BC) - gload()))
                        if cutlass.const_expr(within):
                            sp = anchor(i * BC) - gload()
                            o_c.store(o_c.load() + cute.where(sp <= GUARD, _ex2(sp) * acc.load(), f32(0.0)))
                else:
                    o = (o_q, o_k)[mat]
                    if cutlass.const_expr(tile == 0):
                        if w > i:
                            o.store(o.load() + _ex2(anchor(w * BC) - anchor((i + 1) * BC)) * acc.load())
                    else:
                        if w == i:
                            sp = anchor(i * BC) - gload()
                            o.store(_ex2(-sp) * (o.load() + cute.where(sp <= GUARD, acc.load(), f32(0.0))))
                if cutlass.const_expr(boundary):
                    cute.arch.sync_threads()  # (every warp's column products done: their operands free)
                    operands((0, 1))
                    warpgroup.fence()
                    issue(specs[n + 1], accs[(n + 1) % 2], *frags)
                    warpgroup.commit_group()

        if cutlass.const_expr(roles == 0):
            accs, (o_q, o_k, o_c) = sums((0, 1, 2))
            stream(specs, accs, o_q, o_k, o_c)
        if cutlass.const_expr(roles == 0 and not within):  # (across only: block 0's columns and every row take their own
            # factors at the end)
            if w == 0:
                o_c.store(o_c.load() * _ex2(anchor(BC) - frag(g_g).load()))
            down = _ex2(frag(g_g).load() - anchor(w * BC))
            o_q.store(o_q.load() * down)
            o_k.store(o_k.load() * down)
        # the elements past the guard: their pairs within the block one by one, each with its
        # own exp2, read from memory (none under gentle gates); ``row``: x_q's and x_kr's,
        # ``col``: x_c's. The warp skips the whole path with one branch when none of its
        # elements is past the guard: a branch an element would be 32 jumps over cold code,
        # each a miss in the instruction cache at its target (docs/log/bwd-fused.md)
        def slow(row, col, o_q, o_k, o_c):
            sp = regs(anchor(w * BC) - gload())
            if cutlass.const_expr(var):  # (the chunk's rows alone: a row past its end counts as inside)
                for i in cutlass.range_constexpr(cute.size(shape)):
                    sp[i] = f32(cutlass.select_(coords[i][0] < nval, sp[i], f32(0.0)))
            past = f32(0.0)
            for i in cutlass.range_constexpr(cute.size(shape)):
                past = past + f32(cutlass.select_(sp[i] <= GUARD, f32(0.0), f32(1.0)))
            if cute.arch.vote_any_sync(past > f32(0.0)):
                if cutlass.const_expr(ROLLED):
                    slow_rolled(o_q, o_k, o_c)
                else:
                    slow_serial(row, col, sp, o_q, o_k, o_c)

        def slow_rolled(o_q, o_k, o_c):
            # (the unit's: the thread's elements one by one in a run-time loop, element i = a + 2 b + 4 n
            # at row 16 w + lane // 4 + 8 b, channel 8 n + 2 (lane % 4) + a. The three sums wait in
            # the warp's 12 KB of the B operands' memory, lane-major; an element past the guard adds
            # its pairs there as slow_serial adds them in registers)
            scr = cute.make_tensor(sm[7] + w * (3 * 32 * 32), cute.make_layout((32, 32, 3), stride=(1, 32, 1024)))
            for i in cutlass.range_constexpr(cute.size(shape)):  # (no registers held across the loop)
                scr[lane, i, 0] = o_q[i]
                scr[lane, i, 1] = o_k[i]
                scr[lane, i, 2] = o_c[i]
            u = w * BC
            for i in cutlass.range(32, unroll=1):
                t = u + lane // 4 + 8 * (i // 2 % 2)
                c = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                inside = True
                end = u + BC
                if cutlass.const_expr(var):
                    inside = t < nval
                    end = cutlass.min(u + BC, nval)
                if inside:
                    if not (g_g[u, c] - g_g[t, c] <= GUARD):
                        a_q, a_k = row_pairs(t, c, u)
                        a_c = col_pairs(t, c, end)
                        scr[lane, i, 0] = scr[lane, i, 0] + a_q
                        scr[lane, i, 1] = scr[lane, i, 1] + a_k
                        scr[lane, i, 2] = scr[lane, i, 2] + a_c
            for i in cutlass.range_constexpr(cute.size(shape)):
                o_q[i] = scr[lane, i, 0]
                o_k[i] = scr[lane, i, 1]
                o_c[i] = scr[lane, i, 2]

        def slow_serial(row, col, sp, o_q, o_k, o_c):
            for i in cutlass.range_constexpr(cute.size(shape)):
                t, c = coords[i]
                u = t // BC * BC
                end = cutlass.min(u + BC, nval) if cutlass.const_expr(var) else u + BC  # (the block's rows in the chunk)
                if not (sp[i] <= GUARD):
                    if cutlass.const_expr(row):
                        a_q, a_k = row_pairs(t, c, u)
                        o_q[i] = o_q[i] + a_q
                        o_k[i] = o_k[i] + a_k
                    if cutlass.const_expr(col):
                        o_c[i] = o_c[i] + col_pairs(t, c, end)

        def row_pairs(t, c, u):
            """Element (t, c)'s pairs within its block for x_q and x_kr, s from the block's first
            row u up to t: s <= t (dAkk s < t; in the unit dAqk s < t too, its tail adds s = t)."""
            a_q = f32(0.0)
            a_k = f32(0.0)
            for s in cutlass.range(u, t + (0 if DIAG else 1), unroll=1):
                f = g_kk[s, c].to(f32) * cute.arch.exp2(g_g[t, c] - g_g[s, c])
                a_q += g_q[t, s] * f
                if cutlass.const_expr(DIAG):
                    a_k += g_k[t, s] * f
                elif s < t:
                    a_k += g_k[t, s] * f
            return a_q, a_k

        def col_pairs(t, c, end):
            """Element (t, c)'s pairs within its block for x_c, r from t to the block's end:
            r >= t (dAkk r > t; in the unit dAqk r > t too)."""
            a_c = f32(0.0)
            for r in cutlass.range(t + (1 if DIAG else 0), end, unroll=1):
                wt = g_q[r, t] * g_qq[r, c].to(f32)
                if cutlass.const_expr(DIAG):
                    wt += g_k[r, t] * g_b[r] * g_kk[r, c].to(f32)
                elif r > t:
                    wt += g_k[r, t] * g_b[r] * g_kk[r, c].to(f32)
                a_c += wt * cute.arch.exp2(g_g[r, c] - g_g[t, c])
            return a_c

        def store(outs):
            for o, x in outs:
                frag(cute.local_tile(x, (BT, KH), (rt, ct))).store(o.load())

        if cutlass.const_expr(roles == 0):
            if cutlass.const_expr(within):
                slow(True, True, o_q, o_k, o_c)
            if cutlass.const_expr(unit):
                _tail(thr_c, shape, w, lane, chunk, half, red, xch, xbar, o_q, o_k, o_c, dAqk, q, k, beta, dq, dk, dg,
                      g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part, q_rstd, k_rstd,
                      (row0, nval, ok))
            else:
                store(((o_q, x_q), (o_k, x_kr), (o_c, x_c)))
        else:  # (``wg2``) this warpgroup's role, its registers its own, allocated here
            col = roles == 1
            accs, (o_q, o_k, o_c) = sums((2,) if col else (0, 1))
            if cutlass.const_expr(col or dakk_global):
                da_tiles((0,) if col else (1,))
            operands((2, 3) if col else (0, 1), sync=False)
            cute.arch.fence_view_async_shared()
            _roles_bar()
            stream([sp for sp in specs if (sp[0] == "c") == col], accs, o_q, o_k, o_c)
            slow(not col, col, o_q, o_k, o_c)
            # x_c from warpgroup 0 to warpgroup 1 (``unit``: through shared memory, to the tail)
            s_xc = cute.make_tensor(xc, cute.make_layout((BT, KH), stride=(KH, 1)))
            if cutlass.const_expr(col):
                if cutlass.const_expr(unit):
                    frag(s_xc).store(o_c.load())
                    _roles_bar()
                    if cutlass.const_expr(l2):  # (the two cluster barriers of warpgroup 1's B10)
                        cute.arch.cluster_wait()
                        cute.arch.cluster_arrive_relaxed()
                        cute.arch.cluster_wait()
                else:
                    store(((o_c, x_c),))
            else:
                if cutlass.const_expr(unit):
                    _roles_bar()
                    o_c.store(frag(s_xc).load())
                    _tail(thr_c, shape, w, lane, chunk, half, red, xch, xbar, o_q, o_k, o_c, dAqk, q, k, beta, dq, dk,
                          dg, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part, q_rstd, k_rstd)
                else:
                    store(((o_q, x_q), (o_k, x_kr)))

    @cute.jit
    def _tail(thr_c, shape, w, lane, chunk, half, red, xch, xbar, o_q, o_k, o_c, dAqk, q, k, beta, dq, dk, dg, g_raw,
              a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part, q_rstd, k_rstd, rows=None):
        """``unit``: the B7-B9 unit's tail on this CTA's (chunk, K half), from the three sums in
        registers (``l2``: with B10's l2norm backward of dq2 and dk2; ``rows``: the chunk's first row, its
        length and which of the thread's elements are in it, ``var``'s). A thread's element i = a + 2
        b + 4 n of the wgmma layout is row 16 w + lane // 4 + 8 b and channel 8 n + 2 (lane % 4) + a."""
        rt, ct, head = chunk // H, chunk % H * NS + half, chunk % H
        row0, nval, ok = rows if cutlass.const_expr(rows is not None) else (rt * BT, BT, None)
        frag = thr_c.partition_C
        tile = lambda t: frag(_tile(t, rt, row0, ct))  # noqa: E731
        tile_qk = lambda t: frag(_tile(t, rt, row0, chunk % H // G * NS + half))  # noqa: E731
        # (each warp's column sums [NB, KH] for B8, for dt_bias's, and its dA_log sum)
        s_tot = cute.make_tensor(red, cute.make_layout((NB, KH), stride=(KH, 1)))
        s_bias = cute.make_tensor(red + NB * KH, cute.make_layout((NB, KH), stride=(KH, 1)))
        s_da = cute.make_tensor(red + 2 * NB * KH, cute.make_layout(NB))
        lay = cute.make_layout((BT, KH), stride=(0, 1))
        n_el = cute.size(shape)
        a_q, a_kr, a_c = o_q.load(), o_k.load(), o_c.load()
        kf = _ld(tile_qk(k), ok).to(f32)
        a_krb = a_kr * _ld(frag(cute.make_tensor(beta.iterator + row0 * H + head,
                                                 cute.make_layout((BT, KH), stride=(H, 0)))), ok)
        qf = _ld(tile_qk(q), ok).to(f32)
        if cutlass.const_expr(DIAG):
            # dAqk's diagonal, each row's pair (r, r) at factor 1, out of the products (a bf16 split
            # carries ~2^-17 of a product): dq's and dk's terms added below in fp32. In dg's terms
            # (y), the pair's two, q_r dAqk[r, r] k_r and the same less, cancel exactly: left out.
            # (A thread has two rows: element i's is 16 w + lane // 4 + 8 b, b = i // 2 % 2.)
            dd = [f32(0.0), f32(0.0)]
            for b in cutlass.range_constexpr(2):
                r = w * BC + lane // 4 + 8 * b
                v = f32(0.0)
                if cutlass.const_expr(var):
                    if r < nval:
                        v = dAqk[row0 + r, head * BT + r]
                else:
                    v = dAqk[row0 + r, head * BT + r]
                dd[b] = v
        # (dg's and db's terms first, so that the three sums are dead before dq2 and dk2 are formed)
        y = regs(_ld(tile(dg), ok) + qf * a_q + kf * (a_krb - a_c))
        # db's part: each row's sum over this half's channels (the thread's 16, then its quad's)
        row_sums = quad_row_sums(a_kr * kf)
        dqv, dkv = _ld(tile(dq), ok) + a_q, _ld(tile(dk), ok) + a_krb + a_c
        if cutlass.const_expr(DIAG):
            dqr, dkr, kr, qr = regs(dqv), regs(dkv), regs(kf), regs(qf)
            for i in cutlass.range_constexpr(n_el):
                dqr[i] = dqr[i] + dd[i // 2 % 2] * kr[i]
                dkr[i] = dkr[i] + dd[i // 2 % 2] * qr[i]
            dqv, dkv = dqr.load(), dkr.load()
        if cutlass.const_expr(l2):
            _l2norm_bwd(frag, w, lane, half, row0, ok, head, xch, xbar, dqv, qf, dkv, kf, q_rstd, k_rstd, tile(dq2),
                        tile(dk2))
        else:
            _st(tile(dq2), dqv, ok)
            _st(tile(dk2), dkv, ok)
        if lane % 4 == 0:
            R = cute.size(q, mode=[0])
            for b in cutlass.range_constexpr(2):
                row = w * BC + lane // 4 + 8 * b
                if cutlass.const_expr(var):
                    if row < nval:
                        db_part[half * R * H + (row0 + row) * H + head] = row_sums[b]
                else:
                    db_part[half * R * H + (row0 + row) * H + head] = row_sums[b]
        # B8: each channel's dg summed from the chunk's last row up: within the warp's block (the
        # quad's lanes by row, then the block's second 8 rows into its first), then the later
        # blocks' totals through shared memory
        for d in cutlass.range_constexpr(3):
            for i in cutlass.range_constexpr(n_el):
                moved = cute.arch.shuffle_sync_down(y[i], 4 << d)
                if lane + (4 << d) < 32:
                    y[i] = y[i] + moved
        for i in cutlass.range_constexpr(n_el):
            if i // 2 % 2 == 0:  # (rows 8-15's sum, from the quad's first lane)
                y[i] = y[i] + cute.arch.shuffle_sync(y[i + 2], lane % 4)
        if lane < 4:
            for i in cutlass.range_constexpr(n_el):
                if i // 2 % 2 == 0:
                    s_tot[w, i // 4 * 8 + lane * 2 + i % 2] = y[i]
        _tail_bar()
        for v in cutlass.range_constexpr(1, NB):
            if w < v:
                y.store(y.load() + frag(cute.make_tensor(s_tot[v, None].iterator, lay)).load())
        # B9: the gate's backward from the raw gate
        dy = y.load()
        x = _ld(tile(g_raw), ok).to(f32)
        if cutlass.const_expr(has_bias):
            x = x + frag(cute.make_tensor(dt_bias.iterator + head * K + half * KH, lay)).load()
        A = cute.arch.exp2(a_log[head] * LOG2E)
        # (exp, log and the reciprocals in the hardware's approximate forms, as Triton's exp and log
        # are in the registered unit: the accurate library forms cost ~1,000 more instructions a
        # thread, in a kernel whose time follows its instruction count, docs/log/bwd-fused.md)
        if cutlass.const_expr(lower_bound is None):
            e = cute.math.exp(-x, fastmath=True)
            dx = dy * (-A * cute.math.rcp(1.0 + e, approx=True, ftz=True))
            big = x > 20.0
            sp = cute.where(big, x, cute.math.log(1.0 + cute.math.exp(cute.where(big, 20.0, x), fastmath=True),
                                                  fastmath=True))
            da = dy * (-A * sp)
        else:
            sg = cute.math.rcp(1.0 + cute.math.exp(x * (-A), fastmath=True), approx=True, ftz=True)
            dx = dy * (lower_bound * sg * (1.0 - sg)) * A
            da = dx * x
        dx_out = dx.to(raw)
        _st(tile(dg2), dx_out, ok)
        # dt_bias's partial per channel and dA_log's per (K half, chunk-head), in a fixed order:
        # the thread's rows, its column's lanes, then the warps
        cols = warp_col_sums(dx_out.to(f32))
        das = regs(da)
        total = f32(0.0)
        for i in cutlass.range_constexpr(n_el):
            total += das[i]
        for d in cutlass.range_constexpr(5):
            total += cute.arch.shuffle_sync_bfly(total, 1 << d)
        if lane < 4:
            for i in cutlass.range_constexpr(n_el):
                if i // 2 % 2 == 0:
                    s_bias[w, i // 4 * 8 + lane * 2 + i % 2] = cols[i]
        if lane == 0:
            s_da[w] = total
        _tail_bar()
        tidx = w * 32 + lane
        if tidx < KH:
            if cutlass.const_expr(has_bias):
                bias_sum = f32(0.0)
                for v in cutlass.range_constexpr(NB):
                    bias_sum += s_bias[v, tidx]
                dbias_part[chunk, half * KH + tidx] = bias_sum
        if tidx == 0:
            da_sum = f32(0.0)
            for v in cutlass.range_constexpr(NB):
                da_sum += s_da[v]
            dA_part[half * (cute.size(dA_part, mode=[0]) // NS) + chunk] = da_sum
        if cutlass.const_expr(XCH):  # (the peer has what this CTA sent before either leaves)
            cute.arch.cluster_wait()

    @cute.jit
    def _l2norm_bwd(frag, w, lane, half, row0, ok, head, xch, xbar, dqv, qf, dkv, kf, q_rstd, k_rstd, o_q, o_k):
        """B10 on this CTA's K half: dx = rstd (dy - (dy . y) y) for (dy, y) = (dq2, q) and (dk2, k),
        the dot products over both halves. Each half's row sums (the thread's 16 channels, then the
        quad's) go into ``xch[half]`` here and into the peer's by one bulk copy; each CTA then adds
        xch[0] + xch[1], the same sum in both. (``var``: the rstd and the outputs of the chunk's
        rows alone.)"""
        s_x = cute.make_tensor(xch, cute.make_layout(4 * BT))
        sums = (quad_row_sums(dqv * qf), quad_row_sums(dkv * kf))
        if lane % 4 == 0:
            for m in cutlass.range_constexpr(2):
                for b in cutlass.range_constexpr(2):
                    s_x[(half * 2 + m) * BT + w * BC + lane // 4 + 8 * b] = sums[m][b]
        cute.arch.fence_view_async_shared()
        _tail_bar()
        if cutlass.const_expr(XCH):
            cute.arch.cluster_wait()  # (the peer's barrier is armed)
            if w == 0:
                if lane == 0:
                    send = cute.make_copy_atom(cpasync.CopyBulkS2SOp(), f32, num_bits_per_copy=2 * BT * 32)
                    mine = cute.make_tensor(xch + half * 2 * BT, cute.make_layout(2 * BT))
                    cute.copy(send, mine, mine, mbar_ptr=xbar, cta_rank=cutlass.Int32(1 - half))
            cute.arch.mbarrier_wait(xbar, 0)
            cute.arch.cluster_arrive_relaxed()  # (the peer's bytes are here: its copy has read them)
        by_row = lambda m, h: frag(cute.make_tensor(xch + (h * 2 + m) * BT,  # noqa: E731
                                                    cute.make_layout((BT, KH), stride=(1, 0)))).load()
        whole = (lambda m: by_row(m, 0) + by_row(m, 1)) if cutlass.const_expr(XCH) else (  # noqa: E731
            lambda m: by_row(m, 0))  # (K = 64: the CTA's own sums are the row's)
        rstd = lambda t: _ld(frag(cute.make_tensor(t.iterator + row0 * H + head,  # noqa: E731
                                                   cute.make_layout((BT, KH), stride=(H, 0)))), ok)
        for m, dy, y, r, o in ((0, dqv, qf, rstd(q_rstd), o_q), (1, dkv, kf, rstd(k_rstd), o_k)):
            _st(o, (dy * r - whole(m) * y * r).to(o.element_type), ok)

    if body_only:
        return body

    @cute.jit
    def probe(dAqk: cute.Tensor, dAkk: cute.Tensor, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor,
              beta: cute.Tensor, x_q: cute.Tensor, x_kr: cute.Tensor, x_c: cute.Tensor, dq: cute.Tensor,
              dk: cute.Tensor, dg: cute.Tensor, g_raw: cute.Tensor, a_log: cute.Tensor, dt_bias: cute.Tensor,
              dq2: cute.Tensor, dk2: cute.Tensor, dg2: cute.Tensor, db_part: cute.Tensor, dA_part: cute.Tensor,
              dbias_part: cute.Tensor, q_rstd: cute.Tensor, k_rstd: cute.Tensor, chunk_rows: cute.Tensor,
              stream: cuda.CUstream):
        k_major, mn_major = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR
        mma, mma_z = (sm90.make_trivial_tiled_mma(bf16, bf16, k_major.sm90_mma_major_mode(),
                                                  mn_major.sm90_mma_major_mode(), f32, (1, 1, 1), tiler_mn=(BT, KH))
                      for _ in range(2))
        mma_t, mma_tz = (sm90.make_trivial_tiled_mma(bf16, bf16, mn_major.sm90_mma_major_mode(),
                                                     mn_major.sm90_mma_major_mode(), f32, (1, 1, 1),
                                                     tiler_mn=(BT, KH)) for _ in range(2))
        a_l = sm90.make_smem_layout_a(k_major, (BT, KH, BT), bf16, 1)  # dA: (M = r, K = s)
        at_l = sm90.make_smem_layout_a(mn_major, (BT, KH, BT), bf16, 1)  # the same bytes as (M = s, K = r)
        b_l = sm90.make_smem_layout_b(mn_major, (BT, KH, BT), bf16, 1)  # (N = c, K = row), N contiguous
        nch = (cute.size(chunk_rows, mode=[0]) if cutlass.const_expr(var) else cute.size(k, mode=[0]) // BT) * H
        kernel(dAqk, dAkk, q, k, g, beta, x_q, x_kr, x_c, dq, dk, dg, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part,
               dA_part, dbias_part, q_rstd, k_rstd, chunk_rows, mma, mma_z, mma_t, mma_tz, a_l, at_l, b_l).launch(
            grid=(NS, nch, 1), block=(384 if ws else 256 if wg2 else 128, 1, 1),
            cluster=(2, 1, 1) if XCH else (1, 1, 1), min_blocks_per_mp=1 if ws else 0, stream=stream)

    return probe


ARGS = ("dAqk", "dAkk", "q", "k", "g", "beta", "x_q", "x_kr", "x_c", "dq", "dk", "dg", "g_raw", "A_log", "dt_bias",
        "dq2", "dk2", "dg2", "db_part", "dA_part", "dbias_part", "q_rstd", "k_rstd",
        "chunk_rows")  # the probe's tensors, in its order (chunk_rows: ``var``'s [chunks, 2] int32, else a placeholder)


def make_tensors(nch: int, K: int, device: str, seed: int = 0, strength: float = 0.3, ns: int = 2,
                 bench_gate: bool = False) -> dict:
    """dAqk (lower, with its diagonal), dAkk (strictly lower), q and k, g (the chunk cumsum of
    a log2 decay of 0-``strength`` a token and channel: at 0.3 strong enough that the blocks'
    anchors matter, at 10 past the guard for a sixth of the elements), beta; and the outputs,
    NaN (db's and dA_log's partials for ``ns`` K slices). ``bench_gate``: g drawn as the op
    bench's gate makes it (``kernel_fun.kda.problems.make_inputs``: A in 1-16 a chunk-head,
    Kimi's dt_bias a channel, softplus of a normal draw plus it, in log2 units), where a few
    elements of the strongest heads are past the guard."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.arange(BT, device=device)
    lower = rows[:, None] >= rows[None, :]
    dAqk = torch.randn(nch, BT, BT, generator=gen, device=device) * lower
    dAkk = torch.randn(nch, BT, BT, generator=gen, device=device) * (rows[:, None] > rows[None, :])
    q, k = ((torch.randn(nch * BT, K, generator=gen, device=device) * K ** -0.5).bfloat16() for _ in range(2))
    g = -(torch.rand(nch, BT, K, generator=gen, device=device) * strength).cumsum(1)
    if bench_gate:
        import math

        A = torch.empty(nch, 1, 1, device=device).uniform_(1, 16, generator=gen)
        dt = torch.exp(torch.empty(K, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        bias = dt + torch.log(-torch.expm1(-dt))
        x = torch.randn(nch, BT, K, generator=gen, device=device)
        g = -(A * torch.nn.functional.softplus(x + bias) * 1.4426950408889634).cumsum(1)
    beta = torch.rand(nch * BT, generator=gen, device=device)
    out = {n: torch.full((nch * BT, K), float("nan"), device=device) for n in ("x_q", "x_kr", "x_c", "dq2", "dk2")}
    # (unit) the incoming dq, dk, dg; the raw gate (bf16) and its parameters; the tail's outputs
    grad = {n: torch.randn(nch * BT, K, generator=gen, device=device) * 0.1 for n in ("dq", "dk", "dg")}
    gate = {"g_raw": (torch.randn(nch * BT, K, generator=gen, device=device) * 2).bfloat16(),
            "A_log": torch.randn(1, generator=gen, device=device) * 0.5,
            "dt_bias": torch.randn(K, generator=gen, device=device) * 0.5}
    parts = {"dg2": torch.full((nch * BT, K), float("nan"), device=device).bfloat16(),
             "db_part": torch.full((ns * nch * BT,), float("nan"), device=device),
             "dA_part": torch.full((ns * nch,), float("nan"), device=device),
             "dbias_part": torch.full((nch, K), float("nan"), device=device)}
    # (l2) the rows' reciprocal norms, drawn last so that the rest is as without them
    rstd = {n: torch.rand(nch * BT, generator=gen, device=device) * 1.5 + 0.5 for n in ("q_rstd", "k_rstd")}
    return {"dAqk": dAqk.view(nch * BT, BT), "dAkk": dAkk.view(nch * BT, BT), "q": q, "k": k,
            "g": g.view(nch * BT, K), "beta": beta, **out, **grad, **gate, **parts, **rstd,
            "chunk_rows": torch.zeros(1, 2, dtype=torch.int32, device=device)}


def slow_share(g) -> float:
    """The share of (row, channel) elements whose span from their block's first row, g[u] - g,
    is past GUARD (or NaN): the kernel takes their pairs within the block one by one."""
    n, K = g.shape[0] // BT, g.shape[1]
    gb = g.float().view(n, NB, BC, K)
    return 1.0 - ((gb[:, :, :1] - gb) <= GUARD).float().mean().item()


def want(dAqk, dAkk, q, k, g, beta, within: bool = True) -> tuple:
    """x_q, x_kr and x_c in float64 from their definitions, with the factor exp2(g_r - g_s), over
    the pairs (r, s) with s before r's block (and, ``within``, the pairs within a block): x_q[r]
    = sum_{s <= r} dAqk[r, s] k_s, x_kr[r] = sum_{s < r} dAkk[r, s] k_s (dk's row part, beta_r
    not applied), x_c[s] = sum_{r >= s} dAqk[r, s] q_r + sum_{r > s} dAkk[r, s] beta_r k_r (dk's
    column part). With ``within`` these are B7's whole sums."""
    import torch

    n, K = k.shape[0] // BT, k.shape[1]
    rows = torch.arange(BT, device=k.device)
    across = rows[None, :] < (rows[:, None] // BC * BC)  # [r, s]: s before r's block
    pairs_q = (rows[None, :] <= rows[:, None]) if within else across
    pairs_k = (rows[None, :] < rows[:, None]) if within else across
    qq, kk, gg = q.double().view(n, BT, K), k.double().view(n, BT, K), g.double().view(n, BT, K)
    bk = beta.double().view(n, BT, 1) * kk
    f = torch.exp2(torch.where((rows[None, :] <= rows[:, None])[None, :, :, None],
                               gg[:, :, None, :] - gg[:, None, :, :], float("-inf")))  # [n, r, s, c]
    dq_, dk_ = dAqk.double().view(n, BT, BT) * pairs_q, dAkk.double().view(n, BT, BT) * pairs_k
    x_q, x_kr = (torch.einsum("nrs,nrsc,nsc->nrc", d, f, kk) for d in (dq_, dk_))
    x_c = torch.einsum("nrs,nrsc,nrc->nsc", dq_, f, qq) + torch.einsum("nrs,nrsc,nrc->nsc", dk_, f, bk)
    return tuple(x.reshape(n * BT, K) for x in (x_q, x_kr, x_c))


def twin(dAqk, dAkk, q, k, g, beta, split: bool = True, within: bool = True, diag: bool = True) -> tuple:
    """The kernel's arithmetic in torch (fp32, its bf16 roundings). Row role, per block j < 3:
    kx_j and dA's columns split (or rounded), the products, the rows after block j scaled
    through their anchors; then each row's own factor. Column role, per block i > 0: yq_i, yk_i
    and dA's rows split, the products with dA^T, the columns before block i scaled; then each
    column's own factor. ``within``: then the pairs within a block, through each block's first
    row u: an element (row, channel) whose span g[u] - g is within GUARD from the block-diagonal
    products, one past it pair by pair in fp32. ``diag`` off: without dAqk's diagonal (the pairs
    (r, r), which the unit's tail adds). The GPU check holds the kernel to it and to ``want``;
    the CPU tests hold it to ``want`` and ``want`` to the package's reference B7."""
    import torch

    n, K = k.shape[0] // BT, k.shape[1]
    qq, kk, gg = q.float().view(n, BT, K), k.float().view(n, BT, K), g.float().view(n, BT, K)
    bb = beta.float().view(n, BT, 1)
    rows = torch.arange(BT, device=k.device)
    g_a = gg[:, rows // BC * BC]  # each row's block's first row
    g_n = gg[:, torch.clamp(rows // BC * BC + BC, max=BT - 1)]  # the next block's first row (last block: unused)

    def parts(x):
        hi = x.bfloat16().float()
        return hi, (x - hi).bfloat16().float()

    def product(a, b):
        (a_hi, a_lo), (b_hi, b_lo) = parts(a), parts(b)
        return a_hi @ b_hi + ((a_hi @ b_lo + a_lo @ b_hi) if split else 0)

    lower = (rows[None, :] <= rows[:, None]) if diag else (rows[None, :] < rows[:, None])
    d_q = dAqk.float().view(n, BT, BT) * lower
    d_k = dAkk.float().view(n, BT, BT) * (rows[None, :] < rows[:, None])
    out = []
    for d in (d_q, d_k):
        acc = torch.zeros(n, BT, K, device=k.device)
        for j in range(NB - 1):
            blk, nj = slice(j * BC, (j + 1) * BC), (j + 1) * BC
            prod = product(d[:, :, blk], kk[:, blk] * torch.exp2(gg[:, nj:nj + 1] - gg[:, blk]))
            acc = acc + torch.where((rows >= nj)[None, :, None], torch.exp2(g_a - gg[:, nj:nj + 1]), 0.0) * prod
        out.append(acc * torch.exp2(gg - g_a))
    acc = torch.zeros(n, BT, K, device=k.device)
    for i in range(1, NB):
        blk, ai = slice(i * BC, (i + 1) * BC), i * BC
        down = torch.exp2(gg[:, blk] - gg[:, ai:ai + 1])
        prod = (product(d_q[:, blk].transpose(1, 2), qq[:, blk] * down)
                + product(d_k[:, blk].transpose(1, 2), bb[:, blk] * kk[:, blk] * down))
        acc = acc + torch.where((rows < ai)[None, :, None], torch.exp2(gg[:, ai:ai + 1] - g_n), 0.0) * prod
    out.append(torch.where((rows < BT - BC)[None, :, None], acc * torch.exp2(g_n - gg), 0.0))
    if within:
        same = (rows[:, None] // BC) == (rows[None, :] // BC)
        span = gg[:, rows // BC * BC] - gg  # g[u] - g, u each row's block's first row
        fast_row = span <= GUARD  # (NaN: not)
        kxu = torch.where(fast_row, kk * torch.exp2(torch.where(fast_row, span, 0.0)), 0.0)
        down = torch.exp2(-span)  # (at most 1)
        w_q, w_k = d_q * same, d_k * same
        fast = [product(w_q, kxu) * down, product(w_k, kxu) * down,
                (product(w_q.transpose(1, 2), qq * down) + product(w_k.transpose(1, 2), bb * kk * down))
                * torch.exp2(torch.where(fast_row, span, 0.0))]
        f = torch.exp2(torch.where((same & (rows[None, :] <= rows[:, None]))[None, :, :, None],
                                   gg[:, :, None, :] - gg[:, None, :, :], float("-inf")))  # [n, r, s, c]
        slow = [torch.einsum("nrs,nrsc,nsc->nrc", w_q, f, kk), torch.einsum("nrs,nrsc,nsc->nrc", w_k, f, kk),
                torch.einsum("nrs,nrsc,nrc->nsc", w_q, f, qq) + torch.einsum("nrs,nrsc,nrc->nsc", w_k, f, bb * kk)]
        out = [o + torch.where(fast_row, a, b) for o, a, b in zip(out, fast, slow)]
    return tuple(x.reshape(n * BT, K) for x in out)


def twin_unit(t: dict, split: bool = True, lower_bound: float | None = None, has_bias: bool = True,
              l2: bool = False) -> tuple:
    """The ``unit`` build's arithmetic in torch on ``make_tensors``'s tensors (H = 1): the
    twin's sums without dAqk's diagonal, then the kernel's tail as written there (the diagonal's
    pairs added to dq2 and dk2 in fp32, and left out of dg's sum, where they cancel), for the
    gate form the build takes (softplus, or with ``lower_bound`` the sigmoid form; ``has_bias``: dt_bias added). Returns
    (dq2, dk2, db, dg2, dA_log, ddt_bias) with db, dA_log and ddt_bias summed over the K
    halves' and chunk-heads' partials as a caller of the kernel adds them (ddt_bias None
    without dt_bias). ``l2``: dq2 and dk2 through B10's l2norm backward, in bf16, as that build
    writes them. (The kernel's B9 takes exp, log and the reciprocals in the hardware's
    approximate forms, the twin torch's: a few units in the last place of fp32 apart, before
    dg2's bf16 rounding.)"""
    import torch

    a_q, a_kr, a_c = twin(*[t[n] for n in ("dAqk", "dAkk", "q", "k", "g", "beta")], split=split, diag=False)
    n, K = t["k"].shape[0] // BT, t["k"].shape[1]
    qf, kf, bt = t["q"].float(), t["k"].float(), t["beta"].float()[:, None]
    a_krb = a_kr * bt
    dd = t["dAqk"].float().view(n, BT, BT).diagonal(dim1=1, dim2=2).reshape(n * BT, 1)  # (the pairs (r, r))
    dq2, dk2 = t["dq"] + a_q + dd * kf, t["dk"] + a_krb + a_c + dd * qf
    db = (a_kr * kf).sum(1)
    if l2:  # B10: dx = rstd (dy - (dy . y) y) over the whole row, in bf16
        dq2, dk2 = ((dy * r[:, None] - (dy * y).sum(1, keepdim=True) * y * r[:, None]).bfloat16()
                    for dy, y, r in ((dq2, qf, t["q_rstd"]), (dk2, kf, t["k_rstd"])))
    dy = (t["dg"] + qf * a_q + kf * (a_krb - a_c)).view(n, BT, K).flip(1).cumsum(1).flip(1).reshape(n * BT, K)
    x = t["g_raw"].float() + (t["dt_bias"].float()[None, :] if has_bias else 0.0)
    A = torch.exp(t["A_log"].float())
    if lower_bound is None:
        dx = dy * (-A / (1.0 + torch.exp(-x)))
        sp = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(torch.where(x > 20.0, 20.0, x))))
        da = dy * (-A * sp)
    else:
        sg = 1.0 / (1.0 + torch.exp(x * -A))
        dx = dy * (lower_bound * sg * (1.0 - sg)) * A
        da = dx * x
    dg2 = dx.to(t["g_raw"].dtype)
    return dq2, dk2, db, dg2, da.sum().view(1), (dg2.float().sum(0) if has_bias else None)


def l2norm_bwd_exact(y, rstd, dy):
    """B10 in float64 (y the normalized rows, rstd by row): dx = rstd (dy - (dy . y) y)."""
    y, r, dy = y.double(), rstd.double()[..., None], dy.double()
    return dy * r - (dy * y).sum(-1, keepdim=True) * y * r


_COMPILED: dict = {}


def supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
             cu_seqlens, chunk_indices):
    """None when ``intra_bwd`` (the unit build as the op's B7-B9) takes the call, else why not:
    an sm_90 GPU with CuTe DSL, the gate in the op, chunks of 64 (packed sequences and T not a
    multiple of 64 through the ``var`` build), K=64 (one CTA a chunk-head) or 128, value heads a
    multiple of the q/k heads (GVA), dense tensors."""
    import torch

    from research.cute_kit import cute_unavailable

    B, T, H, K = k.shape
    why = cute_unavailable(k)
    if why:
        return why
    if A_log is None:
        return "a pre-computed gate (the probe's unit ends with the gate's backward)"
    if chunk_size != BT:
        return f"chunk_size={chunk_size} (the probe's chunks are {BT})"
    if cu_seqlens is not None and chunk_indices is None:
        return "packed sequences without their chunk_indices"
    if K not in (KH, 2 * KH) or gc.shape[2] % H:
        return f"K={K}, H={H}, HV={gc.shape[2]} (the probe: K=64 or 128, HV a multiple of H)"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or g.dtype not in (torch.bfloat16, torch.float32):
        return "the probe takes bf16 q and k and a bf16 or fp32 raw gate"
    if not all(x.is_contiguous() for x in (q, k, gc, dAqk, dAkk, dq, dk, dg, g)):
        return "the probe views its tensors as dense [B * T, H * C]"
    return None


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
              cu_seqlens, chunk_indices):
    """B7-B9 with the stage registry's contract ((dq, dk, db, dg, dA_log, ddt_bias)) from the
    unit build, compiled once a shape and gate form: a candidate for ``python -m
    benchmarks.op --candidate B7-B9=research.b7_cute_probe:intra_bwd:supports``. The three sums
    stay in the kernel's registers; db's, dA_log's and dt_bias's partials are added here, in a
    fixed order."""
    why = supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                   cu_seqlens, chunk_indices)
    if why:
        raise ValueError(why)
    return _run_unit(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, g, A_log, dt_bias, lower_bound,
                     cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


def supports_l2(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                cu_seqlens, chunk_indices, q_rstd, k_rstd):
    """None when ``intra_bwd_l2`` (the ``l2`` unit build as the op's B7-B10) takes the call: as
    ``supports``, with the rows' rstd of q and k given."""
    if q_rstd is None or k_rstd is None:
        return "the l2norm is not in the op"
    if gc.shape[2] != k.shape[2]:
        return f"H={k.shape[2]}, HV={gc.shape[2]} (B10 in the unit needs H = HV: GVA's group sum comes first)"
    return supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                    cu_seqlens, chunk_indices)


def intra_bwd_l2(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                 cu_seqlens, chunk_indices, q_rstd, k_rstd):
    """B7-B10 with the stage registry's contract from the ``l2`` unit build (B10's dq and dk in
    q's and k's dtype): a candidate for ``python -m benchmarks.op --candidate
    B7-B10=research.b7_cute_probe:intra_bwd_l2:supports_l2``."""
    why = supports_l2(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound,
                      chunk_size, cu_seqlens, chunk_indices, q_rstd, k_rstd)
    if why:
        raise ValueError(why)
    return _run_unit(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, g, A_log, dt_bias, lower_bound, q_rstd, k_rstd,
                     cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)




def _run_unit(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, g, A_log, dt_bias, lower_bound, q_rstd=None, k_rstd=None,
              cu_seqlens=None, chunk_indices=None):
    """The unit build (``l2`` with q_rstd and k_rstd) on the op's tensors, compiled once a
    shape and gate form, and its outputs as the registry's. (The rows, B * T, as a run-time
    extent would make one build serve every B * T, for 184 more SASS instructions, 1.4%, not
    measured: ``compile_offline(dyn=True)``. As measured, a new B * T compiles again, ~9 s.)
    Packed sequences, or T not a multiple of 64, take the ``var`` build, its rows and chunks
    run-time extents: one build for every batch of them."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch

    B, T, Hq, K = k.shape
    H, dev = gc.shape[2], k.device  # (value heads: Hq of them for q and k, GVA's G = H / Hq)
    l2 = q_rstd is not None
    var = cu_seqlens is not None or T % BT != 0
    tensors = unit_views(q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd, k_rstd, cu_seqlens,
                         chunk_indices)
    args = dlpack_args(tensors, rows_dynamic=var, l2=l2, whole=not var)
    args.append(cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream))
    raw = "bf16" if g.dtype == torch.bfloat16 else "fp32"
    key = (None if var else B * T, H, Hq, K, raw, dt_bias is not None, lower_bound, l2, var, dev.index)
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(build(K, True, True, True, raw, dt_bias is not None,
                                            None if lower_bound is None else float(lower_bound), H, l2, stm=True,
                                            G=H // Hq, var=var),
                                     *args)
    _COMPILED[key](*args)
    return unit_outputs(tensors, db, A_log, dt_bias)


# the tensors whose first extent follows the rows (B * T): a run-time extent in ``dlpack_args``
ROW_ARGS = ("dAqk", "dAkk", "q", "k", "g", "beta", "dq", "dk", "dg", "g_raw", "dq2", "dk2", "dg2", "db_part",
            "dA_part", "dbias_part")


def dlpack_args(tensors: dict, rows_dynamic: bool = False, l2: bool = False, whole: bool = True) -> list:
    """``tensors`` (``ARGS``) as CuTe tensors; ``rows_dynamic``: with the first extent of those
    that follow the rows (and, ``l2``, the rows' rstd; and the chunks' map) a run-time value, so
    that one compiled build serves any B * T (the strides, the heads and channels stay
    compile-time); ``whole``: the rows in whole chunks, every such extent but the chunk-heads'
    partials a multiple of 64."""
    from cutlass.cute.runtime import from_dlpack

    dynamic = set(ROW_ARGS) | {"chunk_rows"} | ({"q_rstd", "k_rstd"} if l2 else set()) if rows_dynamic else set()
    return [from_dlpack(tensors[n], assumed_align=16).mark_compact_shape_dynamic(
        mode=0, divisibility=BT if whole and n not in ("dA_part", "dbias_part", "chunk_rows") else 1) if n in dynamic
        else from_dlpack(tensors[n], assumed_align=16) for n in ARGS]


def unit_outputs(tensors: dict, db, A_log, dt_bias) -> tuple:
    """The registry's (dq, dk, db, dg, dA_log, ddt_bias) from the unit build's outputs in
    ``unit_views``'s tensors: db the input plus the K slices' parts, dA_log the sum of the
    (K half, chunk-head) partials by head, dt_bias's the sum of the chunk-heads' by channel."""
    B, T, H = db.shape
    K = tensors["g"].shape[1] // H
    NS = K // KH  # (the CTAs a chunk-head, each with its partials)
    shape = (B, T, H, K)
    db2 = db.float() + tensors["db_part"].view(NS, B, T, H).sum(0)
    dA_log = tensors["dA_part"].view(NS, -1, H).sum((0, 1)).view_as(A_log).to(A_log.dtype)
    ddt_bias = (tensors["dbias_part"].view(-1, H * K).sum(0).view_as(dt_bias).to(dt_bias.dtype)
                if dt_bias is not None else None)
    return tensors["dq2"].view(shape), tensors["dk2"].view(shape), db2, tensors["dg2"].view(shape), dA_log, ddt_bias


def unit_views(q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd=None, k_rstd=None,
               cu_seqlens=None, chunk_indices=None) -> dict:
    """The unit build's tensors (``ARGS``) for the op's: [B, T, H, C] as [B * T, H * C] (fp32
    where the kernel reads fp32), beta [B * T * H], A_log [H], dt_bias [H * K] (zeros without
    one), and its outputs allocated (the sums' three a placeholder: the unit keeps them in registers).
    With q_rstd and k_rstd ([B, T, H], the ``l2`` build's): dq2 and dk2 in q's and k's dtype.
    With packed sequences (``cu_seqlens``, ``chunk_indices`` its (sequence, chunk) pairs) or T
    not a multiple of 64, the ``var`` build's chunk_rows: each chunk's first row and length."""
    import torch

    q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd, k_rstd = (  # (views for dlpack: no autograd)
        None if x is None else x.detach()
        for x in (q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd, k_rstd))
    B, T, _, K = k.shape
    H = gc.shape[2]  # (the value heads; q and k may have fewer, GVA)
    R, dev, NS = B * T, k.device, K // KH  # (NS: the CTAs a chunk-head, K's halves, or one at K = 64)
    rows = chunk_rows(B, T, cu_seqlens, chunk_indices, dev)
    nch = (R // BT if rows is None else rows.shape[0]) * H
    flat = lambda x: x.reshape(R, -1)  # noqa: E731
    new = lambda dtype=torch.float32: torch.empty(R, H * K, device=dev, dtype=dtype)  # noqa: E731
    unused = torch.empty(BT, H * K, device=dev)  # (the sums' outputs: the unit keeps them in registers)
    return dict(dAqk=flat(dAqk.float()), dAkk=flat(dAkk.float()), q=flat(q), k=flat(k), g=flat(gc.float()),
                beta=beta.float().contiguous().view(-1), x_q=unused, x_kr=unused, x_c=unused, dq=flat(dq.float()),
                dk=flat(dk.float()), dg=flat(dg.float()), g_raw=flat(g), A_log=A_log.float().contiguous().view(-1),
                dt_bias=(dt_bias.float().contiguous().view(-1) if dt_bias is not None
                         else torch.zeros(H * K, device=dev)),
                dq2=new(q.dtype if q_rstd is not None else torch.float32),
                dk2=new(k.dtype if k_rstd is not None else torch.float32), dg2=new(g.dtype),
                db_part=torch.empty(NS * R * H, device=dev), dA_part=torch.empty(NS * nch, device=dev),
                dbias_part=torch.empty(nch, K, device=dev),
                **{n: (x.float().contiguous().view(-1) if x is not None else torch.zeros(BT, device=dev))
                   for n, x in (("q_rstd", q_rstd), ("k_rstd", k_rstd))},
                chunk_rows=rows if rows is not None else torch.zeros(1, 2, dtype=torch.int32, device=dev))


def chunk_rows(B: int, T: int, cu_seqlens=None, chunk_indices=None, device="cpu"):
    """[chunks, 2] int32, each chunk's first row in [B * T] and its length (at most 64): the
    ``var`` build's map, for packed sequences (``chunk_indices``' (sequence, chunk) pairs over
    ``cu_seqlens``) or B sequences of T tokens with T not a multiple of 64; None where every
    chunk is whole and in order (the dense build's rows)."""
    import torch

    if cu_seqlens is None:
        if T % BT == 0:
            return None
        starts = torch.arange(B, device=device)[:, None] * T + torch.arange(0, T, BT, device=device)[None, :]
        ends = (torch.arange(B, device=device)[:, None] + 1) * T
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seq, i = chunk_indices.to(device=device, dtype=torch.int64).unbind(-1)
        starts, ends = cu[seq] + i * BT, cu[seq + 1]
    return torch.stack([starts.reshape(-1), (ends - starts).clamp(max=BT).reshape(-1)], -1).to(torch.int32).contiguous()


def compile_offline(nch: int = 4, K: int = 128, split: bool = True, within: bool = True, unit: bool = False,
                    dump: str | None = None, H: int = 1, has_bias: bool = True, lower_bound: float | None = None,
                    l2: bool = False, phased: bool = False, wg2: bool = False, ws: bool = False, stm: bool = False,
                    dyn: bool = False, G: int = 1, var: bool = False):
    """Trace and compile for sm_90a with no GPU: the PTX and cubin land in ``dump`` (``dyn``: the
    rows a run-time extent, one build for any B * T; ``var``: the op's layout with T 20 short of
    whole chunks, its rows and chunks run-time extents)."""
    if dump:
        os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=dump)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    if H == 1:
        t = make_tensors(nch, K, "cpu", ns=K // KH)
        if l2:
            t.update(dq2=t["dq2"].bfloat16(), dk2=t["dk2"].bfloat16())
    else:  # the op's layout at H heads: one sequence of nch chunks
        import torch

        T = nch * BT - (20 if var else 0)
        op = lambda *shape, dtype=torch.float32: torch.zeros(1, T, *shape, dtype=dtype)  # noqa: E731
        t = unit_views(op(H // G, K, dtype=torch.bfloat16), op(H // G, K, dtype=torch.bfloat16), op(H, K), op(H),
                       op(H, BT), op(H, BT), op(H, K), op(H, K), op(H, K), op(H, K, dtype=torch.bfloat16),
                       torch.zeros(H), torch.zeros(H * K), *((op(H), op(H)) if l2 else ()))
    return cute.compile(build(K, split, within, unit, "bf16", has_bias, lower_bound, H, l2, phased, wg2, ws, stm=stm,
                              G=G, var=var),
                        *dlpack_args(t, rows_dynamic=dyn or var, l2=l2, whole=not var), cuda.CUstream(0))


def sm90_row(dump: str, split: bool, within: bool, unit: bool = False, **form) -> dict:
    """Registers, spills and ptxas's notes (research.cute_kit.ptxas_report), and the wgmma,
    shared-to-shared cluster copy and cluster barrier counts of the PTX (``form``: the build's
    other arguments, recorded as they are)."""
    from research.cute_kit import ptxas_report

    report = ptxas_report(dump)
    ptx = report["ptx"]
    return {"kind": "compile_sm90", "kernel": "b7_cute_probe", "split": split, "within": within, "unit": unit,
            **form, "threads": 384 if form.get("ws") else 256 if form.get("wg2") else 128, **{n: v for n, v in report.items() if n != "ptx"},
            "wgmma": ptx.count("wgmma.mma_async"), "cluster_copies": ptx.count("cp.async.bulk.shared::cluster"),
            "cluster_barriers": ptx.count("barrier.cluster")}


def gpu_run(nch: int = 32768, K: int = 128, split: bool = True, within: bool = True, unit: bool = False,
            reps: int = 20, strength: float = 0.3, lower_bound: float | None = None, has_bias: bool = True,
            l2: bool = False, phased: bool = False, wg2: bool = False, ws: bool = False, stm: bool = False,
            bench_gate: bool = False, dyn: bool = False) -> dict:
    """On a GPU: x_q, x_kr and x_c against float64 and against the twin on 64 chunk-heads
    spread over all (with ``unit``, which keeps them in registers, the twin's alone); with
    ``unit``, the unit's six outputs against the registered Triton B7-B9
    (``b7_b9_intra_bwd.intra_bwd``) on the same tensors (the chunk-heads as one sequence of
    one head) and its per-token ones against float64 (``reference.intra_bwd_tail``) on the 64;
    then the CUDA-event time at ``nch`` chunk-heads against the bytes it moves, the registered
    unit's beside it; then the kernel's causality to the bit. ``l2``: the unit with B10, held to
    the registered unit followed by the op's B10 (fla's l2norm backward), timed against both.
    ``dyn``: the rows a run-time extent (one build for any B * T, as a shipped build would take
    dense tensors)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    ns = K // KH
    t = make_tensors(nch, K, "cuda", strength=strength, ns=ns, bench_gate=bench_gate)
    if l2:  # (B10 writes q's and k's dtype)
        t.update(dq2=t["dq2"].bfloat16(), dk2=t["dk2"].bfloat16())
    args = (dlpack_args(t, rows_dynamic=True, l2=l2) if dyn else
            [from_dlpack(t[n], assumed_align=16) for n in ARGS])
    args.append(cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    if not has_bias:  # (the build without dt_bias never reads it: zeros, as ``unit_views`` passes)
        t["dt_bias"].zero_()
    run = cute.compile(build(K, split, within, unit, "bf16", has_bias, lower_bound, l2=l2, phased=phased, wg2=wg2,
                             ws=ws, stm=stm),
                       *args)
    run(*args)
    torch.cuda.synchronize()
    sel = torch.linspace(0, nch - 1, min(nch, 64), device="cuda").round().long()
    pick = lambda x: x.view(nch, BT, -1)[sel].reshape(len(sel) * BT, -1).squeeze(-1)  # noqa: E731
    ins = [pick(t[n]) for n in ("dAqk", "dAkk", "q", "k", "g", "beta")]
    wants, twins = want(*ins, within=within), twin(*ins, split=split, within=within)

    def rel(got, w):
        return ((got.double() - w.double()).square().mean() / w.double().square().mean()).sqrt().item()

    errors = {}
    for name, w, tw in zip(("x_q", "x_kr", "x_c"), wants, twins):
        errors[f"twin_{name}"] = rel(tw, w)
        if not unit:  # (the unit keeps its sums in registers: its outputs are checked below)
            got = pick(t[name])
            errors.update({name: rel(got, w), f"{name}_vs_twin": rel(got, tw)})
    import statistics

    from kernel_fun.bench.timing import cuda_times

    timed = lambda fn: statistics.median(cuda_times(fn, reps))  # noqa: E731
    registered = {}
    if unit:
        from kernel_fun.kda import reference as ref
        from kernel_fun.kda.kernels import b7_b9_intra_bwd

        tok = lambda x: x.view(1, -1, 1, *x.shape[1:])  # noqa: E731
        db0 = torch.zeros(1, nch * BT, 1, device="cuda")
        bias = t["dt_bias"] if has_bias else None
        reg_args = dict(q=tok(t["q"]), k=tok(t["k"]), gc=tok(t["g"]), beta=tok(t["beta"]), dAqk=tok(t["dAqk"]),
                        dAkk=tok(t["dAkk"]), dq=tok(t["dq"]), dk=tok(t["dk"]), db=db0, dg=tok(t["dg"]),
                        safe_gate=False, g=tok(t["g_raw"]), A_log=t["A_log"], dt_bias=bias, lower_bound=lower_bound,
                        chunk_size=BT, cu_seqlens=None, chunk_indices=None)
        theirs = b7_b9_intra_bwd.intra_bwd(**reg_args)
        if l2:
            from kernel_fun.kda.stages import stages

            b10 = stages()["B10"].impls["fla"]
            rstd = (tok(t["q_rstd"]), tok(t["k_rstd"]))
            theirs = (*b10(reg_args["q"], rstd[0], theirs[0], reg_args["k"], rstd[1], theirs[1]), *theirs[2:])
        ours = (t["dq2"], t["dk2"], t["db_part"].view(ns, -1).sum(0), t["dg2"], t["dA_part"].sum().view(1),
                t["dbias_part"].sum(0))
        names = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")
        registered = {"vs_registered": {n: rel(a.reshape(-1).float(), b.reshape(-1).float())
                                        for n, a, b in zip(names, ours, theirs) if b is not None}}
        picked = {n: tok(pick(t[n])) for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "dg", "g_raw")}
        exact = ref.intra_bwd_tail(picked["q"], picked["k"], picked["g"], picked["beta"], picked["dAqk"],
                                   picked["dAkk"], picked["dq"], picked["dk"], torch.zeros_like(picked["beta"]),
                                   picked["dg"], BT, g=picked["g_raw"], A_log=t["A_log"], dt_bias=bias,
                                   lower_bound=lower_bound, exact=True)
        if l2:
            exact = (l2norm_bwd_exact(picked["q"], tok(pick(t["q_rstd"])), exact[0]),
                     l2norm_bwd_exact(picked["k"], tok(pick(t["k_rstd"])), exact[1]), *exact[2:])
        got = (pick(t["dq2"]), pick(t["dk2"]), pick(t["db_part"].view(ns, -1).sum(0)), pick(t["dg2"]))
        registered["vs_exact"] = {n: rel(a.reshape(-1).float(), w.reshape(-1)) for n, a, w in zip(names, got, exact)}
        registered["registered_ms"] = timed(lambda: b7_b9_intra_bwd.intra_bwd(**reg_args))
        if l2:
            def registered_l2():
                out = b7_b9_intra_bwd.intra_bwd(**reg_args)
                return b10(reg_args["q"], rstd[0], out[0], reg_args["k"], rstd[1], out[1])

            registered["registered_with_b10_ms"] = timed(registered_l2)
        del theirs
    ms = timed(lambda: run(*args))
    outs = ("dq2", "dk2") if unit else ("x_q", "x_kr", "x_c")  # (per row and causal: dg2 is B8's reverse cumsum)
    finite = all(bool(torch.isfinite(t[n]).all()) for n in outs + (("dg2",) if unit else ()))
    share = slow_share(t["g"])
    # causal to the bit: with dA's rows after row 37 of every chunk zero (the call cut there), the
    # rows up to 37 the same bits when the gates (stronger decay), q, k and beta after it change
    later = torch.arange(nch * BT, device="cuda") % BT > 37
    for name in ("dAqk", "dAkk"):
        t[name][later] = 0
    run(*args)
    torch.cuda.synchronize()
    before = [t[name][~later].clone() for name in outs]
    gen = torch.Generator(device="cuda").manual_seed(5)
    g3 = t["g"].view(nch, BT, K)
    step = torch.rand(g3.shape, generator=gen, device="cuda") * 3 * strength
    g3.sub_((step * (torch.arange(BT, device="cuda") > 37)[None, :, None]).cumsum(1))
    for name in ("q", "k"):
        t[name][later] = (torch.randn(t[name][later].shape, generator=gen, device="cuda") * 0.1).bfloat16()
    t["beta"][later] = torch.rand(int(later.sum()), generator=gen, device="cuda")
    run(*args)
    torch.cuda.synchronize()
    causal = all(torch.equal(b, t[name][~later]) for b, name in zip(before, outs))
    # dAqk and dAkk once (the second K half's from L2), q and k (bf16), g (fp32), beta; then the
    # three sums out, or (unit) dq, dk, dg and the raw gate in, dq2 and dk2 (fp32), dg2 (bf16)
    # and the partials out
    moved = nch * (2 * BT * BT * 4 + 2 * BT * K * 2 + BT * K * 4 + BT * 4)
    moved += nch * ((3 * BT * K * 4 + BT * K * 2 + 2 * BT * K * 4 + BT * K * 2 + 2 * BT * 4 + K * 4) if unit
                    else 3 * BT * K * 4)
    if l2:  # dq2 and dk2 in bf16, the rows' rstd in
        moved += nch * (2 * BT * 4 - 2 * BT * K * 2)
    return {"kind": "gpu", "kernel": "b7_cute_probe", "split": split, "within": within, "unit": unit, "l2": l2,
            "phased": phased, "wg2": wg2, "ws": ws, "stm": stm,
            "bench_gate": bench_gate, "dyn": dyn,
            "strength": strength, "lower_bound": lower_bound, "has_bias": has_bias, "chunk_heads": nch,
            "errors": errors, **registered, "slow_share": share,
            "finite": finite, "causal_to_the_bit": causal, "ms": ms, "bytes": moved, "TB_s": moved / ms / 1e9,
            "gpu": torch.cuda.get_device_name()}


def main(argv=None) -> int:
    import subprocess

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:  # each build in a process of its own (CuTe DSL reads its dump folder once)
        dump = argv[1] if len(argv) > 1 else "/tmp/b7_cute_probe"
        for split, within, unit in BUILDS:
            sub = os.path.join(dump, ("split" if split else "single") + ("-within" if within else "")
                               + ("-unit" if unit else ""))
            os.makedirs(sub, exist_ok=True)
            for old in os.listdir(sub):
                os.remove(os.path.join(sub, old))
            subprocess.run([sys.executable, "-m", "research.b7_cute_probe", "compile-one", str(int(split)),
                            str(int(within)), str(int(unit)), sub], check=True, stdout=subprocess.DEVNULL)
            print(json.dumps(sm90_row(sub, split, within, unit)))
        return 0
    if argv[:1] == ["compile-one"]:
        # (then optionally H, and a unit's gate form: lb, nobias)
        compile_offline(split=bool(int(argv[1])), within=bool(int(argv[2])), unit=bool(int(argv[3])), dump=argv[4],
                        H=int(argv[5]) if len(argv) > 5 else 1, has_bias="nobias" not in argv[6:],
                        lower_bound=-5.0 if "lb" in argv[6:] else None, l2="l2" in argv[6:],
                        phased="phased" in argv[6:], wg2="wg2" in argv[6:] or "ws" in argv[6:],
                        ws="ws" in argv[6:], stm="stm" in argv[6:],
                        dyn="dyn" in argv[6:],
                        G=2 if "gva2" in argv[6:] else 1, var="var" in argv[6:],
                        K=64 if "k64" in argv[6:] else 128)
        return 0
    if argv[:1] == ["gpu"]:  # every build at the gentle draw, then the whole sums under gates past the guard;
        # or the builds whose indices in BUILDS follow
        # (a unit build's index may carry its gate form: 2:lb the lower-bounded sigmoid, 2:nobias
        # no dt_bias, 2:lb:nobias both; 2:l2 B10 in the unit; 2:phased the operands in two phases;
        # any build's, 0:wg2, the roles on two warpgroups, 0:ws, that with an idle third and 232 registers;
        # 0:stm, the shared tiles written by stmatrix; 0:benchgate, the
        # op bench's gate draw; 2:strong, the gates past the guard; 2:dyn, the rows a run-time extent)
        for arg in argv[1:] or [str(i) for i in range(len(BUILDS))]:
            index, *form = arg.split(":")
            split, within, unit = BUILDS[int(index)]
            print(json.dumps(gpu_run(split=split, within=within, unit=unit, has_bias="nobias" not in form,
                                     lower_bound=-5.0 if "lb" in form else None, l2="l2" in form,
                                     phased="phased" in form, wg2="wg2" in form or "ws" in form,
                                     ws="ws" in form, stm="stm" in form,
                                     bench_gate="benchgate" in form, dyn="dyn" in form,
                                     strength=10.0 if "strong" in form else 0.3)), flush=True)
        if not argv[1:]:
            print(json.dumps(gpu_run(strength=10.0)), flush=True)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
