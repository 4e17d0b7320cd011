"""Host time by stage: ``Dispatcher.run`` wrapped for the calls made inside the block, each
stage's seconds (its launcher's Python and its launches, and any wait on the GPU it makes)
summed by name into the dict it yields."""
import contextlib
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
