"""F1, F2 and F4 in one kernel (kda/kernels/diag_fwd.py) through the interpreter, on the
inputs the reference chain gives those stages: the normalized rows, their rstds and the
gate's cumsum against the reference stages, the diagonal blocks against a float64 sum on
the kernel's own rows; K 64, 128 and 100, T not a multiple of 64, GVA, packed sequences,
fp16 and fp32, the softplus, lower-bounded and pre-computed gates, weak and very strong
gates (the blocks past the guard go pairwise)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEVICE, chain_problems, needs_triton, register_for_test
from kernel_fun.kda import chunk_kda
from kernel_fun.kda import reference as ref
from kernel_fun.kda.kernels import diag_fwd
from kernel_fun.kda.parity import tril_mask
from kernel_fun.kda.problems import Problem, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, use_impls

pytestmark = needs_triton
GUARD = float(diag_fwd.GUARD_SPAN.value)

SHAPES = [
    Problem("T63-K64", 2, 63, 2, 2, 64, 16),
    Problem("T130-K128-gva", 1, 130, 1, 2, 128, 16),
    Problem("T70-K100-fp16", 1, 70, 2, 2, 100, 16, dtype=torch.float16),
    Problem("varlen-K64-gva", 1, 150, 1, 2, 64, 16, cu_seqlens=(0, 1, 65, 150)),
    Problem("T100-K64-lower-bound", 1, 100, 2, 2, 64, 16, lower_bound=-5.0, safe_gate=True),
    Problem("T80-K64-pregated-fp32", 1, 80, 2, 2, 64, 16, gate_in_kernel=False, dtype=torch.float32),
]


def unit_inputs(p: Problem, gate_scale: float = 1.0, gate_shift: float = 0.0):
    """The F1-F4 kernel's arguments from the reference chain's F1, F2 and F3-F6 inputs, and
    those stages' outputs: (kwargs, F1's (q, q_rstd, k, k_rstd), F2's gc)."""
    kw = make_inputs(p, device=DEVICE, seed=3, requires_grad=False)
    kw["g"] = kw["g"] * gate_scale + gate_shift
    with torch.no_grad(), use_impls("reference"), capture_stages() as log:
        chunk_kda(**kw)
    runs = {name: (x, out) for name, _, x, out in log if name in ("F1", "F2", "F3-F6")}
    (f2, gc), (f36, _) = runs["F2"], runs["F3-F6"]
    f1, f1_out = runs["F1"]
    args = dict(q=f1["q"], k=f1["k"], g=f2["g"], beta=f36["beta"], A_log=f2["A_log"], dt_bias=f2["dt_bias"],
                lower_bound=f2["lower_bound"], use_gate_in_kernel=f2["use_gate_in_kernel"],
                use_qk_l2norm_in_kernel=True, scale=f36["scale"], chunk_size=f36["chunk_size"],
                cu_seqlens=f36["cu_seqlens"], chunk_indices=f36["chunk_indices"])
    return args, f1_out, gc


def exact_blocks(q, k, gc, beta, scale, cu_seqlens, BT: int = 64, BC: int = 16):
    """The diagonal 16x16 blocks in float64 from the given rows: (Aqk's [B, T, HV, 16] with
    s <= r, scaled; Akk's with s < r, times beta_r), in each row's block-local columns."""
    B, T, H, K = q.shape
    HV = gc.shape[2]
    G = HV // H
    qf, kf = (x.double().repeat_interleave(G, dim=2) for x in (q, k))
    gf, bf = gc.double(), beta.double()
    a_q = torch.zeros(B, T, HV, BC, dtype=torch.float64, device=q.device)
    a_k = torch.zeros_like(a_q)
    bounds = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    for lo, hi in bounds:
        for c in range(lo, hi, BT):
            for st in range(c, min(c + BT, hi), BC):
                en = min(st + BC, hi)
                dec = torch.exp2(gf[:, st:en, None] - gf[:, None, st:en])  # [B, r, s, HV, K]
                sq = torch.einsum("brhk,bshk,brshk->brhs", qf[:, st:en], kf[:, st:en], dec)
                sk = torch.einsum("brhk,bshk,brshk->brhs", kf[:, st:en], kf[:, st:en], dec)
                n = en - st
                pos = torch.arange(n, device=q.device)
                low = (pos[None, :] <= pos[:, None]).view(1, n, 1, n)
                strict = (pos[None, :] < pos[:, None]).view(1, n, 1, n)
                a_q[:, st:en, :, :n] = torch.where(low, sq * scale, 0.0)
                a_k[:, st:en, :, :n] = torch.where(strict, sk * bf[:, st:en, :, None], 0.0)
    return a_q, a_k


def local_blocks(Aqk: torch.Tensor, cu_seqlens) -> torch.Tensor:
    return ref.local_blocks(Aqk, 64, cu_seqlens)


def check(args, f1_out, gc_ref, pairwise: bool = False, bound: float = 1e-5):
    qn, q_rstd, kn, k_rstd, gc, Aqk, Akkd = diag_fwd.prep_diag(**args, pairwise=pairwise)
    want_q, want_qr, want_k, want_kr = f1_out
    # F1 and F2 as the reference stages form them (a sum in another order can move a rounded
    # value by one unit in the last place)
    for got, want in ((qn, want_q), (kn, want_k)):
        assert got.dtype == want.dtype
        if got.dtype == torch.float32:
            assert ref.rel_rms(got, want) <= 1e-6
        else:
            assert ref.rel_rms(got, want) <= 1e-3 and (got != want).float().mean() <= 0.01
    assert ref.rel_rms(q_rstd, want_qr) <= 1e-6 and ref.rel_rms(k_rstd, want_kr) <= 1e-6
    assert ref.rel_rms(gc, gc_ref) <= 1e-6
    # the blocks, against float64 on the kernel's own rows
    cu = args["cu_seqlens"]
    e_q, e_k = exact_blocks(qn, kn, gc, args["beta"], args["scale"], cu)
    got_q = local_blocks(Aqk, cu).double()
    rounding = 0 if Aqk.dtype == torch.float32 else 4e-3  # Aqk in the input dtype
    err = {"Aqk": ref.rel_rms(got_q, e_q), "Akkd": ref.rel_rms(Akkd.double(), e_k)}
    assert torch.isfinite(got_q).all() and torch.isfinite(Akkd).all()  # (off the blocks Aqk is left for F5)
    assert err["Aqk"] <= max(bound, rounding) and err["Akkd"] <= bound, err
    # zero above the diagonal inside a block
    r_in = ref.sequence_positions(Aqk.shape[1], cu, Aqk.device) % 16
    pos = torch.arange(16, device=Aqk.device)
    assert not (got_q * (pos[None, :] > r_in[:, None]).view(1, -1, 1, 16)).any()
    assert not (Akkd * (pos[None, :] >= r_in[:, None]).view(1, -1, 1, 16)).any()
    # zeros past the row's block: Aqk's only unwritten entries are the blocks below (F5's)
    col = torch.arange(64, device=Aqk.device)
    row = ref.sequence_positions(Aqk.shape[1], cu, Aqk.device) % 64
    upper = (col[None, :] >= (row // 16 * 16 + 16)[:, None]).view(1, -1, 1, 64)
    assert (torch.where(upper, Aqk, 0) == 0).all()
    return err


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_kernel_matches_reference_stages(p):
    check(*unit_inputs(p))


@pytest.mark.parametrize("p", [SHAPES[1], SHAPES[3]], ids=lambda p: p.name)
def test_pairwise_form_matches(p):
    """Every block pairwise (the guard's other path) on the same inputs."""
    check(*unit_inputs(p), pairwise=True)


def block_spans(gc: torch.Tensor) -> torch.Tensor:
    """Each (sequence, 16-row block, value head)'s span as the kernel's guard takes it: the
    largest |g - g_first| over the block's rows and the channels (dense sequences)."""
    B, T, HV, K = gc.shape
    return torch.stack([(gc[:, st:st + 16] - gc[:, st:st + 1]).abs().amax(dim=(1, 3)) for st in range(0, T, 16)], 1)


def test_the_chain_s_gate_takes_both_paths():
    """The default gate at T63: some blocks within the guard, some past it (pairwise)."""
    args, f1_out, gc = unit_inputs(SHAPES[0])
    spans = block_spans(gc)
    assert (spans <= GUARD).any() and (spans > GUARD).any()
    check(args, f1_out, gc)


def test_very_strong_gates_go_pairwise_and_stay_exact():
    """softplus(8x + 12) makes log-decays of 4-28 nats a token: every block's span passes
    the guard, so the blocks run pairwise; no factor above 1 is formed."""
    args, f1_out, gc = unit_inputs(SHAPES[0], gate_scale=8.0, gate_shift=12.0)
    assert (block_spans(gc) > GUARD).all()
    check(args, f1_out, gc)


def test_weak_gates_take_the_anchored_blocks():
    args, f1_out, gc = unit_inputs(SHAPES[1], gate_scale=1.0, gate_shift=-8.0)
    assert (block_spans(gc) <= GUARD).all()
    check(args, f1_out, gc)


def test_outputs_are_fresh_and_inputs_untouched():
    args, _, _ = unit_inputs(SHAPES[0])
    before = {n: t.clone() for n, t in args.items() if isinstance(t, torch.Tensor)}
    out = list(diag_fwd.prep_diag(**args))
    again = list(diag_fwd.prep_diag(**args))
    for n, t in before.items():
        assert torch.equal(args[n], t), n
    for got in (out, again):  # Aqk: its diagonal blocks (the rest is F5's to write)
        got[5] = local_blocks(got[5], args["cu_seqlens"])
    for a, b in zip(out, again):
        assert torch.equal(a, b)
        assert all(a.data_ptr() != t.data_ptr() for t in before.values())


def test_without_the_l2norm_rows_pass_through():
    """Given normalized rows (no l2norm in the op), the kernel returns them as they are, no
    rstds, and the blocks and cumsum it forms from its own normalized rows with the l2norm."""
    args, _, _ = unit_inputs(SHAPES[0])
    full = diag_fwd.prep_diag(**args)
    qn, kn = full[0], full[2]
    got = diag_fwd.prep_diag(**dict(args, q=qn, k=kn, use_qk_l2norm_in_kernel=False))
    assert got[0] is qn and got[2] is kn and got[1] is None and got[3] is None
    cu = args["cu_seqlens"]
    assert torch.equal(got[4], full[4]) and torch.equal(got[6], full[6])
    assert torch.equal(local_blocks(got[5], cu), local_blocks(full[5], cu))


def test_supports():
    args, _, _ = unit_inputs(SHAPES[0])
    assert diag_fwd.supports(**args) is None
    assert "chunk_size" in diag_fwd.supports(**dict(args, chunk_size=32))
    assert "K=" in diag_fwd.supports(**dict(args, k=torch.empty(1, 1, 1, 512)))


def test_pairwise_switch_is_honoured():
    """The PAIRWISE build and the anchored one agree to fp32 rounding on a gate whose blocks
    all pass the guard, so the two paths are really two (tested: neither is the other)."""
    args, _, _ = unit_inputs(dataclasses.replace(SHAPES[0], dtype=torch.float32))
    anchored = diag_fwd.prep_diag(**args)
    pairwise = diag_fwd.prep_diag(**args, pairwise=True)
    assert not torch.equal(anchored[6], pairwise[6])
    assert ref.rel_rms(anchored[6], pairwise[6]) <= 1e-5


@pytest.mark.parametrize("design", diag_fwd.DESIGNS)
def test_the_unit_on_the_reference_s_blocks_is_the_reference_s_f3_f6(design):
    """The unit's F5 (the reference's, standing in for fla's on the CPU, or the module's
    own) and F6 after the F1-F4 kernel give what the reference's F3-F6 gives on the same
    rows; other diagonal blocks change Akk_inv (the F5 reads them)."""
    from kernel_fun.kda.chain import _ref_f5, _ref_intra

    p = SHAPES[3]
    args, _, _ = unit_inputs(p)
    v = torch.rand(1, p.T, p.HV, p.V, dtype=p.dtype)
    unit = dict(args, v=v, safe_gate=False, disable_recompute=True)
    got = diag_fwd.candidate("F1-F6", design)[0](**unit)
    qn, kn, gc = got[0], got[2], got[4]
    want = _ref_intra(qn, kn, v, gc, args["beta"], args["scale"], 64, args["cu_seqlens"], args["chunk_indices"],
                      False, True)
    for name, a, b in zip(("w", "u", "kg", "Aqk", "Akk", "qg"), got[5:], want):
        assert ref.rel_rms(a, b) <= 2e-3, name
    _, _, _, _, _, Aqk, Akkd = diag_fwd.prep_diag(**args)
    other = _ref_f5(qn, kn, gc, args["beta"], Aqk, Akkd * 2, args["scale"], 64, args["cu_seqlens"],
                    args["chunk_indices"])
    assert ref.rel_rms(other, want[4]) > 1e-2


@pytest.mark.parametrize("p", chain_problems() + [
    Problem("chain-pregated-no-l2norm-fp32", 1, 70, 2, 2, 64, 16, gate_in_kernel=False, l2norm_in_kernel=False,
            dtype=torch.float32),
    # fp16: in bf16 the reference chain itself is past the budgets here (dk 0.013)
    Problem("chain-lower-bound-gva-fp16", 1, 130, 1, 2, 64, 16, lower_bound=-5.0, beta_sigmoid_in_kernel=True,
            dtype=torch.float16),
], ids=lambda p: p.name)
@pytest.mark.parametrize("design", diag_fwd.DESIGNS)
def test_chain_with_the_unit_against_the_oracle(p, design, monkeypatch):
    """The kernel as the chain's F1-F6 unit (F5 and F6 the reference's on its blocks, as
    fla's are on the GPU): the record shows the unit in place of F1, F2 and F3-F6, and the
    forward and every gradient stay within fla's budgets of the float64 recurrence (the
    backward reads the q, k, rstds, Aqk and Akk_inv the unit gave)."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    register_for_test(monkeypatch, "F1-F6", *diag_fwd.candidate("F1-F6", design))
    kwargs = make_inputs(p, device=DEVICE, seed=17)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    forward = last_record().forward
    assert forward["F1-F6"] == "ours" and not {"F1", "F2", "F3-F6"} & set(forward), forward
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


@pytest.mark.parametrize("design,config", [("diag", None), ("diag-solve", {"SOLVE_BKS": 32, "SOLVE_STAGES": 2}),
                                           ("diag-solve-wy", None)])
def test_bench_entry_inputs_run_and_count_bytes(design, config):
    """The F1-F6 stage bench entry: the chain's own inputs, our unit (on the CPU the
    reference's F5, or the module's, and the reference's F6 after the kernel) against the
    float64 stages, and the bytes."""
    from kernel_fun.bench import stage_f1f6
    from kernel_fun.kda.parity import stage_errors
    from kernel_fun.kda.problems import problem

    p = Problem("entry", 1, 100, 2, 4, 64, 32)
    inputs = stage_f1f6.make_inputs(p, DEVICE, seed=1)
    assert inputs["use_qk_l2norm_in_kernel"] and inputs["use_gate_in_kernel"]
    bench = stage_f1f6.BENCH
    got = bench.ours(inputs, design, bench.launch_config(p, design, config))
    exact = bench.exact(**inputs)
    assert exact[0].dtype == torch.float64
    errors = stage_errors("F1-F6", got, exact)
    # the bf16 outputs against the float64 stages: their rounding, inside the budget
    assert set(errors) == {"q", "q_rstd", "k", "k_rstd", "gc", "w", "u", "kg", "Aqk", "Akk"}, errors
    assert all(e <= 5e-3 for e in errors.values()), errors
    assert abs(stage_f1f6.unit_bytes(problem("prod8192_gate")) / 1e9 - 7.54) < 0.01


def test_softplus_gate_without_dt_bias():
    args, f1_out, _ = unit_inputs(SHAPES[0])
    args = dict(args, dt_bias=None)
    gc = ref.gate_cumsum(args["g"], True, args["A_log"], None, None, 64, args["cu_seqlens"])
    check(args, f1_out, gc)


@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0", reason="figures recorded with Triton 3.6.0's ptxas")
@pytest.mark.parametrize("bks,warps", [(32, 4), (16, 8)])
def test_builds_compile_without_spills_or_n8_tf32_wgmma(bks, warps):
    """The default build and the leanest as ptxas assembles them for sm_90a, in a process
    without the interpreter: no N=8 tf32 wgmma (the H200 reads their unpadded shared operand
    out of bounds) and no spills (diag_fwd.DEFAULT_CONFIG's note)."""
    import json
    import os
    import subprocess
    import sys

    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "tools.compile_report", "--design", "diag", "--BV", str(bks), "--warps", str(warps),
           "--stages", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in row, row
    assert row["wgmma_32B_rows"] == 0 and row["spill_stores"] == 0, row


@pytest.mark.parametrize("p", SHAPES + [dataclasses.replace(SHAPES[3], name="varlen-K64-gva-fp32", dtype=torch.float32)],
                         ids=lambda p: p.name)
def test_inter_solve_matches_the_reference_f5(p):
    """The F5 kernel on the F1-F4 kernel's blocks against the reference's F5 on the same
    blocks: Aqk below the diagonal and Akk_inv (lower, zeros above) within the input dtype's
    rounding (fp32: 1e-5), the diagonal blocks of Aqk untouched."""
    args, _, _ = unit_inputs(p)
    qn, _, kn, _, gc, Aqk, Akkd = diag_fwd.prep_diag(**args)
    diag_before = local_blocks(Aqk, args["cu_seqlens"]).clone()
    cu = args["cu_seqlens"]
    want_aqk, want_inv = ref.intra_scores(qn, kn, gc, args["beta"], args["scale"], 64, cu, Aqk_diag=Aqk.clone(),
                                          Akk_diag=Akkd)
    inv = diag_fwd.inter_solve(qn, kn, gc, args["beta"], Aqk, Akkd, args["scale"], 64, cu, args["chunk_indices"])
    assert torch.equal(local_blocks(Aqk, cu), diag_before)
    tril = tril_mask(Aqk, 64, cu)
    assert torch.isfinite(torch.where(tril, Aqk, 0)).all() and torch.isfinite(inv).all()
    bound = 1e-5 if p.dtype == torch.float32 else 5e-3
    err = {"Aqk": ref.rel_rms(torch.where(tril, Aqk, 0).float(), torch.where(tril, want_aqk, 0).float()),
           "Akk_inv": ref.rel_rms(inv.float(), want_inv.float())}
    assert all(e <= bound for e in err.values()), err
    assert not torch.where(tril, 0, inv).any()  # zeros above the diagonal


@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0", reason="figures recorded with Triton 3.6.0's ptxas")
@pytest.mark.parametrize("bks", [16, 32])
@pytest.mark.parametrize("design", ["solve", "solve-wy"])
def test_f5_builds_compile_without_spills_or_n8_tf32_wgmma(bks, design):
    """The F5 kernel at its 4 warps, alone and with F6, both slices the sweep times, as ptxas
    assembles them for sm_90a: no wgmma whose operand rows are 32 bytes (N=8 tf32, which 8
    warps would make; N=16 bf16, which F6's K side made in 16-channel slices and
    compute-sanitizer caught reading shared memory out of bounds on the H200) and no spills."""
    import json
    import os
    import subprocess
    import sys

    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "tools.compile_report", "--design", design, "--BV", str(bks), "--warps", "4",
           "--stages", "1,2"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    rows = [json.loads(line) for line in out.stdout.strip().splitlines()[-2:]]
    for row in rows:
        assert "error" not in row, row
        assert row["wgmma"] > 0 and row["wgmma_32B_rows"] == 0 and row["spill_stores"] == 0, row


def test_inter_solve_reads_only_the_strictly_lower_diagonal_blocks():
    """fla's F4 leaves Akkd's entries on and above each row's diagonal unwritten: the F5
    kernel gives the same Akk_inv with NaN there."""
    args, _, _ = unit_inputs(SHAPES[3])
    qn, _, kn, _, gc, Aqk, Akkd = diag_fwd.prep_diag(**args)
    cu, ci = args["cu_seqlens"], args["chunk_indices"]
    clean = diag_fwd.inter_solve(qn, kn, gc, args["beta"], Aqk.clone(), Akkd, args["scale"], 64, cu, ci)
    r_in = ref.sequence_positions(Akkd.shape[1], cu, Akkd.device) % 16
    upper = (torch.arange(16)[None, :] >= r_in[:, None]).view(1, -1, 1, 16)
    dirty = diag_fwd.inter_solve(qn, kn, gc, args["beta"], Aqk.clone(), torch.where(upper, float("nan"), Akkd),
                                 args["scale"], 64, cu, ci)
    assert torch.equal(clean, dirty)


# --------------------------------------------------------------------------------------
# The backward's B1-B2 unit (recompute_kernel)
# --------------------------------------------------------------------------------------
def recompute_inputs(p: Problem, gate_scale: float = 1.0):
    """The B1-B2 unit's arguments as the stage bench forms them (the reference forward's F2
    and F3-F6 inputs, its Akk_inv; the raw gate scaled by ``gate_scale``) and the reference
    B1 and B2 on them: (kwargs, gc, (w, u, qg, kg))."""
    from kernel_fun.bench import stage_b1b2
    from kernel_fun.kda.chain import _ref_gate, _ref_wy, _recompute_in_turn

    args = stage_b1b2.make_inputs(p, DEVICE, seed=5)
    args["g"] = args["g"] * gate_scale
    gc, *wy = _recompute_in_turn(_ref_gate, _ref_wy)(**args)
    return args, gc, wy


RECOMPUTE_SHAPES = [p for p in SHAPES if p.gate_in_kernel]


@pytest.mark.parametrize("p", RECOMPUTE_SHAPES, ids=lambda p: p.name)
def test_recompute_matches_the_reference_b1_b2(p):
    """The B1-B2 kernel against the reference's B1 and B2 on the chain's backward inputs
    (K 64, 128 and 100, T not a multiple of 64, GVA, packed, fp16, the lower-bounded gate):
    the cumsum within fp32 rounding (1e-5), w, u, qg and kg within their dtype's rounding of
    the reference's (2e-3, the F1-F6 unit's bar); the cumsum bit for bit the F1-F4 kernel's
    on the same raw gate (the backward recomputes the forward's gc)."""
    args, gc_want, wy_want = recompute_inputs(p)
    gc, *wy = diag_fwd.recompute_b1_b2(**args)
    assert ref.rel_rms(gc, gc_want) <= 1e-5
    for name, a, b in zip(("w", "u", "qg", "kg"), wy, wy_want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all() and ref.rel_rms(a, b) <= 2e-3, (name, ref.rel_rms(a, b))
    q_raw = torch.randn_like(args["q"])
    fwd = diag_fwd.prep_diag(q_raw, q_raw, args["g"], args["beta"], args["A_log"], args["dt_bias"], args["lower_bound"],
                             True, True, 1.0, 64, args["cu_seqlens"], args["chunk_indices"])
    assert torch.equal(fwd[4], gc)


def test_recompute_under_a_very_strong_gate_stays_finite_and_exact():
    """A gate scaled 200x (cumsums far past 2^64 within a chunk): kg's factor exp2(g_last - g)
    <= 1 and w's exp2(g) as fla forms them, the same values as the reference's."""
    p = SHAPES[0]
    args, gc_want, wy_want = recompute_inputs(p, gate_scale=200.0)
    gc, *wy = diag_fwd.recompute_b1_b2(**args)
    assert gc.min() < -1000 and ref.rel_rms(gc, gc_want) <= 1e-5
    for name, a, b in zip(("w", "u", "qg", "kg"), wy, wy_want):
        assert torch.isfinite(a).all() and ref.rel_rms(a, b) <= 2e-3, name


def test_recompute_supports_and_refuses():
    args, _, _ = recompute_inputs(SHAPES[0])
    assert diag_fwd.supports_recompute(**args) is None
    assert "pre-computed" in diag_fwd.supports_recompute(**dict(args, use_gate_in_kernel=False))
    assert "chunk_size" in diag_fwd.supports_recompute(**dict(args, chunk_size=32))
    with pytest.raises(ValueError, match="use_gate_in_kernel"):
        diag_fwd.recompute_b1_b2(**dict(args, use_gate_in_kernel=False))
    with pytest.raises(ValueError, match="dense"):
        diag_fwd.recompute_b1_b2(**dict(args, v=args["v"].transpose(1, 2).contiguous().transpose(1, 2)))
    with pytest.raises(ValueError, match="B1-B2=recompute"):
        diag_fwd.candidate("B1-B2", "diag")


@pytest.mark.parametrize("p", [SHAPES[1], SHAPES[3], SHAPES[4],
                               Problem("T90-K64-h0-v-first", 1, 90, 2, 2, 64, 32, initial_state=True,
                                       state_v_first=True)], ids=lambda p: p.name)
def test_chain_with_the_recompute_unit_against_the_oracle(p, monkeypatch):
    """The kernel as the chain's B1-B2 unit: the record shows it in place of B1 and B2, and
    every output stays within fla's budgets of the float64 recurrence, or within 10% of the
    reference chain's own error in the input dtype (the stand-in for fla's on the CPU: in
    bf16 at the packed GVA shape its dk is at the budget, 0.0080)."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    register_for_test(monkeypatch, "B1-B2", *diag_fwd.candidate("B1-B2", "recompute"))
    kwargs = make_inputs(p, device=DEVICE, seed=19)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    backward = last_record().backward
    assert backward["B1-B2"] == "ours" and not {"B1", "B2"} & set(backward), backward
    with use_impls("reference"):
        base = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    theirs = {n: ref.rel_rms(base[n], oracle[n]) for n in errors}
    worse = {n: (e, theirs[n]) for n, e in errors.items() if not (e <= ref.BUDGETS[n] or e <= 1.1 * theirs[n])}
    assert not worse, worse


@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0", reason="figures recorded with Triton 3.6.0's ptxas")
def test_recompute_build_compiles_without_spills_or_32_byte_row_wgmma():
    """The B1-B2 kernel at its config (K=128, V=256) as ptxas assembles it for sm_90a: no
    spills, no wgmma with 32-byte operand rows (the hazard compute-sanitizer caught in the
    F5+F6 kernel), at most 192 registers (two programs an SM)."""
    import json
    import os
    import subprocess
    import sys

    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = diag_fwd.RECOMPUTE_CONFIG
    cmd = [sys.executable, "-m", "tools.compile_report", "--design", "recompute", "--BV", str(cfg["BKS"]),
           "--warps", str(cfg["num_warps"]), "--stages", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in row, row
    assert row["wgmma"] > 0 and row["wgmma_32B_rows"] == 0 and row["spill_stores"] == 0, row
    assert row["registers"] <= 192, row


def test_recompute_bench_entry_inputs_run_and_count_bytes():
    """The B1-B2 stage bench entry: the chain's own inputs, the kernel against the float64
    stages within the entry's bars (the reference's B1 and B2 standing in for fla's), and
    the bytes; a pre-computed gate refused (B1 does not run)."""
    from kernel_fun.bench import stage_b1b2
    from kernel_fun.kda.parity import stage_errors

    p = SHAPES[3]
    inputs = stage_b1b2.make_inputs(p, DEVICE, seed=1)
    got = stage_b1b2.BENCH.ours(inputs, "recompute", stage_b1b2.BENCH.launch_config(p, "recompute", None))
    exact = stage_b1b2.BENCH.exact(**inputs)
    _, gc_ref, wy_ref = recompute_inputs(p)
    theirs = stage_errors("B1-B2", (gc_ref, *wy_ref), exact)
    mine = stage_errors("B1-B2", got, exact)
    assert set(mine) == {"gc", "w", "u", "qg", "kg"}
    assert not stage_b1b2.BENCH.misses(mine, theirs, None), (mine, theirs)
    tok, tok_qk = p.B * p.T * p.HV, p.B * p.T * p.H  # GVA: q and k at their own heads
    reads = tok * p.K * 2 + tok_qk * p.K * 4 + tok * p.V * 2 + tok * 2 + tok * 64 * 2  # g, q, k, v, beta, Akk_inv
    writes = tok * p.K * 4 + tok * p.K * 6 + tok * p.V * 2  # gc; w, qg, kg; u
    assert stage_b1b2.BENCH.bytes(p) == reads + writes
    with pytest.raises(ValueError, match="pre-computed"):
        stage_b1b2.make_inputs(SHAPES[5], DEVICE)
