"""B7-B10's CuTe DSL kernel (``kernel_fun.kda.kernels.b7_b10_intra_bwd_sm90``) as a research
instrument: its sums' definitions in float64 (``want``), its arithmetic in torch (``twin``, and
``twin_unit`` for the tail: the CPU tests hold both to the package's reference B7-B9 and B10),
and one head's chunk-heads timed on a GPU against the Triton unit (``gpu``). The kernel's
design, its rounds and their measurements are in docs/log/bwd-fused.md; its build options that
lost (the sums alone, two warpgroups, the operands in two phases, the body inside a fused
B6-B9 kernel) are recorded there and deleted.

For one chunk-head's K half, g is the chunk cumsum in log2 (non-increasing) and f(r, s) =
exp2(g_r - g_s). The sums are B7's, over the pairs s <= r:

    x_q[r]  = sum_{s <= r} dAqk[r, s] k_s f(r, s)                          (dq's part)
    x_kr[r] = sum_{s < r} dAkk[r, s] k_s f(r, s)             (dk's row part, beta_r not applied)
    x_c[s]  = sum_{r >= s} dAqk[r, s] q_r f(r, s) + sum_{r > s} dAkk[r, s] beta_r k_r f(r, s)
                                                                          (dk's column part)

The rows fall in four blocks of 16. Pairs across blocks go through anchors (each block's first
row and the next block's), every factor at most 1; pairs within a block go through the block's
first row u while g[u] - g stays within GUARD, else one by one. Each fp32 operand is split into
a bf16 high part and remainder, the products hi*hi + hi*lo + lo*hi (CuTe DSL 4.8.1 has no tf32
warpgroup MMA for Hopper).

Layout (one head): dAqk, dAkk [NCH * 64, 64] fp32; q, k [NCH * 64, K] bf16; g [NCH * 64, K]
fp32; beta [NCH * 64] fp32; dq, dk, dg [NCH * 64, K] fp32 in and dq2, dk2 out, the raw gate and
dg2 [NCH * 64, K] bf16, A_log [1], dt_bias [K], the partials db_part [2 * NCH * 64], dA_part
[2 * NCH], dbias_part [NCH, K]; with ``l2`` q_rstd and k_rstd [NCH * 64] in, dq2 and dk2 bf16.

    python -m research.b7_cute_probe gpu [form ...]   # against float64 and the Triton unit, timed
"""


import json
import sys

from kernel_fun.kda.kernels.b7_b10_intra_bwd_sm90 import BC, BT, GUARD, KH, NB  # noqa: F401

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
    out = {n: torch.full((nch * BT, K), float("nan"), device=device) for n in ("dq2", "dk2")}
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



def gpu_run(nch: int = 32768, K: int = 128, reps: int = 20, strength: float = 0.3, lower_bound: float | None = None,
            has_bias: bool = True, l2: bool = False, bench_gate: bool = False) -> dict:
    """On a GPU, the kernel on one head's ``nch`` chunk-heads (``make_tensors``): its six outputs
    against the Triton unit (``b7_b9_intra_bwd.intra_bwd``; with ``l2`` followed by fla's B10) on
    the same tensors, and against float64 (``reference.intra_bwd_tail``) on 64 chunk-heads spread
    over all; the twin's sums against float64 there; then the CUDA-event time against the bytes
    it moves, the Triton unit's beside it; then its causality to the bit."""
    import statistics

    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch

    from kernel_fun.bench.timing import cuda_times
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels import b7_b9_intra_bwd
    from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90 as m

    ns = K // KH
    t = make_tensors(nch, K, "cuda", strength=strength, ns=ns, bench_gate=bench_gate)
    if l2:  # (B10 writes q's and k's dtype)
        t.update(dq2=t["dq2"].bfloat16(), dk2=t["dk2"].bfloat16())
    if not has_bias:  # (the build without dt_bias never reads it: zeros, as ``views`` passes)
        t["dt_bias"].zero_()
    args = m.dlpack_args(t) + [cuda.CUstream(torch.cuda.current_stream().cuda_stream)]
    run = cute.compile(m.build(K, 1, 1, l2, False, "bf16", has_bias, lower_bound), *args)
    run(*args)
    torch.cuda.synchronize()
    sel = torch.linspace(0, nch - 1, min(nch, 64), device="cuda").round().long()
    pick = lambda x: x.view(nch, BT, -1)[sel].reshape(len(sel) * BT, -1).squeeze(-1)  # noqa: E731
    ins = [pick(t[n]) for n in ("dAqk", "dAkk", "q", "k", "g", "beta")]

    def rel(got, w):
        return ((got.double() - w.double()).square().mean() / w.double().square().mean()).sqrt().item()

    errors = {f"twin_{name}": rel(tw, w) for name, w, tw in zip(("x_q", "x_kr", "x_c"), want(*ins), twin(*ins))}
    timed = lambda fn: statistics.median(cuda_times(fn, reps))  # noqa: E731
    tok = lambda x: x.view(1, -1, 1, *x.shape[1:])  # noqa: E731
    bias = t["dt_bias"] if has_bias else None
    reg_args = dict(q=tok(t["q"]), k=tok(t["k"]), gc=tok(t["g"]), beta=tok(t["beta"]), dAqk=tok(t["dAqk"]),
                    dAkk=tok(t["dAkk"]), dq=tok(t["dq"]), dk=tok(t["dk"]), db=torch.zeros(1, nch * BT, 1, device="cuda"),
                    dg=tok(t["dg"]), safe_gate=False, g=tok(t["g_raw"]), A_log=t["A_log"], dt_bias=bias,
                    lower_bound=lower_bound, chunk_size=BT, cu_seqlens=None, chunk_indices=None)
    theirs = b7_b9_intra_bwd.intra_bwd(**reg_args)
    if l2:
        from kernel_fun.kda.stages import stages

        b10 = stages()["B10"].impls["fla"]
        rstd = (tok(t["q_rstd"]), tok(t["k_rstd"]))
        theirs = (*b10(reg_args["q"], rstd[0], theirs[0], reg_args["k"], rstd[1], theirs[1]), *theirs[2:])
    ours = (t["dq2"], t["dk2"], t["db_part"].view(ns, -1).sum(0), t["dg2"], t["dA_part"].sum().view(1),
            t["dbias_part"].sum(0))
    names = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")
    out = {"vs_triton_unit": {n: rel(a.reshape(-1).float(), b.reshape(-1).float())
                              for n, a, b in zip(names, ours, theirs) if b is not None}}
    picked = {n: tok(pick(t[n])) for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "dg", "g_raw")}
    exact = ref.intra_bwd_tail(picked["q"], picked["k"], picked["g"], picked["beta"], picked["dAqk"], picked["dAkk"],
                               picked["dq"], picked["dk"], torch.zeros_like(picked["beta"]), picked["dg"], BT,
                               g=picked["g_raw"], A_log=t["A_log"], dt_bias=bias, lower_bound=lower_bound, exact=True)
    if l2:
        exact = (l2norm_bwd_exact(picked["q"], tok(pick(t["q_rstd"])), exact[0]),
                 l2norm_bwd_exact(picked["k"], tok(pick(t["k_rstd"])), exact[1]), *exact[2:])
    got = (pick(t["dq2"]), pick(t["dk2"]), pick(t["db_part"].view(ns, -1).sum(0)), pick(t["dg2"]))
    out["vs_exact"] = {n: rel(a.reshape(-1).float(), w.reshape(-1)) for n, a, w in zip(names, got, exact)}
    out["triton_unit_ms"] = timed(lambda: b7_b9_intra_bwd.intra_bwd(**reg_args))
    if l2:
        def triton_l2():
            o = b7_b9_intra_bwd.intra_bwd(**reg_args)
            return b10(reg_args["q"], rstd[0], o[0], reg_args["k"], rstd[1], o[1])

        out["triton_unit_with_b10_ms"] = timed(triton_l2)
    del theirs
    ms = timed(lambda: run(*args))
    outs = ("dq2", "dk2")  # (per row and causal: dg2 is B8's reverse cumsum)
    finite = all(bool(torch.isfinite(t[n]).all()) for n in outs + ("dg2",))
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
    # dAqk and dAkk once (the second K half's from L2), q and k (bf16), g (fp32), beta; dq, dk, dg
    # and the raw gate in, dq2 and dk2 (fp32, with l2 bf16 and the rows' rstd in), dg2 (bf16) and
    # the partials out
    moved = nch * (2 * BT * BT * 4 + 2 * BT * K * 2 + BT * K * 4 + BT * 4)
    moved += nch * (3 * BT * K * 4 + BT * K * 2 + 2 * BT * K * 4 + BT * K * 2 + 2 * BT * 4 + K * 4)
    if l2:
        moved += nch * (2 * BT * 4 - 2 * BT * K * 2)
    return {"kind": "gpu", "kernel": "b7_b10_intra_bwd_sm90", "l2": l2, "bench_gate": bench_gate,
            "strength": strength, "lower_bound": lower_bound, "has_bias": has_bias, "chunk_heads": nch,
            "errors": errors, **out, "slow_share": slow_share(t["g"]), "finite": finite, "causal_to_the_bit": causal,
            "ms": ms, "bytes": moved, "TB_s": moved / ms / 1e9, "gpu": torch.cuda.get_device_name()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:  # each form in turn: a colon-separated list of lb (the lower-bounded sigmoid),
        # nobias (no dt_bias), l2 (B10 in the kernel), benchgate (the op bench's gate draw), strong
        # (gates past the guard); with none, the plain form, then it under strong gates
        for arg in argv[1:] or ["", "strong"]:
            form = arg.split(":")
            print(json.dumps(gpu_run(has_bias="nobias" not in form, lower_bound=-5.0 if "lb" in form else None,
                                     l2="l2" in form, bench_gate="benchgate" in form,
                                     strength=10.0 if "strong" in form else 0.3)), flush=True)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
