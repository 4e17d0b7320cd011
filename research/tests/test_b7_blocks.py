"""The gate-independent B7 sums (research.b7_blocks) in the registered B7-B9 kernel, through
the interpreter, against the float64 stages with the pinned kernel's own bounds: K 64, 100
and 128, T not a multiple of 64, GVA, packed sequences with ragged chunks, the softplus,
lower-bounded and pre-computed gates, weak, very strong and saturated gates; and causal: the
rows before t bit for bit the call cut at t, whatever the gates after t."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from conftest import needs_triton  # noqa: E402
from kernel_fun.kda import reference as ref  # noqa: E402
from kernel_fun.kda.problems import Problem  # noqa: E402
from research.b7_blocks import intra_bwd  # noqa: E402
from test_b7_b9_intra_bwd import LEVELS, SHAPES, exact, unit_inputs  # noqa: E402

pytestmark = needs_triton
NAMES = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")


def check(inputs: dict, bound: float = 1e-5, gate_sums: float = 2e-3, guard: float | None = None) -> tuple:
    """As the pinned kernel's test: dq, dk, db and an fp32 dg within ``bound`` of the float64
    stages; the raw gate's bf16 gradient within its rounding (3e-3); dA_log and dt_bias's
    within ``gate_sums`` where they sum a bf16 gate's rounded gradient."""
    got = intra_bwd(**inputs, _guard=guard)
    want = exact(inputs)
    rounded = inputs["A_log"] is not None and inputs["g"].dtype != torch.float32
    for name, a in zip(NAMES, got):
        if want[name] is None:
            assert a is None, name
            continue
        assert torch.isfinite(a).all(), name
        limit = {"dg": 3e-3, "dA_log": gate_sums, "ddt_bias": gate_sums}.get(name, bound) if rounded else bound
        assert ref.rel_rms(a, want[name]) <= max(limit, bound), (name, ref.rel_rms(a, want[name]))
    return got


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_blocks_match_the_float64_stages(p):
    check(unit_inputs(p))


def test_blocks_at_a_saturated_bounded_gate():
    """Every token at safe_gate's lower bound (-5, 7.2 in log2): a 16-row block spans ~115."""
    check(unit_inputs(SHAPES[4], gate_scale=0.0, gate_shift=30.0), bound=3e-5)


@pytest.mark.parametrize("gate_scale,gate_shift", [(8.0, 12.0), (30.0, 0.0)])
def test_blocks_at_very_strong_gates(gate_scale, gate_shift):
    """One token's log-decay past 2^64 (8x + 12: 4-28 nats a token times exp(A_log)): the
    anchors' factors underflow to zero where the pairs' own do."""
    check(unit_inputs(SHAPES[0], gate_scale=gate_scale, gate_shift=gate_shift), gate_sums=0.02)


@pytest.mark.parametrize("guard,gate_scale", [(0.25, 10.0), (4.0, 10.0)])
def test_blocks_through_many_levels_within_a_block(guard, gate_scale):
    """A guard far below GUARD_SPAN: nearly a level a row inside each 16-row block, so the
    pairs across a block's levels carry much of its sums."""
    from benchmarks.stages.b7_b9 import levels

    inputs = unit_inputs(LEVELS, gate_scale=gate_scale)
    assert levels(inputs["gc"], guard).max() >= 8
    check(inputs, guard=guard)


def test_blocks_at_weak_gates():
    check(unit_inputs(Problem("T130-K128-gva-h0", 1, 130, 1, 2, 128, 32, initial_state=True), gate_shift=-8.0))


@pytest.mark.parametrize("cut", [5, 16, 40])
def test_blocks_are_causal_to_the_bit(cut):
    """dq, dk, db and dg at rows before ``cut``: the full chunk's, with dA zero past ``cut``
    (a loss on the rows before it) and the gates past it steepened, equal bit for bit a
    chunk cut at ``cut``."""
    inputs = unit_inputs(Problem("T64-K64-pregated", 1, 64, 1, 1, 64, 16, gate_in_kernel=False), gate_scale=3.0)
    for name in ("dAqk", "dAkk"):
        inputs[name][:, cut:] = 0
    for name in ("dq", "dk", "dg"):
        inputs[name][:, cut:] = 0
    inputs["db"][:, cut:] = 0
    steep = dict(inputs, gc=inputs["gc"].clone())
    steep["gc"][:, cut:] = steep["gc"][:, cut:] * 40.0
    cut_inputs = {n: (v[:, :cut].contiguous() if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == 64
                      else v) for n, v in inputs.items()}
    full, steeper, short = intra_bwd(**inputs), intra_bwd(**steep), intra_bwd(**cut_inputs)
    for name, a, b, c in zip(NAMES, full, steeper, short):
        if a is None:
            continue
        assert torch.equal(a[:, :cut], c[:, :cut]), name
        assert torch.equal(b[:, :cut], c[:, :cut]), name
