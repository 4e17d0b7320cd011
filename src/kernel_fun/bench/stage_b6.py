"""Stage-alone bench of B6 (the WY backward): fla's kernel against kernel-fun's designs.

``python -m kernel_fun.bench.stage_b6 --shapes prod8192_gate,kimi --configs sweep``

For each shape: B6's inputs (random, of the magnitudes a real chain gives: unit q/k rows,
a Kimi-style gate cumsum, a unit-lower-triangular Akk_inv), fla's stage on them, and each
(design, config): parity first -- against fla's stage (dq, dk, dv2 within 1e-4 relative
RMS; db, dg, dA within fla's budgets) and against the float64 stage without intermediate
roundings (within the budgets and within 10% of fla's own error) -- then the median of
CUDA-event timings, interleaved with fla's. Configs compile in parallel worker processes
first, so the sweep pays the compiler once per config across all CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from kernel_fun.kda.problems import problem

BANDWIDTH = 4.25e12  # measured H200 copy rate (anchors.md)

# The configs worth timing, chosen from the sm_90a compile report (tools/compile_report.py,
# docs/log/b6.md): fullk spills at every width, least at 8 warps.
SWEEP = {
    "fullk": [dict(BV=64, num_warps=8, num_stages=3),
              dict(BV=32, num_warps=8, num_stages=2), dict(BV=64, num_warps=8, num_stages=1),
              dict(BV=64, num_warps=8, num_stages=2), dict(BV=64, num_warps=16, num_stages=2),
              dict(BV=128, num_warps=8, num_stages=1), dict(BV=32, num_warps=16, num_stages=2)],
}


def b6_bytes(p) -> int:
    """The fewest bytes B6 moves: every input read once, every output written once."""
    tok_h, tok_hv, nt = p.B * p.T * p.H, p.B * p.T * p.HV, p.B * -(-p.T // 64) * p.HV
    reads = 2 * tok_h * p.K * 2 + 4 * tok_hv * p.V * 2 + tok_hv * p.K * 4 + tok_hv * 2 + tok_hv * 64 * 2
    reads += 2 * nt * p.K * p.V * 2
    writes = 3 * tok_hv * p.K * 4 + tok_hv * p.V * 2 + tok_hv * 4 + tok_hv * 64 * 4
    return reads + writes


def make_inputs(p, device, seed: int = 0) -> dict:
    from kernel_fun.kda import reference as ref

    gen = torch.Generator(device=device).manual_seed(seed)  # GB-sized draws stay on the device

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    B, T, H, HV, K, V = p.B, p.T, p.H, p.HV, p.K, p.V
    NT = -(-T // 64)
    q = torch.nn.functional.normalize(randn(B, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(B, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(HV * K, device=device).uniform_(-6.9, -2.3, generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    gc = ref.gate_cumsum(randn(B, T, HV, K), True, A_log, dt_bias)
    r = torch.arange(64, device=device)
    A = torch.where(r[:, None] > r[None, :], randn(B, NT, HV, 64, 64, scale=0.1, dtype=torch.float32), 0.0)
    A = (A + torch.eye(64, device=device)).permute(0, 1, 3, 2, 4).reshape(B, NT * 64, HV, 64)[:, :T]
    state = (V, K) if p.state_v_first else (K, V)  # the V-first layout of fla's layer
    return dict(
        q=q, k=k, v=randn(B, T, HV, V), v_new=randn(B, T, HV, V, scale=0.5), gc=gc.contiguous(),
        beta=torch.sigmoid(randn(B, T, HV, dtype=torch.float32)).bfloat16(), A=A.bfloat16().contiguous(),
        h=randn(B, NT, HV, *state, scale=0.1), do=randn(B, T, HV, V), dh=randn(B, NT, HV, *state, scale=0.1),
        dv=randn(B, T, HV, V), scale=K ** -0.5, chunk_size=64, cu_seqlens=None, chunk_indices=None,
        state_v_first=p.state_v_first,
    )


def _precompile(job):
    """Worker: compile one (shape, design, config) by launching it on a one-chunk problem
    with the same head counts and dims (T is not specialized, so the binary is the one the
    full-size launch uses)."""
    name, design, config = job
    os.environ.pop("TRITON_INTERPRET", None)
    from kernel_fun.kda.kernels import wy_bwd

    p = dataclasses.replace(problem(name), B=1, T=64)
    try:
        wy_bwd.wy_dqkg_bwd(**make_inputs(p, "cuda"), design=design, config=config)
        torch.cuda.synchronize()
    except Exception as err:  # reported again, as a row, when the config is benched
        print(f"compile failed: {design} {config}: {str(err).splitlines()[0][:200]}", flush=True)
    return job


def precompile(jobs, workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for job in pool.map(_precompile, jobs):
            pass


def config_label(design: str, config: dict) -> str:
    return design + "[" + ",".join(f"{k}={v}" for k, v in sorted(config.items())) + "]"


def bench_shape(name, candidates, reps, rounds, out_path):
    from kernel_fun import versions
    from kernel_fun.bench import results
    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels import wy_bwd
    from kernel_fun.kda.chain import _fla_wy_dqkg
    from kernel_fun.kda.parity import b6_misses, stage_errors

    p = problem(name)
    inputs = make_inputs(p, "cuda")
    floor_ms = b6_bytes(p) / BANDWIDTH * 1e3
    fla_out = _fla_wy_dqkg(**inputs)
    nb = min(p.B, 2)
    sub = {n: (t[:nb] if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    exact = ref.wy_dqkg_bwd(**{n: t for n, t in sub.items() if n != "chunk_indices"}, exact=True)
    fla_exact = stage_errors("B6", tuple(t[:nb] for t in fla_out), exact)
    torch.cuda.synchronize()

    impls = {"fla": (lambda: _fla_wy_dqkg(**inputs), None)}
    checks = {"fla": {"ok": True, "vs_exact": fla_exact}}
    for design, overrides in candidates:
        config = wy_bwd.launch_config(design, p.K, p.V, p.B * p.HV, overrides)
        label = config_label(design, config)
        impls[label] = (None, (design, config))
        try:
            out = wy_bwd.wy_dqkg_bwd(**inputs, design=design, config=config)
        except Exception as err:  # a config that cannot launch is a row too
            checks[label] = {"ok": False, "error": str(err).splitlines()[0][:300]}
            continue
        vs_fla = stage_errors("B6", out, fla_out)
        vs_exact = stage_errors("B6", tuple(t[:nb] for t in out), exact)
        ok = not b6_misses(vs_exact, fla_exact, vs_fla)
        checks[label] = {"ok": ok, "vs_fla": vs_fla, "vs_exact": vs_exact}
        impls[label] = (lambda design=design, config=config: wy_bwd.wy_dqkg_bwd(**inputs, design=design,
                                                                                 config=config), (design, config))
        del out
    del fla_out, exact
    torch.cuda.empty_cache()

    times = {label: [] for label in impls}
    for label, (fn, _) in impls.items():
        if checks[label]["ok"]:
            fn()
    for _ in range(rounds):
        for label, (fn, _) in impls.items():
            if checks[label]["ok"]:
                times[label] += cuda_times(fn, reps)
    rows = []
    info = versions()
    for label, (fn, dc) in impls.items():
        s = summary(times[label]) if times[label] else None
        row = {
            "kind": "stage", "stage": "B6", "shape": name, "problem": p.describe(), "impl": label,
            "design": dc[0] if dc else "fla", "config": dc[1] if dc else None,
            "ms": s["median"] if s else None, "spread_ms": [s["p10"], s["p90"]] if s else None,
            "reps": s["n"] if s else 0, "floor_ms": floor_ms, "bytes": b6_bytes(p),
            "parity": checks[label], "gpu": torch.cuda.get_device_name(), "versions": info,
            "fla_cache_mode": os.environ.get("FLA_CACHE_MODE", "disabled"),
            "commit": results.commit(), "date": results.now(),
        }
        results.append(out_path, row)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernel_fun.bench.stage_b6", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="prod8192_gate")
    parser.add_argument("--configs", default="sweep", help="'sweep', 'pinned', or a JSON list of [design, config]")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernel_fun.bench import fla_configs, results

    fla_configs.use_stored_configs(torch.cuda.get_device_name())
    if args.configs == "sweep":
        candidates = [(d, c) for d, cs in SWEEP.items() for c in cs]
    elif args.configs == "pinned":
        candidates = [("fullk", {})]
    else:
        candidates = [tuple(x) for x in json.loads(args.configs)]
    shapes = args.shapes.split(",")
    jobs, families = [], set()
    for s in shapes:  # one compile per binary: shapes that share head counts and dims share it
        p = problem(s)
        for d, c in candidates:
            key = (p.H, p.HV, p.K, p.V, d, json.dumps(c, sort_keys=True))
            if key not in families:
                families.add(key)
                jobs.append((s, d, c))
    precompile(jobs, args.workers)
    print(f"compiled {len(jobs)} kernel configs", flush=True)
    out = args.out or results.RESULTS / "stages.jsonl"
    rows = []
    for name in shapes:
        rows += bench_shape(name, candidates, args.reps, args.rounds, out)
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
