# B7-B10's CuTe call through TVM-FFI (research/b7_ffi.py) against the shipped call, in one process, on
# an sm_90 GPU with CuTe DSL and apache-tvm-ffi (research/gpu/cute_env.sh installs both):
#   python3 research/gpu/b7_ffi_ab.py [SHAPES] > $OUT/ffi.txt   (rows to $OUT/ffi.jsonl)
# For each call form (shipped, env, explicit) and shape (layer2x8192,grid1024 by default):
# 1. parity: the op's fwd+bwd outputs bit for bit the shipped call's, on the default stream, and on
#    a side stream held back by a 50 ms sleep queued first (a launch on any other stream reads its
#    inputs before they are written, and differs);
# 2. B7-B10's host time a fwd+bwd (research/stage_time.py, 30 calls issued back to back);
# 3. the op's fwd+bwd: host issue ms, synced event ms (median of 30), back to back ms.
# A form that raises is reported with its error and skipped.
import json
import os
import sys
import time

import torch

from benchmarks import fla_configs

fla_configs.use_stored_configs(torch.cuda.get_device_name())
from kernel_fun.bench.op import fwd_bwd, variants  # noqa: E402
from kernel_fun.bench.timing import stream_time  # noqa: E402
from kernel_fun.kda import last_record  # noqa: E402
from kernel_fun.kda.problems import cotangents, make_inputs, problem  # noqa: E402
from research import b7_ffi  # noqa: E402
from research.stage_time import issue_and_event, stage_seconds  # noqa: E402

shapes = (sys.argv[1] if len(sys.argv) > 1 else "layer2x8192,grid1024").split(",")
out = open(os.path.join(os.environ.get("OUT", "."), "ffi.jsonl"), "a")
REPS = 30
ours = variants(["ours"])[0]


def use(form: str) -> None:
    b7_ffi.uninstall() if form == "shipped" else b7_ffi.install(form)


try:
    import tvm_ffi
    import typing_extensions

    print(f"tvm-ffi {tvm_ffi.__version__}, typing_extensions from {typing_extensions.__file__}", flush=True)
except Exception as e:  # (the forms below then report their own errors)
    print(f"tvm-ffi unavailable: {type(e).__name__}: {e}", flush=True)
print(f"{'shape':12} {'form':9} {'parity':22} {'B7-B10 host us':>15} {'issue ms':>9} {'event ms':>9} "
      f"{'back to back':>13}", flush=True)
for shape in shapes:
    p = problem(shape)
    kw = make_inputs(p, device="cuda", seed=0)
    do, _ = cotangents(torch.empty(p.B, p.T, p.HV, p.V, device="cuda", dtype=p.dtype), None, seed=7)
    call = lambda: fwd_bwd(ours, kw, do)  # noqa: E731
    use("shipped")
    want = [g.clone() for g in call()]
    for form in ("shipped", "env", "explicit"):
        row = {"kind": "b7_ffi", "shape": shape, "form": form, "gpu": torch.cuda.get_device_name(),
               "commit": os.environ.get("KERNEL_FUN_COMMIT", ""), "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00",
                                                                                         time.gmtime())}
        try:
            use(form)
            got = call()
            torch.cuda.synchronize()
            impl = last_record().backward.get("B7-B10")
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.cuda._sleep(100_000_000)  # (~50 ms at ~2 GHz: the side stream's queue held back)
                got_side = call()
            side.synchronize()
            same_side = all(torch.equal(a, b) for a, b in zip(got_side, want))
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with stage_seconds() as per_stage:
                for _ in range(REPS):
                    call()
            torch.cuda.synchronize()
            issue, event = issue_and_event(call, REPS)
            builds = sum(key[0] == form for key in b7_ffi._COMPILED)  # (the witness: this form's builds ran)
            row.update(impl=impl, ffi_builds=builds, bitwise=same, bitwise_side_stream=same_side,
                       b7_b10_host_us=per_stage.get("B7-B10", 0.0) / REPS * 1e6, issue_ms=issue, event_ms=event,
                       stream_ms=stream_time(call, REPS))
            print(f"{shape:12} {form:9} {f'{same}/{same_side} ({impl}, {builds})':22} {row['b7_b10_host_us']:15.1f} "
                  f"{issue:9.3f} {event:9.3f} {row['stream_ms']:13.3f}", flush=True)
        except Exception as e:  # (a form that does not run: its error, and the next form)
            row.update(error=f"{type(e).__name__}: {e}"[:2000])
            print(f"{shape:12} {form:9} error: {row['error'][:300]}", flush=True)
        out.write(json.dumps(row, sort_keys=True) + "\n")
        out.flush()
    use("shipped")
