"""F7 + F8 in one kernel (kda/kernels/scan_fwd.py) through the interpreter against the stage
references, on the inputs the chain gives them: T not a multiple of 64, GVA, packed
sequences (a 1-token one among them), initial state, K 64 / 100 / 128, V of one and two
slices, fp16 and bf16."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, INTERPRETING, needs_triton
from kernel_fun.kda import chunk_kda
from kernel_fun.kda import reference as ref
from kernel_fun.kda.kernels import scan_fwd
from kernel_fun.kda.problems import Problem, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, stages, use_impls

pytestmark = needs_triton

SHAPES = [
    Problem("T63-K64-h0", 2, 63, 2, 2, 64, 32, initial_state=True, output_final_state=True),
    Problem("T130-K128-gva-V128", 1, 130, 1, 2, 128, 128, initial_state=True, output_final_state=True),
    Problem("T70-K100-fp16", 1, 70, 2, 2, 100, 16, dtype=torch.float16, output_final_state=True),
    Problem("varlen-K64-h0", 1, 150, 2, 2, 64, 32, initial_state=True, output_final_state=True,
            cu_seqlens=(0, 1, 65, 150)),
    Problem("T64-pregated-no-final", 2, 64, 2, 2, 64, 32, gate_in_kernel=False),
    # K and V of no power of two (the unit runs for any V the chain takes), GVA, h0
    Problem("T100-K48-V40-gva-h0", 1, 100, 1, 2, 48, 40, initial_state=True, output_final_state=True),
]


def f7_f8_inputs(p: Problem) -> tuple[dict, dict, tuple, torch.Tensor]:
    """F7's and F8's inputs and outputs as the reference chain makes them."""
    kw = make_inputs(p, device=DEVICE, seed=8)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (f7_in, f7_out), = [(x, out) for name, _, x, out in log if name == "F7"]
    (f8_in, f8_out), = [(x, out) for name, _, x, out in log if name == "F8"]
    return f7_in, f8_in, f7_out, f8_out


def run_ours(f7: dict, f8: dict, save_states: bool):
    return scan_fwd.scan_fwd(
        q=f8["q"], kg=f7["kg"], w=f7["w"], u=f7["u"], gc=f7["gc"], Aqk=f8["Aqk"], scale=f8["scale"],
        initial_state=f7["initial_state"], output_final_state=f7["output_final_state"],
        chunk_size=f7["chunk_size"], cu_seqlens=f7["cu_seqlens"], save_states=save_states)


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_scan_with_output_matches_f7_then_f8(p):
    f7, f8, (h, v_new, ht), o = f7_f8_inputs(p)
    assert not f7["state_v_first"]
    got_o, got_ht, got_h, got_vn = run_ours(f7, f8, save_states=True)
    assert got_o.dtype == o.dtype and got_o.shape == o.shape
    errors = {"o": ref.rel_rms(got_o, o), "h": ref.rel_rms(got_h, h), "v_new": ref.rel_rms(got_vn, v_new)}
    if ht is not None:
        errors["ht"] = ref.rel_rms(got_ht, ht)
    else:
        assert got_ht is None
    # The same roundings at the same points. Under the interpreter the dots sum in the
    # references' order and o, h, v_new come out bitwise (ht within 4e-8); compiled, the
    # dots' blocking reassociates fp32 sums, which can move a bf16 rounding by one ulp.
    bound = 1e-6 if INTERPRETING else 2e-3
    assert all(e <= bound for e in errors.values()), errors
    assert errors.get("ht", 0.0) <= (1e-6 if INTERPRETING else 1e-4), errors


@pytest.mark.parametrize("p", [SHAPES[0], SHAPES[2], SHAPES[3], SHAPES[5]], ids=lambda p: p.name)
@pytest.mark.parametrize("design", ["scan-hoist", "scan-pf", "scan-hoist-pf"])
def test_load_schedules_compute_the_same(p, design):
    """The designs that only move loads (every load of a chunk before the step's first dot;
    the next chunk's rows asked of L2) give the plain scan's o, states and final state bit
    for bit, reading qg or forming it, and as B3 without o (T not a multiple of 64, packed
    ragged sequences, GVA with h0, fp16, K and V of no power of two)."""
    f7, f8, _, _ = f7_f8_inputs(p)
    flags = scan_fwd.DESIGNS[design]
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    common = dict(q=q, kg=f7["kg"], w=f7["w"], u=f7["u"], gc=gc, Aqk=f8["Aqk"], scale=f8["scale"],
                  initial_state=f7["initial_state"], output_final_state=f7["output_final_state"],
                  chunk_size=f7["chunk_size"], cu_seqlens=f7["cu_seqlens"], save_states=True, BV=32, num_warps=4,
                  num_stages=1)
    for reads in (qg, None):
        plain = scan_fwd.scan_fwd(**common, qg=reads)
        moved = scan_fwd.scan_fwd(**common, qg=reads, **flags)
        for a, b in zip(plain, moved):
            assert (a is None and b is None) or torch.equal(a, b)
    b3 = {n: f7[n] for n in ("kg", "w", "u", "gc", "initial_state", "output_final_state", "chunk_size", "cu_seqlens",
                             "cu_seqlens_cpu", "chunk_indices", "state_v_first")}
    for a, b in zip(scan_fwd.scan_states(**b3), scan_fwd.scan_states(**b3, **flags)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_transposed_state_computes_the_same(p):
    """The kernel holding the state transposed (S^T: the V slice on every dot's M side)
    against the plain scan: o, h, v_new and the final state reading qg or forming it, and
    as B3 without o, at one and two V slices (T not a multiple of 64, packed ragged
    sequences, GVA with h0, fp16, K and V of no power of two). Under the interpreter the
    transposed products sum in the same order: the same to fp32 rounding."""
    f7, f8, _, _ = f7_f8_inputs(p)
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    common = dict(q=q, kg=f7["kg"], w=f7["w"], u=f7["u"], gc=gc, Aqk=f8["Aqk"], scale=f8["scale"],
                  initial_state=f7["initial_state"], output_final_state=f7["output_final_state"],
                  chunk_size=f7["chunk_size"], cu_seqlens=f7["cu_seqlens"], save_states=True, num_warps=4,
                  num_stages=1)
    bound = 1e-6 if INTERPRETING else 2e-3
    for reads in (qg, None):
        plain = scan_fwd.scan_fwd(**common, qg=reads, BV=32)
        for bv in (16, 32):
            vk = scan_fwd.scan_fwd(**common, qg=reads, BV=bv, vk=True)
            for name, a, b in zip(("o", "ht", "h", "v_new"), plain, vk):
                assert (a is None) == (b is None), name
                if a is not None:
                    assert a.dtype == b.dtype and a.shape == b.shape, name
                    assert ref.rel_rms(b, a) <= bound, (name, bv, ref.rel_rms(b, a))
    b3 = {n: f7[n] for n in ("kg", "w", "u", "gc", "initial_state", "output_final_state", "chunk_size", "cu_seqlens",
                             "cu_seqlens_cpu", "chunk_indices", "state_v_first")}
    for name, a, b in zip(("h", "v_new", "ht"), scan_fwd.scan_states(**b3), scan_fwd.scan_states(**b3, vk=True)):
        assert (a is None) == (b is None), name
        if a is not None:
            assert ref.rel_rms(b, a) <= bound, (name, ref.rel_rms(b, a))
    # a wrong state in shows: the kernel read h0
    if f7["initial_state"] is not None:
        moved = scan_fwd.scan_fwd(**{**common, "initial_state": f7["initial_state"] * 2}, qg=qg, BV=32, vk=True)
        assert ref.rel_rms(moved[0], plain[0]) > 1e-3


def test_without_saving_states_o_is_the_same():
    f7, f8, _, _ = f7_f8_inputs(SHAPES[0])
    saved = run_ours(f7, f8, save_states=True)
    plain = run_ours(f7, f8, save_states=False)
    assert plain[2] is None and plain[3] is None
    assert torch.equal(saved[0], plain[0]) and torch.equal(saved[1], plain[1])


def test_supports():
    f7, f8, _, _ = f7_f8_inputs(SHAPES[0])
    assert scan_fwd.supports(q=f8["q"], chunk_size=64) is None
    assert "chunk_size" in scan_fwd.supports(q=f8["q"], chunk_size=32)
    assert "[K, V]" in scan_fwd.supports(q=f8["q"], chunk_size=64, state_v_first=True)
    wide = torch.empty(1, 64, 1, 192)
    assert scan_fwd.supports(q=wide, chunk_size=64) is None  # the pinned unit: the other kernel past K=128
    assert "> 128" in scan_fwd.candidate("F7-F8", "scan-vk")[1](q=wide, chunk_size=64)
    assert "> 128" in scan_fwd.candidate("B3", "scan-vk")[1](kg=wide, chunk_size=64)


def test_registered_as_the_f7_f8_unit_and_b3():
    """The scan is the chain's F7-F8 unit and its B3; F7 and F8 alone stay fla's."""
    assert stages()["F7-F8"].impls["ours"] is scan_fwd.scan_output
    assert stages()["B3"].impls["ours"] is scan_fwd.scan_states
    assert scan_fwd.scan_states.forms_u and scan_fwd.scan_output.reads_qg
    assert not getattr(scan_fwd.scan_output, "forms_u", False)  # F7-F8 reads F6's u (measured faster)
    assert not {"F7", "F8"} & {name for name, s in stages().items() if "ours" in s.impls}


def u_sources(p: Problem, seed: int = 8) -> dict:
    """v, beta and Akk_inv as the reference chain gives F3-F6 and takes from it (F6's u is
    Akk_inv bf16(beta v)), for the same call as ``f7_f8_inputs``."""
    kw = make_inputs(p, device=DEVICE, seed=seed)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (x, out), = [(x, out) for name, _, x, out in log if name == "F3-F6"]
    return dict(v=x["v"], beta=x["beta"], Akk=out[4])


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_scan_forming_u_computes_the_same(p):
    """The transposed-state kernel forming u from v, beta and Akk_inv (F6 / B2 writing none)
    against the same kernel reading the reference F6's u: o, h, v_new and the final state,
    reading qg, and as B3 without o, at one and two V slices (T not a multiple of 64, packed ragged sequences,
    GVA with h0, fp16, K and V of no power of two). Under the interpreter the two agree to
    fp32 rounding but where an entry of u lands on a bf16 rounding edge: the kernel's dot and
    the reference's matmul sum in their BLAS's order, which depends on the CPU, and such an
    entry rounds a unit apart (seen on an AVX2 machine at varlen-K64-h0, BV=16: o 4.4e-5,
    v_new 6.7e-6, bitwise elsewhere). The bound, 2e-4, leaves such units room (4x the worst
    seen) and stays 50x under what a wrong beta or Akk_inv does (v_new moves by over 1e-2)."""
    f7, f8, _, _ = f7_f8_inputs(p)
    src = u_sources(p)
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    common = dict(q=q, qg=qg, kg=f7["kg"], w=f7["w"], gc=gc, Aqk=f8["Aqk"], scale=f8["scale"],
                  initial_state=f7["initial_state"], output_final_state=f7["output_final_state"],
                  chunk_size=f7["chunk_size"], cu_seqlens=f7["cu_seqlens"], save_states=True, num_warps=4,
                  num_stages=1)
    bound = 2e-4 if INTERPRETING else 2e-3
    for bv in (16, 32):
        reading = scan_fwd.scan_fwd(**common, u=f7["u"], BV=bv, vk=True)
        forming = scan_fwd.scan_fwd(**common, u=None, **src, BV=bv, vk=True)
        for name, a, b in zip(("o", "ht", "h", "v_new"), reading, forming):
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert ref.rel_rms(b, a) <= bound, (name, bv, ref.rel_rms(b, a))
    b3 = {n: f7[n] for n in ("kg", "w", "gc", "initial_state", "output_final_state", "chunk_size", "cu_seqlens",
                             "cu_seqlens_cpu", "chunk_indices", "state_v_first")}
    reading = scan_fwd.scan_states(**b3, u=f7["u"], vk=True)
    forming = scan_fwd.scan_states(**b3, u=None, **src)  # (its pin: the transposed kernel)
    for name, a, b in zip(("h", "v_new", "ht"), reading, forming):
        assert (a is None) == (b is None), name
        if a is not None:
            assert ref.rel_rms(b, a) <= bound, (name, ref.rel_rms(b, a))
    # the kernel reads beta and Akk_inv: a wrong one shows
    base = scan_fwd.scan_fwd(**common, u=f7["u"], BV=32, vk=True)[3]
    for wrong in (dict(src, beta=(src["beta"] * 2).contiguous()), dict(src, Akk=(src["Akk"] * 0.5).contiguous())):
        moved = scan_fwd.scan_fwd(**common, u=None, **wrong, BV=32, vk=True)
        assert ref.rel_rms(moved[3], base) > 1e-2
    with pytest.raises(ValueError, match="v, beta and Akk_inv"):
        scan_fwd.scan_fwd(**common, u=None, v=src["v"], BV=32, vk=True)
    with pytest.raises(ValueError, match="only the transposed-state scan"):
        scan_fwd.scan_fwd(**common, u=None, **src, BV=32)


@pytest.mark.parametrize("p", [SHAPES[1], SHAPES[3], SHAPES[5],
                               Problem("layer-vfirst", 1, 100, 2, 2, 64, 32, initial_state=True,
                                       output_final_state=True, state_v_first=True)], ids=lambda p: p.name)
def test_chain_with_the_unit_against_the_oracle(p, monkeypatch):
    """With the scan registered as the chain's F7-F8 unit, the record shows the unit in place
    of F7 and F8, and the forward and every gradient stay within fla's budgets of the
    float64 recurrence (the backward's stages read what the unit saved and recompute the
    rest); a [V, K] caller's states reach it in [K, V] (the chain transposes them)."""
    from conftest import register_for_test
    from kernel_fun.kda import last_record
    from kernel_fun.kda.problems import as_oracle_inputs

    register_for_test(monkeypatch, "F7-F8", scan_fwd.scan_output, scan_fwd.supports)
    kwargs = make_inputs(p, device=DEVICE, seed=12)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    forward = last_record().forward
    assert forward["F7-F8"] == "ours" and not {"F7", "F8"} & set(forward), forward
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


def test_the_unit_saves_states_where_the_chain_keeps_them(monkeypatch):
    """disable_recompute keeps h and v_new for the backward: the unit writes them (its
    save_states), and every output and gradient is the two stages' (bitwise under the
    interpreter but for the final state's last bits), with the backward skipping B1-B3."""
    from conftest import register_for_test
    from kernel_fun.kda import last_record

    p = SHAPES[0]
    kwargs = dict(make_inputs(p, device=DEVICE, seed=13), disable_recompute=True)
    with use_impls({"F7-F8": "reference"}):  # F7 and F8 one by one, every other stage the same
        want = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert {"F7", "F8"} <= set(last_record().forward)
    register_for_test(monkeypatch, "F7-F8", scan_fwd.scan_output, scan_fwd.supports)
    got = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.forward["F7-F8"] == "ours" and "B3" not in record.backward, record
    errors = {n: ref.rel_rms(got[n], want[n]) for n in want if want[n] is not None}
    # (the final state's fp32 update sums in another order than the reference's: 4e-8)
    bars = {n: (1e-7 if n == "final_state" else 0.0) if INTERPRETING else 2e-3 for n in errors}
    assert all(errors[n] <= bars[n] for n in errors), {n: e for n, e in errors.items() if e}


def test_bench_entry_inputs_run_and_count_bytes():
    from kernel_fun.bench import stage_f7f8
    from kernel_fun.kda.parity import stage_errors
    from kernel_fun.kda.problems import problem

    p = Problem("entry", 1, 100, 2, 4, 64, 32, initial_state=True, output_final_state=True)
    inputs = stage_f7f8.make_inputs(p, DEVICE, seed=1)
    bench = stage_f7f8.BENCH
    exact = bench.exact(**inputs)
    assert bench.designs == ("scan-vk",) and inputs["qg"].shape == inputs["kg"].shape
    for design in list(scan_fwd.DESIGNS) + ["scan-vk-u"]:
        got = bench.ours(inputs, design, bench.launch_config(p, design, None))
        errors = stage_errors("F7-F8", got, exact)
        assert set(errors) == {"o", "final_state"} and all(e <= 5e-3 for e in errors.values()), (design, errors)
        # the bf16 stage against its float64 self: the roundings' error, well inside the budget
        assert all(e > 0 for e in errors.values()), errors
    assert abs(stage_f7f8.scan_bytes(problem("prod8192_gate")) / 1e9 - 5.1) < 0.05  # q, kg, w, u, gc, Aqk, o once


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_scan_states_match_b3(p):
    """The backward's B3 (F7 recomputed: h and v_new) by the same kernel without o, on the
    inputs the reference chain gives B3: the reference's h and v_new to fp32 rounding under
    the interpreter (the state's sums in the order of the CPU build of torch's matmul: bit
    for bit with some builds, a last bit apart in places with others)."""
    kw = make_inputs(p, device=DEVICE, seed=20)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (inputs, (h, v_new, _)), = [(x, out) for name, _, x, out in log if name == "B3"]
    got_h, got_vn, got_ht = scan_fwd.scan_states(**inputs)
    assert got_ht is None and got_h.dtype == h.dtype and got_h.shape == h.shape
    bound = 1e-5 if INTERPRETING else 2e-3
    errors = {"h": ref.rel_rms(got_h, h), "v_new": ref.rel_rms(got_vn, v_new)}
    assert all(e <= bound for e in errors.values()), errors


def test_b3_bench_entry_inputs_run_and_count_bytes():
    from kernel_fun.bench import stage_b3
    from kernel_fun.kda.parity import stage_errors
    from kernel_fun.kda.problems import problem

    p = Problem("entry", 1, 100, 2, 4, 64, 32, initial_state=True, output_final_state=True)
    inputs = stage_b3.make_inputs(p, DEVICE, seed=2)
    bench = stage_b3.BENCH
    for design in ("scan", "scan-vk", "scan-vk-u"):
        got = bench.ours(inputs, design, bench.launch_config(p, design, None))
        errors = stage_errors("B3", got, bench.exact(**inputs))
        assert set(errors) == {"h", "v_new", "final_state"} and all(0 < e <= 5e-3 for e in errors.values()), \
            (design, errors)
    assert abs(stage_b3.b3_bytes(problem("prod8192_gate")) / 1e9 - 6.4) < 0.05


def test_launch_picks_the_v_slice_by_grid():
    """The measured ends: 256 chains of V=256 (prod8192_gate) take BV=128, one chain BV=32."""
    assert scan_fwd.launch_config(256, 256, 132)["BV"] == 128
    assert scan_fwd.launch_config(1, 256, 132)["BV"] == 32
    assert scan_fwd.launch_config(1, 16, 132)["BV"] == 32  # never wider than V needs
    # the transposed kernel: BV=64 at two programs an SM for 256 chains, BV=32 for one
    assert scan_fwd.launch_config(256, 256, 132, reads_qg=True, vk=True) == dict(BV=64, num_warps=4, num_stages=2)
    assert scan_fwd.launch_config(1, 256, 132, reads_qg=True, vk=True)["BV"] == 32
    # forming u (one program an SM at BV=64 and 128): BV=128 for 256 chains, BV=32 for one
    assert scan_fwd.launch_config(256, 256, 132, reads_qg=True, vk=True, forms_u=True) == \
        dict(BV=128, num_warps=8, num_stages=2)
    assert scan_fwd.launch_config(1, 256, 132, reads_qg=True, vk=True, forms_u=True)["BV"] == 32


@pytest.mark.parametrize("p", [SHAPES[1], SHAPES[3]], ids=lambda p: p.name)
def test_scan_reading_qg_matches_the_scan_forming_it(p):
    """With ``qg`` (q exp2(g) rounded to q's dtype, as F6 writes it when asked) the scan reads
    it instead of q and g; o is the same up to the one-ulp differences of torch's exp2 and
    the kernel's in qg's rounding (GVA and packed sequences: qg at value heads)."""
    f7, f8, _, _ = f7_f8_inputs(p)
    q, gc = f8["q"], f7["gc"]
    qv = q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2)
    qg = (qv.float() * torch.exp2(gc)).to(q.dtype)
    plain = run_ours(f7, f8, save_states=False)
    read = scan_fwd.scan_fwd(
        q=q, kg=f7["kg"], w=f7["w"], u=f7["u"], gc=gc, Aqk=f8["Aqk"], scale=f8["scale"],
        initial_state=f7["initial_state"], output_final_state=f7["output_final_state"],
        chunk_size=f7["chunk_size"], cu_seqlens=f7["cu_seqlens"], qg=qg)
    assert ref.rel_rms(read[0], plain[0]) <= 2e-3
    assert ref.rel_rms(read[1], plain[1]) <= 1e-6
    # a qg that differs shows: the kernel read it
    wrong = scan_fwd.scan_fwd(
        q=q, kg=f7["kg"], w=f7["w"], u=f7["u"], gc=gc, Aqk=f8["Aqk"], scale=f8["scale"],
        initial_state=f7["initial_state"], output_final_state=False,
        chunk_size=f7["chunk_size"], cu_seqlens=f7["cu_seqlens"], qg=qg * 2)
    assert ref.rel_rms(wrong[0], plain[0]) > 0.05
