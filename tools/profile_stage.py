"""Run one stage's kernel-fun designs a few times on one shape, on its bench entry's inputs,
for a profiler to attach to (Nsight Compute):

    ncu --clock-control none --kernel-name regex:wy_dqkg python -m tools.profile_stage \\
        --stage B6 --shape b8 --configs '[["fullk", {}], ["fullk", {"num_stages": 2}]]'
    ncu --section Occupancy --section WarpStateStats --kernel-name regex:intra_bwd \\
        python -m tools.profile_stage --stage B7 --shape prod8192_gate --configs '[["wide-halves", null]]'

A config of ``null`` is the design's launch config at the shape.
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> None:
    from kernel_fun.bench.stage import entries
    from kernel_fun.kda.problems import problem

    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", default="B6", choices=sorted(entries()))
    parser.add_argument("--shape", default="b8")
    parser.add_argument("--configs", default=None, help="JSON list of [design, config]; default: the first design's")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    bench = entries()[args.stage]
    p = problem(args.shape)
    inputs = bench.make_inputs(p, "cuda")
    for design, config in json.loads(args.configs) if args.configs else [[bench.designs[0], None]]:
        config = bench.launch_config(p, design, config)
        for _ in range(args.repeat):
            bench.ours(inputs, design, config)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
