"""Timing helpers every bench shares: CUDA-event timings and their summary. A leaf module
(torch and the standard library only), so the demo and the benches import it without
importing each other."""

from __future__ import annotations

import statistics

import torch


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    i = (len(s) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def cuda_times(fn, reps: int) -> list[float]:
    """Milliseconds of ``reps`` calls, each between its own pair of CUDA events."""
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def stream_time(fn, reps: int) -> float:
    """Milliseconds a call of ``reps`` calls issued back to back between one pair of CUDA
    events: the host runs ahead as in a training step, so this is the GPU's time a call
    where the host keeps up (``cuda_times`` syncs after each call and counts the host's
    time before the first launch too)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "p10": percentile(times, 0.1),
            "p90": percentile(times, 0.9), "n": len(times)}


def kernel_profile(fn, top: int = 25) -> dict:
    """One call of ``fn`` under the profiler: device ms per kernel name (the ``top`` largest),
    their sum over every kernel, and how many kernels there were by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time_total / 1e3
    ranked = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top])
    return {"kernel_ms": ranked, "kernels_sum_ms": sum(kernels.values()), "kernels": len(kernels)}
