"""Run B6 designs a few times on one shape, for a profiler to attach to (Nsight Compute):

    ncu --clock-control none --kernel-name regex:wy_dqkg python -m tools.profile_b6 \\
        --shape b8 --configs '[["fullk", {}], ["fullk", {"num_stages": 2}]]'
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> None:
    from kernel_fun.bench.stage_b6 import make_inputs
    from kernel_fun.kda.problems import problem
    from kernel_fun.kda.kernels import wy_bwd

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="b8")
    parser.add_argument("--configs", default='[["fullk", {}]]')
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    inputs = make_inputs(problem(args.shape), "cuda")
    for design, config in json.loads(args.configs):
        for _ in range(args.repeat):
            wy_bwd.wy_dqkg_bwd(**inputs, design=design, config=config)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
