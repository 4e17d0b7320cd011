"""B2 (kda/kernels/b2_wy_recompute.py: w, qg, kg from Akk_inv, no u) through the interpreter
against the reference's WY stage on the inputs the chain gives it, and the chain with it as
B2 (no u: kernel-fun's B3 forms it): T not a multiple of 64, GVA, packed sequences, K 48 / 64
/ 100 / 128, fp16, fp32, the lower-bounded gate."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, INTERPRETING, needs_triton
from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda import reference as ref
from kernel_fun.kda.kernels import b2_wy_recompute as wy
from kernel_fun.kda.kernels import f7_f8_b3_scan as scan
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, stages, use_impls
from test_f7_f8_b3_scan import SHAPES as SCAN_SHAPES

pytestmark = needs_triton

# the scan's awkward shapes (T not a multiple of 64, GVA with h0, fp16 at K=100, packed ragged
# sequences), a lower-bounded gate at K and V of no power of two, and fp32 (the dots in three
# tf32 products)
SHAPES = SCAN_SHAPES[:4] + [Problem("T100-K48-V40-gva-lower-bound", 1, 100, 1, 2, 48, 40, lower_bound=-5.0),
                            Problem("T70-K64-fp32", 1, 70, 2, 2, 64, 32, dtype=torch.float32)]


def b2_inputs(p: Problem, seed: int = 3) -> tuple[dict, tuple]:
    """B2's inputs and outputs as the reference chain makes them (q given: qg wanted)."""
    kw = make_inputs(p, device=DEVICE, seed=seed)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    (x, out), = [(x, out) for name, _, x, out in log if name == "B2"]
    return x, out


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_wy_vectors_match_the_reference(p):
    """w, qg and kg as the reference's B2 (the same roundings at the same points: bitwise
    under the interpreter but for a bf16 value a unit apart where the fp32 sums land on a
    rounding edge), at the pinned K slice and a narrower one; no u."""
    x, (w, _, qg, kg) = b2_inputs(p)
    x = dict(x, want_u=False)
    bound = 1e-5 if INTERPRETING else 2e-3
    for config in (None, dict(BK=32)):
        got = wy.wy_recompute(**x, config=config)
        assert got[1] is None
        errors = {"w": ref.rel_rms(got[0], w), "qg": ref.rel_rms(got[2], qg), "kg": ref.rel_rms(got[3], kg)}
        assert all(e <= bound for e in errors.values()), (config, errors)
        assert all(a.dtype == b.dtype and a.shape == b.shape for a, b in zip((got[0], got[2], got[3]), (w, qg, kg)))
    # the kernel reads Akk_inv and beta: a wrong one shows
    wrong = wy.wy_recompute(**{**x, "beta": (x["beta"] * 2).contiguous()})
    assert ref.rel_rms(wrong[0], w) > 0.1 and torch.equal(wrong[3], got[3])
    with pytest.raises(ValueError, match="no u"):
        wy.wy_recompute(**{**x, "want_u": True})


def test_supports():
    x, _ = b2_inputs(SHAPES[0])
    assert x["want_u"]  # the reference chain's B3 reads u
    assert "u is asked for" in wy.supports(**x)
    x["want_u"] = False
    assert wy.supports(**x) is None
    assert "chunk_size" in wy.supports(**{**x, "chunk_size": 32})
    assert "> 256" in wy.supports(**{**x, "k": torch.empty(1, 64, 1, 320)})


def test_registered_for_b2():
    assert stages()["B2"].impls["ours"] is wy.wy_recompute
    assert stages()["B3"].impls["ours"] is scan.scan_states
    assert "ours" not in stages()["F3-F6"].impls  # the forward's F6 stays fla's (its scan reads u)


@pytest.mark.parametrize("p", SHAPES[1:] + [
    Problem("layer-vfirst-h0", 1, 100, 2, 2, 64, 32, initial_state=True, output_final_state=True,
            state_v_first=True),
    Problem("packed-safe-gate", 1, 150, 2, 4, 64, 32, cu_seqlens=(0, 17, 150), safe_gate=True, lower_bound=-5.0),
    Problem("pregated-no-l2norm", 1, 90, 2, 2, 64, 32, gate_in_kernel=False, l2norm_in_kernel=False),
], ids=lambda p: p.name)
def test_chain_without_u_against_the_oracle(p):
    """The backward runs kernel-fun's B2 without u and kernel-fun's B3 forming it: the record
    shows it (and no u in B2's outputs), and the forward and every gradient stay within
    fla's budgets of the float64 recurrence or within 10% of the reference chain's own error
    (small bf16 shapes take the reference chain past a budget: dk 0.012 at
    packed-safe-gate)."""
    kwargs = make_inputs(p, device=DEVICE, seed=14)
    with capture_stages() as log:
        result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.forward["F7-F8"] == "ours" and record.backward["B2"] == "ours" and record.backward["B3"] == "ours"
    (b2,) = [out for name, _, _, out in log if name == "B2"]
    assert b2[1] is None  # no u written: B3 formed it
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    with use_impls("reference"):
        baseline = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    bars = {n: max(ref.BUDGETS[n], 1.1 * ref.rel_rms(baseline[n], oracle[n])) for n in errors}
    assert all(errors[n] <= bars[n] for n in errors), (errors, bars)


def test_chain_with_our_b2_is_the_chain_with_the_reference_b2():
    """kernel-fun's B2 in the chain gives the gradients of the chain whose B2 is the
    reference's (which writes u too, which kernel-fun's B3 does not read)."""
    p = SHAPES[3]
    kwargs = make_inputs(p, device=DEVICE, seed=15)
    with use_impls({"B2": "reference"}):
        want = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert (last_record().backward["B2"], last_record().backward["B3"]) == ("reference", "ours")
    got = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert last_record().backward["B2"] == "ours"
    errors = {n: ref.rel_rms(got[n], want[n]) for n in want if want[n] is not None}
    assert all(e <= (1e-5 if INTERPRETING else 2e-3) for e in errors.values()), errors


def test_a_b3_reading_u_gets_it():
    """Where B3 is not kernel-fun's (forced onto the reference here) it reads u: B2 is asked
    for it and kernel-fun's declines, saying why; disable_recompute runs no B2 at all."""
    p = SHAPES[0]
    kwargs = make_inputs(p, device=DEVICE, seed=16)
    with use_impls({"B3": "reference"}):
        run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.backward["B2"] == "reference" and "u is asked for" in record.notes["B2"], record
    run_fwd_bwd(chunk_kda, dict(kwargs, disable_recompute=True), grid=p.dtype)
    assert not {"B2", "B3"} & set(last_record().backward)
