"""On an sm_90 GPU with CuTe DSL and fla: the CuTe B7-B9 unit (``research.b7_cute_probe``,
``intra_bwd``, and ``intra_bwd_l2`` for B7-B10) as the op's candidate.

- On the chain's own B7 inputs (fla's chain, captured) at shapes the unit takes, under Kimi's
  gates and gates strong enough that the pair-by-pair path runs: held to fla's three stages and
  to the float64 stages as the registered unit is (``tail_misses``: within fla's budgets, and no
  worse than 10% past fla's own error).
- The whole op with the candidate in its stage's place (the unit's ``var`` build too, at T = 500
  and on packed sequences): the launch witness (the CuTe kernel ran, the registered Triton unit
  did not; the record names ours), the result against fla's ``chunk_kda`` as close as the
  registered chain's; and where a candidate refuses, no CuTe kernel and the chain's bits as
  without it.

The registration run (issue 50) runs these beside the stage and whole-op timings, through
``research/gpu/cute_t.sh`` (fla on its stored autotune choices and their defaults: the shapes
here would otherwise autotune every fla kernel for minutes)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from benchmarks.parity import tail_misses
from kernel_fun import _fla
from kernel_fun.kda import chunk_kda, last_record, use_impls
from kernel_fun.kda import reference as ref
from kernel_fun.kda.problems import SHAPES, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, registered, stages

pytestmark = pytest.mark.gpu

PROD = SHAPES["prod8192_gate"]
# dense sequences of whole chunks at the production heads (K = 128, H = HV = 16): the unit's shapes
TAKEN = [
    dataclasses.replace(PROD, name="T1024", B=2, T=1024),
    dataclasses.replace(PROD, name="T1024-layer", B=2, T=1024, state_v_first=True, beta_sigmoid_in_kernel=True),
    dataclasses.replace(PROD, name="T1024-safe", B=2, T=1024, safe_gate=True, lower_bound=-5.0),
    dataclasses.replace(PROD, name="T1024-gva", B=2, T=1024, H=8),  # (16 value heads on 8 q/k heads)
    # the var build: T not a multiple of 64, and packed sequences (one shorter than a chunk, one
    # ending exactly at a chunk's end, the last ending the tensor mid-chunk)
    dataclasses.replace(PROD, name="T500", B=2, T=500),
    dataclasses.replace(PROD, name="varlen", B=1, T=700, cu_seqlens=(0, 30, 158, 700)),
    dataclasses.replace(PROD, name="T1024-k64", B=2, T=1024, K=64),  # (one CTA a chunk-head)
]
# what each candidate refuses: a pre-computed gate (the unit ends with the gate's backward), K = 100
# (the unit's K slices are 64 wide); GVA for B10 in the unit (the group's sum comes first)
K100 = dataclasses.replace(PROD, name="T512-k100", B=1, T=512, K=100)
NOT_TAKEN = [("B7-B9", dataclasses.replace(PROD, name="pregated", B=1, T=512, gate_in_kernel=False,
                                           l2norm_in_kernel=False)),
             ("B7-B9", K100), ("B7-B10", K100), ("B7-B10", TAKEN[3])]
# the whole op: each candidate where it runs, the var builds too
WHOLE = [(stage, p) for stage in ("B7-B9", "B7-B10") for p in (TAKEN[0], TAKEN[4], TAKEN[5], TAKEN[6])]
NAMES = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")


@pytest.fixture(autouse=True)
def _cute_on_sm90():
    pytest.importorskip("cutlass.cute", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe unit is built for sm_90a")


def _strong(kwargs: dict) -> dict:
    """The raw gate scaled and shifted as the registered unit's GPU test does: exp2 differences
    inside a block pass the guard, so the pair-by-pair path runs."""
    kwargs["g"] = (kwargs["g"].detach() * 8 + 12).requires_grad_(True)
    return kwargs


@pytest.mark.parametrize("p", TAKEN, ids=lambda p: p.name)
@pytest.mark.parametrize("gates", ["kimi", "strong"])
def test_the_cute_unit_on_the_chain_s_inputs_matches_fla_stages(p, gates):
    from research import b7_cute_probe

    if gates == "strong" and p.safe_gate:
        pytest.skip("safe_gate bounds the gate")
    kwargs = make_inputs(p, device="cuda", seed=5)
    if gates == "strong":
        kwargs = _strong(kwargs)
    with use_impls({"B7-B9": "fla", "B7-B10": "fla"}), capture_stages() as log:  # B7, B8, B9 one by one
        run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    (b7,) = [x for name, _, x, _ in log if name == "B7"]
    (b9,) = [x for name, _, x, _ in log if name == "B9"]
    gate = {n: b9[n] for n in ("g", "A_log", "dt_bias", "lower_bound")}
    assert b7_cute_probe.supports(**b7, **gate) is None  # (the CuTe unit takes these: no fallback compared)
    theirs = _fla.intra_bwd_tail(**b7, **gate)
    exact = ref.intra_bwd_tail(**{n: t for n, t in b7.items() if n not in ("chunk_indices", "safe_gate")}, **gate,
                               exact=True)
    ours = b7_cute_probe.intra_bwd(**b7, **gate)
    fla_exact = {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, theirs, exact) if b is not None}
    vs_fla = {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, ours, theirs) if b is not None}
    vs_exact = {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, ours, exact) if b is not None}
    # (beside it, the registered Triton unit and the fp32 torch stages on the same inputs)
    shipped = stages()["B7-B9"].impls["ours"](**b7, **gate)
    f32 = ref.intra_bwd_tail(**{n: t for n, t in b7.items() if n not in ("chunk_indices", "safe_gate")}, **gate)
    print(p.name, gates, "vs fla", vs_fla, "vs exact", vs_exact, "fla vs exact", fla_exact,
          "registered vs exact", {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, shipped, exact) if b is not None},
          "fp32 stages vs exact", {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, f32, exact) if b is not None})
    assert all(torch.isfinite(t).all() for t in ours if t is not None)
    assert not tail_misses(vs_exact, fla_exact, vs_fla), tail_misses(vs_exact, fla_exact, vs_fla)


def _dispatching(cute_fn, cute_supports, shipped_fn, shipped_supports):
    """The stage's ``ours`` as a registered CuTe kernel would be: ``cute_fn`` where
    ``cute_supports`` takes the call, else the stage's registered kernel; and its support
    check the registered kernel's."""
    def fn(*args, **kwargs):
        return (cute_fn if cute_supports(*args, **kwargs) is None else shipped_fn)(*args, **kwargs)

    fn.__signature__ = inspect.signature(shipped_fn)
    return fn, shipped_supports


def _op_with(stage: str, p, gates: str = "kimi"):
    """fla's chunk_kda, ours with the CuTe unit as ``stage`` and ours as registered, on the same
    inputs: (ours with the unit, fla's, ours as registered, the record of the call with the unit,
    the CUDA kernels that call launched)."""
    from torch.profiler import ProfilerActivity, profile

    from research import b7_cute_probe

    fn, supports = ((b7_cute_probe.intra_bwd, b7_cute_probe.supports) if stage == "B7-B9" else
                    (b7_cute_probe.intra_bwd_l2, b7_cute_probe.supports_l2))
    kwargs = make_inputs(p, device="cuda", seed=9)
    if gates == "strong":
        kwargs = _strong(kwargs)
    theirs = run_fwd_bwd(_fla.chunk_kda(), kwargs, grid=p.dtype)
    shipped = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    before = stages()[stage]
    if "ours" in before.impls:  # (as it would ship: the CuTe kernel where it takes the call, else the registered one)
        fn, supports = _dispatching(fn, supports, before.impls["ours"], before.supports.get("ours"))
    caps = before.caps.get("ours", ()) if "ours" in before.impls else ()
    with registered(stage, "ours", fn, supports, caps), profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
        torch.cuda.synchronize()
        record = last_record()
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return ours, theirs, shipped, record, kernels


@pytest.mark.parametrize("stage, p", WHOLE, ids=[f"{s}-{p.name}" for s, p in WHOLE])
@pytest.mark.parametrize("gates", ["kimi", "strong"])
def test_the_whole_op_with_the_cute_unit_tracks_fla_and_ran_it(stage, p, gates):
    ours, theirs, shipped, record, kernels = _op_with(stage, p, gates)
    assert record.backward[stage] == "ours", record
    assert any(k.startswith("kernel_cutlass") for k in kernels), sorted(kernels)
    assert "intra_bwd_kernel" not in kernels and "chunk_kda_bwd_kernel_intra" not in kernels, sorted(kernels)
    errors = {n: ref.rel_rms(ours[n], theirs[n]) for n in theirs if theirs[n] is not None}
    registered_errors = {n: ref.rel_rms(shipped[n], theirs[n]) for n in theirs if theirs[n] is not None}
    print(stage, gates, "whole op vs fla", errors, "registered vs fla", registered_errors)
    assert all(torch.isfinite(ours[n]).all() for n in ours if ours[n] is not None)
    # (the registered chain's launch witness test bounds its drift from fla by 5e-3: fp32 sums
    # reassociated, a bf16 rounding downstream one ulp apart; under strong gates the registered
    # chain's own drift may pass that, and the unit may not drift meaningfully further)
    worse = {n: (e, registered_errors[n]) for n, e in errors.items() if e > max(5e-3, 1.1 * registered_errors[n])}
    assert not worse, worse


@pytest.mark.parametrize("stage, p", NOT_TAKEN, ids=[f"{s}-{p.name}" for s, p in NOT_TAKEN])
def test_a_shape_the_cute_unit_does_not_take_runs_without_it(stage, p):
    """A pre-computed gate, K = 100, GVA for B7-B10: the candidate's support check refuses, and
    the chain runs what it runs without it, to the bit: for B7-B9 the registered unit (the
    candidate dispatched as it would ship, ``_dispatching``); for B7-B10, which has no
    registered kernel of ours, the registered B7-B9 unit then B10."""
    ours, theirs, shipped, record, kernels = _op_with(stage, p)
    assert (record.backward.get(stage) == "ours") == ("ours" in stages()[stage].impls), record
    assert not any(k.startswith("kernel_cutlass") for k in kernels), sorted(kernels)
    assert all(torch.equal(ours[n], shipped[n]) for n in shipped if shipped[n] is not None)  # (as without it)
