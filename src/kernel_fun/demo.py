"""Demo: a Kimi-Linear layer's KDA call, forward and backward, through kernel-fun.

``python -m kernel_fun.demo`` runs on the best device present:

- on a GPU: the production layer's flags (gate and q/k l2norm in the op) at a Hopper
  training shape; prints which implementation ran each stage, the error of o, the final
  state and every gradient against the float64 recurrence (at T=512), and fwd+bwd time
  against fla's ``chunk_kda`` in the same process;
- on a CPU: the same call at a small awkward shape (T=200, GVA, initial state), with the
  torch stage references -- and kernel-fun's Triton stages through the Triton interpreter.
"""

from __future__ import annotations

import os
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # Triton kernels run through the interpreter on the CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_fun import versions  # noqa: E402
from kernel_fun.kda import chunk_kda, last_record, reference as ref, stages  # noqa: E402
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd  # noqa: E402

CPU_PROBLEM = Problem("demo-cpu", 2, 200, 2, 4, 64, 64, initial_state=True, output_final_state=True)
GPU_CHECK = Problem("demo-check", 1, 512, 16, 16, 128, 256, initial_state=True, output_final_state=True)
GPU_TIME = Problem("demo-time", 4, 8192, 16, 16, 128, 256)


def stage_table(record) -> str:
    rows = [f"{'stage':<7} {'covers':<12} {'implementation':<15} what"]
    for name, stage in stages().items():
        impl = record.impl_of(name)
        if impl is None:
            continue
        note = f"  ({record.notes[name]})" if name in record.notes else ""
        rows.append(f"{name:<7} {'/'.join(stage.covers):<12} {impl:<15} {stage.title}{note}")
    return "\n".join(rows)


def error_table(p: Problem, device) -> tuple[str, bool]:
    kwargs = make_inputs(p, device=device, seed=0)
    ours = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    lines = [f"{'tensor':<12} {'rel. RMS error':>15} {'budget':>8}"]
    ok = True
    for name, want in oracle.items():
        if want is None:
            continue
        err = ref.rel_rms(ours[name], want)
        good = err <= ref.BUDGETS[name]
        ok &= good
        lines.append(f"{name:<12} {err:>15.2e} {ref.BUDGETS[name]:>8.3f}{'' if good else '  OVER'}")
    return stage_table(record) + "\n\n" + "\n".join(lines), ok


def time_against_fla(p: Problem) -> str:
    from kernel_fun import _fla
    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.kda.problems import cotangents, leaves

    kwargs = make_inputs(p, device="cuda", seed=1)
    do, _ = cotangents(torch.empty(p.B, p.T, p.HV, p.V, device="cuda", dtype=p.dtype), None)

    def fwd_bwd(fn):
        o, _ = fn(**kwargs)
        return torch.autograd.grad(o, list(leaves(kwargs).values()), do)

    out = []
    for name, fn in (("fla", _fla.chunk_kda()), ("kernel-fun", chunk_kda)):
        t0 = time.perf_counter()
        fwd_bwd(fn)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        times = summary(cuda_times(lambda: fwd_bwd(fn), 20))
        out.append((name, times["median"], first))
    (_, base, _), (_, ours, _) = out
    lines = [f"fwd+bwd at {p.describe()}:"]
    lines += [f"  {name:<11} {ms:8.2f} ms (median of 20; first call {first:.1f} s)" for name, ms, first in out]
    lines.append(f"  speedup     {base / ours:8.3f}x")
    return "\n".join(lines)


def main() -> int:
    info = versions()
    print("kernel-fun demo —", ", ".join(f"{k} {v}" for k, v in info.items()))
    if CUDA:
        print("(a fresh machine compiles and autotunes fla's kernels first: minutes)\n")
        text, ok = error_table(GPU_CHECK, "cuda")
        print(f"KDA fwd+bwd at {GPU_CHECK.describe()}, against the float64 recurrence:\n")
        print(text)
        print()
        print(time_against_fla(GPU_TIME))
    else:
        text, ok = error_table(CPU_PROBLEM, "cpu")
        print(f"KDA fwd+bwd at {CPU_PROBLEM.describe()} on the CPU, against the float64 recurrence:\n")
        print(text)
    print("\nall within fla's budgets" if ok else "\nOVER BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
