"""Where a B6 program's time goes: one launch of fullk with per-program stamps.

``python -m tools.b6_timeline --shape prod8192_gate --out bench/results/b6_ablation.jsonl``

The kernel, launched with ``config={"timeline": buffer}``, stores per program (in launch
order) the SM it ran on and three ``%globaltimer`` readings: at its start, when the V
loop's last result is in, and after its last store. From them: the V loop's and the
epilogue's time per program, the gap before the next program on the same SM, and how
many SMs are in each phase at once. The stamps change no output (checked here, bitwise)
and cost a few percent of time (timed here, interleaved with the plain kernel).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np


def stamps_complete(stamps: np.ndarray, n_sm: int) -> bool:
    """Every row of an [n_programs, 4] array of (smid, start, loop end, end) was written by
    its program: an SM id inside the device and three readings, set and in order."""
    sm, start, loop_end, end = (stamps[:, i] for i in range(4))
    return bool(((sm >= 0) & (sm < n_sm) & (start > 0) & (start <= loop_end) & (loop_end <= end)).all())


def timeline_stats(stamps: np.ndarray, grid_ns: int = 500) -> dict:
    """Statistics of an [n_programs, 4] array of (smid, start, loop end, end) in ns:
    p10/p50/p90 of the V loop, epilogue and whole program (us), of the gap between one
    program's end and the next one's start on the same SM (us), of the number of programs
    in each phase at once over the middle 80% of the launch, and the V loop's median by
    quartile of how many other programs were in their V loop meanwhile."""
    sm = stamps[:, 0].astype(np.int64)
    t = stamps[:, 1:].astype(np.int64)
    t = t - t[:, 0].min()
    start, loop_end, end = t[:, 0], t[:, 1], t[:, 2]
    loop, epi, prog = loop_end - start, end - loop_end, end - start

    def q(x, scale=1e-3):
        return [round(float(np.percentile(x, p)) * scale, 3) for p in (10, 50, 90)]

    gaps = []
    for s in np.unique(sm):
        idx = np.where(sm == s)[0]
        order = np.argsort(start[idx])
        gaps.extend((start[idx][order][1:] - end[idx][order][:-1]).tolist())
    span = int(end.max())
    edges = np.arange(0, span + grid_ns, grid_ns)
    in_loop, in_epi = np.zeros(len(edges)), np.zeros(len(edges))
    for s0, s1, s2 in zip(start, loop_end, end):
        in_loop[np.searchsorted(edges, s0):np.searchsorted(edges, s1)] += 1
        in_epi[np.searchsorted(edges, s1):np.searchsorted(edges, s2)] += 1
    middle = (edges > 0.1 * span) & (edges < 0.9 * span)
    if not middle.any():
        middle = np.ones(len(edges), dtype=bool)
    busy = np.array([in_loop[np.searchsorted(edges, a):max(np.searchsorted(edges, b), np.searchsorted(edges, a) + 1)].mean()
                     for a, b in zip(start, loop_end)])
    cuts = np.percentile(busy, [0, 25, 50, 75, 100])
    by_busy = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        sel = (busy >= lo) & (busy <= hi)
        by_busy.append([round(float(lo), 1), round(float(hi), 1), round(float(np.median(loop[sel])) * 1e-3, 3)])
    counts = np.bincount(sm)
    counts = counts[counts > 0]
    return {
        "loop_us": q(loop), "epilogue_us": q(epi), "program_us": q(prog),
        "same_sm_gap_us": q(np.array(gaps)) if gaps else None,
        "programs_in_loop": [round(float(np.percentile(in_loop[middle], p)), 1) for p in (10, 50, 90)],
        "programs_in_epilogue": [round(float(np.percentile(in_epi[middle], p)), 1) for p in (10, 50, 90)],
        "loop_us_by_loop_concurrency_quartile": by_busy,
        "n_sm": int(len(counts)), "programs_per_sm": [int(counts.min()), int(counts.max())],
        "span_ms": round(span * 1e-6, 4),
    }


def run(shape: str, reps: int = 10, rounds: int = 5) -> dict:
    import torch

    from kernel_fun import versions
    from kernel_fun.bench import results
    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.bench.stage_b6 import make_inputs
    from kernel_fun.kda.problems import problem
    from kernel_fun.kda.kernels import wy_bwd

    p = problem(shape)
    inputs = make_inputs(p, "cuda")
    n_programs = -(-p.T // 64) * p.B * p.HV
    stamps = torch.zeros(n_programs, 4, dtype=torch.int64, device="cuda")
    plain = wy_bwd.wy_dqkg_bwd(**inputs, design="fullk")
    stamped = wy_bwd.wy_dqkg_bwd(**inputs, design="fullk", config={"timeline": stamps})
    same = all(torch.equal(a, b) for a, b in zip(plain, stamped))
    del plain, stamped
    fns = {"plain": lambda: wy_bwd.wy_dqkg_bwd(**inputs, design="fullk"),
           "stamped": lambda: wy_bwd.wy_dqkg_bwd(**inputs, design="fullk", config={"timeline": stamps})}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += cuda_times(fn, reps)
    stamps.zero_()
    fns["stamped"]()
    torch.cuda.synchronize()
    a = stamps.cpu().numpy()
    complete = stamps_complete(a, torch.cuda.get_device_properties(stamps.device).multi_processor_count)
    config = wy_bwd.launch_config("fullk", p.K, p.V, p.B * p.HV)
    return {
        "kind": "timeline", "stage": "B6", "shape": shape, "problem": p.describe(), "design": "fullk",
        "config": config, "outputs_bitwise_equal": same, "stamps_complete": complete,
        "ms_plain": round(summary(times["plain"])["median"], 4),
        "ms_stamped": round(summary(times["stamped"])["median"], 4),
        **(timeline_stats(a) if complete else {}),
        "method": "tools.b6_timeline: %globaltimer per program at start, after the V loop's last "
                  "result, after the last store; p10/p50/p90 in us; concurrency on a 0.5 us grid",
        "gpu": torch.cuda.get_device_name(), "versions": versions(), "commit": results.commit(),
        "date": results.now(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.b6_timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="prod8192_gate")
    parser.add_argument("--out", default=None, help="a jsonl file to append the row to")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    row = run(args.shape)
    if args.out:
        from kernel_fun.bench import results

        results.append(Path(args.out), row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("versions", "method")}, indent=1))
    return 0 if row["outputs_bitwise_equal"] and row["stamps_complete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
