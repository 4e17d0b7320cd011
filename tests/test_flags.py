"""The calls real training makes, on the CPU: every flag the chain carries, inputs as fla
takes them, the CPU path's errors, the log, and ``patch_fla``.

- ``state_v_first``, ``safe_gate`` (with ``lower_bound``) and ``disable_recompute`` run
  kernel-fun's chain (never the whole call to fla) and match the float64 recurrence on
  awkward shapes: in fp32 within 1e-4, in fp16 within fla's budgets, also at K=64 where
  kernel-fun's B6 kernel runs in the interpreter (its launch witnessed).
- ``state_v_first`` gives the default layout's results, transposed, bit for bit (the chain
  keeps [K, V] inside and transposes the boundary states);
  ``disable_recompute`` gives the recomputing chain's, bit for bit, without B1-B3;
  ``return_intermediate_states`` returns F7's h in inference mode.
- Strided views of every tensor input give the contiguous call's outputs and gradients.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib

import pytest
import torch

import kernel_fun
from kernel_fun import _fla
from kernel_fun.kda import chunk_kda, is_supported, last_record, reference as ref, use_impls
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages

from conftest import fla_layers, needs_interpreter
from test_reference import check_against_oracle

FLAGS = {
    "state_v_first": dict(state_v_first=True),
    "safe_gate": dict(safe_gate=True, lower_bound=-5.0),
    "disable_recompute": dict(disable_recompute=True),
}

SHAPES = [
    Problem("T63-K60-gva-h0", 2, 63, 2, 4, 60, 32, initial_state=True, output_final_state=True),
    Problem("T500-K100", 1, 500, 1, 1, 100, 16, output_final_state=True),
    Problem("varlen-h0", 1, 200, 2, 4, 64, 32, initial_state=True, output_final_state=True,
            cu_seqlens=(0, 1, 137, 200)),
]


def flagged(p: Problem, flag: str, **more) -> Problem:
    return dataclasses.replace(p, name=f"{p.name}-{flag}", **FLAGS[flag], **more)


def oracle_of(kwargs: dict, dtype) -> dict:
    return run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=dtype)


def seed_of(p: Problem) -> int:
    return zlib.crc32(p.name.encode()) % 1000


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
@pytest.mark.parametrize("flag", list(FLAGS))
def test_flag_runs_the_chain_and_matches_the_recurrence(flag, p, dtype):
    p = flagged(p, flag, dtype=dtype)
    kwargs = make_inputs(p, seed=seed_of(p))
    assert is_supported(**kwargs) == (True, None)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=dtype)
    record = last_record()
    assert record.engaged
    if flag == "disable_recompute":
        assert not {"B1", "B2", "B3"} & set(record.backward), record.backward
    else:
        assert {"B2", "B3"} <= set(record.backward)
    check_against_oracle(result, oracle_of(kwargs, dtype), dtype)


# fp16 (the dtype of fla's own budget tests) at K=64, V a multiple of 32: kernel-fun's B6
# kernel takes the call.
B6_SHAPES = [
    Problem("fp16-T65-gva-h0", 1, 65, 1, 2, 64, 32, initial_state=True, output_final_state=True,
            dtype=torch.float16),
    Problem("fp16-varlen", 1, 140, 2, 2, 64, 32, initial_state=True, output_final_state=True,
            cu_seqlens=(0, 64, 65, 140), dtype=torch.float16),
    Problem("fp16-varlen-empty-seqs", 1, 70, 1, 2, 64, 32, initial_state=True, output_final_state=True,
            cu_seqlens=(0, 0, 64, 64, 70), dtype=torch.float16),
]


@needs_interpreter
@pytest.mark.parametrize("p", B6_SHAPES, ids=lambda p: p.name)
@pytest.mark.parametrize("flag", list(FLAGS))
def test_flag_with_our_b6_matches_the_recurrence(flag, p, b6_launches):
    p = flagged(p, flag)
    kwargs = make_inputs(p, seed=seed_of(p))
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert last_record().backward["B6"] == "ours" and len(b6_launches) == 1
    check_against_oracle(result, oracle_of(kwargs, p.dtype), p.dtype)


def _fwd_bwd_with(kwargs: dict, do: torch.Tensor, dht: torch.Tensor) -> dict:
    from kernel_fun.kda.problems import GRAD_NAMES, leaves

    o, ht = chunk_kda(**kwargs)
    named = leaves(kwargs)
    grads = torch.autograd.grad([o, ht], list(named.values()), [do, dht])
    return {"o": o, "final_state": ht, **{GRAD_NAMES[n]: g for n, g in zip(named, grads)}}


@pytest.mark.parametrize("p", [SHAPES[0], B6_SHAPES[1]], ids=lambda p: p.name)
def test_state_v_first_is_the_default_layout_transposed(p):
    from kernel_fun.kda.problems import cotangents

    kwargs = make_inputs(p, seed=7)
    o, ht = chunk_kda(**kwargs)
    do, dht = cotangents(o, ht, seed=3)
    default = _fwd_bwd_with(kwargs, do, dht)
    impls = {**last_record().forward, **last_record().backward}
    h0 = kwargs["initial_state"]
    v_first_kwargs = dict(kwargs, state_v_first=True,
                          initial_state=h0.detach().transpose(-1, -2).contiguous().requires_grad_())
    v_first = _fwd_bwd_with(v_first_kwargs, do, dht.transpose(-1, -2).contiguous())
    assert {**last_record().forward, **last_record().backward} == impls
    assert v_first["final_state"].shape == (p.B if p.cu_seqlens is None else len(p.cu_seqlens) - 1, p.HV, p.V, p.K)
    for name, want in default.items():
        got = v_first[name]
        if name in ("final_state", "dh0"):
            got = got.transpose(-1, -2)
        assert torch.equal(got, want), name


def test_state_v_first_keeps_the_chain_in_k_first():
    """A [V, K] caller's states are transposed once at the boundary: every stage inside
    runs in [K, V] (B6's fast layout), the F7-F8 unit starts from the transposed h0 and the B4-B5 unit ends at dh0
    in [K, V], which reaches the caller transposed back."""
    p = flagged(B6_SHAPES[1], "state_v_first")
    kwargs = make_inputs(p, seed=12)
    with capture_stages() as log:
        result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    inputs = {name: stage_inputs for name, _, stage_inputs, _ in log}
    outputs = {name: out for name, _, _, out in log}
    assert {n for n, x in inputs.items() if "state_v_first" in x} == {"F7-F8", "B3", "B4-B5", "B6"}
    assert not any(x.get("state_v_first") for x in inputs.values())
    assert torch.equal(inputs["F7-F8"]["initial_state"], ref.swap_state(kwargs["initial_state"].detach()))
    assert torch.equal(result["final_state"], ref.swap_state(outputs["F7-F8"][1]))
    assert torch.equal(result["dh0"], ref.swap_state(outputs["B4-B5"][2]))


@pytest.mark.parametrize("p", [SHAPES[2], B6_SHAPES[0]], ids=lambda p: p.name)
def test_disable_recompute_equals_recomputing(p):
    """disable_recompute saves what the backward would recompute: the gradients are the
    recomputing chain's (bitwise here), up to where the recompute's B3, forming u itself,
    rounds an entry a bf16 unit from F6's u (the two dots' sums in their BLAS's order, which
    depends on the CPU; bounded at 2e-3, as on the GPU); a wrong or stale saved tensor moves
    them by O(1)."""
    kwargs = make_inputs(p, seed=8)
    recomputed = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert {"B2", "B3"} <= set(last_record().backward)
    saved = run_fwd_bwd(chunk_kda, dict(kwargs, disable_recompute=True), grid=p.dtype)
    assert not {"B1", "B2", "B3"} & set(last_record().backward)
    errors = {n: ref.rel_rms(saved[n].float(), want.float()) for n, want in recomputed.items() if want is not None}
    assert all(saved[n] is None for n, want in recomputed.items() if want is None)
    assert all(e <= 2e-3 for e in errors.values()), errors
    assert errors["o"] == 0.0 and errors["final_state"] == 0.0  # the same forward either way


def test_safe_gate_reaches_the_stages_it_changes():
    p = flagged(SHAPES[2], "safe_gate")
    kwargs = make_inputs(p, seed=9)
    with capture_stages() as log:
        run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    inputs = {name: stage_inputs for name, _, stage_inputs, _ in log}
    assert inputs["F3-F6"]["safe_gate"] is True and inputs["B7-B9"]["safe_gate"] is True  # B7-B9 ours: one unit
    assert inputs["F2"]["lower_bound"] == -5.0 and inputs["B7-B9"]["lower_bound"] == -5.0


def test_return_intermediate_states_returns_h_in_inference_mode():
    """h is the state entering each chunk, in the call's layout: chunk 0's is the initial
    state (in k's dtype), and the V-first h is the default layout's transposed; o and the
    final state are the training call's."""
    p = dataclasses.replace(SHAPES[0], T=130, state_v_first=True)  # three chunks
    kwargs = make_inputs(p, seed=10, requires_grad=False)
    o_ref, ht_ref = chunk_kda(**kwargs)
    with torch.inference_mode():
        o, ht, h = chunk_kda(**kwargs, return_intermediate_states=True)
        assert last_record().engaged
        k_first = dict(kwargs, state_v_first=False, initial_state=ref.swap_state(kwargs["initial_state"]))
        _, _, h_kv = chunk_kda(**k_first, return_intermediate_states=True)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    B, T, HV, K, V = p.B, p.T, p.HV, p.K, p.V
    assert h.shape == (B, -(-T // 64), HV, V, K) and h.dtype == kwargs["k"].dtype
    assert torch.equal(h[:, 0], kwargs["initial_state"].to(h.dtype))
    assert torch.equal(h, ref.swap_state(h_kv)) and not torch.equal(h[:, 1], h[:, 0])


@pytest.mark.parametrize("extra,message", [
    ({}, "return_intermediate_states is only allowed in inference mode"),
    ({"disable_recompute": True}, "return_intermediate_states must be used with disable_recompute=False"),
])
@pytest.mark.every_fla
def test_return_intermediate_states_errors_are_fla_s(extra, message):
    kwargs = make_inputs(SHAPES[0], requires_grad=False)
    kwargs.update(return_intermediate_states=True, **extra)
    ctx = torch.inference_mode() if extra else torch.enable_grad()
    with ctx, pytest.raises(AssertionError) as err:
        chunk_kda(**kwargs)
    assert str(err.value) == message


# --------------------------------------------------------------------------------------
# Inputs as fla takes them
# --------------------------------------------------------------------------------------
def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous leaf: every other element of a buffer twice its
    size (1-D), or the first half of a buffer twice as wide in its last axis, as the split of
    a fused projection gives."""
    t = t.detach()
    pad = torch.full_like(t, float("nan"))
    if t.dim() == 1:
        s = torch.stack([t, pad], -1).reshape(-1)[::2]
    else:
        s = torch.cat([t, pad], -1)[..., :t.shape[-1]]
    assert not s.is_contiguous() and torch.equal(s, t)
    return s.requires_grad_(True)


@needs_interpreter
@pytest.mark.parametrize("p", [B6_SHAPES[0], dataclasses.replace(B6_SHAPES[0], name="v-first", state_v_first=True)],
                         ids=lambda p: p.name)
def test_strided_inputs_give_the_contiguous_gradients(p):
    kwargs = make_inputs(p, seed=11)
    dense = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    strided = dict(kwargs, **{n: _strided(kwargs[n]) for n in names})
    got = run_fwd_bwd(chunk_kda, strided, grid=p.dtype)
    assert last_record().engaged and last_record().backward["B6"] == "ours"
    for name, want in dense.items():
        assert torch.equal(got[name], want), name


def _offset(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous view that starts one element past a 16-byte boundary (a
    caller's view into a larger buffer at an odd offset)."""
    t = t.detach()
    s = torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view_as(t).copy_(t)
    assert s.is_contiguous() and s.data_ptr() % 16 and torch.equal(s, t)
    return s.requires_grad_(True)


@needs_interpreter
def test_inputs_off_a_16_byte_boundary_reach_every_stage_aligned():
    """The aligned call first, so that the offset call reuses its plan and the dispatcher's
    choices (kept per metadata, which holds no address); B7-B10's CuTe build takes its
    tensors as 16-byte aligned."""
    p = B6_SHAPES[0]
    kwargs = make_inputs(p, seed=12)
    dense = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    offset = dict(kwargs, **{n: _offset(kwargs[n]) for n in names})
    with capture_stages() as log:
        got = run_fwd_bwd(chunk_kda, offset, grid=p.dtype)
    assert last_record().engaged and last_record().backward["B6"] == "ours"
    seen = [(name, n) for name, _, inputs, _ in log for n, x in inputs.items() if isinstance(x, torch.Tensor)]
    assert len(seen) > 20 and all(x.data_ptr() % 16 == 0 for _, _, inputs, _ in log for x in inputs.values()
                                  if isinstance(x, torch.Tensor) and x.numel()), seen
    for name, want in dense.items():
        assert torch.equal(got[name], want), name


@pytest.mark.every_fla
def test_cu_seqlens_as_a_list_is_a_type_error():
    kwargs = make_inputs(SHAPES[2], requires_grad=False)
    kwargs["cu_seqlens"] = [0, 1, 137, 200]
    with pytest.raises(TypeError, match="cu_seqlens` must be a 1-D int32/int64 torch.Tensor"):
        chunk_kda(**kwargs)
    ok, reason = is_supported(**kwargs)
    assert not ok and "must be a 1-D int32/int64 torch.Tensor" in reason


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cu_seqlens_int32_and_int64_agree(dtype):
    kwargs = make_inputs(SHAPES[2], requires_grad=False)
    o64, _ = chunk_kda(**kwargs)
    o, _ = chunk_kda(**dict(kwargs, cu_seqlens=kwargs["cu_seqlens"].to(dtype)))
    assert torch.equal(o, o64)


# --------------------------------------------------------------------------------------
# The CPU path never dies inside Triton
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,switch,needle", [
    (dict(chunk_size=32), None, "chunk_size=32"),
    (dict(some_new_flag=1), None, "some_new_flag"),
    (dict(cp_context=object()), None, "cp_context"),
    ({}, "KERNEL_FUN_KDA_DISABLE", "KERNEL_FUN_KDA_DISABLE=1"),
    ({}, "KERNEL_FUN_DISABLE", "KERNEL_FUN_DISABLE=1"),
])
@pytest.mark.every_fla
def test_a_call_for_fla_on_the_cpu_says_why(extra, switch, needle, monkeypatch):
    if switch:
        monkeypatch.setenv(switch, "1")
    kwargs = make_inputs(SHAPES[0], requires_grad=False)
    with pytest.raises(RuntimeError) as err:
        chunk_kda(**kwargs, **extra)
    assert needle in str(err.value) and "CUDA device" in str(err.value)


# --------------------------------------------------------------------------------------
# "Did our kernels run?" answered by the log
# --------------------------------------------------------------------------------------
def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kernel_fun"]


@needs_interpreter
def test_log_names_every_stage_once_per_shape_and_flags(caplog):
    caplog.set_level(logging.INFO, logger="kernel_fun")
    kwargs = make_inputs(B6_SHAPES[0], seed=12)
    for _ in range(2):
        run_fwd_bwd(chunk_kda, kwargs)
    run_fwd_bwd(chunk_kda, dict(kwargs, disable_recompute=True))
    engaged = [m for m in _messages(caplog) if m.startswith("engaged (")]
    assert len(engaged) == 2, engaged
    # the F7-F8 unit, B2, B3, the B4-B5 unit, B6, B7-B9
    assert engaged[0].endswith("fwd+bwd): forward F1-F6 reference, F7-F8 ours; backward B1 reference, B2-B9 ours, "
                               "B10 reference"), engaged[0]
    assert "disable_recompute" in engaged[1] and "backward B4-B9 ours, B10 reference" in engaged[1]


def test_packed_batches_of_other_lengths_log_one_line(caplog):
    """The log names a packed call by its heads, not its token and sequence counts (which
    change every step of packed training). Whichever implementations run (here the torch
    references, the cheapest), the line is the call's."""
    caplog.set_level(logging.INFO, logger="kernel_fun")
    for bounds in ((0, 1, 137, 200), (0, 50, 200), (0, 64, 129)):
        p = dataclasses.replace(SHAPES[2], T=bounds[-1], cu_seqlens=bounds)
        with use_impls("reference"):
            run_fwd_bwd(chunk_kda, make_inputs(p, seed=16))
    engaged = [m for m in _messages(caplog) if m.startswith("engaged (")]
    assert len(engaged) == 1 and engaged[0].startswith("engaged (packed H=2 HV=4 K=64 V=32"), engaged


@needs_interpreter
def test_a_stage_that_declines_ours_says_why_once(caplog):
    caplog.set_level(logging.INFO, logger="kernel_fun")
    kwargs = make_inputs(dataclasses.replace(B6_SHAPES[0], dtype=torch.float32), seed=13)
    for _ in range(2):
        run_fwd_bwd(chunk_kda, kwargs)
    declined = [m for m in _messages(caplog) if m.startswith("B6: ")]
    assert declined == ["B6: kernel-fun's kernel declined (dtype float32 (B6 kernels take bf16/fp16)); "
                        "this stage runs reference"]
    assert last_record().notes["B6"] == "dtype float32 (B6 kernels take bf16/fp16)"


def test_cpu_without_the_interpreter_says_triton_was_skipped(caplog, monkeypatch):
    import importlib

    stages_mod = importlib.import_module("kernel_fun.kda.stages")  # the attribute is the stages() function
    monkeypatch.setattr(stages_mod, "interpreting", lambda: False)
    caplog.set_level(logging.INFO, logger="kernel_fun")
    kwargs = make_inputs(B6_SHAPES[0], seed=14)
    for _ in range(2):
        run_fwd_bwd(chunk_kda, kwargs)
    assert last_record().backward["B6"] == "reference"
    skipped = [m for m in _messages(caplog) if "TRITON_INTERPRET=1" in m]
    assert len(skipped) == 1 and "skipped" in skipped[0]


# --------------------------------------------------------------------------------------
# patch_fla / unpatch_fla
# --------------------------------------------------------------------------------------
@pytest.fixture
def unpatched():
    yield
    kernel_fun.unpatch_fla()


@pytest.mark.every_fla
def test_patch_fla_routes_every_binding_and_unpatch_restores_it(unpatched, caplog):
    layers = fla_layers()
    import fla.ops
    import fla.ops.kda

    from kernel_fun import patch

    original = _fla.chunk_kda()
    assert layers.chunk_kda is original and fla.ops.kda.chunk_kda is original
    caplog.set_level(logging.INFO, logger="kernel_fun")
    changed = kernel_fun.patch_fla()
    assert {"fla.layers.kda.chunk_kda", "fla.ops.kda.chunk_kda", "fla.ops.chunk_kda"} <= set(changed)
    assert layers.chunk_kda is chunk_kda and fla.ops.kda.chunk_kda is chunk_kda and fla.ops.chunk_kda is chunk_kda
    assert kernel_fun.patch_fla() == []  # idempotent
    assert _fla.chunk_kda() is original  # the fallback still reaches fla's own function
    assert any(m.startswith("patch_fla: fla's chunk_kda now runs kernel-fun's at") for m in _messages(caplog))

    # fla's layer module now calls kernel-fun's chain
    kwargs = make_inputs(SHAPES[0], requires_grad=False, seed=15)
    layers.chunk_kda(**kwargs)
    assert last_record().engaged

    assert sorted(kernel_fun.unpatch_fla()) == sorted(changed)
    assert layers.chunk_kda is original and fla.ops.kda.chunk_kda is original and fla.ops.chunk_kda is original
    assert kernel_fun.unpatch_fla() == []
    with patch.fla_patched():  # the same for a block
        assert layers.chunk_kda is chunk_kda
    assert layers.chunk_kda is original


@pytest.mark.every_fla
def test_patch_fla_picks_up_a_module_imported_later(unpatched, monkeypatch):
    fla_layers()
    import sys
    import types

    kernel_fun.patch_fla()
    late = types.ModuleType("fla.late_module")
    late.kda = _fla.chunk_kda()
    monkeypatch.setitem(sys.modules, "fla.late_module", late)
    assert kernel_fun.patch_fla() == ["fla.late_module.kda"]
    assert late.kda is chunk_kda
    kernel_fun.unpatch_fla()
    assert late.kda is _fla.chunk_kda()


@pytest.mark.every_fla
def test_fallback_under_patch_reaches_fla_not_itself(unpatched, monkeypatch):
    fla_layers()
    kernel_fun.patch_fla()
    assert _fla.chunk_kda() is not chunk_kda
