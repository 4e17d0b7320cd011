"""research.l2norm_fwd (F1 in one launch) in the interpreter: each row's rstd and normalized
values as the reference's to rounding, at K 128, 100 and 60, rows not a multiple of the block,
bf16 and fp32, a zero row; the refusals; and in the chain as F1's ``ours`` (the launch
witness), the forward and every gradient as with the reference F1."""

import dataclasses

import pytest
import torch

from kernel_fun.kda import chunk_kda, last_record, use_impls
from kernel_fun.kda import reference as ref
from kernel_fun.kda.problems import SHAPES, as_oracle_inputs, make_inputs, run_fwd_bwd
from kernel_fun.kda.stages import registered
from research.l2norm_fwd import l2norm_fwd, supports


@pytest.mark.parametrize("K, rows, dtype", [(128, 70, torch.bfloat16), (100, 33, torch.bfloat16),
                                            (60, 5, torch.float32), (128, 64, torch.float32)])
def test_rows_as_the_reference(K, rows, dtype):
    """rstd within a few fp32 units of the reference's (the row's sum in another order); y the
    product x rstd in fp32, rounded to x's dtype to nearest: bit for bit."""
    gen = torch.Generator().manual_seed(K + rows)
    q = (torch.randn(1, rows, 1, K, generator=gen) * 3).to(dtype)
    k = torch.randn(1, rows, 1, K, generator=gen).to(dtype)
    q[0, 3] = 0  # (a zero row: rstd 1 / sqrt(eps), the row stays 0)
    got = l2norm_fwd(q, k, br=16)
    for x, y, r in ((q, got[0], got[1]), (k, got[2], got[3])):
        want_y, want_r = ref.l2norm_fwd(x)
        assert y.shape == x.shape and y.dtype == x.dtype and r.shape == x.shape[:-1] and r.dtype == torch.float32
        assert torch.allclose(r, want_r, rtol=4e-7, atol=0), (r - want_r).abs().max()
        prod = x.float() * r[..., None]
        assert torch.equal(y, prod.to(dtype))
        exact = ref.l2norm_fwd(x.double())[0]
        assert ref.rel_rms(y, exact) <= 2.5 * max(ref.rel_rms(want_y, exact), 1e-7)
    assert torch.equal(got[0][0, 3], torch.zeros_like(got[0][0, 3]))
    assert torch.allclose(got[1][0, 3], torch.tensor(1e-6) ** -0.5)


def test_what_it_refuses():
    x = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    assert supports(x, x) is None
    assert supports(x, x[..., :32]) is not None
    assert supports(x.transpose(1, 2), x.transpose(1, 2)) is not None
    assert supports(torch.randn(1, 8, 2, 1024), torch.randn(1, 8, 2, 1024)) is not None


def test_in_the_chain_as_f1():
    """F1 as the candidate in the whole op: the record names ours (the launch witness), and the
    output and every gradient are within fla's budgets of the float64 recurrence, or within 10%
    of the chain's own error with the reference F1."""
    p = dataclasses.replace(SHAPES["prod8192_gate"], name="f1", B=1, T=100, H=2, HV=2, K=64, V=32)
    kwargs = make_inputs(p, device="cpu", seed=3)
    with use_impls({"F1": "reference"}):
        baseline = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    assert last_record().forward["F1"] == "reference"
    with registered("F1", "ours", l2norm_fwd, supports), use_impls({"F1": "ours"}):
        got = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
        assert last_record().forward["F1"] == "ours"
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(got[n], oracle[n]) for n in oracle if oracle[n] is not None}
    bars = {n: max(ref.BUDGETS[n], 1.1 * ref.rel_rms(baseline[n], oracle[n])) for n in errors}
    assert all(errors[n] <= bars[n] for n in errors), (errors, bars)
