"""Step 1 of the fused backward (docs/log/bwd-fused.md): B6's V loop as a warp-specialized,
persistent Gluon kernel, compiled offline for sm_90a (no GPU needed).

One CTA an SM takes chunk-heads ``i = pid, pid + nprog, ...`` below NCH. A producer warp
(the worker partition) streams, per chunk-head and V tile of BV, h and dh ([K, BV] bf16,
h and dh stored [NCH * K, V]: one [K, V] state a chunk-head) and v_new, do and dv
([BT, BV] bf16, stored [NCH * BT, V]) by TMA into a ring of STAGES shared-memory stages,
each with a ``ready`` barrier (expect-tx bytes) and an ``empty`` barrier. The default
partition, 8 warps (two warpgroups, each owning 64 of the K=128 columns of the [64, 128]
accumulators), waits ``ready``, issues the async wgmmas

    dq  += do  @ h^T      dkh += v_new @ dh^T      dw += dv @ h^T      dav += dv @ v_new^T

(the B operands are the stage's [K, BV] or [BT, BV] tiles seen through a permuted
shared-memory view: [BV, K] with BV contiguous, the K-major B wgmma reads natively),
waits them and arrives on ``empty``. After a chunk-head's V loop it stores the fp32
accumulators with plain stores ([NCH, 64, 128] each, [NCH, 64, 64] for dav).

``b6_ws_split_kernel`` is the same loop with the consumers as two partitions of one
warpgroup each (consumer 0 the default partition and the only one doing dav, consumer 1
a worker), as the design has them for steps 2-4.

A probe, not a stage. ``python -m research.b6_ws_probe [variant ...]`` compiles offline and
prints one JSON row a build: registers
(with ``setmaxnreg`` ptxas reports the kernel-wide cap; ``sass_max_reg`` is the highest
register the code names), spills, shared memory, SASS instruction count, HGMMA (wgmma)
count, the ``setmaxnreg`` values in the PTX (the partitions' register budgets).

What it found (Triton 3.6, its ptxas, offline): every variant builds on the first try,
12 warps launched (8 consumers, the producer warp padded to a warpgroup), ``.maxnreg 168``
with the consumers raised to 232 and the producer at 40, no spills, no ptxas warnings; the
permuted h, dh and v_new views go straight into the wgmma as transposed B descriptors (no
copy); the V loop is not unrolled in the consumers (16 HGMMAs: 12 m64n64k16 and 4 m64n32k16
a warpgroup), the producer's is (4 x 5 TMA loads). Consumers name at most 145 registers
(132 without dav, 160 in the split form): the design's 168 a thread holds with room.
Shared memory: 114,900 B at 2 stages, 172,268 B at 3.

``python -m research.b6_ws_probe gpu [variant ...] [--out FILE]`` runs the builds on a CUDA
GPU at prod8192_gate's shape (B=16, T=8192, HV=16, K=128, V=256: 32,768 chunk-heads, h and dh
``[NCH * K, V]``, v_new, do and dv ``[NCH * 64, V]`` bf16, random normal x 0.1), one CTA an SM:
each build's outputs (NaN-filled first) are checked finite everywhere and, on 192 chunk-heads
(the first, the last and 64 spread between), against float64 torch (dq = do h^T, dkh = v_new
dh^T, dw = dv h^T, dav = dv v_new^T; max relative RMS over those chunk-heads, bar 1e-2), and
a build that passes is timed (CUDA events, median of 20 after 2 warm-up calls) beside
kernel-fun's registered B6 (``wy_dqkg_bwd``, on benchmarks.stages.b6's inputs at the same
shape) in the same process. The probe is the V loop's dots only (no epilogue): its time is
what the V loop alone costs against the whole B6. One JSON row a build and one for B6 (also
appended to ``--out``), then a table and the probe's memory floor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# The most shared memory one CTA may take on an H100/H200 (227 KB).
SM90_SHARED_BYTES = 232448


@gluon.jit
def _b6_producer(d_h, d_dh, d_vn, d_do, d_dv, h_s, dh_s, vn_s, do_s, dv_s, ready, empty, NCH,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: five TMA loads a V tile into the ring, run ahead by STAGES tiles."""
    NV: gl.constexpr = V // BV
    nbytes: gl.constexpr = 2 * K * BV * 2 + 3 * BT * BV * 2
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    c = 0
    for i in range(pid, NCH, nprog):
        for iv in range(NV):
            s = c % STAGES
            phase = (c // STAGES) & 1
            # empty barriers start with phase 1 complete: the first pass through the ring goes straight on
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            col = iv * BV
            tma.async_copy_global_to_shared(d_h, [i * K, col], bar, h_s.index(s))
            tma.async_copy_global_to_shared(d_dh, [i * K, col], bar, dh_s.index(s))
            tma.async_copy_global_to_shared(d_vn, [i * BT, col], bar, vn_s.index(s))
            tma.async_copy_global_to_shared(d_do, [i * BT, col], bar, do_s.index(s))
            tma.async_copy_global_to_shared(d_dv, [i * BT, col], bar, dv_s.index(s))
            c += 1


@gluon.jit
def _b6_consumer(h_s, dh_s, vn_s, do_s, dv_s, ready, empty, dq, dkh, dw, dav, NCH,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
                 DAV: gl.constexpr, OVERLAP: gl.constexpr):
    """The two consumer warpgroups: async wgmma over the ring, accumulators stored a chunk-head."""
    NV: gl.constexpr = V // BV
    # warps [4, 2]: each warpgroup holds all 64 rows and one 64-column half of a [64, 128] tile
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
    av_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    r_k = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_l))
    c_k = gl.arange(0, K, layout=gl.SliceLayout(0, acc_l))
    off_k = r_k[:, None] * K + c_k[None, :]
    r_v = gl.arange(0, BT, layout=gl.SliceLayout(1, av_l))
    c_v = gl.arange(0, BT, layout=gl.SliceLayout(0, av_l))
    off_v = r_v[:, None] * BT + c_v[None, :]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    c = 0
    for i in range(pid, NCH, nprog):
        a_q = gl.zeros([BT, K], gl.float32, acc_l)
        a_k = gl.zeros([BT, K], gl.float32, acc_l)
        a_w = gl.zeros([BT, K], gl.float32, acc_l)
        a_v = gl.zeros([BT, BT], gl.float32, av_l)
        for iv in range(NV):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            h_t = h_s.index(s).permute((1, 0))  # [BV, K], BV contiguous: a K-major B operand
            a_q = warpgroup_mma(do_s.index(s), h_t, a_q, is_async=True)
            a_k = warpgroup_mma(vn_s.index(s), dh_s.index(s).permute((1, 0)), a_k, is_async=True)
            a_w = warpgroup_mma(dv_s.index(s), h_t, a_w, is_async=True)
            if DAV:
                a_v = warpgroup_mma(dv_s.index(s), vn_s.index(s).permute((1, 0)), a_v, is_async=True)
            if OVERLAP:
                # leave this tile's wgmmas in flight, retire the previous tile's and free its stage
                NG: gl.constexpr = 4 if DAV else 3
                a_q, a_k, a_w, a_v = warpgroup_mma_wait(NG, deps=[a_q, a_k, a_w, a_v])
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=iv > 0)
            else:
                a_q, a_k, a_w, a_v = warpgroup_mma_wait(0, deps=[a_q, a_k, a_w, a_v])
                mbarrier.arrive(empty.index(s))
            c += 1
        if OVERLAP:
            a_q, a_k, a_w, a_v = warpgroup_mma_wait(0, deps=[a_q, a_k, a_w, a_v])
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        base = i.to(gl.int64) * (BT * K)
        gl.store(dq + base + off_k, a_q)
        gl.store(dkh + base + off_k, a_k)
        gl.store(dw + base + off_k, a_w)
        if DAV:
            gl.store(dav + i.to(gl.int64) * (BT * BT) + off_v, a_v)


@gluon.jit
def b6_ws_kernel(d_h, d_dh, d_vn, d_do, d_dv, dq, dkh, dw, dav, NCH,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
                 DAV: gl.constexpr, OVERLAP: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """B6's V loop, persistent (launch one CTA an SM), num_warps=8 for the consumers plus a producer warp."""
    h_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, K, BV], d_h.layout)
    dh_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, K, BV], d_dh.layout)
    vn_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_vn.layout)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_do.layout)
    dv_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_dv.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_b6_consumer, (h_s, dh_s, vn_s, do_s, dv_s, ready, empty, dq, dkh, dw, dav, NCH,
                        K, V, BT, BV, STAGES, DAV, OVERLAP)),
        (_b6_producer, (d_h, d_dh, d_vn, d_do, d_dv, h_s, dh_s, vn_s, do_s, dv_s, ready, empty, NCH,
                        K, V, BT, BV, STAGES)),
    ], [1], [PRODUCER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def _b6_half(h_s, dh_s, vn_s, do_s, dv_s, ready, empty, dq, dkh, dw, dav, NCH,
             K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
             J: gl.constexpr, DAV: gl.constexpr):
    """One consumer warpgroup of its own partition: K channels 64J..64J+63 (the design's split),
    and dav when DAV (consumer 0 only)."""
    NV: gl.constexpr = V // BV
    KH: gl.constexpr = K // 2
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KH, 16])
    av_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    r_k = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_l))
    c_k = gl.arange(0, KH, layout=gl.SliceLayout(0, acc_l))
    off_k = r_k[:, None] * K + J * KH + c_k[None, :]
    r_v = gl.arange(0, BT, layout=gl.SliceLayout(1, av_l))
    c_v = gl.arange(0, BT, layout=gl.SliceLayout(0, av_l))
    off_v = r_v[:, None] * BT + c_v[None, :]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    c = 0
    for i in range(pid, NCH, nprog):
        a_q = gl.zeros([BT, KH], gl.float32, acc_l)
        a_k = gl.zeros([BT, KH], gl.float32, acc_l)
        a_w = gl.zeros([BT, KH], gl.float32, acc_l)
        a_v = gl.zeros([BT, BT], gl.float32, av_l)
        for iv in range(NV):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            h_t = h_s.index(s).slice(J * KH, KH, dim=0).permute((1, 0))  # [BV, KH]
            a_q = warpgroup_mma(do_s.index(s), h_t, a_q, is_async=True)
            a_k = warpgroup_mma(vn_s.index(s), dh_s.index(s).slice(J * KH, KH, dim=0).permute((1, 0)), a_k,
                                is_async=True)
            a_w = warpgroup_mma(dv_s.index(s), h_t, a_w, is_async=True)
            if DAV:
                a_v = warpgroup_mma(dv_s.index(s), vn_s.index(s).permute((1, 0)), a_v, is_async=True)
            a_q, a_k, a_w, a_v = warpgroup_mma_wait(0, deps=[a_q, a_k, a_w, a_v])
            mbarrier.arrive(empty.index(s))  # the stage's empty barrier counts both consumers
            c += 1
        base = i.to(gl.int64) * (BT * K)
        gl.store(dq + base + off_k, a_q)
        gl.store(dkh + base + off_k, a_k)
        gl.store(dw + base + off_k, a_w)
        if DAV:
            gl.store(dav + i.to(gl.int64) * (BT * BT) + off_v, a_v)


@gluon.jit
def b6_ws_split_kernel(d_h, d_dh, d_vn, d_do, d_dv, dq, dkh, dw, dav, NCH,
                       K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
                       DAV: gl.constexpr, OVERLAP: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                       CONSUMER1_REGS: gl.constexpr):
    """``b6_ws_kernel`` with the consumers as two partitions of a warpgroup each (num_warps=4:
    consumer 0 is the default partition, consumer 1 and the producer warp are workers), as the
    design has them, so each can later take its own steps 2-4. OVERLAP is not built here."""
    h_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, K, BV], d_h.layout)
    dh_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, K, BV], d_dh.layout)
    vn_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_vn.layout)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_do.layout)
    dv_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], d_dv.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_b6_half, (h_s, dh_s, vn_s, do_s, dv_s, ready, empty, dq, dkh, dw, dav, NCH,
                    K, V, BT, BV, STAGES, 0, DAV)),
        (_b6_half, (h_s, dh_s, vn_s, do_s, dv_s, ready, empty, dq, dkh, dw, dav, NCH,
                    K, V, BT, BV, STAGES, 1, False)),
        (_b6_producer, (d_h, d_dh, d_vn, d_do, d_dv, h_s, dh_s, vn_s, do_s, dv_s, ready, empty, NCH,
                        K, V, BT, BV, STAGES)),
    ], [4, 1], [CONSUMER1_REGS, PRODUCER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def desc_type(block: list[int]) -> str:
    """A Gluon bf16 tensor descriptor's signature type, as the runtime mangles one
    (``triton.runtime.jit.mangle_type`` of ``gluon.nvidia.hopper.TensorDescriptor``)."""
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{', '.join(map(str, block))}],{layout!r}>"


def cuda_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _build(K, V, BV, stages, dav, overlap, split, num_warps, producer_regs, consumer1_regs):
    """A build's kernel, constexprs (in the kernel's parameter order) and warp count, for the offline
    compile and the GPU launch alike."""
    ce = dict(K=K, V=V, BT=64, BV=BV, STAGES=stages, DAV=dav, OVERLAP=overlap, PRODUCER_REGS=producer_regs)
    if split:
        ce.update(CONSUMER1_REGS=consumer1_regs)
    return (b6_ws_split_kernel if split else b6_ws_kernel), ce, num_warps or (4 if split else 8)


def compile_b6_ws(K: int = 128, V: int = 256, BV: int = 64, stages: int = 2, dav: bool = True, overlap: bool = False,
                  split: bool = False, num_warps: int | None = None, producer_regs: int = 40,
                  consumer1_regs: int = 232, maxnreg: int | None = None) -> dict:
    """Compile ``b6_ws_kernel`` for sm_90a and assemble it with Triton's ptxas: one row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    BT = 64
    kernel, ce, num_warps = _build(K, V, BV, stages, dav, overlap, split, num_warps, producer_regs, consumer1_regs)
    sig = {"d_h": desc_type([K, BV]), "d_dh": desc_type([K, BV]), "d_vn": desc_type([BT, BV]),
           "d_do": desc_type([BT, BV]), "d_dv": desc_type([BT, BV]),
           "dq": "*fp32", "dkh": "*fp32", "dw": "*fp32", "dav": "*fp32", "NCH": "i32", **dict.fromkeys(ce, "constexpr")}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("dq", "dkh", "dw", "dav")}
    row = dict(K=K, V=V, BV=BV, stages=stages, dav=dav, overlap=overlap, split=split, num_warps=num_warps,
               producer_regs=producer_regs, maxnreg=maxnreg, **(dict(consumer1_regs=consumer1_regs) if split else {}))
    try:
        compiled = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=ce, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps, maxnreg=maxnreg))
    except Exception as e:  # the compiler's error is the row
        return {**row, "ok": False, "error": f"{type(e).__name__}: {str(e).strip()[-1500:]}"}
    return {**row, "ok": True, **sm90_report(compiled)}


def sm90_report(compiled) -> dict:
    """What a compiled kernel's PTX becomes on sm_90a (its ptxas and nvdisasm): registers
    (with setmaxnreg, the kernel-wide cap), the highest register the code names, named
    barriers, spills, shared memory, SASS size, wgmma counts and shapes, the setmaxnreg
    budgets, ptxas's warnings."""
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cubin = os.path.join(tmp, "k.cubin")
        log = subprocess.run([cuda_tool("ptxas"), "-v", "--gpu-name=sm_90a", path, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        listing = subprocess.run([cuda_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                                 check=True).stdout
        cubin_bytes = os.path.getsize(cubin)
    sass = [line for line in listing.splitlines() if "/*" in line and ";" in line]

    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": grab(r"Used (\d+) registers"),  # with setmaxnreg: the kernel-wide cap (.maxnreg)
        "named_barriers": grab(r"used (\d+) barriers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "shared": compiled.metadata.shared,
        "shared_fits": compiled.metadata.shared <= SM90_SHARED_BYTES,
        "sass_instructions": len(sass),
        "wgmma_sass": sum("HGMMA" in line for line in sass),
        "wgmma_ptx": ptx.count("wgmma.mma_async"),
        "wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        "setmaxnreg": sorted(set(int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
        "setmaxnreg_sass": any("USETMAXREG" in line for line in sass),
        # the highest general register the code names, + 1: what the widest partition really uses
        "sass_max_reg": 1 + max((int(n) for n in re.findall(r"\bR(\d+)\b", "\n".join(sass))), default=-1),
        "cubin_bytes": cubin_bytes,
        # ptxas's warnings (a wgmma serialized for want of registers or across a call shows here)
        "ptxas_warnings": sorted(set(re.sub(r"^.*?warning\s*:\s*", "", line) for line in log.splitlines()
                                     if "warning" in line.lower() or "Performance Loss" in line)),
    }


VARIANTS = {
    "main": dict(BV=64, stages=2, dav=True),
    "no_dav": dict(BV=64, stages=2, dav=False),
    "stages3": dict(BV=64, stages=3, dav=True),
    "overlap": dict(BV=64, stages=2, dav=True, overlap=True),
    "stages3_overlap": dict(BV=64, stages=3, dav=True, overlap=True),
    "split": dict(BV=64, stages=2, dav=True, split=True),
    "split_stages3": dict(BV=64, stages=3, dav=True, split=True),
}


def compile_rows(names=None) -> list[dict]:
    """One row a build variant (``VARIANTS``; all of them unless ``names``)."""
    return [{"variant": n, **compile_b6_ws(**VARIANTS[n])} for n in (names or VARIANTS)]


# --------------------------------------------------------------------------------------
# The GPU run (``gpu``): values and times at prod8192_gate's shape
# --------------------------------------------------------------------------------------
GPU_SHAPE = dict(name="prod8192_gate", B=16, T=8192, HV=16, K=128, V=256)
HBM_BYTES_PER_S = 4.25e12  # the H200's measured copy rate (benchmarks.stage.BANDWIDTH)
ERR_BAR = 1e-2  # relative RMS; bf16 inputs, fp32 sums give ~1e-3, a wrong barrier phase O(1)
OUTPUTS = ("dq", "dkh", "dw", "dav")


def probe_bytes(nch: int, K: int = 128, V: int = 256, BT: int = 64) -> tuple[int, int]:
    """(read, written) bytes of the probe over ``nch`` chunk-heads: h and dh, v_new, do and dv
    (bf16) once; dq, dkh, dw and dav (fp32) once."""
    return nch * (2 * K * V * 2 + 3 * BT * V * 2), nch * (3 * BT * K * 4 + BT * BT * 4)


def gpu_inputs(nch: int, K: int, V: int, BT: int = 64, seed: int = 0, scale: float = 0.1, device="cuda") -> dict:
    """The probe's inputs in the layouts the kernel reads: h, dh ``[nch * K, V]``, v_new, do, dv
    ``[nch * BT, V]`` (bf16, normal x ``scale``, from a seeded generator on ``device``); its fp32
    outputs dq, dkh, dw ``[nch * BT, K]`` and dav ``[nch * BT, BT]`` (unfilled)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(rows):
        return torch.randn(rows, V, generator=gen, device=device).mul_(scale).to(torch.bfloat16)

    t = dict(h=randn(nch * K), dh=randn(nch * K), v_new=randn(nch * BT), do=randn(nch * BT), dv=randn(nch * BT))
    for n in ("dq", "dkh", "dw"):
        t[n] = torch.empty(nch * BT, K, device=device, dtype=torch.float32)
    t["dav"] = torch.empty(nch * BT, BT, device=device, dtype=torch.float32)
    return t


def launch_args(t: dict, K: int, V: int, BV=64, stages=2, dav=True, overlap=False, split=False, num_warps=None,
                producer_regs=40, consumer1_regs=232, maxnreg=None):
    """(kernel, args, keywords) launching the build (``VARIANTS``'s keywords) on ``gpu_inputs``'s
    tensors ``t``: host-side TMA descriptors of the [K, BV] and [64, BV] boxes the producer loads,
    in the shared layouts the offline compile takes (``desc_type``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    kernel, ce, num_warps = _build(K, V, BV, stages, dav, overlap, split, num_warps, producer_regs, consumer1_regs)
    BT = ce["BT"]

    def desc(x, rows):
        block = [rows, BV]
        return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    nch = t["h"].shape[0] // K
    assert t["h"].shape == (nch * K, V) and t["v_new"].shape == (nch * BT, V), "gpu_inputs's layouts"
    args = (desc(t["h"], K), desc(t["dh"], K), desc(t["v_new"], BT), desc(t["do"], BT), desc(t["dv"], BT),
            t["dq"], t["dkh"], t["dw"], t["dav"], nch)
    return kernel, args, dict(**ce, num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))


def gpu_launcher(t: dict, K: int, V: int, n_sm: int, **build):
    """A no-argument function launching the build on ``t``, one CTA an SM (the kernel is persistent)."""
    kernel, args, kw = launch_args(t, K, V, **build)

    def launch():
        kernel[(n_sm,)](*args, **kw)

    return launch


def wait_or_hang(hang_s: float) -> bool:
    """Waits for the GPU's queued work, at most ``hang_s`` seconds: False if it is still running
    (a deadlocked barrier never ends)."""
    import torch

    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > hang_s:
            return False
        time.sleep(0.005)
    return True


def check_outputs(t: dict, K: int, dav: bool, idx) -> dict:
    """Max relative RMS, over the chunk-heads ``idx``, of each output against float64 torch, and
    whether each output is finite everywhere (None for dav when the build skips it)."""
    import torch

    BT = 64
    nch = t["h"].shape[0] // K

    def chunks(x, rows):
        return x.view(nch, rows, x.shape[-1])[idx].double()

    h, dh = chunks(t["h"], K), chunks(t["dh"], K)
    vn, do, dv = chunks(t["v_new"], BT), chunks(t["do"], BT), chunks(t["dv"], BT)
    want = dict(dq=do @ h.mT, dkh=vn @ dh.mT, dw=dv @ h.mT, dav=dv @ vn.mT)
    errors, finite = {}, {}
    for n in OUTPUTS:
        if n == "dav" and not dav:
            errors[n] = finite[n] = None
            continue
        got, ref = chunks(t[n], BT), want[n]
        r = (got - ref).pow(2).mean(dim=(1, 2)).sqrt() / ref.pow(2).mean(dim=(1, 2)).sqrt()
        errors[n] = float(r.max())  # NaN anywhere gives NaN, which fails the bar
        finite[n] = bool(torch.isfinite(t[n]).all())
    return dict(errors=errors, finite=finite)


def cuda_ms(fn, warmup: int = 2, reps: int = 20) -> dict:
    """Median (and min, max) milliseconds of ``reps`` calls, each between its own CUDA events,
    after ``warmup`` calls."""
    import torch

    from kernel_fun.bench.timing import cuda_times

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms = cuda_times(fn, reps)
    return dict(ms=round(statistics.median(ms), 4), spread_ms=[round(min(ms), 4), round(max(ms), 4)])


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[-1500:]}"


def b6_reference_row(warmup: int, reps: int) -> dict:
    """kernel-fun's registered B6 (``wy_dqkg_bwd``) timed on benchmarks.stages.b6's inputs at
    ``GPU_SHAPE``."""
    import torch

    row = dict(variant="registered_b6", kind="b6_ws_probe_gpu")
    try:
        from benchmarks.stages.b6 import b6_bytes, make_inputs
        from kernel_fun.kda.kernels import b6_wy_bwd
        from kernel_fun.kda.problems import problem

        p = problem(GPU_SHAPE["name"])
        dims = dict(B=p.B, T=p.T, HV=p.HV, K=p.K, V=p.V)
        assert dims == {k: GPU_SHAPE[k] for k in dims}, f"{GPU_SHAPE['name']} is {dims}, not {GPU_SHAPE}"
        inputs = make_inputs(p, "cuda")
        row["shapes"] = {n: list(x.shape) for n, x in inputs.items() if isinstance(x, torch.Tensor)}
        why = b6_wy_bwd.supports(**inputs)
        if why is not None:
            raise RuntimeError(f"B6 refuses the call: {why}")
        fn = lambda: b6_wy_bwd.wy_dqkg_bwd(**inputs)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        row.update(ok=True, **cuda_ms(fn, warmup, reps))
        row["floor_ms"] = round(b6_bytes(p) / HBM_BYTES_PER_S * 1e3, 4)
    except Exception as e:
        row.update(ok=False, error=error_text(e))
    return row


def run_gpu(names=None, warmup: int = 2, reps: int = 20, seed: int = 0, hang_s: float = 60.0, emit=print) -> list[dict]:
    """The ``gpu`` subcommand's rows: the registered B6's, then one a build of ``names`` (all
    ``VARIANTS`` by default). ``emit`` takes each row as it comes. A build that outlives
    ``hang_s`` on its checking call ends the run (the GPU stays busy with it)."""
    import torch

    os.environ.pop("TRITON_INTERPRET", None)
    B, T, HV, K, V = (GPU_SHAPE[k] for k in ("B", "T", "HV", "K", "V"))
    BT = 64
    nch = B * (T // BT) * HV
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    common = dict(shape=GPU_SHAPE["name"], gpu=torch.cuda.get_device_name(), n_sm=n_sm, nch=nch)
    try:
        from benchmarks import rows as results

        common.update(commit=results.commit(), date=results.now())
    except Exception:
        pass
    rows = []

    def add(row):
        row = {**row, **common}
        rows.append(row)
        emit(row)

    # the registered B6 first: its number comes back even if a build below hangs the GPU
    add(b6_reference_row(warmup, reps))
    torch.cuda.empty_cache()  # B6's inputs and outputs are gone with the call

    t = gpu_inputs(nch, K, V, BT, seed)
    read, written = probe_bytes(nch, K, V, BT)
    floor_ms = (read + written) / HBM_BYTES_PER_S * 1e3
    idx = torch.cat([torch.arange(64), torch.linspace(64, nch - 65, 64).round().long(), torch.arange(nch - 64, nch)])
    idx = torch.unique(idx).cuda()
    dead = None  # the CUDA context's error, once a build has broken it
    for name in names or VARIANTS:
        kw = VARIANTS[name]
        row = dict(variant=name, kind="b6_ws_probe_gpu", build=kw, ok=False, checked_chunk_heads=int(idx.numel()))
        if dead:
            add({**row, "error": f"not run: the CUDA context is broken ({dead})"})
            continue
        try:
            for n in OUTPUTS:
                t[n].fill_(float("nan"))  # unwritten outputs show as NaN
            launch = gpu_launcher(t, K, V, n_sm, **kw)
            launch()
            if not wait_or_hang(hang_s):
                add({**row, "error": f"hung: the checking call was still running after {hang_s:g} s"})
                return rows
            row.update(check_outputs(t, K, kw.get("dav", True), idx))
            errs = [e for e in row["errors"].values() if e is not None]
            ok = all(e <= ERR_BAR for e in errs) and all(f is not False for f in row["finite"].values())
            row["ok"] = ok
            if ok:
                row.update(cuda_ms(launch, warmup, reps))
                row["floor_ms"] = round(floor_ms, 4)
                row["x_floor"] = round(row["ms"] / floor_ms, 3)
        except Exception as e:
            row.update(ok=False, error=error_text(e))
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # a fault is sticky: every later launch would fail with it
                dead = error_text(e2)[:200]
        add(row)
    return rows


def gpu_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m research.b6_ws_probe gpu",
                                description="Runs the builds on a CUDA GPU at prod8192_gate's shape: values "
                                            "against torch, times beside the registered B6 (module docstring).")
    p.add_argument("variants", nargs="*", help=f"builds, of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--out", default=None, help="a jsonl file to append the rows to")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=60.0, help="seconds before a checking call counts as hung")
    args = p.parse_args(argv)
    for n in args.variants:
        if n not in VARIANTS:
            p.error(f"no variant {n!r}")
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (sm_90a: an H100 or H200)")

    def emit(row):
        print(json.dumps(row), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")

    rows = run_gpu(args.variants or None, args.warmup, args.reps, args.seed, args.hang_s, emit)
    hung = any(str(r.get("error", "")).startswith("hung") for r in rows)
    B, T, HV, K, V = (GPU_SHAPE[k] for k in ("B", "T", "HV", "K", "V"))
    nch = B * (T // 64) * HV
    read, written = probe_bytes(nch, K, V)
    ref = next((r for r in rows if r["variant"] == "registered_b6" and r.get("ok")), None)
    print(f"\n{GPU_SHAPE['name']}: {nch} chunk-heads, {rows[0]['gpu']}, {rows[0]['n_sm']} SMs")
    print(f"{'variant':18s} {'ok':5s} {'max rel RMS':>12s} {'ms':>9s} {'x floor':>8s} {'/ B6':>6s}")
    for r in rows:
        errs = [e for e in (r.get("errors") or {}).values() if e is not None]
        err = "nan" if any(e != e for e in errs) else f"{max(errs):.2e}" if errs else "-"
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        xf = f"{r['ms'] / r['floor_ms']:.2f}" if "ms" in r and r.get("floor_ms") else "-"
        rel = f"{r['ms'] / ref['ms']:.2f}" if "ms" in r and ref else "-"
        print(f"{r['variant']:18s} {str(r.get('ok')):5s} {err:>12s} {ms:>9s} {xf:>8s} {rel:>6s}"
              + (f"  {r['error'][:100]}" if r.get("error") else ""))
    print(f"probe's memory floor at {HBM_BYTES_PER_S / 1e12:g} TB/s: reads {read / 1e9:.2f} GB "
          f"{read / HBM_BYTES_PER_S * 1e3:.3f} ms; writes {written / 1e9:.2f} GB; reads and writes "
          f"{(read + written) / HBM_BYTES_PER_S * 1e3:.3f} ms (the rows' floor_ms)")
    print("(the probe is the V loop's dots alone; the registered B6 is the whole stage, epilogue included)")
    if hung:  # don't wait on the deadlocked kernel at exit
        sys.stdout.flush()
        os._exit(3)
    return 0 if all(r.get("ok") for r in rows) else 1


def offline_compile_available() -> str | None:
    """Why the sm_90a compile of a Gluon kernel cannot run here, or None."""
    try:
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except Exception as e:  # an older or a CPU-only Triton
        return f"no Gluon in this Triton: {e}"
    for tool in ("ptxas", "nvdisasm"):
        if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)):
            return f"Triton ships no {tool}"
    return None


def compile_main(argv, prog: str, doc: str, variants: dict, rows, gpu) -> int:
    """A probe's command line: ``gpu ...`` (a reserved first word: no build is called gpu)
    runs ``gpu``; otherwise the named builds (all by default) compiled, one JSON row each."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu"]:
        return gpu(argv[1:])
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0],
                                epilog=f"python -m {prog} gpu --help: the builds run on a GPU, checked for values "
                                       "and timed")
    p.add_argument("variants", nargs="*", help=f"build variants, of {', '.join(variants)} (default: all)")
    args = p.parse_args(argv)
    for n in args.variants:
        if n not in variants:
            p.error(f"no variant {n!r}")
    os.environ.pop("TRITON_INTERPRET", None)
    for row in rows(args.variants or None):
        print(json.dumps(row), flush=True)
    return 0


def main(argv=None):
    return compile_main(argv, "research.b6_ws_probe", __doc__, VARIANTS, compile_rows, gpu_main)

if __name__ == "__main__":
    raise SystemExit(main())
