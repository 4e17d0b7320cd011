"""kernel_fun._triton's helpers as the compiler takes them: store_pairs compiled for sm_90a
(no GPU needed) for fp32 only, by either way of addressing."""

from __future__ import annotations

import os

import pytest

_PAIR_STORE_PROBE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernel_fun._triton import store_pairs

@triton.jit
def probe(out):
    o = tl.arange(0, 256)
    store_pairs(ADDR, tl.zeros([256], dtype=tl.DTYPE), o < 256)

try:
    triton.compile(ASTSource(fn=probe, signature={"out": "*PTR"}, constexprs={}), target=GPUTarget("cuda", 90, 32))
    print("compiled")
except Exception as err:
    print("refused:", err, err.__cause__)
"""


_BY_OFFSETS, _BY_POINTERS = "out, o.to(tl.int32)", "out + o, None"


@pytest.mark.parametrize("dtype,ptr,addr,want", [
    ("bfloat16", "bf16", _BY_OFFSETS, "store_pairs stores fp32 values"),
    ("float32", "bf16", _BY_OFFSETS, "store_pairs stores to fp32 pointers"),
    ("float32", "fp32", "out, o.to(tl.int64)", "store_pairs takes int32 element offsets"),
    ("float32", "fp32", _BY_OFFSETS, "compiled"),
    ("bfloat16", "fp32", _BY_POINTERS, "store_pairs stores fp32 values"),
    ("float32", "bf16", _BY_POINTERS, "store_pairs stores to fp32 pointers"),
    ("float32", "fp32", _BY_POINTERS, "compiled")])
def test_pair_stores_compile_for_fp32_only(dtype, ptr, addr, want, tmp_path):
    """store_pairs writes fp32 pairs in inline PTX, addressed by int32 element offsets from
    one pointer or by a pointer per element: compiled for sm_90a (in a process without the
    interpreter), fp32 either way compiles and anything else is refused at compile time (an
    int64 offset would be truncated)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = tmp_path / "probe.py"
    probe.write_text(_PAIR_STORE_PROBE.replace("DTYPE", dtype).replace("PTR", ptr).replace("ADDR", addr))
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=300)
    assert want in out.stdout, out.stdout + out.stderr


