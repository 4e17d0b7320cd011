"""The B6 bytes instrument (research.b6_stream) moves what it says: every output is
the fixed formula of the inputs it documents, so a dropped load or store, or a tile read at
the wrong offset, shows here (T not a multiple of 64, GVA, both tile widths)."""

from __future__ import annotations


import pytest
import torch

from benchmarks.stages.b6 import make_inputs
from research.b6_stream import FORMULA_RTOL, launch, reference_outputs
from kernel_fun.kda.problems import Problem
from kernel_fun.kda.reference import rel_rms

from conftest import DEVICE, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("T, H, HV, K, V, BV, num_stages, heads_fast, rows, prefetch_at", [
    (100, 2, 4, 64, 64, 32, 2, True, 16, None), (128, 2, 2, 128, 128, 64, 3, True, 64, 2),
    (100, 1, 2, 64, 128, 128, 1, False, 32, 1)])
def test_stream_outputs_follow_the_formula(T, H, HV, K, V, BV, num_stages, heads_fast, rows, prefetch_at):
    inputs = make_inputs(Problem("stream", B=2, T=T, H=H, HV=HV, K=K, V=V), DEVICE, seed=5)
    got = launch(inputs, BV, num_warps=4, num_stages=num_stages, heads_fast=heads_fast, rows=rows,
                 prefetch_at=prefetch_at)
    want = reference_outputs(inputs, BV)
    for name, a, b in zip(("dq", "dk", "dv2", "dg", "db", "dA"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < FORMULA_RTOL, (name, rel_rms(a, b))


def test_stream_refuses_what_it_does_not_move():
    inputs = make_inputs(Problem("stream", B=1, T=64, H=1, HV=1, K=64, V=96), DEVICE, seed=5)
    with pytest.raises(ValueError, match="multiple of BV"):
        launch(inputs, 64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="16, 32 or 64 rows"):
        launch(inputs, 32, num_warps=4, num_stages=2, rows=8)
