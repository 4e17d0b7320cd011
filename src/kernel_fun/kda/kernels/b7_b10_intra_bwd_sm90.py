"""B7-B9, and with the l2norm in the op B7-B10, in one CuTe DSL kernel for sm_90a: the
intra-chunk backward's three sums on tensor cores, dg's chunk cumsum (B8), the gate's backward
(B9) and the l2norm's (B10), for one (chunk-head, 64-channel K half) a CTA of one warpgroup.
It runs inside the registered stages (B7-B9's ``ours``, ``kda/kernels/__init__.py``, and
B7-B10's) on an sm_90 GPU with ``nvidia-cutlass-dsl`` installed (the ``sm90`` extra), where
``supports`` takes the call; the Triton unit, which CI runs in the interpreter, is its twin.

The sums, for g the chunk cumsum in log2 and f(r, s) = exp2(g_r - g_s):
x_q[r] = sum_{s<=r} dAqk[r, s] k_s f, x_kr[r] = sum_{s<r} dAkk[r, s] k_s f (beta_r after),
x_c[s] = sum_{r>=s} dAqk[r, s] q_r f + sum_{r>s} dAkk[r, s] beta_r k_r f. The chunk's rows fall
in four blocks of 16. Pairs across blocks go through anchors (each block's first row, and the
next block's), every factor at most 1; pairs within a block go through the block's first row u
while g[u] - g stays within 2^GUARD. So a row's sums follow from it and the rows before it, to
the bit. An element past the guard (a decay of over 4 log2 units a token, or a NaN gate) takes
its pairs within its block one by one, exact for any gate, in one run-time loop.

Two CTAs an SM (255 registers, 96 KB of shared memory each). dA's tiles are split into a bf16
high part and remainder and lie once in shared memory, read as they lie by the row role and
MN-major by the column role; the B operands (kx, kxu, yq, yk, split) are built on chip by
stmatrix. 18 groups of three bf16 wgmmas (hi*hi + hi*lo + lo*hi) alternate between two
accumulators, the next group issued before this one's epilogue. The sums never leave the
registers: the tail forms dq2, dk2, db's part, dg's reverse cumsum and the gate's backward
from them, dAqk's diagonal (the pairs (r, r)) added in fp32. With B10, a chunk-head's K halves
run as a 2-CTA cluster and swap their halves' row sums by one shared-to-shared copy, which
completes on the receiver's barrier (both addresses mapped into the peer, as PTX requires).

Measured: the README's whole-op tables (on an H100 at prod8192_gate, B7-B10 7.8 ms in the op
where the Triton unit and B10 took 13.1; the op 31.70 ms against 37.33 with them, fla's 52.84;
at prod_packed 31.73 in two launches against 37.94 in one, every chunk bounded). Clean under
memcheck and racecheck. Its time follows its code: unrolled, the pair-by-pair path made it
13,400 SASS instructions, past the instruction cache, and 12.0 ms; as a loop ~8,500
(docs/log/bwd-fused.md has every round).

Falls back (``supports``, to the Triton unit): not sm_90, CuTe DSL missing or not 4.8.1, a
pre-computed gate, chunk size other than 64, K other than 64 or 128, fp32 q or k, non-dense
tensors, 2^31 elements a tensor; for B7-B10 also GVA (the group's sum comes before B10). Packed
sequences and T not a multiple of 64 take two launches: the chunks of 64 rows the ``whole``
build (the dense build's code, 8,496 SASS instructions against 8,512), and at most one chunk a
sequence, every shorter one among them, the ``var`` build (bounded rows, 10,328). One compile a
shape and gate form (~9 s; two for packed sequences), kept per process.
"""

import torch

BT, KH, BC = 64, 64, 16  # chunk rows, a CTA's K half, the row block
NB = BT // BC
GUARD = 64  # the pairs within a block go through its first row where its factor stays within 2^GUARD
LOG2E = 1.4426950408889634
# the kernel's tensors, in its order (chunk_rows: ``var``'s [chunks, 3] int32, else a placeholder)
ARGS = ("dAqk", "dAkk", "q", "k", "g", "beta", "dq", "dk", "dg", "g_raw", "A_log", "dt_bias", "dq2", "dk2", "dg2",
        "db_part", "dA_part", "dbias_part", "q_rstd", "k_rstd", "chunk_rows")
# the tensors whose first extent follows the rows (B * T): run-time extents in the ``var`` build
ROW_ARGS = ("dAqk", "dAkk", "q", "k", "g", "beta", "dq", "dk", "dg", "g_raw", "dq2", "dk2", "dg2", "db_part",
            "dA_part", "dbias_part")


# --------------------------------------------------------------------------------------
# register fragments of the wgmma accumulator layout: a thread's element i = a + 2 b + 4 n
# of a [64, 64] tile is row 16 w + lane // 4 + 8 b, channel 8 n + 2 (lane % 4) + a
# --------------------------------------------------------------------------------------
def regs(x):
    """x (a thread's fragment of fp32 values) in registers, each element addressable."""
    import cutlass
    import cutlass.cute as cute

    r = cute.make_rmem_tensor(x.shape, cutlass.Float32)
    r.store(x)
    return r


def quad_row_sums(x):
    """The sums over a [64, 64] tile's columns of x for the thread's two rows, in every lane of
    its quad."""
    import cutlass
    import cutlass.cute as cute

    sums = []
    for b in (0, 1):
        t = cutlass.Float32(0.0)
        for i in range(cute.size(x.shape)):
            if i // 2 % 2 == b:
                t = t + x[i]
        t = t + cute.arch.shuffle_sync_bfly(t, 1)
        sums.append(t + cute.arch.shuffle_sync_bfly(t, 2))
    return sums


def warp_col_sums(x):
    """The sums over the warp's 16 rows of x by column, in the elements of row b = 0 (in every
    lane with the column)."""
    import cutlass.cute as cute

    c = regs(x)
    for i in range(cute.size(x.shape)):
        if i // 2 % 2 == 0:
            c[i] = c[i] + c[i + 2]
    for d in (4, 8, 16):
        for i in range(cute.size(x.shape)):
            if i // 2 % 2 == 0:
                c[i] = c[i] + cute.arch.shuffle_sync_bfly(c[i], d)
    return c


# --------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------
def _bulk_to_peer(src, nbytes: int, mbar, peer):
    """One bulk copy of ``nbytes`` from ``src`` (this CTA's shared memory) to the same offset in
    cluster CTA ``peer``, completing on ``peer``'s barrier at ``mbar``'s offset. PTX requires the
    barrier in the destination CTA, so both addresses are mapped into the peer; CuTe DSL 4.8.1's
    ``CopyBulkS2SOp`` maps the destination alone (compute-sanitizer's memcheck flags that form)."""
    from cutlass import AddressSpace, Int32
    from cutlass._mlir.dialects import llvm, nvvm
    from cutlass.cutlass_dsl import T

    cluster = llvm.PointerType.get(AddressSpace.dsmem)
    dst = nvvm.mapa(cluster, src.to_llvm_ptr(), peer.ir_value())
    bar = nvvm.mapa(cluster, mbar.to_llvm_ptr(), peer.ir_value())
    # (the op types its barrier operand as this CTA's window; PTX takes either window's 32 bits)
    bar = llvm.inttoptr(llvm.PointerType.get(AddressSpace.smem), llvm.ptrtoint(T.i32(), bar))
    nvvm.cp_async_bulk_shared_cluster_shared_cta(dst, src.to_llvm_ptr(), bar, Int32(nbytes).ir_value())


def build(K: int = 128, H: int = 1, G: int = 1, l2: bool = False, var: bool = False, raw: str = "bf16",
          has_bias: bool = True, lower_bound: float | None = None, whole: bool = False):
    """The host function (a ``cute.jit``) for one shape and gate form: one CTA of 128 threads a
    (K half, chunk-head), K = 64 (one CTA a chunk-head) or 128 (two). The token tensors hold H
    value heads side by side, as the op's [B, T, H, C] viewed [B * T, H * C]; q and k hold H / G
    heads (GVA: chunk-head c reads head c % H // G; dq2 and dk2 stay by value head). Chunk-head c
    is the chunk of rows c // H at head c % H. ``l2`` (H = HV): B10 too, dq2 and dk2 written in
    bf16. ``var``: chunks of any length up to 64 anywhere in the rows (``chunk_rows``), rows past
    a chunk's end never read or written, g past it read as its last row's (every factor stays
    finite; the zero rows of dA, q, k and beta add nothing). ``raw``: the raw gate's dtype (bf16
    or fp32); ``has_bias``: dt_bias added; ``lower_bound``: the sigmoid gate form. ``whole`` (with
    ``var``): every chunk the map names is 64 rows, so no row is bounded (the chunks still start
    anywhere). A ``var`` build writes each chunk-head's partials of dA_log and dt_bias at the
    chunk's number in the map (its third column), so that a launch may take any of the chunks."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import warp, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    NS = K // KH  # (the CTAs a chunk-head: K's halves, or one at K = 64)
    assert K == NS * KH and NS in (1, 2)
    assert G == 1 or not l2  # (B10 needs the group's sum first)
    XCH = l2 and NS == 2  # (B10's row sums swapped between the K halves; at K = 64 one CTA holds the row)
    assert var or not whole
    short = var and not whole  # (chunks may end before 64 rows: their rows bounded)
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    raw = {"bf16": bf16, "fp32": f32}[raw]

    def _ex2(x):
        """2^x (fp32 values) as the hardware's fast ex2, with no side effects declared (the inline-asm
        cute.arch.exp2 declares some, which pins every one, and the loads around it, in program
        order, and keeps equal ones from being shared)."""
        return cute.math.exp2(x, fastmath=True)

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
    else:
        def _tile(x, rt, row0, ctile, width=KH):
            """x's [64, width] tile at row tile rt, column tile ``ctile``."""
            return cute.local_tile(x, (BT, width), (rt, ctile))

    if short:
        # (a thread's fragment holds two rows: each read or written whole under one branch on its
        # ``ok``, so that its pairs of adjacent channels stay 8-byte accesses)
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
        specs = [("c", i, 0, 0) for i in range(NB - 1, -1, -1)]
        for j in range(NB):
            for tile in ((0,) if j < NB - 1 else ()) + (1,):
                specs += [("r", j, 0, tile), ("r", j, 1, tile)]
        return specs

    def _fragments(tmma, a_tiles, b_tiles):
        """The wgmma fragments of the A tiles (as ``tmma`` reads them) and of the B tiles."""
        thr = tmma.get_slice(0)
        return ([tmma.make_fragment_A(thr.partition_A(t)) for t in a_tiles],
                [tmma.make_fragment_B(thr.partition_B(t)) for t in b_tiles])

    def _products(tmma, zmma, acc, a_hi, a_lo, b_hi, b_lo, ka, kb, fresh):
        """acc (+)= a b over one block: k block ka of a, kb of b, as hi*hi + hi*lo + lo*hi;
        ``fresh``: the first overwrites acc (``zmma``'s scale-d off)."""
        at_a, at_b = (None, None, ka, 0), (None, None, kb, 0)
        cute.gemm(zmma if fresh else tmma, acc, a_hi[at_a], b_hi[at_b], acc)
        cute.gemm(tmma, acc, a_hi[at_a], b_lo[at_b], acc)
        cute.gemm(tmma, acc, a_lo[at_a], b_hi[at_b], acc)

    @cute.kernel
    def kernel(dAqk: cute.Tensor, dAkk: cute.Tensor, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor,
               beta: cute.Tensor, dq: cute.Tensor, dk: cute.Tensor, dg: cute.Tensor, g_raw: cute.Tensor,
               a_log: cute.Tensor, dt_bias: cute.Tensor, dq2: cute.Tensor, dk2: cute.Tensor, dg2: cute.Tensor,
               db_part: cute.Tensor, dA_part: cute.Tensor, dbias_part: cute.Tensor, q_rstd: cute.Tensor,
               k_rstd: cute.Tensor, chunk_rows: cute.Tensor, mma: cute.TiledMma, mma_z: cute.TiledMma,
               mma_t: cute.TiledMma, mma_tz: cute.TiledMma, a_l: cute.ComposedLayout, at_l: cute.ComposedLayout,
               b_l: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        half, chunk = bid % NS, bid // NS  # (the grid's x: a chunk-head's K halves side by side, a cluster)
        w = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % NB  # (its rows, or columns s, are block w)
        lane = cute.arch.lane_idx()
        for m, on in ((mma, True), (mma_z, False), (mma_t, True), (mma_tz, False)):  # (each MMA twice, its
            m.set(warpgroup.Field.ACCUMULATE, on)  # accumulate field set here once)

        @cute.struct
        class Smem:
            # dA's tiles, split: the A operand of the row role as they lie (M = r, K = s) and of the
            # column role read MN-major (M = s, K = r), the same bytes
            qh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            kh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            kl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            # the B operands [64 channels, 64 rows], MN-major (a row's 64 channels one 128-byte
            # row: no operand with 32-byte rows, the shape read past its end on the H200), a
            # block's rows its k block: kx (across blocks, row role), kxu (within a block, row
            # role), yq and yk (column role). After the products, the pair-by-pair loop's 12 KB a
            # warp from xh on (the eight tiles lie end to end).
            xh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            xl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            uh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            ul: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            yqh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            yql: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            ykh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            ykl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            # the warps' column sums for B8's cumsum and dt_bias's partial, and their dA_log sums
            red: cute.struct.Align[cute.struct.MemRange[f32, 2 * NB * KH + NB], 128]
            # (l2) the K halves' row sums of dq2 q and dk2 k, [half, q or k, row]: this CTA's half
            # written here, the peer's copied in, and the barrier that copy completes on
            xch: cute.struct.Align[cute.struct.MemRange[f32, 4 * BT], 128]
            xbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 1], 8]

        storage = SmemAllocator().allocate(Smem)
        if cutlass.const_expr(XCH):  # the barrier armed for the peer's 512 bytes before the peer can send
            if tidx == 0:
                cute.arch.mbarrier_init(storage.xbar.data_ptr(), 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()  # (its initialisation before any use, for every thread's view)
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(storage.xbar.data_ptr(), 2 * BT * 4)
            cute.arch.cluster_arrive_relaxed()
        s_a = [getattr(storage, n).get_tensor(a_l.outer, swizzle=a_l.inner) for n in ("qh", "ql", "kh", "kl")]
        s_b = [getattr(storage, n).get_tensor(b_l.outer, swizzle=b_l.inner)
               for n in ("xh", "xl", "uh", "ul", "yqh", "yql", "ykh", "ykl")]
        s_at = [getattr(storage, n).get_tensor(at_l.outer, swizzle=at_l.inner) for n in ("qh", "ql", "kh", "kl")]
        tens = (dAqk, dAkk, q, k, g, beta, dq, dk, dg, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part,
                dbias_part, q_rstd, k_rstd, chunk_rows)
        sm = (s_a, s_at, s_b, storage.red.data_ptr(), storage.xch.data_ptr(), storage.xbar.data_ptr(),
              cute.recast_ptr(storage.xh.data_ptr(), dtype=f32))
        body(tidx, w, lane, chunk, half, tens, sm, (mma, mma_z, mma_t, mma_tz))

    @cute.jit
    def body(tid, w, lane, chunk, half, tens, sm, mmas):
        """The unit for one (chunk-head, K half). ``tens``: the global tensors in ``ARGS``'s order;
        ``sm``: dA's split tiles (as they lie and as read MN-major), the B operand tiles, the
        tail's sums, the l2 exchange and its barrier, the pair-by-pair loop's scratch; ``mmas``:
        the four MMAs."""
        (dAqk, dAkk, q, k, g, beta, dq, dk, dg, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part,
         q_rstd, k_rstd, chunk_rows) = tens
        s_a, s_at, s_b, red, xch, xbar, scratch = sm
        mma, mma_z, mma_t, mma_tz = mmas
        rt, ct = chunk // H, chunk % H * NS + half  # the chunk's row tile; this K slice's column tile
        head = chunk % H
        # (``var``: the chunk's first row from chunk_rows, its length too unless ``whole``; else
        # whole chunks in order)
        row0 = chunk_rows[chunk // H, 0] if cutlass.const_expr(var) else rt * BT
        nval = chunk_rows[chunk // H, 1] if cutlass.const_expr(short) else BT
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
        ok = None  # (short chunks: which of the thread's elements are the chunk's rows)
        if cutlass.const_expr(short):
            ok = cute.make_rmem_tensor(shape, cutlass.Boolean)
            for i in cutlass.range_constexpr(cute.size(shape)):
                ok[i] = coords[i][0] < nval
        lay = cute.make_layout((BT, KH), stride=(0, 1))
        rows_of = lambda ptr: frag(cute.make_tensor(ptr, cute.make_layout((BT, KH), stride=(H, 0))))  # noqa: E731
        if cutlass.const_expr(short):  # (an anchor past the chunk's end is its last row; so is g)
            anchor = lambda row: frag(cute.make_tensor(g_g[cutlass.min(row, nval - 1), None].iterator,  # noqa: E731
                                                       lay)).load()
            gload = lambda: cute.where(ok.load(), _ld(frag(g_g), ok), anchor(nval - 1))  # noqa: E731
        else:
            anchor = lambda row: frag(cute.make_tensor(g_g[row, None].iterator, lay)).load()  # noqa: E731
            gload = lambda: frag(g_g).load()  # noqa: E731
        mn = lambda t: t[None, None, 0]  # noqa: E731  (an A tile as (M, K))
        kn = lambda t: cute.make_tensor(t.iterator, cute.select(t[None, None, 0].layout, mode=[1, 0]))  # noqa: E731
        # (the bf16 tiles written by stmatrix, four 8x8 blocks an instruction)
        st_copy = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), bf16), mma)

        def put(view, vals):
            """vals (bf16, this thread's elements of a [64, 64] tile in the wgmma layout) into the
            shared tile ``view`` (rows, columns)."""
            st_thr = st_copy.get_slice(tid)
            r = cute.make_rmem_tensor(shape, bf16)
            r.store(vals)
            cute.copy(st_copy, st_thr.retile(r), st_thr.partition_D(view))

        # dA's tiles, split, their upper triangles and dAqk's diagonal zeroed (the tail adds the
        # pairs (r, r) in fp32): the row role reads them as they lie, the column role MN-major
        for mat in (0, 1):
            v = regs(_ld(frag((g_q, g_k)[mat]), ok))
            for i in cutlass.range_constexpr(cute.size(shape)):
                r, s = coords[i]
                v[i] = f32(cutlass.select_(s < r, v[i], f32(0.0)))
            parts = _split(v.load())
            put(mn(s_a[2 * mat]), parts[0])
            put(mn(s_a[2 * mat + 1]), parts[1])
        # the B operands, each warp its own block's rows: kx = k exp2(g[n(r)] - g) (at most 1;
        # block 3's never read), kxu = k exp2(g[a(r)] - g) (at most 2^GUARD: 0 past it, where only
        # rows past the guard read it), yq = q exp2(g - g[a(r)]) and yk = beta k exp2(g - g[a(r)])
        gv = gload()
        span = anchor(w * BC) - gv  # g[u] - g, u = a(r)
        kf = _ld(frag(g_kk), ok).to(f32)
        ops = [kf * _ex2(anchor(cutlass.select_(w < NB - 1, (w + 1) * BC, w * BC)) - gv),
               cute.where(span <= GUARD, kf * _ex2(span), f32(0.0))]
        down = _ex2(-span)
        ops += [_ld(frag(g_qq), ok).to(f32) * down, _ld(rows_of(beta.iterator + row0 * H + head), ok) * kf * down]
        for n in cutlass.range_constexpr(4):
            parts = _split(ops[n])
            put(kn(s_b[2 * n]), parts[0])
            put(kn(s_b[2 * n + 1]), parts[1])
        cute.arch.fence_view_async_shared()  # (the generic proxy's stores seen by the wgmmas)
        cute.arch.sync_threads()

        # Each group is one block's products into one of two accumulators, the next group issued
        # before this one's epilogue. Column role, blocks i = 3 .. 0 (dA's rows of block i,
        # transposed, times yq, yk on them): the columns s of an earlier block w take it through
        # the anchors g[a_i] and g[n(s)] (every factor at most 1); at i = w every column takes
        # exp2(g[n(s)] - g_s), then its pairs within the block times exp2(g[a(s)] - g_s) where that
        # is within the guard. Row role, blocks j = 0 .. 3 (dA's columns of block j times kx, and
        # times kxu): the rows of a later block w take the kx product through g[a(r)] and g[n_j];
        # at j = w each row adds its kxu product where within the guard, then takes exp2(g_r - g[a(r)]).
        specs = _specs()
        accs = (cute.make_rmem_tensor(shape, f32), cute.make_rmem_tensor(shape, f32))
        o_q, o_k, o_c = (cute.make_rmem_tensor(shape, f32) for _ in range(3))
        for o in (o_q, o_k, o_c):
            o.fill(0.0)

        def issue(spec, acc, r_a, r_b, t_a, t_b):
            kind, i, mat, tile = spec
            if kind == "c":
                _products(mma_t, mma_tz, acc, t_a[0], t_a[1], t_b[4], t_b[5], i, i, True)
                _products(mma_t, mma_tz, acc, t_a[2], t_a[3], t_b[6], t_b[7], i, i, False)
            else:
                _products(mma, mma_z, acc, r_a[2 * mat], r_a[2 * mat + 1], r_b[2 * tile], r_b[2 * tile + 1], i, i,
                          True)

        r_a, r_b = _fragments(mma, s_a, s_b)  # (the operands' descriptors, made where they are used)
        t_a, t_b = _fragments(mma_t, s_at, s_b)
        frags = (r_a, r_b, t_a, t_b)
        warpgroup.fence()
        issue(specs[0], accs[0], *frags)
        warpgroup.commit_group()
        for n in cutlass.range_constexpr(len(specs)):
            kind, i, mat, tile = specs[n]
            acc = accs[n % 2]
            if cutlass.const_expr(n + 1 < len(specs)):
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

        # The elements past the guard: their pairs within the block one by one, each with its own
        # exp2, read from memory (none under gentle gates). The warp skips the path with one
        # branch when none of its elements is past the guard; else one run-time loop over the
        # thread's 32 elements, the three sums waiting in the warp's 12 KB of the B operands'
        # memory (dead once the products are done), lane-major, so that no registers are held
        # across the loop and its code stays small (unrolled, ~5,100 SASS instructions of cold
        # code between the products and the tail pushed the kernel past the instruction cache).
        sp = regs(anchor(w * BC) - gload())
        if cutlass.const_expr(short):  # (the chunk's rows alone: a row past its end counts as inside)
            for i in cutlass.range_constexpr(cute.size(shape)):
                sp[i] = f32(cutlass.select_(coords[i][0] < nval, sp[i], f32(0.0)))
        past = f32(0.0)
        for i in cutlass.range_constexpr(cute.size(shape)):
            past = past + f32(cutlass.select_(sp[i] <= GUARD, f32(0.0), f32(1.0)))
        if cute.arch.vote_any_sync(past > f32(0.0)):
            # (element i = a + 2 b + 4 n at row 16 w + lane // 4 + 8 b, channel 8 n + 2 (lane % 4) + a)
            scr = cute.make_tensor(scratch + w * (3 * 32 * 32), cute.make_layout((32, 32, 3), stride=(1, 32, 1024)))
            for i in cutlass.range_constexpr(cute.size(shape)):
                scr[lane, i, 0] = o_q[i]
                scr[lane, i, 1] = o_k[i]
                scr[lane, i, 2] = o_c[i]
            u = w * BC
            for i in cutlass.range(32, unroll=1):
                t = u + lane // 4 + 8 * (i // 2 % 2)
                c = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                inside = True
                end = u + BC
                if cutlass.const_expr(short):
                    inside = t < nval
                    end = cutlass.min(u + BC, nval)
                if inside:
                    if not (g_g[u, c] - g_g[t, c] <= GUARD):
                        # x_q's and x_kr's pairs s from u up to t (s < t: the tail adds dAqk's s = t)
                        a_q = f32(0.0)
                        a_k = f32(0.0)
                        for s in cutlass.range(u, t, unroll=1):
                            f = g_kk[s, c].to(f32) * cute.arch.exp2(g_g[t, c] - g_g[s, c])
                            a_q += g_q[t, s] * f
                            a_k += g_k[t, s] * f
                        # x_c's pairs r from past t to the block's end (in the chunk)
                        a_c = f32(0.0)
                        for r in cutlass.range(t + 1, end, unroll=1):
                            wt = g_q[r, t] * g_qq[r, c].to(f32)
                            wt += g_k[r, t] * g_b[r] * g_kk[r, c].to(f32)
                            a_c += wt * cute.arch.exp2(g_g[r, c] - g_g[t, c])
                        scr[lane, i, 0] = scr[lane, i, 0] + a_q
                        scr[lane, i, 1] = scr[lane, i, 1] + a_k
                        scr[lane, i, 2] = scr[lane, i, 2] + a_c
            for i in cutlass.range_constexpr(cute.size(shape)):
                o_q[i] = scr[lane, i, 0]
                o_k[i] = scr[lane, i, 1]
                o_c[i] = scr[lane, i, 2]
        _tail(thr_c, shape, w, lane, chunk, half, red, xch, xbar, o_q, o_k, o_c, dAqk, q, k, beta, dq, dk, dg,
              g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part, q_rstd, k_rstd, chunk_rows, row0,
              nval, ok)

    @cute.jit
    def _tail(thr_c, shape, w, lane, chunk, half, red, xch, xbar, o_q, o_k, o_c, dAqk, q, k, beta, dq, dk, dg, g_raw,
              a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part, dbias_part, q_rstd, k_rstd, chunk_rows, row0, nval,
              ok):
        """The rest of the unit on this CTA's (chunk-head, K half) from the three sums in registers:
        dq2 = dq + x_q, dk2 = dk + beta x_kr + x_c (with dAqk's diagonal), db's part (the row sums
        of x_kr k), dg = dg + q x_q + k (beta x_kr - x_c) reverse-cumsummed over the chunk (B8),
        the gate's backward (B9) into dg2 with dA_log's partial per (K half, chunk-head) and
        dt_bias's per (chunk-head, channel); ``l2``: B10 on dq2 and dk2."""
        rt, ct, head = chunk // H, chunk % H * NS + half, chunk % H
        # (where the partials go: the chunk-head's number, ``var``: by the chunk's number in the map)
        cid = chunk_rows[chunk // H, 2] * H + head if cutlass.const_expr(var) else chunk
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
        # dAqk's diagonal, each row's pair (r, r) at factor 1, out of the products (a bf16 split
        # carries ~2^-17 of a product): dq's and dk's terms added below in fp32. In dg's terms (y),
        # the pair's two, q_r dAqk[r, r] k_r and the same less, cancel exactly: left out.
        dd = [f32(0.0), f32(0.0)]
        for b in cutlass.range_constexpr(2):
            r = w * BC + lane // 4 + 8 * b
            v = f32(0.0)
            if cutlass.const_expr(short):
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
                if cutlass.const_expr(short):
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
        cute.arch.sync_threads()
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
        # are in the Triton unit: the accurate library forms cost ~1,000 more instructions a thread)
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
        cute.arch.sync_threads()
        tidx = w * 32 + lane
        if tidx < KH:
            if cutlass.const_expr(has_bias):
                bias_sum = f32(0.0)
                for v in cutlass.range_constexpr(NB):
                    bias_sum += s_bias[v, tidx]
                dbias_part[cid, half * KH + tidx] = bias_sum
        if tidx == 0:
            da_sum = f32(0.0)
            for v in cutlass.range_constexpr(NB):
                da_sum += s_da[v]
            dA_part[half * (cute.size(dA_part, mode=[0]) // NS) + cid] = da_sum
        if cutlass.const_expr(XCH):  # (the peer has what this CTA sent before either leaves)
            cute.arch.cluster_wait()

    @cute.jit
    def _l2norm_bwd(frag, w, lane, half, row0, ok, head, xch, xbar, dqv, qf, dkv, kf, q_rstd, k_rstd, o_q, o_k):
        """B10 on this CTA's K half: dx = rstd (dy - (dy . y) y) for (dy, y) = (dq2, q) and (dk2, k),
        the dot products over both halves. Each half's row sums (the thread's 16 channels, then the
        quad's) go into ``xch[half]`` here and into the peer's by one bulk copy; each CTA then adds
        xch[0] + xch[1], the same sum in both, so both halves scale by the same number."""
        s_x = cute.make_tensor(xch, cute.make_layout(4 * BT))
        sums = (quad_row_sums(dqv * qf), quad_row_sums(dkv * kf))
        if lane % 4 == 0:
            for m in cutlass.range_constexpr(2):
                for b in cutlass.range_constexpr(2):
                    s_x[(half * 2 + m) * BT + w * BC + lane // 4 + 8 * b] = sums[m][b]
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        if cutlass.const_expr(XCH):
            cute.arch.cluster_wait()  # (the peer's barrier is armed)
            if w == 0:
                if lane == 0:
                    _bulk_to_peer(xch + half * 2 * BT, 2 * BT * 4, xbar, cutlass.Int32(1 - half))
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

    @cute.jit
    def launch(dAqk: cute.Tensor, dAkk: cute.Tensor, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor,
               beta: cute.Tensor, dq: cute.Tensor, dk: cute.Tensor, dg: cute.Tensor, g_raw: cute.Tensor,
               a_log: cute.Tensor, dt_bias: cute.Tensor, dq2: cute.Tensor, dk2: cute.Tensor, dg2: cute.Tensor,
               db_part: cute.Tensor, dA_part: cute.Tensor, dbias_part: cute.Tensor, q_rstd: cute.Tensor,
               k_rstd: cute.Tensor, chunk_rows: cute.Tensor, stream: cuda.CUstream):
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
        kernel(dAqk, dAkk, q, k, g, beta, dq, dk, dg, g_raw, a_log, dt_bias, dq2, dk2, dg2, db_part, dA_part,
               dbias_part, q_rstd, k_rstd, chunk_rows, mma, mma_z, mma_t, mma_tz, a_l, at_l, b_l).launch(
            grid=(NS * nch, 1, 1), block=(128, 1, 1), cluster=(2, 1, 1) if XCH else (1, 1, 1), stream=stream)

    return launch


# --------------------------------------------------------------------------------------
# the stage contract
# --------------------------------------------------------------------------------------
_COMPILED: dict = {}


def cute_unavailable(t) -> str | None:
    """Why the kernel cannot run on ``t``'s device (an sm_90 GPU with CuTe DSL installed), or None."""
    if not t.is_cuda or torch.cuda.get_device_capability(t.device) != (9, 0):
        return "the CuTe kernel is built for sm_90a"
    return _cute_missing()


# the CuTe DSL release the kernel is built and tested with (the ``sm90`` extra pins it): its
# language changes between releases, so another one is declined rather than compiled
CUTE_DSL = "4.8.1"
_CUTE: dict = {}


def _cute_missing() -> str | None:
    if "missing" not in _CUTE:
        try:
            import cutlass
            import cutlass.cute  # noqa: F401

            version = getattr(cutlass, "__version__", None)
            _CUTE["missing"] = None if version == CUTE_DSL else (
                f"CuTe DSL {version} is installed; the kernel is built for {CUTE_DSL} (pip install 'kernel-fun[sm90]')")
        except ImportError:
            _CUTE["missing"] = "CuTe DSL is not installed (pip install 'kernel-fun[sm90]')"
    return _CUTE["missing"]


def _misaligned(*tensors) -> bool:
    """Whether any of ``tensors`` starts off a 16-byte boundary: the build takes every tensor as
    16-byte aligned (an offset view of a caller's buffer need not be)."""
    return any(x is not None and x.data_ptr() % 16 for x in tensors)


def supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
             cu_seqlens, chunk_indices):
    """None when ``intra_bwd`` takes the B7-B9 unit, else why not: an sm_90 GPU with CuTe DSL, the
    gate in the op, chunks of 64, K = 64 or 128, value heads a multiple of the q/k heads, bf16 q
    and k, a bf16 or fp32 raw gate, dense tensors that start on 16 bytes."""
    why = cute_unavailable(k)
    if why:
        return why
    B, T, H, K = k.shape
    if A_log is None:
        return "a pre-computed gate (the kernel ends with the gate's backward)"
    if chunk_size != BT:
        return f"chunk_size={chunk_size} (the kernel's chunks are {BT})"
    if cu_seqlens is not None and chunk_indices is None:
        return "packed sequences without their chunk_indices"
    if K not in (KH, 2 * KH) or gc.shape[2] % H:
        return f"K={K}, H={H}, HV={gc.shape[2]} (the kernel takes K=64 or 128, HV a multiple of H)"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or g.dtype not in (torch.bfloat16, torch.float32):
        return f"q {q.dtype}, k {k.dtype}, raw gate {g.dtype} (the kernel takes bf16 q and k, a bf16 or fp32 gate)"
    if not all(x.is_contiguous() for x in (q, k, gc, dAqk, dAkk, dq, dk, dg, g)):
        return "non-contiguous tensors (the kernel views them as dense [B * T, H * C])"
    if _misaligned(q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias):
        return "a tensor that does not start on a 16-byte boundary (the kernel's loads assume one)"
    if B * T * gc.shape[2] * K >= 2 ** 31:
        return f"{B * T * gc.shape[2] * K} elements a tensor (the kernel's offsets are 32-bit)"
    return None


def supports_l2(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                cu_seqlens, chunk_indices, q_rstd, k_rstd):
    """None when ``intra_bwd_l2`` takes the B7-B10 unit: as ``supports``, with H = HV (GVA sums
    each group before B10)."""
    if q_rstd is None or k_rstd is None:
        return "the l2norm is not in the op"
    if gc.shape[2] != k.shape[2]:
        return f"H={k.shape[2]}, HV={gc.shape[2]} (B10 in the kernel needs H = HV: GVA's group sum comes first)"
    if _misaligned(q_rstd, k_rstd):
        return "an rstd that does not start on a 16-byte boundary (the kernel's loads assume one)"
    return supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                    cu_seqlens, chunk_indices)


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
              cu_seqlens, chunk_indices):
    """B7-B9 with fla's contracts: (dq, dk, db, dg, dA_log, ddt_bias), as the Triton unit's. Exact
    for any gate (``safe_gate`` changes nothing)."""
    why = supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                   cu_seqlens, chunk_indices)
    if why:
        raise ValueError(f"B7-B9's CuTe kernel: {why}")
    return _run(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, g, A_log, dt_bias, lower_bound, None, None, cu_seqlens,
                chunk_indices)


def intra_bwd_l2(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
                 cu_seqlens, chunk_indices, q_rstd, k_rstd):
    """B7-B10 with the stage's contract: B7-B9's outputs with dq and dk through the l2norm's
    backward (q and k the normalized rows, q_rstd and k_rstd [B, T, H]), in q's and k's dtype."""
    why = supports_l2(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound,
                      chunk_size, cu_seqlens, chunk_indices, q_rstd, k_rstd)
    if why:
        raise ValueError(f"B7-B10's CuTe kernel: {why}")
    return _run(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, g, A_log, dt_bias, lower_bound, q_rstd, k_rstd,
                cu_seqlens, chunk_indices)


def _run(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, g, A_log, dt_bias, lower_bound, q_rstd, k_rstd, cu_seqlens,
         chunk_indices):
    """The build for this shape and gate form (compiled on first use, kept per process) on the
    op's tensors, and its outputs as the stage's. Dense sequences of whole chunks take a build
    per B * T; packed sequences and T not a multiple of 64 two builds for every batch of them
    (``split_chunks``): the ``whole`` one on chunks of 64 rows, the ``var`` one on the rest."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    B, T, Hq, K = k.shape
    H, dev = gc.shape[2], k.device
    l2 = q_rstd is not None
    var = cu_seqlens is not None or T % BT != 0
    tensors = views(q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd, k_rstd, cu_seqlens,
                    chunk_indices)
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    raw = "bf16" if g.dtype == torch.bfloat16 else "fp32"
    lb = None if lower_bound is None else float(lower_bound)
    if var:  # (the chunks of 64 rows, then the rest: each a launch of its own build, where it has any)
        n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
        runs = [(whole, rows) for whole, rows in zip((True, False), split_chunks(tensors["chunk_rows"], n_seq))
                if rows.shape[0]]
    else:
        runs = [(False, None)]
    with torch.cuda.device(dev):  # (compiled and launched on the tensors' device, whichever is current)
        for whole, rows in runs:
            args = dlpack_args(tensors if rows is None else {**tensors, "chunk_rows": rows}, var) + [stream]
            # (every extent and value the build bakes in: B * T unless ``var``, the heads, K, the gate form)
            key = (None if var else B * T, H, Hq, K, raw, dt_bias is not None, lb, l2, var, whole, dev.index)
            fn = _COMPILED.get(key)
            if fn is None:
                fn = _COMPILED[key] = cute.compile(build(K, H, H // Hq, l2, var, raw, dt_bias is not None, lb, whole),
                                                   *args)
            fn(*args)
    return outputs(tensors, db, A_log, dt_bias)


def chunk_rows(B: int, T: int, cu_seqlens=None, chunk_indices=None, device="cpu"):
    """[chunks, 3] int32, each chunk's first row in [B * T], its length (at most 64) and its
    number: the ``var`` builds' map, for packed sequences (``chunk_indices``' (sequence, chunk)
    pairs over ``cu_seqlens``) or B sequences of T tokens with T not a multiple of 64; None where
    every chunk is whole and in order (the dense build's rows)."""
    if cu_seqlens is None:
        if T % BT == 0:
            return None
        starts = torch.arange(B, device=device)[:, None] * T + torch.arange(0, T, BT, device=device)[None, :]
        ends = (torch.arange(B, device=device)[:, None] + 1) * T
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seq, i = chunk_indices.to(device=device, dtype=torch.int64).unbind(-1)
        starts, ends = cu[seq] + i * BT, cu[seq + 1]
    lens, starts = (ends - starts).clamp(max=BT).reshape(-1), starts.reshape(-1)
    return torch.stack([starts, lens, torch.arange(len(starts), device=device)], -1).to(torch.int32).contiguous()


def split_chunks(rows, n_seq: int):
    """``chunk_rows``' map as two: chunks of 64 rows, for the ``whole`` build, and a last part of
    min(n_seq, chunks) chunks that holds every shorter one, for the ``var`` build. Only a
    sequence's last chunk can be short, so at most n_seq are; the chunks of 64 sort first (each
    group in its order), and the split needs no count from the device. Each part keeps the
    chunks' numbers (the third column), where their partials go."""
    n = rows.shape[0]
    order = torch.argsort((rows[:, 1] < BT).to(torch.int64) * n + torch.arange(n, device=rows.device))
    ranked = rows[order]
    cut = n - min(n_seq, n)
    return ranked[:cut].contiguous(), ranked[cut:].clone()


def views(q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd=None, k_rstd=None, cu_seqlens=None,
          chunk_indices=None) -> dict:
    """The kernel's tensors (``ARGS``) for the op's: [B, T, H, C] as [B * T, H * C] (fp32 where
    the kernel reads fp32), beta [B * T * H], A_log [H], dt_bias [H * K] (zeros without one), and
    its outputs allocated: dq2 and dk2 (fp32, or with q_rstd and k_rstd in q's and k's dtype), dg2
    in the raw gate's, the partials of db [NS, B * T * H], dA_log [NS, chunk-heads] and dt_bias
    [chunk-heads, K]; chunk_rows for the ``var`` build."""
    q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd, k_rstd = (  # (views for dlpack: no autograd)
        None if x is None else x.detach()
        for x in (q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd, k_rstd))
    B, T, _, K = k.shape
    H = gc.shape[2]  # (the value heads; q and k may have fewer, GVA)
    R, dev, NS = B * T, k.device, K // KH
    rows = chunk_rows(B, T, cu_seqlens, chunk_indices, dev)
    nch = (R // BT if rows is None else rows.shape[0]) * H
    flat = lambda x: x.reshape(R, -1)  # noqa: E731
    new = lambda dtype=torch.float32: torch.empty(R, H * K, device=dev, dtype=dtype)  # noqa: E731
    return dict(dAqk=flat(dAqk.float()), dAkk=flat(dAkk.float()), q=flat(q), k=flat(k), g=flat(gc.float()),
                beta=beta.float().contiguous().view(-1), dq=flat(dq.float()), dk=flat(dk.float()),
                dg=flat(dg.float()), g_raw=flat(g), A_log=A_log.float().contiguous().view(-1),
                dt_bias=(dt_bias.float().contiguous().view(-1) if dt_bias is not None
                         else torch.zeros(H * K, device=dev)),
                dq2=new(q.dtype if q_rstd is not None else torch.float32),
                dk2=new(k.dtype if k_rstd is not None else torch.float32), dg2=new(g.dtype),
                db_part=torch.empty(NS * R * H, device=dev), dA_part=torch.empty(NS * nch, device=dev),
                dbias_part=torch.empty(nch, K, device=dev),
                **{n: (x.float().contiguous().view(-1) if x is not None else torch.zeros(BT, device=dev))
                   for n, x in (("q_rstd", q_rstd), ("k_rstd", k_rstd))},
                chunk_rows=rows if rows is not None else torch.zeros(1, 3, dtype=torch.int32, device=dev))


def dlpack_args(tensors: dict, var: bool = False) -> list:
    """``tensors`` (``ARGS``) as CuTe tensors; ``var``: the first extent of those that follow the
    rows (the rows' rstd and the chunks' map too) a run-time value, so that one build serves every
    batch (the strides, heads and channels stay compile-time)."""
    from cutlass.cute.runtime import from_dlpack

    dynamic = set(ROW_ARGS) | {"chunk_rows", "q_rstd", "k_rstd"} if var else set()
    return [from_dlpack(tensors[n], assumed_align=16).mark_compact_shape_dynamic(mode=0, divisibility=1)
            if n in dynamic else from_dlpack(tensors[n], assumed_align=16) for n in ARGS]


def outputs(tensors: dict, db, A_log, dt_bias) -> tuple:
    """The stage's (dq, dk, db, dg, dA_log, ddt_bias) from the kernel's outputs in ``views``'s
    tensors: db the input plus the K halves' parts, dA_log the sum of the (K half, chunk-head)
    partials by head, dt_bias's the sum of the chunk-heads' by channel, each in a fixed order."""
    B, T, H = db.shape
    K = tensors["g"].shape[1] // H
    NS = K // KH
    shape = (B, T, H, K)
    db2 = db.float() + tensors["db_part"].view(NS, B, T, H).sum(0)
    dA_log = tensors["dA_part"].view(NS, -1, H).sum((0, 1)).view_as(A_log).to(A_log.dtype)
    ddt_bias = (tensors["dbias_part"].view(-1, H * K).sum(0).view_as(dt_bias).to(dt_bias.dtype)
                if dt_bias is not None else None)
    return tensors["dq2"].view(shape), tensors["dk2"].view(shape), db2, tensors["dg2"].view(shape), dA_log, ddt_bias

