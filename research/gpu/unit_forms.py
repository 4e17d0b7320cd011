# The whole op's fwd+bwd at prod8192_gate on the op bench's draw (seed 0) with each form of the
# CuTe unit as B7-B10, in one process, in two interleaved rounds: the step's CUDA-event time and
# the unit's kernel time (the launch named kernel_cutlass, torch's profiler). Forms (argv, default
# all): diag (intra_bwd_l2: dAqk's diagonal read from global memory in the tail), sdiag (read from
# shared memory, put there by the threads that load it for the split tiles), zdiag (not read: its
# values wrong), nodiag (the diagonal in the split products), rolled and nodiag_rolled (the
# pair-by-pair path a run-time loop). Each form's outputs against the form it must match to the
# bit (SAME_AS: the same fp32 operations in the same order), the others against diag's.
import sys

import torch

from benchmarks import fla_configs

fla_configs.use_stored_configs(torch.cuda.get_device_name())  # (before fla is imported: no autotune)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kernel_fun.kda import chunk_kda, last_record  # noqa: E402
from kernel_fun.kda.problems import fwd_bwd_step, make_inputs, problem  # noqa: E402
from kernel_fun.kda.stages import add_impl  # noqa: E402
from research import b7_cute_probe as P  # noqa: E402

FNS = {"diag": P.intra_bwd_l2, "sdiag": P.intra_bwd_l2_sdiag, "zdiag": P.intra_bwd_l2_zdiag,
       "nodiag": P.intra_bwd_l2_nodiag, "rolled": P.intra_bwd_l2_rolled, "nodiag_rolled": P.intra_bwd_l2_nodiag_rolled}
SAME_AS = {"sdiag": "diag", "zdiag": "diag", "rolled": "diag", "nodiag_rolled": "nodiag"}  # (the form to match)
forms = sys.argv[1:] or list(FNS)
kwargs = make_inputs(problem("prod8192_gate"), device="cuda", seed=0)
results, first = {f: [] for f in forms}, {}
for rnd in range(2):
    for form in forms:
        add_impl("B7-B10", "ours", FNS[form], P.supports_l2)
        step = fwd_bwd_step(chunk_kda, kwargs)
        out = step()
        torch.cuda.synchronize()
        assert last_record().backward["B7-B10"] == "ours", last_record()
        if rnd == 0:
            first[form] = out
            ref = first.get(SAME_AS.get(form, "diag"))
            if ref is not None:
                same = {n: bool(torch.equal(out[n], ref[n])) for n in out if out[n] is not None}
                print(form, f"bits as {SAME_AS.get(form, 'diag')}:", same, flush=True)
        for _ in range(2):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        step_ms = start.elapsed_time(end) / 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        ks = [e.device_time_total / 1e3 for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("kernel_cutlass")]
        unit_ms = sum(ks) / max(len(ks), 1)
        results[form].append((step_ms, unit_ms))
        print(f"round {rnd} {form}: fwd+bwd {step_ms:.2f} ms, unit {unit_ms:.2f} ms ({len(ks)} launches)", flush=True)
print("| form | fwd+bwd ms (two rounds) | unit's kernel ms |")
print("|---|---|---|")
for form in forms:
    r = results[form]
    print(f"| {form} | {' / '.join(f'{a:.2f}' for a, _ in r)} | {' / '.join(f'{b:.2f}' for _, b in r)} |")
