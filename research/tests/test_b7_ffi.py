"""The TVM-FFI call of B7-B10's CuTe kernel (research.b7_ffi) on the CPU: its build compiles for
sm_90a, and the kernel's machine code is the shipped build's (only the host wrapper differs).
Each compile runs in a process of its own, so that each gets its own dump folder."""
import glob
import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

COMPILE = r"""
import sys, torch
import cuda.bindings.driver as cuda
import cutlass.cute as cute
from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90 as m
from research import b7_ffi
H, K, T, var = 16, 128, 4 * 64 - int(sys.argv[2]) * 20, bool(int(sys.argv[2]))
op = lambda *s, dtype=torch.float32: torch.zeros(1, T, *s, dtype=dtype)
t = m.views(op(H, K, dtype=torch.bfloat16), op(H, K, dtype=torch.bfloat16), op(H, K), op(H), op(H, 64), op(H, 64),
            op(H, K), op(H, K), op(H, K), op(H, K, dtype=torch.bfloat16), torch.zeros(H), torch.zeros(H * K),
            op(H), op(H))
build = (K, H, 1, True, var, "bf16", True, None, False)
if sys.argv[1] == "ffi":
    fn = b7_ffi.compile_build(build, t, var, "explicit")
    print(type(fn).__name__)
else:
    cute.compile(m.build(*build), *m.dlpack_args(t, var), cuda.CUstream(0))
"""


def _cubin(tmp_path, how: str, var: int) -> str:
    dump = tmp_path / f"{how}{var}"
    dump.mkdir()
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(dump)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), root, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", COMPILE, how, str(var)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    if how == "ffi":
        assert "TVMFFI" in out.stdout  # (cute.compile gave tvm-ffi's callable)
    (cubin,) = glob.glob(str(dump / "*.cubin"))
    return cubin


@pytest.mark.parametrize("var", [0, 1])
def test_the_ffi_build_is_the_shipped_kernel(tmp_path, var):
    from benchmarks.compile_report import sass_sha

    shipped, ffi = sass_sha(_cubin(tmp_path, "shipped", var)), sass_sha(_cubin(tmp_path, "ffi", var))
    assert shipped[1] > 1000 and shipped == ffi
