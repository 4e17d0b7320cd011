"""research.prep16 through the interpreter: Aqk and Akk_inv against the float64 reference
stages, on the anchored path, the element-wise path and both mixed, T not a multiple of 64,
K 64, 100 and 128, GVA."""

from __future__ import annotations

import pytest
import torch

from kernel_fun.kda import reference as ref
from research import prep16


def _inputs(B, T, H, HV, K, step, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(torch.bfloat16)
    # per-token log2 decays, channel by channel up to `step`
    a = -torch.rand(B, T, HV, K, generator=gen) * step
    gc = ref.chunk_cumsum(a, chunk_size=64)
    beta = torch.rand(B, T, HV, generator=gen).to(torch.bfloat16)
    return q, k, gc, beta


@pytest.mark.parametrize("B,T,H,HV,K,step,span_max", [
    (1, 130, 1, 2, 64, 0.5, prep16.SPAN_MAX),     # anchored everywhere
    (1, 130, 1, 2, 64, 0.5, -1.0),                # element-wise everywhere
    (2, 100, 1, 1, 100, 12.0, prep16.SPAN_MAX),   # a steep gate: both paths, K=100
    (1, 64, 2, 2, 128, 3.0, prep16.SPAN_MAX),
])
def test_intra16_matches_the_reference_stage(B, T, H, HV, K, step, span_max):
    q, k, gc, beta = _inputs(B, T, H, HV, K, step)
    scale = K ** -0.5
    Aqk, Akk_inv = prep16.intra16(q, k, gc, beta, scale, span_max=span_max)
    want_qk, want_inv = ref.intra_scores(q, k, gc, beta, scale, 64, exact=True)
    assert ref.rel_rms(Aqk.double(), want_qk) < 0.005, ref.rel_rms(Aqk.double(), want_qk)
    assert ref.rel_rms(Akk_inv.double(), want_inv) < 0.005, ref.rel_rms(Akk_inv.double(), want_inv)


def test_intra16_on_packed_sequences():
    """Empty and one-token sequences among them; a steep gate in one."""
    from kernel_fun import _fla

    q, k, gc_dense, beta = _inputs(1, 200, 1, 2, 64, 0.5)
    cu = torch.tensor([0, 0, 1, 70, 70, 200])
    steep = -torch.rand(1, 200, 2, 64, generator=torch.Generator().manual_seed(3)) * 12
    a = torch.where((torch.arange(200) >= 70)[None, :, None, None], steep, -torch.rand(1, 200, 2, 64) * 0.5)
    gc = ref.chunk_cumsum(a, chunk_size=64, cu_seqlens=cu)
    index = _fla.prepare_chunk_indices(cu, 64)
    Aqk, Akk_inv = prep16.intra16(q, k, gc, beta, 64 ** -0.5, cu_seqlens=cu, chunk_indices=index)
    want_qk, want_inv = ref.intra_scores(q, k, gc, beta, 64 ** -0.5, 64, cu_seqlens=cu, exact=True)
    assert ref.rel_rms(Aqk.double(), want_qk) < 0.005
    assert ref.rel_rms(Akk_inv.double(), want_inv) < 0.005
