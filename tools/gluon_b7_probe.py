"""Does Gluon (Triton 3.6) build the operand path a Gluon B7 needs? A compile probe for
sm_90a (no GPU needed): one chunk-head's dA tile split into tf32 halves and written to
shared memory once, K-major (the row role's A) and transposed, K-major again (the column
role's A: tf32 wgmma reads both operands K-major only); a K slice's B operand ([64, BK],
hi and lo) in the transposed NVMMA layout tf32 B needs; the three tf32 wgmmas of a
hand-split fp32 product, from shared memory. ``python -m tools.gluon_b7_probe``.

What it found (2026-12-01, Triton 3.6, ptxas 12.8): it builds m64n32k8 tf32 wgmmas at
BK=32, 61 registers, 64 KB of shared memory for three [64, 64] and two [64, 32] fp32
tiles. Two quirks of this Gluon: ``warpgroup_mma``'s ``precision`` does not take a
constexpr (the default, tf32, is what this needs), and a register tensor transposed with
``gl.permute`` stores into a K-major layout directly. Not run on a GPU; not a stage
implementation.
"""

from __future__ import annotations

import json
import os
import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

from kernel_fun.kda.kernels.intra_bwd_gluon import _split


@gluon.jit
def operand_probe(dA, kx, out, BK: gl.constexpr):
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
    a_hi, a_lo = _split(gl.load(dA + r[:, None] * 64 + c[None, :]))
    a_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    s_ahi = gl.allocate_shared_memory(gl.float32, [64, 64], a_layout, a_hi)
    s_alo = gl.allocate_shared_memory(gl.float32, [64, 64], a_layout, a_lo)
    s_athi = gl.allocate_shared_memory(gl.float32, [64, 64], a_layout, gl.permute(a_hi, (1, 0)))
    cb = gl.arange(0, BK, layout=gl.SliceLayout(0, blk))
    b_hi, b_lo = _split(gl.load(kx + r[:, None] * BK + cb[None, :]))
    b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2, transposed=True)
    s_bhi = gl.allocate_shared_memory(gl.float32, [64, BK], b_layout, b_hi)
    s_blo = gl.allocate_shared_memory(gl.float32, [64, BK], b_layout, b_lo)
    hopper.fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 8])
    acc = hopper.warpgroup_mma(s_ahi, s_blo, gl.zeros([64, BK], gl.float32, acc_layout))
    acc = hopper.warpgroup_mma(s_alo, s_bhi, acc)
    acc = hopper.warpgroup_mma(s_ahi, s_bhi, acc)
    acc_t = hopper.warpgroup_mma(s_athi, s_bhi, gl.zeros([64, BK], gl.float32, acc_layout))
    gl.store(out + r[:, None] * BK + cb[None, :], gl.convert_layout(acc + acc_t, blk))


def report(BK: int = 32) -> dict:
    """The probe built for sm_90a: its wgmma shapes, registers, spills and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tools.compile_report import assemble_ptx, ptxas_numbers

    sig = {"dA": "*fp32", "kx": "*fp32", "out": "*fp32", "BK": "constexpr"}
    compiled = triton.compile(GluonASTSource(fn=operand_probe, signature=sig, constexprs={"BK": BK}),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    log = assemble_ptx(compiled)
    return {"BK": BK, "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?);?\s", ptx))),
            **ptxas_numbers(log), "shared": compiled.metadata.shared}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    for bk in (16, 32):
        print(json.dumps(report(bk)))
