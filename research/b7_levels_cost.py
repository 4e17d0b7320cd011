"""What B7-B9's causal levels cost: the registered kernel against a copy of the module with
the tiers it replaced (``--baseline``, a file path), on the B7-B9 stage bench's inputs, at the
pinned config. Both against each other (relative RMS, fp32-level expected), then CUDA-event
medians, the two kernels interleaved round by round.

    git show 2c5e38b:src/kernel_fun/kda/kernels/b7_b9_intra_bwd.py > research/_b7_tiers_old.py
    python -m research.b7_levels_cost --baseline research/_b7_tiers_old.py --out $OUT/b7_levels.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from research.causal_cost import load, time_pair


def main(argv=None) -> None:
    from benchmarks.stages.b7_b9 import level_shares, make_inputs
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels import b7_b9_intra_bwd as new
    from kernel_fun.kda.problems import problem

    parser = argparse.ArgumentParser(prog="python -m research.b7_levels_cost")
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--shapes", default="prod8192_gate,kimi,grid1024")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    old = load(args.baseline)
    table = []
    for name in args.shapes.split(","):
        p = problem(name)
        inputs = make_inputs(p, "cuda")
        a, b = new.intra_bwd(**inputs), old.intra_bwd(**inputs)
        diff = {n: ref.rel_rms(x, y) for n, x, y in zip(("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), a, b)
                if x is not None}
        ms = time_pair({"levels": lambda: new.intra_bwd(**inputs), "tiers": lambda: old.intra_bwd(**inputs)},
                       args.reps, args.rounds)
        row = {"kind": "b7_levels_cost", "stage": "B7-B9", "shape": name, "levels_vs_tiers": diff,
               "level_shares": level_shares(inputs["gc"][:1]), "ms_levels": ms["levels"], "ms_tiers": ms["tiers"],
               "cost": ms["levels"] / ms["tiers"] - 1, "gpu": torch.cuda.get_device_name()}
        table.append(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        inputs = a = b = None
        torch.cuda.empty_cache()
    print(f"{'shape':16s} {'tiers ms':>10s} {'levels ms':>10s} {'cost':>7s}  max rel diff")
    for r in table:
        print(f"{r['shape']:16s} {r['ms_tiers']:10.3f} {r['ms_levels']:10.3f} {100 * r['cost']:6.1f}%  "
              f"{max(r['levels_vs_tiers'].values()):.1e}")


if __name__ == "__main__":
    main()
