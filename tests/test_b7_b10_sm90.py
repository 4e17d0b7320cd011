"""B7-B9 and B7-B10's CuTe DSL kernel (kda/kernels/b7_b10_intra_bwd_sm90.py) where no sm_90 GPU
is: its registration, the dispatch inside B7-B9's ``ours`` (the CuTe kernel where it takes the
call, the Triton unit otherwise), every refusal of its support checks, the version gate and the
``var`` build's chunk map. Its numerics run on the GPU (tests/test_gpu_sm90.py) against the
Triton unit, which the interpreter runs here, and against fla's stages; its compile for sm_90a
is held to its committed rows by the slow tests there."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from conftest import DEVICE, cute_runs, needs_triton
from kernel_fun import _runtime
from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda import kernels
from kernel_fun.kda.kernels import b7_b9_intra_bwd, b7_b10_intra_bwd_sm90 as sm90
from kernel_fun.kda.problems import Problem, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, stages, use_impls


def _inputs(p: Problem, l2: bool = False) -> dict:
    """B7-B9's inputs (with ``l2`` B7-B10's) as the reference chain gives them."""
    kw = make_inputs(p, device=DEVICE, seed=4)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (b7,) = [x for name, _, x, _ in log if name == "B7"]
    (b9,) = [x for name, _, x, _ in log if name == "B9"]
    out = dict(b7, **{n: b9[n] for n in ("g", "A_log", "dt_bias", "lower_bound")})
    if l2:
        (b10,) = [x for name, _, x, _ in log if name == "B10"]
        out.update(q_rstd=b10["q_rstd"], k_rstd=b10["k_rstd"])
    return out


@pytest.mark.shipped_dispatch
def test_the_stages_register_the_dispatch_and_b7_b10():
    assert stages()["B7-B9"].impls["ours"] is kernels.intra_bwd
    assert stages()["B7-B9"].supports["ours"] is b7_b9_intra_bwd.supports  # (the Triton unit takes what CuTe declines)
    assert stages()["B7-B10"].impls["ours"] is sm90.intra_bwd_l2
    assert stages()["B7-B10"].supports["ours"] is sm90.supports_l2


@needs_triton
def test_off_sm90_b7_b9_runs_the_triton_unit_and_b7_b10_declines(caplog):
    """Where the CuTe kernel cannot run, B7-B9's ``ours`` is the Triton unit to the bit (no log
    line on the CPU, where that is the rule), and the chain, asked for B7-B10, runs the B7-B9
    unit and B10, the record saying why."""
    if cute_runs():
        pytest.skip("the CuTe kernel runs here (tests/test_gpu_sm90.py)")
    p = Problem("T70-K64", 1, 70, 2, 2, 64, 16)
    inputs = _inputs(p)
    assert sm90.supports(**inputs) is not None
    caplog.set_level(logging.INFO, logger="kernel_fun")
    _runtime.reset_log_once()
    for a, b in zip(kernels.intra_bwd(**inputs), b7_b9_intra_bwd.intra_bwd(**inputs)):
        assert torch.equal(a, b)
    assert not [r for r in caplog.records if "CuTe" in r.getMessage()]
    run_fwd_bwd(chunk_kda, make_inputs(p, device=DEVICE, seed=4), grid=p.dtype)
    record = last_record()
    assert record.backward["B7-B9"] == "ours" and record.backward["B10"] in ("reference", "fla"), record
    assert "B7-B10" not in record.backward and "CuTe" in record.notes["B7-B10"], record


def test_the_dispatch_takes_the_cute_kernel_where_it_supports_the_call(monkeypatch):
    """B7-B9's ``ours`` calls the CuTe kernel exactly when its ``supports`` says None, with every
    argument as the stage passed it; otherwise the Triton unit."""
    calls = []
    monkeypatch.setattr(sm90, "supports", lambda *a: None)
    monkeypatch.setattr(sm90, "intra_bwd", lambda *a: calls.append(("cute", a)) or "cute")
    monkeypatch.setattr(b7_b9_intra_bwd, "intra_bwd", lambda *a: calls.append(("triton", a)) or "triton")
    args = (None, types.SimpleNamespace(is_cuda=True)) + tuple(range(16))
    assert kernels.intra_bwd(*args) == "cute" and calls == [("cute", args)]
    monkeypatch.setattr(sm90, "supports", lambda *a: "declined")
    assert kernels.intra_bwd(*args) == "triton" and calls[-1] == ("triton", args)


def test_a_cuda_call_the_cute_kernel_declines_logs_why(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(sm90, "supports", lambda *a: "K=100 (for the test)")
    monkeypatch.setattr(b7_b9_intra_bwd, "intra_bwd", lambda *a: calls.append(a) or "triton")
    k = types.SimpleNamespace(is_cuda=True)
    caplog.set_level(logging.INFO, logger="kernel_fun")
    _runtime.reset_log_once()
    args = (None, k) + (None,) * 16
    assert kernels.intra_bwd(*args) == "triton" and kernels.intra_bwd(*args) == "triton"
    lines = [r.getMessage() for r in caplog.records if "CuTe" in r.getMessage()]
    assert lines == ["B7-B9: the CuTe kernel declined (K=100 (for the test)); the Triton unit runs"], lines


@pytest.mark.parametrize("change, why", [
    (dict(A_log=None), "pre-computed gate"),
    (dict(chunk_size=32), "chunk_size=32"),
    (dict(cu_seqlens=torch.tensor([0, 70])), "without their chunk_indices"),
    ("K100", "K=100"),
    ("gva3", "HV a multiple of H"),
    ("q_fp32", "bf16 q and k"),
    ("g_fp16", "a bf16 or fp32 gate"),
    ("dAqk_strided", "non-contiguous"),
    ("huge", "32-bit"),
    ("beta_offset", "16-byte boundary"),
])
def test_every_refusal_says_why(monkeypatch, change, why):
    """With CuTe DSL and an sm_90 GPU taken as given, each shape or form the kernel is not built
    for is refused with its reason (and the Triton unit runs it)."""
    monkeypatch.setattr(sm90, "cute_unavailable", lambda t: None)
    inputs = _inputs(Problem("T70-K64", 1, 70, 2, 2, 64, 16))
    assert sm90.supports(**inputs) is None
    if isinstance(change, dict):
        inputs.update(change)
    elif change == "K100":
        inputs.update(k=torch.zeros(1, 70, 2, 100, dtype=torch.bfloat16))
    elif change == "gva3":
        inputs.update(k=torch.zeros(1, 70, 3, 64, dtype=torch.bfloat16))
    elif change == "q_fp32":
        inputs.update(q=inputs["q"].float())
    elif change == "g_fp16":
        inputs.update(g=inputs["g"].half())
    elif change == "beta_offset":  # (contiguous, 4 bytes past a 16-byte boundary: a view into a caller's buffer)
        beta = inputs["beta"].float()
        inputs.update(beta=torch.zeros(beta.numel() + 1)[1:].view_as(beta).copy_(beta))
    elif change == "huge":  # (2^31 elements a tensor, on the meta device: no memory)
        inputs.update(k=torch.empty(1, 2 ** 20, 16, 128, dtype=torch.bfloat16, device="meta"),
                      gc=torch.empty(1, 2 ** 20, 16, 128, device="meta"))
    else:
        inputs.update(dAqk=inputs["dAqk"].transpose(1, 2).contiguous().transpose(1, 2))
    reason = sm90.supports(**inputs)
    assert reason is not None and why in reason, reason
    with pytest.raises(ValueError, match="CuTe kernel"):
        sm90.intra_bwd(**inputs)


def test_b7_b10_needs_the_l2norm_and_h_equal_hv(monkeypatch):
    monkeypatch.setattr(sm90, "cute_unavailable", lambda t: None)
    inputs = _inputs(Problem("T70-K64", 1, 70, 2, 2, 64, 16), l2=True)
    assert sm90.supports_l2(**inputs) is None
    assert "l2norm" in sm90.supports_l2(**dict(inputs, q_rstd=None))
    rstd = inputs["k_rstd"].float()
    offset = torch.zeros(rstd.numel() + 1)[1:].view_as(rstd).copy_(rstd)  # (4 bytes past a 16-byte boundary)
    assert "16-byte boundary" in sm90.supports_l2(**dict(inputs, k_rstd=offset))
    gva = _inputs(Problem("T70-K64-gva", 1, 70, 1, 2, 64, 16), l2=True)
    assert sm90.supports(**{n: t for n, t in gva.items() if n not in ("q_rstd", "k_rstd")}) is None
    assert "H = HV" in sm90.supports_l2(**gva)


def test_another_cute_dsl_release_is_declined(monkeypatch):
    """The kernel is compiled and tested with one CuTe DSL release; another is declined with the
    versions named, as is CuTe DSL missing."""
    fake = types.ModuleType("cutlass")
    fake.__version__ = "4.9.0"
    fake.cute = types.ModuleType("cutlass.cute")
    monkeypatch.setitem(sys.modules, "cutlass", fake)
    monkeypatch.setitem(sys.modules, "cutlass.cute", fake.cute)
    monkeypatch.setattr(sm90, "_CUTE", {})
    assert "4.9.0" in sm90._cute_missing() and sm90.CUTE_DSL in sm90._cute_missing()
    fake.__version__ = sm90.CUTE_DSL
    monkeypatch.setattr(sm90, "_CUTE", {})
    assert sm90._cute_missing() is None
    monkeypatch.setitem(sys.modules, "cutlass", None)  # (an import of it raises ImportError)
    monkeypatch.setattr(sm90, "_CUTE", {})
    assert "not installed" in sm90._cute_missing()


def test_the_var_build_s_chunk_map():
    """Each chunk's first row, length and number: B sequences of T tokens (T not a multiple of
    64), and packed sequences through fla's (sequence, chunk) pairs; None for whole chunks in
    order."""
    assert sm90.chunk_rows(2, 128) is None
    assert sm90.chunk_rows(2, 100).tolist() == [[0, 64, 0], [64, 36, 1], [100, 64, 2], [164, 36, 3]]
    cu = torch.tensor([0, 30, 158, 700])
    idx = torch.tensor([[0, 0], [1, 0], [1, 1], [2, 0]] + [[2, i] for i in range(1, 9)])
    got = sm90.chunk_rows(1, 700, cu, idx).tolist()
    assert got[:4] == [[0, 30, 0], [30, 64, 1], [94, 64, 2], [158, 64, 3]] and got[-1] == [670, 30, 11], got
    assert sum(n for _, n, _ in got) == 700 and [c for _, _, c in got] == list(range(12))


@pytest.mark.parametrize("case", ["T100", "packed", "whole-last", "empty-seq", "all-short"])
def test_the_map_splits_into_whole_chunks_and_a_part_that_holds_every_short_one(case):
    """``split_chunks``: the first part only chunks of 64 rows (the ``whole`` build bounds no
    row), the second min(sequences, chunks) chunks holding every shorter one, the chunks' numbers
    kept; together every chunk once, the chunks of 64 first and each group in the map's order."""
    B, T, cu, n_seq = {"T100": (2, 100, None, 2), "packed": (1, 700, [0, 30, 158, 700], 3),
                       "whole-last": (1, 320, [0, 64, 100, 320], 3), "empty-seq": (1, 200, [0, 70, 70, 200], 3),
                       "all-short": (1, 90, [0, 30, 60, 90], 3)}[case]
    if cu is not None:
        cu = torch.tensor(cu)
        per = (cu[1:] - cu[:-1] + 63) // 64
        idx = torch.stack([torch.arange(len(per)).repeat_interleave(per),
                           torch.cat([torch.arange(int(n)) for n in per])], -1)
    else:
        idx = None
    rows = sm90.chunk_rows(B, T, cu, idx)
    whole, part = sm90.split_chunks(rows, n_seq)
    assert (whole[:, 1] == 64).all() and len(part) == min(n_seq, len(rows))
    assert int((rows[:, 1] < 64).sum()) == int((part[:, 1] < 64).sum())
    assert sorted(torch.cat([whole, part]).tolist()) == rows.tolist()
    ranked = torch.cat([whole, part])
    n_whole = int((rows[:, 1] == 64).sum())
    for group in (ranked[:n_whole], ranked[n_whole:]):
        assert (group[:, 2][1:] > group[:, 2][:-1]).all()
    assert whole.is_contiguous() and part.is_contiguous() and part.data_ptr() % 16 == 0
    assert len(whole) == 0 or whole.data_ptr() % 16 == 0
