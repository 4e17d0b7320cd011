"""F3-F6 in one kernel (kda/kernels/prep_fwd.py) through the interpreter against the reference
stage, on the inputs the chain gives it: K 64, 128 and 100, T not a multiple of 64, GVA,
packed sequences (ragged chunks of 1, 16, 17, 33 rows), weak, very strong and lower-bounded
gates, disable_recompute's qg; and the chain with it in place of F3-F6 against the float64
recurrence."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, chain_problems, needs_triton, register_for_test
from kernel_fun.kda import chunk_kda
from kernel_fun.kda import reference as ref
from kernel_fun.kda.chain import _ref_intra
from kernel_fun.kda.kernels import prep_fwd
from kernel_fun.kda.problems import Problem, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, stages, use_impls

pytestmark = needs_triton

SHAPES = [
    Problem("T63-K64", 2, 63, 2, 2, 64, 32),
    Problem("T130-K128-gva", 1, 130, 1, 2, 128, 32),
    Problem("T70-K100-fp16", 1, 70, 2, 2, 100, 16, dtype=torch.float16),
    Problem("varlen-ragged-gva4", 1, 67, 1, 4, 64, 16, cu_seqlens=(0, 1, 17, 34, 67)),
    Problem("T100-K64-safe", 1, 100, 2, 2, 64, 16, lower_bound=-5.0, safe_gate=True),
    Problem("T64-V256", 1, 64, 1, 1, 64, 256),
]


def stage_inputs(p: Problem, gate_scale: float = 1.0, gate_shift: float = 0.0, **flags) -> dict:
    """F3-F6's inputs as the reference chain gives them (the raw gate scaled and shifted
    first: softplus of 8x + 12 gives per-token decays of 4-28 nats times exp(A_log))."""
    kw = dict(make_inputs(p, device=DEVICE, seed=6, requires_grad=False), **flags)
    kw["g"] = kw["g"] * gate_scale + gate_shift
    with torch.no_grad(), use_impls("reference"), capture_stages() as log:
        chunk_kda(**kw)
    (inputs,) = [x for name, _, x, _ in log if name == "F3-F6"]
    return inputs


def check(inputs: dict, bound: float = 2e-3) -> dict:
    """Ours against the reference stage (which rounds where fla rounds): every output in the
    input dtype; a value can move one unit in its last place where the fp32 sums differ
    (under the interpreter w and u measure up to 2e-4 at a lower-bounded gate, 8e-5 at
    Kimi's: Akk_inv's bf16 rounding after a solve summed in another order, carried into
    w and u)."""
    got = prep_fwd.prep_fwd(**inputs)
    want = _ref_intra(**inputs)
    errors = {}
    for name, a, b in zip(("w", "u", "kg", "Aqk", "Akk", "qg"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and torch.isfinite(a).all(), name
        errors[name] = ref.rel_rms(a, b)
    assert all(e <= bound for e in errors.values()), errors
    return errors


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_prep_matches_the_reference_stage(p):
    check(stage_inputs(p))


@pytest.mark.parametrize("p", [SHAPES[0], SHAPES[3]], ids=lambda p: p.name)
def test_prep_with_very_strong_gates(p):
    """Per-token decays of 4-28 nats: every diagonal block's span passes 2^64 (the pairwise
    path), and exp2 differences across a block pass 100."""
    inputs = stage_inputs(p, gate_scale=8.0, gate_shift=12.0)
    gc = inputs["gc"][:, : inputs["gc"].shape[1] // 16 * 16]
    spans = gc.unflatten(1, (-1, 16))[:, :, 0] - gc.unflatten(1, (-1, 16))[:, :, 15]
    assert spans.amax() > 100
    check(inputs)


def test_prep_keeps_qg_with_disable_recompute():
    errors = check(stage_inputs(SHAPES[1], disable_recompute=True))
    assert "qg" in errors


def test_both_paths_of_the_diagonal_give_the_same_scores():
    """A weak gate (every diagonal through its anchor) and the same inputs with the gate made
    steep in one head only (that head's diagonals pairwise): the other head's outputs are
    bit for bit unchanged, the steep head's match the reference."""
    weak = stage_inputs(SHAPES[1])
    steep = stage_inputs(SHAPES[1], gate_scale=8.0, gate_shift=12.0)
    mixed = dict(weak, gc=torch.cat([weak["gc"][:, :, :1], steep["gc"][:, :, 1:]], dim=2))
    a, b = prep_fwd.prep_fwd(**weak), prep_fwd.prep_fwd(**mixed)
    assert all(torch.equal(x[:, :, 0], y[:, :, 0]) for x, y in zip(a[:5], b[:5]))
    check(mixed)


def test_supports_and_not_dispatched_yet():
    inputs = stage_inputs(SHAPES[0])
    assert prep_fwd.supports(**inputs) is None
    assert "chunk_size" in prep_fwd.supports(**dict(inputs, chunk_size=32))
    assert "ours" not in stages()["F3-F6"].impls and "ours" not in stages()["F1-F6"].impls


@pytest.mark.parametrize("p", chain_problems(), ids=lambda p: p.name)
def test_chain_with_the_prep_kernel_against_the_oracle(p, monkeypatch):
    """With the kernel in place of F3-F6 (the backward's stages read the Aqk and Akk_inv it
    saved), the forward and every gradient stay within fla's budgets of the float64
    recurrence."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    register_for_test(monkeypatch, "F3-F6", prep_fwd.prep_fwd, prep_fwd.supports)
    kwargs = make_inputs(p, device=DEVICE, seed=14)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert last_record().forward["F3-F6"] == "ours"
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


def test_bench_entry_inputs_run_and_count_bytes():
    from kernel_fun.bench import stage_f3f6
    from kernel_fun.kda.parity import stage_errors
    from kernel_fun.kda.problems import problem

    p = Problem("entry", 1, 100, 2, 4, 64, 32)
    inputs = stage_f3f6.make_inputs(p, DEVICE, seed=1)
    bench = stage_f3f6.BENCH
    got = bench.ours(inputs, "prep", bench.launch_config(p, "prep", None))
    exact = bench.exact(**inputs)
    assert exact[0].dtype == torch.float64
    errors = stage_errors("F3-F6", got, exact)
    # the bf16 outputs against the float64 stage: their rounding, inside the budget
    assert set(errors) == {"w", "u", "kg", "Aqk", "Akk"} and all(0 < e <= 5e-3 for e in errors.values()), errors
    assert abs(stage_f3f6.prep_bytes(problem("prod8192_gate")) / 1e9 - 5.9) < 0.05


# --------------------------------------------------------------------------------------
# F1 and F2 in the same pass
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [
    SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[4],
    Problem("T70-pregated-no-l2norm", 1, 70, 2, 2, 64, 16, gate_in_kernel=False, l2norm_in_kernel=False),
    Problem("T64-no-dt-bias", 1, 64, 2, 2, 64, 16),
], ids=lambda p: p.name)
def test_fused_prep_matches_f1_f2_then_f3_f6(p):
    """The raw q, k and gate in: the normalized q and k, their rstds and the gate's chunk
    cumsum equal to F1's and F2's (their fp32 sums in another order: within 1e-6), and
    F3-F6's outputs within the same bars as the unfused kernel's."""
    kw = make_inputs(p, device=DEVICE, seed=16, requires_grad=False)
    if p.name.endswith("no-dt-bias"):
        kw["dt_bias"] = None
    with torch.no_grad(), use_impls("reference"), capture_stages() as log:
        chunk_kda(**kw)
    found = {name: (x, out) for name, _, x, out in log}
    f36_in, f36_out = found["F3-F6"]
    f2_in, gc_ref = found["F2"]
    got = prep_fwd.prep_fwd_fused(
        q=kw["q"], k=kw["k"], v=f36_in["v"], g=kw["g"], beta=f36_in["beta"], A_log=kw.get("A_log"),
        dt_bias=kw.get("dt_bias"), lower_bound=p.lower_bound, use_gate_in_kernel=p.gate_in_kernel,
        use_qk_l2norm_in_kernel=p.l2norm_in_kernel, scale=f36_in["scale"], chunk_size=64,
        cu_seqlens=f36_in["cu_seqlens"], chunk_indices=f36_in["chunk_indices"], safe_gate=p.safe_gate,
        disable_recompute=False)
    qn, q_rstd, kn, k_rstd, gc = got[:5]
    errors = {"gc": ref.rel_rms(gc, gc_ref)}
    if p.l2norm_in_kernel:
        _, (q_ref, q_rstd_ref, k_ref, k_rstd_ref) = found["F1"]
        errors.update(q=ref.rel_rms(qn, q_ref), k=ref.rel_rms(kn, k_ref), q_rstd=ref.rel_rms(q_rstd, q_rstd_ref),
                      k_rstd=ref.rel_rms(k_rstd, k_rstd_ref))
    else:
        assert q_rstd is None and qn is kw["q"]
    assert all(e <= 1e-6 for e in errors.values()), errors
    for name, a, b in zip(("w", "u", "kg", "Aqk", "Akk"), got[5:], f36_out):
        errors[name] = ref.rel_rms(a, b)
    assert all(e <= 2e-3 for e in errors.values()), errors


@pytest.mark.parametrize("p", chain_problems()[:1] + [
    Problem("chain-K128-varlen-layer-safe", 1, 150, 1, 1, 128, 32, cu_seqlens=(0, 80, 150), dtype=torch.float16,
            lower_bound=-5.0, safe_gate=True, beta_sigmoid_in_kernel=True, state_v_first=True),
    # fp32: without the l2norm, bf16 inputs put even the reference chain past fla's budgets
    Problem("chain-pregated-no-l2norm-fp32", 1, 70, 2, 2, 64, 16, gate_in_kernel=False, l2norm_in_kernel=False,
            dtype=torch.float32),
], ids=lambda p: p.name)
def test_chain_with_the_fused_prep_against_the_oracle(p, monkeypatch):
    """With the fused kernel as the chain's F1-F6 unit, the record shows the unit (and F1b
    before it) in place of F1, F2 and F3-F6, and the forward and every gradient stay within
    fla's budgets of the float64 recurrence: the backward reads the q, k, rstds and Aqk,
    Akk_inv it saved and recomputes the gate from the raw input."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    register_for_test(monkeypatch, "F1-F6", prep_fwd.prep_fwd_fused, prep_fwd.supports)
    kwargs = make_inputs(p, device=DEVICE, seed=17)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    forward = last_record().forward
    assert forward["F1-F6"] == "ours" and not {"F1", "F2", "F3-F6"} & set(forward), forward
    assert ("F1b" in forward) == p.beta_sigmoid_in_kernel
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


@pytest.mark.parametrize("p", [SHAPES[1], SHAPES[3], SHAPES[4]], ids=lambda p: p.name)
def test_wy_recompute_matches_b2(p):
    """The backward's B2 (w, u, qg, kg from the saved Akk_inv) by the same kernel's F6 code,
    on the inputs the reference chain gives B2: within the bars of the forward's outputs."""
    from kernel_fun.kda.chain import _ref_wy

    kw = make_inputs(p, device=DEVICE, seed=19)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (inputs,) = [x for name, _, x, _ in log if name == "B2"]
    got, want = prep_fwd.wy_recompute(**inputs), _ref_wy(**inputs)
    errors = {name: ref.rel_rms(a, b) for name, a, b in zip(("w", "u", "qg", "kg"), got, want)}
    assert all(e <= 2e-3 for e in errors.values()), errors
    # elementwise, the reference's roundings: equal but for exp2 of very negative arguments
    # (denormal results, where the interpreter's and torch's exp2 differ)
    assert errors["kg"] <= 1e-30 and errors["qg"] <= 1e-30, errors


@pytest.mark.parametrize("p", chain_problems(), ids=lambda p: p.name)
def test_chain_with_every_forward_kernel_and_the_recompute(p, monkeypatch):
    """The fused prep as F1-F6, the scan as F7-F8, and in the backward the same kernels as B2
    (wy_recompute) and B3 (scan_states), all registered for the test: the record shows each,
    and the forward and every gradient stay within fla's budgets of the float64 recurrence."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.kernels import scan_fwd
    from kernel_fun.kda.problems import as_oracle_inputs

    register_for_test(monkeypatch, "F1-F6", prep_fwd.prep_fwd_fused, prep_fwd.supports)
    register_for_test(monkeypatch, "F7-F8", scan_fwd.scan_output, scan_fwd.supports)
    register_for_test(monkeypatch, "B2", prep_fwd.wy_recompute, prep_fwd.supports)
    register_for_test(monkeypatch, "B3", scan_fwd.scan_states, lambda kg, **kw: scan_fwd.supports(q=kg, **kw))
    kwargs = make_inputs(p, device=DEVICE, seed=21)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.forward["F1-F6"] == record.forward["F7-F8"] == "ours", record.forward
    assert record.backward["B2"] == record.backward["B3"] == "ours", record.backward
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0", reason="figures recorded with Triton 3.6.0's ptxas")
@pytest.mark.parametrize("design,spills", [("prep", 300), ("prep-fused", 308)])
def test_pinned_config_compiles_without_n8_tf32_wgmma(design, spills):
    """The pin as ptxas assembles it for sm_90a, in a process without the interpreter: no
    N=8 tf32 wgmma (the H200 reads their unpadded shared operand out of bounds: the score
    dots as [64, 16] tiles at 8 warps made 640 of them, and every launch faulted), and no
    more spills than recorded at prep_fwd.DEFAULT_CONFIG."""
    import json
    import os
    import subprocess
    import sys

    cfg = prep_fwd.DEFAULT_CONFIG
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "tools.compile_report", "--design", design, "--bks", str(cfg["BKS"]),
           "--BV", str(cfg["BV"]), "--warps", str(cfg["num_warps"]), "--stages", str(cfg["num_stages"])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in row and row["wgmma"] > 0 and row["wgmma_32B_rows"] == 0, row
    assert row["spill_stores"] <= spills and row["spill_loads"] <= spills, row
