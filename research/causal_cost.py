"""What making a stage causal to the bit cost: the registered kernel against a copy of its
module from before the change (``--baseline``, a file path), on the stage bench's inputs at
each shape's pinned or picked config, the two interleaved round by round (CUDA-event
medians). ``--stage F7-F8``: the scan's check for a non-finite v_new (the two must agree
bit for bit on finite inputs); ``--stage B7-B9``: the levels against the tiers they
replaced (relative RMS between the two, fp32-level expected, and the share of programs on
each count of levels).

    git show ccef277^:src/kernel_fun/kda/kernels/f7_f8_b3_scan.py > research/_baseline.py
    python -m research.causal_cost --stage F7-F8 --baseline research/_baseline.py --out $OUT/cost.jsonl
    git show 2c5e38b:src/kernel_fun/kda/kernels/b7_b9_intra_bwd.py > research/_baseline.py
    python -m research.causal_cost --stage B7-B9 --baseline research/_baseline.py --out $OUT/cost.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import torch

SHAPES = {"F7-F8": "prod8192_gate,kimi,step8192", "B7-B9": "prod8192_gate,kimi,grid1024"}


def load(path: Path):
    spec = importlib.util.spec_from_file_location("baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_pair(fns: dict, reps: int, rounds: int) -> dict:
    """Median ms of each function, the functions interleaved round by round."""
    from kernel_fun.bench.timing import cuda_times

    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            for _ in range(3):
                fn()
            times[k] += cuda_times(fn, reps)
    return {k: statistics.median(v) for k, v in times.items()}


def _scan(p, old):
    from benchmarks.stages.f7_f8 import make_inputs
    from kernel_fun.kda.kernels import f7_f8_b3_scan as new

    inputs = make_inputs(p, "cuda")
    (o_new, s_new, _, _), (o_old, s_old, _, _) = new.scan_output(**inputs), old.scan_output(**inputs)
    extra = {"bitwise_same": torch.equal(o_new, o_old) and (s_new is None or torch.equal(s_new, s_old)),
             "config": new.launch_config((p.B if p.cu_seqlens is None else len(p.cu_seqlens) - 1) * p.HV, p.V, p.K)}
    return lambda: new.scan_output(**inputs), lambda: old.scan_output(**inputs), extra


def _intra(p, old):
    from benchmarks.stages.b7_b9 import level_shares, make_inputs
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels import b7_b9_intra_bwd as new

    inputs = make_inputs(p, "cuda")
    pairs = zip(("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), new.intra_bwd(**inputs), old.intra_bwd(**inputs))
    extra = {"new_vs_baseline": {n: ref.rel_rms(a, b) for n, a, b in pairs if a is not None},
             "level_shares": level_shares(inputs["gc"][:1])}
    return lambda: new.intra_bwd(**inputs), lambda: old.intra_bwd(**inputs), extra


def main(argv=None) -> None:
    from kernel_fun.kda.problems import problem

    parser = argparse.ArgumentParser(prog="python -m research.causal_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=sorted(SHAPES), required=True)
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    old = load(args.baseline)
    table = []
    for name in (args.shapes or SHAPES[args.stage]).split(","):
        ours, theirs, extra = (_scan if args.stage == "F7-F8" else _intra)(problem(name), old)
        ms = time_pair({"causal": ours, "before": theirs}, args.reps, args.rounds)
        row = {"kind": "causal_cost", "stage": args.stage, "shape": name, **extra, "ms_causal": ms["causal"],
               "ms_before": ms["before"], "cost": ms["causal"] / ms["before"] - 1,
               "gpu": torch.cuda.get_device_name()}
        table.append(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        ours = theirs = None
        torch.cuda.empty_cache()
    print(f"{'shape':16s} {'before ms':>10s} {'causal ms':>10s} {'cost':>7s}")
    for r in table:
        print(f"{r['shape']:16s} {r['ms_before']:10.3f} {r['ms_causal']:10.3f} {100 * r['cost']:6.1f}%")


if __name__ == "__main__":
    main()
