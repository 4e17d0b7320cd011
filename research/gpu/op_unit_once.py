# The whole op's fwd+bwd once at prod8192_gate on the op bench's draw (seed 0), for ncu: B7-B10's
# CuTe kernel is the one launch named kernel_cutlass.
import torch

from benchmarks import fla_configs

fla_configs.use_stored_configs(torch.cuda.get_device_name())  # (before fla is imported: no autotune)
from kernel_fun.kda import chunk_kda, last_record  # noqa: E402
from kernel_fun.kda.problems import make_inputs, problem, run_fwd_bwd  # noqa: E402

p = problem("prod8192_gate")
run_fwd_bwd(chunk_kda, make_inputs(p, device="cuda", seed=0))  # (the gate draw decides the kernel's path)
torch.cuda.synchronize()
assert last_record().backward["B7-B10"] == "ours", last_record()
print("B7-B10 ran once in the op")
