"""The warp-specialization probe's B6 kernel (research.ws_probe) computes what its
docstring says, so the compile rows it produces describe a kernel that does the stage's
V-loop work. Under the interpreter warp_specialize is a hint that changes nothing; on a
Hopper GPU the matmul probe's descriptor cases compile specialized, so there the test
checks the specialized code's values too."""

from __future__ import annotations


import pytest
import torch

from benchmarks.stages.b6 import make_inputs
from research.ws_probe import run_b6_probe
from kernel_fun.kda.problems import Problem
from kernel_fun.kda.reference import rel_rms

from conftest import DEVICE, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("BV, kg_dot, H, HV", [(64, False, 2, 2), (32, True, 1, 2)])
def test_ws_b6_probe_matches_float64(BV, kg_dot, H, HV):
    inputs = make_inputs(Problem("probe", B=1, T=128, H=H, HV=HV, K=128, V=128), DEVICE, seed=3)
    dq, dk, dv2, dg, db, dA = run_b6_probe(inputs, BV, kg_dot=kg_dot, warp_specialize=True)

    f = {n: t.double() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    B, T, _, K = f["k"].shape
    NT = T // 64
    g = f["gc"].view(B, NT, 64, HV, K)
    rep = lambda x: x.repeat_interleave(HV // H, dim=2).view(B, NT, 64, HV, -1)  # noqa: E731
    q, k = rep(f["q"]), rep(f["k"])
    chunked = lambda n: f[n].view(B, NT, 64, HV, -1)  # noqa: E731
    v, vn, do, dvn, A = (chunked(n) for n in ("v", "v_new", "do", "dv", "A"))
    beta = f["beta"].view(B, NT, 64, HV)
    h, dh = f["h"], f["dh"]  # [B, NT, HV, K, V]

    want_dq = torch.einsum("bntjv,bnjkv->bntjk", do, h) * torch.exp2(g) * inputs["scale"]
    want_dk = torch.einsum("bntjv,bnjkv->bntjk", vn, dh) * torch.exp2(g[:, :, -1:] - g)
    dw = -torch.einsum("bntjv,bnjkv->bntjk", dvn, h)
    dvb = torch.einsum("bnsjt,bnsjv->bntjv", A, dvn)  # A^T dvn
    want_dv2 = dvb * beta[..., None]
    want_db = (dvb * v).sum(-1)
    want_dA = torch.einsum("bntjv,bnsjv->bntjs", dvn, v)
    if kg_dot:
        kg = (k.to(torch.bfloat16).double() * torch.exp2(g)).to(torch.bfloat16).double()
        want_dA = want_dA + torch.einsum("bntjk,bnsjk->bntjs", dw.to(torch.bfloat16).double(), kg)
    dgk = (h * dh).sum(-1)[:, :, None]  # [B, NT, 1, HV, K]
    want_dg = q * want_dq - k * want_dk + dgk

    got = dict(dq=dq, dk=dk, dv2=dv2, dg=dg, db=db, dA=dA)
    want = dict(dq=want_dq, dk=want_dk, dv2=want_dv2, dg=want_dg, db=want_db, dA=want_dA)
    for name in got:
        err = rel_rms(got[name].view(want[name].shape), want[name])
        assert err < 0.005, (name, err)


# a pointer operand, or a pointer-loaded one after the loop, fails the pass: those run unspecialized
@pytest.mark.parametrize("desc, epi, ws", [(True, 0, True), (False, 0, False), (True, 1, False), (True, 2, True),
                                           (True, 3, True)])
def test_ws_mm_probe_matches_float64(desc, epi, ws):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from research.ws_probe import ws_mm_probe

    BM, BN, BK, K = 64, 128, 64, 128
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(BM, K, generator=gen).bfloat16().to(DEVICE)
    b = torch.randn(K, BN, generator=gen).bfloat16().to(DEVICE)
    c = torch.empty(BM * BN + BM * BM, dtype=torch.float32, device=DEVICE)
    args = (TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(b, [BK, BN])) if desc else (a, b)
    ws_mm_probe[(1,)](*args, a, c, K, BM=BM, BN=BN, BK=BK, DESC=desc, WS=ws, EPI=epi, num_warps=4)
    acc = a.double() @ b.double()
    if epi in (1, 2):  # a[:, :BM] @ bf16(acc)
        acc = a[:, :BM].double() @ acc.float().bfloat16().double()
    assert rel_rms(c[:BM * BN].view(BM, BN), acc) < 0.005
    if epi == 3:
        x = acc.float().bfloat16().double()
        assert rel_rms(c[BM * BN:].view(BM, BM), x @ x.T) < 0.005
