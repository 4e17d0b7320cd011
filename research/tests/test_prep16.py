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


@pytest.mark.parametrize("T,K,V,HV,cu", [(130, 64, 32, 2, None), (100, 100, 64, 1, None), (200, 64, 32, 2, (0, 0, 1, 70, 200))])
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


@pytest.mark.parametrize("lower_bound,bias,cu", [(None, True, None), (-5.0, True, (0, 1, 70, 130)), (None, False, None)])
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
