"""research.prep16 through the interpreter: Aqk and Akk_inv against the float64 reference
stages, on the anchored path, the element-wise path and both mixed, T not a multiple of 64,
K 64, 100 and 128, GVA."""

from __future__ import annotations

import pytest
import torch

from kernel_fun.kda import reference as ref
from research import prep16


def _inputs(B, T, H, HV, K, step, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(torch.bfloat16)
    # per-token log2 decays, channel by channel up to `step`
    a = -torch.rand(B, T, HV, K, generator=gen) * step
    gc = ref.chunk_cumsum(a, chunk_size=64)
    beta = torch.rand(B, T, HV, generator=gen).to(torch.bfloat16)
    return q, k, gc, beta


@pytest.mark.parametrize("B,T,H,HV,K,step,span_max", [
    (1, 130, 1, 2, 64, 0.5, prep16.SPAN_MAX),     # anchored everywhere
    (1, 130, 1, 2, 64, 0.5, -1.0),                # element-wise everywhere
    (2, 100, 1, 1, 100, 12.0, prep16.SPAN_MAX),   # a steep gate: both paths, K=100
    (1, 64, 2, 2, 128, 3.0, prep16.SPAN_MAX),
])
def test_intra16_matches_the_reference_stage(B, T, H, HV, K, step, span_max):
    q, k, gc, beta = _inputs(B, T, H, HV, K, step)
    scale = K ** -0.5
    Aqk, Akk_inv = prep16.intra16(q, k, gc, beta, scale, span_max=span_max)
    want = ref.intra_scores(q, k, gc, beta, scale, 64, exact=True)
    rounded = ref.intra_scores(q, k, gc, beta, scale, 64)  # fp32, rounded to bf16 once
    for got, w, r in zip((Aqk, Akk_inv), want, rounded):
        # no worse than rounding the fp32 result once, to within a fifth
        assert ref.rel_rms(got.double(), w) <= 1.2 * ref.rel_rms(r.double(), w) + 1e-6, \
            (ref.rel_rms(got.double(), w), ref.rel_rms(r.double(), w))


def test_intra16_on_packed_sequences():
    """Empty and one-token sequences among them; a steep gate in one."""
    from kernel_fun import _fla

    q, k, gc_dense, beta = _inputs(1, 200, 1, 2, 64, 0.5)
    cu = torch.tensor([0, 0, 1, 70, 70, 200])
    steep = -torch.rand(1, 200, 2, 64, generator=torch.Generator().manual_seed(3)) * 12
    a = torch.where((torch.arange(200) >= 70)[None, :, None, None], steep, -torch.rand(1, 200, 2, 64) * 0.5)
    gc = ref.chunk_cumsum(a, chunk_size=64, cu_seqlens=cu)
    index = _fla.prepare_chunk_indices(cu, 64)
    Aqk, Akk_inv = prep16.intra16(q, k, gc, beta, 64 ** -0.5, cu_seqlens=cu, chunk_indices=index)
    want_qk, want_inv = ref.intra_scores(q, k, gc, beta, 64 ** -0.5, 64, cu_seqlens=cu, exact=True)
    assert ref.rel_rms(Aqk.double(), want_qk) < 0.005
    assert ref.rel_rms(Akk_inv.double(), want_inv) < 0.005


@pytest.mark.parametrize("T,K,V,HV,cu", [(130, 64, 32, 2, None), (100, 100, 64, 1, None),
                                         (200, 64, 32, 2, (0, 0, 1, 70, 200))])
def test_intra16_with_the_wy_vectors(T, K, V, HV, cu):
    """F6 in the same program: w, u, kg and qg against the reference rounding as fla's F6
    does, from this kernel's inverse (F6 alone), and against the float64 chain."""
    from kernel_fun import _fla

    q, k, gc, beta = _inputs(1, T, 1, HV, K, 1.0)
    v = torch.randn(1, T, HV, V, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    kw = {}
    if cu is not None:
        cu_t = torch.tensor(cu)
        gc = ref.chunk_cumsum(-torch.rand(1, T, HV, K) * 1.0, chunk_size=64, cu_seqlens=cu_t)
        kw = dict(cu_seqlens=cu_t, chunk_indices=_fla.prepare_chunk_indices(cu_t, 64))
    got = prep16.intra16(q, k, gc, beta, K ** -0.5, v=v, **kw)
    cs = kw.get("cu_seqlens")
    _, A64 = ref.intra_scores(q, k, gc, beta, K ** -0.5, 64, cu_seqlens=cs, exact=True)
    exact = ref.wy_fwd(k, v, beta, A64, gc, q, 64, cu_seqlens=cs, exact=True)
    # F6 alone: the reference rounding as fla's F6 does, from this kernel's own inverse
    rounded = ref.wy_fwd(k, v, beta, got[1], gc, q, 64, cu_seqlens=cs)
    for name, g_, r_, e_ in zip(("w", "u", "qg", "kg"), (got[2], got[3], got[5], got[4]), rounded, exact):
        ours, theirs = ref.rel_rms(g_.double(), e_), ref.rel_rms(r_.double(), e_)
        print(name, ours, theirs)
        assert ref.rel_rms(g_.double(), r_.double()) < 1e-3 and ours <= 1.5 * theirs + 1e-5, (name, ours, theirs)


@pytest.mark.parametrize("p", [
    "dense-gva-h0", "packed-layer-safe",
])
def test_the_chain_with_f3_f6_forced_on_matches_the_float64_recurrence(p):
    """The whole op (fwd+bwd) with prep16 as F3-F6: o, the final state and every gradient
    within fla's budgets of the float64 recurrence, the record naming it."""
    from kernel_fun.kda import chunk_kda, last_record
    from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
    from kernel_fun.kda.stages import registered

    probs = {
        "dense-gva-h0": Problem("dense-gva-h0", 1, 130, 1, 2, 64, 32, initial_state=True, output_final_state=True,
                                dtype=torch.float16),
        "packed-layer-safe": Problem("packed-layer-safe", 1, 150, 1, 1, 64, 32, cu_seqlens=(0, 1, 80, 150),
                                     beta_sigmoid_in_kernel=True, state_v_first=True, safe_gate=True,
                                     lower_bound=-5.0, initial_state=True, output_final_state=True,
                                     dtype=torch.float16),
    }
    prob = probs[p]
    kw = make_inputs(prob, seed=4)
    with registered("F3-F6", "ours", prep16.f3_f6, prep16.supports):
        got = run_fwd_bwd(chunk_kda, kw, grid=prob.dtype)
        record = last_record()
    assert record.forward["F3-F6"] == "ours", record
    want = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kw), grid=prob.dtype)
    errors = {n: ref.rel_rms(got[n].double(), want[n]) for n in want if want[n] is not None}
    print(p, record.forward, errors)
    assert len(errors) >= 8 and all(e <= ref.BUDGETS[n] for n, e in errors.items()), errors


@pytest.mark.parametrize("lower_bound,bias,cu", [(None, True, None), (-5.0, True, (0, 1, 70, 130)),
                                                 (None, False, None)])
def test_intra16_with_the_gate_in_front(lower_bound, bias, cu):
    """F2 in the same program (the gate's activation and the chunk cumsum, written to gc and
    read back): gc, Aqk and Akk_inv against the reference stages from the raw gate."""
    from kernel_fun import _fla

    T, HV, K = 130, 2, 64
    q, k, _, beta = _inputs(1, T, 1, HV, K, 1.0)
    gen = torch.Generator().manual_seed(9)
    g_raw = torch.randn(1, T, HV, K, generator=gen).to(torch.bfloat16)
    A_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5 if bias else None
    kw = {}
    if cu is not None:
        cu_t = torch.tensor(cu)
        kw = dict(cu_seqlens=cu_t, chunk_indices=_fla.prepare_chunk_indices(cu_t, 64))
    gc = torch.empty(1, T, HV, K)
    Aqk, Akk_inv = prep16.intra16(q, k, gc, beta, K ** -0.5, g_raw=g_raw, A_log=A_log, dt_bias=dt_bias,
                                  lower_bound=lower_bound, **kw)
    want_gc = ref.gate_cumsum(g_raw, True, A_log, dt_bias, lower_bound, 64, kw.get("cu_seqlens"))
    assert ref.rel_rms(gc.double(), want_gc.double()) < 1e-5, ref.rel_rms(gc.double(), want_gc.double())
    want_qk, want_inv = ref.intra_scores(q, k, want_gc, beta, K ** -0.5, 64, cu_seqlens=kw.get("cu_seqlens"),
                                         exact=True)
    assert ref.rel_rms(Aqk.double(), want_qk) < 0.005 and ref.rel_rms(Akk_inv.double(), want_inv) < 0.005


def _raw_inputs(T, H, HV, K, V, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, T, H, K, generator=gen) * 3).to(dtype)
    k = (torch.randn(1, T, H, K, generator=gen) * 0.2).to(dtype)
    v = torch.randn(1, T, HV, V, generator=gen).to(dtype)
    beta = torch.rand(1, T, HV, generator=gen).to(dtype)
    g_raw = torch.randn(1, T, HV, K, generator=gen).to(dtype)
    A_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5
    return q, k, v, beta, g_raw, A_log, dt_bias


@pytest.mark.parametrize("T,H,HV,K,V,cu,gate,l2norm", [
    (130, 1, 2, 64, 32, None, "softplus", True),              # GVA: one group writes F1's outputs
    (100, 1, 1, 100, 64, None, "lower_bound", True),          # K=100
    (200, 2, 2, 64, 32, (0, 0, 1, 70, 200), "softplus", True),  # packed, empty and one-token sequences
    (130, 1, 1, 64, 32, None, "given", True),                 # a log-decay given, with resets (-inf)
    (130, 1, 2, 64, 32, (0, 1, 130), "given", False),        # no l2norm in the op
    (70, 1, 1, 128, 256, None, "softplus", True),             # the production head dims
    (64, 1, 1, 128, 128, None, "lower_bound", True),
])
def test_f1_f6_matches_the_reference_stages(T, H, HV, K, V, cu, gate, l2norm):
    """F1, F2 and F3-F6 in one program (the chain's F1-F6 contract) against the reference
    stages in turn: F1's q, k and rstds and F2's gc to rounding, then Aqk, Akk_inv and the
    WY vectors against the float64 stages from the reference F1 and F2."""
    from kernel_fun import _fla

    q, k, v, beta, g_raw, A_log, dt_bias = _raw_inputs(T, H, HV, K, V)
    lower_bound = -5.0 if gate == "lower_bound" else None
    use_gate = gate != "given"
    if not use_gate:  # a log-decay: steep in places, a reset in two rows of one channel
        g_raw = -torch.rand(1, T, HV, K, generator=torch.Generator().manual_seed(2)) * 4
        g_raw[0, 5:7, 0, 3] = float("-inf")
    if not l2norm:
        q = torch.nn.functional.normalize(q.float(), dim=-1).to(q.dtype)
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(k.dtype)
    cu_t = None if cu is None else torch.tensor(cu)
    index = None if cu is None else _fla.prepare_chunk_indices(cu_t, 64)
    scale = K ** -0.5
    got = prep16.f1_f6(q, k, v, g_raw, beta, A_log, dt_bias if use_gate else None, lower_bound, use_gate, l2norm,
                       scale, False, True, 64, cu_t, index)
    qn, q_rstd, kn, k_rstd, gc, w, u, kg, Aqk, Akk_inv, qg = got
    if l2norm:
        (want_q, want_qr), (want_k, want_kr) = ref.l2norm_fwd(q), ref.l2norm_fwd(k)
        for a, b in ((qn, want_q), (kn, want_k)):
            assert ref.rel_rms(a.double(), b.double()) < 2e-3, ref.rel_rms(a.double(), b.double())
        for a, b in ((q_rstd, want_qr), (k_rstd, want_kr)):
            assert torch.allclose(a, b, rtol=1e-5), (a - b).abs().max()
    else:
        assert qn is q and kn is k and q_rstd is None and k_rstd is None
        want_q, want_k = q, k
    want_gc = ref.gate_cumsum(g_raw, use_gate, A_log, dt_bias if use_gate else None, lower_bound, 64, cu_t)
    assert torch.isfinite(gc).all()
    assert ref.rel_rms(gc.double(), want_gc.double()) < 1e-5, ref.rel_rms(gc.double(), want_gc.double())
    want_qk, want_inv = ref.intra_scores(want_q, want_k, want_gc, beta, scale, 64, cu_seqlens=cu_t, exact=True)
    rounded = ref.intra_scores(want_q, want_k, want_gc, beta, scale, 64, cu_seqlens=cu_t)
    for name, a, e, r in (("Aqk", Aqk, want_qk, rounded[0]), ("Akk_inv", Akk_inv, want_inv, rounded[1])):
        ours, theirs = ref.rel_rms(a.double(), e), ref.rel_rms(r.double(), e)
        assert ours <= 1.3 * theirs + 1e-5, (name, ours, theirs)
    exact = ref.wy_fwd(want_k, v, beta, want_inv, want_gc, want_q, 64, cu_seqlens=cu_t, exact=True)
    fla_like = ref.wy_fwd(want_k, v, beta, rounded[1], want_gc, want_q, 64, cu_seqlens=cu_t)
    for name, a, e, r in zip(("w", "u", "qg", "kg"), (w, u, qg, kg), exact, fla_like):
        ours, theirs = ref.rel_rms(a.double(), e), ref.rel_rms(r.double(), e)
        assert ours <= 1.3 * theirs + 1e-5, (name, ours, theirs)


@pytest.mark.parametrize("cu,want_u,gate", [(None, True, "softplus"), ((0, 0, 1, 70, 200), False, "lower_bound"),
                                            (None, True, "given")])
def test_b1_b2_matches_the_reference_stages(cu, want_u, gate):
    """The backward's recompute (B1-B2 contract) from the raw gate and a saved Akk_inv: gc to
    rounding, w, u, qg and kg as the reference rounds them from that inverse."""
    from kernel_fun import _fla

    T, H, HV, K, V = 200, 1, 2, 64, 32
    q, k, v, beta, g_raw, A_log, dt_bias = _raw_inputs(T, H, HV, K, V, seed=1)
    q = torch.nn.functional.normalize(q.float(), dim=-1).to(q.dtype)
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(k.dtype)
    use_gate = gate != "given"
    if not use_gate:
        g_raw = -torch.rand(1, T, HV, K, generator=torch.Generator().manual_seed(2)) * 2
    lower_bound = -5.0 if gate == "lower_bound" else None
    cu_t = None if cu is None else torch.tensor(cu)
    index = None if cu is None else _fla.prepare_chunk_indices(cu_t, 64)
    bias = dt_bias if use_gate else None
    want_gc = ref.gate_cumsum(g_raw, use_gate, A_log, bias, lower_bound, 64, cu_t)
    _, A = ref.intra_scores(q, k, want_gc, beta, K ** -0.5, 64, cu_seqlens=cu_t)
    gc, w, u, qg, kg = prep16.b1_b2(g_raw, use_gate, A_log, bias, lower_bound, q, k, v, beta, A, want_u, 64, cu_t,
                                    index)
    assert ref.rel_rms(gc.double(), want_gc.double()) < 1e-5
    assert (u is None) == (not want_u)
    want = ref.wy_fwd(k, v, beta, A, want_gc, q, 64, cu_seqlens=cu_t)
    for name, a, r in zip(("w", "u", "qg", "kg"), (w, u, qg, kg), want):
        if a is None:
            continue
        assert ref.rel_rms(a.double(), r.double()) < 2e-3, (name, ref.rel_rms(a.double(), r.double()))


@pytest.mark.parametrize("p", ["dense-gva-h0", "packed-layer-safe", "given-gate-k100", "no-l2norm-keep"])
def test_the_chain_with_f1_f6_and_b1_b2_forced_on_matches_the_float64_recurrence(p):
    """The whole op (fwd+bwd) with prep16 as the F1-F6 and B1-B2 units: o, the final state
    and every gradient within fla's budgets of the float64 recurrence, the record naming
    the units wherever they apply (B1-B2: a gate in the op, the backward recomputing)."""
    from kernel_fun.kda import chunk_kda, last_record
    from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
    from kernel_fun.kda.stages import registered

    probs = {
        "dense-gva-h0": Problem("dense-gva-h0", 1, 130, 1, 2, 64, 32, initial_state=True, output_final_state=True,
                                dtype=torch.float16),
        "packed-layer-safe": Problem("packed-layer-safe", 1, 150, 1, 1, 64, 32, cu_seqlens=(0, 0, 1, 80, 150),
                                     beta_sigmoid_in_kernel=True, state_v_first=True, safe_gate=True,
                                     lower_bound=-5.0, initial_state=True, output_final_state=True,
                                     dtype=torch.float16),
        "given-gate-k100": Problem("given-gate-k100", 2, 100, 1, 1, 100, 32, gate_in_kernel=False,
                                   output_final_state=True, dtype=torch.float16),
        "no-l2norm-keep": Problem("no-l2norm-keep", 1, 130, 2, 2, 64, 64, l2norm_in_kernel=False,
                                  disable_recompute=True, initial_state=True, dtype=torch.float16),
    }
    prob = probs[p]
    kw = make_inputs(prob, seed=4)
    with registered("F1-F6", "ours", prep16.f1_f6, prep16.supports_f1_f6), \
            registered("B1-B2", "ours", prep16.b1_b2, prep16.supports_b1_b2):
        got = run_fwd_bwd(chunk_kda, kw, grid=prob.dtype)
        record = last_record()
    assert record.forward["F1-F6"] == "ours", record
    recomputes = prob.gate_in_kernel and not prob.disable_recompute
    assert (record.backward.get("B1-B2") == "ours") == recomputes, record
    want = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kw), grid=prob.dtype)
    errors = {n: ref.rel_rms(got[n].double(), want[n]) for n in want if want[n] is not None}
    print(p, record.forward, record.backward, errors)
    assert len(errors) >= 6 and all(e <= ref.BUDGETS[n] for n, e in errors.items()), errors
