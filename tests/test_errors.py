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

from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda.problems import Problem, make_inputs

P = Problem("err", 2, 70, 2, 4, 32, 16)


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


CLEARER = {
    "mixed-dtypes": (dict(v=torch.rand(2, 70, 4, 16)), TypeError, "share one dtype"),
    "T-zero": (dict(q=torch.rand(2, 0, 2, 32).bfloat16(), k=torch.rand(2, 0, 2, 32).bfloat16(),
                    v=torch.rand(2, 0, 4, 16).bfloat16(), g=torch.randn(2, 0, 4, 32).bfloat16(),
                    beta=torch.rand(2, 0, 4).bfloat16()), ValueError, "T, K and V >= 1"),
    "v-batch": (dict(v=torch.rand(1, 70, 4, 16).bfloat16()), ValueError, "v must have shape"),
    "q-not-4d": (dict(q=torch.rand(2, 70, 64).bfloat16()), ValueError, "q must have shape"),
    "h0-shape": (dict(initial_state=torch.zeros(2, 4, 16, 32)), ValueError, "initial_state must have shape"),
    "A_log-size": (dict(A_log=torch.zeros(3)), ValueError, "A_log must have HV=4"),
    "dt_bias-size": (dict(dt_bias=torch.zeros(4 * 16)), ValueError, "dt_bias must have HV[*]K=128"),
    "A_log-none": (dict(A_log=None), TypeError, "A_log must be a tensor"),
    "cu_seqlens-not-ending-at-T": (dict(cu_seqlens=torch.tensor([0, 30, 60])), ValueError, "rise from 0 to T"),
    "cu_seqlens-float": (dict(cu_seqlens=torch.tensor([0.0, 70.0])), ValueError, "int32/int64"),
    "integer-g": (dict(g=torch.zeros(2, 70, 4, 32, dtype=torch.int32)), TypeError, "floating-point"),
    "h0-k-first-with-state_v_first": (dict(initial_state=torch.zeros(2, 4, 32, 16), state_v_first=True), ValueError,
                                      r"initial_state must have shape \[N, HV, V, K\] \(state_v_first\)"),
    "cu_seqlens-as-a-list": (dict(cu_seqlens=[0, 70]), TypeError, "cu_seqlens` must be a 1-D int32/int64 torch.Tensor"),
    "cu_seqlens_cpu-as-a-list": (dict(cu_seqlens=torch.tensor([0, 70]), cu_seqlens_cpu=[0, 70]), TypeError,
                                 "cu_seqlens_cpu` must be a 1-D int32/int64 torch.Tensor"),
    "cu_seqlens-2d": (dict(cu_seqlens=torch.tensor([[0, 70]])), ValueError, "1-D int32/int64"),
    "cu_seqlens-falling": (dict(cu_seqlens=torch.tensor([0, 50, 40, 70])), ValueError, "rise from 0 to T"),
}


@pytest.mark.parametrize("name", list(CLEARER))
def test_clearer_errors(name):
    overrides, exc, match = CLEARER[name]
    kw = base(**overrides)
    if "cu_seqlens" in overrides:
        kw = {n: (t[:1] if isinstance(t, torch.Tensor) and n in ("q", "k", "v", "g", "beta") else t) for n, t in kw.items()}
    with pytest.raises(exc, match=match):
        chunk_kda(**kw)


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
    with pytest.warns(UserWarning, match=r"T=4 < H=70; inputs look head-first"):
        chunk_kda(**_head_first_call())


def test_head_first_flag_is_an_error_not_ignored():
    with pytest.raises(ValueError, match="head_first=True is not supported"):
        chunk_kda(**base(), head_first=True)


def test_unknown_keyword_goes_to_fla_with_its_reason():
    with pytest.raises(RuntimeError, match=r"goes to fla \(unknown keyword argument\(s\) some_new_flag\)"):
        chunk_kda(**base(), some_new_flag=1)


# --------------------------------------------------------------------------------------
# docs/errors.md: every bad input above, kernel-fun's answer beside fla's
# --------------------------------------------------------------------------------------
ERRORS_DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
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
    warned = [str(w.message) for w in caught if "Triton is not supported" not in str(w.message)]
    return result + (f" (warns: {warned[0][:120]})" if warned else "")


def _bad_inputs() -> dict[str, dict]:
    calls = {}
    for name, overrides in FLA_CASES.items():
        overrides = dict(overrides)
        drop = overrides.pop("_drop", ())
        kw = base(**overrides)
        for key in drop:
            kw.pop(key)
        calls[name] = kw
    for name, (overrides, _, _) in CLEARER.items():
        kw = base(**overrides)
        if "cu_seqlens" in overrides:
            kw = {n: (t[:1] if isinstance(t, torch.Tensor) and n in ("q", "k", "v", "g", "beta") else t)
                  for n, t in kw.items()}
        calls[name] = kw
    calls["head-first-layout"] = _head_first_call()
    calls["head_first=True"] = base(head_first=True)
    calls["unknown-keyword"] = base(some_new_flag=1)
    return calls


@functools.lru_cache(maxsize=1)
def _fla_outcomes() -> dict[str, str]:
    """fla's outcome for each bad input, from a child process with Triton's interpreter off:
    under the interpreter a call that passes fla's checks would run fla's kernels on the
    bad input (and can abort the process); without it the first launch stops at "0 active
    drivers", which is the observation wanted."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, __file__, "--fla-outcomes"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def error_table() -> str:
    lines = ["| bad input | kernel-fun | fla 0.5.2 (on the CPU: what it checks before its first kernel) |",
             "|---|---|---|"]
    fla = _fla_outcomes()
    for name, kw in _bad_inputs().items():
        ours = _outcome(chunk_kda, kw).replace("|", "\\|")
        lines.append(f"| {name} | {ours} | {fla[name].replace('|', chr(92) + '|')} |")
    return "\n".join(lines)


def test_errors_doc_is_current():
    text = ERRORS_DOC.read_text()
    body = text.split(TABLE_BEGIN)[1].split(TABLE_END)[0].strip()
    assert body == error_table(), "docs/errors.md is stale: run `python tests/test_errors.py`"


def test_no_bad_input_computes_silently_where_fla_checks():
    """Every bad input fla rejects, kernel-fun rejects too (the table's rows, checked)."""
    fla = _fla_outcomes()
    for name, kw in _bad_inputs().items():
        if fla[name].startswith("`"):
            ours = _outcome(chunk_kda, kw)
            assert ours.startswith("`"), (name, ours, fla[name])


if __name__ == "__main__":
    import re

    if "--fla-outcomes" in sys.argv:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        print(json.dumps({name: _outcome(fla_chunk_kda, kw) for name, kw in _bad_inputs().items()}))
        sys.exit(0)
    text = ERRORS_DOC.read_text()
    new = re.sub(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END),
                 lambda _: f"{TABLE_BEGIN}\n{error_table()}\n{TABLE_END}", text, flags=re.S)
    ERRORS_DOC.write_text(new)
    print(f"{ERRORS_DOC}: written")
