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
