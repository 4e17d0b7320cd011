"""Stage-alone bench: one stage's kernel-fun kernel against fla's stage, for any stage that
has an entry (``benchmarks/stages/``).

``python -m benchmarks.stage --stage B6 --shapes prod8192_gate,kimi --configs sweep``
``python -m benchmarks.stage --stage B7-B9 --shapes kimi --candidate research.<module>:<function>``

For each shape: the stage's inputs (its entry's ``make_inputs``: random or a real chain's, of
the magnitudes a real chain gives), fla's stage on them, and each launch config (the pinned
one, and with ``sweep`` the entry's others): parity first -- against fla's stage and against
the float64 stage, with the entry's bars (``misses``) -- then the median of CUDA-event
timings, interleaved with fla's. Configs compile in parallel worker processes first, so a
sweep pays the compiler once per config across all CPU cores. Rows (``kind: stage``) go to
``benchmarks/results/stages.jsonl``; the README's stage table is generated from them, each
row's "ships" verdict from its entry's ``launch_config``. ``--candidate module:function`` times a
kernel not registered (kept under ``research/``, the stage's registry contract) in the entry's
place, on the same inputs and bars: its rows carry ``candidate`` and never ship.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from kernel_fun.kda.problems import problem

BANDWIDTH = 4.25e12  # the H200's measured copy rate


def entries():
    from benchmarks.stages import entries as stage_entries

    return stage_entries()


def config_label(design: str, config: dict) -> str:
    return design + "[" + ",".join(f"{k}={v}" for k, v in sorted(config.items())) + "]"


def _precompile(job):
    """Worker: compile one (stage, shape, config) by launching it on a small problem
    with the same head counts, dims and flags: B=2 and three chunks, so no integer argument
    is 1 where the full-size launch's is not (Triton specializes ints equal to 1) and the
    binary is the one the full-size launch uses."""
    entry, name, config = job
    os.environ.pop("TRITON_INTERPRET", None)
    bench = entries()[entry]
    p = dataclasses.replace(problem(name), B=2, T=192)
    try:
        bench.ours(bench.make_inputs(p, "cuda"), bench.launch_config(p, config))
        torch.cuda.synchronize()
    except Exception as err:  # reported again, as a row, when the config is benched
        print(f"compile failed: {config}: {str(err).splitlines()[0][:200]}", flush=True)
    return job


def precompile(jobs, workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    if not jobs:
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for _ in pool.map(_precompile, jobs):
            pass


def bench_shape(bench, name: str, candidates, reps: int, rounds: int, out_path: Path,
                device="cuda", timer=None) -> list[dict]:
    """Parity, then timings, of every candidate config (overrides of the pinned one) at shape
    ``name``; one row each and one for fla's stage, appended to ``out_path``. ``timer(fn,
    reps)`` returns milliseconds (CUDA events by default)."""
    from benchmarks import rows as results
    from benchmarks.parity import stage_errors
    from kernel_fun import versions
    from kernel_fun.bench.timing import cuda_times, summary

    timer = timer or cuda_times
    p = problem(name)
    t0 = time.perf_counter()
    inputs = bench.make_inputs(p, device)
    floor_ms = bench.bytes(p) / BANDWIDTH * 1e3
    fla_out = bench.fla(**inputs)
    nb = min(p.B, 2)  # the float64 stage on the first sequences
    # per-token tensors are [B, T, ...]; per-head parameters (A_log, dt_bias) are not sliced
    sub = {n: (t[:nb] if isinstance(t, torch.Tensor) and t.dim() >= 3 else t) for n, t in inputs.items()}
    # the float64 stage on the first sequences: per-token outputs are [B, T, ...]; a per-head
    # output (dA_log, dt_bias's gradient) sums every sequence, so it is held to the float64
    # stage only where the first sequences are all of them
    whole = nb == p.B

    def first(out):
        return tuple(None if t is None or (t.dim() < 3 and not whole) else (t[:nb] if t.dim() >= 3 else t)
                     for t in out)

    exact = first(bench.exact(**sub))
    fla_exact = stage_errors(bench.stage, first(fla_out), exact)
    # (where a run's time goes: the chain's inputs, fla's stage and the float64 one)
    print(f"{name}: inputs, fla's stage and the float64 stage in {time.perf_counter() - t0:.0f} s", flush=True)

    impls = {"fla": (lambda: bench.fla(**inputs), None)}
    checks = {"fla": {"ok": True, "vs_exact": fla_exact}}
    for overrides in candidates:
        try:
            config = bench.launch_config(p, overrides)
        except ValueError as err:  # a config this shape does not take
            print(f"{name}: {overrides} skipped ({err})", flush=True)
            continue
        label = config_label(bench.label, config)
        impls[label] = (None, config)
        try:
            out = bench.ours(inputs, config)
        except Exception as err:  # a config that cannot launch is a row too
            checks[label] = {"ok": False, "error": str(err).splitlines()[0][:300]}
            continue
        vs_fla = stage_errors(bench.stage, out, fla_out)
        vs_exact = stage_errors(bench.stage, first(out), exact)
        checks[label] = {"ok": not bench.misses(vs_exact, fla_exact, vs_fla), "vs_fla": vs_fla, "vs_exact": vs_exact}
        impls[label] = (lambda config=config: bench.ours(inputs, config), config)
        del out
    del fla_out, exact
    if device == "cuda":
        torch.cuda.empty_cache()

    times = {label: [] for label in impls}
    for label, (fn, _) in impls.items():  # warm-up
        if checks[label]["ok"]:
            fn()
    for _ in range(rounds):
        for label, (fn, _) in impls.items():
            if checks[label]["ok"]:
                times[label] += timer(fn, reps)
    rows = []
    info = versions()
    gpu = torch.cuda.get_device_name() if device == "cuda" else str(device)
    for label, (_, config) in impls.items():
        s = summary(times[label]) if times[label] else None
        row = {
            "kind": "stage", "stage": bench.stage, "shape": name, "problem": p.describe(), "impl": label,
            "design": bench.label if label != "fla" else "fla", "config": config,
            "ms": s["median"] if s else None, "spread_ms": [s["p10"], s["p90"]] if s else None,
            "reps": s["n"] if s else 0, "floor_ms": floor_ms, "bytes": bench.bytes(p),
            "parity": checks[label], "gpu": gpu, "versions": info,
            "fla_cache_mode": os.environ.get("FLA_CACHE_MODE", "disabled"),
            "commit": results.commit(), "date": results.now(),
            **({"candidate": bench.candidate} if bench.candidate and label != "fla" else {}),
        }
        results.append(out_path, row)
        rows.append(row)
    return rows


def as_candidate(bench, target: str):
    """The stage's entry with ``module:function`` (the stage's registry contract, a kernel
    kept under ``research/``) as its kernel: the same inputs, bytes, float64 stage and bars;
    no launch configs; its rows named by the target and marked ``candidate``."""
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    return dataclasses.replace(bench, label=f"candidate {target}", ours=lambda inputs, config: fn(**inputs),
                               launch_config=lambda p, overrides: {}, sweep=(), candidate=target)


def main(argv=None, stage: str | None = None) -> int:
    known = entries()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if stage is None:
        parser.add_argument("--stage", required=True, choices=sorted(known))
    parser.add_argument("--shapes", default="prod8192_gate")
    parser.add_argument("--configs", default="sweep",
                        help="'sweep' (the pinned config and the entry's others), 'pinned', or a JSON list of "
                             "config overrides")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--candidate", default=None, metavar="module:function",
                        help="a kernel kept under research/ (the stage's registry contract) timed in the entry's place")
    args = parser.parse_args(argv)
    bench = known[stage or args.stage]
    if args.candidate:
        bench = as_candidate(bench, args.candidate)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks import fla_configs
    from benchmarks import rows as results

    fla_configs.use_stored_configs(torch.cuda.get_device_name())
    if bench.candidate:  # (the candidate's build is its own: no launch configs)
        candidates = [{}]
    elif args.configs == "sweep":
        candidates = [{}] + list(bench.sweep)
    elif args.configs == "pinned":
        candidates = [{}]
    else:
        candidates = list(json.loads(args.configs))
    shapes = args.shapes.split(",")
    jobs, families = [], set()
    # one compile per binary: shapes that differ only in B and T share it (a candidate's build
    # is its own: nothing to precompile)
    for s in (shapes if bench.precompile and not bench.candidate else []):
        p = problem(s)
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("name", "B", "T")}
        for c in candidates:
            key = (repr(sorted(fields.items())), json.dumps(c, sort_keys=True))
            if key not in families:
                families.add(key)
                jobs.append((bench.name, s, c))
    t0 = time.perf_counter()
    precompile(jobs, args.workers)
    print(f"compiled {len(jobs)} kernel configs in {time.perf_counter() - t0:.0f} s", flush=True)
    out = args.out or results.RESULTS / "stages.jsonl"
    rows = []
    for name in shapes:
        rows += bench_shape(bench, name, candidates, args.reps, args.rounds, out)
        torch.cuda.empty_cache()
    print()
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] else "  RED"
        fla = next(x for x in rows if x["shape"] == r["shape"] and x["impl"] == "fla")
        speed = f"{fla['ms'] / r['ms']:.2f}x" if r["ms"] else ""
        print(f"{r['shape']:<14} {r['impl']:<80} {ms:>8} ms {speed:>6} floor {r['floor_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
