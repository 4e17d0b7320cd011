"""Does kernel-fun help on this GPU? The whole ``chunk_kda`` op, fla's against kernel-fun's, in
one process: ``python -m kernel_fun.bench [--shapes prod8192_gate,kimi]``.

For each named shape (``kernel_fun.kda.problems.SHAPES``, or a stage shape such as grid1024:
one 4096-token sequence on the production heads) and each implementation:

1. parity first: every output and gradient against fla's at the bench shape (bitwise for
   the all-fla control), and every implementation against the float64 recurrence at a
   smaller shape of the same family; a red gate prints no speed;
2. first-call seconds (the first fwd+bwd in this process: compile and autotune included
   for whichever implementation runs first) and peak memory of one fwd+bwd;
3. fwd and fwd+bwd time: median of CUDA-event timings after warm-up, with the 10th-90th
   percentile spread, the implementations interleaved round by round;
4. device time per stage from the profiler (kernel-fun's stage ranges; fla's kernels by
   name).

Each (shape, implementation) is one row (a dict); the command prints them as a table.
"""

from __future__ import annotations

import argparse
import sys
import time
import torch

from kernel_fun.bench.timing import cuda_times, summary

# Memory floors (ms): the bytes fla's stage chain moves, and a fused design's, at the H200's
# measured copy rate of 4.25 TB/s.
FLOORS_MS = {
    "prod8192_gate": {"fla_chain_fwd": 6.23, "fla_chain_fwdbwd": 20.59, "fused_fwdbwd": 9.0},
    "kimi": {"fla_chain_fwd": 4.84, "fla_chain_fwdbwd": 16.29, "fused_fwdbwd": 6.36},
}
# fla's layer flags move the same bytes (the V-first states are the same tensors transposed;
# beta's sigmoid adds 2 x 67 MB at prod8192): prod8192_gate's floors.
FLOORS_MS["prod8192_layer"] = FLOORS_MS["prod8192_layer_safe"] = FLOORS_MS["prod8192_gate"]
# (prod_packed: the same tokens and heads, 144 more chunk-heads where documents end mid-chunk)
FLOORS_MS["prod_packed"] = FLOORS_MS["prod8192_gate"]
ORACLE_T = 512


class Variant:
    def __init__(self, name: str, fn, force=None):
        self.name, self.fn, self.force = name, fn, force

    def __call__(self, **kwargs):
        if self.force is None:
            return self.fn(**kwargs)
        from kernel_fun.kda import use_impls

        with use_impls(self.force):
            return self.fn(**kwargs)


def variants(names: list[str], off: dict | None = None) -> list[Variant]:
    """The implementations by name; ``off`` ({stage: "fla"}) forces those stages of ``ours``
    onto fla's (a fused unit forced off runs the stages it covers, each its own choice)."""
    from kernel_fun import _fla
    from kernel_fun.kda import chunk_kda

    table = {
        "fla": Variant("fla", _fla.chunk_kda()),
        "chain_fla": Variant("chain_fla", chunk_kda, force="fla"),
        "ours": Variant("ours", chunk_kda, force=off or None),
    }
    return [table[n] for n in names]


def fwd_bwd(variant: Variant, kwargs: dict, do: torch.Tensor):
    from kernel_fun.kda.problems import leaves

    o, _ = variant(**kwargs)
    return torch.autograd.grad(o, list(leaves(kwargs).values()), do)


def parity(variants_: list[Variant], p, device, seed: int) -> dict[str, dict]:
    """Each variant against fla at the bench shape, and against the oracle at T=ORACLE_T."""
    from kernel_fun.kda import last_record
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import as_oracle_inputs, make_inputs, run_fwd_bwd, shrunk

    out = {v.name: {} for v in variants_}
    kw = make_inputs(p, device=device, seed=seed)
    results, records = {}, {}
    for v in variants_:
        results[v.name] = run_fwd_bwd(v, kw, grid=p.dtype)
        records[v.name] = last_record() if v.name != "fla" else None
    base = results.get("fla")
    for v in variants_:
        rec = records[v.name]
        if rec is not None:
            out[v.name]["engaged"] = rec.engaged
            out[v.name]["impls"] = {**rec.forward, **rec.backward}
        if base is not None and v.name != "fla":
            res = results[v.name]
            out[v.name]["bitwise_vs_fla"] = all(
                (res[n] is None and base[n] is None) or (res[n] is not None and torch.equal(res[n], base[n]))
                for n in base
            )
            out[v.name]["vs_fla"] = {n: ref.rel_rms(res[n], base[n]) for n in base if base[n] is not None}
    del results, base
    torch.cuda.empty_cache()

    small = shrunk(p, ORACLE_T)
    kw = make_inputs(small, device=device, seed=seed + 1)
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kw), grid=p.dtype)
    errors = {}
    # fla's own error is the yardstick even where fla is not timed
    for v in variants_ + ([] if any(v.name == "fla" for v in variants_) else variants(["fla"])):
        res = run_fwd_bwd(v, kw, grid=p.dtype)
        errors[v.name] = {n: ref.rel_rms(res[n], oracle[n]) for n in oracle if oracle[n] is not None}
    fla_err = errors.get("fla")
    for v in variants_:
        e = errors[v.name]
        out[v.name]["oracle_shape"] = small.describe()
        out[v.name]["vs_oracle"] = e
        # Within fla's budget, or no more than 10% over fla's own error on the same inputs.
        within = {n: e[n] <= ref.BUDGETS[n] or (fla_err is not None and e[n] <= 1.1 * fla_err[n]) for n in e}
        ok = all(within.values())
        if v.name == "chain_fla":
            ok = ok and out[v.name].get("bitwise_vs_fla", False)
        out[v.name]["ok"] = ok
        out[v.name]["over_budget"] = sorted(n for n in e if e[n] > ref.BUDGETS[n])
        out[v.name]["worse_than_fla"] = sorted(n for n, good in within.items() if not good)
    return out


def profile_stages(variant: Variant, kwargs: dict, do: torch.Tensor) -> tuple[dict, dict]:
    """(ms per kernel-fun stage, ms per kernel name) of one fwd+bwd: stages timed with CUDA
    events around each (empty for fla's own chunk_kda), kernels from the profiler."""
    from kernel_fun.bench.timing import kernel_profile
    from kernel_fun.kda.stages import stage_ms, time_stages

    with time_stages() as marks:
        fwd_bwd(variant, kwargs, do)
    stages = stage_ms(marks)
    kernels = kernel_profile(lambda: fwd_bwd(variant, kwargs, do))["kernel_ms"]
    return stages, kernels


def bench_shape(name: str, names: list[str], reps: int, rounds: int, seed: int = 0,
                off: dict | None = None) -> list[dict]:
    """One row per implementation at shape ``name``: parity first (a red gate times nothing),
    first-call seconds, peak memory, fwd and fwd+bwd timings interleaved round by round, and
    device time per stage. ``off`` ({stage: "fla"}) forces those stages of ``ours`` onto fla's."""
    from kernel_fun import versions
    from kernel_fun.kda.problems import cotangents, make_inputs, problem

    p = problem(name)
    device = torch.device("cuda")
    vs = variants(names, off)
    kw = make_inputs(p, device=device, seed=seed)
    o_shape = torch.empty(p.B, p.T, p.HV, p.V, device=device, dtype=p.dtype)
    do, _ = cotangents(o_shape, None, seed=seed + 7)
    del o_shape

    first_call = {}
    for v in vs:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd_bwd(v, kw, do)
        torch.cuda.synchronize()
        first_call[v.name] = time.perf_counter() - t0
    print(f"[{name}] first calls (s): {first_call}", flush=True)

    checks = parity(vs, p, device, seed)
    print(f"[{name}] parity: " + ", ".join(f"{k}: {'ok' if c['ok'] else 'RED ' + str(c['worse_than_fla'])}"
                                           for k, c in checks.items()), flush=True)

    peaks = {}
    for v in vs:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(v, kw, do)
        torch.cuda.synchronize()
        peaks[v.name] = torch.cuda.max_memory_allocated() / 2**30

    fwd_times = {v.name: [] for v in vs}
    fb_times = {v.name: [] for v in vs}
    for v in vs:  # warm-up
        for _ in range(3):
            fwd_bwd(v, kw, do)
    for _ in range(rounds):
        for v in vs:
            if not checks[v.name]["ok"]:
                continue
            fwd_times[v.name] += cuda_times(lambda: v(**kw), reps)
            fb_times[v.name] += cuda_times(lambda: fwd_bwd(v, kw, do), reps)

    rows = []
    info = versions()
    for v in vs:
        try:
            stage_ms, kernel_ms = profile_stages(v, kw, do)
        except Exception as err:  # a broken profiler must not cost the timings
            stage_ms, kernel_ms = {"error": repr(err)}, {}
        ok = checks[v.name]["ok"]
        fwd = summary(fwd_times[v.name]) if ok else None
        fb = summary(fb_times[v.name]) if ok else None
        rows.append({
            "kind": "chunk_kda",
            "shape": name,
            "problem": p.describe(),
            "impl": v.name,
            "fwd_ms": fwd["median"] if fwd else None,
            "fwd_spread_ms": [fwd["p10"], fwd["p90"]] if fwd else None,
            "fwdbwd_ms": fb["median"] if fb else None,
            "fwdbwd_spread_ms": [fb["p10"], fb["p90"]] if fb else None,
            "reps": fb["n"] if fb else 0,
            "stage_ms": stage_ms,
            "kernel_ms": kernel_ms,
            "first_call_s": first_call[v.name],
            "first_call_cold": v is vs[0],
            "peak_gib": peaks[v.name],
            "parity": checks[v.name],
            "floors_ms": FLOORS_MS.get(name),
            "gpu": torch.cuda.get_device_name(),
            "versions": info,
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as a short table: each implementation against fla's row of its shape."""
    fla = {r["shape"]: r for r in rows if r["impl"] == "fla"}
    lines = [f"{'shape':<22} {'implementation':<10} {'fwd ms':>8} {'fwd+bwd ms':>11} {'vs fla':>8} {'peak GiB':>9}  parity"]
    for r in rows:
        base = fla.get(r["shape"])
        ratio = (f"{base['fwdbwd_ms'] / r['fwdbwd_ms']:.3f}x" if base and base.get("fwdbwd_ms") and r.get("fwdbwd_ms")
                 else "-")
        fwd = f"{r['fwd_ms']:.2f}" if r.get("fwd_ms") else "-"
        fb = f"{r['fwdbwd_ms']:.2f}" if r.get("fwdbwd_ms") else "-"
        parity = "ok" if r["parity"]["ok"] else "RED " + ", ".join(r["parity"].get("worse_than_fla", []))
        lines.append(f"{r['shape']:<22} {r['impl']:<10} {fwd:>8} {fb:>11} {ratio:>8} {r['peak_gib']:>9.2f}  {parity}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from kernel_fun.kda.problems import SHAPES, STAGE_SHAPES

    out = argparse.ArgumentParser(prog="python -m kernel_fun.bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--shapes", default="prod8192_gate",
                     help=f"comma list of {sorted(SHAPES)} or stage shapes ({sorted(STAGE_SHAPES)}); "
                          "'all' is the first list")
    out.add_argument("--impls", default="fla,chain_fla,ours", help="comma list of fla, chain_fla, ours")
    out.add_argument("--reps", type=int, default=10, help="timed calls per round")
    out.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    return out


def shapes_of(arg: str) -> list[str]:
    from kernel_fun.kda.problems import SHAPES

    return sorted(SHAPES) if arg == "all" else arg.split(",")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_fun.bench needs a CUDA GPU; `python -m kernel_fun.demo` runs anywhere.", file=sys.stderr)
        return 2
    rows = []
    for name in shapes_of(args.shapes):
        rows += bench_shape(name, args.impls.split(","), args.reps, args.rounds)
        torch.cuda.empty_cache()
    print()
    print(format_rows(rows))
    return 0 if all(r["parity"]["ok"] for r in rows) else 1
