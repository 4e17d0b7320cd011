"""Host time by stage: ``Dispatcher.run`` wrapped for the calls made inside the block, each
stage's seconds (its launcher's Python and its launches, and any wait on the GPU it makes)
summed by name into the dict it yields; and a call's host issue time against its CUDA-event
time (``issue_and_event``, on a GPU)."""
import contextlib
import statistics
import time


@contextlib.contextmanager
def stage_seconds():
    from kernel_fun.kda.stages import Dispatcher

    plain, seconds = Dispatcher.run, {}

    def timed_run(self, name, phase, **inputs):
        t0 = time.perf_counter()
        out = plain(self, name, phase, **inputs)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
        return out

    Dispatcher.run = timed_run
    try:
        yield seconds
    finally:
        Dispatcher.run = plain


def issue_and_event(fn, reps: int) -> tuple[float, float]:
    """(median host issue ms, median event ms) over ``reps`` calls of ``fn``, each after a sync:
    the time to enqueue its launches (perf_counter around the call) and its CUDA-event time."""
    import torch

    issue, event = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        issue.append((t1 - t0) * 1e3)
        event.append(start.elapsed_time(end))
    return statistics.median(issue), statistics.median(event)
