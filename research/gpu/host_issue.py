# Where a small call's time goes between the host and the GPU (layer2x8192 by default, the KDA call
# inside fla's layer at B2 T8192): for fla's chunk_kda and ours, the forward and the fwd+bwd, each
# call's host issue time (perf_counter around the call, no sync: the time to enqueue its launches)
# against its CUDA-event time (synced after each call, as the op bench times), then our forward's
# and fwd+bwd's host time by stage and a cProfile of each. Usage, on the GPU:
#   python3 research/gpu/host_issue.py [SHAPE] > $OUT/host_issue.txt
# Read: where the issue time is near the event time, the GPU waits on the host (a deeper queue in
# training hides it only while the host keeps ahead); the profile names what the host spends.
import cProfile
import pstats
import sys
import time

import torch

from benchmarks import fla_configs

fla_configs.use_stored_configs(torch.cuda.get_device_name())  # (before fla is imported: no autotune)
from kernel_fun.bench.op import fwd_bwd, variants  # noqa: E402
from kernel_fun.bench.timing import stream_time  # noqa: E402
from kernel_fun.kda.problems import cotangents, make_inputs, problem  # noqa: E402
from research.stage_time import issue_and_event, stage_seconds  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "layer2x8192"
p = problem(shape)
kw = make_inputs(p, device="cuda", seed=0)
o_like = torch.empty(p.B, p.T, p.HV, p.V, device="cuda", dtype=p.dtype)
do, _ = cotangents(o_like, None, seed=7)
REPS = 30


print(f"{shape}: {p.describe()}")
print(f"{'impl':6} {'phase':8} {'host issue ms':>14} {'event ms':>9} {'back to back ms':>16}")
for v in variants(["fla", "ours"]):
    for _ in range(3):
        fwd_bwd(v, kw, do)
    for phase, fn in (("fwd", lambda v=v: v(**kw)), ("fwd+bwd", lambda v=v: fwd_bwd(v, kw, do))):
        issue, event = issue_and_event(fn, REPS)
        print(f"{v.name:6} {phase:8} {issue:14.3f} {event:9.3f} {stream_time(fn, REPS):16.3f}", flush=True)

# Our forward's and fwd+bwd's host time by stage (``research/stage_time.py``), the rest of the
# call outside any stage.
ours = variants(["ours"])[0]
for what, call in (("forward", lambda: ours(**kw)), ("fwd+bwd", lambda: fwd_bwd(ours, kw, do))):
    torch.cuda.synchronize()
    with stage_seconds() as per_stage:
        t0 = time.perf_counter()
        for _ in range(REPS):
            call()
        total = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"\nour {what}'s host time by stage (us a call, {REPS} calls issued back to back; a stage that "
          "waits on the GPU shows here too):")
    for name, secs in per_stage.items():
        print(f"  {name:8} {secs / REPS * 1e6:9.1f}")
    print(f"  {'outside':8} {(total - sum(per_stage.values())) / REPS * 1e6:9.1f}   (the call's own Python, autograd)")
    print(f"  {'total':8} {total / REPS * 1e6:9.1f}")

for what, call in (("forwards", lambda: ours(**kw)), ("fwd+bwds", lambda: fwd_bwd(ours, kw, do))):
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(REPS):
        call()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {REPS} {what} (ours), by own time, then by time with callees:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
