"""research.b7_tiers on the CPU: the tiers of a gate built to take each one, and the shares of
the chain's own gate (the reference chain, a small dense shape) summing to one."""

from __future__ import annotations

import torch

from kernel_fun.kda.problems import Problem
from research import b7_tiers


def test_tiers_follow_the_guards_on_a_gate_built_for_each():
    """Log-decays a token of 0.01, 3.0, 4.1 and 5.0 (the chunk's middle-row span 32 steps,
    a half's 16, a block's 15, against 2^64): the chunk anchor, the halves, the blocks, the
    pairwise diagonal, chunk by chunk; a last chunk of 10 rows takes the chunk anchor."""
    slope = torch.tensor([0.01, 3.0, 4.1, 5.0, 5.0])
    T = 4 * 64 + 10
    steps = slope[torch.arange(T) // 64]
    gc = -torch.cat([steps[64 * c:64 * c + 64].cumsum(0) for c in range(5)])
    gc = gc[None, :, None, None].expand(1, T, 1, 32).contiguous()
    assert b7_tiers.tiers(gc).flatten().tolist() == [0, 1, 2, 3, 0]


def test_shares_of_the_chain_s_gate_sum_to_one():
    from kernel_fun.kda.stages import use_impls

    with use_impls("reference"):
        got = b7_tiers.shares(b7_tiers.chain_gc(Problem("small", 1, 130, 2, 2, 64, 16), "cpu"))
    assert set(got) == set(b7_tiers.TIER_NAMES) and abs(sum(got.values()) - 1) < 1e-6, got
