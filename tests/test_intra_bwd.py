"""B7 (kda/kernels/intra_bwd.py) through the interpreter against the stage reference, on the
inputs the chain gives the stage: K 64, 128 and 100, T not a multiple of 64, GVA, packed
sequences, weak, very strong and lower-bounded gates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEVICE, chain_problems, needs_triton
from kernel_fun.kda import chunk_kda
from kernel_fun.kda import reference as ref
from kernel_fun.kda.kernels import intra_bwd
from kernel_fun.kda.problems import Problem, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, stages, use_impls

pytestmark = needs_triton

SHAPES = [
    Problem("T63-K64", 2, 63, 2, 2, 64, 32),
    Problem("T130-K128-gva-h0", 1, 130, 1, 2, 128, 32, initial_state=True),
    Problem("T70-K100", 1, 70, 2, 2, 100, 16),
    Problem("varlen-K64", 1, 150, 2, 2, 64, 16, cu_seqlens=(0, 1, 65, 150)),
    Problem("T100-K64-safe", 1, 100, 2, 2, 64, 16, lower_bound=-5.0, safe_gate=True),
    # ragged chunks of 1, 16, 17 and 33 rows (a sub-chunk boundary on each side), GVA 4
    Problem("varlen-ragged-gva4", 1, 67, 1, 4, 64, 16, cu_seqlens=(0, 1, 17, 34, 67)),
]


def stage_inputs(p: Problem, gate_scale: float = 1.0, gate_shift: float = 0.0) -> dict:
    """B7's inputs as the reference chain gives them, the raw gate scaled and shifted first
    (softplus of 8x + 12 makes per-token log-decays of 4-28 nats, times exp(A_log))."""
    kw = make_inputs(p, device=DEVICE, seed=4)
    kw["g"] = (kw["g"].detach() * gate_scale + gate_shift).requires_grad_(True)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (inputs,) = [x for name, _, x, _ in log if name == "B7"]
    return inputs


def exact(inputs: dict) -> tuple:
    """The reference stage in float64 on the same inputs."""
    return ref.intra_bwd(**{n: t for n, t in inputs.items() if n not in ("chunk_indices", "safe_gate")}, exact=True)


# The designs the interpreter tells apart: the pin (wide-halves-pf) is wide-halves with an L2
# hint, which the interpreter skips (bit for bit there; the GPU test holds the two to each
# other).
# wide-halves-pf-x2 (two tf32 products a dot) is exact only to its operand's rounding: its own
# test below.
INTERPRETED = tuple(d for d in intra_bwd.DESIGNS if d not in ("wide-halves", "wide-halves-pf-x2"))


def check(inputs: dict, bound: float = 1e-5, designs=INTERPRETED) -> dict:
    """The designs against the float64 stage (both are exact for any gate)."""
    want = exact(inputs)
    for design in designs:
        got = intra_bwd.intra_bwd(**inputs, design=design)
        errors = {n: ref.rel_rms(a, b) for n, a, b in zip(("dq", "dk", "db", "dg"), got, want)}
        assert all(torch.isfinite(t).all() for t in got), (design, errors)
        assert all(e <= bound for e in errors.values()), (design, errors)
    return errors


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_kernel_matches_reference_stage(p):
    check(stage_inputs(p))


@pytest.mark.parametrize("p", [SHAPES[4], dataclasses.replace(SHAPES[3], name="varlen-K64-safe", lower_bound=-5.0,
                                                               safe_gate=True)], ids=lambda p: p.name)
def test_saturated_bounded_gate(p):
    """The steepest gate safe_gate allows (every token at the lower bound, -5): a block's
    span, 108 in log2, is past GUARD_SPAN, so every diagonal runs pairwise."""
    inputs = stage_inputs(p, gate_scale=0.0, gate_shift=30.0)  # sigmoid saturates: every gate at -5
    gc = inputs["gc"]
    assert (gc[:, 0:16] - gc[:, 15:16]).amax() > float(intra_bwd.GUARD_SPAN.value)
    # dg's intra part cancels (q dq + k dk_row - k dk_col) most at a saturated gate: near
    # 1e-5 there in fp32 (measured 9.5e-6), 1e-7 elsewhere.
    check(inputs, bound=3e-5)
    check(stage_inputs(p))


def test_very_strong_gates_stay_exact():
    """Gates strong enough that exp2 differences inside one 16-row block span hundreds:
    where a factor through an anchor would overflow."""
    p = SHAPES[0]
    inputs = stage_inputs(p, gate_scale=8.0, gate_shift=12.0)
    gc = inputs["gc"]
    span = (gc[:, 0:16] - gc[:, 15:16]).abs().max()
    assert span > 100, span
    check(inputs)


def test_weak_gates():
    check(stage_inputs(SHAPES[1], gate_scale=1.0, gate_shift=-8.0))


# K 64 and 128, GVA with an initial state, packed ragged sequences, a strong gate, the
# saturated lower-bounded one
X2_CASES = [(SHAPES[0], 1.0, 0.0), (SHAPES[1], 1.0, 0.0), (SHAPES[5], 1.0, 0.0), (SHAPES[0], 8.0, 12.0),
            (SHAPES[4], 0.0, 30.0)]


@pytest.mark.parametrize("p,scale,shift", X2_CASES,
                         ids=["T63-K64", "T130-K128-gva-h0", "varlen-ragged-gva4", "T63-K64-strong",
                              "T100-K64-safe-saturated"])
def test_two_product_dots_round_one_operand(p, scale, shift):
    """The candidate wide-halves-pf-x2 takes every dot as a_lo b' + a_hi b', b' = b rounded to
    the nearest tf32 (|b - b'| <= 2^-11 |b|, unbiased): on the chain's fp32 inputs its error
    against the float64 stage is that rounding's, within 2^-11 / sqrt(3) = 2.8e-4 a product
    (measured 2e-5 to 2.8e-4), far from the pin's 1e-7 with three products (so the
    two-product path ran). At the saturated lower-bounded gate (every diagonal pairwise)
    dg's intra part cancels (q dq + k dk_row - k dk_col): the three-product
    form is 1e-5 there, this one 5.8e-3, under fla's dg budget (0.02). On the H200 its error
    is 0.13-0.39 of fla's stage at prod8192_gate and prod8192_layer_safe (stages.jsonl at
    3c7ec7f), and tests/test_gpu.py holds it to fla's own error on the chain's gates; in the
    whole op its gate gradients reach fla's error (why it is not the pin: docs/log/b7.md)."""
    inputs = stage_inputs(p, gate_scale=scale, gate_shift=shift)
    want = exact(inputs)
    got = intra_bwd.intra_bwd(**inputs, design="wide-halves-pf-x2")
    three = intra_bwd.intra_bwd(**inputs, design=intra_bwd.PIN)
    saturated = scale == 0.0
    for n, a, b, c in zip(("dq", "dk", "db", "dg"), got, want, three):
        err, three_err = ref.rel_rms(a, b), ref.rel_rms(c, b)
        bound = 8e-3 if (saturated and n == "dg") else 4e-4
        assert torch.isfinite(a).all() and err <= bound, (n, err)
        assert err > 10 * three_err or (saturated and n == "db"), (n, err, three_err)  # the two-product path ran


@pytest.mark.parametrize("design", INTERPRETED)
def test_outputs_are_fresh_and_inputs_untouched(design):
    inputs = stage_inputs(SHAPES[0])
    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    out = intra_bwd.intra_bwd(**inputs, design=design)
    again = intra_bwd.intra_bwd(**inputs, design=design)
    for n, t in before.items():
        assert torch.equal(inputs[n], t), n
    for a, b in zip(out, again):
        assert torch.equal(a, b)
        assert all(a.data_ptr() != t.data_ptr() for t in before.values())


def test_supports():
    inputs = stage_inputs(SHAPES[0])
    assert intra_bwd.supports(**inputs) is None
    assert "chunk_size" in intra_bwd.supports(**dict(inputs, chunk_size=32))
    assert intra_bwd.supports(**dict(inputs, safe_gate=True)) is None


def test_kernel_is_dispatched():
    assert stages()["B7"].impls["ours"] is intra_bwd.intra_bwd
    assert stages()["B7-B9"].impls["ours"] is intra_bwd.intra_bwd_tail


def test_bench_entry_inputs_run_and_count_bytes():
    from kernel_fun.bench import stage_b7
    from kernel_fun.kda.problems import problem

    p = Problem("entry", 1, 100, 2, 4, 64, 16)
    inputs = stage_b7.make_inputs(p, DEVICE, seed=1)
    want = stage_b7.BENCH.exact(**inputs)
    # the pin's three-product dots at fp32 level; the candidate's two-product dots under fla's
    # own error against the float64 stage on these inputs' magnitudes (1.3e-5 to 2.3e-5 at
    # prod8192_gate, the candidate's 0.28-0.39 of it there: stages.jsonl at 3c7ec7f)
    for design, bound in ((intra_bwd.PIN, 1e-6), ("wide-halves-pf-x2", 1.2e-5)):
        got = stage_b7.BENCH.ours(inputs, design, stage_b7.BENCH.launch_config(p, design, None))
        errors = {n: ref.rel_rms(a, b) for n, a, b in zip(("dq", "dk", "db", "dg"), got, want)}
        assert all(e <= bound for e in errors.values()), (design, errors)
    assert abs(stage_b7.b7_bytes(problem("prod8192_gate")) / 1e9 - 9.7) < 0.1  # the roofline's 9.7 GB


@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0", reason="spill figures recorded with Triton 3.6.0's ptxas")
@pytest.mark.parametrize("design,K,spills,extra", [("wide-halves-pf", 128, 144, ()), ("wide-halves-pf", 64, 136, ()),
                                                   ("wide", 128, 0, ()), ("wide-halves-pf", 128, 152, ("--tail", "2"))],
                         ids=["pin-K128", "pin-K64", "wide-K128", "B7-B9"])
def test_default_config_compiles_within_its_recorded_spills(design, K, spills, extra):
    """A design's default config as ptxas assembles it for sm_90a (the note at
    intra_bwd.DEFAULT_CONFIG), alone and with the tail (B8, B9), compiled in a
    process without the interpreter: a change that adds spills fails here. Its [64, 16] x [16, 32] dots are wgmma, none of them N=8 tf32
    (which the H200 runs out of bounds, see tools/compile_report.py)."""
    import json
    import os
    import subprocess
    import sys

    cfg = intra_bwd.DEFAULT_CONFIG
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "tools.compile_report", "--design", design, "--K", str(K), "--BV", str(cfg["BK"]),
           "--warps", str(cfg["num_warps"]), "--stages", str(cfg["num_stages"]), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in row and row["wgmma"] > 0 and row["wgmma_32B_rows"] == 0, row
    assert row["spill_stores"] <= spills and row["spill_loads"] <= spills, row


@needs_triton
def test_the_kernel_takes_the_tier_the_spec_names():
    """tools.b7_tiers (the guards' arithmetic in torch, what the tier shares on the H200 are
    counted with) against the kernel: log-decays a token of 0.01, 3.0, 4.1 and 5.0 in turn
    put the four chunks on the chunk anchor, the half-chunk anchors, the per-block anchors
    and the pairwise diagonals (the half span 16 steps, the block span 15; the second K
    slice gentler), T=250 (a last chunk of 58 rows). Where the spec names the chunk anchor
    the pin's dq, dk and dg are wide-chunk's bit for bit, where it names the per-block form
    wide's, and where it names the halves neither's."""
    p = Problem("tiers", 1, 250, 2, 2, 64, 16)
    inputs = stage_inputs(p)
    gc = inputs["gc"]
    t = torch.arange(gc.shape[1], device=gc.device)
    slope = torch.tensor([0.01, 3.0, 4.1, 5.0], dtype=gc.dtype)[t // 64]
    scale = torch.tensor([1.0, 0.7], dtype=gc.dtype).repeat_interleave(32)  # the second slice gentler
    steps = slope[:, None] * scale[None, :]  # [T, K]
    within = torch.cat([steps[64 * c:64 * c + 64].cumsum(0) for c in range(-(-gc.shape[1] // 64))])
    inputs = dict(inputs, gc=(-within)[None, :, None, :].expand_as(gc).contiguous())
    from tools.b7_tiers import tiers as tiers_of

    tiers = tiers_of(inputs["gc"])
    assert tiers[0, :, 0, 0].tolist() == [0, 1, 2, 3], tiers
    assert set(tiers.unique().tolist()) == {0, 1, 2, 3}, tiers
    run = {d: intra_bwd.intra_bwd(**inputs, design=d) for d in (intra_bwd.PIN, "wide-chunk", "wide")}
    per_row = tiers.repeat_interleave(64, 1)[:, :gc.shape[1]].repeat_interleave(32, 3)  # [B, T, HV, K]
    for i, name in ((0, "dq"), (1, "dk"), (3, "dg")):
        pin, chunk, wide = (run[d][i] for d in (intra_bwd.PIN, "wide-chunk", "wide"))
        on = per_row == 0
        assert torch.equal(pin[on], chunk[on]), name
        on = per_row >= 2
        assert torch.equal(pin[on], wide[on]), name
        on = per_row == 1
        assert (pin[on] != wide[on]).any() and (pin[on] != chunk[on]).any(), name



@pytest.mark.parametrize("p", chain_problems(), ids=lambda p: p.name)
def test_chain_with_our_b7_against_the_oracle(p):
    """B7's launcher takes the chain's stage contract as registered: with it in the chain
    (B6 ours too; the B7-B9 unit held off, so B7 runs alone), every output and gradient
    stays within fla's budgets of the float64 recurrence."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    kwargs = make_inputs(p, device=DEVICE, seed=11)
    with use_impls({"B7-B9": "reference"}):  # the unit held off: B7, B8 and B9 run one by one
        result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert last_record().backward["B7"] == "ours" and last_record().backward["B6"] == "ours"
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


def test_guard_takes_each_path_where_it_should():
    """wide: a block's diagonal through its anchor where its gate span is small (the result
    then differs in the last bits from wide-pairwise's), pairwise where the span passes
    GUARD_SPAN in every block (bit for bit wide-pairwise's result); wide-chunk likewise
    against wide."""
    inputs = stage_inputs(SHAPES[0])
    assert (inputs["gc"][:, 0:16] - inputs["gc"][:, 15:16]).amax() < float(intra_bwd.GUARD_SPAN.value)
    anchored = intra_bwd.intra_bwd(**inputs, design="wide")
    pairwise = intra_bwd.intra_bwd(**inputs, design="wide-pairwise")
    assert not all(torch.equal(a, b) for a, b in zip(anchored, pairwise))
    saturated = stage_inputs(SHAPES[0], gate_scale=0.0, gate_shift=30.0)  # every block's span in the hundreds
    gc = saturated["gc"][:, :48]  # T=63: the last block has 15 rows
    assert (gc.unflatten(1, (3, 16))[:, :, 0] - gc.unflatten(1, (3, 16))[:, :, 15]).amin() > 64
    anchored = intra_bwd.intra_bwd(**saturated, design="wide")
    pairwise = intra_bwd.intra_bwd(**saturated, design="wide-pairwise")
    assert all(torch.equal(a, b) for a, b in zip(anchored, pairwise))
    # wide-chunk: the whole chunk through its middle row at the weak gate, the wide form where
    # a chunk's factors pass the guard (the saturated gate: bit for bit wide's result)
    assert not all(torch.equal(a, b) for a, b in zip(intra_bwd.intra_bwd(**inputs, design="wide-chunk"),
                                                      intra_bwd.intra_bwd(**inputs, design="wide")))
    assert all(torch.equal(a, b) for a, b in zip(intra_bwd.intra_bwd(**saturated, design="wide-chunk"), anchored))
    # the pin (wide-halves-pf) likewise: the per-block form where neither anchor passes the guard
    assert all(torch.equal(a, b) for a, b in zip(intra_bwd.intra_bwd(**saturated), anchored))


def test_the_half_chunk_anchors_take_the_chunks_they_should():
    """The pin (the half-chunk tier): where the whole chunk's anchor passes the guard, wide-chunk's result bit
    for bit; where it does not but each 32-row half's does (a log-decay of 3 a token: 96
    through the chunk's middle, 48 through each half's), its own path (not the per-block
    form's bits), and both exact against the float64 stage."""
    inputs = stage_inputs(SHAPES[0])
    gc = inputs["gc"]
    t = (torch.arange(gc.shape[1], device=gc.device) % 64 + 1).to(gc.dtype)[None, :, None, None]
    weak = dict(inputs, gc=(-0.01 * t).expand_as(gc).contiguous())
    steep = dict(inputs, gc=(-3.0 * t).expand_as(gc).contiguous())
    run = lambda x, d: intra_bwd.intra_bwd(**x, design=d)  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(run(weak, intra_bwd.PIN), run(weak, "wide-chunk")))
    check(steep, designs=("wide-chunk", intra_bwd.PIN))
    assert not all(torch.equal(a, b) for a, b in zip(run(steep, intra_bwd.PIN), run(steep, "wide-chunk")))


# --------------------------------------------------------------------------------------
# The tail in the same pass: B8 (reverse chunk cumsum of dg) and B9 (the gate's backward)
# --------------------------------------------------------------------------------------
def tail_inputs(p: Problem) -> tuple[dict, dict | None]:
    """B7's inputs and B9's (None for a pre-computed gate) from one reference chain run."""
    kw = make_inputs(p, device=DEVICE, seed=4)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (b7,) = [x for name, _, x, _ in log if name == "B7"]
    b9 = [x for name, _, x, _ in log if name == "B9"]
    return b7, (b9[0] if b9 else None)


def exact_tail(b7: dict, b9: dict | None) -> dict:
    """B7 in float64, B8 and B9 from it in float64."""
    gate = {} if b9 is None else {n: b9[n] for n in ("g", "A_log", "dt_bias", "lower_bound")}
    out = ref.intra_bwd_tail(**{n: t for n, t in b7.items() if n not in ("chunk_indices", "safe_gate")}, **gate,
                             exact=True)
    return dict(zip(("dg", "dA_log", "ddt_bias"), out[3:])) if b9 is not None else {"dg": out[3]}


TAIL_SHAPES = [
    dataclasses.replace(SHAPES[0], name="T63-K64-fp32", dtype=torch.float32),
    dataclasses.replace(SHAPES[1], name="T130-K128-gva-h0-pregated", gate_in_kernel=False),
    SHAPES[3],  # packed, bf16
    SHAPES[4],  # lower_bound, safe_gate
    dataclasses.replace(SHAPES[5], name="varlen-ragged-gva4-fp32", dtype=torch.float32),
]


@pytest.mark.parametrize("p", TAIL_SHAPES, ids=lambda p: p.name)
def test_tail_matches_the_float64_stages(p):
    """intra_bwd_tail = B9(B8(B7)) of the float64 stages: dg within 1e-5 in fp32 (bf16:
    the rounding of the written gradient, 3e-3), dA_log and dt_bias's gradients within 1e-5
    (bf16: 2e-3); B7's own outputs as intra_bwd's, bit for bit."""
    b7, b9 = tail_inputs(p)
    want = exact_tail(b7, b9)
    gate = {} if b9 is None else {n: b9[n] for n in ("g", "A_log", "dt_bias", "lower_bound")}
    for design in INTERPRETED:
        dq, dk, db, dg, dA_log, ddt_bias = intra_bwd.intra_bwd_tail(**b7, **gate, design=design)
        alone = intra_bwd.intra_bwd(**b7, design=design)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, db), alone[:3])), design
        got = {"dg": dg, "dA_log": dA_log, "ddt_bias": ddt_bias}
        rounded = b9 is not None and b9["g"].dtype != torch.float32
        assert dg.dtype == (b9["g"].dtype if b9 is not None else torch.float32), design
        for name, w in want.items():
            assert got[name] is not None, (design, name)
            err = ref.rel_rms(got[name], w)
            bound = (3e-3 if name == "dg" else 2e-3) if rounded else 1e-5
            assert err <= bound, (design, name, err)
        if b9 is None:
            assert dA_log is None and ddt_bias is None


@pytest.mark.parametrize("p", [
    Problem("chain-K64-gva-h0-gate", 2, 100, 2, 4, 64, 32, initial_state=True, output_final_state=True,
            dtype=torch.float16),
    Problem("chain-K128-varlen-safe", 1, 150, 1, 1, 128, 32, cu_seqlens=(0, 80, 150), dtype=torch.float16,
            lower_bound=-5.0, safe_gate=True),
    Problem("chain-K64-pregated", 1, 70, 2, 2, 64, 16, gate_in_kernel=False, dtype=torch.float16),
], ids=lambda p: p.name)
def test_chain_with_the_fused_tail_against_the_oracle(p):
    """The chain runs B7-B9 in one pass when its kernel takes the call: the record shows
    the unit in place of B7, B8 and B9, and every output and gradient (dA_log and dt_bias's
    too) stays within fla's budgets of the float64 recurrence."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    kwargs = make_inputs(p, device=DEVICE, seed=11)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record().backward
    assert record["B7-B9"] == "ours" and not {"B7", "B8", "B9"} & set(record), record
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors
    assert ("dA_log" in errors) == p.gate_in_kernel


@needs_triton
def test_b7_b9_bench_entry_runs_and_counts_bytes():
    """The B7-B9 unit's stage-bench entry: its kernel on the entry's inputs (GVA, lower
    bound) within 1e-6 of the float64 stages where fp32 (dq, dk, db, dA_log) and within the
    written rounding where bf16 (the raw gate's gradient); the pin ships; its floor is B7's
    reads plus the raw gate, with dg written in the gate's dtype."""
    from kernel_fun.bench import stage, stage_b7, stage_b7b9
    from kernel_fun.kda.parity import stage_errors
    from kernel_fun.kda.problems import problem

    p = Problem("entry", 1, 100, 2, 4, 64, 16, lower_bound=-5.0, safe_gate=True)
    inputs = stage_b7b9.make_inputs(p, DEVICE, seed=1)
    bench = stage.entries()["B7-B9"]
    errors = stage_errors("B7-B9", bench.ours(inputs, intra_bwd.PIN, bench.launch_config(p, intra_bwd.PIN, None)),
                          bench.exact(**inputs))
    assert all(errors[n] <= 1e-6 for n in ("dq", "dk", "db", "dA_log")) and errors["dg"] <= 3e-3, errors
    assert bench.ships(dict(design=intra_bwd.PIN, shape="prod8192_gate", config=intra_bwd.DEFAULT_CONFIG))
    assert not bench.ships(dict(design="wide-halves", shape="prod8192_gate", config=intra_bwd.DEFAULT_CONFIG))
    assert not bench.ships(dict(design="wide-chunk", shape="prod8192_gate", config=intra_bwd.DEFAULT_CONFIG))
    p = problem("prod8192_gate")
    tok = p.B * p.T * p.HV * p.K
    assert stage_b7b9.b7b9_bytes(p) == stage_b7.b7_bytes(p) - tok * 4 + 2 * tok * 2  # dg in bf16, the raw gate read
