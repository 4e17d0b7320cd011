"""The harness itself: fresh allocations are poisoned, and under the interpreter an
autotuned kernel runs with one config (so a multi-config kernel costs one run, not many)."""

from __future__ import annotations


import pytest
import torch
import triton
import triton.language as tl

from conftest import INTERPRETING


def test_fresh_allocations_are_nan():
    assert torch.isnan(torch.empty(8)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(3))).all()
    assert torch.isnan(torch.zeros(2).new_empty(4)).all()
    assert torch.empty(4, dtype=torch.int32).dtype == torch.int32  # integers are left alone


@triton.autotune(
    configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)],
    key=["n"],
)
@triton.jit
def _scale_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) * 2.0, mask=mask)


@pytest.mark.skipif(not INTERPRETING, reason="interpreter only")
def test_autotuner_takes_one_config_under_the_interpreter():
    assert len(_scale_kernel.configs) == 1
    x = torch.arange(50, dtype=torch.float32)
    y = torch.empty_like(x)
    _scale_kernel[lambda meta: (triton.cdiv(50, meta["BLOCK"]),)](x, y, 50)
    assert torch.equal(y, 2 * x)


def test_a_stage_candidate_takes_the_entry_s_place_and_never_ships():
    """``benchmarks.stage --candidate module:function``: the stage's entry with that function as
    its kernel (called with the entry's inputs), no launch configs, and its rows marked and
    named so that the README's stage table never takes them for the kernel that ships."""
    from benchmarks.stage import as_candidate, entries

    entry = entries()["B7-B9"]
    cand = as_candidate(entry, "builtins:dict")  # (a stand-in kernel: returns its keyword inputs)
    assert cand.ours({"q": 1, "k": 2}, None) == {"q": 1, "k": 2}
    assert (cand.candidate, cand.sweep, cand.launch_config(None, {"BK": 16})) == ("builtins:dict", (), {})
    assert (cand.stage, cand.make_inputs, cand.exact, cand.misses) == (entry.stage, entry.make_inputs, entry.exact,
                                                                         entry.misses)
    row = {"design": cand.label, "shape": "prod8192_gate", "config": {}, "candidate": "builtins:dict"}
    assert not cand.ships(row) and not entry.ships(row)
    assert not entry.ships({**row, "design": entry.label})  # (marked a candidate: never what ships)


def test_b7_b9_s_cute_kernel_has_its_own_stage_entry():
    """B7-B9's two shipped kernels each have a stage-bench entry: the Triton unit (``B7-B9``) and
    the CuTe kernel (``B7-B9-sm90``: the same inputs and bars, one pinned build compiled in the
    bench's process). Where the CuTe kernel declines (here: no sm_90 GPU) its entry raises with
    the reason rather than timing another kernel under its name, and the reliability harness
    skips it; the README's stage table names both where both ship at one shape."""
    from benchmarks import readme
    from benchmarks.stage import entries
    from kernel_fun.kda.problems import problem

    triton_unit, cute = entries()["B7-B9"], entries()["B7-B9-sm90"]
    assert (cute.stage, cute.make_inputs, cute.exact, cute.misses, cute.bytes) == (
        "B7-B9", triton_unit.make_inputs, triton_unit.exact, triton_unit.misses, triton_unit.bytes)
    assert (cute.sweep, cute.precompile, cute.launch_config(None, None)) == ((), False, {})
    assert triton_unit.precompile and triton_unit.declines is None
    inputs = cute.make_inputs(problem("grid64"), "cpu")
    why = cute.declines(inputs)
    assert why and ("sm_90" in why or "CuTe" in why), why
    with pytest.raises(RuntimeError, match="declines"):
        cute.ours(inputs, None)
    assert cute.ships({"design": cute.label, "shape": "prod8192_gate", "config": {}})
    assert not cute.ships({"design": triton_unit.label, "shape": "prod8192_gate", "config": {}})

    from kernel_fun.kda.kernels.b7_b9_intra_bwd import CONFIG

    base = dict(kind="stage", stage="B7-B9", shape="kimi", spread_ms=[0.9, 1.1], floor_ms=0.5, gpu="H100",
                date="2026-12-06T10:00:00+00:00", commit="abc", parity={"ok": True})
    rows = [dict(base, impl="fla", design="fla", ms=2.0, config={}),
            dict(base, impl="wide-halves-pf[x]", design=triton_unit.label, ms=1.5, config=dict(CONFIG)),
            dict(base, impl="cute-sm90[]", design=cute.label, ms=1.0, config={})]
    table = readme.render(rows)
    assert f"| kernel-fun ({cute.label}) |" in table and f"| kernel-fun ({triton_unit.label}) |" in table
    assert "| kernel-fun |" in readme.render(rows[:2])  # (one kernel at a shape: unnamed, as before)
