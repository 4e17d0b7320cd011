"""research.f4_diag (F4's diagonal blocks through an anchor row) in the interpreter, against
the definitions in float64: dense, GVA, packed sequences with short chunks and blocks, K 128,
100 and 60, bf16 and fp32, gentle gates (the anchored products) and strong ones (every block
past the guard, pair by pair) and a mix; nothing written outside the diagonal blocks; the
output at token t independent of the tokens after it."""

import pytest
import torch

from kernel_fun.kda import reference as ref
from kernel_fun.kda.chain import host_chunk_indices
from research.f4_diag import BC, BT, diag_blocks, diag_mask, exact_diag, positions


def _inputs(B, T, H, HV, K, dtype, rate, seed=0):
    """q, k in ``dtype`` (l2-normalized rows, as the op hands them on), the gate's log2 decay a
    token of 0 to 2 ``rate`` (a float or a per-head list; its chunk cumsum is F4's g), beta."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    rates = torch.tensor(rate if isinstance(rate, list) else [rate] * HV).view(1, 1, HV, 1)
    step = -torch.rand(B, T, HV, K, generator=gen) * 2 * rates
    beta = torch.rand(B, T, HV, generator=gen).to(dtype)
    return q, k, step, beta


CASES = [
    ("dense", 2, 100, 2, 2, 128, torch.bfloat16, 0.5, None),
    ("gva-k100", 1, 80, 1, 2, 100, torch.bfloat16, 0.5, None),
    ("k60-fp32", 1, 70, 2, 2, 60, torch.float32, 0.5, None),
    ("strong", 1, 64, 1, 1, 64, torch.bfloat16, 20.0, None),  # (every block past the guard)
    ("mixed", 1, 128, 2, 2, 64, torch.bfloat16, [0.5, 20.0], None),
    ("packed", 1, 150, 2, 2, 64, torch.bfloat16, 0.5, (0, 30, 64, 81, 150)),
]


@pytest.mark.parametrize("name, B, T, H, HV, K, dtype, rate, cu", CASES, ids=[c[0] for c in CASES])
def test_the_diagonal_blocks_are_their_definition(name, B, T, H, HV, K, dtype, rate, cu):
    q, k, step, beta = _inputs(B, T, H, HV, K, dtype, rate)
    ci = None
    if cu is not None:
        cu = torch.tensor(cu, dtype=torch.int32)
        ci = host_chunk_indices(cu, cu.clone(), BT)
    gc = ref.chunk_cumsum(step, chunk_size=BT, cu_seqlens=cu)  # (each sequence's chunks from its start)
    scale = K ** -0.5
    sentinel = 7.0
    Aqk = torch.full((B, T, HV, BT), sentinel, dtype=k.dtype)
    Akkd = torch.full((B, T, HV, BC), sentinel)
    diag_blocks(q, k, gc, beta, scale, cu, ci, Aqk, Akkd)
    e_q, e_k = exact_diag(q, k, gc, beta, scale, cu)
    m_q, m_k = diag_mask(T, HV, cu, B)
    # Akkd in fp32: the anchored products' tf32x3 (or the pairs' fp32 sums) against float64
    assert ref.rel_rms(Akkd[m_k], e_k[m_k]) < 2e-6, ref.rel_rms(Akkd[m_k], e_k[m_k])
    # Aqk in q's dtype: as close as the definition rounded to it
    bar = ref.rel_rms(e_q[m_q].to(k.dtype), e_q[m_q])
    assert ref.rel_rms(Aqk[m_q], e_q[m_q]) <= 1.05 * bar + 2e-6, (ref.rel_rms(Aqk[m_q], e_q[m_q]), bar)
    # above a block's diagonal: 0; outside the diagonal blocks: untouched
    r = positions(T, cu)
    cols = torch.arange(BT)
    in_block = (cols[None, :] // BC == (r % BT)[:, None] // BC)[None, :, None, :].expand_as(Aqk)
    assert (Aqk[in_block & ~m_q] == 0).all()
    assert (Aqk[~in_block] == sentinel).all()
    assert (Akkd[~m_k] == 0).all()


@pytest.mark.parametrize("rate, t, poison", [(0.5, 37, 3.0), (0.5, 3, float("nan")), (20.0, 40, -1e4),
                                           (4.0, 21, float("inf"))])
def test_the_output_at_a_token_ignores_later_tokens(rate, t, poison):
    """Every input after token t changed (the gate by ``poison``: a shift, a NaN, a decay that
    sends the later rows past the guard, an inf): the outputs at tokens <= t bit for bit."""
    q, k, step, beta = _inputs(1, 64, 1, 1, 64, torch.bfloat16, [rate])
    gc = ref.chunk_cumsum(step, chunk_size=BT)
    fresh = lambda: (torch.zeros(1, 64, 1, BT, dtype=k.dtype), torch.zeros(1, 64, 1, BC))  # noqa: E731
    base = diag_blocks(q, k, gc, beta, 0.125, None, None, *fresh())
    q2, k2, gc2, beta2 = (x.clone() for x in (q, k, gc, beta))
    q2[:, t + 1:] += 1.0
    k2[:, t + 1:] -= 1.0
    gc2[:, t + 1:] += poison
    beta2[:, t + 1:] += 0.5
    later = diag_blocks(q2, k2, gc2, beta2, 0.125, None, None, *fresh())
    for a, b in zip(base, later):
        assert torch.equal(a[:, :t + 1], b[:, :t + 1])
