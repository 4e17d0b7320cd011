"""F4, the diagonal 16x16 blocks of the forward's scores, on the tensor cores through an anchor
row, and F3-F6 around it with fla's F5 and F6 kernels. A candidate; not registered.

F4's outputs, for each chunk's four 16-row blocks (rows r, columns s of the same block, g the
chunk cumsum of the gate in log2 units, fla's definitions):
    Aqk[r, s]  = scale sum_c q[r, c] k[s, c] exp2(g[r, c] - g[s, c])   for s <= r (bf16)
    Akkd[r, s] = beta[r] sum_c k[r, c] k[s, c] exp2(g[r, c] - g[s, c]) for s < r  (fp32)
fla's F5 (``chunk_kda_fwd_kernel_inter_solve_fused``) reads them, forms the blocks below the
diagonal, solves (I + Akk)^-1 and writes it; F6 (``recompute_w_u_fwd``) forms w, u, kg and qg.

Where fla's time goes (H200, prod8192_gate, docs/log/prep.md and the roofline): fla's F4
(``chunk_kda_fwd_kernel_intra_token_parallel``) takes 1.64 ms against a 0.53 ms memory floor.
A program per token walks the token's block pairs one by one, an exp2 per (pair, channel):
~1,100 exp2 a token-head (0.55 ms of the H200's MUFU alone), each pair's k and g reloaded.

This kernel: a program per (chunk, value head), its four blocks in turn. Each block's pairs go
through the block's first row u, at or before every row it serves:
    q[r] exp2(g[r] - g[u]) . k[s] exp2(g[u] - g[s]),
one [16, K] x [K, 16] product each for Aqk and Akkd (``dot3``: three tf32 products, fp32-level),
2 exp2 a (token, channel). A row takes them where every factor its pairs meet stays within
2^64 (``GUARD_SPAN``, as B7's diagonal blocks: |g[s] - g[u]| for s <= r); a row past it (a
gate of more than 4 log2 units a token, or a NaN) takes its pairs one by one, each with its
own exp2, as fla's kernel does. Exact for any gate, and a row's values follow from it and the
rows before it, to the bit.

The rest of F3-F6 is fla's, called as fla's ``chunk_kda_fwd_intra`` calls it (fla 0.5.x).
Falls back (``supports``): safe_gate (fla's own MMA kernel for the diagonal), chunk size other
than 64, K over 256, fla other than 0.5.

Predicted on the H200 at prod8192_gate: F4 at 0.6-0.8 ms (its 2.3 GB at ~3.5 TB/s, the exp2
within it), against 1.64: F3-F6 4.91 to ~4.0 ms, the forward 8.08 to ~7.2.

    python -m research.f4_diag gpu [--out FILE]   # against fla's F4 and F3-F6, float64, timed
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kernel_fun._triton import GUARD_SPAN, chunk_head, dot3, to

BT, BC = 64, 16
BKS, WARPS = 32, 4  # the channels a slice, the warps a program: 149 registers, no spills (sm_90a)


@triton.jit
def _slice(q, k, g, p_qk, p_g, m_r, i_k, K: tl.constexpr, BK: tl.constexpr):
    """The block's rows of q, k and g in channel slice i_k, fp32 (rows past the chunk's end 0)."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m = m_r[:, None] & m_k[None, :]
    b_q = tl.load(q + p_qk + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_qk + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + p_g + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    return o_k, m_k, m, b_q, b_k, b_g


@triton.jit
def _block(q, k, g, beta, Aqk, Akkd, scale, r0, n, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, j0: tl.constexpr):
    """Block j0 // BC of the chunk whose first token row is r0 and token count n (> j0), its
    channels in slices of BK."""
    o_i = tl.arange(0, BC)
    rows = j0 + o_i  # (within the chunk; the block's columns are the same rows)
    m_r = rows < n
    t = (r0 + rows).to(tl.int64)  # token rows
    tu = (r0 + j0).to(tl.int64)  # the anchor: the block's first row, at or before every row it serves
    p_qk = (t * H + i_h)[:, None] * K
    p_g = (t * HV + i_hv)[:, None] * K
    b_b = tl.load(beta + t * HV + i_hv, mask=m_r, other=0.0).to(tl.float32)
    lower = rows[None, :] <= rows[:, None]  # [r, s]
    strict = rows[None, :] < rows[:, None]
    b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
    far = tl.zeros([BC], dtype=tl.float32)  # each row's largest |g - g[u]|
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k, m, b_q, b_k, b_g = _slice(q, k, g, p_qk, p_g, m_r, i_k, K, BK)
        b_gu = tl.load(g + (tu * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        # (rows past the chunk's end take the anchor's g: their factors 1, their q and k 0)
        d = tl.where(m, b_g - b_gu[None, :], 0.0)
        far = tl.maximum(far, tl.max(tl.abs(d), axis=1))
        far = tl.where(tl.sum(tl.where(d != d, 1, 0), axis=1) > 0, float("nan"), far)  # (a NaN stays one)
        up = tl.exp2(d)  # exp2(g[r] - g[u])
        b_kd = b_k * tl.exp2(-d)  # k[s] exp2(g[u] - g[s])
        b_Aqk = dot3(b_q * up, tl.trans(b_kd), b_Aqk)
        b_Akk = dot3(b_k * up, tl.trans(b_kd), b_Akk)
    b_Aqk = b_Aqk * scale
    b_Akk = b_Akk * b_b[:, None]
    # row r takes the anchored products where every factor its pairs meet is within 2^GUARD:
    # |g[s] - g[u]| <= GUARD_SPAN for every s <= r and channel (a NaN: not). The choice follows
    # from row r and the rows before it alone.
    bad = (far > GUARD_SPAN) | (far != far)
    row_bad = tl.sum(tl.where(lower & bad[None, :], 1, 0), axis=1) > 0  # [r]
    if tl.sum(row_bad.to(tl.int32), axis=0) > 0:  # a row past the guard: its pairs one by one
        p_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
        p_Akk = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(0, BC):
            ts = tl.minimum(r0 + j0 + j, r0 + n - 1).to(tl.int64)
            col = (o_i == j)[None, :]
            a_q = tl.zeros([BC], dtype=tl.float32)
            a_k = tl.zeros([BC], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k, m_k, m, b_q, b_k, b_g = _slice(q, k, g, p_qk, p_g, m_r, i_k, K, BK)
                b_ks = tl.load(k + (ts * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_gs = tl.load(g + (ts * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_f = tl.where(m, b_ks[None, :] * tl.exp2(b_g - b_gs[None, :]), 0.0)
                a_q += tl.sum(b_q * b_f, axis=1)
                a_k += tl.sum(b_k * b_f, axis=1)
            p_Aqk += tl.where(col, a_q[:, None] * scale, 0.0)
            p_Akk += tl.where(col, a_k[:, None] * b_b[:, None], 0.0)
        b_Aqk = tl.where(row_bad[:, None], p_Aqk, b_Aqk)
        b_Akk = tl.where(row_bad[:, None], p_Akk, b_Akk)
    b_Aqk = tl.where(lower, b_Aqk, 0.0)
    b_Akk = tl.where(strict, b_Akk, 0.0)
    p = (t * HV + i_hv)[:, None]
    tl.store(Aqk + p * BT + rows[None, :], to(b_Aqk, Aqk.dtype.element_ty), mask=m_r[:, None])
    tl.store(Akkd + p * BC + o_i[None, :], b_Akk, mask=m_r[:, None])


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T"])
def _diag_fwd(q, k, g, beta, Aqk, Akkd, scale, cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr,
              K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_hv, i_h, r0, n = chunk_head(cu_seqlens, chunk_indices, T, H, HV, BT, IS_VARLEN)
    if n > 0:
        _block(q, k, g, beta, Aqk, Akkd, scale, r0, n, i_h, i_hv, H, HV, K, BK, BC, BT, 0)
    if n > BC:
        _block(q, k, g, beta, Aqk, Akkd, scale, r0, n, i_h, i_hv, H, HV, K, BK, BC, BT, BC)
    if n > 2 * BC:
        _block(q, k, g, beta, Aqk, Akkd, scale, r0, n, i_h, i_hv, H, HV, K, BK, BC, BT, 2 * BC)
    if n > 3 * BC:
        _block(q, k, g, beta, Aqk, Akkd, scale, r0, n, i_h, i_hv, H, HV, K, BK, BC, BT, 3 * BC)


def diag_blocks(q, k, gc, beta, scale, cu_seqlens=None, chunk_indices=None, Aqk=None, Akkd=None, bk: int = BKS,
                warps: int = WARPS):
    """F4: (Aqk with its diagonal blocks written, Akkd [B, T, HV, 16] fp32). Rows past a
    sequence's end are not written; a diagonal block's entries above its diagonal are written
    0 (fla leaves them unwritten and its readers mask them)."""
    B, T, H, K = q.shape
    HV = gc.shape[2]
    if Aqk is None:
        Aqk = torch.empty(B, T, HV, BT, device=q.device, dtype=k.dtype)
    if Akkd is None:
        Akkd = torch.empty(B, T, HV, BC, device=q.device, dtype=torch.float32)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else chunk_indices.shape[0]
    if NT and B * HV:
        _diag_fwd[(NT, B * HV)](q, k, gc, beta, Aqk, Akkd, scale, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K,
                                BK=min(bk, triton.next_power_of_2(K)), BT=BT, BC=BC, num_warps=warps)
    return Aqk, Akkd


def supports(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate, disable_recompute):
    """None when ``intra`` takes the call, else why not."""
    from kernel_fun import _fla

    if safe_gate:
        return "safe_gate (fla's own kernel forms the diagonal blocks)"
    if chunk_size != BT:
        return f"chunk_size={chunk_size}"
    if q.shape[-1] > 256:
        return f"K={q.shape[-1]}"
    if cu_seqlens is not None and chunk_indices is None:
        return "packed sequences without their chunk_indices"
    if not q.is_cuda or _fla.version_tuple()[:2] != (0, 5):
        return "fla 0.5's F5 and F6 kernels on a GPU"
    return None


def intra(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate, disable_recompute):
    """F3-F6 with this F4: (w, u, kg, Aqk, Akk_inv, qg), the stage registry's contract."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_kernel_inter_solve_fused
    from fla.ops.kda.wy_fast import recompute_w_u_fwd

    B, T, H, K = k.shape
    HV = gc.shape[2]
    Aqk, Akkd = diag_blocks(q, k, gc, beta, scale, cu_seqlens, chunk_indices)
    Akk = torch.zeros(B, T, HV, BT, device=k.device, dtype=k.dtype)  # (F5 writes its lower triangle)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else chunk_indices.shape[0]
    chunk_kda_fwd_kernel_inter_solve_fused[(NT, B * HV)](
        q=q, k=k, g=gc, beta=beta, Aqk=Aqk, Akkd=Akkd, Akk=Akk, scale=scale, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, BT=BT, BC=BC, NC=BT // BC, USE_SAFE_GATE=False)
    w, u, qg, kg = recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, q=q if disable_recompute else None, gk=gc,
                                     cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    return w, u, kg, Aqk, Akk, qg


def exact_diag(q, k, gc, beta, scale, cu_seqlens=None):
    """F4's outputs in float64 from their definitions: (Aqk [B, T, HV, 64], its diagonal
    blocks' lower triangles and 0 elsewhere; Akkd [B, T, HV, 16], strictly lower, 0 elsewhere),
    chunks from each sequence's start."""
    B, T, H, K = q.shape
    HV = gc.shape[2]
    G = HV // H
    Aqk = torch.zeros(B, T, HV, BT, dtype=torch.float64, device=q.device)
    Akkd = torch.zeros(B, T, HV, BC, dtype=torch.float64, device=q.device)
    seqs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(x), int(y)) for x, y in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    for b, bos, eos in seqs:
        for c0 in range(bos, eos, BT):
            for j0 in range(c0, min(c0 + BT, eos), BC):
                rows = slice(j0, min(j0 + BC, c0 + BT, eos))
                qq = q[b, rows].double().repeat_interleave(G, 1)  # [n, HV, K]
                kk = k[b, rows].double().repeat_interleave(G, 1)
                gg = gc[b, rows].double()
                n = qq.shape[0]
                f = torch.exp2(gg[:, None] - gg[None, :])  # [r, s, HV, K]
                low = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
                aq = torch.einsum("rhc,rshc,shc->rhs", qq, f, kk) * scale
                ak = torch.einsum("rhc,rshc,shc->rhs", kk, f, kk) * beta[b, rows].double()[..., None]
                aq = torch.where(low[:, None, :], aq, 0.0)
                ak = torch.where((low & ~torch.eye(n, dtype=torch.bool, device=q.device))[:, None, :], ak, 0.0)
                Aqk[b, rows, :, j0 - c0:j0 - c0 + n] = aq
                Akkd[b, rows, :, :n] = ak
    return Aqk, Akkd


def positions(T: int, cu_seqlens=None, device="cpu"):
    """Each token's position within its sequence, [T] (one sequence of T, or the packed ones)."""
    starts = torch.zeros(T, dtype=torch.long, device=device)
    if cu_seqlens is not None:
        for x, y in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            starts[x:y] = x
    return torch.arange(T, device=device) - starts


def diag_mask(T: int, HV: int, cu_seqlens=None, B: int = 1, device="cpu"):
    """Where F4 writes values both kernels define: (Aqk's diagonal blocks' lower triangles
    [B, T, HV, 64], Akkd's strict lower triangles [B, T, HV, 16]), chunks from each sequence's
    start."""
    r = positions(T, cu_seqlens, device) % BT
    cols = torch.arange(BT, device=device)
    mq = (cols[None, :] // BC == r[:, None] // BC) & (cols[None, :] <= r[:, None])
    mk = torch.arange(BC, device=device)[None, :] < (r % BC)[:, None]
    return mq[None, :, None, :].expand(B, T, HV, BT), mk[None, :, None, :].expand(B, T, HV, BC)


def gpu(out: str | None = None) -> list[dict]:
    """On a GPU: F4 against fla's (their diagonal blocks; both against float64 on the first
    1,024 tokens), then F3-F6 with it against fla's stage, at the chain's inputs for
    prod8192_gate and for gates eight times as strong; each timed interleaved with fla's."""
    import statistics

    from fla.ops.kda.chunk_intra_token_parallel import chunk_kda_fwd_intra_token_parallel

    from research import emit_row
    from kernel_fun import _fla
    from kernel_fun.bench.timing import cuda_times
    from kernel_fun.kda import chunk_kda, use_impls
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import SHAPES, make_inputs
    from kernel_fun.kda.stages import capture_stages

    rows = []
    for strong in (False, True):
        p = SHAPES["prod8192_gate"]
        kw = make_inputs(p, device="cuda", seed=1, requires_grad=False)
        if strong:
            kw["g"] = kw["g"] * 8 + 12
        with use_impls("fla"), capture_stages() as log, torch.no_grad():
            chunk_kda(**kw)
        (f36,) = [x for name, _, x, _ in log if name == "F3-F6"]
        a = {n: f36[n] for n in ("q", "k", "gc", "beta", "scale", "cu_seqlens", "chunk_indices")}
        B, T, H, K = a["k"].shape
        HV = a["gc"].shape[2]
        theirs_aqk = torch.zeros(B, T, HV, BT, device="cuda", dtype=a["k"].dtype)
        theirs_akk = torch.zeros(B, T, HV, BC, device="cuda")
        fla_f4 = lambda: chunk_kda_fwd_intra_token_parallel(  # noqa: E731
            q=a["q"], k=a["k"], gk=a["gc"], beta=a["beta"], Aqk=theirs_aqk, Akk=theirs_akk, scale=a["scale"],
            cu_seqlens=a["cu_seqlens"])
        fla_f4()
        ours_aqk, ours_akk = diag_blocks(**a)
        m_q, m_k = diag_mask(T, HV, B=B, device="cuda")
        n = 1024
        e_q, e_k = exact_diag(*(a[x][:1, :n] for x in ("q", "k", "gc", "beta")), a["scale"])
        mq1, mk1 = m_q[:1, :n], m_k[:1, :n]
        row = {"kind": "gpu", "kernel": "f4_diag", "shape": "prod8192_gate", "strong": strong,
               "vs_fla": {"Aqk": ref.rel_rms(ours_aqk[m_q], theirs_aqk[m_q]),
                          "Akkd": ref.rel_rms(ours_akk[m_k], theirs_akk[m_k])},
               "vs_exact": {"Aqk": ref.rel_rms(ours_aqk[:1, :n][mq1], e_q[mq1]),
                            "Akkd": ref.rel_rms(ours_akk[:1, :n][mk1], e_k[mk1])},
               "fla_vs_exact": {"Aqk": ref.rel_rms(theirs_aqk[:1, :n][mq1], e_q[mq1]),
                                "Akkd": ref.rel_rms(theirs_akk[:1, :n][mk1], e_k[mk1])}}
        full = {**a, "v": f36["v"], "chunk_size": BT, "safe_gate": False, "disable_recompute": True}
        want = _fla.intra(**full)
        got = intra(**full)
        # (Aqk where both write it: each chunk's lower triangle; fla leaves the rest unwritten)
        low = ((torch.arange(BT, device="cuda")[None, :] <= (positions(T, device="cuda") % BT)[:, None])
               [None, :, None, :].expand(B, T, HV, BT))
        row["stage_vs_fla"] = {name: ref.rel_rms(x[low] if name == "Aqk" else x, y[low] if name == "Aqk" else y)
                               for name, x, y in zip(("w", "u", "kg", "Aqk", "Akk", "qg"), got, want) if x is not None}
        blocks = ((32, 4), (16, 2), (64, 4), (32, 2), (16, 4))  # (channels a slice, warps): the pin first
        t4o, t4f, t6o, t6f = {c: [] for c in blocks}, [], [], []
        for _ in range(3):  # (interleaved rounds)
            for c in blocks:
                t4o[c] += cuda_times(lambda c=c: diag_blocks(**a, Aqk=ours_aqk, Akkd=ours_akk, bk=c[0], warps=c[1]),
                                     20)
            t4f += cuda_times(fla_f4, 20)
            t6o += cuda_times(lambda: intra(**full), 10)
            t6f += cuda_times(lambda: _fla.intra(**full), 10)
        row.update(f4_ms={f"{c[0]}x{c[1]}": statistics.median(v) for c, v in t4o.items()},
                   fla_f4_ms=statistics.median(t4f), f3_f6_ms=statistics.median(t6o),
                   fla_f3_f6_ms=statistics.median(t6f), gpu=torch.cuda.get_device_name())
        rows.append(emit_row(row, out))
    return rows


if __name__ == "__main__":
    from research import gpu_main

    gpu_main(gpu, sys.argv)
