"""On an sm_90 GPU with CuTe DSL (the ``sm90`` extra) and fla: B7-B9 and B7-B10's CuTe kernel
(kda/kernels/b7_b10_intra_bwd_sm90.py) as the registered stages run it.

- On the chain's own B7 inputs (fla's chain, captured) at the shapes it takes (K = 128 and 64,
  GVA, T = 500, packed sequences, fla's layer's flags, safe_gate), under Kimi's gates and gates
  strong enough that the pair-by-pair loop runs: held to fla's three stages and to the float64
  stages as the Triton unit is (``tail_misses``: within fla's budgets, and no worse than 10% past
  fla's own error).
- The whole op (B7-B9 without the l2norm in the op, B7-B10 with it): the launch witness (the CuTe
  kernel ran, neither the Triton unit nor fla's B7 did; the record names ours), and the result
  against fla's ``chunk_kda`` as close as the chain with the Triton unit; where the kernel
  refuses (a pre-computed gate, K = 100; GVA for B7-B10, whose B7-B9 it then runs), no CuTe
  kernel for what it refused and the Triton chain's bits.

Run with fla's stored autotune choices and their defaults (``FLA_CACHE_MODE=full``; tests/
test_gpu.py says how): the shapes here would otherwise autotune every fla kernel for minutes."""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import pytest
import torch

from benchmarks.parity import tail_misses
from kernel_fun import _fla
from kernel_fun.kda import chunk_kda, last_record, use_impls
from kernel_fun.kda import reference as ref
from kernel_fun.kda.kernels import b7_b9_intra_bwd
from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90 as sm90
from kernel_fun.kda.problems import SHAPES, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import capture_stages, registered

pytestmark = pytest.mark.gpu

PROD = SHAPES["prod8192_gate"]
# the shapes the kernel takes, at the production heads (K = 128, H = HV = 16) and beside them
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
K100 = dataclasses.replace(PROD, name="T512-k100", B=1, T=512, K=100)
PREGATED = dataclasses.replace(PROD, name="pregated", B=1, T=512, gate_in_kernel=False, l2norm_in_kernel=False)
NO_L2 = lambda p: dataclasses.replace(p, name=p.name + "-no-l2", l2norm_in_kernel=False)  # noqa: E731
# the whole op: B7-B9 (the l2norm outside the op) and B7-B10, dense, T = 500, packed, K = 64
WHOLE = [(stage, p if stage == "B7-B10" else NO_L2(p)) for stage in ("B7-B9", "B7-B10")
         for p in (TAKEN[0], TAKEN[4], TAKEN[5], TAKEN[6])]
NAMES = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")


@pytest.fixture(autouse=True)
def _cute_on_sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    why = sm90.cute_unavailable(torch.empty(1, device="cuda"))
    if why:
        pytest.skip(why)


def _strong(kwargs: dict) -> dict:
    """The raw gate scaled and shifted as the Triton unit's GPU test does: exp2 differences inside
    a block pass the guard, so the pair-by-pair loop runs."""
    kwargs["g"] = (kwargs["g"].detach() * 8 + 12).requires_grad_(True)
    return kwargs


@contextlib.contextmanager
def _triton_chain():
    """The chain as it runs without the CuTe kernel: B7-B9's ``ours`` the Triton unit, B7-B10's
    declined."""
    with registered("B7-B9", "ours", b7_b9_intra_bwd.intra_bwd, b7_b9_intra_bwd.supports), \
            registered("B7-B10", "ours", sm90.intra_bwd_l2, lambda **kw: "the Triton chain, for the comparison"):
        yield


def _op(p, gates: str = "kimi"):
    """fla's chunk_kda, ours as registered and ours on the Triton chain, on the same inputs: (ours,
    fla's, the Triton chain's, the record of ours, the CUDA kernels ours launched, by name and
    count)."""
    from torch.profiler import ProfilerActivity, profile

    kwargs = make_inputs(p, device="cuda", seed=9)
    if gates == "strong":
        kwargs = _strong(kwargs)
    theirs = run_fwd_bwd(_fla.chunk_kda(), kwargs, grid=p.dtype)
    with _triton_chain():
        triton = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
        torch.cuda.synchronize()
        record = last_record()
    kernels = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return ours, theirs, triton, record, kernels


@pytest.mark.parametrize("stage, p", WHOLE, ids=[f"{s}-{p.name}" for s, p in WHOLE])
@pytest.mark.parametrize("gates", ["kimi", "strong"])
def test_the_whole_op_runs_the_kernel_and_tracks_fla(stage, p, gates):
    ours, theirs, triton, record, kernels = _op(p, gates)
    assert record.backward[stage] == "ours", record
    assert not {"B7", "B8", "B9", "B10", "B7-B9", "B7-B10"} - {stage} & set(record.backward), record
    # (packed sequences and T not a multiple of 64: the chunks of 64 rows one launch, the rest another)
    launches = sum(n for name, n in kernels.items() if name.startswith("kernel_cutlass"))
    assert launches == (2 if p.cu_seqlens is not None or p.T % 64 else 1), kernels
    assert "intra_bwd_kernel" not in kernels and "chunk_kda_bwd_kernel_intra" not in kernels, sorted(kernels)
    errors = {n: ref.rel_rms(ours[n], theirs[n]) for n in theirs if theirs[n] is not None}
    triton_errors = {n: ref.rel_rms(triton[n], theirs[n]) for n in theirs if theirs[n] is not None}
    print(stage, gates, "whole op vs fla", errors, "Triton chain vs fla", triton_errors)
    assert all(torch.isfinite(ours[n]).all() for n in ours if ours[n] is not None)
    # (the chain's launch witness test bounds its drift from fla by 5e-3: fp32 sums reassociated, a
    # bf16 rounding downstream one ulp apart; under strong gates the Triton chain's own drift may
    # pass that, and the CuTe kernel's may not be meaningfully further)
    worse = {n: (e, triton_errors[n]) for n, e in errors.items() if e > max(5e-3, 1.1 * triton_errors[n])}
    assert not worse, worse


@pytest.mark.parametrize("p, cute", [(PREGATED, False), (K100, False), (NO_L2(K100), False), (TAKEN[3], True)],
                         ids=["pregated", "k100", "k100-no-l2", "gva-l2"])
def test_what_the_kernel_refuses_runs_as_without_it(p, cute):
    """A pre-computed gate and K = 100: no CuTe kernel, and the Triton chain's bits. GVA with the
    l2norm in the op: B7-B10 declined (B10 needs the group's sum first), the CuTe kernel as
    B7-B9, then GVA's sum and B10."""
    ours, theirs, triton, record, kernels = _op(p)
    assert "B7-B10" not in record.backward, record
    assert any(k.startswith("kernel_cutlass") for k in kernels) == cute, sorted(kernels)
    if cute:
        assert record.backward["B7-B9"] == "ours" and "intra_bwd_kernel" not in kernels, (record, sorted(kernels))
        errors = {n: ref.rel_rms(ours[n], theirs[n]) for n in theirs if theirs[n] is not None}
        triton_errors = {n: ref.rel_rms(triton[n], theirs[n]) for n in theirs if theirs[n] is not None}
        worse = {n: (e, triton_errors[n]) for n, e in errors.items() if e > max(5e-3, 1.1 * triton_errors[n])}
        assert not worse, worse
        return
    assert all(torch.equal(ours[n], triton[n]) for n in triton if triton[n] is not None)


@pytest.mark.parametrize("p", TAKEN, ids=lambda p: p.name)
@pytest.mark.parametrize("gates", ["kimi", "strong"])
def test_the_kernel_on_the_chain_s_inputs_matches_fla_stages(p, gates):
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
    assert sm90.supports(**b7, **gate) is None  # (the kernel takes these: no fallback compared)
    theirs = _fla.intra_bwd_tail(**b7, **gate)
    exact = ref.intra_bwd_tail(**{n: t for n, t in b7.items() if n not in ("chunk_indices", "safe_gate")}, **gate,
                               exact=True)
    ours = sm90.intra_bwd(**b7, **gate)
    fla_exact = {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, theirs, exact) if b is not None}
    vs_fla = {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, ours, theirs) if b is not None}
    vs_exact = {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, ours, exact) if b is not None}
    triton = b7_b9_intra_bwd.intra_bwd(**b7, **gate)
    print(p.name, gates, "vs fla", vs_fla, "vs exact", vs_exact, "fla vs exact", fla_exact,
          "Triton unit vs exact", {n: ref.rel_rms(a, b) for n, a, b in zip(NAMES, triton, exact) if b is not None})
    assert all(torch.isfinite(t).all() for t in ours if t is not None)
    assert not tail_misses(vs_exact, fla_exact, vs_fla), tail_misses(vs_exact, fla_exact, vs_fla)
