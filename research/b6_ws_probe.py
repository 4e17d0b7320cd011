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

A compile probe, not a stage: nothing here is launched or checked for values.
``python -m research.b6_ws_probe [variant ...]`` prints one JSON row a build: registers
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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

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


def _desc_type(block: list[int]) -> str:
    """A Gluon bf16 tensor descriptor's signature type, as the runtime mangles one
    (``triton.runtime.jit.mangle_type`` of ``gluon.nvidia.hopper.TensorDescriptor``)."""
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{', '.join(map(str, block))}],{layout!r}>"


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_b6_ws(K: int = 128, V: int = 256, BV: int = 64, stages: int = 2, dav: bool = True, overlap: bool = False,
                  split: bool = False, num_warps: int | None = None, producer_regs: int = 40,
                  consumer1_regs: int = 232, maxnreg: int | None = None) -> dict:
    """Compile ``b6_ws_kernel`` for sm_90a and assemble it with Triton's ptxas: one row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    BT = 64
    ce = dict(K=K, V=V, BT=BT, BV=BV, STAGES=stages, DAV=dav, OVERLAP=overlap, PRODUCER_REGS=producer_regs)
    if split:
        ce.update(CONSUMER1_REGS=consumer1_regs)
    num_warps = num_warps or (4 if split else 8)
    kernel = b6_ws_split_kernel if split else b6_ws_kernel
    sig = {"d_h": _desc_type([K, BV]), "d_dh": _desc_type([K, BV]), "d_vn": _desc_type([BT, BV]),
           "d_do": _desc_type([BT, BV]), "d_dv": _desc_type([BT, BV]),
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
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cubin = os.path.join(tmp, "k.cubin")
        log = subprocess.run([_tool("ptxas"), "-v", "--gpu-name=sm_90a", path, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        listing = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
        cubin_bytes = os.path.getsize(cubin)
    sass = [line for line in listing.splitlines() if "/*" in line and ";" in line]

    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        **row, "ok": True,
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", help=f"build variants, of {', '.join(VARIANTS)} (default: all)")
    args = p.parse_args(argv)
    for n in args.variants:
        if n not in VARIANTS:
            p.error(f"no variant {n!r}")
    os.environ.pop("TRITON_INTERPRET", None)
    for row in compile_rows(args.variants or None):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
