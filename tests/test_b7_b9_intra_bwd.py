"""B7-B9 (kda/kernels/b7_b9_intra_bwd.py: B7 with B8 and B9 in one pass) through the
interpreter against the float64 stages, on the inputs the chain gives them: K 64, 128 and
100, T not a multiple of 64, GVA, packed sequences (ragged chunks of 1, 16, 17 and 33 rows),
the softplus, lower-bounded and pre-computed gates, weak, very strong and saturated gates
(each tier of the kernel taken, and held to the others bit for bit where both take a path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEVICE, chain_problems, needs_triton
from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda import reference as ref
from kernel_fun.kda.kernels import b7_b9_intra_bwd as unit
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, stages, use_impls

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
# The tiers switched off, each a path the pinned kernel takes where the gate sends it: the
# per-block form alone, every diagonal pairwise, and the chunk anchor without the halves.
BLOCKS = dict(CHUNK_ANCHOR=False, HALVES=False)
PAIRWISE = dict(PAIRWISE=True, CHUNK_ANCHOR=False, HALVES=False)
CHUNK = dict(HALVES=False)


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


def check(inputs: dict, bound: float = 1e-5, tiers: dict | None = None) -> tuple:
    """The unit against the float64 stages: dq, dk and db (fp32) within ``bound``; dg within
    ``bound`` where it is fp32 (B8's, a pre-computed or fp32 gate), within its rounding where
    it is the raw gate's bf16 gradient (3e-3), and dA_log's and dt_bias's gradients within 1e-5
    (2e-3 summed from a bf16 gate's rounded gradient)."""
    got = unit.intra_bwd(**inputs, _tiers=tiers)
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
        limit = {"dg": 3e-3, "dA_log": 2e-3, "ddt_bias": 2e-3}.get(name, bound) if rounded else bound
        assert err <= max(limit, bound), (name, err)
    return got


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_unit_matches_the_float64_stages(p):
    check(unit_inputs(p))


def test_saturated_bounded_gate():
    """The steepest gate safe_gate allows (every token at the lower bound, -5): a full
    block's span, 108 in log2, is past GUARD_SPAN, so its diagonal runs pairwise."""
    inputs = unit_inputs(SHAPES[4], gate_scale=0.0, gate_shift=30.0)  # sigmoid saturates: every gate at -5
    gc = inputs["gc"]
    assert (gc[:, 0:16] - gc[:, 15:16]).amax() > float(unit.GUARD_SPAN.value)
    # dg's intra part cancels (q dq + k dk_row - k dk_col) most at a saturated gate: near
    # 1e-5 there in fp32 (measured 9.5e-6), 1e-7 elsewhere.
    check(inputs, bound=3e-5)


def test_very_strong_gates_stay_exact():
    """Gates strong enough that exp2 differences inside one 16-row block span hundreds:
    where a factor through an anchor would overflow."""
    inputs = unit_inputs(SHAPES[0], gate_scale=8.0, gate_shift=12.0)
    gc = inputs["gc"]
    assert (gc[:, 0:16] - gc[:, 15:16]).abs().max() > 100
    check(inputs)


def test_weak_gates():
    """softplus(x - 8): log-decays of ~3e-4 a token, every program on the chunk anchor."""
    check(unit_inputs(Problem("T130-K128-gva-h0", 1, 130, 1, 2, 128, 32, initial_state=True), gate_shift=-8.0))


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


def test_guard_takes_each_path_where_it_should():
    """The per-block form: a block's diagonal through its anchor where its gate span is small
    (the result then differs in the last bits from the pairwise tier's), pairwise where the
    span passes GUARD_SPAN in every block (bit for bit the pairwise tier's result); the chunk
    anchor likewise against the per-block form, and the pinned kernel the per-block form's
    where neither anchor passes the guard."""
    inputs = unit_inputs(SHAPES[0])
    assert (inputs["gc"][:, 0:16] - inputs["gc"][:, 15:16]).amax() < float(unit.GUARD_SPAN.value)

    def run(x, tiers=None):
        return unit.intra_bwd(**x, _tiers=tiers)[:4]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    blocks = run(inputs, BLOCKS)
    assert not same(blocks, run(inputs, PAIRWISE))
    assert not same(run(inputs, CHUNK), blocks)
    saturated = unit_inputs(SHAPES[0], gate_scale=0.0, gate_shift=30.0)  # every block's span in the hundreds
    gc = saturated["gc"][:, :48]  # T=63: the last block has 15 rows
    assert (gc.unflatten(1, (3, 16))[:, :, 0] - gc.unflatten(1, (3, 16))[:, :, 15]).amin() > 64
    blocks = run(saturated, BLOCKS)
    assert same(blocks, run(saturated, PAIRWISE))
    assert same(run(saturated, CHUNK), blocks)
    assert same(run(saturated), blocks)


def test_the_half_chunk_anchors_take_the_chunks_they_should():
    """Where the whole chunk's anchor passes the guard, the chunk tier's result bit for bit;
    where it does not but each 32-row half's does (a log-decay of 3 a token: 96 through the
    chunk's middle, 48 through each half's), the halves' own path (not the chunk tier's bits),
    exact against the float64 stages either way."""
    inputs = unit_inputs(SHAPES[0])
    gc = inputs["gc"]
    t = (torch.arange(gc.shape[1], device=gc.device) % 64 + 1).to(gc.dtype)[None, :, None, None]
    weak, steep = with_gc(inputs, -0.01 * t), with_gc(inputs, -3.0 * t)
    pin = unit.intra_bwd(**weak)[:4]
    assert all(torch.equal(a, b) for a, b in zip(pin, unit.intra_bwd(**weak, _tiers=CHUNK)[:4]))
    pin = check(steep)[:4]
    chunk = check(steep, tiers=CHUNK)[:4]
    assert not all(torch.equal(a, b) for a, b in zip(pin, chunk))


def test_the_kernel_takes_the_tier_the_spec_names():
    """The guards' arithmetic in torch (``benchmarks.stages.b7_b9.tiers``, what the tier
    shares on the H200 are counted with) against the kernel: log-decays a token of 0.01, 3.0,
    4.1 and 5.0 in turn put the four chunks on the chunk anchor, the half-chunk anchors, the
    per-block anchors and the pairwise diagonals (the half span 16 steps, the block span 15;
    the second K slice gentler), T=250 (a last chunk of 58 rows). Where the spec names the
    chunk anchor the kernel's dq, dk and dg are the chunk tier's bit for bit, where it names
    the per-block form the per-block tier's, and where it names the halves neither's."""
    from benchmarks.stages.b7_b9 import tiers as tiers_of

    p = Problem("tiers", 1, 250, 2, 2, 64, 16, gate_in_kernel=False)
    inputs = unit_inputs(p)
    gc = inputs["gc"]
    t = torch.arange(gc.shape[1], device=gc.device)
    slope = torch.tensor([0.01, 3.0, 4.1, 5.0], dtype=gc.dtype)[t // 64]
    scale = torch.tensor([1.0, 0.7], dtype=gc.dtype).repeat_interleave(32)  # the second slice gentler
    steps = slope[:, None] * scale[None, :]  # [T, K]
    within = torch.cat([steps[64 * c:64 * c + 64].cumsum(0) for c in range(-(-gc.shape[1] // 64))])
    inputs = with_gc(inputs, (-within)[None, :, None, :])
    tiers = tiers_of(inputs["gc"])
    assert tiers[0, :, 0, 0].tolist() == [0, 1, 2, 3], tiers
    assert set(tiers.unique().tolist()) == {0, 1, 2, 3}, tiers
    run = {name: unit.intra_bwd(**inputs, _tiers=tiers_) for name, tiers_ in
           (("pin", None), ("chunk", CHUNK), ("blocks", BLOCKS))}
    per_row = tiers.repeat_interleave(64, 1)[:, :gc.shape[1]].repeat_interleave(32, 3)  # [B, T, HV, K]
    for i, name in ((0, "dq"), (1, "dk"), (3, "dg")):
        pin, chunk, blocks = (run[d][i] for d in ("pin", "chunk", "blocks"))
        on = per_row == 0
        assert torch.equal(pin[on], chunk[on]), name
        on = per_row >= 2
        assert torch.equal(pin[on], blocks[on]), name
        on = per_row == 1
        assert (pin[on] != blocks[on]).any() and (pin[on] != chunk[on]).any(), name


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


def test_supports_and_config():
    inputs = unit_inputs(SHAPES[0])
    assert unit.supports(**inputs) is None
    assert "chunk_size" in unit.supports(**dict(inputs, chunk_size=32))
    assert unit.supports(**dict(inputs, safe_gate=True)) is None
    with pytest.raises(ValueError, match="PRODUCTS"):  # a retired knob is an error, not ignored
        unit.intra_bwd(**inputs, config={"PRODUCTS": 2})
    assert stages()["B7-B9"].impls["ours"] is unit.intra_bwd
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
