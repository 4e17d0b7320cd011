"""Compile kernel-fun's shipped Triton kernels for Hopper (sm_90a) without a GPU and report
what the compiler made of them: registers, spill bytes, stack, shared memory, wgmma count,
and the machine code's fingerprints.

Triton lowers to PTX on any machine; its bundled ptxas assembles for sm_90a. This costs no
GPU time, so register pressure is read here first and only the configs worth timing go to
the H200.

    python -m benchmarks.compile_report                  # every shipped build, one row each
    python -m benchmarks.compile_report --only b6,scan   # the builds whose names start so
    python -m benchmarks.compile_report --out benchmarks/results/compile_sm90.jsonl  # rows kept
    python -m benchmarks.compile_report --kernel b6 --K 128 --V 256 --BV 32,64 --warps 8 --stages 2,3
    python -m benchmarks.compile_report --cute all       # B7-B10's CuTe DSL builds (CuTe DSL installed)

``sass_sha`` fingerprints nvdisasm's listing without line information or the kernel's name,
so a kernel moved to another file or renamed keeps it and any changed instruction changes
it; ``sass_code_sha`` also blanks the kernel parameters' constant-bank offsets, so a kernel
that drops an unused parameter keeps that one. A build's inputs are typed as a launch
specializes them (16-byte-aligned pointers, dense strides).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _signature(jit, pointer_types: dict[str, str], constexprs: dict) -> dict:
    sig = {}
    for name in jit.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        elif name in ("scale", "lower_bound"):
            sig[name] = "fp32"
        elif name in ("T", "NBH", "NT_ROWS", "NT_ALL", "stride_b", "stride_t"):
            sig[name] = "i32"
        else:
            raise KeyError(f"no type for argument {name}")
    return sig


def assemble_sm90(jit, sig: dict, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None,
                  divisible: tuple[str, ...] = ()):
    """Compile the JITFunction ``jit`` with the full signature ``sig`` for sm_90a and
    assemble it with Triton's ptxas: (the compiled kernel, ptxas's -v report)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # As a launch with 16-byte-aligned tensors specializes them (without it no load is
    # vectorized and the pipeliner leaves every loop alone).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(jit.arg_names)
             if sig[name].startswith("*") or name in divisible}  # (integers: as a launch specializes multiples of 16)
    src = ASTSource(fn=jit, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))
    return compiled, assemble_ptx(compiled)


def assemble_ptx(compiled) -> str:
    """Assemble a kernel compiled for sm_90a with Triton's ptxas: ptxas's
    -v report; the machine code's fingerprint and instruction count onto ``compiled``."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        cubin = os.path.join(tmp, "k.cubin")
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        compiled.sass_sha, compiled.sass_instructions = sass_sha(cubin)
        compiled.sass_code_sha = sass_code_sha(cubin)
    return log


def sass_sha(cubin: str) -> tuple[str, int]:
    """A fingerprint of the machine code alone: nvdisasm's listing of the cubin without line
    information or the kernel's name, so a kernel moved to another file or renamed keeps
    its fingerprint and any changed instruction changes it; and the listing's (static)
    instruction count."""
    import hashlib

    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    listing = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    code = [line.split("/*", 2)[2] if line.strip().startswith("/*") and line.count("/*") >= 2 else line
            for line in listing.splitlines() if "/*" in line and ";" in line]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16], len(code)


def sass_code_sha(cubin: str) -> str:
    """``sass_sha`` with the kernel parameters' constant-bank offsets blanked: the same
    instructions in the same order, whatever the parameter list (a kernel that drops an
    unused pointer keeps this fingerprint; any changed instruction changes it)."""
    import hashlib

    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    listing = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    code = [line.split("/*", 2)[2] if line.strip().startswith("/*") and line.count("/*") >= 2 else line
            for line in listing.splitlines() if "/*" in line and ";" in line]
    code = [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][P]", line) for line in code]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def ptxas_numbers(log: str) -> dict:
    """Registers, spill bytes and stack from ptxas's -v report (0 where it names none)."""
    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    notes = {}  # ptxas's notes on lost speed: wgmmas serialised (C7514/C7515), a wait (C7517) or fence (C7519) added
    for code in re.findall(r"\((C75\d\d)\)", log):
        notes[code] = notes.get(code, 0) + 1
    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack": grab(r"(\d+) bytes stack frame"),
        "ptxas_notes": notes,
    }


def compile_sm90(kernel, pointer_types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                 maxnreg: int | None = None, divisible: tuple[str, ...] = ()) -> dict:
    """Compile ``kernel`` (a JITFunction, or a heuristics wrapper of one) for sm_90a."""
    jit = kernel
    while not hasattr(jit, "arg_names") or not hasattr(jit, "src"):
        jit = jit.fn
    sig = _signature(jit, pointer_types, constexprs)
    compiled, log = assemble_sm90(jit, sig, constexprs, num_warps, num_stages, maxnreg, divisible)
    return {
        **ptxas_numbers(log),
        "shared": compiled.metadata.shared,
        "wgmma": compiled.asm["ptx"].count("wgmma.mma_async"),
        # wgmmas whose shared operand has 32-byte rows: N=8 tf32 (Triton 3.6 leaves it
        # unpadded and the H200 reads past its end: an illegal address, triton-lang/triton#10629)
        # and N=16 bf16/fp16 (compute-sanitizer caught the same read past the allocation in the
        # F5+F6 kernel). A kernel must have none.
        "wgmma_32B_rows": len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(?:m64n8k8\.f32\.tf32|m64n16k16\.f32\.[bf]+16)",
                                         compiled.asm["ptx"])),
        # every wgmma shape (m64nNkK.f32.<a>.<b>) and its count, for the hazards below
        "wgmma_shapes": wgmma_shapes(compiled.asm["ptx"]),
        "sass_sha": compiled.sass_sha,
        "sass_code_sha": compiled.sass_code_sha,
        "sass_instructions": compiled.sass_instructions,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "maxnreg": maxnreg,
    }


def b6_report(K: int = 128, V: int = 256, HV: int = 16, heads_fast: bool = True, varlen: bool = False,
              dtype: str = "bf16", config: dict | None = None) -> dict:
    """B6 (``kda/kernels/b6_wy_bwd.py``) at the launcher's config for (K, V), its V tile and
    prefetch tile included; ``config`` over it."""
    import triton

    from kernel_fun.kda.kernels import b6_wy_bwd

    cfg = b6_wy_bwd.launch_config(K, V, 1, {"HEADS_FAST": heads_fast, **(config or {})})
    types = {n: _PTR[dtype] for n in ("q", "k", "v", "v_new", "beta", "A", "h", "do", "dh", "dv", "dv2")}
    types.update({n: "*fp32" for n in ("g", "dq", "dk", "dg", "db", "dA")}, cu_seqlens="*i32", chunk_indices="*i32")
    ce = dict(H=HV, HV=HV, K=K, V=V, BT=64, BK=triton.next_power_of_2(K), BV=cfg["BV"], IS_VARLEN=varlen,
              PF_ITER=b6_wy_bwd.prefetch_iter(V, cfg["BV"], cfg.get("PF_AT")), HEADS_FAST=bool(cfg["HEADS_FAST"]),
              **({} if varlen else dict(cu_seqlens=None, chunk_indices=None)))
    return compile_sm90(b6_wy_bwd.wy_dqkg_kernel, types, ce, cfg["num_warps"], cfg["num_stages"], cfg.get("maxnreg"))


def b7_b9_report(K: int = 128, HV: int = 16, gate: bool = True, bias: bool = True, lower_bound: bool = False,
                 varlen: bool = False, dtype: str = "bf16", config: dict | None = None, sums=None) -> dict:
    """The B7-B9 unit (``kda/kernels/b7_b9_intra_bwd.py``) at its pinned config: with the
    gate's backward (``gate``: dt_bias with ``bias``, the lower-bounded form with
    ``lower_bound``) or B7 and B8 alone (a pre-computed gate). ``sums``: a candidate for the
    kernel's three sums (its ``SUMS``)."""
    from kernel_fun.kda.kernels import b7_b9_intra_bwd as m

    cfg = {**m.CONFIG, **(config or {})}
    types = {"q": _PTR[dtype], "k": _PTR[dtype], "beta": _PTR[dtype], "cu_seqlens": "*i32", "chunk_indices": "*i32",
             **{n: "*fp32" for n in ("g", "dAqk", "dAkk", "dq", "dk", "dg", "dq2", "dk2", "dg2", "db_part")}}
    gate_args = dict(g_raw=_PTR[dtype], A_log="*fp32", dt_bias="*fp32", dA_part="*fp32", dbias_part="*fp32")
    guard = float(m.GUARD_SPAN.value)
    ce = dict(H=HV, HV=HV, K=K, BT=64, BK=cfg["BK"], IS_VARLEN=varlen, GUARD=guard, SCALE=2.0 ** -guard,
              GATE=gate, HAS_BIAS=gate and bias, USE_LOWER_BOUND=gate and lower_bound,
              **({} if varlen else dict(cu_seqlens=None, chunk_indices=None)))
    if gate:
        types.update(gate_args, dg2=_PTR[dtype])
        if not bias:
            ce.update(dt_bias=None, dbias_part=None)
    else:
        ce.update(dict.fromkeys(gate_args))
    ce["SUMS"] = sums
    return compile_sm90(m.intra_bwd_kernel, types, ce, cfg["num_warps"], cfg["num_stages"], cfg.get("maxnreg"))


def scan_report(K: int = 128, V: int = 256, recompute: bool = False, h0: bool = True, final_state: bool = True,
                save_states: bool = False, varlen: bool = False, dtype: str = "bf16",
                config: dict | None = None, chains: int = 256) -> dict:
    """The scan (``kda/kernels/f7_f8_b3_scan.py``): F7-F8 (the transposed kernel at K <= 128,
    the [K, V] one past it) at ``config`` (BV, num_warps, num_stages: the launcher picks one
    by grid, ``TRANSPOSED_STEPS``), or B3 (``recompute``) at the launcher's config for ``chains``
    chains (prod8192_gate's 256 by default)."""
    import triton

    from kernel_fun.kda.kernels import f7_f8_b3_scan as m

    picked = (m.states_config(chains, V) if recompute
              else m.TRANSPOSED_STEPS[64][0] if K <= 128 else m.WIDE_K_STEPS[64][0])
    cfg = {**picked, **(config or {})}
    types = {n: _PTR[dtype] for n in ("qg", "kg", "w", "u", "Aqk", "o", "h", "v_new", "v", "beta", "Akk")}
    types.update(g="*fp32", h0="*fp32", ht="*fp32", cu_seqlens="*i32", chunk_offsets="*i64")
    ce = dict(HV=16, K=K, V=V, BT=64, BV=cfg["BV"], IS_VARLEN=varlen, HAS_H0=h0, STORE_HT=final_state and not recompute,
              SAVE_STATES=save_states or recompute)
    ce.update({} if h0 else dict(h0=None), **({} if ce["STORE_HT"] else dict(ht=None)),
              **({} if ce["SAVE_STATES"] else dict(h=None, v_new=None)),
              **({} if varlen else dict(cu_seqlens=None, chunk_offsets=None)))
    if recompute:
        ce.update(qg=None, u=None, Aqk=None, o=None, BK=max(64, triton.next_power_of_2(K)), RECOMPUTE=True)
        return compile_sm90(m.scan_transposed_kernel, types, ce, cfg["num_warps"], cfg["num_stages"])
    if K <= 128:
        ce.update(v=None, beta=None, Akk=None, BK=max(64, triton.next_power_of_2(K)), RECOMPUTE=False)
        return compile_sm90(m.scan_transposed_kernel, types, ce, cfg["num_warps"], cfg["num_stages"])
    ce.update(BK=triton.next_power_of_2(K))
    return compile_sm90(m.scan_kernel, types, ce, cfg["num_warps"], cfg["num_stages"])


def b2_report(K: int = 128, varlen: bool = False, dtype: str = "bf16", config: dict | None = None) -> dict:
    """B2 (``kda/kernels/b2_wy_recompute.py``) at its pinned config."""
    import triton

    from kernel_fun.kda.kernels import b2_wy_recompute as m

    cfg = {**m.CONFIG, **(config or {})}
    types = {n: _PTR[dtype] for n in ("q", "k", "beta", "Akk", "w", "kg", "qg")}
    types.update(g="*fp32", cu_seqlens="*i32", chunk_indices="*i32")
    ce = dict(H=16, HV=16, K=K, BT=64, BK=min(cfg["BK"], max(16, triton.next_power_of_2(K))), IS_VARLEN=varlen,
              **({} if varlen else dict(cu_seqlens=None, chunk_indices=None)))
    return compile_sm90(m.wy_recompute_kernel, types, ce, cfg["num_warps"], cfg["num_stages"])


def dhu_report(K: int = 128, V: int = 256, h0: bool = True, dht: bool = False, varlen: bool = False,
               dtype: str = "bf16", chains: int = 256, config: dict | None = None) -> dict:
    """B4-B5's reverse scan (``kda/kernels/b4_b5_dhu.py``) at the launcher's config for
    ``chains`` chains (prod8192_gate's 256 by default); ``config`` over it."""
    import triton

    from kernel_fun._triton import v_slice
    from kernel_fun.kda.kernels import b4_b5_dhu as m

    cfg = {**m.launch_config(chains, V, K), **(config or {})}
    cfg["BV"] = v_slice(cfg, V)  # (as the launcher clips it)
    types = {n: _PTR[dtype] for n in ("qg", "kg", "w", "do", "Aqk", "dh", "dv2")}
    types.update(g="*fp32", dht="*fp32", dh0="*fp32", cu_seqlens="*i32", chunk_offsets="*i64")
    ce = dict(HV=16, K=K, V=V, BT=64, BK=max(64, triton.next_power_of_2(K)), BV=cfg["BV"], IS_VARLEN=varlen,
              HAS_DHT=dht, HAS_DH0=h0, **({} if dht else dict(dht=None)), **({} if h0 else dict(dh0=None)),
              **({} if varlen else dict(cu_seqlens=None, chunk_offsets=None)))
    return compile_sm90(m.dhu_transposed_kernel, types, ce, cfg["num_warps"], cfg["num_stages"])


def daqk_report(V: int = 256, varlen: bool = False, dtype: str = "bf16") -> dict:
    """B4-B5's dAqk kernel (``kda/kernels/b4_b5_dhu.py``) at its pinned config."""
    from kernel_fun.kda.kernels import b4_b5_dhu as m

    cfg = m.DAQK_CONFIG
    types = dict(do=_PTR[dtype], v_new=_PTR[dtype], dAqk="*fp32", chunk_indices="*i64", cu_seqlens="*i32")
    ce = dict(HV=16, V=V, BT=64, BV=cfg["BV"], IS_VARLEN=varlen,
              **({} if varlen else dict(chunk_indices=None, cu_seqlens=None)))
    return compile_sm90(m.dAqk_kernel, types, ce, cfg["num_warps"], cfg["num_stages"])


def cconv_report(D: int = 2048, backward: bool = False, config: dict | None = None) -> dict:
    """The short convolution's forward or backward kernel (``cconv/kernels.py``) at its pinned
    config: bf16 x, fp32 weight, W=4, SiLU, no bias, dense sequences."""
    from kernel_fun.cconv import kernels as K

    cfg = {**K.DEFAULT_CONFIG, **(config or {})}
    # x dense: channel stride 1 (a constant of the kernel), the others multiples of 16, as a launch specializes them
    types = dict(x="*bf16", w="*fp32", residual="*bf16", y="*bf16", dy="*bf16", dx="*bf16", dw_part="*fp32")
    ce = dict(D=D, W=4, BD=cfg["BD"], TS=cfg["TS"], SILU=True, HAS_BIAS=False, HAS_H0=False,
              IS_VARLEN=False, seg_index=None, cu_seqlens=None, bias=None, h0=None, stride_d=1)
    if backward:
        ce.update(HAS_DHT=False, dht=None, db_part=None, dh0=None)
        return compile_sm90(K.causal_conv1d_bwd_kernel, types, ce, cfg["num_warps"], 1, divisible=_STRIDES)
    ce.update(HAS_RESIDUAL=False, residual=None)
    return compile_sm90(K.causal_conv1d_fwd_kernel, types, ce, cfg["num_warps"], 1, divisible=_STRIDES)


_STRIDES = ("stride_b", "stride_t")


def wgmma_shapes(ptx: str) -> dict[str, int]:
    shapes: dict[str, int] = {}
    for m in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+\.f32\.\w+\.\w+)", ptx):
        shapes[m] = shapes.get(m, 0) + 1
    return shapes


# Every shipped build worth holding: each kernel at the configs its launcher picks at the
# production heads (K=128, V=256, H=HV=16) and at the awkward ones its support box takes.
SHIPPED = {
    "b6 K128 V256": lambda: b6_report(),
    "b6 K128 V256 chunks-fast": lambda: b6_report(heads_fast=False),
    "b6 K64 V128": lambda: b6_report(K=64, V=128, heads_fast=False),
    "b6 K128 V128 HV32": lambda: b6_report(V=128, HV=32),
    "b6 K128 V64": lambda: b6_report(V=64),
    "b6 K128 V32": lambda: b6_report(V=32),
    "b6 K128 V256 varlen fp16": lambda: b6_report(varlen=True, dtype="fp16", heads_fast=False),
    "b7-b9 K128 pre-gated": lambda: b7_b9_report(gate=False),
    "b7-b9 K128 gate": lambda: b7_b9_report(),
    "b7-b9 K64 lower-bound no-bias varlen": lambda: b7_b9_report(K=64, bias=False, lower_bound=True, varlen=True),
    "scan f7-f8 K128 V256 BV64": lambda: scan_report(),
    "scan f7-f8 K128 V256 BV128 states varlen": lambda: scan_report(save_states=True, varlen=True,
                                                                    config=dict(BV=128, num_warps=8, num_stages=2)),
    "scan f7-f8 K128 V256 BV32": lambda: scan_report(h0=False, final_state=False,
                                                     config=dict(BV=32, num_warps=4, num_stages=2)),
    "scan f7-f8 K256 V128 BV64": lambda: scan_report(K=256, V=128),
    "scan f7-f8 K192 V128 BV128 states": lambda: scan_report(K=192, V=128, save_states=True,
                                                             config=dict(BV=128, num_warps=8, num_stages=1)),
    "scan b3 K128 V256": lambda: scan_report(recompute=True),
    "scan b3 K64 V128 varlen": lambda: scan_report(K=64, V=128, recompute=True, h0=False, varlen=True),
    "scan b3 K128 V128 32 chains": lambda: scan_report(V=128, recompute=True, chains=32),
    "b4-b5 dhu K128 V256": lambda: dhu_report(),
    "b4-b5 dhu K64 V256": lambda: dhu_report(K=64),
    "b4-b5 dhu K64 V64": lambda: dhu_report(K=64, V=64),
    "b4-b5 dhu K128 V256 32 chains": lambda: dhu_report(chains=32),
    "b4-b5 dhu K128 V256 dht varlen": lambda: dhu_report(h0=False, dht=True, varlen=True),
    "b4-b5 dhu K100 V256 fp16": lambda: dhu_report(K=100, dtype="fp16"),
    "b4-b5 dAqk V256": lambda: daqk_report(),
    "b4-b5 dAqk V128 varlen": lambda: daqk_report(V=128, varlen=True),
    "b2 K128": lambda: b2_report(),
    "b2 K64 varlen": lambda: b2_report(K=64, varlen=True),
    "b2 K128 fp32": lambda: b2_report(dtype="fp32"),
    "cconv fwd D2048": lambda: cconv_report(),
    "cconv bwd D2048": lambda: cconv_report(backward=True),
}


# B7-B10's CuTe DSL kernel (``kda/kernels/b7_b10_intra_bwd_sm90.py``): each build the chain
# can call, at the production heads (H = 16, K = 128) and the awkward ones its support takes
# (the ``var`` builds: T 20 short of whole chunks). Compiled by CuTe DSL (the ``sm90`` extra),
# one build a process: CuTe DSL reads its dump folder once.
CUTE_SHIPPED = {
    "b7-b10 cute K128": dict(l2=True),
    "b7-b10 cute K128 var": dict(l2=True, var=True),
    "b7-b10 cute K128 var whole": dict(l2=True, var=True, whole=True),
    "b7-b10 cute K64": dict(K=64, l2=True),
    "b7-b9 cute K128": dict(),
    "b7-b9 cute K128 var": dict(var=True),
    "b7-b9 cute K128 var whole": dict(var=True, whole=True),
    "b7-b9 cute K128 gva2": dict(G=2),
    "b7-b9 cute K128 var gva2": dict(var=True, G=2),
    "b7-b9 cute K64 lower-bound no-bias": dict(K=64, has_bias=False, lower_bound=-5.0),
}


def cluster_copies(ptx: str) -> tuple[int, int]:
    """The PTX's bulk copies into a cluster peer's shared memory, and how many of them have both
    their destination and their barrier mapped into the peer by ``mapa`` (PTX requires the
    barrier in the destination CTA: compute-sanitizer's memcheck flags a copy whose barrier is
    this CTA's)."""
    mapped = set(re.findall(r"mapa\.shared::cluster\.u32\s+(%r\d+),", ptx))
    copies = re.findall(r"cp\.async\.bulk\.shared::cluster\.shared::cta\.mbarrier::complete_tx::bytes\s+"
                        r"\[(%r\d+)\],\s*\[[^\]]+\],\s*[^,]+,\s*\[(%r\d+)\]", ptx)
    return len(copies), sum(dst in mapped and bar in mapped for dst, bar in copies)


def cute_report(name: str) -> dict:
    """The CuTe build ``name`` (``CUTE_SHIPPED``) compiled for sm_90a in a dump folder of its
    own: registers, spills and ptxas's notes (Triton's ptxas on its PTX: CuTe DSL 4.8.1 writes
    PTX ISA 8.8, Triton 3.6's ptxas reads up to 8.7, so the header is lowered for this count
    only), and the fingerprint, instruction count, wgmmas and local-memory stores of the cubin
    CuTe DSL built, the one that runs."""
    import glob

    import torch

    from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90 as m

    form = {**dict(K=128, G=1, l2=False, var=False, has_bias=True, lower_bound=None, whole=False), **CUTE_SHIPPED[name]}
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=dump)
        import cuda.bindings.driver as cuda
        import cutlass.cute as cute

        H, K, G, T = 16, form["K"], form["G"], 4 * 64 - (20 if form["var"] else 0)
        op = lambda *shape, dtype=torch.float32: torch.zeros(1, T, *shape, dtype=dtype)  # noqa: E731
        t = m.views(op(H // G, K, dtype=torch.bfloat16), op(H // G, K, dtype=torch.bfloat16), op(H, K), op(H),
                    op(H, 64), op(H, 64), op(H, K), op(H, K), op(H, K), op(H, K, dtype=torch.bfloat16),
                    torch.zeros(H), torch.zeros(H * K), *((op(H), op(H)) if form["l2"] else ()))
        cute.compile(m.build(K, H, G, form["l2"], form["var"], "bf16", form["has_bias"], form["lower_bound"],
                             form["whole"]),
                     *m.dlpack_args(t, form["var"]), cuda.CUstream(0))
        (ptx_path,) = glob.glob(os.path.join(dump, "*.sm_90a.ptx"))
        ptx = open(ptx_path).read()
        lowered = os.path.join(dump, "isa87.ptx")
        with open(lowered, "w") as f:
            f.write(re.sub(r"^\.version 8\.8", ".version 8.7", ptx, flags=re.M))
        import triton

        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", lowered, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
        (cubin,) = glob.glob(os.path.join(dump, "*.cubin"))
        sha, count = sass_sha(cubin)
        listing = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", cubin],
                                 capture_output=True, text=True, check=True).stdout
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", listing)
    return {**ptxas_numbers(log), "sass_sha": sha, "sass_instructions": count,
            "sass_hgmma": sum(o.startswith("HGMMA") for o in ops), "sass_stl": sum(o.startswith("STL") for o in ops),
            "wgmma": ptx.count("wgmma.mma_async"), "cute_dsl": m.CUTE_DSL,
            **dict(zip(("cluster_copies", "cluster_copies_mapped"), cluster_copies(ptx)))}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma list of prefixes of the shipped builds' names")
    parser.add_argument("--kernel", choices=("b6", "b7-b9", "scan", "b3", "b2", "cconv-fwd", "cconv-bwd"),
                        help="sweep one kernel's configs instead (--BV its tile: B6's V tile, B7-B9's and B2's K "
                             "slice, the scan's V slice, the convolution's channel strip)")
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=256)
    parser.add_argument("--BV", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--maxnreg", type=int, default=None)
    parser.add_argument("--out", default=None, help="a jsonl file to append the shipped builds' rows to")
    parser.add_argument("--cute", default=None, metavar="NAME",
                        help="one CuTe DSL build of CUTE_SHIPPED (CuTe DSL installed), or 'all', each in a process")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    if args.cute is not None:
        names = list(CUTE_SHIPPED) if args.cute == "all" else [args.cute]
        for name in names:
            if len(names) > 1:  # (a process each: CuTe DSL reads its dump folder once)
                out = subprocess.run([sys.executable, "-m", "benchmarks.compile_report", "--cute", name,
                                      *(["--out", args.out] if args.out else [])], capture_output=True, text=True)
                print(out.stdout.strip() or json.dumps({"build": name, "error": out.stderr.strip()[-160:]}),
                      flush=True)
                continue
            row = {"build": name}
            try:
                row.update(cute_report(name))
            except Exception as err:  # a build that does not compile is a row too
                row.update(error=str(err).splitlines()[0][:160])
            print(json.dumps(row), flush=True)
            if args.out:
                from pathlib import Path

                import triton

                from benchmarks import rows

                rows.append(Path(args.out), rows.stamp({"kind": "compile_sm90_cute", "triton": triton.__version__,
                                                        **row}))
        return 0
    if args.kernel is None:
        prefixes = [p for p in args.only.split(",") if p]
        for name, build in SHIPPED.items():
            if prefixes and not any(name.startswith(p) for p in prefixes):
                continue
            row = {"build": name}
            try:
                row.update(build())
            except Exception as err:  # a build that does not compile is a row too
                row.update(error=str(err).splitlines()[0][:160])
            print(json.dumps(row), flush=True)
            if args.out:
                from pathlib import Path

                import triton

                from benchmarks import rows

                rows.append(Path(args.out), rows.stamp({"kind": "compile_sm90", "triton": triton.__version__, **row}))
        return 0
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    tile = {"b6": "BV", "b7-b9": "BK", "scan": "BV", "b3": "BV", "b2": "BK", "cconv-fwd": "BD", "cconv-bwd": "BD"}
    for BV, warps, stages in itertools.product(ints(args.BV), ints(args.warps), ints(args.stages)):
        config = {tile[args.kernel]: BV, "num_warps": warps, "num_stages": stages,
                  **({"maxnreg": args.maxnreg} if args.maxnreg else {})}
        row = dict(kernel=args.kernel, K=args.K, V=args.V, **config)
        try:
            if args.kernel == "b6":
                row.update(b6_report(args.K, args.V, config=config))
            elif args.kernel == "b7-b9":
                row.update(b7_b9_report(args.K, config=config))
            elif args.kernel in ("scan", "b3"):
                row.update(scan_report(args.K, args.V, recompute=args.kernel == "b3",
                                       config={k: config[k] for k in ("BV", "num_warps", "num_stages")}))
            elif args.kernel == "b2":
                row.update(b2_report(args.K, config={k: config[k] for k in ("BK", "num_warps", "num_stages")}))
            else:
                row.update(cconv_report(args.V if args.V != 256 else 2048, backward=args.kernel == "cconv-bwd",
                                        config={"BD": BV, "num_warps": warps}))
        except Exception as err:  # a config that does not compile is a row too
            row.update(error=str(err).splitlines()[0][:160])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
