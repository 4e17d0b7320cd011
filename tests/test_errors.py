"""Bad input gets fla's error (same type, same message) or a clearer one -- never a wrong
result, never a crash inside a kernel. fla validates before it launches anything, so its
errors can be observed on the CPU and compared one for one."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_fun import _fla
from kernel_fun.cconv import causal_conv1d, last_route
from kernel_fun.cconv import is_supported as conv_is_supported
from kernel_fun.cconv import op as conv_op
from kernel_fun.kda import chunk_kda, is_supported, last_record
from kernel_fun.kda.problems import Problem, make_inputs

# the tests that follow the installed fla's validation and errors: also run against the other
# fla-core kernel-fun serves
EVERY_FLA = pytest.mark.every_fla

P = Problem("err", 2, 70, 2, 4, 32, 16)
# (conftest's mark, written here: this file also runs as a script, which regenerates the doc)
needs_triton = pytest.mark.skipif(not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
                                  reason="Triton kernels need the interpreter or a CUDA device")


def base(**overrides):
    kw = make_inputs(P, requires_grad=False)
    kw.update(overrides)
    return kw


def fla_error(kwargs) -> BaseException:
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    with pytest.raises(Exception) as info:
        fla_chunk_kda(**kwargs)
    return info.value


def _cases():
    kw = make_inputs(P, requires_grad=False)
    k, v, g, beta = kw["k"], kw["v"], kw["g"], kw["beta"]
    packed = make_inputs(Problem("packed", 1, 70, 2, 4, 32, 16), requires_grad=False)
    return {
        "q-k-mismatch": dict(k=k[:, :, :1]),
        "hv-not-multiple-of-h": dict(v=v[:, :, :3], g=g[:, :, :3], beta=beta[:, :, :3]),
        "g-shape": dict(g=g[:, :, :, :16]),
        "beta-shape": dict(beta=beta[:, :, :2]),
        "K-over-256": dict(q=torch.rand(2, 70, 2, 264).bfloat16(), k=torch.rand(2, 70, 2, 264).bfloat16(),
                           g=torch.randn(2, 70, 4, 264).bfloat16()),
        "cu_seqlens-with-B2": dict(cu_seqlens=torch.tensor([0, 30, 70])),
        "h0-not-fp32": dict(initial_state=torch.zeros(2, 4, 32, 16, dtype=torch.bfloat16)),
        "h0-count-vs-cu_seqlens": dict(packed, cu_seqlens=torch.tensor([0, 30, 70]),
                                       initial_state=torch.zeros(3, 4, 32, 16)),
        "chunk_size-48": dict(chunk_size=48),
        "neg-eigval-without-sigmoid": dict(allow_neg_eigval=True),
        "safe_gate-without-lower_bound": dict(safe_gate=True),
        "safe_gate-lower_bound-range": dict(safe_gate=True, lower_bound=-6.0),
        "gate-without-A_log": dict(A_log=None, dt_bias=None, _drop=("A_log", "dt_bias")),
        "both-state-layout-flags": dict(state_v_first=True, transpose_state_layout=True),
    }


FLA_CASES = _cases()


@EVERY_FLA
@pytest.mark.parametrize("name", list(FLA_CASES))
def test_same_error_as_fla(name):
    overrides = dict(FLA_CASES[name])
    drop = overrides.pop("_drop", ())
    kw = base(**overrides)
    for key in drop:
        kw.pop(key)
    expected = fla_error(kw)
    with pytest.raises(type(expected)) as ours:
        chunk_kda(**kw)
    assert str(ours.value) == str(expected)


def _packed(kw: dict) -> dict:
    """kw as one packed row (B = 1), for the cases about cu_seqlens."""
    return {n: (t[:1] if isinstance(t, torch.Tensor) and n in ("q", "k", "v", "g", "beta") else t)
            for n, t in kw.items()}


_ZERO_BATCH = {n: t[:0] for n, t in make_inputs(P, requires_grad=False).items()
               if isinstance(t, torch.Tensor) and n in ("q", "k", "v", "g", "beta")}
# A_log=None without lower_bound: fla 0.6's own ValueError; fla 0.5.2 would run its kernels on None
_A_LOG_NONE = ((ValueError, "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set")
               if _fla.version_tuple() >= (0, 6) else (TypeError, "A_log must be a tensor"))
# (overrides, exception, message pattern, packed): kernel-fun's error where fla has none
CLEARER = {
    "mixed-dtypes": (dict(v=torch.rand(2, 70, 4, 16)), TypeError, "share one dtype", False),
    "T-zero": (dict(q=torch.rand(2, 0, 2, 32).bfloat16(), k=torch.rand(2, 0, 2, 32).bfloat16(),
                    v=torch.rand(2, 0, 4, 16).bfloat16(), g=torch.randn(2, 0, 4, 32).bfloat16(),
                    beta=torch.rand(2, 0, 4).bfloat16()), ValueError, "B, T, K and V >= 1", False),
    "B-zero": (_ZERO_BATCH, ValueError, "B, T, K and V >= 1", False),
    "v-batch": (dict(v=torch.rand(1, 70, 4, 16).bfloat16()), ValueError, "v must have shape", False),
    "q-not-4d": (dict(q=torch.rand(2, 70, 64).bfloat16()), ValueError, "q must have shape", False),
    "q-a-list": (dict(q=[[0.0]]), TypeError, "`q` must be a torch.Tensor", False),
    "h0-shape": (dict(initial_state=torch.zeros(2, 4, 16, 32)), ValueError, "initial_state must have shape", False),
    "A_log-size": (dict(A_log=torch.zeros(3)), ValueError, "A_log must have HV=4", False),
    "dt_bias-size": (dict(dt_bias=torch.zeros(4 * 16)), ValueError, "dt_bias must have HV[*]K=128", False),
    "A_log-none": (dict(A_log=None), *_A_LOG_NONE, False),
    "A_log-a-list": (dict(A_log=[0.0] * 4), TypeError, "A_log must be a tensor", False),
    "dt_bias-a-list": (dict(dt_bias=[0.0] * 128), TypeError, "dt_bias must be a tensor", False),
    "scale-a-tensor": (dict(scale=torch.tensor(0.1)), TypeError, "`scale` must be a Python float", False),
    "scale-a-bool": (dict(scale=True), TypeError, "`scale` must be a Python float", False),
    "cu_seqlens-not-ending-at-T": (dict(cu_seqlens=torch.tensor([0, 30, 60])), ValueError, "rise from 0 to T=70",
                                   True),
    "cu_seqlens-past-T": (dict(cu_seqlens=torch.tensor([0, 30, 90])), ValueError, "rise from 0 to T=70", True),
    "cu_seqlens-negative": (dict(cu_seqlens=torch.tensor([-10, 30, 70])), ValueError, "rise from 0 to T=70", True),
    "cu_seqlens-falling": (dict(cu_seqlens=torch.tensor([0, 50, 40, 70])), ValueError, "without a step down", True),
    "cu_seqlens-float": (dict(cu_seqlens=torch.tensor([0.0, 70.0])), ValueError, "int32/int64", True),
    "cu_seqlens-2d": (dict(cu_seqlens=torch.tensor([[0, 70]])), ValueError, "1-D int32/int64", True),
    "cu_seqlens-0d": (dict(cu_seqlens=torch.tensor(70)), ValueError, "1-D int32/int64", True),
    "cu_seqlens-one-offset": (dict(cu_seqlens=torch.tensor([0])), ValueError, "N[+]1 >= 2 offsets", True),
    "cu_seqlens-as-a-list": (dict(cu_seqlens=[0, 70]), TypeError, "cu_seqlens` must be a 1-D int32/int64 torch.Tensor",
                             True),
    "cu_seqlens_cpu-as-a-list": (dict(cu_seqlens=torch.tensor([0, 70]), cu_seqlens_cpu=[0, 70]), TypeError,
                                 "cu_seqlens_cpu` must be a 1-D int32/int64 torch.Tensor", True),
    "cu_seqlens_cpu-without-cu_seqlens": (dict(cu_seqlens_cpu=torch.tensor([0, 70])), ValueError,
                                          "cu_seqlens_cpu must be cu_seqlens's offsets", False),
    "cu_seqlens_cpu-of-other-length": (dict(cu_seqlens=torch.tensor([0, 70]), cu_seqlens_cpu=torch.tensor([0, 30, 70])),
                                       ValueError, "cu_seqlens_cpu must be cu_seqlens's offsets", True),
    "cu_seqlens_cpu-wrong": (dict(cu_seqlens=torch.tensor([0, 70]), cu_seqlens_cpu=torch.tensor([0, 60])),
                             ValueError, "rise from 0 to T=70", True),
    "integer-g": (dict(g=torch.zeros(2, 70, 4, 32, dtype=torch.int32)), TypeError, "floating-point", False),
    "h0-k-first-with-state_v_first": (dict(initial_state=torch.zeros(2, 4, 32, 16), state_v_first=True), ValueError,
                                      r"initial_state must have shape \[N, HV, V, K\] \(state_v_first\)", False),
}


def clearer_call(name: str) -> dict:
    overrides, _, _, packed = CLEARER[name]
    kw = base(**overrides)
    return _packed(kw) if packed else kw


@EVERY_FLA
@pytest.mark.parametrize("name", list(CLEARER))
def test_clearer_errors(name):
    _, exc, match, _ = CLEARER[name]
    kw = clearer_call(name)
    with pytest.raises(exc, match=match):
        chunk_kda(**kw)
    ok, reason = is_supported(**kw)
    assert not ok and reason.startswith("invalid arguments"), reason


def test_non_contiguous_inputs_give_the_contiguous_result():
    kw = make_inputs(P, requires_grad=False)
    o_ref, _ = chunk_kda(**kw)
    strided = dict(kw)
    for name in ("q", "k", "v", "g"):
        t = kw[name]
        strided[name] = t.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
        assert not strided[name].is_contiguous()
    o, _ = chunk_kda(**strided)
    assert last_record().engaged
    assert torch.equal(o, o_ref)


def test_nan_input_gives_nan_output_not_a_crash():
    kw = make_inputs(P, requires_grad=False)
    q = kw["q"].clone()
    q[0, 5, 0, 3] = float("nan")
    o, _ = chunk_kda(**dict(kw, q=q))
    assert torch.isnan(o[0, 5:]).any()
    assert not torch.isnan(o[1]).any()  # the other sequence is untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_two_devices():
    kw = make_inputs(P, requires_grad=False)
    kw["v"] = kw["v"].cuda()
    with pytest.raises(ValueError, match="one device"):
        chunk_kda(**kw)


def _head_first_call():
    """A call in fla's removed head-first layout, [B, H, T, ...], with H = HV so that every
    shape check passes: T=70 tokens of 4 heads read as 4 tokens of 70 heads."""
    p = Problem("head-first", 2, 70, 4, 4, 32, 16, gate_in_kernel=False)
    kw = make_inputs(p, requires_grad=False)
    for name in ("q", "k", "v", "g", "beta"):
        kw[name] = kw[name].transpose(1, 2).contiguous()
    return kw


def test_head_first_layout_warns():
    """Every call warns (the first decides afresh, the next reuses its plan), at the caller's line."""
    from kernel_fun.kda.stages import use_impls

    kw = _head_first_call()
    for _ in range(2):
        with pytest.warns(UserWarning, match=r"T=4 < H=70; inputs look head-first") as caught, use_impls("reference"):
            chunk_kda(**kw)
        assert [w.filename for w in caught] == [__file__]


@EVERY_FLA
def test_head_first_flag_is_an_error_not_ignored():
    with pytest.raises(ValueError, match="head_first=True is not supported"):
        chunk_kda(**base(), head_first=True)


@EVERY_FLA
def test_unknown_keyword_goes_to_fla_with_its_reason():
    with pytest.raises(RuntimeError, match=r"goes to fla \(unknown keyword argument\(s\) some_new_flag\)"):
        chunk_kda(**base(), some_new_flag=1)


# --------------------------------------------------------------------------------------
# Crashes that became errors or results
# --------------------------------------------------------------------------------------
def test_double_backward_says_it_is_not_supported():
    """create_graph=True through either op's kernels: a clear error, not gradients that
    silently carry no graph. (The convolution's CPU path is torch autograd: differentiable.)"""
    kw = make_inputs(Problem("double", 1, 20, 1, 1, 16, 16))
    o, _ = chunk_kda(**kw)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        torch.autograd.grad(o.float().sum(), kw["q"], create_graph=True)
    gq, = torch.autograd.grad(chunk_kda(**kw)[0].float().sum(), kw["q"])  # first order still runs
    assert gq.shape == kw["q"].shape and not gq.requires_grad


@needs_triton
def test_convolution_double_backward_says_it_is_not_supported():
    x = torch.randn(2, 9, 16, requires_grad=True)
    y, _ = causal_conv1d(x, torch.randn(16, 4), activation="silu")
    assert last_route() == "kernels"
    with pytest.raises(RuntimeError, match="causal_conv1d: double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("shape", [(4, 32), (4, 32, 1)], ids=["2-D", "3-D"])
def test_gate_parameters_of_any_shape_get_gradients_of_their_shape(shape):
    """dt_bias [HV, K] (or any shape of HV*K elements) and A_log [HV, 1]: each gradient in
    its parameter's shape, and equal to the flat parameters' gradients."""
    from kernel_fun.kda.stages import use_impls

    kw = make_inputs(P)
    flat = {n: kw[n] for n in ("A_log", "dt_bias")}
    shaped = {"A_log": flat["A_log"].detach().view(4, 1).clone().requires_grad_(True),
              "dt_bias": flat["dt_bias"].detach().view(shape).clone().requires_grad_(True)}
    with use_impls("reference"):  # the chain's boundary shapes them, whichever stages ran
        chunk_kda(**kw)[0].float().sum().backward()
        chunk_kda(**{**kw, **shaped})[0].float().sum().backward()
    for n in shaped:
        assert shaped[n].grad.shape == shaped[n].shape
        assert torch.equal(shaped[n].grad.flatten(), flat[n].grad.flatten()), n


def test_assert_offsets_checks_on_the_device_once_per_tensor_version():
    """The device-side check of offsets: on a CPU tensor torch's assert raises at once (on a
    GPU it stops the stream with the same message before the first kernel); an offsets
    tensor is checked once while it lives unmodified, again after an in-place write."""
    from kernel_fun import _runtime

    good = torch.tensor([0, 30, 70])
    _runtime.assert_offsets(good, 70, "op")
    for bad in ([0, 30, 60], [0, 40, 30, 70], [5, 30, 70]):
        with pytest.raises(RuntimeError, match="op: cu_seqlens must rise from 0 to T=70 without a step down"):
            _runtime.assert_offsets(torch.tensor(bad), 70, "op")
    calls = []
    real = torch._assert_async
    try:
        torch._assert_async = lambda *a: calls.append(a)
        _runtime.assert_offsets(good, 70, "op")
        assert calls == []  # checked already
        good[1] = 31
        _runtime.assert_offsets(good, 70, "op")
        assert len(calls) == 1
    finally:
        torch._assert_async = real


@EVERY_FLA
def test_a_lower_bound_gate_without_A_log_follows_the_installed_fla():
    """fla 0.6 takes ``A_log`` omitted when ``lower_bound`` is set (the gate
    ``L * sigmoid(g + dt_bias)``): kernel-fun's chain runs it, the output and every gradient
    within fla's budgets of the float64 recurrence (fp16). fla 0.5.2 asserts A_log is
    passed: so does kernel-fun."""
    from kernel_fun.kda.problems import as_oracle_inputs, run_fwd_bwd
    from kernel_fun.kda.reference import BUDGETS, recurrent_kda, rel_rms

    p = Problem("lb-only", 2, 100, 2, 2, 32, 16, lower_bound=-5.0, safe_gate=True, initial_state=True,
                output_final_state=True, dtype=torch.float16)
    kw = make_inputs(p)
    kw.pop("A_log")
    if _fla.version_tuple() < (0, 6):
        with pytest.raises(AssertionError, match="A_log must be provided"):
            chunk_kda(**kw)
        with pytest.raises(TypeError, match="fla 0.6 takes None with lower_bound"):
            chunk_kda(**kw, A_log=None)
        return
    ours = run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    assert last_record().engaged
    want = run_fwd_bwd(recurrent_kda, as_oracle_inputs(kw), grid=p.dtype)
    assert set(ours) == set(want) and "ddt_bias" in want and "dA_log" not in want
    errors = {n: rel_rms(ours[n], want[n]) for n in want}
    assert all(e <= BUDGETS[n] for n, e in errors.items()), errors


# --------------------------------------------------------------------------------------
# causal_conv1d's bad inputs
# --------------------------------------------------------------------------------------
def _conv_x(B=2, T=8):
    return torch.randn(B, T, 16, generator=torch.Generator().manual_seed(0))


_W = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
# (arguments, exception, message pattern): kernel-fun's answer to each
CONV_CASES = {
    "no-weight": (dict(x=_conv_x()), ValueError, "weight .* is required"),
    "weight-1-D": (dict(x=_conv_x(), weight=_W[:, 0]), ValueError, r"weight must be \[D, W\]"),
    "weight-width-0": (dict(x=_conv_x(), weight=_W[:, :0]), ValueError, "width W must be at least 1"),
    "x-2-D": (dict(x=_conv_x()[0], weight=_W), ValueError, r"x must be \[B, T, D\]"),
    "channels": (dict(x=_conv_x(), weight=_W[:15]), ValueError, "channels a token"),
    "bias-shape": (dict(x=_conv_x(), weight=_W, bias=torch.randn(15)), ValueError, "bias must be"),
    "residual-shape": (dict(x=_conv_x(), weight=_W, residual=torch.randn(2, 7, 16)), ValueError, "residual must have"),
    "activation-gelu": (dict(x=_conv_x(), weight=_W, activation="gelu"), ValueError, "activation must be"),
    "state-shape": (dict(x=_conv_x(), weight=_W, initial_state=torch.randn(2, 16, 3)), ValueError,
                    "initial_state must be"),
    "offsets-with-B2": (dict(x=_conv_x(), weight=_W, cu_seqlens=torch.tensor([0, 3, 8])), ValueError,
                        r"x must be \[1, total tokens, D\]"),
    "offsets-past-x": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0, 3, 9])), ValueError,
                       "rise from 0 to T=8"),
    "offsets-ending-early": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0, 3, 6])), ValueError,
                             "rise from 0 to T=8"),
    "offsets-negative": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([-2, 3, 8])), ValueError,
                         "rise from 0 to T=8"),
    "offsets-falling": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError,
                        "without a step down"),
    "offsets-host-copy-wrong": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0, 3, 8]),
                                     cu_seqlens_cpu=torch.tensor([0, 3, 9])), ValueError, "rise from 0 to T=8"),
    "offsets-host-copy-length": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0, 3, 8]),
                                      cu_seqlens_cpu=torch.tensor([0, 8])), ValueError,
                                 "cu_seqlens_cpu must be cu_seqlens's 3 integer offsets"),
    "offsets-as-a-list": (dict(x=_conv_x(1), weight=_W, cu_seqlens=[0, 3, 8]), TypeError,
                          "cu_seqlens must be a 1-D int32/int64 torch.Tensor"),
    "offsets-float": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0.0, 8.0])), ValueError, "int32/int64"),
    "offsets-2-D": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([[0, 8]])), ValueError, "1-D int32/int64"),
    "offsets-0-D": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor(8)), ValueError, "1-D int32/int64"),
    "offsets-one": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0])), ValueError, "N [+] 1 >= 2 offsets"),
    "state-with-offsets-count": (dict(x=_conv_x(1), weight=_W, cu_seqlens=torch.tensor([0, 3, 8]),
                                      initial_state=torch.randn(3, 16, 4)), ValueError,
                                 r"initial_state must be \[N, D, W\] = \[2"),
}
# Inputs at the edges that compute: the empty result fla's shapes imply
CONV_EDGES = {"batch-zero": dict(x=_conv_x(0), weight=_W, initial_state=torch.randn(0, 16, 4), output_final_state=True),
              "tokens-zero": dict(x=_conv_x(2, 0), weight=_W, initial_state=torch.randn(2, 16, 4),
                                  output_final_state=True)}


@EVERY_FLA
@pytest.mark.parametrize("name", list(CONV_CASES))
def test_convolution_bad_input_gets_a_clear_error(name):
    kw, exc, match = CONV_CASES[name]
    with pytest.raises(exc, match=match):
        causal_conv1d(**kw)
    ok, reason = conv_is_supported(**kw)
    assert not ok and reason.startswith("invalid arguments"), reason


@pytest.mark.parametrize("path", ["kernels", "reference"])
@pytest.mark.parametrize("name", list(CONV_EDGES))
def test_convolution_edges_compute_empty_results(name, path, monkeypatch):
    """No batch or no tokens: y empty, the final state the initial state's slots (no token
    shifted in), the gradients of x's shape and zero for the weight; on the kernels and the
    torch path alike."""
    if path == "reference":
        monkeypatch.setattr(conv_op, "uses_kernels", lambda x: False)
    elif not conv_op.uses_kernels(torch.zeros(1)):
        pytest.skip("the kernels need the interpreter on a CPU")
    kw = {**CONV_EDGES[name]}
    x = kw["x"].clone().requires_grad_(True)
    w = kw["weight"].clone().requires_grad_(True)
    y, final = causal_conv1d(**{**kw, "x": x, "weight": w}, activation="silu")
    assert last_route() == path
    assert y.shape == x.shape and torch.equal(final, kw["initial_state"])
    (y.sum() + final.sum()).backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


# --------------------------------------------------------------------------------------
# docs/errors.md: every bad input above, kernel-fun's answer beside fla's, under each fla
# --------------------------------------------------------------------------------------
ERRORS_DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
OUTCOMES = ERRORS_DOC.with_name("errors-outcomes.json")
TABLE_BEGIN, TABLE_END = "<!-- errors:begin (generated by `python tests/test_errors.py`) -->", "<!-- errors:end -->"


def _outcome(fn, kw) -> str:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn(**kw)
            result = "computes"
        except Exception as err:  # the outcome is what the table records
            text = str(err).splitlines()[0] if str(err) else ""
            if "active drivers" in text:
                return "no check: reaches its first kernel"
            result = f"`{type(err).__name__}`: {text[:160]}"
    # the call's own warnings, not those of an import on the way (fla's about missing
    # packages and the CPU, torch's and numpy's deprecations under the interpreter)
    noise = ("is not installed", "Triton is not supported", "script_method", "Conversion of an array")
    warned = [str(w.message) for w in caught if not any(n in str(w.message) for n in noise)]
    return result + (f" (warns: {warned[0][:120]})" if warned else "")


def kda_calls() -> dict[str, dict]:
    calls = {}
    for name, overrides in FLA_CASES.items():
        overrides = dict(overrides)
        drop = overrides.pop("_drop", ())
        kw = base(**overrides)
        for key in drop:
            kw.pop(key)
        calls[name] = kw
    for name in CLEARER:
        calls[name] = clearer_call(name)
    calls["lower-bound-gate-without-A_log"] = {k: v for k, v in base(lower_bound=-5.0).items() if k != "A_log"}
    calls["head-first-layout"] = _head_first_call()
    calls["head_first=True"] = base(head_first=True)
    calls["unknown-keyword"] = base(some_new_flag=1)
    return calls


def conv_calls() -> dict[str, dict]:
    return {**{n: kw for n, (kw, _, _) in CONV_CASES.items()}, **CONV_EDGES}


def fla_outcomes() -> dict:
    """fla's outcome for each bad input, from a child process with Triton's interpreter off:
    under the interpreter a call that passes fla's checks would run fla's kernels on the bad
    input, and can abort the process; without it the first launch stops at "0 active
    drivers", which is the observation wanted."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, __file__, "--fla-outcomes"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=1)
def outcomes_here(ask_fla: bool = True) -> dict:
    """Each bad input's outcome under the installed fla: kernel-fun's (this process) and
    fla's (``fla_outcomes``; without ``ask_fla``, the stored ones of the installed fla-core
    version where there are any: fla's checks are fixed by its version)."""
    from kernel_fun.kda.stages import use_impls

    stored = _load().get(_fla.version()) if OUTCOMES.exists() and not ask_fla else None
    fla = ({op: {n: row["fla"] for n, row in rows.items()} for op, rows in stored.items()} if stored
           else fla_outcomes())
    with use_impls("reference"):  # a call that computes computes the same on any path: the quickest
        ours = {"kda": {n: _outcome(chunk_kda, kw) for n, kw in kda_calls().items()},
                "conv": {n: _outcome(causal_conv1d, kw) for n, kw in conv_calls().items()}}
    return {op: {n: {"kernel_fun": ours[op][n], "fla": fla[op].get(n, "(not asked)")} for n in ours[op]}
            for op in ours}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(store: dict) -> str:
    """The two tables (chunk_kda, causal_conv1d) from every fla version's outcomes. fla's
    cell reads "same" where it says what kernel-fun's beside it says; a cell of a later
    version reads "as with <version>" where it says what the same column said there."""
    versions = sorted(store, key=lambda v: tuple(int(x) for x in v.split(".")[:2]))
    parts = []
    for op, title in (("kda", "chunk_kda"), ("conv", "causal_conv1d")):
        head = ["bad input"] + [c for v in versions for c in (f"kernel-fun, fla-core {v}", f"fla-core {v}")]
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in store[versions[0]][op]:
            cells, before = [name], None
            for v in versions:
                row = store[v][op].get(name, {"kernel_fun": "(not asked)", "fla": "(not asked)"})
                for who in ("kernel_fun", "fla"):
                    text = row[who]
                    if who == "fla" and text == row["kernel_fun"]:
                        cells.append("same")
                    elif before is not None and text == before[0][who]:
                        cells.append(f"as with {before[1]}")
                    else:
                        cells.append(_cell(text))
                before = (row, v)
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _load() -> dict:
    return json.loads(OUTCOMES.read_text())


# the two tests below share one computation of the outcomes: one worker
@EVERY_FLA
@pytest.mark.xdist_group("errors-doc")
def test_errors_doc_is_current():
    """The stored outcomes under the installed fla are today's (kernel-fun's computed now;
    fla's, fixed by its version, as stored: `python tests/test_errors.py` asks fla again),
    and docs/errors.md shows the stored outcomes of every fla version."""
    store = _load()
    assert store.get(_fla.version()) == outcomes_here(ask_fla=False), (
        f"docs/errors-outcomes.json is stale for fla-core {_fla.version()}: run `python tests/test_errors.py`")
    body = ERRORS_DOC.read_text().split(TABLE_BEGIN)[1].split(TABLE_END)[0].strip()
    assert body == render(store), "docs/errors.md is stale: run `python tests/test_errors.py`"


@EVERY_FLA
@pytest.mark.xdist_group("errors-doc")
def test_no_bad_input_computes_silently_where_fla_checks():
    """Every bad input fla rejects, kernel-fun rejects too (the installed fla's rows)."""
    for op, rows in outcomes_here(ask_fla=False).items():
        for name, row in rows.items():
            if row["fla"].startswith("`"):
                assert row["kernel_fun"].startswith("`"), (op, name, row)


if __name__ == "__main__":
    import re

    if "--fla-outcomes" in sys.argv:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        fla_conv = _fla.causal_conv1d()
        print(json.dumps({"kda": {n: _outcome(fla_chunk_kda, kw) for n, kw in kda_calls().items()},
                          "conv": {n: _outcome(fla_conv, kw) for n, kw in conv_calls().items()}}))
        sys.exit(0)
    if "--outcomes" in sys.argv:
        print(json.dumps({_fla.version(): outcomes_here()}))
        sys.exit(0)
    # python tests/test_errors.py [--with PYTHON ...]: the installed fla's outcomes, and each
    # other interpreter's (one with another fla-core installed) through its own run
    store = _load() if OUTCOMES.exists() else {}
    store[_fla.version()] = outcomes_here()
    others = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--with"]
    for python in others:
        done = subprocess.run([python, __file__, "--outcomes"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        store.update(json.loads(done.stdout.strip().splitlines()[-1]))
    OUTCOMES.write_text(json.dumps(store, indent=1) + "\n")
    text = ERRORS_DOC.read_text()
    new = re.sub(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END),
                 lambda _: f"{TABLE_BEGIN}\n{render(store)}\n{TABLE_END}", text, flags=re.S)
    ERRORS_DOC.write_text(new)
    print(f"{ERRORS_DOC}, {OUTCOMES}: written (fla-core {', '.join(sorted(store))})")
