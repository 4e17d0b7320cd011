"""B7-B9 (kda/kernels/b7_b9_intra_bwd.py: B7 with B8 and B9 in one pass) through the
interpreter against the float64 stages, on the inputs the chain gives them: K 64, 128 and
100, T not a multiple of 64, GVA, packed sequences (ragged chunks of 1, 16, 17 and 33 rows),
the softplus, lower-bounded and pre-computed gates, weak, very strong and saturated gates
(one level a chunk and many), and causal: rows before t bit for bit the call cut at t."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEVICE, chain_problems, needs_triton
from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda import reference as ref
from kernel_fun.kda import kernels
from kernel_fun.kda.kernels import b7_b9_intra_bwd as unit
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, stages, use_impls

from benchmarks.stages.b7_b9 import levels

pytestmark = needs_triton

SHAPES = [
    Problem("T63-K64", 2, 63, 2, 2, 64, 32),
    Problem("T130-K128-gva-h0-pregated", 1, 130, 1, 2, 128, 32, initial_state=True, gate_in_kernel=False),
    Problem("T70-K100", 1, 70, 2, 2, 100, 16),
    Problem("varlen-K64", 1, 150, 2, 2, 64, 16, cu_seqlens=(0, 1, 65, 150)),
    Problem("T100-K64-safe", 1, 100, 2, 2, 64, 16, lower_bound=-5.0, safe_gate=True),
    # ragged chunks of 1, 16, 17 and 33 rows (a sub-chunk boundary on each side), GVA 4, fp32
    Problem("varlen-ragged-gva4-fp32", 1, 67, 1, 4, 64, 16, cu_seqlens=(0, 1, 17, 34, 67), dtype=torch.float32),
]
def unit_inputs(p: Problem, gate_scale: float = 1.0, gate_shift: float = 0.0) -> dict:
    """The unit's inputs as the reference chain gives B7 and B9 (the raw gate scaled and
    shifted first: softplus of 8x + 12 makes per-token log-decays of 4-28 nats, times
    exp(A_log))."""
    kw = make_inputs(p, device=DEVICE, seed=4)
    kw["g"] = (kw["g"].detach() * gate_scale + gate_shift).requires_grad_(True)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (b7,) = [x for name, _, x, _ in log if name == "B7"]
    b9 = [x for name, _, x, _ in log if name == "B9"]
    gate = ({n: b9[0][n] for n in ("g", "A_log", "dt_bias", "lower_bound")} if b9 else
            dict(g=None, A_log=None, dt_bias=None, lower_bound=None))
    return dict(b7, **gate)


def with_gc(inputs: dict, gc: torch.Tensor) -> dict:
    return dict(inputs, gc=gc.expand_as(inputs["gc"]).contiguous())


def exact(inputs: dict) -> dict:
    """B7 in float64, and B8 and B9 from it in float64: dq, dk, db, dg, dA_log, ddt_bias."""
    b7 = {n: t for n, t in inputs.items() if n not in ("chunk_indices", "safe_gate", "g", "A_log", "dt_bias",
                                                       "lower_bound")}
    dq, dk, db, _ = ref.intra_bwd(**b7, exact=True)
    gate = {n: inputs[n] for n in ("g", "A_log", "dt_bias", "lower_bound")} if inputs["A_log"] is not None else {}
    tail = ref.intra_bwd_tail(**b7, **gate, exact=True)
    return dict(dq=dq, dk=dk, db=db, dg=tail[3], dA_log=tail[4], ddt_bias=tail[5])


def check(inputs: dict, bound: float = 1e-5, guard: float | None = None, gate_sums: float = 2e-3) -> tuple:
    """The unit against the float64 stages: dq, dk and db (fp32) within ``bound``; dg within
    ``bound`` where it is fp32 (B8's, a pre-computed or fp32 gate), within its rounding where
    it is the raw gate's bf16 gradient (3e-3), and dA_log's and dt_bias's gradients within 1e-5
    (2e-3 summed from a bf16 gate's rounded gradient)."""
    got = unit.intra_bwd(**inputs, _guard=guard)
    want = exact(inputs)
    names = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")
    rounded = inputs["A_log"] is not None and inputs["g"].dtype != torch.float32
    for name, a in zip(names, got):
        if want[name] is None:
            assert a is None, name
            continue
        assert a is not None and torch.isfinite(a).all(), name
        err = ref.rel_rms(a, want[name])
        if name == "dg":
            assert a.dtype == (inputs["g"].dtype if inputs["A_log"] is not None else torch.float32)
        limit = {"dg": 3e-3, "dA_log": gate_sums, "ddt_bias": gate_sums}.get(name, bound) if rounded else bound
        assert err <= max(limit, bound), (name, err)
    return got


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_unit_matches_the_float64_stages(p):
    check(unit_inputs(p))


def test_saturated_bounded_gate():
    """The steepest gate safe_gate allows (every token at the lower bound, -5, 7.2 in log2): a
    chunk's span, ~450, takes eight levels."""
    inputs = unit_inputs(SHAPES[4], gate_scale=0.0, gate_shift=30.0)  # sigmoid saturates: every gate at -5
    assert levels(inputs["gc"]).max() >= 7
    # dg's intra part cancels (q dq + k dk_row - k dk_col) most at a saturated gate: near
    # 1e-5 there in fp32 (measured 9.5e-6), 1e-7 elsewhere.
    check(inputs, bound=3e-5)


def test_very_strong_gates_stay_exact():
    """Gates strong enough that one token's log-decay passes GUARD_SPAN (levels of one or two
    rows): dq, dk, db and B8's dg within 1e-5 of the float64 stages. dA_log and dt_bias's
    gradients are held to fla's budget (0.02) here: they sum ~8,000 terms of dy weighted by
    A softplus(x) up to ~600, so dy's fp32-level error (3e-6, the three tf32 products of a
    one-row level, each truncated toward zero) adds up: measured 3.9e-3 (B8's dg 3.0e-6)."""
    inputs = unit_inputs(SHAPES[0], gate_scale=8.0, gate_shift=12.0)
    gc = inputs["gc"]
    assert (gc[:, :-1] - gc[:, 1:]).abs().max() > float(unit.GUARD_SPAN.value)
    check(inputs, gate_sums=0.02)


def test_weak_gates():
    """softplus(x - 8): log-decays of ~3e-4 a token, every chunk in one level."""
    inputs = unit_inputs(Problem("T130-K128-gva-h0", 1, 130, 1, 2, 128, 32, initial_state=True), gate_shift=-8.0)
    assert levels(inputs["gc"]).max() == 1
    check(inputs)


LEVELS = Problem("T64-K64-gva-pregated", 1, 64, 1, 2, 64, 16, gate_in_kernel=False)


@pytest.mark.parametrize("guard,gate_scale,least", [(0.25, 10.0, 50), (4.0, 10.0, 8), (None, 30.0, 2)])
def test_many_levels_stay_exact(guard, gate_scale, least):
    """Chunks through many levels, so the pairs across levels (through each level's first
    row) carry much of the sums: a guard far below GUARD_SPAN (0.25: nearly a level a row),
    and GUARD_SPAN itself at a gate whose chunk span (~170) takes two, as about half the
    programs at prod8192_gate do: within 1e-5 of the float64 stages."""
    inputs = unit_inputs(LEVELS, gate_scale=gate_scale)
    assert levels(inputs["gc"], guard).max() >= least
    check(inputs, guard=guard)


def test_gate_in_the_op_without_dt_bias():
    """The softplus gate with no dt_bias (fla's default when the layer has none): B9 without
    the bias's sums, ddt_bias None."""
    kw = make_inputs(Problem("nobias", 1, 70, 1, 2, 64, 16), device=DEVICE, seed=4)
    del kw["dt_bias"]
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=torch.bfloat16)
    (b7,) = [x for name, _, x, _ in log if name == "B7"]
    (b9,) = [x for name, _, x, _ in log if name == "B9"]
    got = check(dict(b7, **{n: b9[n] for n in ("g", "A_log", "dt_bias", "lower_bound")}))
    assert got[5] is None


def test_levels_follow_the_spec():
    """``benchmarks.stages.b7_b9.levels`` (what the level shares on the H200 are counted
    with): log-decays a token of 0.01, 2.5, 5 and 70 in log2 give one, two, four and 57
    levels (the first level spans 128, each later one 64; the last chunk has 58 rows); the
    second K slice, its log-decays halved, one, one, two and 28. Exact at each."""
    p = Problem("levels", 1, 250, 2, 2, 64, 16, gate_in_kernel=False)
    inputs = unit_inputs(p)
    gc = inputs["gc"]
    t = torch.arange(gc.shape[1], device=gc.device)
    slope = torch.tensor([0.01, 2.5, 5.0, 70.0], dtype=gc.dtype)[t // 64]
    scale = torch.tensor([1.0, 0.5], dtype=gc.dtype).repeat_interleave(32)
    within = torch.cat([(slope[:, None] * scale[None, :])[64 * c:64 * c + 64].cumsum(0) for c in range(4)])
    n = levels((-within)[None, :, None, :])
    assert n[0, :, 0, 0].tolist() == [1, 2, 4, 57], n
    assert n[0, :, 0, 1].tolist() == [1, 1, 2, 28], n
    check(with_gc(inputs, (-within)[None, :, None, :]))


def test_rows_before_a_cut_do_not_see_the_gate_after_it():
    """Causal to the bit: with every input after token t replaced (gates steeper or gentler,
    other q, k, beta) and dA, dq, dk and dg zero there (as a loss on the tokens before t
    leaves them), dq, dk, db and dg before t are the call on the first t tokens' bit for bit,
    at cuts inside a level and at a chunk's edge, one level a chunk and many."""
    p = Problem("cut", 1, 100, 1, 2, 64, 16, gate_in_kernel=False)
    base = unit_inputs(p)
    gen = torch.Generator().manual_seed(3)
    for cut, steep, guard in ((37, 1.0, None), (64, 1.0, None), (20, 40.0, None), (45, 1.0, 2.0)):
        x = dict(base)
        T = base["gc"].shape[1]
        steps = torch.rand(1, T, 2, 64, generator=gen).to(base["gc"].device) * steep
        chunk = torch.arange(T) // 64
        gc = torch.cat([-steps[:, chunk == c].cumsum(1) for c in range(int(chunk.max()) + 1)], 1)
        x["gc"] = gc
        for n in ("dAqk", "dAkk", "dq", "dk", "dg", "db"):
            x[n] = base[n].clone()
            x[n][:, cut:] = 0
        for n in ("q", "k", "beta"):
            x[n] = base[n].clone()
            x[n][:, cut:] = torch.randn(x[n][:, cut:].shape, generator=gen).to(x[n])
        prefix = {n: (v[:, :cut].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 else v)
                  for n, v in x.items()}
        full = unit.intra_bwd(**x, _guard=guard)[:4]
        cut_call = unit.intra_bwd(**prefix, _guard=guard)[:4]
        for name, a, b in zip(("dq", "dk", "db", "dg"), full, cut_call):
            assert torch.equal(a[:, :cut], b), (cut, steep, name)


def test_outputs_are_fresh_and_inputs_untouched():
    inputs = unit_inputs(SHAPES[0])
    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    out = unit.intra_bwd(**inputs)
    again = unit.intra_bwd(**inputs)
    for n, t in before.items():
        assert torch.equal(inputs[n], t), n
    for a, b in zip(out, again):
        assert torch.equal(a, b)
        assert all(a.data_ptr() != t.data_ptr() for t in before.values())


@pytest.mark.shipped_dispatch
def test_supports_and_config():
    inputs = unit_inputs(SHAPES[0])
    assert unit.supports(**inputs) is None
    assert "chunk_size" in unit.supports(**dict(inputs, chunk_size=32))
    assert unit.supports(**dict(inputs, safe_gate=True)) is None
    with pytest.raises(ValueError, match="PRODUCTS"):  # a retired knob is an error, not ignored
        unit.intra_bwd(**inputs, config={"PRODUCTS": 2})
    assert stages()["B7-B9"].impls["ours"] is kernels.intra_bwd  # (the CuTe kernel where it takes the call, else this)
    assert "ours" not in stages()["B7"].impls  # the unit is what runs: B7 alone has no kernel of ours


@pytest.mark.parametrize("p", chain_problems() + [
    Problem("chain-K64-pregated", 1, 70, 2, 2, 64, 16, gate_in_kernel=False, dtype=torch.float16),
], ids=lambda p: p.name)
def test_chain_with_the_unit_against_the_oracle(p):
    """The chain runs B7-B9 in one pass when its kernel takes the call: the record shows the
    unit in place of B7, B8 and B9, and every output and gradient (dA_log and dt_bias's too)
    stays within fla's budgets of the float64 recurrence."""
    kwargs = make_inputs(p, device=DEVICE, seed=11)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record().backward
    assert record["B7-B9"] == "ours" and not {"B7", "B8", "B9"} & set(record), record
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors
    assert ("dA_log" in errors) == p.gate_in_kernel


def test_packed_gate_unit_equals_per_sequence_calls():
    """A packed batch through the unit gives each sequence's outputs, and dA_log's and
    dt_bias's gradients summed over the sequences (in order: per chunk, no atomics)."""
    p = dataclasses.replace(SHAPES[3], name="varlen-fp32", dtype=torch.float32)
    inputs = unit_inputs(p)
    got = unit.intra_bwd(**inputs)
    cu = inputs["cu_seqlens"].tolist()
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        one = {n: (t[:, a:b] if isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[1] == inputs["gc"].shape[1]
                   else t) for n, t in inputs.items()}
        one.update(cu_seqlens=None, chunk_indices=None)
        parts.append(unit.intra_bwd(**{n: (t.contiguous() if isinstance(t, torch.Tensor) else t)
                                       for n, t in one.items()}))
    for i in range(4):
        assert ref.rel_rms(got[i], torch.cat([q[i] for q in parts], 1)) <= 1e-6, i
    for i in (4, 5):
        assert ref.rel_rms(got[i], sum(q[i] for q in parts)) <= 1e-6, i


def _counted(fn):
    """(calls, fn counted): each call's q shape appended to calls, for a unit test's "asked once"."""
    calls = []

    def counted(**inputs):
        calls.append(inputs["q"].shape)
        return fn(**inputs)

    return calls, counted


def _assert_bitwise(result: dict, plain: dict) -> None:
    for name in plain:
        if plain[name] is not None:
            assert torch.equal(result[name], plain[name]), name


@pytest.mark.parametrize("p", [
    Problem("unit-l2-gva-T70", 1, 70, 1, 2, 64, 16),
    Problem("unit-l2-varlen", 1, 100, 2, 2, 64, 16, cu_seqlens=(0, 30, 100), lower_bound=-5.0),
], ids=lambda p: p.name)
def test_a_b7_b10_unit_runs_in_place_of_b7_to_b10(p):
    """With the l2norm in the op, a kernel registered for the B7-B10 unit runs in place of B7,
    B8, B9 and B10 when it takes the call (here the registered B7-B9 unit, GVA's group sum and
    the reference B10 in one function, counted): the same gradients, bit for bit, as the chain
    running those stages itself; without the l2norm in the op it is never asked."""
    from kernel_fun.kda.chain import intra_l2_unit
    from kernel_fun.kda.stages import registered

    calls, fused = _counted(intra_l2_unit(unit.intra_bwd, stages()["B10"].impls["reference"]))
    kwargs = make_inputs(p, device=DEVICE, seed=12)
    plain = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record().backward
    assert record["B7-B9"] == "ours" and record["B10"] == "reference" and "B7-B10" not in record, record
    with registered("B7-B10", "ours", fused):
        result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
        record = last_record().backward
        assert record["B7-B10"] == "ours" and not {"B7", "B8", "B9", "B10", "B7-B9"} & set(record), record
        assert len(calls) == 1
        run_fwd_bwd(chunk_kda, dict(kwargs, use_qk_l2norm_in_kernel=False), grid=p.dtype)
        assert "B7-B10" not in last_record().backward and len(calls) == 1
    _assert_bitwise(result, plain)


@pytest.mark.parametrize("p", [
    Problem("unit6-gva-varlen", 1, 100, 1, 2, 64, 32, cu_seqlens=(0, 30, 100), lower_bound=-5.0),
], ids=lambda p: p.name)
def test_a_b6_b9_unit_runs_in_place_of_b6_to_b9(p):
    """With the gate in the op, a kernel registered for the B6-B9 unit runs in place of B6 and
    the B7-B9 unit when it takes the call (here the registered B6 and B7-B9 unit in one
    function, counted): the same gradients, bit for bit, as the chain running those stages
    itself, GVA's group sum and B10 after it as after the stages; with a pre-computed gate it
    is never asked."""
    from kernel_fun.kda.chain import wy_intra_unit
    from kernel_fun.kda.stages import registered

    calls, fused = _counted(wy_intra_unit(stages()["B6"].impls["ours"], unit.intra_bwd))
    kwargs = make_inputs(p, device=DEVICE, seed=13)
    plain = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record().backward
    assert record["B6"] == "ours" and record["B7-B9"] == "ours" and "B6-B9" not in record, record
    with registered("B6-B9", "ours", fused):
        result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
        record = last_record().backward
        assert record["B6-B9"] == "ours" and not {"B6", "B7", "B8", "B9", "B7-B9", "B7-B10"} & set(record), record
        assert "B10" in record  # (the l2norm in the op: B10 after the unit, on the group sums)
        assert len(calls) == 1
        run_fwd_bwd(chunk_kda, make_inputs(dataclasses.replace(p, gate_in_kernel=False), device=DEVICE, seed=13),
                    grid=p.dtype)
        assert "B6-B9" not in last_record().backward and len(calls) == 1
    _assert_bitwise(result, plain)
