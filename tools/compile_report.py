"""Compile kernel-fun's Triton kernels for Hopper (sm_90a) without a GPU and report what
the compiler made of them: registers, spill bytes, stack, shared memory, wgmma count.

Triton lowers to PTX on any machine; its bundled ptxas assembles for sm_90a. This costs
no GPU time, so register pressure is read here first and only the configs worth timing
go to the H200. ``python -m tools.compile_report [--design fullk] ...``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile

_PTR = {"bf16": "*bf16", "fp32": "*fp32"}


def _signature(jit, pointer_types: dict[str, str], constexprs: dict) -> dict:
    sig = {}
    for name in jit.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        elif name == "scale":
            sig[name] = "fp32"
        elif name in ("T", "NBH"):
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


def ptxas_numbers(log: str) -> dict:
    """Registers, spill bytes and stack from ptxas's -v report (0 where it names none)."""
    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack": grab(r"(\d+) bytes stack frame"),
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
        "sass_instructions": compiled.sass_instructions,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "maxnreg": maxnreg,
    }


def b6_report(design: str, K: int, V: int, H: int, HV: int, BV: int, num_warps: int, num_stages: int,
              dtype: str = "bf16", maxnreg: int | None = None, extra: dict | None = None) -> dict:
    from kernel_fun.kda.kernels import wy_bwd

    common = dict(cu_seqlens=None, chunk_indices=None, HV=HV, K=K, V=V, BT=64, BK=K, BV=BV, IS_VARLEN=False)
    act = {n: _PTR[dtype] for n in ("q", "k", "v", "v_new", "beta", "A", "h", "do", "dh", "dv", "dv2")}
    f32 = {n: "*fp32" for n in ("g", "dq", "dk", "dg", "db", "dA")}
    types = {**act, **f32}
    if design == "fullk":
        # the pinned prefetch tile for this K and V (not a fixed tile: at V=128 it is the first)
        pf_iter = wy_bwd.prefetch_iter(V, BV, wy_bwd.CONFIGS.get(("fullk", K), {}).get("PF_AT"))
        switches = {**dict(PF_ITER=pf_iter, HEADS_FAST=True, TIMELINE=False), **(extra or {})}
        if switches["TIMELINE"]:
            types["stamps"] = "*i64"
        else:
            switches["stamps"] = None
        return compile_sm90(wy_bwd.wy_dqkg_fullk_kernel, types, dict(common, H=H, **switches), num_warps, num_stages,
                            maxnreg)
    raise ValueError(design)


def b7_report(K: int, H: int, HV: int, BK: int, num_warps: int, num_stages: int, dtype: str = "bf16",
              design: str = "wide-halves-pf", maxnreg: int | None = None, tail: int = 0) -> dict:
    """B7's kernel (kda/kernels/intra_bwd.py), dense sequences, in one of its designs
    (``intra_bwd.DESIGNS``); ``tail`` 1 with B8, 2 with B8 and B9 (dt_bias, softplus form)."""
    from kernel_fun.kda.kernels import intra_bwd

    types = {"q": _PTR[dtype], "k": _PTR[dtype], "beta": _PTR[dtype], "NT_ROWS": "i32", "NT_ALL": "i32",
             "lower_bound": "fp32", **{n: "*fp32" for n in ("g", "dAqk", "dAkk", "dq", "dk", "dg", "dq2", "dk2",
                                                             "dg2", "db_part")}}
    gate = dict(g_raw=_PTR[dtype], A_log="*fp32", dt_bias="*fp32", dA_part="*fp32", dbias_part="*fp32")
    if tail == 2:
        types.update(gate, dg2=_PTR[dtype])
    constexprs = dict(cu_seqlens=None, chunk_indices=None, H=H, HV=HV, K=K, BT=64, BC=intra_bwd.BC, BK=BK,
                      IS_VARLEN=False, **intra_bwd.design_flags(design),
                      TAIL=tail, HAS_BIAS=tail == 2, USE_LOWER_BOUND=False,
                      **({} if tail == 2 else dict.fromkeys(gate)))
    return compile_sm90(intra_bwd.intra_bwd_wide_kernel, types, constexprs, num_warps, num_stages, maxnreg)


def diag_report(K: int, H: int, HV: int, BKS: int, num_warps: int, num_stages: int, dtype: str = "bf16",
                maxnreg: int | None = None) -> dict:
    """The F1-F4 kernel (kda/kernels/diag_fwd.py) at dense sequences, with the l2norm and the
    softplus gate with dt_bias."""
    from kernel_fun.kda.kernels import diag_fwd

    types = {n: _PTR[dtype] for n in ("q_raw", "k_raw", "g_raw", "beta", "q", "k", "Aqk")}
    types.update({n: "*fp32" for n in ("A_log", "dt_bias", "q_rstd", "k_rstd", "gc", "Akkd")}, lower_bound="fp32")
    constexprs = dict(cu_seqlens=None, chunk_indices=None, H=H, HV=HV, K=K, BT=64, BC=diag_fwd.BC, BKS=BKS,
                      IS_VARLEN=False, L2NORM=True, GATE=2, HAS_BIAS=True, PAIRWISE=False)
    return compile_sm90(diag_fwd.prep_diag_kernel, types, constexprs, num_warps, num_stages, maxnreg)


def solve_report(K: int, V: int, H: int, HV: int, BKS: int, num_warps: int, num_stages: int, dtype: str = "bf16",
                 maxnreg: int | None = None, wy: bool = False) -> dict:
    """The F5 kernel (diag_fwd.inter_solve_kernel) at dense sequences; ``wy`` with F6 (w,
    u, kg; no qg) in the same program."""
    from kernel_fun.kda.kernels import diag_fwd

    types = {n: _PTR[dtype] for n in ("q", "k", "beta", "Aqk", "Akk")}
    types.update(gc="*fp32", Akkd="*fp32")
    if wy:
        types.update({n: _PTR[dtype] for n in ("v", "w", "u", "kg")})
    constexprs = dict(cu_seqlens=None, chunk_indices=None, H=H, HV=HV, K=K, V=V, BT=64, BC=diag_fwd.BC, BKS=BKS,
                      BV=64, WY_BK=diag_fwd.WY_BK, IS_VARLEN=False, WY=wy, STORE_QG=False, qg=None,
                      **({} if wy else dict(v=None, w=None, u=None, kg=None)))
    return compile_sm90(diag_fwd.inter_solve_kernel, types, constexprs, num_warps, num_stages, maxnreg)


def recompute_report(K: int, V: int, H: int, HV: int, BKS: int, num_warps: int, num_stages: int,
                     dtype: str = "bf16") -> dict:
    """The backward's B1-B2 kernel (diag_fwd.recompute_kernel) at dense sequences, the
    softplus gate with dt_bias."""
    from kernel_fun.kda.kernels import diag_fwd

    types = {n: _PTR[dtype] for n in ("g_raw", "q", "k", "v", "beta", "Akk", "w", "u", "kg", "qg")}
    types.update(A_log="*fp32", dt_bias="*fp32", gc="*fp32", lower_bound="fp32")
    constexprs = dict(cu_seqlens=None, chunk_indices=None, H=H, HV=HV, K=K, V=V, BT=64, BC=diag_fwd.BC,
                      GBKS=diag_fwd.DEFAULT_CONFIG["BKS"], BKS=BKS, BV=diag_fwd.RECOMPUTE_CONFIG["BV"],
                      IS_VARLEN=False, GATE=2, HAS_BIAS=True)
    return compile_sm90(diag_fwd.recompute_kernel, types, constexprs, num_warps, num_stages)


def wy_report(K: int, V: int, H: int, HV: int, BK: int, num_warps: int, num_stages: int, store_u: bool = False,
              dtype: str = "bf16") -> dict:
    """B2's WY kernel (kda/kernels/wy_fwd.py) at dense sequences, qg written, u only with
    ``store_u``."""
    from kernel_fun.kda.kernels import wy_fwd

    types = {n: _PTR[dtype] for n in ("q", "k", "v", "beta", "Akk", "w", "u", "kg", "qg")}
    types.update(g="*fp32")
    constexprs = dict(cu_seqlens=None, chunk_indices=None, H=H, HV=HV, K=K, V=V, BT=64, BK=BK,
                      BV=wy_fwd.DEFAULT_CONFIG["BV"], IS_VARLEN=False, STORE_QG=True, STORE_U=store_u,
                      **({} if store_u else dict(u=None)))
    return compile_sm90(wy_fwd.wy_fwd_kernel, types, constexprs, num_warps, num_stages)


def prep_report(K: int, V: int, H: int, HV: int, BKS: int, BV: int, num_warps: int, num_stages: int,
                fused: bool = False, dtype: str = "bf16") -> dict:
    """The F3-F6 kernel (kda/kernels/prep_fwd.py) at dense sequences; ``fused`` with F1 and
    F2 (the l2norm, the softplus gate with dt_bias)."""
    from kernel_fun.kda.kernels import prep_fwd

    types = {n: _PTR[dtype] for n in ("q", "k", "v", "beta", "Aqk", "Akk", "w", "u", "kg", "qg")}
    types.update(g="*fp32", lower_bound="fp32")
    if fused:
        types.update(q_raw=_PTR[dtype], k_raw=_PTR[dtype], q_rstd="*fp32", k_rstd="*fp32", g_raw="*fp32",
                     A_log="*fp32", dt_bias="*fp32")
    absent = dict.fromkeys(("q_raw", "k_raw", "q_rstd", "k_rstd", "g_raw", "A_log", "dt_bias")) if not fused else {}
    constexprs = dict(cu_seqlens=None, chunk_indices=None, qg=None, H=H, HV=HV, K=K, V=V, BT=64, BC=prep_fwd.BC,
                      BK=max(16, triton_next_pow2(K)), BKS=BKS, BV=BV, IS_VARLEN=False, STORE_QG=False,
                      L2NORM=fused, GATE=2 if fused else 0, HAS_BIAS=fused, RECOMPUTE=False, **absent)
    return compile_sm90(prep_fwd.prep_fwd_kernel, types, constexprs, num_warps, num_stages)


def cconv_report(D: int, BD: int, num_warps: int, TS: int = 256, backward: bool = False) -> dict:
    """The short convolution's forward or backward kernel (cconv/kernels.py): bf16 x, fp32
    weight, W=4, SiLU, no bias, dense sequences."""
    from kernel_fun.cconv import kernels as K

    # x dense: channel stride 1 (a constant of the kernel), the others multiples of 16, as a launch specializes them
    types = dict(x="*bf16", w="*fp32", residual="*bf16", y="*bf16", dy="*bf16", dx="*bf16", dw_part="*fp32",
                 T="i32", stride_b="i32", stride_t="i32")
    constexprs = dict(D=D, W=4, BD=BD, TS=TS, SILU=True, HAS_BIAS=False, HAS_H0=False,
                      IS_VARLEN=False, seg_index=None, cu_seqlens=None, bias=None, h0=None, stride_d=1)
    if backward:
        constexprs.update(HAS_DHT=False, dht=None, db_part=None, dh0=None)
        return compile_sm90(K.causal_conv1d_bwd_kernel, types, constexprs, num_warps, 1, divisible=_STRIDES)
    constexprs.update(HAS_RESIDUAL=False, residual=None)
    return compile_sm90(K.causal_conv1d_fwd_kernel, types, constexprs, num_warps, 1, divisible=_STRIDES)


_STRIDES = ("stride_b", "stride_t")


def wgmma_shapes(ptx: str) -> dict[str, int]:
    shapes: dict[str, int] = {}
    for m in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+\.f32\.\w+\.\w+)", ptx):
        shapes[m] = shapes.get(m, 0) + 1
    return shapes


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", default="fullk",
                        help="fullk (B6), one of B7's designs (--BV its K slice), prep or prep-fused (F3-F6; --BV its "
                             "V tile, --bks its K slice), diag, solve, solve-wy (F1-F6), recompute (B1-B2) or wy, wy-u "
                             "(B2; --BV their K slice), cconv-fwd or cconv-bwd (--BV "
                             "the channel strip, --V the channels: 2048 by default)")
    parser.add_argument("--bks", type=int, default=64, help="the prep kernel's K slice")
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=256)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--HV", type=int, default=16, help="value heads; strides fold into the code, so spills can change with it")
    parser.add_argument("--BV", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--maxnreg", type=int, default=None)
    parser.add_argument("--tail", type=int, default=0, help="B7's block form: 1 with B8, 2 with B8 and B9")
    parser.add_argument("--extra", default="{}", help="JSON of fullk switches, e.g. '{\"PF_ITER\": -1}'")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    from kernel_fun.kda.kernels import intra_bwd
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    for design in args.design.split(","):
        for BV, warps, stages in itertools.product(ints(args.BV), ints(args.warps), ints(args.stages)):
            row = dict(design=design, K=args.K, V=args.V, **({"H": args.H, "HV": args.HV} if (args.H, args.HV) != (16, 16) else {}),
                       BV=BV,
                       **({"switches": json.loads(args.extra)} if args.extra != "{}" else {}))
            try:
                if design.startswith("cconv-"):  # --BV its channel strip
                    row.update(cconv_report(args.V if args.V != 256 else 2048, BV, warps,
                                            backward=design == "cconv-bwd"))
                elif design == "diag":  # --BV its K slice
                    row.update(diag_report(args.K, args.H, args.HV, BV, warps, stages, maxnreg=args.maxnreg))
                elif design in ("solve", "solve-wy"):  # --BV its K slice
                    row.update(solve_report(args.K, args.V, args.H, args.HV, BV, warps, stages, maxnreg=args.maxnreg,
                                            wy=design == "solve-wy"))
                elif design in ("wy", "wy-u"):  # B2: --BV its K slice
                    row.update(wy_report(args.K, args.V, args.H, args.HV, BV, warps, stages, store_u=design == "wy-u"))
                elif design == "recompute":  # --BV its K slice
                    row.update(recompute_report(args.K, args.V, args.H, args.HV, BV, warps, stages))
                elif design in ("prep", "prep-fused"):
                    row.update(prep_report(args.K, args.V, args.H, args.HV, args.bks, BV, warps, stages,
                                           fused=design == "prep-fused"))
                elif design in intra_bwd.DESIGNS:  # B7: --BV its K slice
                    row.update(b7_report(args.K, args.H, args.HV, BV, warps, stages, design=design, maxnreg=args.maxnreg,
                                         tail=args.tail))
                else:
                    row.update(b6_report(design, args.K, args.V, args.H, args.HV, BV, warps, stages,
                                         maxnreg=args.maxnreg, extra=json.loads(args.extra)))
            except Exception as err:  # a config that does not compile is a row too
                row.update(error=str(err).splitlines()[0][:160], num_warps=warps, num_stages=stages)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
