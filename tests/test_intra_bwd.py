"""B7 (kda/kernels/intra_bwd.py) through the interpreter against the stage reference, on the
inputs the chain gives the stage: K 64, 128 and 100, T not a multiple of 64, GVA, packed
sequences, weak, very strong and lower-bounded gates."""

from __future__ import annotations

import contextlib
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


def check(inputs: dict, bound: float = 1e-5, designs=intra_bwd.DESIGNS) -> dict:
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


@pytest.mark.parametrize("design", intra_bwd.DESIGNS)
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
    got = stage_b7.BENCH.ours(inputs, "wide-chunk", stage_b7.BENCH.launch_config(p, "wide-chunk", None))
    want = stage_b7.BENCH.exact(**inputs)
    errors = {n: ref.rel_rms(a, b) for n, a, b in zip(("dq", "dk", "db", "dg"), got, want)}
    assert all(e <= 1e-5 for e in errors.values()), errors
    assert abs(stage_b7.b7_bytes(problem("prod8192_gate")) / 1e9 - 9.7) < 0.1  # the roofline's 9.7 GB


@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0", reason="spill figures recorded with Triton 3.6.0's ptxas")
@pytest.mark.parametrize("design,K,spills,extra", [("wide-chunk", 128, 4, ()), ("wide-chunk", 64, 24, ()),
                                                   ("wide", 128, 0, ()), ("wide-chunk", 128, 36, ("--tail", "2")),
                                                   ("wide-chunk", 128, 44, ("--tail", "2", "--l2norm"))],
                         ids=["wide-chunk-K128", "wide-chunk-K64", "wide-K128", "B7-B9", "B7-B10"])
def test_default_config_compiles_within_its_recorded_spills(design, K, spills, extra):
    """A design's default config as ptxas assembles it for sm_90a (the note at
    intra_bwd.DEFAULT_CONFIG), alone, with the tail (B8, B9) and with B10 too, compiled in a
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
    assert "error" not in row and row["wgmma"] > 0 and row["wgmma_tf32_n8"] == 0, row
    assert row["spill_stores"] <= spills and row["spill_loads"] <= spills, row


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


def test_the_half_chunk_anchors_take_the_chunks_they_should():
    """wide-halves: where the whole chunk's anchor passes the guard, wide-chunk's result bit
    for bit; where it does not but each 32-row half's does (a log-decay of 3 a token: 96
    through the chunk's middle, 48 through each half's), its own path (not the per-block
    form's bits), and both exact against the float64 stage."""
    inputs = stage_inputs(SHAPES[0])
    gc = inputs["gc"]
    t = (torch.arange(gc.shape[1], device=gc.device) % 64 + 1).to(gc.dtype)[None, :, None, None]
    weak = dict(inputs, gc=(-0.01 * t).expand_as(gc).contiguous())
    steep = dict(inputs, gc=(-3.0 * t).expand_as(gc).contiguous())
    run = lambda x, d: intra_bwd.intra_bwd(**x, design=d)  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(run(weak, "wide-halves"), run(weak, "wide-chunk")))
    check(steep, designs=("wide-chunk", "wide-halves"))
    assert not all(torch.equal(a, b) for a, b in zip(run(steep, "wide-halves"), run(steep, "wide-chunk")))


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
    for design in intra_bwd.DESIGNS:
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


# --------------------------------------------------------------------------------------
# B10 in the same launch: the l2norm backward of dq and dk by each chunk-head's last slice
# --------------------------------------------------------------------------------------
@contextlib.contextmanager
def candidate_unit(stage: str, design: str):
    """``design`` registered as ``stage``'s ours inside the block only (as the bench's
    --candidate does for a run)."""
    import importlib

    registry = importlib.import_module("kernel_fun.kda.stages")
    old = registry.stages()[stage]
    registry.add_impl(stage, "ours", *intra_bwd.candidate(stage, design))
    try:
        yield
    finally:
        registry._REGISTRY[stage] = old


L2_SHAPES = [
    dataclasses.replace(SHAPES[0], name="T63-K64-fp32", dtype=torch.float32),
    Problem("T130-K128-h0-fp32", 1, 130, 2, 2, 128, 32, initial_state=True, dtype=torch.float32),
    SHAPES[3],  # packed, bf16
    SHAPES[4],  # lower_bound, safe_gate
    Problem("T70-K100-pregated-fp32", 1, 70, 2, 2, 100, 16, gate_in_kernel=False, dtype=torch.float32),
]


@pytest.mark.parametrize("p", L2_SHAPES, ids=lambda p: p.name)
def test_b10_in_the_launch_matches_the_float64_stages(p):
    """intra_bwd_l2 = B10 of the tail: dq and dk within 1e-5 of B10 in float64 on the
    float64 B7 (bf16: the rounding of the written gradient, 3e-3), in q's dtype; db, dg and
    the gate's parameter gradients the tail's bit for bit; the slices' counters all
    arrived (each chunk-head's last slice wrote its rows: none left unwritten)."""
    kw = make_inputs(p, device=DEVICE, seed=4)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (b7,) = [x for name, _, x, _ in log if name == "B7"]
    (b10,) = [x for name, _, x, _ in log if name == "B10"]
    b9 = [x for name, _, x, _ in log if name == "B9"]
    gate = {n: b9[0][n] for n in ("g", "A_log", "dt_bias", "lower_bound")} if b9 else {}
    want = exact(b7)
    want = [ref.l2norm_bwd(b7[y].double(), b10[r].double(), d) for y, r, d in (("q", "q_rstd", want[0]),
                                                                                ("k", "k_rstd", want[1]))]
    bound = 1e-5 if p.dtype == torch.float32 else 3e-3
    for design in ("wide-chunk", "wide-halves", "wide-pairwise"):
        got = intra_bwd.intra_bwd_l2(**b7, **gate, q_rstd=b10["q_rstd"], k_rstd=b10["k_rstd"], design=design)
        tail = intra_bwd.intra_bwd_tail(**b7, **gate, design=design)
        for a, b in zip(got[2:], tail[2:]):
            assert (a is None and b is None) or torch.equal(a, b), design
        for name, g_, w, like in zip(("dq", "dk"), got[:2], want, (b7["q"], b7["k"])):
            assert g_.dtype == like.dtype and g_.shape == like.shape, (design, name)
            err = ref.rel_rms(g_, w)
            assert err <= bound, (design, name, err)


def test_b10_in_the_launch_refuses_gva():
    b7 = stage_inputs(SHAPES[1])  # H=1, HV=2
    rstd = torch.ones(b7["q"].shape[:3], device=b7["q"].device)
    gate = dict(g=None, A_log=None, dt_bias=None, lower_bound=None, q_rstd=rstd, k_rstd=rstd)
    assert "GVA" in intra_bwd.supports_l2(**b7, **gate)
    with pytest.raises(ValueError, match="H == HV"):
        intra_bwd.intra_bwd_l2(**b7, **gate)


@pytest.mark.parametrize("p", [
    Problem("chain-K128-varlen-safe", 1, 150, 1, 1, 128, 32, cu_seqlens=(0, 80, 150), dtype=torch.float16,
            lower_bound=-5.0, safe_gate=True),
    Problem("chain-K64-gva-h0-gate", 2, 100, 2, 4, 64, 32, initial_state=True, output_final_state=True,
            dtype=torch.float16),
], ids=lambda p: p.name)
def test_chain_with_b10_in_the_launch_against_the_oracle(p):
    """With the B7-B10 unit a candidate: the chain runs it in place of B7 through B10 where
    it takes the call (H == HV), B7-B9 and B10 where it does not (GVA), and every output and
    gradient stays within fla's budgets of the float64 recurrence."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    kwargs = make_inputs(p, device=DEVICE, seed=11)
    with candidate_unit("B7-B10", "wide-chunk"):
        result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record().backward
    if p.H == p.HV:
        assert record["B7-B10"] == "ours" and not {"B7", "B8", "B9", "B7-B9", "B10"} & set(record), record
    else:
        assert "B7-B10" not in record and record["B7-B9"] == "ours" and "B10" in record, record
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


def test_b7_b10_bench_entry_runs_and_counts_bytes():
    from kernel_fun.bench import stage, stage_b7, stage_b7b10
    from kernel_fun.kda.parity import stage_errors
    from kernel_fun.kda.problems import problem

    p = Problem("entry", 1, 100, 2, 2, 64, 16, lower_bound=-5.0, safe_gate=True)
    inputs = stage_b7b10.make_inputs(p, DEVICE, seed=1)
    bench = stage.entries()["B7-B10"]
    errors = stage_errors("B7-B10", bench.ours(inputs, "wide-chunk", bench.launch_config(p, "wide-chunk", None)),
                          bench.exact(**inputs))
    # dq, dk and dg are written in bf16 (their rounding, ~1.6e-3), db and dA_log in fp32
    assert all(errors[n] <= 3e-3 for n in ("dq", "dk", "dg", "ddt_bias")) and errors["db"] <= 1e-5, errors
    assert not bench.designs and "ours" not in stages()["B7-B10"].impls  # a candidate: nothing ships
    with pytest.raises(ValueError, match="H == HV"):
        stage_b7b10.make_inputs(dataclasses.replace(p, HV=4), DEVICE)
    # the unit's floor: B7's reads, its fp32 writes of dq, dk and dg replaced by bf16 ones,
    # the raw gate and both rstds read (B10's whole pass gone)
    p = problem("prod8192_gate")
    tok = p.B * p.T * p.HV * p.K
    fp32_writes, bf16_writes, extra_reads = 3 * tok * 4, 3 * tok * 2, tok * 2 + 2 * p.B * p.T * p.H * 4
    assert stage_b7b10.b7b10_bytes(p) == stage_b7.b7_bytes(p) - fp32_writes + bf16_writes + extra_reads
