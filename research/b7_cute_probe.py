"""B7's sums across 16-row blocks, on chip in CuTe DSL (sm_90a): the first piece of B7 for the
fused backward kernel (docs/log/bwd-fused.md, step 6). Not registered; compiled offline, not
yet run.

CuTe DSL 4.8.1 has no tf32 warpgroup MMA for Hopper: its warpgroup ops take bf16/fp16, fp8
and int8; tf32 is only in the sm80 warp MMA and in Blackwell's tcgen05. So where the Triton
kernels take three tf32 products (``dot3``), this takes three bf16 ones. Each fp32 operand
is split into a bf16 high part and a bf16 remainder, and the product is hi*hi + hi*lo + lo*hi
(``split``; the lo*lo term, about 2^-16 of the product, is dropped). Without ``split``, one
bf16 product.

For one chunk-head's K half (a CTA of one warpgroup), g is the chunk cumsum in log2
(non-increasing). The rows fall in four blocks of 16; a(r) is the first row of r's block,
n(s) the first row of the block after s's, and f(r, s) = exp2(g_r - g_s). For the pairs with
s before r's block (the blocks form of research/b7_blocks.py, the candidate measured level
with fla under strong gates):

    x_q[r]  = sum_s dAqk[r, s] k_s f(r, s)                       (dq's part)
    x_kr[r] = sum_s dAkk[r, s] k_s f(r, s)                       (dk's row part, beta_r not applied)
    x_c[s]  = sum_r (dAqk[r, s] q_r + dAkk[r, s] beta_r k_r) f(r, s)   (dk's column part)

Each is a product of 16-row blocks through two anchors, every factor at most 1:
- Row role, per block j < 3 (n_j = 16 (j + 1)): dA's columns of block j times kx_j = k
  exp2(g[n_j] - g) on block j's rows. The rows after block j take it times exp2(g[a(r)] -
  g[n_j]); at the end every row takes exp2(g_r - g[a(r)]).
- Column role, per block i > 0 (a_i = 16 i): dA's rows of block i, transposed, times yq_i = q
  exp2(g - g[a_i]) and yk_i = beta k exp2(g - g[a_i]) on block i's rows. The columns before
  block i take it times exp2(g[a_i] - g[n(s)]); at the end every column takes exp2(g[n(s)] - g_s).

dA's tiles, split, lie once in shared memory. They are the A operand of the row role as they
lie (M = r, K = s) and of the column role read MN-major (M = s, K = r), the same bytes. The
B operands are built on chip, split, as [64 channels, 64 rows] K-major tiles, a block's rows
its k block: 128-byte rows, never the 32-byte rows that read past their end on the H200.
Each block takes three wgmmas a dA into a fresh accumulator, then the scaling in registers.

Layout: dAqk, dAkk [NCH * 64, 64] fp32; q, k [NCH * 64, K] bf16; g [NCH * 64, K] fp32; beta
[NCH * 64] fp32; out x_q, x_kr, x_c [NCH * 64, K] fp32.

    python -m research.b7_cute_probe compile [dir]   # sm_90a offline (CuTe DSL installed): rows
    python -m research.b7_cute_probe gpu             # against float64 and the twin, then timed
"""


import json
import os
import sys

BT, KH, BC = 64, 64, 16  # chunk rows, a CTA's K half, the row block
NB = BT // BC
BUILDS = (True, False)  # split: the three-product split first, one bf16 product second


def build(K: int = 128, split: bool = True):
    """The probe's host function (a ``cute.jit``) for K = 2 KH: one CTA of 128 threads a
    (K half, chunk-head)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    assert K == 2 * KH
    bf16, f32 = cutlass.BFloat16, cutlass.Float32

    def _parts(x):
        """(hi, lo): x's bf16 rounding and the bf16 rounding of what it left."""
        hi = x.to(bf16)
        return hi, (x - hi.to(f32)).to(bf16)

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
               beta: cute.Tensor, x_q: cute.Tensor, x_kr: cute.Tensor, x_c: cute.Tensor, mma: cute.TiledMma,
               mma_z: cute.TiledMma, mma_t: cute.TiledMma, mma_tz: cute.TiledMma, a_l: cute.ComposedLayout,
               at_l: cute.ComposedLayout, b_l: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        half, chunk, _ = cute.arch.block_idx()
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
            # the B operands [64 channels, 64 rows], K-major, a block's rows its k block (128-byte
            # rows: no operand with 32-byte rows, the shape read past its end on the H200,
            # docs/log/prep.md): kx_j on blocks 0-2 (row role), yq_i and yk_i on blocks 1-3 (column role)
            xh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            xl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            yqh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            yql: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            ykh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            ykl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]

        storage = SmemAllocator().allocate(Smem)
        s_qh, s_ql, s_kh, s_kl = (getattr(storage, n).get_tensor(a_l.outer, swizzle=a_l.inner)
                                  for n in ("qh", "ql", "kh", "kl"))
        s_xh, s_xl, s_yqh, s_yql, s_ykh, s_ykl = (getattr(storage, n).get_tensor(b_l.outer, swizzle=b_l.inner)
                                                  for n in ("xh", "xl", "yqh", "yql", "ykh", "ykl"))
        g_q = cute.local_tile(dAqk, (BT, BT), (chunk, 0))
        g_k = cute.local_tile(dAkk, (BT, BT), (chunk, 0))
        g_qq = cute.local_tile(q, (BT, KH), (chunk, half))
        g_kk = cute.local_tile(k, (BT, KH), (chunk, half))
        g_g = cute.local_tile(g, (BT, KH), (chunk, half))
        # dA's columns of the first three blocks, split (the row role reads them for every row, the
        # column role for the rows of the last three blocks)
        for i in cutlass.range(tidx, BT * (BT - BC), 128, unroll=4):
            r = i // (BT - BC)
            s = i % (BT - BC)
            hi, lo = _parts(g_q[r, s])
            s_qh[r, s, 0] = hi
            s_ql[r, s, 0] = lo
            hi, lo = _parts(g_k[r, s])
            s_kh[r, s, 0] = hi
            s_kl[r, s, 0] = lo
        # the B operands (n = channel, k = row), split: kx_j = k exp2(g[n_j] - g) on the rows of
        # block j < 3; yq_i = q exp2(g - g[a_i]) and yk_i = beta k exp2(g - g[a_i]) on the rows of
        # block i > 0
        for i in cutlass.range(tidx, (NB - 1) * BC * KH, 128, unroll=2):
            j = i // (BC * KH)
            row = i % (BC * KH) // KH
            c = i % KH
            s = j * BC + row
            hi, lo = _parts(g_kk[s, c].to(f32) * cute.arch.exp2(g_g[(j + 1) * BC, c] - g_g[s, c]))
            s_xh[c, s, 0] = hi
            s_xl[c, s, 0] = lo
            r = s + BC  # (block j + 1)
            down = cute.arch.exp2(g_g[r, c] - g_g[(j + 1) * BC, c])
            hi, lo = _parts(g_qq[r, c].to(f32) * down)
            s_yqh[c, r, 0] = hi
            s_yql[c, r, 0] = lo
            hi, lo = _parts(beta[chunk * BT + r] * g_kk[r, c].to(f32) * down)
            s_ykh[c, r, 0] = hi
            s_ykl[c, r, 0] = lo
        cute.arch.fence_view_async_shared()  # (the generic proxy's stores seen by the wgmmas)
        cute.arch.sync_threads()

        thr_c = mma.get_slice(tidx)
        shape = thr_c.partition_C(g_g).shape
        coords = thr_c.partition_C(cute.make_identity_tensor((BT, KH)))

        b_tiles = (s_xh, s_xl, s_yqh, s_yql, s_ykh, s_ykl)
        # row role: rows r after block j take dA[r, block j] kx_j, through the anchors a(r), n_j
        r_a, r_b = _fragments(mma, (s_qh, s_ql, s_kh, s_kl), b_tiles)
        p_q = cute.make_rmem_tensor(shape, f32)  # (wgmma accumulators: each block's products)
        p_k = cute.make_rmem_tensor(shape, f32)
        o_q = cute.make_rmem_tensor(shape, f32)  # (the sums: registers the wgmmas never touch)
        o_k = cute.make_rmem_tensor(shape, f32)
        g_a = cute.make_rmem_tensor(shape, f32)
        o_q.fill(0.0)
        o_k.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(shape)):
            r, c = coords[i]
            g_a[i] = g_g[r // BC * BC, c]
        for j in cutlass.range_constexpr(NB - 1):
            warpgroup.fence()
            _products(mma, mma_z, p_q, r_a[0], r_a[1], r_b[0], r_b[1], j, j, True)
            _products(mma, mma_z, p_k, r_a[2], r_a[3], r_b[0], r_b[1], j, j, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            n = (j + 1) * BC
            for i in cutlass.range_constexpr(cute.size(shape)):
                r, c = coords[i]
                if r >= n:
                    e = cute.arch.exp2(g_a[i] - g_g[n, c])
                    o_q[i] = o_q[i] + e * p_q[i]
                    o_k[i] = o_k[i] + e * p_k[i]
        for i in cutlass.range_constexpr(cute.size(shape)):
            r, c = coords[i]
            down = cute.arch.exp2(g_g[r, c] - g_a[i])
            o_q[i] = o_q[i] * down
            o_k[i] = o_k[i] * down
        thr_c.partition_C(cute.local_tile(x_q, (BT, KH), (chunk, half))).store(o_q.load())
        thr_c.partition_C(cute.local_tile(x_kr, (BT, KH), (chunk, half))).store(o_k.load())

        # column role: columns s before block i take dA[block i, s]^T (yq_i + yk_i), through the
        # anchors a_i and n(s), the first row of s's next block
        r_a, r_b = _fragments(mma_t, [getattr(storage, n).get_tensor(at_l.outer, swizzle=at_l.inner)
                                       for n in ("qh", "ql", "kh", "kl")], b_tiles)
        p_c = cute.make_rmem_tensor(shape, f32)
        o_c = cute.make_rmem_tensor(shape, f32)
        g_n = cute.make_rmem_tensor(shape, f32)
        o_c.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(shape)):
            s, c = coords[i]
            g_n[i] = g_g[cutlass.min(s // BC * BC + BC, BT - 1), c]  # (rows of the last block: unused)
        for i_b in cutlass.range_constexpr(1, NB):
            warpgroup.fence()
            _products(mma_t, mma_tz, p_c, r_a[0], r_a[1], r_b[2], r_b[3], i_b, i_b, True)
            _products(mma_t, mma_tz, p_c, r_a[2], r_a[3], r_b[4], r_b[5], i_b, i_b, False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(shape)):
                s, c = coords[i]
                if s < i_b * BC:
                    o_c[i] = o_c[i] + cute.arch.exp2(g_g[i_b * BC, c] - g_n[i]) * p_c[i]
        for i in cutlass.range_constexpr(cute.size(shape)):
            s, c = coords[i]
            if s < BT - BC:
                o_c[i] = o_c[i] * cute.arch.exp2(g_n[i] - g_g[s, c])
        thr_c.partition_C(cute.local_tile(x_c, (BT, KH), (chunk, half))).store(o_c.load())

    @cute.jit
    def probe(dAqk: cute.Tensor, dAkk: cute.Tensor, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor,
              beta: cute.Tensor, x_q: cute.Tensor, x_kr: cute.Tensor, x_c: cute.Tensor, stream: cuda.CUstream):
        k_major, mn_major = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR
        mma, mma_z = (sm90.make_trivial_tiled_mma(bf16, bf16, k_major.sm90_mma_major_mode(),
                                                  k_major.sm90_mma_major_mode(), f32, (1, 1, 1), tiler_mn=(BT, KH))
                      for _ in range(2))
        mma_t, mma_tz = (sm90.make_trivial_tiled_mma(bf16, bf16, mn_major.sm90_mma_major_mode(),
                                                     k_major.sm90_mma_major_mode(), f32, (1, 1, 1),
                                                     tiler_mn=(BT, KH)) for _ in range(2))
        a_l = sm90.make_smem_layout_a(k_major, (BT, KH, BT), bf16, 1)  # dA: (M = r, K = s)
        at_l = sm90.make_smem_layout_a(mn_major, (BT, KH, BT), bf16, 1)  # the same bytes as (M = s, K = r)
        b_l = sm90.make_smem_layout_b(k_major, (BT, KH, BT), bf16, 1)  # (N = c, K = row)
        nch = cute.size(k, mode=[0]) // BT
        kernel(dAqk, dAkk, q, k, g, beta, x_q, x_kr, x_c, mma, mma_z, mma_t, mma_tz, a_l, at_l, b_l).launch(
            grid=(2, nch, 1), block=(128, 1, 1), stream=stream)

    return probe


ARGS = ("dAqk", "dAkk", "q", "k", "g", "beta", "x_q", "x_kr", "x_c")  # the probe's tensors, in its order


def _tensors(nch: int, K: int, device: str, seed: int = 0) -> dict:
    """dAqk (lower, with its diagonal), dAkk (strictly lower), q and k, g (the chunk cumsum of
    a log2 decay of 0-0.3 a token and channel: strong enough that the blocks' anchors
    matter), beta; and the outputs, NaN."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.arange(BT, device=device)
    lower = rows[:, None] >= rows[None, :]
    dAqk = torch.randn(nch, BT, BT, generator=gen, device=device) * lower
    dAkk = torch.randn(nch, BT, BT, generator=gen, device=device) * (rows[:, None] > rows[None, :])
    q, k = ((torch.randn(nch * BT, K, generator=gen, device=device) * K ** -0.5).bfloat16() for _ in range(2))
    g = -(torch.rand(nch, BT, K, generator=gen, device=device) * 0.3).cumsum(1)
    beta = torch.rand(nch * BT, generator=gen, device=device)
    out = {n: torch.full((nch * BT, K), float("nan"), device=device) for n in ("x_q", "x_kr", "x_c")}
    return {"dAqk": dAqk.view(nch * BT, BT), "dAkk": dAkk.view(nch * BT, BT), "q": q, "k": k,
            "g": g.view(nch * BT, K), "beta": beta, **out}


def want(dAqk, dAkk, q, k, g, beta) -> tuple:
    """x_q, x_kr and x_c in float64 from their definitions, over the pairs (r, s) with s before
    r's block and the factor exp2(g_r - g_s): x_q[r] = sum_s dAqk[r, s] k_s, x_kr[r] = sum_s
    dAkk[r, s] k_s (dk's row part, beta_r not applied), x_c[s] = sum_r dAqk[r, s] q_r + dAkk[r,
    s] beta_r k_r (dk's column part)."""
    import torch

    n, K = k.shape[0] // BT, k.shape[1]
    rows = torch.arange(BT, device=k.device)
    across = (rows[None, :] < (rows[:, None] // BC * BC)).double()  # [r, s]: s before r's block
    qq, kk, gg = q.double().view(n, BT, K), k.double().view(n, BT, K), g.double().view(n, BT, K)
    bk = beta.double().view(n, BT, 1) * kk
    f = torch.exp2(gg[:, :, None, :] - gg[:, None, :, :])  # [n, r, s, c]
    dq_, dk_ = (dA.double().view(n, BT, BT) * across for dA in (dAqk, dAkk))
    x_q, x_kr = (torch.einsum("nrs,nrsc,nsc->nrc", d, f, kk) for d in (dq_, dk_))
    x_c = torch.einsum("nrs,nrsc,nrc->nsc", dq_, f, qq) + torch.einsum("nrs,nrsc,nrc->nsc", dk_, f, bk)
    return tuple(x.reshape(n * BT, K) for x in (x_q, x_kr, x_c))


def twin(dAqk, dAkk, q, k, g, beta, split: bool = True) -> tuple:
    """The kernel's arithmetic in torch (fp32, its bf16 roundings). Row role, per block j < 3:
    kx_j and dA's columns split (or rounded), the products, the rows after block j scaled
    through their anchors; then each row's own factor. Column role, per block i > 0: yq_i, yk_i
    and dA's rows split, the products with dA^T, the columns before block i scaled; then each
    column's own factor. The GPU check holds the kernel to it and to ``want``; the CPU tests
    hold it to ``want`` and ``want`` to the package's reference B7."""
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

    d_q, d_k = (dA.float().view(n, BT, BT) for dA in (dAqk, dAkk))
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
    return tuple(x.reshape(n * BT, K) for x in out)


def compile_offline(nch: int = 4, K: int = 128, split: bool = True, dump: str | None = None):
    """Trace and compile for sm_90a with no GPU: the PTX and cubin land in ``dump``."""
    if dump:
        os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=dump)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    t = _tensors(nch, K, "cpu")
    return cute.compile(build(K, split), *[from_dlpack(t[n], assumed_align=16) for n in ARGS], cuda.CUstream(0))


def sm90_row(dump: str, split: bool) -> dict:
    """Registers, spills and ptxas's notes (research.b6_cute_probe.ptxas_report), and the wgmma
    count of the PTX."""
    from research.b6_cute_probe import ptxas_report

    report = ptxas_report(dump)
    return {"kind": "compile_sm90", "kernel": "b7_cute_probe", "split": split, "threads": 128,
            **{n: v for n, v in report.items() if n != "ptx"}, "wgmma": report["ptx"].count("wgmma.mma_async")}


def gpu_run(nch: int = 32768, K: int = 128, split: bool = True, reps: int = 20) -> dict:
    """On a GPU: x_q, x_kr and x_c against float64 and against the twin on 64 chunk-heads
    spread over all, then the CUDA-event time at ``nch`` chunk-heads against the bytes it
    moves."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    t = _tensors(nch, K, "cuda")
    args = [from_dlpack(t[n], assumed_align=16) for n in ARGS]
    args.append(cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    run = cute.compile(build(K, split), *args)
    run(*args)
    torch.cuda.synchronize()
    sel = torch.linspace(0, nch - 1, min(nch, 64), device="cuda").round().long()
    pick = lambda x: x.view(nch, BT, -1)[sel].reshape(len(sel) * BT, -1).squeeze(-1)  # noqa: E731
    ins = [pick(t[n]) for n in ("dAqk", "dAkk", "q", "k", "g", "beta")]
    wants, twins = want(*ins), twin(*ins, split=split)
    def rel(got, w):
        return ((got.double() - w.double()).square().mean() / w.double().square().mean()).sqrt().item()

    errors = {}
    for name, w, tw in zip(("x_q", "x_kr", "x_c"), wants, twins):
        got = pick(t[name])
        errors.update({name: rel(got, w), f"twin_{name}": rel(tw, w), f"{name}_vs_twin": rel(got, tw)})
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[reps // 2]
    # dAqk and dAkk once (the second K half's from L2), q and k (bf16), g (fp32), beta; three outputs
    moved = nch * (2 * BT * BT * 4 + 2 * BT * K * 2 + BT * K * 4 + BT * 4 + 3 * BT * K * 4)
    return {"kind": "gpu", "kernel": "b7_cute_probe", "split": split, "chunk_heads": nch, "errors": errors,
            "finite": all(bool(torch.isfinite(t[n]).all()) for n in ("x_q", "x_kr", "x_c")), "ms": ms,
            "bytes": moved, "TB_s": moved / ms / 1e9, "gpu": torch.cuda.get_device_name()}


def main(argv=None) -> int:
    import subprocess

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:  # each build in a process of its own (CuTe DSL reads its dump folder once)
        dump = argv[1] if len(argv) > 1 else "/tmp/b7_cute_probe"
        for split in BUILDS:
            sub = os.path.join(dump, "split" if split else "single")
            os.makedirs(sub, exist_ok=True)
            for old in os.listdir(sub):
                os.remove(os.path.join(sub, old))
            subprocess.run([sys.executable, "-m", "research.b7_cute_probe", "compile-one", str(int(split)), sub],
                           check=True, stdout=subprocess.DEVNULL)
            print(json.dumps(sm90_row(sub, split)))
        return 0
    if argv[:1] == ["compile-one"]:
        compile_offline(split=bool(int(argv[1])), dump=argv[2])
        return 0
    if argv[:1] == ["gpu"]:
        for split in BUILDS:
            print(json.dumps(gpu_run(split=split)), flush=True)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
