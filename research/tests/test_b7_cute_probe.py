"""B7-B10's CuTe DSL kernel's instrument (research.b7_cute_probe) on the CPU: its definitions are the package's
reference B7 (dq's part, and dk's row and column parts together), whole or less the pairs
within a block; its twin (the kernel's arithmetic in torch: anchors, masks, bf16 split, the
pairs within a block through their first rows or, past the guard, one by one) meets them at
the split's precision under gentle and extreme gates, and one bf16 product does not; and
the unit's tail (assembly, B8, B9) meets the reference B7-B9 unit, and keeps dA_log within
budget under strong gates on the reference chain's inputs; and the kernel's reads and writes on
the op's layout (``views``, ``outputs``, ``chunk_rows``), emulated with the twin, are the
reference unit's. (Its builds' compile for sm_90a: benchmarks/tests/test_compile_report.py.)"""


import pytest
import torch

from research.b7_cute_probe import BC, BT, KH, make_tensors, slow_share, twin, want


def test_the_sums_are_b7_s_whole_or_less_the_blocks():
    from kernel_fun.kda import reference as ref

    n, K = 3, 64
    t = make_tensors(n, K, "cpu", seed=1)
    ins = [t[name] for name in ("dAqk", "dAkk", "q", "k", "g", "beta")]
    x_q, x_kr, x_c = (x.view(n, BT, K) for x in want(*ins, within=False))
    tok = lambda x: x.view(1, n * BT, 1, *x.shape[1:])  # noqa: E731
    zeros = torch.zeros(1, n * BT, 1, K, dtype=torch.float64)
    dq, dk, *_ = ref.intra_bwd(tok(t["q"]), tok(t["k"]), tok(t["g"]), tok(t["beta"]), tok(t["dAqk"]), tok(t["dAkk"]),
                               zeros, zeros, torch.zeros(1, n * BT, 1, dtype=torch.float64), zeros, exact=True)
    # the pairs within a block (s in r's block), as the reference has them
    rows = torch.arange(BT)
    within = rows[None, :] >= rows[:, None] // BC * BC
    qq, kk, gg = (t[name].double().view(n, BT, K) for name in ("q", "k", "g"))
    bb = t["beta"].double().view(n, BT, 1)
    f = torch.exp2(gg[:, :, None, :] - gg[:, None, :, :])  # [n, r, s, c]
    wq = t["dAqk"].double().view(n, BT, BT) * (within & (rows[None, :] <= rows[:, None]))
    wk = t["dAkk"].double().view(n, BT, BT) * (within & (rows[None, :] < rows[:, None]))
    dq_in = torch.einsum("nrs,nrsc,nsc->nrc", wq, f, kk)
    dk_in = (torch.einsum("nrs,nrsc,nrc->nsc", wq, f, qq) + torch.einsum("nrs,nrsc,nsc->nrc", wk, f, kk) * bb
             + torch.einsum("nrs,nrsc,nrc->nsc", wk, f, bb * kk))
    assert ref.rel_rms(x_q + dq_in, dq.view(n, BT, K)) < 1e-12
    assert ref.rel_rms(x_kr * bb + x_c + dk_in, dk.view(n, BT, K)) < 1e-12
    w_q, w_kr, w_c = (x.view(n, BT, K) for x in want(*ins, within=True))
    assert ref.rel_rms(w_q, dq.view(n, BT, K)) < 1e-12
    assert ref.rel_rms(w_kr * bb + w_c, dk.view(n, BT, K)) < 1e-12


@pytest.mark.parametrize("within", [True, False])
@pytest.mark.parametrize("strength", [0.3, 10.0])
def test_the_twin_meets_the_definitions_at_the_split_s_precision(within, strength):
    t = make_tensors(16, 128, "cpu", seed=2, strength=strength)
    ins = [t[name] for name in ("dAqk", "dAkk", "q", "k", "g", "beta")]
    rel = lambda got, w: ((got.double() - w).square().mean() / w.square().mean()).sqrt().item()  # noqa: E731
    wants = want(*ins, within=within)
    for got, w in zip(twin(*ins, split=True, within=within), wants):
        assert rel(got, w) < 2e-5  # fla's B7 (tf32 off the diagonal): ~2e-5
    for got, w in zip(twin(*ins, split=False, within=within), wants):
        assert rel(got, w) > 5e-4  # one bf16 product: the split is needed
    if not within:
        x_q, _, x_c = (w.view(16, BT, -1) for w in wants)
        assert x_q[:, :BC].abs().max() == 0 and x_c[:, -BC:].abs().max() == 0  # no block before the first, after the last
    # the gentle draw takes the products everywhere; the extreme one both paths
    assert slow_share(t["g"]) == 0 if strength < 1 else 0 < slow_share(t["g"]) < 1


@pytest.mark.parametrize("strength", [0.3, 10.0])
def test_the_twin_is_causal_to_the_bit(strength):
    """Rows at or before t are the same bits whatever the gates, q, k and beta after t, with dA's
    rows after t zero (the call cut at t): every anchor is a row at or before the rows it
    serves, and the guard's choice follows from a row and its block's first row."""
    n, t = 4, 37
    a = make_tensors(n, 128, "cpu", seed=3, strength=strength)
    b = {name: x.clone() for name, x in a.items()}
    later = torch.arange(n * BT) % BT > t
    for x in (a, b):
        for name in ("dAqk", "dAkk"):
            x[name][later] = 0
    gen = torch.Generator().manual_seed(4)
    g = b["g"].view(n, BT, -1)
    step = torch.rand(g.shape, generator=gen) * 3 * strength * (torch.arange(BT) > t)[None, :, None]
    b["g"] = (g - step.cumsum(1)).view(n * BT, -1)  # stronger decay after t, still non-increasing
    for name in ("q", "k"):
        b[name][later] = (torch.randn(b[name][later].shape, generator=gen) * 0.1).bfloat16()
    b["beta"][later] = torch.rand(int(later.sum()), generator=gen)
    # every gate after t moved, those in t's own block (rows 38-47, which an anchor at the block's
    # middle row 40 would read) included
    assert (a["g"] != b["g"])[later].all()
    outs = [twin(*[x[name] for name in ("dAqk", "dAkk", "q", "k", "g", "beta")]) for x in (a, b)]
    for got_a, got_b in zip(*outs):
        assert torch.equal(got_a[~later], got_b[~later])


@pytest.mark.parametrize("lower_bound,has_bias", [(None, True), (None, False), (-5.0, True), (-5.0, False)])
def test_the_unit_s_tail_is_the_reference_b7_b9(lower_bound, has_bias):
    """The ``unit`` build's tail (the twin's sums, dq2, dk2, db's row sums, B8's reverse cumsum,
    B9's gate backward in each form the build compiles: softplus or lower-bounded sigmoid, with
    and without dt_bias) against the reference unit in float64 (``reference.intra_bwd_tail``)."""
    from kernel_fun.kda import reference as ref
    from research.b7_cute_probe import twin_unit

    n, K = 4, 128
    t = make_tensors(n, K, "cpu", seed=6)
    tok = lambda x: x.view(1, n * BT, 1, *x.shape[1:])  # noqa: E731
    args = (tok(t["q"]), tok(t["k"]), tok(t["g"]), tok(t["beta"]), tok(t["dAqk"]), tok(t["dAkk"]), tok(t["dq"]),
            tok(t["dk"]), torch.zeros(1, n * BT, 1), tok(t["dg"]), BT)
    gate = dict(g=tok(t["g_raw"]), A_log=t["A_log"], dt_bias=t["dt_bias"] if has_bias else None,
                lower_bound=lower_bound)
    want_ = ref.intra_bwd_tail(*args, **gate, exact=True)
    own = ref.intra_bwd_tail(*args, **gate)  # (fp32, bf16 dg)
    got = twin_unit(t, lower_bound=lower_bound, has_bias=has_bias)
    assert (got[5] is None) == (want_[5] is None) == (not has_bias)
    for name, g_, w, o in [x for x in zip(("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), got, want_, own)
                           if x[1] is not None]:
        err = ref.rel_rms(g_.reshape(-1).double(), w.reshape(-1).double())
        # the split's 2e-5, or where the output is rounded to the raw gate's bf16 (dg, and dt_bias's
        # sum of it) no more than the fp32 reference's own rounding
        bar = max(2e-5, 1.1 * ref.rel_rms(o.reshape(-1).double(), w.reshape(-1).double()))
        assert err < bar, (name, err, bar)


def test_the_unit_with_b10_is_the_reference_b7_b10():
    """The ``l2`` build's tail: the unit's dq2 and dk2 through B10's l2norm backward (the dot
    product over the whole row, in bf16), against the reference unit and l2norm backward in
    float64, within the bf16 rounding of the same arithmetic from the fp32 reference; the rest
    of the unit's outputs as without B10."""
    from kernel_fun.kda import reference as ref
    from research.b7_cute_probe import l2norm_bwd_exact, twin_unit

    n, K = 4, 128
    t = make_tensors(n, K, "cpu", seed=8)
    tok = lambda x: x.view(1, n * BT, 1, *x.shape[1:])  # noqa: E731
    args = (tok(t["q"]), tok(t["k"]), tok(t["g"]), tok(t["beta"]), tok(t["dAqk"]), tok(t["dAkk"]), tok(t["dq"]),
            tok(t["dk"]), torch.zeros(1, n * BT, 1), tok(t["dg"]), BT)
    gate = dict(g=tok(t["g_raw"]), A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=None)
    exact, own = ref.intra_bwd_tail(*args, **gate, exact=True), ref.intra_bwd_tail(*args, **gate)
    rstd = (tok(t["q_rstd"]), tok(t["k_rstd"]))
    want_ = [l2norm_bwd_exact(args[0], rstd[0], exact[0]), l2norm_bwd_exact(args[1], rstd[1], exact[1])]
    rounded = [ref.l2norm_bwd(args[0], rstd[0], own[0]), ref.l2norm_bwd(args[1], rstd[1], own[1])]
    got, plain = twin_unit(t, l2=True), twin_unit(t)
    for name, g_, w, o in zip(("dq", "dk"), got, want_, rounded):
        assert g_.dtype == torch.bfloat16
        err = ref.rel_rms(g_.reshape(-1).double(), w.reshape(-1))
        bar = 1.1 * ref.rel_rms(o.reshape(-1).double(), w.reshape(-1))
        assert 0 < err < bar < 5e-3, (name, err, bar)
    for a_, b_ in zip(got[2:], plain[2:]):
        assert torch.equal(a_, b_)


@pytest.mark.parametrize("l2, G, K", [(False, 1, 128), (True, 1, 128), (False, 2, 128), (False, 1, 64), (True, 1, 64)],
                         ids=["unit", "l2", "gva", "k64", "l2-k64"])
def test_the_op_layout_the_unit_reads_and_writes(l2, G, K):
    """What the kernel's ``intra_bwd`` (B7-B9; with ``l2``, ``intra_bwd_l2`` as
    B7-B10, the rows' rstd read at stride H as beta; with G = 2, GVA: 4 value heads on 2 q/k
    heads, value head h reading q's and k's head h // 2; at K = 64 one CTA a chunk-head, its
    partials alone) relies on, for B=2, T=128, H=3: the
    kernel's reads and writes emulated chunk-head by chunk-head from ``unit_views``'s tensors
    at the kernel's coordinates (chunk-head c = rt * H + h: tiles (rt, 2 h + j), dA's (rt, h),
    beta's rows at stride H, A_log[h], dt_bias[h * K + ...], db's part at (j, rt * 64 + r, h),
    dA_log's at (j, c), dt_bias's at (c, channel)) with ``twin_unit`` for the arithmetic, then
    ``unit_outputs`` summing the partials, against the reference unit on the op's tensors."""
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels.b7_b10_intra_bwd_sm90 import outputs as unit_outputs, views as unit_views
    from research.b7_cute_probe import twin_unit

    B, T, H = 2, 128, 3 if G == 1 else 4
    gen = torch.Generator().manual_seed(7)
    per = [make_tensors(B * T // BT, K, "cpu", seed=10 + h) for h in range(H)]  # one head's chunks each
    op = {name: torch.stack([p[name].view(B, T, *p[name].shape[1:]) for p in per], dim=2)
          for name in ("q", "k", "g", "dAqk", "dAkk", "dq", "dk", "dg", "g_raw")}
    op["q"], op["k"] = op["q"][:, :, ::G].contiguous(), op["k"][:, :, ::G].contiguous()  # (H / G q/k heads)
    op["beta"] = torch.stack([p["beta"].view(B, T) for p in per], dim=2)
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen) * 0.5
    db = torch.randn(B, T, H, generator=gen)
    rstd = ({n: torch.rand(B, T, H, generator=gen) + 0.5 for n in ("q_rstd", "k_rstd")} if l2
            else dict(q_rstd=None, k_rstd=None))
    t = unit_views(op["q"], op["k"], op["g"], op["beta"], op["dAqk"], op["dAkk"], op["dq"], op["dk"], op["dg"],
                   op["g_raw"], A_log, dt_bias, **rstd)
    assert (t["dq2"].dtype == torch.bfloat16) == l2
    NT = T // BT
    for rt in range(B * NT):
        for h in range(H):
            c = rt * H + h
            rows = slice(rt * BT, (rt + 1) * BT)
            one = {name: t[name][rows, h * K:(h + 1) * K] for name in ("g", "dq", "dk", "dg", "g_raw")}
            one.update({name: t[name][rows, h // G * K:(h // G + 1) * K] for name in ("q", "k")})
            one.update(dAqk=t["dAqk"][rows, h * BT:(h + 1) * BT], dAkk=t["dAkk"][rows, h * BT:(h + 1) * BT],
                       beta=t["beta"][(rt * BT + torch.arange(BT)) * H + h], A_log=t["A_log"][h:h + 1],
                       dt_bias=t["dt_bias"][h * K:(h + 1) * K],
                       **{n: t[n][(rt * BT + torch.arange(BT)) * H + h] for n in ("q_rstd", "k_rstd") if l2})
            dq2, dk2, db_c, dg2, da, dbias = twin_unit(one, l2=l2)
            t["dq2"][rows, h * K:(h + 1) * K] = dq2
            t["dk2"][rows, h * K:(h + 1) * K] = dk2
            t["dg2"][rows, h * K:(h + 1) * K] = dg2
            for j in range(K // 64):  # each K slice's part: here the whole in slice 0, nothing in slice 1
                t["db_part"][j * B * T * H + (rt * BT + torch.arange(BT)) * H + h] = db_c if j == 0 else 0.0
                t["dA_part"][j * (B * NT * H) + c] = da[0] if j == 0 else 0.0
            t["dbias_part"][c] = dbias
    got = unit_outputs(t, db, A_log, dt_bias)
    want_ = ref.intra_bwd_tail(op["q"], op["k"], op["g"], op["beta"], op["dAqk"], op["dAkk"], op["dq"], op["dk"], db,
                               op["dg"], BT, g=op["g_raw"], A_log=A_log, dt_bias=dt_bias)  # (dq, dk by value head)
    if l2:
        want_ = (ref.l2norm_bwd(op["q"], rstd["q_rstd"], want_[0]), ref.l2norm_bwd(op["k"], rstd["k_rstd"], want_[1]),
                 *want_[2:])
    for name, g_, w in zip(("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), got, want_):
        err = ref.rel_rms(g_.reshape(-1).double(), w.reshape(-1).double())
        # (dg and its sum: a few elements' bf16 roundings apart, 6e-5 and 1e-5 here; with l2, dq
        # and dk are bf16 on both sides, a few elements' roundings apart)
        assert err < (5e-4 if name in ("dg", "ddt_bias") or (l2 and name in ("dq", "dk")) else 2e-5), (name, err)


def test_the_tail_s_lane_arithmetic():
    """The unit's tail moves values between lanes (``_tail``, ``quad_row_sums`` and
    ``warp_col_sums``): emulated here on a [64, 64] tile laid out as the
    wgmma accumulator (thread t's element i = a + 2 b + 4 n at row 16 (t // 32) + t % 32 // 4 + 8 b,
    column 8 n + 2 (t % 4) + a), each step as the kernel writes it, against torch: B8's reverse
    cumsum by column, the rows' sums, the columns' sums."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(BT, KH, generator=gen, dtype=torch.float64)
    t = torch.arange(128)
    i = torch.arange(32)
    a, b, n = i % 2, i // 2 % 2, i // 4
    rows = (16 * (t // 32) + t % 32 // 4)[:, None] + 8 * b[None, :]
    cols = (2 * (t % 4))[:, None] + (a + 8 * n)[None, :]
    lane, w = t % 32, t // 32
    frag = x[rows, cols]  # [thread, element]

    def from_lane(v, src):  # each thread reads v at the lane src[t] of its own warp
        return v[w * 32 + src]

    # B8: the quad's lanes by row (shuffle down by 4, 8, 16), the block's second 8 rows into its
    # first (from the quad's first lane), then the later warps' block totals
    y = frag.clone()
    for d in (4, 8, 16):
        moved = from_lane(y, torch.where(lane + d < 32, lane + d, lane))
        y = torch.where((lane + d < 32)[:, None], y + moved, y)
    first = from_lane(y, lane % 4)
    y[:, b == 0] += first[:, b == 1]
    tot = torch.zeros(4, KH, dtype=torch.float64)
    for th in range(4 * 32):
        if lane[th] < 4:
            for el in range(32):
                if b[el] == 0:
                    tot[w[th], n[el] * 8 + lane[th] * 2 + a[el]] = y[th, el]
    for v in range(1, 4):
        y += torch.where((w < v)[:, None], tot[v][cols], 0.0)
    want_cumsum = x.flip(0).cumsum(0).flip(0)
    assert torch.allclose(y, want_cumsum[rows, cols])
    # the rows' sums: the thread's 16 elements of each row, then butterflies 1 and 2
    for bb in (0, 1):
        s = frag[:, b == bb].sum(1)
        for d in (1, 2):
            s = s + from_lane(s, lane ^ d)
        assert torch.allclose(s, x.sum(1)[16 * w + lane // 4 + 8 * bb])
    # the warps' column sums: the thread's two rows, then butterflies 4, 8, 16, then the warps
    c = frag[:, b == 0] + frag[:, b == 1]
    for d in (4, 8, 16):
        c = c + from_lane(c, lane ^ d)
    got = sum(c[32 * v:32 * v + 4] for v in range(4))  # lanes 0-3 of each warp
    assert torch.allclose(got, x.sum(0)[cols[:4, b == 0]])


@pytest.mark.parametrize("packed", [False, True], ids=["T100", "packed"])
def test_the_var_build_s_rows_are_the_reference_b7_b9(packed):
    """What the ``var`` build (packed sequences, T not a multiple of 64) relies on, emulated
    chunk by chunk on the CPU: ``chunk_rows``' first rows and lengths, each chunk's rows past
    its end read as 0 (dA, q, k, beta, the incoming gradients, the raw gate), ``twin_unit``'s
    arithmetic on the 64 rows, only the chunk's rows written, and ``unit_outputs`` summing the
    partials: against the reference unit with cu_seqlens. (g past the end is the last row's, as
    the kernel reads it; the twin's exact pair factors never meet it, the kernel's anchors do:
    that part is the GPU test's, tests/test_gpu_sm90.py.)"""
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels.b7_b10_intra_bwd_sm90 import chunk_rows, outputs as unit_outputs, views as unit_views
    from research.b7_cute_probe import twin_unit

    H, K = 2, 128
    if packed:
        B, T, cu = 1, 230, torch.tensor([0, 70, 134, 200, 230])  # (70: 64 + 6; 64 exactly; 66; 30)
        seqs = torch.arange(len(cu) - 1)
        per_seq = (cu[1:] - cu[:-1] + BT - 1) // BT
        ci = torch.stack([seqs.repeat_interleave(per_seq),
                          torch.cat([torch.arange(int(n)) for n in per_seq])], -1)
    else:
        B, T, cu, ci = 2, 100, None, None
    R = B * T
    gen = torch.Generator().manual_seed(3)
    src = make_tensors(R // BT + 2, K, "cpu", seed=4)  # (rows enough for any chunk's 64)
    take = lambda x: x[:R].view(B, T, 1, *x.shape[1:]).expand(B, T, H, *x.shape[1:]).contiguous()  # noqa: E731
    op = {n: take(src[n]) for n in ("q", "k", "dq", "dk", "dg", "g_raw", "dAqk", "dAkk")}
    op["q"], op["k"] = op["q"][:, :, :1].contiguous(), op["k"][:, :, :1].contiguous()  # (GVA: one q/k head)
    op["beta"] = src["beta"][:R].view(B, T, 1).expand(B, T, H).contiguous()
    # g: each sequence's chunk cumsum of a decay (B4's gc), by chunk of the sequence
    step = -(torch.rand(B, T, H, K, generator=gen) * 0.3)
    starts = (cu[:-1].tolist() if packed else [b * T for b in range(B)])
    ends = (cu[1:].tolist() if packed else [(b + 1) * T for b in range(B)])
    gflat, sflat = torch.zeros(R, H, K), step.view(R, H, K)
    for a, e in zip(starts, ends):
        for c0 in range(a, e, BT):
            gflat[c0:min(c0 + BT, e)] = sflat[c0:min(c0 + BT, e)].cumsum(0)
    op["g"] = gflat.view(B, T, H, K)
    rows_ = torch.arange(BT)
    mask_q, mask_k = rows_[:, None] >= rows_[None, :], rows_[:, None] > rows_[None, :]
    for name, m in (("dAqk", mask_q), ("dAkk", mask_k)):  # (each chunk's dA: its own rows and columns)
        flat = op[name].view(R, H, BT).clone()
        for a, e in zip(starts, ends):
            for c0 in range(a, e, BT):
                n = min(BT, e - c0)
                flat[c0:c0 + n] *= (m[:n, :] & (rows_[None, :] < n)).view(n, 1, BT)
        op[name] = flat.view(B, T, H, BT)
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen) * 0.5
    db = torch.randn(B, T, H, generator=gen)
    t = unit_views(op["q"], op["k"], op["g"], op["beta"], op["dAqk"], op["dAkk"], op["dq"], op["dk"], op["dg"],
                   op["g_raw"], A_log, dt_bias, cu_seqlens=cu, chunk_indices=ci)
    cr = chunk_rows(B, T, cu, ci)
    assert torch.equal(t["chunk_rows"], cr) and cr[:, 1].max() <= BT and int(cr[:, 1].sum()) == R
    assert cr.shape[0] == (sum((e - a + BT - 1) // BT for a, e in zip(starts, ends)))
    assert cr[:, 2].tolist() == list(range(cr.shape[0]))  # (each chunk's number: where its partials go)
    for chunk, (row0, n, _) in enumerate(cr.tolist()):
        for h in range(H):
            c = chunk * H + h
            rows = torch.arange(row0, row0 + BT).clamp(max=R - 1)  # (the emulation's rows; past n unused)
            valid = torch.arange(BT) < n
            z = lambda x: x * valid.view(BT, *([1] * (x.dim() - 1))).to(x.dtype)  # noqa: E731
            one = {name: z(t[name][rows, h * K:(h + 1) * K]) for name in ("dq", "dk", "dg", "g_raw")}
            one.update({name: z(t[name][rows, 0:K]) for name in ("q", "k")})
            g_one = t["g"][rows, h * K:(h + 1) * K]
            one["g"] = torch.where(valid[:, None], g_one, g_one[n - 1][None, :])  # (flat past the end)
            one.update(dAqk=z(t["dAqk"][rows, h * BT:(h + 1) * BT]), dAkk=z(t["dAkk"][rows, h * BT:(h + 1) * BT]),
                       beta=z(t["beta"][rows * H + h]), A_log=t["A_log"][h:h + 1],
                       dt_bias=t["dt_bias"][h * K:(h + 1) * K])
            dq2, dk2, db_c, dg2, da, dbias = twin_unit(one)
            keep = slice(row0, row0 + n)
            t["dq2"][keep, h * K:(h + 1) * K] = dq2[:n]
            t["dk2"][keep, h * K:(h + 1) * K] = dk2[:n]
            t["dg2"][keep, h * K:(h + 1) * K] = dg2[:n]
            for j in range(2):
                t["db_part"][j * R * H + torch.arange(row0, row0 + n) * H + h] = db_c[:n] if j == 0 else 0.0
                t["dA_part"][j * (cr.shape[0] * H) + c] = da[0] if j == 0 else 0.0
            t["dbias_part"][c] = dbias
    got = unit_outputs(t, db, A_log, dt_bias)
    cu_ref = cu if packed else torch.arange(0, R + 1, T)
    flat = lambda x: x.reshape(1, R, *x.shape[2:])  # noqa: E731
    want_ = ref.intra_bwd_tail(*(flat(op[n]) for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk")), flat(db),
                               flat(op["dg"]), BT, cu_seqlens=cu_ref, g=flat(op["g_raw"]), A_log=A_log,
                               dt_bias=dt_bias)
    for name, g_, w in zip(("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), got, want_):
        err = ref.rel_rms(g_.reshape(-1).double(), w.reshape(-1).double())
        assert err < (5e-4 if name in ("dg", "ddt_bias") else 2e-5), (name, err)


def _chain_b7(T: int, strong: bool, seed: int = 5):
    """B7's and B9's inputs as the reference chain hands them over (2 heads, K = 128, the gate and
    l2norm in the op), under Kimi's gates or under them scaled by 8 and shifted by 12 (the GPU
    test's strong draw: most tokens decay by tens of log2 units, most pairs vanish but the
    diagonal's)."""
    import dataclasses

    from kernel_fun.kda import chunk_kda, use_impls
    from kernel_fun.kda.problems import SHAPES, make_inputs, run_fwd_bwd
    from kernel_fun.kda.stages import capture_stages

    p = dataclasses.replace(SHAPES["prod8192_gate"], name="strong", B=1, T=T, H=2, HV=2)
    kwargs = make_inputs(p, device="cpu", seed=seed)
    if strong:
        kwargs["g"] = (kwargs["g"].detach() * 8 + 12).requires_grad_(True)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    (b7,) = [x for name, _, x, _ in log if name == "B7"]
    (b9,) = [x for name, _, x, _ in log if name == "B9"]
    return b7, {n: b9[n] for n in ("g", "A_log", "dt_bias", "lower_bound")}


@pytest.mark.parametrize("T", [512, 1024])
def test_the_unit_s_arithmetic_keeps_dA_log_in_budget_under_strong_gates(T):
    """dA_log (and dt_bias's gradient) is a sum over every token and channel of the reverse
    cumsum of dg's terms, weighted by the gate's -A softplus(x): under strong gates the weights
    reach tens and the cumsums are small, so a product's rounding in any dg term shows. The
    unit's arithmetic (``twin_unit``: the bf16 split products, ~2^-17 of a product, with dAqk's
    diagonal added in fp32 in the tail and left out of dg's terms, where its two terms cancel),
    chunk-head by chunk-head on the reference chain's B7 inputs, within fla's 0.02 of float64.
    With the diagonal in the products, as the unit had it: 7.3e-3 at T = 512 and 0.043 at 1024
    (0.032 on the GPU at T = 500, 16 heads)."""
    from kernel_fun.kda import reference as ref
    from research.b7_cute_probe import twin_unit

    b7, gate = _chain_b7(T, strong=True)
    exact = ref.intra_bwd_tail(**{n: t for n, t in b7.items() if n not in ("chunk_indices", "safe_gate")}, **gate,
                               exact=True)
    B, _, H, K = b7["k"].shape
    dA_log, dbias = torch.zeros(H, dtype=torch.float64), torch.zeros(H, K, dtype=torch.float64)
    dq = torch.zeros(b7["dq"].shape)
    for h in range(H):
        for c in range(T // BT):
            rows = slice(c * BT, (c + 1) * BT)
            one = {n: b7[n][0, rows, h] for n in ("q", "k", "dq", "dk", "dg", "dAqk", "dAkk", "beta")}
            one.update(g=b7["gc"][0, rows, h], g_raw=gate["g"][0, rows, h], A_log=gate["A_log"][h:h + 1],
                       dt_bias=gate["dt_bias"].view(H, K)[h])
            dq[0, rows, h], _, _, _, da, db_ = twin_unit(one)
            dA_log[h] += da[0].double()
            dbias[h] += db_.double()
    for name, got, want_, bar in (("dA_log", dA_log, exact[4], 0.02), ("ddt_bias", dbias, exact[5], 0.02),
                                  ("dq", dq, exact[0], 0.008)):
        err = ref.rel_rms(got.reshape(-1).double(), want_.reshape(-1).double())
        assert err < bar, (name, err)
