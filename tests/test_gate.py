"""The whitelist gate: every parameter classified, every fallback verbatim, every switch."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

import kernel_fun
from kernel_fun.kda import PARAMETERS, chunk_kda, is_supported, last_record, use_impls
from kernel_fun.kda import chunk as chunk_mod
from kernel_fun.kda.problems import Problem, make_inputs

from conftest import needs_interpreter

# (the installed fla's validation and errors: run against every fla-core kernel-fun serves)
pytestmark = pytest.mark.every_fla

# fla 0.6.0 added these to chunk_kda's signature (fla 0.5.2 is what CI installs).
FLA_060_EXTRA = ("use_graph", "max_num_seqs")
# Keywords fla 0.5.2 reads out of **kwargs.
FLA_KWARGS = ("A_log", "dt_bias", "chunk_size", "transpose_state_layout")

SMALL = Problem("gate", 1, 70, 2, 2, 32, 16)


class FlaStub:
    """Stands in for fla's chunk_kda (fla's kernels do not run on the CPU)."""

    def __init__(self):
        self.calls = []
        self.result = (object(), None)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.fixture
def fla_stub(monkeypatch):
    """fla on a CUDA device, as far as the gate can tell: the stub takes the call, and the
    CPU tensors pass the device check a real fallback makes (tested on its own below)."""
    from kernel_fun import _fla

    stub = FlaStub()
    monkeypatch.setattr(_fla, "chunk_kda", lambda: stub)
    monkeypatch.setattr(chunk_mod, "_require_cuda", lambda reason, args, kwargs: None)
    return stub


def inputs(**overrides):
    kw = make_inputs(SMALL, requires_grad=False)
    kw.update(overrides)
    return kw


def test_signature_is_the_installed_fla_s_plus_0_6():
    """fla's named parameters in fla's order and defaults, with fla 0.6's two added at the
    end where the installed fla (0.5.2) lacks them."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    fla_params = list(inspect.signature(fla_chunk_kda).parameters.values())
    ours = list(inspect.signature(chunk_kda).parameters.values())
    fla_named = [p for p in fla_params if p.kind != p.VAR_KEYWORD]
    ours_named = [p for p in ours if p.kind != p.VAR_KEYWORD]
    missing = [name for name in FLA_060_EXTRA if name not in {p.name for p in fla_named}]
    assert [p.name for p in ours_named] == [p.name for p in fla_named] + missing
    for a, b in zip(ours_named, fla_named):
        assert a.default == b.default, a.name
    assert ours[-1].kind == inspect.Parameter.VAR_KEYWORD


def test_every_parameter_is_classified():
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    names = [p.name for p in inspect.signature(fla_chunk_kda).parameters.values() if p.kind != p.VAR_KEYWORD]
    for name in names + list(FLA_060_EXTRA) + list(FLA_KWARGS):
        assert name in PARAMETERS, f"{name} is not classified"


def test_supported_call_engages_and_logs_once(caplog, fla_stub):
    caplog.set_level(logging.INFO, logger="kernel_fun")
    kw = inputs()
    assert is_supported(**kw) == (True, None)
    for _ in range(2):
        chunk_kda(**kw)
    assert not fla_stub.calls
    assert last_record().engaged
    engaged = [r for r in caplog.records if r.getMessage().startswith("engaged (")]
    assert len(engaged) == 1 and engaged[0].levelno == logging.INFO


FALLBACKS = [
    (dict(transpose_state_layout=False), "transpose_state_layout"),
    (dict(cp_context=object()), "cp_context"),
    # (use_graph alone: fla 0.6's capacity-shaped mode, which the chain takes under 0.6)
    (dict(use_graph=True, disable_recompute=True), "use_graph"),
    (dict(max_num_seqs=4), "max_num_seqs"),
    (dict(chunk_size=32), "chunk_size=32"),
    (dict(some_new_flag=1), "some_new_flag"),
]


@pytest.mark.parametrize("extra,needle", FALLBACKS, ids=[n for _, n in FALLBACKS])
def test_fallback_passes_fla_the_callers_arguments(extra, needle, fla_stub, caplog):
    caplog.set_level(logging.INFO, logger="kernel_fun")
    kw = inputs(**extra)
    ok, reason = is_supported(**kw)
    assert not ok and needle in reason
    assert "tensor(" not in reason
    out = chunk_kda(kw["q"], kw["k"], **{n: v for n, v in kw.items() if n not in ("q", "k")})
    assert out is fla_stub.result
    (args, kwargs), = fla_stub.calls
    assert args[0] is kw["q"] and args[1] is kw["k"] and len(args) == 2
    assert kwargs.keys() == {n for n in kw if n not in ("q", "k")}
    assert all(kwargs[n] is kw[n] for n in kwargs)
    record = last_record()
    assert not record.engaged and needle in record.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [f"falling back to fla — {reason}"]


def test_fallback_logs_once_per_reason(fla_stub, caplog):
    caplog.set_level(logging.WARNING, logger="kernel_fun")
    kw = inputs(chunk_size=32)
    for _ in range(3):
        chunk_kda(**kw)
    assert len(fla_stub.calls) == 3
    assert len(caplog.records) == 1


@pytest.mark.parametrize("switch", ["KERNEL_FUN_DISABLE", "KERNEL_FUN_KDA_DISABLE"])
def test_disable_switches(switch, monkeypatch, fla_stub):
    kw = inputs()
    monkeypatch.setenv(switch, "1")
    assert is_supported(**kw) == (False, f"{switch}=1")
    chunk_kda(**kw)
    assert len(fla_stub.calls) == 1
    monkeypatch.setenv(switch, "0")
    assert is_supported(**kw) == (True, None)


@pytest.mark.parametrize("value", ["maybe", "2", " "])
def test_bad_switch_value_warns_and_keeps_default(value, monkeypatch, caplog, fla_stub):
    caplog.set_level(logging.WARNING, logger="kernel_fun")
    monkeypatch.setenv("KERNEL_FUN_DISABLE", value)
    chunk_kda(**inputs())
    assert not fla_stub.calls and last_record().engaged
    if value.strip():
        assert any("ignoring KERNEL_FUN_DISABLE" in r.getMessage() for r in caplog.records)


def test_min_ctas(monkeypatch, caplog, fla_stub):
    kw = inputs()  # 2 chunks x 2 value heads = 4 chunk-heads
    monkeypatch.setenv("KERNEL_FUN_KDA_MIN_CTAS", "5")
    ok, reason = is_supported(**kw)
    assert not ok and reason == "4 chunk-heads < KERNEL_FUN_KDA_MIN_CTAS=5"
    monkeypatch.setenv("KERNEL_FUN_KDA_MIN_CTAS", "4")
    assert is_supported(**kw) == (True, None)
    caplog.set_level(logging.WARNING, logger="kernel_fun")
    for bad in ("many", "-1"):
        monkeypatch.setenv("KERNEL_FUN_KDA_MIN_CTAS", bad)
        assert is_supported(**kw) == (True, None)
        assert any(f"ignoring KERNEL_FUN_KDA_MIN_CTAS='{bad}'" in r.getMessage() for r in caplog.records)


def test_is_supported_reports_invalid_arguments():
    ok, reason = is_supported(**inputs(chunk_size=48))
    assert not ok and reason.startswith("invalid arguments — ") and "chunk_size" in reason


def test_unsupported_dtype_falls_back(fla_stub):
    kw = make_inputs(SMALL, requires_grad=False)
    kw = {n: (t.double() if isinstance(t, torch.Tensor) and n in ("q", "k", "v") else t) for n, t in kw.items()}
    ok, reason = is_supported(**kw)
    assert not ok and "float64" in reason


def test_forced_impls_never_silently_substitute():
    kw = inputs()
    with use_impls("fla"):
        with pytest.raises(RuntimeError, match="CUDA"):
            chunk_kda(**kw)
    with use_impls({"B6": "ours"}):
        o, _ = chunk_kda(**inputs(q=kw["q"].requires_grad_()))
        with pytest.raises(RuntimeError, match="stage B6"):
            o.float().sum().backward()
    with use_impls("reference"):
        chunk_kda(**inputs())
    assert set(last_record().forward.values()) == {"reference"}


def test_versions():
    v = kernel_fun.versions()
    assert set(v) == {"kernel_fun", "torch", "triton", "fla", "device"}
    import importlib.metadata

    assert v["fla"] == importlib.metadata.version("fla-core")


def test_a_call_fla_gives_another_backend_goes_to_fla(fla_stub, monkeypatch, caplog):
    """fla 0.6 hands no-grad bf16 calls to FlashKDA when it is installed (its forward is
    reported ~2x fla's; kernel-fun's 1.2x): such a call goes to fla, which dispatches it,
    with the reason logged; the same call with FlashKDA declining it runs the chain."""
    from kernel_fun import _fla

    caplog.set_level(logging.INFO, logger="kernel_fun")
    seen = []

    def backend(call):
        seen.append(call)
        return "flash_kda"

    monkeypatch.setattr(_fla, "chunk_kda_backend", backend)
    monkeypatch.setattr(_fla, "chunk_kda_backend_possible", lambda: True)  # (fla 0.6 with a backend installed)
    kw = inputs()
    assert chunk_kda(**kw) is fla_stub.result
    assert not last_record().engaged and last_record().reason == "fla gives this call to its flash_kda backend"
    assert seen[0]["q"] is kw["q"] and seen[0]["A_log"] is kw["A_log"]  # every argument, by name
    monkeypatch.setattr(_fla, "chunk_kda_backend", lambda call: None)
    chunk_kda(**kw)
    assert last_record().engaged


def test_fla_backend_is_asked_of_fla_s_own_registry():
    """fla 0.6: a backend registered for fla's chunk_kda that accepts the call is the one
    named; one that declines, is unavailable or raises is not. fla 0.5.2 has no dispatch."""
    from kernel_fun import _fla

    kw = {**inputs(), "scale": None}
    if _fla.version_tuple() < (0, 6):
        assert _fla.chunk_kda_backend(kw) is None
        return
    import fla.backends as fla_backends
    from fla.backends import BaseBackend
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    registry = fla_backends._function_registries[inspect.unwrap(fla_chunk_kda)]

    def make(kind, accepts, available=True):
        class Fake(BaseBackend):
            backend_type = kind
            priority = 0

            @classmethod
            def is_available(cls):
                return available

            def chunk_kda_verifier(self, *args, **kwargs):
                if accepts == "raise":
                    raise RuntimeError("cannot tell")
                return accepts, None if accepts else "declined"

            def chunk_kda(self, *args, **kwargs):  # pragma: no cover - never called here
                raise AssertionError

        return Fake()

    saved = dict(registry._backends)
    try:
        for fake, want in ((make("fake_off", True, available=False), None), (make("fake_no", False), None),
                           (make("fake_raise", "raise"), None), (make("fake_yes", True), "fake_yes")):
            registry._backends = {**saved, fake.backend_type: fake}
            assert _fla.chunk_kda_backend(kw) == want, fake.backend_type
    finally:
        registry._backends = saved


def test_hand_binding_is_signature_binding():
    """chunk_kda binds its arguments by hand (host time): the same names, values and extra
    keywords as ``inspect.Signature.bind`` with defaults applied, for positional, keyword
    and mixed calls; a call Python would reject gets Python's own error."""
    from kernel_fun.kda import chunk as op

    q, k, v, g, beta = (torch.zeros(1) for _ in range(5))
    calls = [((q, k, v, g, beta), {}), ((), dict(q=q, k=k, v=v, g=g, beta=beta, scale=0.5)),
             ((q, k), dict(v=v, g=g, beta=beta, output_final_state=True, head_first=False)),
             ((q, k, v, g, beta, 0.1, None, True), dict(cu_seqlens=None, unknown=3))]
    for args, kwargs in calls:
        want = op._SIG.bind(*args, **kwargs)
        want.apply_defaults()
        want = dict(want.arguments)
        extra = want.pop("kwargs")
        got = op._bind(args, kwargs)
        assert list(got.args) == list(want) and all(got.args[n] is want[n] for n in want)
        assert got.kwargs == extra
    for args, kwargs in [((q, k, v, g), {}), ((q, k, v, g, beta), dict(q=q)), ((q,) * 30, {})]:
        with pytest.raises(TypeError) as ours:
            op._bind(args, kwargs)
        with pytest.raises(TypeError) as python:
            op._SIG.bind(*args, **kwargs)
        assert str(ours.value) == str(python.value)


def test_a_remembered_plan_changes_no_outcome(monkeypatch, fla_stub):
    """A call with the metadata of an earlier supported call reuses its plan (validation, the
    gate and the stage choices, kept for host time), and still follows the switches, the
    forced choices, the registry and its own offsets, as a call decided afresh does."""
    from kernel_fun.kda import chain
    from kernel_fun.kda.stages import registered

    kw = inputs()
    chunk_kda(**kw)
    first = dict(last_record().forward)
    assert key_of(kw) in chunk_mod._PLANS
    chunk_kda(**kw)
    assert last_record().engaged and last_record().forward == first
    monkeypatch.setenv("KERNEL_FUN_KDA_DISABLE", "1")
    chunk_kda(**kw)
    assert len(fla_stub.calls) == 1 and not last_record().engaged
    monkeypatch.delenv("KERNEL_FUN_KDA_DISABLE")
    with use_impls("reference"):
        chunk_kda(**kw)
    assert set(last_record().forward.values()) == {"reference"}
    with registered("F2", "ours", lambda **stage: chain._ref_gate(**stage)):
        chunk_kda(**kw)
        assert last_record().forward["F2"] == ("ours" if _interpreting() else "reference")
    chunk_kda(**kw)
    assert last_record().forward == first
    packed = make_inputs(Problem("packed", 1, 70, 2, 2, 32, 16, cu_seqlens=(0, 30, 70)), requires_grad=False)
    chunk_kda(**packed)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T=70 without a step down"):
        chunk_kda(**dict(packed, cu_seqlens=torch.tensor([0, 80, 70])))


def test_parameters_are_plain_tensors_to_the_plan():
    """A model's A_log and dt_bias are nn.Parameters: such a call is keyed and its plan kept."""
    kw = inputs()
    kw["A_log"], kw["dt_bias"] = torch.nn.Parameter(kw["A_log"]), torch.nn.Parameter(kw["dt_bias"])
    chunk_kda(**kw)
    assert key_of(kw) is not None and key_of(kw) in chunk_mod._PLANS and last_record().engaged


def key_of(kw):
    return chunk_mod._metadata_key((), kw)


def _interpreting():
    from kernel_fun._triton import interpreting

    return interpreting()


def test_a_gpu_other_than_hopper_is_named(monkeypatch):
    """(the device's capability is asked once per trace under torch.compile: a constant)"""
    from kernel_fun import _runtime

    monkeypatch.setattr(_runtime, "cuda_device", lambda index: (8, 0, "NVIDIA A100"))
    assert _runtime.not_hopper(torch.device("cuda", 0)) == "device NVIDIA A100 is sm_80; kernel-fun targets Hopper (sm_90)"
    monkeypatch.setattr(_runtime, "cuda_device", lambda index: (9, 0, "NVIDIA H200"))
    assert _runtime.not_hopper(torch.device("cuda", 0)) is None


@needs_interpreter
def test_a_remembered_plan_gives_the_same_record():
    """Stage choices, fused-unit answers and the notes of declined kernels (K=200: B2, B3
    and B6 decline) are the first call's on every later call with its plan."""
    from kernel_fun.kda.problems import run_fwd_bwd

    kw = make_inputs(Problem("k200", 1, 70, 1, 1, 200, 16))
    records = []
    for _ in range(2):
        run_fwd_bwd(chunk_kda, kw)
        r = last_record()
        records.append((dict(r.forward), dict(r.backward), dict(r.notes)))
    assert records[0] == records[1] and set(records[0][2]) >= {"B2", "B3", "B6"}, records
