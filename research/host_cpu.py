# Our stages' host time on this CPU, Triton's launches stubbed out (no GPU, no interpreter): the
# chain's choices forced to kernel-fun's kernels where it has them (the dispatcher told it
# interprets), every other stage on its torch reference (their times here are the references'
# compute, not fla's host time). What is timed per stage is its launcher's Python and its
# allocations; Triton's own launch cost and CuTe's call are not in it.
#   PYTHONPATH=src:. python research/host_cpu.py [SHAPE]   (B=1, T=256 at the shape's heads)
import dataclasses
import sys

import torch
from triton.runtime import autotuner
from triton.runtime import jit as tjit

launches = [0]


def _stub(self, *args, **kwargs):
    launches[0] += 1


tjit.JITFunction.run = _stub
autotuner.Autotuner.run = _stub

from kernel_fun.kda import chunk_kda, last_record  # noqa: E402
from kernel_fun.kda.problems import cotangents, leaves, make_inputs, problem  # noqa: E402
from research.stage_time import stage_seconds  # noqa: E402

sys.modules["kernel_fun.kda.stages"].interpreting = lambda: True  # (kernel-fun's stages chosen on the CPU)
p = dataclasses.replace(problem(sys.argv[1] if len(sys.argv) > 1 else "layer2x8192"), B=1, T=256)
kw = make_inputs(p, device="cpu", seed=0)
do, _ = cotangents(torch.empty(p.B, p.T, p.HV, p.V, dtype=p.dtype), None, seed=7)


def fwd_bwd():
    o, _ = chunk_kda(**kw)
    return torch.autograd.grad(o, list(leaves(kw).values()), do, allow_unused=True)


fwd_bwd()
record = last_record()
ours = {name for phase in (record.forward, record.backward) for name, impl in phase.items() if impl == "ours"}
REPS = 30
for _ in range(3):
    fwd_bwd()
launches[0] = 0
with stage_seconds() as per_stage:
    for _ in range(REPS):
        fwd_bwd()
print(f"{p.describe()}: {launches[0] / REPS:.0f} Triton launches a fwd+bwd; kernel-fun's stages, us a call:")
for name in sorted(ours, key=list(per_stage).index):
    print(f"  {name:8} {per_stage[name] / REPS * 1e6:7.1f}")
print(f"  {'sum':8} {sum(per_stage[n] for n in ours) / REPS * 1e6:7.1f}")
