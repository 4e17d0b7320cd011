"""How many levels B7's programs take on the chain's own gate.

``python -m research.b7_tiers --shapes prod8192_gate,kimi`` runs the whole op once per shape
(B7's inputs captured as the chain hands them over) and prints the share of (chunk, value
head, K slice) programs taking one, two, three and four or more levels: each level is one
[64, 64] x [64, 32] dot a role and dA, so these shares are what B7's dots cost
(``kda/kernels/b7_b9_intra_bwd.py``). ``levels`` is the kernel's level arithmetic in torch
(``benchmarks/stages/b7_b9.py``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.stages.b7_b9 import level_shares


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
        print(json.dumps({"shape": name, **{n: round(v, 4) for n, v in level_shares(chain_gc(p, "cuda")).items()}}))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
