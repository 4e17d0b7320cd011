"""Causal to the bit: the output at token t, and a prefix's final state, do not depend on any
input after t -- finite or not -- on every path of kernel-fun's: the chain of torch stage
references (the CPU path) and the chain with kernel-fun's kernels (F7-F8's scan here, through
the interpreter). A full call's o[:t] is held bit for bit to the call on the first t tokens,
with random, NaN and +-inf values planted after t, at cuts inside a chunk and at its edge,
dense and packed. A -inf log-decay (a full reset) leaves the outputs on both sides finite
and within budget of the float64 recurrence. (On a GPU the chain's F1-F6 are fla's kernels:
tests/test_gpu.py reports which of them leak.)"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import HAS_CUDA, INTERPRETING, needs_triton
from benchmarks.causal import KINDS, TOKEN_INPUTS, bits, planted, prefix_call, stage_leaks
from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda.problems import Problem, make_inputs
from kernel_fun.kda.reference import BUDGETS, recurrent_kda, rel_rms
from kernel_fun.kda.stages import use_impls

PROBLEMS = {
    # pre-gated g (a log-decay: -inf is a reset), GVA, initial state
    "dense-pregated": Problem("dense-pregated", 2, 150, 1, 2, 32, 16, gate_in_kernel=False, initial_state=True,
                              output_final_state=True),
    # the gate in the op (a raw gate input of +inf is a reset), beta's sigmoid in the op
    "dense-gate": Problem("dense-gate", 1, 150, 2, 2, 32, 16, beta_sigmoid_in_kernel=True, output_final_state=True),
    # packed: the cut inside the second sequence
    "packed": Problem("packed", 1, 230, 1, 1, 32, 16, gate_in_kernel=False, initial_state=True,
                      output_final_state=True, cu_seqlens=(0, 70, 200, 230)),
}
CUTS = {"dense-pregated": (37, 64, 100), "dense-gate": (1, 64, 127), "packed": (100, 134, 70)}


def _path(name):
    """The chain of stage references, or the chain with kernel-fun's kernels."""
    return use_impls("reference") if name == "reference" else contextlib.nullcontext()


def _call(kw):
    o, final = chunk_kda(**kw)
    return o, final


@needs_triton
@pytest.mark.parametrize("path", ["reference", "ours"])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_output_is_causal_to_the_bit(name, path):
    p = PROBLEMS[name]
    kw = make_inputs(p, requires_grad=False)
    with _path(path):
        for cut in CUTS[name]:
            o_p, final_p = _call(prefix_call(p, kw, cut))
            if path == "ours":
                assert last_record().forward.get("F7-F8") == "ours"  # the launch witness
            for j, kind in enumerate(KINDS):
                o, _ = _call(planted(kw, cut, kind, seed=cut + j))
                assert torch.equal(bits(o[:, :cut]), bits(o_p)), (name, path, cut, kind)
            assert torch.isfinite(o_p).all() and torch.isfinite(final_p).all()


@needs_triton
@pytest.mark.parametrize("path", ["reference", "ours"])
def test_state_at_a_chunk_edge_is_the_prefix_final_state(path):
    """The state the full call carries into chunk c (its intermediate states, as fla returns
    them: h[c], in k's dtype) is the prefix call's final state over the first 64 c tokens,
    rounded once, whatever follows."""
    p = PROBLEMS["dense-pregated"]
    kw = make_inputs(p, requires_grad=False)
    with _path(path), torch.inference_mode():
        for cut in (64, 128):
            _, final_p = _call(prefix_call(p, kw, cut))
            full = planted(kw, cut, "nan", seed=cut)
            _, _, h = chunk_kda(**full, return_intermediate_states=True)
            assert torch.equal(bits(h[:, cut // 64]), bits(final_p.to(h.dtype))), (path, cut)


@pytest.mark.parametrize("path", ["reference", "ours"])
@pytest.mark.parametrize("name", ["dense-pregated", "dense-gate", "packed"])
def test_a_minus_inf_log_decay_is_a_reset(name, path):
    """A log-decay of -inf (pre-gated: g itself; the gate in the op: a raw input of +inf)
    empties the state: every output on both sides finite and within budget of the float64
    recurrence, which takes exp(-inf) = 0 (whole heads, some channels, at a chunk's first and
    last rows and inside)."""
    if path == "ours" and not (INTERPRETING or HAS_CUDA):
        pytest.skip("Triton kernels need the interpreter or a CUDA device")
    p = PROBLEMS[name]
    kw = make_inputs(p, requires_grad=False)
    g = kw["g"].clone()
    reset = float("-inf") if not p.gate_in_kernel else float("inf")
    g[0, 40, 0] = reset
    g[0, 64, :, :5] = reset
    g[0, 127, -1, 3] = reset
    g[0, 90:92] = reset
    kw["g"] = g
    o64, final64 = recurrent_kda(**kw)
    with _path(path):
        o, final = _call(kw)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms(o, o64) <= BUDGETS["o"] and rel_rms(final, final64) <= BUDGETS["final_state"]


@needs_triton
@pytest.mark.parametrize("K,dtype", [(32, torch.bfloat16), (32, torch.float16), (32, torch.float32),
                                     (160, torch.bfloat16)], ids=["transposed-bf16", "transposed-fp16",
                                                                  "transposed-fp32", "wide-K-bf16"])
def test_scan_kernel_selects_away_a_later_non_finite_row(K, dtype):
    """F7-F8's kernels alone (the transposed-state one, K <= 128, and the [K, V] one): a NaN
    or inf value of u (so of v_new) at token j leaves o[:j] bit for bit as with u zero from
    j on (0 * NaN in the masked product would be NaN), and makes that value column NaN from
    token j on, the others finite (a 16-bit value is read as finite from its exponent bits)."""
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels import f7_f8_b3_scan as scan

    p = Problem("scan", 1, 100, 1, 1, K, 16, gate_in_kernel=False, l2norm_in_kernel=False, dtype=dtype)
    kw = make_inputs(p, requires_grad=False)
    q, k, v, g, beta = (kw[n] for n in TOKEN_INPUTS)
    gc = ref.gate_cumsum(g, False)
    Aqk, Akk = ref.intra_scores(q, k, gc, beta, K ** -0.5)
    w, u, qg, kg = ref.wy_fwd(k, v, beta, Akk, gc, q=q)

    def o_of(u):
        return scan.scan_output(q, qg, kg, w, u, gc, Aqk, K ** -0.5, None, False, False, None, False, 64, None,
                                None)[0]

    for j, value in ((70, float("nan")), (64, float("inf")), (99, float("-inf"))):
        bad, zero = u.clone(), u.clone()
        bad[0, j, 0, 3] = value
        zero[0, j:] = 0
        o_bad, o_zero = o_of(bad), o_of(zero)
        assert torch.equal(bits(o_bad[:, :j]), bits(o_zero[:, :j])), j
        assert torch.isnan(o_bad[0, j:, 0, 3]).all() and torch.isfinite(o_bad[0, :, 0, :3]).all()


@needs_triton
@pytest.mark.parametrize("path", ["reference", "ours"])
@pytest.mark.parametrize("name", ["dense-gate", "packed"])
def test_no_stage_leaks(name, path):
    """Stage by stage (``benchmarks.causal``): no forward stage of the path, given inputs
    that match the prefix call's before the cut, returns outputs that do not."""
    p = PROBLEMS[name]
    with _path(path):
        verdict = stage_leaks(p, CUTS[name][0])
    leaks = {s: e for s, e in verdict.items() if e["leaks"]}
    assert not leaks, leaks
    assert verdict["F7-F8" if path == "ours" else "F8"]["impl"] == ("ours" if path == "ours" else "reference")


@pytest.mark.parametrize("path", ["kernels", "reference"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_convolution_is_causal_to_the_bit(path, packed, monkeypatch):
    """causal_conv1d: y[:t] and the state after token t are the call on the first t tokens',
    bit for bit, with random, NaN and -inf values in x and the residual after t."""
    from kernel_fun.cconv import causal_conv1d, last_route
    from kernel_fun.cconv import op

    if path == "reference":
        monkeypatch.setattr(op, "uses_kernels", lambda x: False)
    elif not op.uses_kernels(torch.zeros(1)):
        pytest.skip("the kernels need the interpreter on a CPU")
    gen = torch.Generator().manual_seed(0)
    B, T, D = 1, 80, 8
    x = torch.randn(B, T, D, generator=gen).bfloat16()
    res = torch.randn(B, T, D, generator=gen).bfloat16()
    args = dict(weight=torch.randn(D, 4, generator=gen), bias=torch.randn(D, generator=gen), activation="silu",
                output_final_state=True)
    bounds = [0, 30, 80] if packed else None
    for cut in (37, 79):
        seqs = None if bounds is None else torch.tensor([b for b in bounds if b < cut] + [cut])
        N = B if seqs is None else len(seqs) - 1
        h0 = torch.randn(N, D, 4, generator=gen).bfloat16()
        y_p, f_p = causal_conv1d(x[:, :cut], residual=res[:, :cut], initial_state=h0, cu_seqlens=seqs, **args)
        assert last_route() == path
        for value in ("random", "nan", "-inf"):
            xf, rf = x.clone(), res.clone()
            if value == "random":
                xf[:, cut:] = torch.randn(xf[:, cut:].shape, generator=gen).bfloat16()
            else:
                xf[:, cut:cut + 3] = float(value)
                rf[:, cut + 1:] = float(value)
            full_seqs = None if bounds is None else torch.tensor(bounds)
            h0_full = h0 if seqs is None else torch.cat([h0, torch.zeros(len(bounds) - len(seqs), D, 4).bfloat16()])
            y, _ = causal_conv1d(xf, residual=rf, initial_state=h0_full, cu_seqlens=full_seqs, **args)
            assert torch.equal(bits(y[:, :cut]), bits(y_p)), (path, packed, cut, value)
        assert torch.isfinite(f_p).all()


def _prefix_loss_grads(p: Problem, kw: dict, cut: int, do: torch.Tensor) -> dict:
    """Every gradient of a loss on o[:, :cut] alone."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in kw.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    o, _ = chunk_kda(**{**kw, **leaves})
    (o[:, :cut].float() * do).sum().backward()
    return {n: t.grad for n, t in leaves.items()}


def _gradient_differences(p: Problem, cuts) -> dict:
    """Where a loss on o[:, :t] gives the tokens before t (and h0) other gradients in the
    whole call than in the call on its first t tokens (the gate's parameters, sums over every
    token, excluded: their summation order follows the length)."""
    kw = make_inputs(p, requires_grad=False)
    found = {}
    for cut in cuts:
        do = torch.randn(p.B, cut, p.HV, p.V, generator=torch.Generator().manual_seed(cut))
        want = _prefix_loss_grads(p, prefix_call(p, kw, cut), cut, do)
        got = _prefix_loss_grads(p, kw, cut, do)
        for n in ("q", "k", "v", "g", "beta", "initial_state"):
            if n in want:
                a = got[n][:, :cut] if n != "initial_state" else got[n]
                if not torch.equal(bits(a), bits(want[n])):
                    found[(cut, n)] = (a.float() - want[n].float()).abs().max().item()
    return found


GRAD_PROBLEM = Problem("grad", 1, 150, 1, 2, 32, 16, gate_in_kernel=False, initial_state=True)


@needs_triton
@pytest.mark.parametrize("path", ["reference", "ours"])
def test_gradients_of_a_prefix_loss_do_not_depend_on_later_inputs(path):
    """A loss on o[:, :t]: the gradients of the tokens before t and of h0 are the call on the
    first t tokens', bit for bit -- the torch references, and the chain with kernel-fun's B2,
    B3, B6 and B7-B9 (whose levels follow from each row and the rows before it), at a cut
    before a chunk's middle row and one past it. B7-B9's own test with steeper gates and many
    levels is in tests/test_b7_b9_intra_bwd.py."""
    impls = use_impls("reference") if path == "reference" else contextlib.nullcontext()
    with impls:
        assert _gradient_differences(GRAD_PROBLEM, (20, 100)) == {}
    if path != "reference":
        record = last_record().backward
        assert record.get("B6") is not None and record.get("B7-B9") == "ours", record
