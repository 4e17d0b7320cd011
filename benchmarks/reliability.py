"""The reliability harness: what every kernel of ours passes on the H200 before its issue
is resolved -- determinism, memory safety, a soak and extreme inputs -- for each stage with
an ``ours`` implementation and for the whole op, in one device call of about 8 minutes
(or two, split by ``--parts``, where the sanitizer is slow):

    python -m benchmarks.reliability --out $OUT/reliability.jsonl          # every part
    python -m benchmarks.reliability --parts sanitize --sanitizer-timeout 120
    python -m benchmarks.reliability --parts determinism,soak,extreme
    python -m benchmarks.reliability --parts offsets    # only the malformed offsets under memcheck

Rows (``kind: reliability``, one per check, ``ok`` true or false) go to ``--out`` (default
``benchmarks/results/reliability.jsonl``); a short table is printed last.

1. **Determinism**: the whole op (fwd+bwd at ``--shape``, default prod8192_gate) and each
   of our stages alone (its bench entry's inputs at the same shape): three runs give
   bitwise-equal outputs and gradients, and so do a run on a non-default stream and a run
   while a second stream multiplies large matrices.
2. **Memory safety**: ``compute-sanitizer`` memcheck, racecheck, initcheck and synccheck
   run a child process that calls only our kernels, on inputs the real chain gave them
   at small awkward shapes (``SANITIZE_SHAPES``: T 63 / 64 / 65 / 70 / 130, packed sequences with a
   1-token and a 64-token one, GVA, K 64 and 128, V 32 / 64 / 256, initial states, both
   state layouts), captured first in this process. Zero errors each. The same script runs
   a copy of B6's kernel with one store moved a chunk further (``planted_module``) under
   memcheck and must count errors: the check can fail. PyTorch's caching allocator is off
   in the child so every tensor is its own allocation and an out-of-bounds access cannot
   land inside a neighbour's block. Malformed packed offsets (``BAD_OFFSETS``) under
   memcheck: the convolution's kernels launched on them directly touch nothing outside
   their tensors; ``causal_conv1d`` and ``chunk_kda`` given them on the device stop at
   their device-side assert before any kernel reads them.
3. **Soak**: ``--soak-iters`` fwd+bwd (default 1,000, at most ``--soak-seconds``) at the
   shape: allocated and reserved memory after warm-up against the end and the maximum, no
   NaN in o or any gradient, per-step times p10/p50/p90.
4. **Extreme inputs** (``EXTREME``), ours beside fla's on the same call and both against
   the float64 recurrence with fla's budgets: NaN in one token of q (NaN confined to where
   the chunked math puts it, see ``nan_escapes``), pre-computed gates masked to -1000 at
   packed-style positions, very strong softplus gates, T = 1, a batch of one-token
   sequences, zero-length sequences in ``cu_seqlens`` (fla's outcome reported). ``--extreme``
   picks cases by name.

Part 5 of the contract, bad inputs, is ``tests/test_errors.py`` (CPU, in CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernel_fun.kda.problems import Problem, as_oracle_inputs, fwd_bwd_step, make_inputs, problem, run_fwd_bwd

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")

# Small awkward shapes for the sanitizer: ragged chunks, packed sequences of 1, 64 and more
# tokens, GVA, both K our B6 takes, V of one tile, two tiles and four, initial states, the
# V-first layout. Each runs the whole chain once (to capture our stages' inputs).
SANITIZE_SHAPES = [
    Problem("T63-K128-V64-h0", 2, 63, 2, 2, 128, 64, initial_state=True, output_final_state=True),
    Problem("T65-K64-V32-gva", 1, 65, 1, 2, 64, 32),
    Problem("packed-1-64-70-K128-V256-gva-h0", 1, 135, 2, 4, 128, 256, initial_state=True,
            output_final_state=True, cu_seqlens=(0, 1, 65, 135)),
    Problem("T130-K64-V256-v-first-h0", 1, 130, 2, 2, 64, 256, initial_state=True, output_final_state=True,
            state_v_first=True),
    Problem("T64-K128-V32-pregated", 2, 64, 2, 2, 128, 32, gate_in_kernel=False),
    # K=64 V=64: B4-B5's scan at BV=64 on 4 warps (8 warps there made wgmmas that read past
    # their operands' allocation)
    Problem("T70-K64-V64-h0", 1, 70, 2, 2, 64, 64, initial_state=True),
]


def ours_stages() -> list[str]:
    """The stages with a kernel of ours, in chain order."""
    from kernel_fun.kda.stages import stages

    return [name for name, st in stages().items() if "ours" in st.impls]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def differences(a: dict, b: dict) -> dict[str, float]:
    """Name -> largest |difference| for every output that is not bitwise equal (NaN in the
    same bits counts as equal); empty when all are."""
    out = {}
    for name in a:
        x, y = a[name], b[name]
        if x is None or y is None:
            if (x is None) != (y is None):
                out[name] = float("inf")
            continue
        if x.shape != y.shape:
            out[name] = float("inf")
        elif not torch.equal(_bits(x), _bits(y)):
            x, y = x.detach().double(), y.detach().double()
            d = (x - y).abs().masked_fill(torch.isnan(x) & torch.isnan(y), 0)
            out[name] = float(d.nan_to_num(float("inf")).max())
    return out


def _as_dict(out) -> dict:
    if isinstance(out, dict):
        return out
    return {f"out{i}": t for i, t in enumerate(out if isinstance(out, tuple) else (out,))}


def determinism(fn, device: torch.device, runs: int = 3) -> dict:
    """``fn()`` three times, once on a non-default stream, once beside a second stream busy
    with matrix products: which runs differ from the first, and where."""
    first = _as_dict(fn())
    report = {}
    for i in range(1, runs):
        report[f"repeat{i}"] = differences(_as_dict(fn()), first)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    if side is not None:
        with torch.cuda.stream(side):
            got = _as_dict(fn())
        side.synchronize()
        report["other_stream"] = differences(got, first)
        busy = torch.cuda.Stream(device)
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        busy.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(busy):
            for _ in range(40):  # ~1.5 ms each on an H200: the op runs while they do
                a = (a @ a).clamp_(-1, 1)
        got = _as_dict(fn())
        torch.cuda.synchronize(device)
        report["concurrent"] = differences(got, first)
    return report


# --------------------------------------------------------------------------------------
# NaN placement
# --------------------------------------------------------------------------------------
def nan_escapes(result: dict, p: Problem, b: int, t: int, h: int, chunk: int = 64) -> dict[str, str]:
    """Where NaN from q[b, t, h] reached that it should not, by output name.

    The forward: o is NaN exactly at (b, t, value heads of qk head h) and nowhere else; the
    final state carries no q, so it is finite. The backward, with finite cotangents: q_t
    enters dq_t, and through dAqk's row t and dh's q_t^T do_t every key and value of the
    same sequence and heads at or before t's chunk; the chunked sums multiply masked zeros
    with that row, so all of t's chunk and every earlier chunk of the sequence may be NaN,
    and the gate's per-head sums (dA_log, dt_bias) of those heads. Nothing of another
    sequence, another head group, or a later chunk of the same sequence may be."""
    G = p.HV // p.H
    heads = slice(h * G, (h + 1) * G)
    if p.cu_seqlens is None:
        seq_start, seq_end = 0, p.T
    else:
        starts = p.cu_seqlens
        i = max(j for j in range(len(starts) - 1) if starts[j] <= t)
        seq_start, seq_end = starts[i], starts[i + 1]
    chunk_end = min(seq_start + ((t - seq_start) // chunk + 1) * chunk, seq_end)
    bad = {}

    def outside(name, x, tokens, head_slice, head_axis=2):
        allowed = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        idx = [slice(None)] * x.dim()
        idx[0] = b
        idx[1] = tokens
        idx[head_axis] = head_slice
        allowed[tuple(idx)] = True
        nan = torch.isnan(x)
        if (nan & ~allowed).any():
            bad[name] = f"{int((nan & ~allowed).sum())} NaN outside the allowed region"

    o = result["o"]
    outside("o", o, slice(t, t + 1), heads)
    row = o[b, t, heads]
    if not torch.isnan(row).all():
        bad["o"] = bad.get("o", "") + f"; o[{b}, {t}, heads {h * G}..{(h + 1) * G - 1}] not all NaN"
    if result.get("final_state") is not None and torch.isnan(result["final_state"]).any():
        bad["final_state"] = "NaN in the final state"
    hq = slice(h, h + 1)
    for name in ("dq", "dk"):
        if result.get(name) is not None:
            outside(name, result[name], slice(seq_start, chunk_end), hq)
    for name in ("dv", "dg", "dbeta"):
        if result.get(name) is not None:
            outside(name, result[name], slice(seq_start, chunk_end), heads)
    if result.get("dh0") is not None:
        n = b if p.cu_seqlens is None else i
        nan = torch.isnan(result["dh0"])
        allowed = torch.zeros_like(nan)
        allowed[n, heads] = True
        if (nan & ~allowed).any():
            bad["dh0"] = "NaN in another sequence's or head's dh0"
    if result.get("dA_log") is not None:
        nan = torch.isnan(result["dA_log"])
        allowed = torch.zeros_like(nan)
        allowed[heads] = True
        if (nan & ~allowed).any():
            bad["dA_log"] = "NaN in another head's dA_log"
    if result.get("ddt_bias") is not None:
        nan = torch.isnan(result["ddt_bias"]).view(p.HV, p.K)
        allowed = torch.zeros_like(nan)
        allowed[heads] = True
        if (nan & ~allowed).any():
            bad["ddt_bias"] = "NaN in another head's dt_bias gradient"
    return bad


# --------------------------------------------------------------------------------------
# Extreme inputs
# --------------------------------------------------------------------------------------
EXTREME_BASE = Problem("extreme", 2, 200, 2, 4, 128, 64, initial_state=True, output_final_state=True)


def _masked_gates(base: Problem, seed: int) -> tuple[Problem, dict]:
    p = dataclasses.replace(base, name="gates-masked-1000", gate_in_kernel=False)
    kw = make_inputs(p, seed=seed)
    g = kw["g"].detach().clone()
    T = p.T
    for b, t in ((0, 0), (0, 63), (0, 64), (0, T // 2), (p.B - 1, 5), (p.B - 1, T - 1)):  # starts, chunk edges
        g[b, min(t, T - 1)] = -1000.0
    kw["g"] = g.requires_grad_(True)
    return p, kw


def _strong_softplus(base: Problem, seed: int) -> tuple[Problem, dict]:
    p = dataclasses.replace(base, name="strong-softplus-gates")
    kw = make_inputs(p, seed=seed)
    kw["g"] = (kw["g"].detach() * 8 + 12).requires_grad_(True)  # softplus ~4-28, times exp(A_log) up to 16
    return p, kw


def _shaped(name: str, **dims):
    def make(base: Problem, seed: int) -> tuple[Problem, dict]:
        p = dataclasses.replace(base, name=name, **dims)
        return p, make_inputs(p, seed=seed)
    return make


NAN_CASE = "nan-in-one-token-of-q"  # ``nan_case``: its own check, run before EXTREME's
EXTREME = {
    "gates-masked-1000": _masked_gates,
    "strong-softplus-gates": _strong_softplus,
    "T1": _shaped("T1", T=1),
    "one-token-sequences": _shaped("one-token-sequences", B=1, T=6, cu_seqlens=(0, 1, 2, 3, 4, 5, 6)),
    "zero-length-sequences": _shaped("zero-length-sequences", B=1, T=140, cu_seqlens=(0, 0, 70, 70, 140)),
}
EXTREME_CASES = (NAN_CASE, *EXTREME)  # the names --extreme takes


def _to(kwargs: dict, device) -> dict:
    out = {}
    for n, t in kwargs.items():
        if isinstance(t, torch.Tensor):
            leaf = t.requires_grad
            t = t.detach().to(device)
            out[n] = t.requires_grad_(True) if leaf else t
        else:
            out[n] = t
    return out


def oracle_errors(result: dict, oracle: dict) -> dict[str, float]:
    from kernel_fun.kda import reference as ref

    return {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None and result.get(n) is not None}


def extreme_case(name: str, device, fla=None, base: Problem = EXTREME_BASE) -> dict:
    """One extreme call: ours (and fla's, when given) against the float64 recurrence."""
    from kernel_fun.kda import chunk_kda, last_record
    from kernel_fun.kda import reference as ref

    p, kw = EXTREME[name](base, 5)
    kw = _to(kw, device)
    row = {"case": name, "problem": p.describe()}
    try:
        ours = run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    except Exception as err:  # a clear error is an outcome; a crash inside a kernel is not caught here
        row.update(ok=False, ours=f"raised {type(err).__name__}: {err}")
        return row
    record = last_record()
    row["impls"] = {**record.forward, **record.backward}
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kw), grid=p.dtype)
    errs = oracle_errors(ours, oracle)
    finite = all(torch.isfinite(t).all() for t in ours.values() if t is not None)
    row["vs_oracle"] = errs
    if fla is not None:
        try:
            theirs = run_fwd_bwd(fla, kw, grid=p.dtype)
            row["fla_vs_oracle"] = oracle_errors(theirs, oracle)
        except Exception as err:
            row["fla"] = f"raised {type(err).__name__}: {str(err)[:200]}"
    fla_errs = row.get("fla_vs_oracle", {})
    over = {n: e for n, e in errs.items()
            if not (e <= ref.BUDGETS[n] or (n in fla_errs and e <= 1.1 * fla_errs[n]))}
    row["over_budget"] = over
    row["ok"] = bool(finite and not over)
    if not finite:
        row["nonfinite"] = [n for n, t in ours.items() if t is not None and not torch.isfinite(t).all()]
    return row


def nan_case(device, fla=None, base: Problem = EXTREME_BASE) -> dict:
    """NaN in q at one token of one head of one sequence: where it reaches, ours and fla's."""
    from kernel_fun.kda import chunk_kda

    p = base
    kw = _to(make_inputs(p, seed=6), device)
    b, t, h = p.B - 1, p.T // 2, p.H - 1
    q = kw["q"].detach().clone()
    q[b, t, h, 3] = float("nan")
    kw["q"] = q.requires_grad_(True)
    row = {"case": NAN_CASE, "problem": p.describe(), "token": [b, t, h]}
    ours = run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    row["escapes"] = nan_escapes(ours, p, b, t, h)
    if fla is not None:
        row["fla_escapes"] = nan_escapes(run_fwd_bwd(fla, kw, grid=p.dtype), p, b, t, h)
    row["ok"] = not row["escapes"]
    return row


# --------------------------------------------------------------------------------------
# Memory safety: capture, the child, the planted fault
# --------------------------------------------------------------------------------------
def capture_inputs(shapes=SANITIZE_SHAPES, device="cuda") -> list[dict]:
    """Run the chain at each shape and keep each of our stages' inputs (on the CPU), so the
    sanitized child calls our kernels alone on what the chain gave them."""
    from kernel_fun.kda import chunk_kda
    from kernel_fun.kda.stages import capture_stages

    ours = set(ours_stages())
    captured = []
    for p in shapes:
        kw = make_inputs(p, device=device, seed=3)
        with capture_stages() as log:
            run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
        for name, impl, inputs, _ in log:
            if name in ours and impl == "ours":
                captured.append({"stage": name, "shape": p.name,
                                 "inputs": {n: (x.cpu() if isinstance(x, torch.Tensor) else x)
                                            for n, x in inputs.items()}})
    return captured


PLANT_FROM = "    tl.store(dk + p_tk, b_dk, mask=m_tk)\n"
PLANT_TO = "    tl.store(dk + p_tk + BT * HV * K, b_dk, mask=m_tk)  # planted: one chunk too far\n"
PLANTED_FILE = "planted_b6_wy_bwd.py"


def planted_module(directory: Path):
    """A copy of B6's kernel module whose dk store lands one chunk further on: the last
    chunk of every sequence then writes past dk's end. Loaded from its own file (Triton
    reads a kernel's source from it); kernel modules register nothing themselves, so the
    copy never becomes B6's implementation for the chain."""
    from kernel_fun.kda.kernels import b6_wy_bwd

    source = Path(b6_wy_bwd.__file__).read_text()
    if source.count(PLANT_FROM) != 1:
        raise RuntimeError(f"{PLANT_FROM.strip()!r} is not in b6_wy_bwd.py exactly once; update "
                           "benchmarks/reliability.py")
    path = Path(directory) / PLANTED_FILE
    path.write_text(source.replace(PLANT_FROM, PLANT_TO))
    spec = importlib.util.spec_from_file_location("planted_b6_wy_bwd", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_captured(path: Path, planted: bool, device: str = "cuda") -> None:
    """The sanitized child: our kernels alone on the captured inputs (or the planted copy of
    B6 on the first B6 input)."""
    from kernel_fun.kda.stages import stages

    captured = torch.load(path, weights_only=False)
    reg = stages()
    for entry in captured:
        inputs = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in entry["inputs"].items()}
        if planted:
            if entry["stage"] != "B6":
                continue
            with tempfile.TemporaryDirectory() as tmp:
                planted_module(Path(tmp)).wy_dqkg_bwd(**inputs)
                _sync(device)
            print("planted B6 ran on", entry["shape"], flush=True)
            return
        reg[entry["stage"]].impls["ours"](**inputs)
        _sync(device)
        print("ran", entry["stage"], entry["shape"], flush=True)


# Malformed packed-sequence offsets over 40 tokens: past x's end, ending early, falling,
# negative, one near int32's limit.
BAD_OFFSETS = {"past-the-end": [0, 5, 90], "ends-early": [0, 5, 12], "falling": [0, 30, 5, 40],
               "negative": [-64, 5, 40], "huge": [0, 5, 2 ** 31 - 1]}
OFFSET_CHILDREN = ("cconv-kernels", "cconv-op", "kda-op")
ASSERT_TEXT = "cu_seqlens must rise from 0"


def run_offsets(which: str, device: str = "cuda") -> None:
    """The sanitized child for malformed offsets. ``cconv-kernels``: the convolution's
    kernels launched directly on each of ``BAD_OFFSETS`` (they clamp every sequence to x's
    rows: no access outside x, y or the state, whatever the offsets); ``cconv-op`` and
    ``kda-op``: the public op on device-only offsets, which a device-side assert stops before
    any kernel reads them (the first case ends the process: a tripped assert ends the CUDA
    context)."""
    from kernel_fun.cconv import causal_conv1d
    from kernel_fun.cconv import kernels as K
    from kernel_fun.kda import chunk_kda

    gen = torch.Generator().manual_seed(0)
    D, W, T = 16, 4, 40
    x = torch.randn(1, T, D, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(D, W, generator=gen).to(device)
    for name, bounds in BAD_OFFSETS.items():
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        N = len(bounds) - 1
        if which == "cconv-kernels":
            TS = K.DEFAULT_CONFIG["TS"]
            seg = K.segment_index(cu, T, TS)
            h0 = torch.randn(N, D, W, generator=gen).to(device, torch.bfloat16)
            K.conv_fwd(x, w, None, None, h0, True, cu, seg, TS)
            K.conv_bwd(x, w, None, h0, torch.ones_like(x), torch.ones_like(h0), True, cu, seg, TS, True)
        elif which == "cconv-op":
            causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
        else:
            p = Problem("offsets", 1, T, 1, 1, 64, 32)
            chunk_kda(**{**make_inputs(p, device=device, requires_grad=False), "cu_seqlens": cu})
        _sync(device)
        print("ran", which, name, flush=True)


def sanitize_offsets(which: str, timeout: float) -> dict:
    """memcheck over ``run_offsets(which)``: no invalid access in any case; the kernels run
    every case, the ops stop at the device assert with its message."""
    cmd = [sanitizer(), "--tool", "memcheck", "--padding", str(MEMCHECK_PADDING), "--print-limit", "20",
           sys.executable, "-m", "benchmarks.reliability", "--child-offsets", which]
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        text = ((err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")) + "\n[timed out]"
    ran = len(re.findall(r"^ran ", text, re.M))
    invalid = len(re.findall(r"Invalid __global__|Invalid __shared__|out of bounds", text))
    asserted = ASSERT_TEXT in text
    ok = invalid == 0 and (ran == len(BAD_OFFSETS) if which == "cconv-kernels" else ran == 0 and asserted)
    lines = [ln for ln in text.splitlines() if "=========" in ln or ASSERT_TEXT in ln][:30]
    return {"ok": ok, "invalid_accesses": invalid, "cases_ran": ran, "device_assert": asserted,
            "seconds": round(time.perf_counter() - start, 1), "summary": lines}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        candidate = root / "bin" / "compute-sanitizer"
        if candidate.is_file():
            return str(candidate)
    return None


def parse_summary(text: str) -> int | None:
    """The error count of compute-sanitizer's summary: ``ERROR SUMMARY: N error(s)``
    (memcheck, initcheck, synccheck) or racecheck's ``RACECHECK SUMMARY: N hazard(s)
    displayed (E errors, W warnings)``, whose every hazard counts."""
    found = re.findall(r"ERROR SUMMARY:\s+(\d+)\s+error", text)
    if found:
        return int(found[-1])
    found = re.findall(r"RACECHECK SUMMARY:\s+(\d+)\s+hazard", text)
    return int(found[-1]) if found else None


MEMCHECK_PADDING = 1 << 20  # bytes after every allocation: more than any chunk's rows at these shapes


def sanitize(tool: str, captured_path: Path, planted: bool, timeout: float, candidates: list[str] = ()) -> dict:
    # memcheck's padding: small cudaMalloc blocks sit back to back, so without it a store a
    # chunk past one tensor's end lands inside the next tensor and counts as valid.
    padding = ["--padding", str(MEMCHECK_PADDING)] if tool == "memcheck" else []
    # (host API errors are not the kernels': CuTe DSL's driver bindings probe symbols the driver
    # lacks through cuGetProcAddress, each an "invalid argument" the sanitizer would count)
    cmd = [sanitizer(), "--tool", tool, *padding, "--report-api-errors", "no", "--print-limit", "20",
           sys.executable, "-m", "benchmarks.reliability",
           "--child", str(captured_path)] + (["--planted"] if planted else [])
    cmd += [f"--candidate={c}" for c in candidates]
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        text = ((err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")) + "\n[timed out]"
        code = None
    errors = parse_summary(text)
    ran = len(re.findall(r"^(?:ran|planted B6 ran) ", text, re.M))
    lines = [ln for ln in text.splitlines() if "=========" in ln]
    lines = lines if len(lines) <= 30 else lines[:24] + ["========= ..."] + lines[-2:]  # the first reports, the summary
    return {"tool": tool, "planted": planted, "errors": errors, "exit": code, "kernels_ran": ran,
            "seconds": round(time.perf_counter() - start, 1), "summary": lines}


# --------------------------------------------------------------------------------------
# Soak
# --------------------------------------------------------------------------------------
def soak(fn, iters: int, seconds: float, warmup: int = 20) -> dict:
    from kernel_fun.bench.timing import percentile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    max_alloc, max_res, nan_steps, times = base_alloc, base_res, [], []
    start = time.perf_counter()
    n = 0
    while n < iters and time.perf_counter() - start < seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
        if n % 50 == 0 or n == iters - 1:
            if any(torch.isnan(t).any() for t in out.values() if t is not None):
                nan_steps.append(n)
            max_alloc = max(max_alloc, torch.cuda.memory_allocated())
            max_res = max(max_res, torch.cuda.memory_reserved())
        del out
        n += 1
    torch.cuda.synchronize()
    end_alloc, end_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    row = {"steps": n, "seconds": round(time.perf_counter() - start, 1),
           "allocated_mib": [round(x / 2**20, 1) for x in (base_alloc, end_alloc, max_alloc)],
           "reserved_mib": [round(x / 2**20, 1) for x in (base_res, end_res, max_res)],
           "nan_steps": nan_steps[:10],
           "ms_p10_p50_p90": [round(percentile(times, q), 3) for q in (0.1, 0.5, 0.9)]}
    row["ok"] = bool(not nan_steps and end_alloc <= base_alloc and max_res <= base_res)
    return row


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------
def _fla():
    from kernel_fun import _fla as fla

    return fla.chunk_kda()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="sanitize,determinism,soak,extreme")
    parser.add_argument("--shape", default="prod8192_gate")
    parser.add_argument("--soak-iters", type=int, default=1000)
    parser.add_argument("--soak-seconds", type=float, default=300)
    parser.add_argument("--extreme", default=",".join(EXTREME_CASES),
                        help="the extreme-input cases to run, a comma list")
    parser.add_argument("--sanitizer-timeout", type=float, default=100, help="seconds per sanitizer run")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help="the sanitize part's tools, a comma list (the planted store and the malformed "
                             "offsets run with memcheck): one device call may take some, the next the rest")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--candidate", action="append", default=[], metavar="STAGE=module:function[:supports]",
                        help="an implementation not registered for users, as the stage's ours for this run "
                             "(as benchmarks.op's)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--planted", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-offsets", choices=OFFSET_CHILDREN, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        parser.error(f"--tools: {unknown} (known: {', '.join(TOOLS)})")
    cases = args.extreme.split(",")
    unknown = sorted(set(cases) - set(EXTREME_CASES))
    if unknown:
        parser.error(f"unknown --extreme cases {unknown}")
    if args.candidate:
        from benchmarks.op import register_candidates

        register_candidates(args.candidate)
    if args.child is not None:
        run_captured(args.child, args.planted)
        return 0
    if args.child_offsets is not None:
        run_offsets(args.child_offsets)
        return 0
    if not torch.cuda.is_available():
        print("the reliability harness needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks import fla_configs
    from benchmarks import rows as results
    from benchmarks.stages import entries
    from kernel_fun import versions

    gpu = torch.cuda.get_device_name()
    os.environ.setdefault("FLA_CACHE_MODE", "fuzzy")  # small shapes take the stored configs' nearest
    fla_configs.use_stored_configs(gpu)
    from kernel_fun.kda import chunk_kda

    out = args.out or results.RESULTS / "reliability.jsonl"
    parts = args.parts.split(",")
    device = torch.device("cuda")
    common = {"kind": "reliability", "gpu": gpu, "versions": versions(), "commit": results.commit(),
              **({"candidate": args.candidate} if args.candidate else {})}
    rows = []

    def emit(part, check, row):
        row = {**common, "part": part, "check": check, "date": results.now(), **row}
        results.append(out, row)
        rows.append(row)
        print(f"{part:12s} {check:40s} {'FAILED' if not row['ok'] else 'skipped' if row.get('skipped') else 'ok'}",
              flush=True)

    # Order: the sanitizer's child processes first (they need this process's CUDA context
    # only to capture inputs), the extreme inputs last (fla's call on zero-length sequences
    # is the one most likely to fault, and a fault poisons the context for what follows).
    if "sanitize" in parts or "offsets" in parts:
        tool = sanitizer()
        if tool is None:
            emit("sanitize", "compute-sanitizer", {"ok": False, "error": "compute-sanitizer not found"})
        elif "sanitize" in parts:
            captured = capture_inputs()
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "captured.pt"
                torch.save(captured, path)
                shapes = sorted({c["shape"] for c in captured})
                for t in tools:
                    res = sanitize(t, path, False, args.sanitizer_timeout, args.candidate)
                    res["ok"] = res["errors"] == 0 and res["kernels_ran"] == len(captured)
                    emit("sanitize", f"{t} ({len(captured)} launches, {len(shapes)} shapes)",
                         {**res, "shapes": shapes, "stages": sorted({c["stage"] for c in captured})})
                if "memcheck" in tools:
                    res = sanitize("memcheck", path, True, args.sanitizer_timeout, args.candidate)
                    # The fault must be seen, in the planted copy (memcheck names its file and line;
                    # the launch then fails, so the child never reports the kernel as done).
                    res["ok"] = bool(res["errors"]) and any(PLANTED_FILE in line for line in res["summary"])
                    emit("sanitize", "planted out-of-bounds store caught", res)
        # the malformed offsets: with the sanitize part's memcheck, or alone (--parts offsets)
        if tool is not None and ("memcheck" in tools or "sanitize" not in parts):
            for which in OFFSET_CHILDREN:
                emit("sanitize", f"memcheck malformed offsets, {which}",
                     sanitize_offsets(which, args.sanitizer_timeout))
    p = problem(args.shape)
    if "determinism" in parts or "soak" in parts:
        kw = make_inputs(p, device=device, seed=0)
        op = fwd_bwd_step(chunk_kda, kw, grid=p.dtype)  # cotangents drawn once
    if "determinism" in parts:
        report = determinism(op, device)
        emit("determinism", f"whole op {args.shape}", {"differs": report, "ok": not any(report.values())})
        for name, entry in entries().items():
            if entry.stage not in ours_stages():
                continue
            inputs = entry.make_inputs(p, "cuda", seed=1)
            why = entry.declines(inputs) if entry.declines else None
            if why:
                emit("determinism", f"{name} alone {args.shape}", {"ok": True, "skipped": why})
                continue
            report = determinism(lambda: entry.ours(inputs, None), device)
            emit("determinism", f"{name} alone {args.shape}", {"differs": report, "ok": not any(report.values())})
            if not entry.key:  # (fla's stage once a stage)
                fla_report = determinism(lambda: entry.fla(**inputs), device)  # beside ours, for the record
                emit("determinism", f"{name} fla's stage {args.shape}",
                     {"differs": fla_report, "ok": True, "reference_only": True})
            del inputs
        torch.cuda.empty_cache()
    if "soak" in parts:
        emit("soak", f"whole op {args.shape}", soak(op, args.soak_iters, args.soak_seconds))
    if "determinism" in parts or "soak" in parts:
        del kw
        torch.cuda.empty_cache()
    if "extreme" in parts:
        fla = _fla()
        if NAN_CASE in cases:
            emit("extreme", NAN_CASE, nan_case(device, fla))
        for name in EXTREME:
            if name in cases:
                emit("extreme", name, extreme_case(name, device, fla))
    print()
    print("| part | check | ok |\n|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['check']} | {'ok' if r['ok'] else 'FAILED'} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
