"""research.b7_tiers on the CPU: the level counts of a gate built for each, and the shares of
the chain's own gate (the reference chain, a small dense shape) summing to one."""

from __future__ import annotations

import torch

from benchmarks.stages.b7_b9 import LEVEL_NAMES, level_shares, levels
from kernel_fun.kda.problems import Problem
from research import b7_tiers


def test_levels_of_a_gate_built_for_each():
    """Log-decays a token of 0.01, 2.5, 5.0 and 70 in log2 (the first level spans 128, a
    later one 64): one, two, four and 63 levels, chunk by chunk; a last chunk of 10 rows at
    5.0 takes one."""
    slope = torch.tensor([0.01, 2.5, 5.0, 70.0, 5.0])
    T = 4 * 64 + 10
    steps = slope[torch.arange(T) // 64]
    gc = -torch.cat([steps[64 * c:64 * c + 64].cumsum(0) for c in range(5)])
    gc = gc[None, :, None, None].expand(1, T, 1, 32).contiguous()
    assert levels(gc).flatten().tolist() == [1, 2, 4, 63, 1]


def test_shares_of_the_chain_s_gate_sum_to_one():
    from kernel_fun.kda.stages import use_impls

    with use_impls("reference"):
        got = level_shares(b7_tiers.chain_gc(Problem("small", 1, 130, 2, 2, 64, 16), "cpu"))
    assert set(got) == set(LEVEL_NAMES) and abs(sum(got.values()) - 1) < 1e-6, got
