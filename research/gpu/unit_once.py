# The B7-B9 unit launched once at prod8192_gate's 32,768 chunk-heads (for ncu); "stm" in argv: its tiles by stmatrix.
import sys

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack

from research.b7_cute_probe import ARGS, build, make_tensors

t = make_tensors(32768, 128, "cuda", strength=0.3)
args = [from_dlpack(t[n], assumed_align=16) for n in ARGS]
args.append(cuda.CUstream(torch.cuda.current_stream().cuda_stream))
run = cute.compile(build(128, True, True, True, "bf16", True, None, stm="stm" in sys.argv[1:]), *args)
run(*args)
torch.cuda.synchronize()
print("unit ran once")
