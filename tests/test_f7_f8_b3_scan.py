"""The scan (kda/kernels/f7_f8_b3_scan.py) through the interpreter against the stage
references, on the inputs the chain gives them: as the F7-F8 unit (the state scan with its
output, reading F6's qg) and as B3 (the states alone, forming u from v, beta and Akk_inv).
T not a multiple of 64, GVA, packed sequences (a 1-token one among them), initial and final
states, K 48 / 64 / 100 / 128 (the transposed kernel) and 160 (the [K, V] one), V of one and
two slices and of no power of two, fp16 and bf16."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, INTERPRETING, needs_triton
from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda import reference as ref
from kernel_fun.kda.kernels import f7_f8_b3_scan as scan
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
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
    # past K=128: the [K, V] kernel
    Problem("T70-K160-h0-fp16", 1, 70, 1, 1, 160, 16, initial_state=True, output_final_state=True,
            dtype=torch.float16),
]


def stage_runs(p: Problem, seed: int = 8) -> dict:
    """(inputs, outputs) of F3-F6, F7, F8 and B3 as the reference chain runs them."""
    kw = make_inputs(p, device=DEVICE, seed=seed)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    return {name: (x, out) for name, _, x, out in log if name in ("F3-F6", "F7", "F8", "B3")}


def unit_inputs(runs: dict) -> dict:
    """The F7-F8 unit's inputs from the reference stages' (qg = q exp2(g) rounded to q's dtype,
    as F6 writes it when asked)."""
    f7, f8 = runs["F7"][0], runs["F8"][0]
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    return dict(q=q, qg=qg, Aqk=f8["Aqk"], scale=f8["scale"], save_states=True,
                **{n: f7[n] for n in ("kg", "w", "u", "gc", "initial_state", "output_final_state", "cu_seqlens_cpu",
                                      "state_v_first", "chunk_size", "cu_seqlens", "chunk_indices")})


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_scan_output_matches_f7_then_f8(p):
    """o, h, v_new and the final state of the unit against the reference F7 then F8, at the
    V slice the launcher picks and at half of it (two slices where V allows). The same
    roundings at the same points: under the interpreter the transposed kernel's dots sum in
    the references' order and o, h, v_new come out bitwise (the final state within 4e-8);
    the [K, V] kernel's state is K padded to a power of two, which reassociates its dots'
    fp32 sums, and so does the GPU's blocking: that can move a rounding of o by one ulp in
    places (K=160 in fp16 under the interpreter: one element of 1,120, 1.3e-5 relative)."""
    runs = stage_runs(p)
    (h, v_new, ht), o = runs["F7"][1], runs["F8"][1]
    inputs = unit_inputs(runs)
    picked = scan.launch_config(1, p.V, p.K)["BV"]
    for config in (None, {"BV": max(16, picked // 2)}):
        got_o, got_ht, got_h, got_vn = scan.scan_output(**inputs, config=config)
        assert got_o.dtype == o.dtype and got_o.shape == o.shape
        errors = {"o": ref.rel_rms(got_o, o), "h": ref.rel_rms(got_h, h), "v_new": ref.rel_rms(got_vn, v_new)}
        if ht is not None:
            errors["ht"] = ref.rel_rms(got_ht, ht)
        else:
            assert got_ht is None
        bound = (1e-6 if p.K <= 128 else 1e-4) if INTERPRETING else 2e-3
        assert all(e <= bound for e in errors.values()), (config, errors)


def test_the_kernel_reads_qg_and_the_initial_state():
    """A qg or an initial state that differs shows: the kernel read them (not q and g)."""
    inputs = unit_inputs(stage_runs(SHAPES[1]))
    base = scan.scan_output(**inputs)[0]
    assert ref.rel_rms(scan.scan_output(**dict(inputs, qg=inputs["qg"] * 2))[0], base) > 0.05
    assert ref.rel_rms(scan.scan_output(**dict(inputs, initial_state=inputs["initial_state"] * 2))[0], base) > 1e-3
    with pytest.raises(ValueError, match="qg"):
        scan.scan_output(**dict(inputs, qg=None))


def test_without_saving_states_o_is_the_same():
    inputs = unit_inputs(stage_runs(SHAPES[0]))
    saved = scan.scan_output(**inputs)
    plain = scan.scan_output(**dict(inputs, save_states=False))
    assert plain[2] is None and plain[3] is None
    assert torch.equal(saved[0], plain[0]) and torch.equal(saved[1], plain[1])


@pytest.mark.parametrize("p", SHAPES[:6], ids=lambda p: p.name)
def test_scan_states_match_b3(p):
    """The backward's B3 (F7 recomputed: h and v_new) by the transposed kernel without o,
    forming u from v, beta and Akk_inv, on the inputs the reference chain gives B3 (whose
    reference reads the reference B2's u), at the launcher's V slice, at 16 and, past V=32, at
    64. Under the interpreter the two agree to fp32 rounding but where an entry of u lands on a
    bf16 rounding edge: the kernel's dot and the reference's matmul sum in their BLAS's order,
    which depends on the CPU, and such an entry rounds a unit apart (seen on an AVX2 machine:
    v_new 6.7e-6). The
    bound, 2e-4, leaves such units room and stays 50x under what a wrong beta or Akk_inv
    does (v_new moves by over 1e-2)."""
    inputs, (h, v_new, _) = stage_runs(p)["B3"]
    bound = 2e-4 if INTERPRETING else 2e-3
    for config in (None, {"BV": 16}) + (({"BV": 64},) if p.V > 32 else ()):
        got_h, got_vn, got_ht = scan.scan_states(**inputs, config=config)
        assert got_ht is None and got_h.dtype == h.dtype and got_h.shape == h.shape
        errors = {"h": ref.rel_rms(got_h, h), "v_new": ref.rel_rms(got_vn, v_new)}
        assert all(e <= bound for e in errors.values()), (config, errors)
    # the kernel forms u from beta and Akk_inv (a u given is not read): a wrong one shows
    base = scan.scan_states(**inputs)[1]
    assert torch.equal(scan.scan_states(**dict(inputs, u=None))[1], base)
    for wrong in (dict(beta=(inputs["beta"] * 2).contiguous()), dict(Akk=(inputs["Akk"] * 0.5).contiguous())):
        assert ref.rel_rms(scan.scan_states(**dict(inputs, **wrong))[1], base) > 1e-2
    with pytest.raises(ValueError, match="v, beta and Akk_inv"):
        scan.scan_states(**dict(inputs, beta=None))


def test_supports_and_registration():
    """The scan is the chain's F7-F8 unit (reading F6's qg) and its B3 (forming u); F7 and
    F8 alone stay fla's. F7-F8 takes K up to 256, B3 up to 128."""
    q = torch.empty(1, 64, 1, 64)
    wide = torch.empty(1, 64, 1, 192)
    assert scan.supports(q=q, chunk_size=64) is None
    assert "chunk_size" in scan.supports(q=q, chunk_size=32)
    assert "[K, V]" in scan.supports(q=q, chunk_size=64, state_v_first=True)
    assert scan.supports(q=wide, chunk_size=64) is None
    assert "> 256" in scan.supports(q=torch.empty(1, 64, 1, 264), chunk_size=64)
    assert scan.supports_states(kg=q, chunk_size=64, state_v_first=False) is None
    assert "> 128" in scan.supports_states(kg=wide, chunk_size=64, state_v_first=False)
    assert stages()["F7-F8"].impls["ours"] is scan.scan_output
    assert stages()["B3"].impls["ours"] is scan.scan_states
    assert stages()["F7-F8"].caps["ours"] == {"reads_qg"} and stages()["B3"].caps["ours"] == {"forms_u"}
    assert not {"F7", "F8"} & {name for name, s in stages().items() if "ours" in s.impls}
    with pytest.raises(ValueError, match="vk"):  # a retired knob is an error, not ignored
        scan.scan_output(**unit_inputs(stage_runs(SHAPES[0])), config={"vk": True})


def test_launch_picks_the_v_slice_by_grid():
    """The transposed kernel: 256 chains of V=256 (prod8192_gate) take BV=64 at two programs an
    SM, one chain BV=32; never wider than V needs. Past K=128 the [K, V] kernel's table."""
    assert scan.launch_config(256, 256, 128) == dict(BV=64, num_warps=4, num_stages=2)
    assert scan.launch_config(1, 256, 128)["BV"] == 32
    assert scan.launch_config(1, 16, 128)["BV"] == 32
    assert scan.launch_config(256, 256, 192) == dict(BV=64, num_warps=4, num_stages=1)
    assert scan.launch_config(1, 256, 192)["BV"] == 32


def test_b3_picks_the_v_slice_by_grid():
    """B3 by the same rule from its own table: 256 chains of V=256 (prod8192_gate) and b8's 128
    take BV=64 at two programs an SM; 32 chains (fla's layer at B2 T8192: V=128; small: V=256)
    and 16 (grid1024) BV=32, as measured on the H200 (0.384 ms against BV=64's 0.449 at
    layer2x8192); never wider than V needs."""
    assert scan.states_config(256, 256) == dict(BV=64, num_warps=4, num_stages=2)
    assert scan.states_config(128, 256)["BV"] == 64
    for chains, V in ((32, 128), (32, 256), (16, 256), (1, 256), (1, 16)):
        assert scan.states_config(chains, V) == dict(BV=32, num_warps=4, num_stages=2), (chains, V)
    # more chains never take a narrower slice (the fewest waves favour the wider one)
    picked = [scan.states_config(n, 256)["BV"] for n in (1, 16, 32, 64, 128, 256, 1024, 4096)]
    assert picked == sorted(picked), picked


@pytest.mark.parametrize("p", [SHAPES[1], SHAPES[3], SHAPES[6],
                               Problem("layer-vfirst", 1, 100, 2, 2, 64, 32, initial_state=True,
                                       output_final_state=True, state_v_first=True)], ids=lambda p: p.name)
def test_chain_with_the_scan_against_the_oracle(p):
    """The chain runs the unit in place of F7 and F8 and, where K <= 128, B3 forming u (B2
    writing none); the forward and every gradient stay within fla's budgets of the float64
    recurrence; a [V, K] caller's states reach the kernels in [K, V] (the chain transposes
    them)."""
    kwargs = make_inputs(p, device=DEVICE, seed=12)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.forward["F7-F8"] == "ours" and not {"F7", "F8"} & set(record.forward), record.forward
    assert record.backward["B3"] == ("ours" if p.K <= 128 else "reference"), record.backward
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


def test_the_unit_saves_states_where_the_chain_keeps_them():
    """disable_recompute keeps h and v_new for the backward: the unit writes them (its
    save_states), and every output and gradient is the two stages' (bitwise under the
    interpreter but for the final state's last bits), with the backward skipping B1-B3."""
    p = SHAPES[0]
    kwargs = dict(make_inputs(p, device=DEVICE, seed=13), disable_recompute=True)
    with use_impls({"F7-F8": "reference"}):  # F7 and F8 one by one, every other stage the same
        want = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert {"F7", "F8"} <= set(last_record().forward)
    got = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.forward["F7-F8"] == "ours" and "B3" not in record.backward, record
    errors = {n: ref.rel_rms(got[n], want[n]) for n in want if want[n] is not None}
    # (the final state's fp32 update sums in another order than the reference's: 4e-8)
    bars = {n: (1e-7 if n == "final_state" else 0.0) if INTERPRETING else 2e-3 for n in errors}
    assert all(errors[n] <= bars[n] for n in errors), {n: e for n, e in errors.items() if e}
