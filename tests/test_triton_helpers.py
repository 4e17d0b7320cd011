"""kernel_fun._triton's numeric helpers against float64, under the interpreter or on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from conftest import DEVICE, needs_triton

from kernel_fun._triton import softplus

pytestmark = needs_triton


@triton.jit
def _softplus_kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, softplus(tl.load(x + o)))


def test_softplus_is_torch_s_to_a_few_ulp_everywhere():
    """Relative error against float64 within 4 fp32 ulp (2^-21), plus, for negative x, what
    rounding e^x's argument costs any fp32 exp (2^-23 |x|: torch's fp32 softplus is 2.2e-6
    off at -90), from -90 to 90 wherever the result is a normal fp32 number (below x ~ -87
    it is subnormal: the same bound on 2^-126, plus a few units of 2^-149), through 0, the series' worst point
    (z = 1), and 20, where torch passes x through."""
    x = torch.cat([torch.linspace(-90, 90, 3001), torch.linspace(-1e-3, 1e-3, 101),
                   torch.tensor([19.999, 20.0, 20.001, -20.0, 0.0, 1e-30, -1e-30])])
    n = triton.next_power_of_2(x.numel())
    x = torch.nn.functional.pad(x, (0, n - x.numel())).float().to(DEVICE)
    y = torch.empty_like(x)
    _softplus_kernel[(1,)](x, y, N=n)
    want = torch.nn.functional.softplus(x.double().cpu())
    got = y.double().cpu()
    normal = want >= 2.0 ** -126
    bound = 2.0 ** -21 + 2.0 ** -23 * (-x.double().cpu()).clamp_min(0)
    excess = ((got - want).abs() / want - bound)[normal].max().item()
    assert excess <= 0, excess
    assert ((got - want).abs() - bound * 2.0 ** -126)[~normal].max().item() <= 4 * 2.0 ** -149
    assert torch.equal(got[x.cpu() > 20], x.cpu()[x.cpu() > 20].double())
