"""F1, the l2norm of q and k (x / sqrt(sum x^2 + 1e-6) by row, and each row's rstd), in one
launch with a pinned block. A candidate for the forward's first stage; not registered.

Why: F1 moves 2.16 GB at prod8192_gate, a 0.51 ms floor on the H200 (0.65 on the H100), and
fla's two l2norm launches reach it in fla's own runs (0.51 ms). In kernel-fun's chain the same
two launches take 0.77-1.01 ms on the H200 and 0.89-1.77 on the H100, run to run
(benchmarks/results/chunk_kda.jsonl, stage F1). F2 beside it, the same kind of pass, holds to
0.57 in every run. fla autotunes F1's kernel over 25 (rows, warps) configs keyed on D and the
rows' count, so a process can settle on a slow one; this kernel takes no autotune, and q and k
share the launch.

This kernel: a program normalizes BR rows of q or of k (the first half of the grid q's, the
second k's), each row's K channels in one [BR, BK] block (BK the power of two at or above K,
masked), fp32 sums. Numerics as fla's kernel: x in fp32, rstd = 1 / sqrt(sum x^2 + eps),
y = x rstd rounded to x's dtype, rstd fp32. Only the order of the row's sum may differ
(Triton's reduction tree follows the block's layout), a last-place difference in rstd.

Predicted on the H200 at prod8192_gate: within 10% of the floor, ~0.55 ms, against 0.77-1.01
for the chain's F1 now. That is 0.2-0.45 ms of the forward's 8.08. Falls back (``supports``)
for K above 512 or a non-contiguous row layout.

    python -m research.l2norm_fwd gpu [--out FILE]   # parity against fla's and float64, then
                                                      # timed against fla's two launches
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kernel_fun._triton import to

EPS = 1e-6
BR, WARPS = 32, 4  # rows a program and its warps: 8 KB of bf16 in at K = 128


@triton.jit
def _rows(x, y, rstd, row0, R, eps, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    rows = row0 + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m_r = rows < R
    m = m_r[:, None] & (cols[None, :] < K)
    off = rows.to(tl.int64)[:, None] * K + cols[None, :]
    b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    b_r = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + off, to(b_x * b_r[:, None], y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, b_r, mask=m_r)


@triton.jit
def _l2norm_qk(q, k, qn, kn, q_rstd, k_rstd, R, nb, eps, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < nb:
        _rows(q, qn, q_rstd, pid * BR, R, eps, K, BR, BK)
    else:
        _rows(k, kn, k_rstd, (pid - nb) * BR, R, eps, K, BR, BK)


def supports(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """None when ``l2norm_fwd`` takes the call, else why not."""
    if q.shape != k.shape:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} differ"
    if q.shape[-1] > 512:
        return f"K={q.shape[-1]} (one block a row: K up to 512)"
    if not (q.is_contiguous() and k.is_contiguous()):
        return "q and k as dense rows"
    if q.dtype != k.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"q {q.dtype}, k {k.dtype}"
    return None


def l2norm_fwd(q: torch.Tensor, k: torch.Tensor, br: int = BR, warps: int = WARPS):
    """F1's contract: (q normalized, q's rstd [..., ] fp32, k normalized, k's rstd)."""
    K = q.shape[-1]
    R = q.numel() // K
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    q_rstd = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    k_rstd = torch.empty(k.shape[:-1], dtype=torch.float32, device=k.device)
    nb = triton.cdiv(R, br)
    if R:
        _l2norm_qk[(2 * nb,)](q, k, qn, kn, q_rstd, k_rstd, R, nb, EPS, K=K, BR=br, BK=triton.next_power_of_2(K),
                              num_warps=warps)
    return qn, q_rstd, kn, k_rstd


def gpu(out: str | None = None) -> list[dict]:
    """On a GPU at prod8192_gate's q and k ([16, 8192, 16, 128] bf16): each (rows, warps) block
    against fla's ``l2norm_fwd`` on q then k (bits, and both against float64), then timed
    interleaved with it (CUDA events, median), and against the bytes' floor."""
    import statistics

    from fla.modules.l2norm import l2norm_fwd as fla_fwd

    from research import emit_row
    from kernel_fun.bench.timing import cuda_times
    from kernel_fun.kda import reference as ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (16, 8192, 16, 128)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def theirs():
        a, ar = fla_fwd(q)
        b, br_ = fla_fwd(k)
        return a, ar, b, br_

    want = theirs()
    exact = [ref.l2norm_fwd(x.double()) for x in (q, k)]
    exact = (exact[0][0], exact[0][1], exact[1][0], exact[1][1])
    moved = 2 * q.numel() * 2 * 2 + 2 * q.numel() // shape[-1] * 4
    rows = []
    for br, warps in ((32, 4), (16, 4), (64, 8), (32, 8), (8, 2)):
        got = l2norm_fwd(q, k, br, warps)
        torch.cuda.synchronize()
        row = {"kind": "gpu", "kernel": "l2norm_fwd", "shape": list(shape), "br": br, "warps": warps,
               "vs_fla_bits": [int((a != b).sum()) for a, b in zip(got, want)],
               "vs_fla": [ref.rel_rms(a, b) for a, b in zip(got, want)],
               "vs_exact": [ref.rel_rms(a, b) for a, b in zip(got, exact)],
               "fla_vs_exact": [ref.rel_rms(a, b) for a, b in zip(want, exact)]}
        ours_t, fla_t = [], []
        for _ in range(3):  # (interleaved rounds)
            ours_t += cuda_times(lambda: l2norm_fwd(q, k, br, warps), 20)
            fla_t += cuda_times(theirs, 20)
        row.update(ms=statistics.median(ours_t), fla_ms=statistics.median(fla_t), bytes=moved,
                   TB_s=moved / statistics.median(ours_t) / 1e9, gpu=torch.cuda.get_device_name())
        rows.append(emit_row(row, out))
    return rows


if __name__ == "__main__":
    from research import gpu_main

    gpu_main(gpu, sys.argv)
