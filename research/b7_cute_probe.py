"""B7's row sums across 16-row blocks, on chip in CuTe DSL (sm_90a): the first piece of B7 for
the fused backward kernel (docs/log/bwd-fused.md, step 6). Not registered; compiled offline,
not yet run.

CuTe DSL 4.8.1 has no tf32 warpgroup MMA for Hopper: its warpgroup ops take bf16/fp16, fp8
and int8; tf32 is only in the sm80 warp MMA and in Blackwell's tcgen05. So where the Triton
kernels take three tf32 products (``dot3``), this takes three bf16 ones. Each fp32 operand
is split into a bf16 high part and a bf16 remainder, and the product is hi*hi + hi*lo + lo*hi
(``split``; the lo*lo term, about 2^-16 of the product, is dropped). Without ``split``, one
bf16 product.

For one chunk-head's K half (a CTA of one warpgroup), g is the chunk cumsum in log2
(non-increasing). The rows fall in four blocks of 16; a(r) is the first row of r's block and
n_j = 16 (j + 1). Then:

    x[r, c] = sum over s in the blocks before r's of dA[r, s] k[s, c] exp2(g[r, c] - g[s, c])
            = exp2(g[r, c] - g[a(r), c])
              * sum over j with n_j <= r of exp2(g[a(r), c] - g[n_j, c]) (dA[r, block j] kx_j)[r, c],
    kx_j[s, c] = k[s, c] exp2(g[n_j, c] - g[s, c])    (s in block j)

Every factor is at most 1. This is the row role across blocks of research/b7_blocks.py, the
candidate measured level with fla under strong gates. dA is dAqk (dq's part) and dAkk (dk's
row part), the two sharing kx. Per block j:
- dA's columns of block j are the A operand: k block j of the [64, 64] tile in shared memory,
  hi and lo.
- kx_j, built on chip, is the B operand: [64 channels, 16 rows], K-major, hi and lo.
- Three wgmmas a dA into a fresh accumulator, then the scaling in registers.

Layout: dAqk, dAkk [NCH * 64, 64] fp32; k [NCH * 64, K] bf16; g [NCH * 64, K] fp32; out
x_q, x_kr [NCH * 64, K] fp32.

    python -m research.b7_cute_probe compile [dir]   # sm_90a offline (CuTe DSL installed): rows
    python -m research.b7_cute_probe gpu             # against float64, then timed
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

    @cute.kernel
    def kernel(dAqk: cute.Tensor, dAkk: cute.Tensor, k: cute.Tensor, g: cute.Tensor, x_q: cute.Tensor,
               x_kr: cute.Tensor, mma: cute.TiledMma, mma_z: cute.TiledMma, a_l: cute.ComposedLayout,
               b_l: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        half, chunk, _ = cute.arch.block_idx()
        mma.set(warpgroup.Field.ACCUMULATE, True)  # (two MMAs, their field set here once: see
        mma_z.set(warpgroup.Field.ACCUMULATE, False)  # research.b6_cute_probe's _Mma)

        @cute.struct
        class Smem:
            qh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            kh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            kl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(a_l)], 1024]
            xh: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]
            xl: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(b_l)], 1024]

        storage = SmemAllocator().allocate(Smem)
        s_qh, s_ql, s_kh, s_kl = (getattr(storage, n).get_tensor(a_l.outer, swizzle=a_l.inner)
                                  for n in ("qh", "ql", "kh", "kl"))
        s_xh, s_xl = (getattr(storage, n).get_tensor(b_l.outer, swizzle=b_l.inner) for n in ("xh", "xl"))
        g_q = cute.local_tile(dAqk, (BT, BT), (chunk, 0))
        g_k = cute.local_tile(dAkk, (BT, BT), (chunk, 0))
        g_kk = cute.local_tile(k, (BT, KH), (chunk, half))
        g_g = cute.local_tile(g, (BT, KH), (chunk, half))
        # dA's tiles, split, as the A operand (rows r, k = columns s); only the columns of the
        # first three blocks are read
        for i in cutlass.range(tidx, BT * (BT - BC), 128, unroll=4):
            r = i // (BT - BC)
            s = i % (BT - BC)
            hi, lo = _parts(g_q[r, s])
            s_qh[r, s, 0] = hi
            s_ql[r, s, 0] = lo
            hi, lo = _parts(g_k[r, s])
            s_kh[r, s, 0] = hi
            s_kl[r, s, 0] = lo
        # kx_j for the first three blocks, split, as the B operand (n = channel, k = row in block j)
        for i in cutlass.range(tidx, (NB - 1) * BC * KH, 128, unroll=4):
            j = i // (BC * KH)
            s = j * BC + i % (BC * KH) // KH
            c = i % KH
            hi, lo = _parts(g_kk[s, c].to(f32) * cute.arch.exp2(g_g[(j + 1) * BC, c] - g_g[s, c]))
            s_xh[c, s - j * BC, j] = hi
            s_xl[c, s - j * BC, j] = lo
        cute.arch.fence_view_async_shared()  # (the generic proxy's stores seen by the wgmmas)
        cute.arch.sync_threads()

        thr = mma.get_slice(0)
        thr_c = mma.get_slice(tidx)
        r_qh, r_ql, r_kh, r_kl = (mma.make_fragment_A(thr.partition_A(t)) for t in (s_qh, s_ql, s_kh, s_kl))
        r_xh, r_xl = (mma.make_fragment_B(thr.partition_B(t)) for t in (s_xh, s_xl))
        shape = thr_c.partition_C(g_g).shape
        p_q = cute.make_rmem_tensor(shape, f32)  # (wgmma accumulators: each block's products)
        p_k = cute.make_rmem_tensor(shape, f32)
        o_q = cute.make_rmem_tensor(shape, f32)  # (the sums: registers the wgmmas never touch)
        o_k = cute.make_rmem_tensor(shape, f32)
        g_a = cute.make_rmem_tensor(shape, f32)
        o_q.fill(0.0)
        o_k.fill(0.0)
        coords = thr_c.partition_C(cute.make_identity_tensor((BT, KH)))
        for i in cutlass.range_constexpr(cute.size(shape)):
            r, c = coords[i]
            g_a[i] = g_g[r // BC * BC, c]
        for j in cutlass.range_constexpr(NB - 1):
            warpgroup.fence()
            for p, a_hi, a_lo in ((p_q, r_qh, r_ql), (p_k, r_kh, r_kl)):
                at_a, at_b = (None, None, j, 0), (None, None, 0, j)
                cute.gemm(mma_z, p, a_hi[at_a], r_xh[at_b], p)
                if cutlass.const_expr(split):
                    cute.gemm(mma, p, a_hi[at_a], r_xl[at_b], p)
                    cute.gemm(mma, p, a_lo[at_a], r_xh[at_b], p)
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

    @cute.jit
    def probe(dAqk: cute.Tensor, dAkk: cute.Tensor, k: cute.Tensor, g: cute.Tensor, x_q: cute.Tensor,
              x_kr: cute.Tensor, stream: cuda.CUstream):
        k_major = LayoutEnum.ROW_MAJOR
        mma, mma_z = (sm90.make_trivial_tiled_mma(bf16, bf16, k_major.sm90_mma_major_mode(),
                                                  k_major.sm90_mma_major_mode(), f32, (1, 1, 1), tiler_mn=(BT, KH))
                      for _ in range(2))
        a_l = sm90.make_smem_layout_a(k_major, (BT, KH, BT), bf16, 1)  # dA: (M = r, K = s), one stage
        b_l = sm90.make_smem_layout_b(k_major, (BT, KH, BC), bf16, NB - 1)  # kx_j: (N = c, K = s), a stage a block
        nch = cute.size(k, mode=[0]) // BT
        kernel(dAqk, dAkk, k, g, x_q, x_kr, mma, mma_z, a_l, b_l).launch(grid=(2, nch, 1), block=(128, 1, 1),
                                                                           stream=stream)

    return probe


def _tensors(nch: int, K: int, device: str, seed: int = 0) -> dict:
    """dAqk (lower, with its diagonal), dAkk (strictly lower), k, g (the chunk cumsum of a log2
    decay of 0-0.3 a token and channel: strong enough that the blocks' anchors matter)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.arange(BT, device=device)
    lower = rows[:, None] >= rows[None, :]
    dAqk = torch.randn(nch, BT, BT, generator=gen, device=device) * lower
    dAkk = torch.randn(nch, BT, BT, generator=gen, device=device) * (rows[:, None] > rows[None, :])
    k = (torch.randn(nch * BT, K, generator=gen, device=device) * K ** -0.5).bfloat16()
    g = -(torch.rand(nch, BT, K, generator=gen, device=device) * 0.3).cumsum(1)
    return {"dAqk": dAqk.view(nch * BT, BT), "dAkk": dAkk.view(nch * BT, BT), "k": k, "g": g.view(nch * BT, K)}


def want(dAqk, dAkk, k, g) -> tuple:
    """x_q and x_kr in float64, from their definition (pairs s < a(r), the factor exp2(g_r - g_s))."""
    import torch

    n, K = k.shape[0] // BT, k.shape[1]
    rows = torch.arange(BT, device=k.device)
    across = (rows[None, :] < (rows[:, None] // BC * BC)).double()  # s before r's block
    kk, gg = k.double().view(n, BT, K), g.double().view(n, BT, K)
    f = torch.exp2(gg[:, :, None, :] - gg[:, None, :, :])  # [n, r, s, c]
    out = []
    for dA in (dAqk, dAkk):
        d = dA.double().view(n, BT, BT) * across
        out.append(torch.einsum("nrs,nrsc,nsc->nrc", d, f, kk).reshape(n * BT, K))
    return tuple(out)


def twin(dAqk, dAkk, k, g, split: bool = True) -> tuple:
    """The kernel's arithmetic in torch (fp32, its bf16 roundings): per block j, kx_j and dA's
    columns split (or rounded), the products, the anchored scaling of the rows after block j,
    then each row's own factor. The GPU check holds the kernel to it and to ``want``; the CPU
    tests hold it to ``want`` and ``want`` to the package's reference B7."""
    import torch

    n, K = k.shape[0] // BT, k.shape[1]
    kk, gg = k.float().view(n, BT, K), g.float().view(n, BT, K)
    rows = torch.arange(BT, device=k.device)
    g_a = gg[:, rows // BC * BC]  # each row's block's first row

    def parts(x):
        hi = x.bfloat16().float()
        return hi, (x - hi).bfloat16().float()

    out = []
    for dA in (dAqk, dAkk):
        d = dA.float().view(n, BT, BT)
        acc = torch.zeros(n, BT, K, device=k.device)
        for j in range(NB - 1):
            blk, nj = slice(j * BC, (j + 1) * BC), (j + 1) * BC
            kx = kk[:, blk] * torch.exp2(gg[:, nj:nj + 1] - gg[:, blk])
            (a_hi, a_lo), (b_hi, b_lo) = parts(d[:, :, blk]), parts(kx)
            prod = a_hi @ b_hi + ((a_hi @ b_lo + a_lo @ b_hi) if split else 0)
            later = (rows >= nj)[None, :, None]
            acc = acc + torch.where(later, torch.exp2(g_a - gg[:, nj:nj + 1]), 0.0) * prod
        out.append((acc * torch.exp2(gg - g_a)).reshape(n * BT, K))
    return tuple(out)


def compile_offline(nch: int = 4, K: int = 128, split: bool = True, dump: str | None = None):
    """Trace and compile for sm_90a with no GPU: the PTX and cubin land in ``dump``."""
    if dump:
        os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=dump)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    t = _tensors(nch, K, "cpu")
    args = [from_dlpack(x, assumed_align=16) for x in (t["dAqk"], t["dAkk"], t["k"], t["g"],
                                                        torch.zeros(nch * BT, K), torch.zeros(nch * BT, K))]
    return cute.compile(build(K, split), *args, cuda.CUstream(0))


def sm90_row(dump: str, split: bool) -> dict:
    """Registers, spills and ptxas's notes (research.b6_cute_probe.ptxas_report), and the wgmma
    count of the PTX."""
    from research.b6_cute_probe import ptxas_report

    report = ptxas_report(dump)
    return {"kind": "compile_sm90", "kernel": "b7_cute_probe", "split": split, "threads": 128,
            **{n: v for n, v in report.items() if n != "ptx"}, "wgmma": report["ptx"].count("wgmma.mma_async")}


def gpu_run(nch: int = 32768, K: int = 128, split: bool = True, reps: int = 20) -> dict:
    """On a GPU: x_q and x_kr against float64 on 64 chunk-heads spread over all, then the
    CUDA-event time at ``nch`` chunk-heads against the bytes it moves."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    t = _tensors(nch, K, "cuda")
    x_q, x_kr = (torch.full((nch * BT, K), float("nan"), device="cuda") for _ in range(2))
    args = [from_dlpack(x, assumed_align=16) for x in (t["dAqk"], t["dAkk"], t["k"], t["g"], x_q, x_kr)]
    args.append(cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    run = cute.compile(build(K, split), *args)
    run(*args)
    torch.cuda.synchronize()
    sel = torch.linspace(0, nch - 1, min(nch, 64), device="cuda").round().long()
    pick = lambda x: x.view(nch, BT, -1)[sel].reshape(-1, x.shape[-1])  # noqa: E731
    w_q, w_kr = want(pick(t["dAqk"]), pick(t["dAkk"]), pick(t["k"]), pick(t["g"]))
    rel = lambda got, w: ((got.double() - w).square().mean() / w.square().mean()).sqrt().item()  # noqa: E731
    t_q, t_kr = twin(pick(t["dAqk"]), pick(t["dAkk"]), pick(t["k"]), pick(t["g"]), split)
    errors = {"x_q": rel(pick(x_q), w_q), "x_kr": rel(pick(x_kr), w_kr), "twin_x_q": rel(t_q, w_q),
              "twin_x_kr": rel(t_kr, w_kr), "x_q_vs_twin": rel(pick(x_q), t_q.double()),
              "x_kr_vs_twin": rel(pick(x_kr), t_kr.double())}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[reps // 2]
    moved = nch * (2 * BT * BT * 4 + BT * K * 2 + BT * K * 4 + 2 * BT * K * 4)
    return {"kind": "gpu", "kernel": "b7_cute_probe", "split": split, "chunk_heads": nch, "errors": errors,
            "finite": bool(torch.isfinite(x_q).all() and torch.isfinite(x_kr).all()), "ms": ms, "bytes": moved,
            "TB_s": moved / ms / 1e9, "gpu": torch.cuda.get_device_name()}


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
