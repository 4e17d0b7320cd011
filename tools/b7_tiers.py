"""Which B7 tier each (chunk, value head, K slice) takes on the chain's own gate.

``python -m tools.b7_tiers --shapes prod8192_gate,kimi`` runs the whole op once per shape
(fla's stages but B7's inputs captured as the chain hands them over), and prints the share
of slices on each tier as the kernels' guards pick it: the chunk anchor (one [64, 64] dot a
role and dA), the half-chunk anchors, the per-block anchors, and the per-block form with a
diagonal pairwise on CUDA cores (a block whose own span passes 2^GUARD_SPAN). These shares
are what B7's time is made of (``kda/kernels/intra_bwd.py``'s tiers follow them), and the
pairwise share is the diagonal formulation's CUDA-core work. ``tiers`` is the guards'
arithmetic in torch; tests/test_intra_bwd.py holds the kernel to it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

TIER_NAMES = ("chunk", "halves", "blocks", "pairwise")


def tiers(gc: torch.Tensor, BK: int = 32) -> torch.Tensor:
    """Each (batch, chunk, value head, K slice)'s tier as the kernels' guards pick it, from
    the chunk cumsum [B, T, HV, K] of a dense batch: 0 the chunk anchor, 1 the half-chunk
    anchors, 2 the per-block anchors, 3 a block's diagonal pairwise."""
    from kernel_fun.kda.kernels import intra_bwd

    B, T, HV, K = gc.shape
    out = torch.empty(B, -(-T // 64), HV, K // BK, dtype=torch.long, device=gc.device)
    guard = float(intra_bwd.GUARD_SPAN.value)
    for i_c in range(out.shape[1]):
        x = gc[:, 64 * i_c:64 * i_c + 64].unflatten(3, (K // BK, BK))  # [B, n_t, HV, NK, BK]
        n_t = x.shape[1]

        def row(r):
            return x[:, min(r, n_t - 1)]

        whole = torch.maximum(row(0) - row(min(32, n_t) - 1), row(min(32, n_t) - 1) - row(n_t - 1)).amax(-1) <= guard
        half = [torch.maximum(row(st) - row(st + 15), row(st + 15) - row(st + 31)).amax(-1) if st < n_t
                else torch.zeros_like(whole, dtype=x.dtype) for st in (0, 32)]
        halves = torch.maximum(*half) <= guard
        span = [(row(st) - row(min(st + 16, n_t) - 1)).amax(-1) if st < n_t else torch.zeros_like(half[0])
                for st in (0, 16, 32, 48)]
        blocks = torch.stack(span).amax(0) <= guard
        out[:, i_c] = torch.where(whole, 0, torch.where(halves, 1, torch.where(blocks, 2, 3)))
    return out


def shares(gc: torch.Tensor, BK: int = 32) -> dict:
    """The share of slices on each tier (names as ``TIER_NAMES``)."""
    t = tiers(gc, BK)
    return {n: (t == i).float().mean().item() for i, n in enumerate(TIER_NAMES)}


def chain_gc(p, device, seed: int = 0) -> torch.Tensor:
    """B7's gate cumsum as the chain hands it over at problem ``p`` (a dense one), from the
    whole op on its default implementations."""
    from kernel_fun.kda import chunk_kda
    from kernel_fun.kda.problems import make_inputs, run_fwd_bwd
    from kernel_fun.kda.stages import capture_stages

    with capture_stages() as log:
        run_fwd_bwd(chunk_kda, make_inputs(p, device=device, seed=seed), grid=p.dtype)
    found = [x for name, _, x, _ in log if name in ("B7", "B7-B9")]
    if not found:
        raise RuntimeError("no B7 stage ran")
    return found[0]["gc"]


def main(argv=None) -> int:
    from kernel_fun.kda.problems import problem

    parser = argparse.ArgumentParser(prog="python -m tools.b7_tiers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="prod8192_gate")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the whole op at a bench shape)", file=sys.stderr)
        return 2
    for name in args.shapes.split(","):
        p = problem(name)
        if p.cu_seqlens is not None:
            print(f"{name}: packed sequences are not counted here", file=sys.stderr)
            continue
        print(json.dumps({"shape": name, **{n: round(v, 4) for n, v in shares(chain_gc(p, "cuda")).items()}}))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
