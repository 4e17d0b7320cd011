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
