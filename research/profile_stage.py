"""Run one stage's kernel a few times on one shape, on its stage-bench entry's inputs, for a
profiler to attach to (Nsight Compute):

    ncu --clock-control none --kernel-name regex:wy_dqkg python -m research.profile_stage \\
        --stage B6 --shape b8 --configs '[{}, {"num_stages": 2}]'
    ncu --section Occupancy --section WarpStateStats --kernel-name regex:intra_bwd \\
        python -m research.profile_stage --stage B7-B9 --shape prod8192_gate

Each config is an override of the launch config the kernel picks at the shape (``{}``: that
config itself, the default).
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> None:
    from benchmarks.stages import entries
    from kernel_fun.kda.problems import problem

    parser = argparse.ArgumentParser(prog="python -m research.profile_stage")
    parser.add_argument("--stage", default="B6", choices=sorted(entries()))
    parser.add_argument("--shape", default="b8")
    parser.add_argument("--configs", default="[{}]", help="JSON list of config overrides")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    bench = entries()[args.stage]
    p = problem(args.shape)
    inputs = bench.make_inputs(p, "cuda")
    for overrides in json.loads(args.configs):
        config = bench.launch_config(p, overrides)
        for _ in range(args.repeat):
            bench.ours(inputs, config)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
