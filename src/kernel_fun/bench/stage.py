"""Stage-alone bench: one stage's kernel-fun kernel against fla's stage, for any stage that
has a bench entry.

``python -m kernel_fun.bench.stage --stage B6 --shapes prod8192_gate,kimi --configs sweep``

For each shape: the stage's inputs (its entry's ``make_inputs``: random, of the magnitudes a
real chain gives), fla's stage on them, and each (design, config): parity first -- against
fla's stage and against the float64 stage, with the entry's bars (``misses``) -- then the
median of CUDA-event timings, interleaved with fla's. Configs compile in parallel worker
processes first, so a sweep pays the compiler once per config across all CPU cores. Rows
(``kind: stage``) go to ``bench/results/stages.jsonl``; the README's stage table is
generated from them, each row's "ships" verdict from its entry's ``launch_config``.

A stage's entry is a ``StageBench`` in its own bench module (``bench/stage_b6.py`` for B6),
listed in ``entries()``: adding a kernel adds one module and one line there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernel_fun.kda.problems import Problem, problem

BANDWIDTH = 4.25e12  # measured H200 copy rate (anchors.md)


@dataclasses.dataclass(frozen=True)
class StageBench:
    """What the stage bench needs of one stage's kernel."""

    stage: str
    make_inputs: Callable[..., dict]  # (problem, device, seed) -> the stage's keyword inputs
    bytes: Callable[[Problem], int]  # the fewest bytes the stage moves
    fla: Callable[..., tuple]  # fla's stage, on the inputs
    exact: Callable[..., tuple]  # the float64 stage, on the inputs of the first sequences
    ours: Callable[..., tuple]  # (inputs, design, config) -> kernel-fun's outputs
    launch_config: Callable[..., dict]  # (problem, design, overrides) -> the config that runs
    misses: Callable[..., dict]  # (vs_exact, fla_vs_exact, vs_fla) -> the outputs over their bars
    sweep: dict[str, list[dict]]  # design -> configs worth timing
    designs: tuple[str, ...]  # what ships ("pinned": each with its pinned config)

    def ships(self, row: dict) -> bool:
        """The stage's kernel is registered and the row ran the config the launcher picks
        at its shape (rows from before fullk's launch-order switch carry no HEADS_FAST:
        fla's order)."""
        from kernel_fun.kda.stages import stages

        design = row.get("design")
        if design not in self.designs or "ours" not in stages()[self.stage].impls:
            return False
        try:
            picked = self.launch_config(problem(row["shape"]), design, None)
        except (KeyError, ValueError):  # a shape or design the launcher does not know
            return False
        config = dict(row.get("config") or {})
        if "HEADS_FAST" in picked:
            config.setdefault("HEADS_FAST", False)
        return config == picked


def qk_and_gate(p: Problem, device, seed: int):
    """What every stage entry's inputs start from, of the magnitudes a real chain gives:
    ``(randn, q, k, gc)`` with ``randn(*shape, scale=1.0, dtype=bf16)`` drawing on the device
    (GB-sized draws stay there), unit q/k rows in bf16, and the chunk cumsum (fp32) of a
    Kimi-style gate (A_log, dt_bias initialised as Kimi-Linear does; ``p.lower_bound``'s form
    where the problem has one)."""
    from kernel_fun.kda import reference as ref

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    B, T, H, HV, K = p.B, p.T, p.H, p.HV, p.K
    q = torch.nn.functional.normalize(randn(B, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(B, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(HV * K, device=device).uniform_(-6.9, -2.3, generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    gc = ref.gate_cumsum(randn(B, T, HV, K), True, A_log, dt_bias, lower_bound=p.lower_bound)
    return randn, q, k, gc.contiguous()


def chain_runs(p: Problem, device, seed: int, names: tuple[str, ...]) -> dict[str, tuple[dict, tuple]]:
    """(inputs, outputs) of the named stages in one forward through the reference stages
    (torch, on ``device``) at problem ``p``, so a stage's inputs are a real chain's (w and u a
    real WY transform's, the state bounded)."""
    from kernel_fun.kda import chunk_kda
    from kernel_fun.kda.problems import make_inputs as call_inputs
    from kernel_fun.kda.stages import capture_stages, use_impls

    kwargs = call_inputs(p, device=device, seed=seed, requires_grad=False)
    with torch.no_grad(), use_impls("reference"), capture_stages() as log:
        chunk_kda(**kwargs)
    return {name: (x, out) for name, _, x, out in log if name in names}


def chain_inputs(p: Problem, device, seed: int, names: tuple[str, ...]) -> dict[str, dict]:
    """The inputs the chain gives the named stages (``chain_runs``)."""
    return {name: x for name, (x, _) in chain_runs(p, device, seed, names).items()}


def entries() -> dict[str, StageBench]:
    """Every stage with a bench entry, by stage name."""
    from kernel_fun.bench import (stage_b1b2, stage_b2, stage_b3, stage_b6, stage_b7, stage_b7b9, stage_f1f6,
                                  stage_f3f6, stage_f7f8)

    return {"B1-B2": stage_b1b2.BENCH, "B2": stage_b2.BENCH, "B3": stage_b3.BENCH, "B6": stage_b6.BENCH, "B7": stage_b7.BENCH,
            "B7-B9": stage_b7b9.BENCH, "F1-F6": stage_f1f6.BENCH, "F3-F6": stage_f3f6.BENCH, "F7-F8": stage_f7f8.BENCH}


def config_label(design: str, config: dict) -> str:
    return design + "[" + ",".join(f"{k}={v}" for k, v in sorted(config.items())) + "]"


def _precompile(job):
    """Worker: compile one (stage, shape, design, config) by launching it on a small problem
    with the same head counts, dims and flags: B=2 and three chunks, so no integer argument
    is 1 where the full-size launch's is not (Triton specializes ints equal to 1) and the
    binary is the one the full-size launch uses."""
    stage, name, design, config = job
    os.environ.pop("TRITON_INTERPRET", None)
    bench = entries()[stage]
    p = dataclasses.replace(problem(name), B=2, T=192)
    try:
        bench.ours(bench.make_inputs(p, "cuda"), design, config)
        torch.cuda.synchronize()
    except Exception as err:  # reported again, as a row, when the config is benched
        print(f"compile failed: {design} {config}: {str(err).splitlines()[0][:200]}", flush=True)
    return job


def precompile(jobs, workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for _ in pool.map(_precompile, jobs):
            pass


def bench_shape(bench: StageBench, name: str, candidates, reps: int, rounds: int, out_path: Path,
                device="cuda", timer=None) -> list[dict]:
    """Parity, then timings, of every candidate (design, overrides) at shape ``name``; one
    row each and one for fla's stage, appended to ``out_path``. ``timer(fn, reps)`` returns
    milliseconds (CUDA events by default)."""
    from kernel_fun import versions
    from kernel_fun.bench import results
    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.kda.parity import stage_errors

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
    for design, overrides in candidates:
        try:
            config = bench.launch_config(p, design, overrides)
        except ValueError as err:  # a design this shape does not take
            print(f"{name}: {design} skipped ({err})", flush=True)
            continue
        label = config_label(design, config)
        impls[label] = (None, (design, config))
        try:
            out = bench.ours(inputs, design, config)
        except Exception as err:  # a config that cannot launch is a row too
            checks[label] = {"ok": False, "error": str(err).splitlines()[0][:300]}
            continue
        vs_fla = stage_errors(bench.stage, out, fla_out)
        vs_exact = stage_errors(bench.stage, first(out), exact)
        checks[label] = {"ok": not bench.misses(vs_exact, fla_exact, vs_fla), "vs_fla": vs_fla, "vs_exact": vs_exact}
        impls[label] = (lambda design=design, config=config: bench.ours(inputs, design, config), (design, config))
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
    for label, (_, dc) in impls.items():
        s = summary(times[label]) if times[label] else None
        row = {
            "kind": "stage", "stage": bench.stage, "shape": name, "problem": p.describe(), "impl": label,
            "design": dc[0] if dc else "fla", "config": dc[1] if dc else None,
            "ms": s["median"] if s else None, "spread_ms": [s["p10"], s["p90"]] if s else None,
            "reps": s["n"] if s else 0, "floor_ms": floor_ms, "bytes": bench.bytes(p),
            "parity": checks[label], "gpu": gpu, "versions": info,
            "fla_cache_mode": os.environ.get("FLA_CACHE_MODE", "disabled"),
            "commit": results.commit(), "date": results.now(),
        }
        results.append(out_path, row)
        rows.append(row)
    return rows


def main(argv=None, stage: str | None = None) -> int:
    known = entries()
    parser = argparse.ArgumentParser(prog="python -m kernel_fun.bench.stage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if stage is None:
        parser.add_argument("--stage", required=True, choices=sorted(known))
    parser.add_argument("--shapes", default="prod8192_gate")
    parser.add_argument("--configs", default="sweep", help="'sweep', 'pinned', or a JSON list of [design, config]")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    bench = known[stage or args.stage]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernel_fun.bench import fla_configs, results

    fla_configs.use_stored_configs(torch.cuda.get_device_name())
    if args.configs == "sweep":
        candidates = [(d, c) for d, cs in bench.sweep.items() for c in cs]
    elif args.configs == "pinned":
        candidates = [(d, {}) for d in bench.designs]
    else:
        candidates = [tuple(x) for x in json.loads(args.configs)]
    shapes = args.shapes.split(",")
    jobs, families = [], set()
    for s in shapes:  # one compile per binary: shapes that differ only in B and T share it
        p = problem(s)
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("name", "B", "T")}
        for d, c in candidates:
            key = (repr(sorted(fields.items())), d, json.dumps(c, sort_keys=True))
            if key not in families:
                families.add(key)
                jobs.append((bench.stage, s, d, c))
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
