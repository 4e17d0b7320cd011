"""A training step's other costs, on the GPU: compiling, CUDA graphs, the first step, a real run.

    python -m benchmarks.step first --side fla|ours    # a fresh process, empty caches
    python -m benchmarks.step compile                   # fla's layer and a plain module, compiled
    python -m benchmarks.step graphs                    # fwd+bwd captured in CUDA graphs
    python -m benchmarks.step train [--steps 300]       # a small KDA model, with and without patch_fla

Every result is one JSON line, printed and appended to ``--out`` (default
``$OUT/step.jsonl`` when ``OUT`` is set, else ``benchmarks/results/step.jsonl``).

- ``first``: the first fwd+bwd of fla's ``KimiDeltaAttention`` (fla's defaults: hidden 2048,
  16 heads, head dims 128) at B1 T8192, fla's own or through ``patch_fla()``, in a process
  whose Triton cache and fla autotune cache are empty (a fresh machine). Each Triton kernel's
  first launch is timed on the host (compiling and autotuning are host time, and the
  autotuner's benchmarks end in a sync), so the row says where the first step's time went.
- ``compile``: fla's layer at B2 T8192, eager and ``torch.compile``d, fla's own and
  patched: graph breaks counted (``torch._dynamo.explain``), parity against fla's eager
  layer, fwd+bwd timed round by round in one process. The same for a plain module of the
  layer's core calling kernel-fun's two operators (``fullgraph=True``) or fla's functions.
- ``graphs``: the op's fwd+bwd at host-bound shapes, eager (fla's and ours), captured with
  ``torch.cuda.graph`` and through ``mode="reduce-overhead"``; each replay on new inputs held
  to an eager call on those inputs bit for bit, then timed back to back.
- ``train``: a 4-layer ``KDAForCausalLM`` (hidden 2048, 16 heads of 128, vocab 4096) trained on
  a fixed synthetic token stream: fla twice with one seed (its run-to-run spread), fla with
  its initial weights moved by bf16 rounding (how far a rounding-level change drifts), and
  through ``patch_fla()``; a row per run (every step's loss, the step time).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _out_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "step.jsonl"
    return RESULTS / "step.jsonl"


class Log:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, row: dict) -> dict:
        from benchmarks import rows

        row = rows.stamp({**row, "fla_cache_mode": os.environ.get("FLA_CACHE_MODE", "disabled"),
                          "fla_config_dir": os.environ.get("FLA_CONFIG_DIR")})
        line = json.dumps(row, default=str)
        print(line[:2000], flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
        return row


def _stored_configs() -> None:
    from benchmarks import fla_configs

    fla_configs.use_stored_configs(torch.cuda.get_device_name())


def _sync_ms(fn, reps: int) -> float:
    """Milliseconds a call, ``reps`` calls back to back between two syncs: the host's time
    when the host is the bottleneck, the GPU's when it is not."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


def _timed_rounds(fns: dict, reps: int, rounds: int) -> dict:
    """The median over ``rounds`` of ``_sync_ms`` per entry, the entries interleaved round by
    round; each entry a (context, fn) pair."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (context, fn) in fns.items():
            with context():
                times[name].append(_sync_ms(fn, reps))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _device_profile(fns: dict, top: int = 8) -> dict:
    """Per entry, one warmed call under the profiler: the device time of its kernels summed
    (against the wall time ``_timed_rounds`` gives, what is not device time is the host's or
    a gap) and its ``top`` kernels by device time; each entry a (context, fn) pair."""
    from kernel_fun.bench.timing import kernel_profile

    out = {}
    for name, (context, fn) in fns.items():
        with context():
            fn()
            torch.cuda.synchronize()
            prof = kernel_profile(fn, top)
        out[name] = {"device_ms": round(prof["kernels_sum_ms"], 4), "kernels": prof["kernels"],
                     "top": [[n[:80], round(ms, 4)] for n, ms in prof["kernel_ms"].items()]}
    return out


# --------------------------------------------------------------------------------------
# first: the first step on a fresh machine
# --------------------------------------------------------------------------------------
class _FirstLaunches:
    """Host seconds of every Triton kernel's top-level launches (an autotuner's, a heuristics
    wrapper's or a plain kernel's), by kernel name; nested launches (the autotuner's trials)
    count in their caller's."""

    def __init__(self):
        from triton.runtime import autotuner, jit

        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.owner: dict[str, str] = {}
        self._depth = 0
        self._saved = []
        classes = [jit.JITFunction, autotuner.Autotuner, autotuner.Heuristics]
        try:
            from fla.ops.utils.cache import CachedAutotuner

            classes.append(CachedAutotuner)
        except ImportError:
            pass
        for cls in classes:
            if "run" in vars(cls):
                self._saved.append((cls, vars(cls)["run"]))
                setattr(cls, "run", self._wrap(vars(cls)["run"]))

    @staticmethod
    def _name(obj) -> tuple[str, str]:
        fn = obj
        for _ in range(4):
            inner = getattr(fn, "fn", None)
            if inner is None:
                break
            fn = inner
        name = getattr(fn, "__name__", None) or type(obj).__name__
        return name, getattr(fn, "__module__", "") or ""

    def _wrap(self, run):
        def timed(obj, *args, **kwargs):
            if self._depth:
                return run(obj, *args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return run(obj, *args, **kwargs)
            finally:
                self._depth -= 1
                name, module = self._name(obj)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
                self.owner[name] = module

        return timed

    def close(self) -> None:
        for cls, run in self._saved:
            setattr(cls, "run", run)

    def table(self) -> list[dict]:
        return sorted(({"kernel": n, "module": self.owner[n], "s": round(s, 3), "launches": self.calls[n]}
                       for n, s in self.seconds.items()), key=lambda r: -r["s"])


def first(args, log: Log) -> int:
    t0 = time.perf_counter()
    import fla  # noqa: F401

    import kernel_fun
    from kernel_fun.bench.layer import fla_layer, fwd_bwd

    import_s = time.perf_counter() - t0
    torch.cuda.init()
    torch.empty(1, device="cuda")
    if args.side == "ours":
        kernel_fun.patch_fla()
    layer = fla_layer()
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.B, args.T, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = torch.randn(args.B, args.T, 2048, device="cuda", generator=gen)
    torch.cuda.synchronize()
    launches = _FirstLaunches()
    t1 = time.perf_counter()
    fwd_bwd(layer, x, w)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t1
    launches.close()
    t2 = time.perf_counter()
    fwd_bwd(layer, x, w)
    torch.cuda.synchronize()
    second_s = time.perf_counter() - t2
    steady = _sync_ms(lambda: fwd_bwd(layer, x, w), 10)
    table = launches.table()
    row = {"kind": "first_step", "impl": args.side, "shape": f"kda_layer_B{args.B}_T{args.T}",
           "import_s": round(import_s, 2), "first_step_s": round(first_s, 2), "second_step_s": round(second_s, 3),
           "steady_ms": round(steady, 2),
           "kernels_s": round(sum(r["s"] for r in table), 2),
           "fla_kernels_s": round(sum(r["s"] for r in table if r["module"].startswith("fla")), 2),
           "ours_kernels_s": round(sum(r["s"] for r in table if r["module"].startswith("kernel_fun")), 2),
           "kernels": table, "triton_cache": os.environ.get("TRITON_CACHE_DIR"), "gpu": torch.cuda.get_device_name()}
    if args.side == "ours":
        from kernel_fun.cconv import last_route
        from kernel_fun.kda import last_record

        record = last_record()
        row["witness"] = {"engaged": record.engaged, "impls": {**record.forward, **record.backward},
                          "convolutions": last_route()}
    log(row)
    if args.dump_fla_configs:  # (fla's choices, for the later runs on this machine: KERNEL_FUN_FLA_CONFIGS)
        from benchmarks import fla_configs

        fla_configs.dump(fla_configs.gpu_dir(torch.cuda.get_device_name()))
    return 0


# --------------------------------------------------------------------------------------
# compile: fla's layer and a plain module under torch.compile
# --------------------------------------------------------------------------------------
def _explain(fn, *args, **kwargs) -> dict:
    torch._dynamo.reset()
    e = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = []
    for r in e.break_reasons:
        frame = r.user_stack[-1] if getattr(r, "user_stack", None) else None
        reasons.append(f"{r.reason[:160]}" + (f" @ {frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
                                             if frame else ""))
    return {"graphs": e.graph_count, "breaks": e.graph_break_count, "reasons": reasons[:8]}


class Core(torch.nn.Module):
    """The core of a KDA layer (fla's defaults: hidden 2048, 16 heads of 128): q, k, v
    projections through short convolutions (silu), the low-rank gate projection, beta's,
    ``chunk_kda`` with the gate, l2norm and beta's sigmoid in the op, an RMS norm and the
    output projection; its two ops kernel-fun's or fla's."""

    def __init__(self, chunk_kda, causal_conv1d, H=16, K=128, C=2048):
        super().__init__()
        self.chunk_kda, self.causal_conv1d, self.H, self.K = chunk_kda, causal_conv1d, H, K
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q, self.k, self.v = lin(C, H * K), lin(C, H * K), lin(C, H * K)
        self.conv = torch.nn.Parameter(torch.randn(3, H * K, 4) * 0.3)
        self.f = torch.nn.Sequential(lin(C, K), lin(K, H * K))
        self.b = lin(C, H)
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        self.dt_bias = torch.nn.Parameter(torch.zeros(H * K))
        self.o = lin(H * K, C)

    def forward(self, x):
        B, T, _ = x.shape
        H, K = self.H, self.K

        def conv(t, i):
            return self.causal_conv1d(t, self.conv[i], activation="silu")[0].view(B, T, H, K)

        q, k, v = conv(self.q(x), 0), conv(self.k(x), 1), conv(self.v(x), 2)
        o, _ = self.chunk_kda(q, k, v, self.f(x).view(B, T, H, K), self.b(x).view(B, T, H),
                              A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True,
                              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        return self.o(torch.nn.functional.rms_norm(o, (K,)).flatten(2)), None


def compile_(args, log: Log) -> int:
    _stored_configs()
    from kernel_fun import _fla
    from kernel_fun.bench.layer import fla_layer, fwd_bwd, layer_grads, parity_misses
    from kernel_fun.cconv import causal_conv1d as our_conv
    from kernel_fun.cconv import last_route
    from kernel_fun.kda import chunk_kda as our_kda
    from kernel_fun.kda import last_record
    from kernel_fun.kda import reference as ref
    from kernel_fun.patch import fla_patched

    torch._dynamo.config.cache_size_limit = 64
    B, T = args.B, args.T
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = torch.randn(B, T, 2048, device="cuda", generator=gen)
    fla_side = fla_layer()
    ours_side = copy.deepcopy(fla_side)
    none = contextlib.nullcontext

    # fla's layer: eager, compiled; fla's own and patched
    fla_eager = layer_grads(fla_side, x, w)
    breaks = {"fla": _explain(fla_side, x)}
    fla_compiled = torch.compile(fla_side)
    got = layer_grads(fla_side, x, w, call=fla_compiled)
    vs = {n: ref.rel_rms(got[n], fla_eager[n]) for n in fla_eager}
    with fla_patched():
        breaks["ours"] = _explain(ours_side, x)
        ours_compiled = torch.compile(ours_side)
        ours_eager_g = layer_grads(ours_side, x, w)
        ours_g = layer_grads(ours_side, x, w, call=ours_compiled)
        record, conv = last_record(), last_route()
    errors, misses = parity_misses(ours_g, fla_eager)
    same = all(torch.equal(ours_g[n], ours_eager_g[n]) for n in ours_g)
    del got, ours_g, ours_eager_g
    step = lambda layer: (lambda: fwd_bwd(layer, x, w))  # noqa: E731
    fns = {"fla_eager": (none, step(fla_side)), "fla_compiled": (none, step(fla_compiled)),
           "ours_eager": (fla_patched, step(ours_side)), "ours_compiled": (fla_patched, step(ours_compiled))}
    for _, (context, fn) in fns.items():
        with context():
            fn(), fn()
    times = _timed_rounds(fns, args.reps, args.rounds)
    log({"kind": "compile_layer", "shape": f"kda_layer_B{B}_T{T}", "ms": times, "profile": _device_profile(fns),
         "breaks": breaks,
         "parity": {"ok": not misses and record.engaged, "vs_fla_eager": errors, "misses": misses,
                    "compiled_equals_eager": same, "fla_compiled_vs_fla_eager": vs,
                    "impls": {**record.forward, **record.backward}, "convolutions": conv},
         "gpu": torch.cuda.get_device_name()})
    del fla_eager

    # a plain module calling the two operators (ours: fullgraph=True)
    torch.manual_seed(0)
    ours_core = Core(our_kda, our_conv).cuda().bfloat16()
    fla_core = copy.deepcopy(ours_core)
    fla_core.chunk_kda, fla_core.causal_conv1d = _fla.chunk_kda(), _fla.causal_conv1d()
    core_breaks = {"fla": _explain(fla_core, x), "ours": _explain(ours_core, x)}
    torch._dynamo.reset()
    compiled = {"ours": torch.compile(ours_core, fullgraph=True), "fla": torch.compile(fla_core)}
    grads = {"fla_eager": layer_grads(fla_core, x, w), "ours_eager": layer_grads(ours_core, x, w),
             "ours_compiled": layer_grads(ours_core, x, w, call=compiled["ours"]),
             "fla_compiled": layer_grads(fla_core, x, w, call=compiled["fla"])}
    record, conv = last_record(), last_route()
    core_errors = {n: ref.rel_rms(grads["ours_compiled"][n], grads["fla_eager"][n]) for n in grads["fla_eager"]}
    core_same = all(torch.equal(grads["ours_compiled"][n], grads["ours_eager"][n]) for n in grads["ours_eager"])
    del grads
    fns = {"fla_eager": (none, step(fla_core)), "fla_compiled": (none, step(compiled["fla"])),
           "ours_eager": (none, step(ours_core)), "ours_compiled": (none, step(compiled["ours"]))}
    for _, (context, fn) in fns.items():
        fn(), fn()
    times = _timed_rounds(fns, args.reps, args.rounds)
    log({"kind": "compile_core", "shape": f"kda_core_B{B}_T{T}", "ms": times, "profile": _device_profile(fns),
         "breaks": core_breaks,
         "parity": {"vs_fla_eager": core_errors, "compiled_equals_eager": core_same,
                    "engaged": record.engaged, "impls": {**record.forward, **record.backward},
                    "convolutions": conv},
         "gpu": torch.cuda.get_device_name()})
    return 0


# --------------------------------------------------------------------------------------
# graphs: fwd+bwd in CUDA graphs
# --------------------------------------------------------------------------------------
GRAPH_SHAPES = {
    "small": dict(B=4, T=8192, H=8, HV=8, K=128, V=256),
    "grid1024": dict(B=1, T=4096, H=16, HV=16, K=128, V=256),
    "t4096v128": dict(B=1, T=4096, H=16, HV=16, K=128, V=128),
    "grid1024_packed": dict(B=1, T=4096, H=16, HV=16, K=128, V=256, cu_seqlens=(0, 700, 2100, 2500, 4096)),
}


def _error_text(err: BaseException) -> str:
    """The error and the innermost frames of its traceback (where a traced call failed)."""
    import traceback

    frames = traceback.format_exception(type(err), err, err.__traceback__)
    return f"{type(err).__name__}: {str(err)[:1500]} || " + "".join(frames)[-3000:]


def _captured(fn, static: dict, leaves: dict, cot: list):
    """fwd+bwd of ``fn(**static)`` captured in a CUDA graph: (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            o, s = fn(**static)
            torch.autograd.grad([o] + ([s] if s is not None else []), list(leaves.values()), cot[: 1 + (s is not None)])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = fn(**static)
        grads = torch.autograd.grad([o] + ([s] if s is not None else []), list(leaves.values()),
                                    cot[: 1 + (s is not None)])
    return graph, [o] + list(grads)


def graphs(args, log: Log) -> int:
    _stored_configs()
    from kernel_fun import _fla
    from kernel_fun.kda import chunk_kda, last_record
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import Problem, cotangents, leaves, make_inputs

    fla_kda = _fla.chunk_kda()
    for name in args.shapes.split(","):
        dims = dict(GRAPH_SHAPES[name])
        p = Problem(name, output_final_state=False, **dims)
        kw = make_inputs(p, device="cuda", seed=0)
        if "cu_seqlens" in kw:
            kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
        fresh = make_inputs(p, device="cuda", seed=7)
        if "cu_seqlens" in fresh:
            fresh["cu_seqlens_cpu"] = fresh["cu_seqlens"].cpu()
        o0, _ = chunk_kda(**kw)
        cot = [cotangents(o0, None, seed=1)[0]]

        def eager(fn, inputs):
            o, _ = fn(**inputs)
            return [o] + list(torch.autograd.grad([o], list(leaves(inputs).values()), cot))

        want = eager(chunk_kda, fresh)
        fla_want = eager(fla_kda, {n: t for n, t in fresh.items() if n != "cu_seqlens_cpu"})
        row = {"kind": "graphs", "shape": name, "problem": p.describe(), "ms": {}, "ok": {}, "errors": {},
               "gpu": torch.cuda.get_device_name()}
        row["vs_fla_eager"] = {i: ref.rel_rms(a, b) for i, (a, b) in enumerate(zip(want, fla_want))}
        fns = {"fla_eager": lambda: eager(fla_kda, {n: t for n, t in kw.items() if n != "cu_seqlens_cpu"}),
               "ours_eager": lambda: eager(chunk_kda, kw)}

        def copy_in(dst: dict, src: dict):
            with torch.no_grad():
                for n, t in src.items():
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        dst[n].copy_(t)

        # torch.cuda.graph: ours, and fla's where it can be captured
        for side, fn in (("ours", chunk_kda),) + ((("fla", fla_kda),) if args.fla_graphs else ()):
            static = {n: (t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t)
                      for n, t in kw.items() if side == "ours" or n != "cu_seqlens_cpu"}
            try:
                graph, outs = _captured(fn, static, leaves(static), cot)
                copy_in(static, fresh)
                graph.replay()
                ref_outs = want if side == "ours" else fla_want
                row["ok"][f"{side}_graph"] = all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
                fns[f"{side}_graph"] = graph.replay
                if side == "ours":
                    row["witness"] = {k: v for k, v in {**last_record().forward, **last_record().backward}.items()}
            except Exception as err:  # (fla's call may not be capturable: recorded, not fatal)
                row["errors"][f"{side}_graph"] = _error_text(err)
                torch.cuda.synchronize()

        # mode="reduce-overhead": cudagraph trees over the compiled forward and backward
        try:
            torch._dynamo.reset()
            compiled = torch.compile(chunk_kda, mode="reduce-overhead", fullgraph=True)

            def ro_step(inputs):
                torch.compiler.cudagraph_mark_step_begin()
                return eager(compiled, inputs)

            for _ in range(3):
                ro_step(kw)
            got = ro_step(fresh)
            row["ok"]["ours_reduce_overhead"] = all(torch.equal(a, b) for a, b in zip(got, want))
            fns["ours_reduce_overhead"] = lambda: ro_step(kw)
            row["cudagraph_skips"] = dict(torch._dynamo.utils.counters.get("inductor", {}))
        except Exception as err:
            row["errors"]["ours_reduce_overhead"] = _error_text(err)
        for fn in fns.values():
            fn()
        times = _timed_rounds({n: (contextlib.nullcontext, fn) for n, fn in fns.items()}, args.reps, args.rounds)
        row["ms"] = {n: round(t, 4) for n, t in times.items()}
        log(row)
        del fns, want, fla_want
        torch.cuda.empty_cache()
    return 0


# --------------------------------------------------------------------------------------
# train: a small KDA model, with and without patch_fla
# --------------------------------------------------------------------------------------
def _token_stream(steps: int, B: int, T: int, vocab: int, seed: int) -> torch.Tensor:
    """(steps, B, T) tokens: each sequence a walk of a fixed sparse Markov chain (4 successors
    a token) over its first half, the same walk again over its second (learnable locally by
    the convolutions, and at long range by recall)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=gen).cuda()
    n = steps * B
    half = T // 2
    walk = torch.empty(n, half, dtype=torch.long, device="cuda")
    walk[:, 0] = torch.randint(0, vocab, (n,), generator=gen).cuda()
    choice = torch.randint(0, 4, (n, half), generator=gen).cuda()
    for t in range(1, half):
        walk[:, t] = succ[walk[:, t - 1], choice[:, t]]
    return torch.cat([walk, walk], dim=1).view(steps, B, T)


def _train_once(label: str, tokens: torch.Tensor, args, perturb: bool, patched: bool) -> dict:
    from fla.models import KDAConfig, KDAForCausalLM

    from kernel_fun.patch import fla_patched

    torch.manual_seed(args.seed)
    config = KDAConfig(hidden_size=2048, num_heads=16, head_dim=128, num_hidden_layers=args.layers,
                       vocab_size=args.vocab, max_position_embeddings=tokens.shape[-1])
    model = KDAForCausalLM(config)
    if perturb:  # every initial weight moved by about one bf16 rounding step
        gen = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + torch.randn(p.shape, generator=gen) * 2.0 ** -9)
    model = model.cuda()
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = torch.optim.AdamW(master, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    losses, step_ms = [], []
    context = fla_patched if patched else contextlib.nullcontext
    with context():
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ids = tokens[step]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            with torch.no_grad():
                for m, p in zip(master, params):
                    m.grad = p.grad.float() if p.grad is not None else None
                    p.grad = None
                torch.nn.utils.clip_grad_norm_(master, 1.0)
                opt.step()
                sched.step()
                for m, p in zip(master, params):
                    p.copy_(m)
            losses.append(loss.item())
            step_ms.append((time.perf_counter() - t0) * 1e3)
        witness = None
        if patched:
            from kernel_fun.cconv import last_route
            from kernel_fun.kda import last_record

            record = last_record()
            witness = {"engaged": record.engaged, "impls": {**record.forward, **record.backward},
                       "convolutions": last_route()}
    tail = sorted(step_ms[10:])
    return {"kind": "train", "run": label, "losses": losses, "step_ms_median": tail[len(tail) // 2],
            "first_step_ms": step_ms[0], "witness": witness,
            "model": f"KDAForCausalLM {args.layers} layers, hidden 2048, 16 heads of 128, vocab {args.vocab}",
            "batch": list(tokens.shape[1:]), "steps": args.steps, "lr": args.lr, "seed": args.seed,
            "gpu": torch.cuda.get_device_name()}


def train(args, log: Log) -> int:
    _stored_configs()
    tokens = _token_stream(args.steps, args.B, args.T, args.vocab, seed=1234)
    runs = [("fla", False, False), ("fla_again", False, False), ("ours", False, True),
            ("fla_rounding", True, False)]
    for label, perturb, patched in runs:
        row = _train_once(label, tokens, args, perturb, patched)
        log(row)
        torch.cuda.empty_cache()
    return 0


def plot(path: Path, out: Path) -> None:
    """The loss curves of the newest ``train`` rows, side by side, into ``out`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "train":
            runs[row["run"]] = row
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    base = runs["fla"]["losses"]
    for name, row in runs.items():
        top.plot(row["losses"], label=f"{name} ({row['step_ms_median']:.0f} ms/step)", lw=1)
        if name != "fla":
            bottom.plot([a - b for a, b in zip(row["losses"], base)], label=f"{name} - fla", lw=1)
    top.set_ylabel("loss")
    top.set_yscale("log")
    top.legend()
    top.set_title(next(iter(runs.values()))["model"], fontsize=9)
    bottom.set_ylabel("loss difference")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["first", "compile", "graphs", "train", "plot"])
    parser.add_argument("--side", choices=["fla", "ours"], default="ours")
    parser.add_argument("--B", type=int, default=None)
    parser.add_argument("--T", type=int, default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(GRAPH_SHAPES))
    parser.add_argument("--dump-fla-configs", action="store_true",
                        help="first: store fla's autotuner choices (fla_configs.dump)")
    parser.add_argument("--fla-graphs", action="store_true",
                        help="also try to capture fla's own call (a failed capture can leave the stream unusable)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--png", default="docs/train-loss.png")
    args = parser.parse_args(argv)
    if args.what == "plot":
        plot(_out_path(args.out), Path(args.png))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    defaults = {"first": (1, 8192), "compile": (2, 8192), "train": (4, 4096)}.get(args.what, (None, None))
    args.B = args.B or defaults[0]
    args.T = args.T or defaults[1]
    log = Log(_out_path(args.out))
    return {"first": first, "compile": compile_, "graphs": graphs, "train": train}[args.what](args, log)


if __name__ == "__main__":
    sys.exit(main())
