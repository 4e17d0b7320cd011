"""Can Triton 3.6 warp-specialize B6 on Hopper? Compile probes for sm_90a (no GPU needed).

fullk's V loop and epilogue take ~10 us each per chunk-head and never overlap within an SM
(docs/log/b6.md): the overlap would have to come from warp specialization, a
producer warpgroup streaming the next tiles while consumer warpgroups compute. Triton 3.6
runs a Hopper pass for it (``nvidia.passes.hopper.add_hopper_warpspec``) on loops marked
``tl.range(..., warp_specialize=True)``. These probes find out what the pass takes:

- ``mm``: one [BM, 128] tile of a matmul over a K loop, the shape the pass was built
  for, with its operands by tensor descriptor (TMA) or by pointer, at 4 or 8 warps, and
  optionally a dot after the loop fed by a pointer load, by a descriptor load, or
  contracting over the accumulator's columns (as B6's ``dA += (-dw) kg^T`` contracts
  over K).
- ``b6``: B6's V loop on descriptors (the three [64, BV] @ [BV, K] dots, ``dvn v^T``,
  ``A^T dvn``, dv2's store, db's v-side, ``sum_V h dh``) with an epilogue that is the
  stage's without the k-side terms and the dA chain, and optionally with ``dA += (-dw) kg^T``.
  An ablation, not the stage: ``run_b6_probe`` launches it (tests/test_ws_probe.py checks
  its outputs against float64 in the interpreter; on the H200 its dq and dv2 are bitwise
  the shipped kernel's).

Each row: whether the pass specialized the kernel (``setmaxnreg`` in the PTX, warps
launched), registers, spills and shared memory, or the compiler's error; the B6 rows
compile each config ``--repeat`` times. ``python -m research.ws_probe``.

What it found (2026-11-30, Triton 3.6, ptxas 12.8; rows in
``benchmarks/results/b6_compile_sm90.jsonl``, design ``ws-probe``, timings run 42 of
``b6_ablation.jsonl``):

- the pass specializes only 4-warp kernels whose dot operands come by tensor descriptor:
  the matmul tile then launches 12 warps, a producer and two consumer warpgroups
  (``setmaxnreg`` 40 / 120 / 232 / 256 in its PTX); at 8 warps it does nothing, with
  pointer operands it fails, and so does a dot after the loop fed by a pointer load (an
  assertion in its token lowering);
- on B6's loop it is not deterministic: the same source compiles in some attempts and
  fails in others (without the epilogue's ``(-dw) kg^T``: 4 of 16 at BV=64 / 2 stages,
  1 of 16 at 3 stages, 2 of 16 at BV=32 / 2 and 3 stages; with it: 0 of 64), and what
  compiles spills 1,416-1,920 B per thread (BV=64 / 3 stages: 305 KB of shared memory,
  more than an SM has);
- timed on the H200 (prod8192_gate, same process): 8.57-9.61 ms specialized against 4.99
  (BV=64) and 5.49 (BV=32) for the same source unspecialized at 8 warps and 4.89 for the
  shipped kernel, which does more work. Bitwise the same dq, dk, dv2, dA as unspecialized.
  So Triton's own warp specialization cannot carry B6 on Hopper.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import triton
import triton.language as tl

from kernel_fun._triton import dot as _dot, to as _to

# The most shared memory one program may take on an H100/H200 (227 KB).
SM90_SHARED_BYTES = 232448


@triton.jit
def ws_mm_probe(a, b, a_ptr, c, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DESC: tl.constexpr, WS: tl.constexpr, EPI: tl.constexpr):
    """c[:BM, :BN] = a[:BM] @ b[:, :BN] (a, b descriptors if DESC, else pointers), then an
    optional dot: EPI 1 with a pointer-loaded operand, 2 with a descriptor-loaded one, 3
    contracting over the accumulator's columns."""
    o_m = tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for kk in tl.range(0, K, BK, warp_specialize=WS):
        if DESC:
            x = a.load([0, kk])
            y = b.load([kk, 0])
        else:
            x = tl.load(a + o_m[:, None] * K + (kk + o_k)[None, :])
            y = tl.load(b + (kk + o_k)[:, None] * BN + o_n[None, :])
        acc += _dot(x, y)
    if EPI == 1:  # [BM, BM] @ [BM, BN]: sums over the accumulator's rows
        acc = _dot(tl.load(a_ptr + o_m[:, None] * K + o_m[None, :]), _to(acc, tl.bfloat16))
    if EPI == 2:
        acc = _dot(a.load([0, 0]), _to(acc, tl.bfloat16))
    if EPI == 3:
        sq = _dot(_to(acc, tl.bfloat16), tl.trans(_to(acc, tl.bfloat16)))  # [BM, BM], sums over BN
        tl.store(c + BM * BN + o_m[:, None] * BM + o_m[None, :], sq)
    tl.store(c + o_m[:, None] * BN + o_n[None, :], acc)


@triton.jit
def ws_b6_probe(d_q, d_k, d_g, g, beta, dq, dk, dv2, dg, db, dA,
                d_do, d_vn, d_dv, d_v, d_h, d_dh, d_A, scale, T,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BV: tl.constexpr, WS: tl.constexpr, KG_DOT: tl.constexpr):
    """B6's V loop on descriptors, one program per (chunk, b*hv), T a multiple of BT.
    Writes dq and dv2 as the stage does; dk without its k-side term (dk_h only), dg
    without the k-side and last-row terms, db's v-side only, dA before the chain (dvn v^T,
    plus (-dw) kg^T if KG_DOT)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    row0 = i_b * T + i_t * BT
    hrow = ((i_b * (T // BT) + i_t) * HV + i_hv) * K
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    b_dq = tl.zeros([BT, K], dtype=tl.float32)
    b_dk = tl.zeros([BT, K], dtype=tl.float32)
    b_dw = tl.zeros([BT, K], dtype=tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dgk = tl.zeros([K], dtype=tl.float32)
    b_dbv = tl.zeros([BT, BV], dtype=tl.float32)
    b_beta = tl.load(beta + (row0 + o_t) * HV + i_hv).to(tl.float32)
    for i_v in tl.range(0, V // BV, warp_specialize=WS):
        col = i_hv * V + i_v * BV
        b_do = d_do.load([row0, col])
        b_vn = d_vn.load([row0, col])
        b_dvn = d_dv.load([row0, col])
        b_v = d_v.load([row0, col])
        b_h = d_h.load([hrow, i_v * BV])
        b_dh = d_dh.load([hrow, i_v * BV])
        b_At = tl.trans(d_A.load([row0, i_hv * BT]))
        b_dgk += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        b_dq += _dot(b_do, tl.trans(b_h))
        b_dk += _dot(b_vn, tl.trans(b_dh))
        b_dw += _dot(b_dvn, tl.trans(b_h))
        b_dA += _dot(b_dvn, tl.trans(b_v))
        b_dvb = _dot(b_At, b_dvn)
        o_v = i_v * BV + tl.arange(0, BV)
        tl.store(dv2 + (row0 + o_t[:, None]) * (HV * V) + i_hv * V + o_v[None, :],
                 _to(b_dvb * b_beta[:, None], dv2.dtype.element_ty))
        b_dbv += b_dvb * b_v.to(tl.float32)
    p_tk = (row0 + o_t[:, None]) * (HV * K) + i_hv * K + o_k[None, :]
    b_k = d_k.load([row0, i_h * K])
    b_q = d_q.load([row0, i_h * K])
    b_g = d_g.load([row0, i_hv * K])
    b_gn = tl.load(g + (row0 + BT - 1) * (HV * K) + i_hv * K + o_k)
    b_gexp = tl.exp2(b_g)
    b_dq = b_dq * b_gexp * scale
    tl.store(dq + p_tk, b_dq)
    b_dk = b_dk * tl.exp2(b_gn[None, :] - b_g)
    tl.store(dk + p_tk, b_dk)
    tl.store(dg + p_tk, b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk + b_dgk[None, :])
    if KG_DOT:
        b_dA += _dot(_to(-b_dw, b_k.dtype), tl.trans(_to(b_k * b_gexp, b_k.dtype)))
    tl.store(dA + (row0 + o_t[:, None]) * (HV * BT) + i_hv * BT + o_t[None, :], b_dA)
    tl.store(db + (row0 + o_t) * HV + i_hv, tl.sum(b_dbv, axis=1))


def run_b6_probe(inputs: dict, BV: int, kg_dot: bool = False, warp_specialize: bool = False, num_warps: int = 8,
                 num_stages: int = 3):
    """Launch the B6 probe on ``benchmarks.stages.b6.make_inputs``-style inputs (no
    varlen, T a multiple of 64). Returns dq, dk_h, dv2, dg (partial), db (v-side), dA
    (before the chain), all as the probe's docstring defines them."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    q, k, g, beta, A = inputs["q"], inputs["k"], inputs["gc"], inputs["beta"], inputs["A"]
    v, vn, do, dv, h, dh = (inputs[n] for n in ("v", "v_new", "do", "dv", "h", "dh"))
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = 64
    if T % BT or inputs.get("cu_seqlens") is not None or V % BV or K & (K - 1):
        raise ValueError(f"the B6 probe takes T a multiple of 64, V a multiple of BV, K a power of two and no "
                         f"cu_seqlens; got T={T}, V={V}, BV={BV}, K={K}")
    desc = lambda t, cols, block: TensorDescriptor.from_tensor(t.reshape(-1, cols), block)  # noqa: E731
    dq, dk, dg = (torch.empty(B, T, HV, K, device=k.device, dtype=torch.float32) for _ in range(3))
    dv2 = torch.empty_like(v)
    db = torch.empty(B, T, HV, device=k.device, dtype=torch.float32)
    dA = torch.empty(B, T, HV, BT, device=k.device, dtype=torch.float32)
    ws_b6_probe[(T // BT, B * HV)](
        desc(q, H * K, [BT, K]), desc(k, H * K, [BT, K]), desc(g, HV * K, [BT, K]), g, beta,
        dq, dk, dv2, dg, db, dA,
        desc(do, HV * V, [BT, BV]), desc(vn, HV * V, [BT, BV]), desc(dv, HV * V, [BT, BV]), desc(v, HV * V, [BT, BV]),
        desc(h, V, [K, BV]), desc(dh, V, [K, BV]), desc(A, HV * BT, [BT, BT]), inputs["scale"], T,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, WS=warp_specialize, KG_DOT=kg_dot,
        num_warps=num_warps, num_stages=num_stages)
    return dq, dk, dv2, dg, db, dA


def _compile(fn, sig: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    from benchmarks.compile_report import assemble_sm90, ptxas_numbers

    full = {**sig, **{n: "constexpr" for n in constexprs}}
    row = {"num_warps": num_warps, "num_stages": num_stages}
    try:
        compiled, log = assemble_sm90(fn, {n: full[n] for n in fn.arg_names}, constexprs, num_warps, num_stages)
    except RuntimeError as err:  # the pass's failures ("PassManager::run failed") are rows too
        return {**row, "error": str(err).splitlines()[0][:160]}
    ptx = compiled.asm["ptx"]
    nums = ptxas_numbers(log)
    return {**row, "specialized": "setmaxnreg" in ptx, "warps_launched": compiled.metadata.num_warps,
            "setmaxnreg": sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
            "registers": nums["registers"], "spill_stores": nums["spill_stores"], "shared": compiled.metadata.shared,
            "fits_sm90": compiled.metadata.shared <= SM90_SHARED_BYTES}


def mm_row(desc: bool, num_warps: int, epi: int, BM: int = 64, ws: bool = True) -> dict:
    BN, BK = 128, 64
    op = (lambda s: f"tensordesc<bf16[{s[0]}, {s[1]}]>") if desc else (lambda s: "*bf16")
    sig = dict(a=op((BM, BK)), b=op((BK, BN)), a_ptr="*bf16", c="*fp32", K="i32")
    r = _compile(ws_mm_probe, sig, dict(BM=BM, BN=BN, BK=BK, DESC=desc, WS=ws, EPI=epi), num_warps, 3)
    return dict(probe="mm", operands="descriptor" if desc else "pointer", BM=BM, epilogue_dot=
                [None, "pointer-loaded operand", "descriptor-loaded operand", "contracts over the accumulator's N"][epi],
                warp_specialize=ws, **r)


def b6_row(BV: int, num_stages: int, kg_dot: bool, num_warps: int = 4, ws: bool = True, repeat: int = 1) -> dict:
    """B6's loop probe, compiled ``repeat`` times (the Hopper pass does not give the same
    answer every time for it): how many compiled, and the range of what they made."""
    K, V, BT = 128, 256, 64
    d = lambda r, c, t="bf16": f"tensordesc<{t}[{r}, {c}]>"  # noqa: E731
    sig = dict(d_q=d(BT, K), d_k=d(BT, K), d_g=d(BT, K, "fp32"), g="*fp32", beta="*bf16", dq="*fp32", dk="*fp32",
               dv2="*bf16", dg="*fp32", db="*fp32", dA="*fp32", d_do=d(BT, BV), d_vn=d(BT, BV), d_dv=d(BT, BV),
               d_v=d(BT, BV), d_h=d(K, BV), d_dh=d(K, BV), d_A=d(BT, BT), scale="fp32", T="i32")
    runs = [_compile(ws_b6_probe, sig, dict(H=16, HV=16, K=K, V=V, BT=BT, BV=BV, WS=ws, KG_DOT=kg_dot),
                     num_warps, num_stages) for _ in range(repeat)]
    ok = [r for r in runs if "error" not in r]
    row = dict(probe="b6", K=K, V=V, BV=BV, kg_dot=kg_dot, warp_specialize=ws, num_warps=num_warps,
               num_stages=num_stages, compiled=len(ok), attempts=repeat)
    if ok:
        for key in ("specialized", "warps_launched", "setmaxnreg", "registers", "fits_sm90"):
            row[key] = ok[0][key]
        for key in ("spill_stores", "shared"):
            row[key] = [min(r[key] for r in ok), max(r[key] for r in ok)]
    if len(ok) < repeat:
        row["error"] = next(r["error"] for r in runs if "error" in r)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=8, help="compiles per B6 config")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # every attempt compiles; a cached kernel would hide the variation
    for row in (mm_row(True, 4, 0, BM=128), mm_row(True, 4, 0), mm_row(True, 8, 0), mm_row(False, 4, 0),
                mm_row(False, 8, 0), mm_row(True, 4, 1), mm_row(True, 4, 2), mm_row(True, 4, 3)):
        print(json.dumps(row), flush=True)
    for kg in (False, True):
        for BV in (64, 32):
            for ns in (2, 3):
                print(json.dumps(b6_row(BV, ns, kg, repeat=args.repeat)), flush=True)
    for BV in (64, 32):  # the same source unspecialized, 8 warps
        print(json.dumps(b6_row(BV, 3, False, num_warps=8, ws=False)), flush=True)


if __name__ == "__main__":
    main()
