"""The chain's own host time: what a ``chunk_kda`` call costs on the CPU around its kernels.

    python -m benchmarks.host_time                 # the table: forward, fwd+bwd, and the bare Function
    python -m benchmarks.host_time --out benchmarks/results/host_time.jsonl

Every stage is replaced by its captured output (one real call at a small shape first, with
the stage choices a supported call on an H200 makes: kernel-fun's where it has a kernel,
the other stages as fla's), so what is timed is only the Python around the kernels: the
op's validation and gate, the chain, the dispatcher, autograd. Beside it, a bare
``torch.autograd.Function`` with the same inputs whose forward returns a fresh tensor of
o's shape and whose backward returns stored gradients: the floor any op pays. The chain's
own time is the call minus that floor. Medians of ``--rounds`` rounds of ``--calls`` calls,
on this machine's CPU (no GPU needed; the figures move with the CPU, so compare before and
after on one machine).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

PROBLEM = dict(B=1, T=64, H=2, HV=2, K=16, V=16)


def _replaying(log: list):
    """Each stage's captured outputs, returned in the order the real call produced them."""
    from kernel_fun.kda.stages import registered, stages

    outs: dict[str, list] = {}
    for name, _, _, out in log:
        outs.setdefault(name, []).append(out)
    known = stages()
    contexts = []
    for name, seq in outs.items():
        impl = "ours" if "ours" in known[name].impls else "reference"

        def replay(_seq=seq, _turn=itertools.count(), **_inputs):
            return _seq[next(_turn) % len(_seq)]

        replay.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in known[name].inputs])
        contexts.append(registered(name, impl, replay))
    return contexts


class _Bare(torch.autograd.Function):
    """The floor: a Function taking the op's tensors, returning a fresh o, giving back stored
    gradients."""

    @staticmethod
    def forward(ctx, grads, q, k, v, g, beta, A_log, dt_bias):
        ctx.grads = grads
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, do):
        return (None, *ctx.grads)


def measure(calls: int = 200, rounds: int = 7) -> dict:
    """Median microseconds a call: ``forward`` and ``fwd_bwd`` of the chain with every stage
    replayed, and ``bare_forward`` / ``bare_fwd_bwd`` of the Function above."""
    import contextlib

    from kernel_fun.kda import chunk_kda
    from kernel_fun.kda.problems import Problem, make_inputs
    from kernel_fun.kda.stages import capture_stages

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the capture runs kernel-fun's stages through the "
                         "interpreter, so the chain takes the path a GPU call takes)")
    p = Problem("host", dtype=torch.bfloat16, **PROBLEM)
    kw = make_inputs(p, device="cpu", seed=0)
    leaves = {n: t for n, t in kw.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    with capture_stages() as log:
        o, _ = chunk_kda(**kw)
        o.float().sum().backward()
    grads = [leaves[n].grad.clone() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    do = torch.ones_like(o)

    def chain_fwd():
        with torch.no_grad():
            chunk_kda(**kw)

    def chain_step():
        out, _ = chunk_kda(**kw)
        out.backward(do)

    bare_args = [kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]

    def bare_fwd():
        with torch.no_grad():
            _Bare.apply(grads, *bare_args)

    def bare_step():
        _Bare.apply(grads, *bare_args).backward(do)

    def timed(fn) -> float:
        for _ in range(20):
            fn()
        per = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(per)

    with contextlib.ExitStack() as stack:
        for ctx in _replaying(log):
            stack.enter_context(ctx)
        got = dict(forward=timed(chain_fwd), fwd_bwd=timed(chain_step))
    got.update(bare_forward=timed(bare_fwd), bare_fwd_bwd=timed(bare_step))
    got.update(own_forward=got["forward"] - got["bare_forward"], own_fwd_bwd=got["fwd_bwd"] - got["bare_fwd_bwd"])
    return got


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    got = measure(args.calls, args.rounds)
    if args.out:
        from benchmarks import rows as results

        row = {"kind": "host_time", "commit": results.commit(), "date": results.now(), "torch": torch.__version__,
               "cpu": os.cpu_count(), "problem": PROBLEM, **{k: round(v, 1) for k, v in got.items()}}
        results.append(args.out, row)
    print("| us a call | chain (stages replayed) | bare autograd Function | the chain's own |")
    print("|---|---|---|---|")
    print(f"| forward | {got['forward']:.0f} | {got['bare_forward']:.0f} | {got['own_forward']:.0f} |")
    print(f"| fwd+bwd | {got['fwd_bwd']:.0f} | {got['bare_fwd_bwd']:.0f} | {got['own_fwd_bwd']:.0f} |")
    print(json.dumps({k: round(v, 1) for k, v in got.items()}))


if __name__ == "__main__":
    main()
