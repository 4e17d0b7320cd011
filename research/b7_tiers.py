"""Which B7 tier each (chunk, value head, K slice) takes on the chain's own gate.

``python -m research.b7_tiers --shapes prod8192_gate,kimi`` runs the whole op once per shape
(fla's stages but B7's inputs captured as the chain hands them over), and prints the share
of slices on each tier as the kernels' guards pick it: the chunk anchor (one [64, 64] dot a
role and dA), the half-chunk anchors, the per-block anchors, and the per-block form with a
diagonal pairwise on CUDA cores (a block whose own span passes 2^GUARD_SPAN). These shares
are what B7's time is made of (``kda/kernels/b7_b9_intra_bwd.py``'s tiers follow them), and
the pairwise share is the diagonal formulation's CUDA-core work. ``tiers`` is the guards'
arithmetic in torch (``benchmarks/stages/b7_b9.py``); tests/test_b7_b9_intra_bwd.py holds the
kernel to it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.stages.b7_b9 import TIER_NAMES, tiers


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

    parser = argparse.ArgumentParser(prog="python -m research.b7_tiers", description=__doc__,
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
