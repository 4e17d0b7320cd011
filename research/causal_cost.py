"""What the F7-F8 scan's causal check costs: the registered kernel against a copy of the scan
module from before the check (``--baseline``, a file path), on the F7-F8 stage bench's
inputs (a reference chain's), at each shape's picked launch config. Both must give bitwise
the same o and final state on finite inputs (the check only selects non-finite values);
then CUDA-event medians, the two kernels interleaved round by round.

    git show ccef277^:src/kernel_fun/kda/kernels/f7_f8_b3_scan.py > research/_scan_precausal.py
    python -m research.causal_cost --baseline research/_scan_precausal.py --out $OUT/causal_cost.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import torch


def load(path: Path):
    spec = importlib.util.spec_from_file_location("scan_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_pair(fns: dict, reps: int, rounds: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[k].append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    from benchmarks.stages.f7_f8 import make_inputs
    from kernel_fun.kda.kernels import f7_f8_b3_scan as new
    from kernel_fun.kda.problems import problem

    parser = argparse.ArgumentParser(prog="python -m research.causal_cost")
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--shapes", default="prod8192_gate,kimi,step8192")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    old = load(args.baseline)
    table = []
    for name in args.shapes.split(","):
        p = problem(name)
        inputs = make_inputs(p, "cuda")
        o_new, s_new, _, _ = new.scan_output(**inputs)
        o_old, s_old, _, _ = old.scan_output(**inputs)
        same = torch.equal(o_new, o_old) and (s_new is None or torch.equal(s_new, s_old))
        ms = time_pair({"with check": lambda: new.scan_output(**inputs),
                        "before": lambda: old.scan_output(**inputs)}, args.reps, args.rounds)
        row = {"kind": "causal_cost", "stage": "F7-F8", "shape": name, "bitwise_same": same,
               "config": new.launch_config((p.B if p.cu_seqlens is None else len(p.cu_seqlens) - 1) * p.HV,
                                           p.V, p.K),
               "ms_with_check": ms["with check"], "ms_before": ms["before"],
               "cost": ms["with check"] / ms["before"] - 1, "gpu": torch.cuda.get_device_name()}
        table.append(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    print(f"{'shape':16s} {'same':5s} {'before ms':>10s} {'check ms':>10s} {'cost':>7s}")
    for r in table:
        print(f"{r['shape']:16s} {str(r['bitwise_same']):5s} {r['ms_before']:10.3f} {r['ms_with_check']:10.3f} "
              f"{100 * r['cost']:6.1f}%")


if __name__ == "__main__":
    main()
