"""What B6's bytes alone cost on this GPU: a kernel that moves exactly the stage's data and
computes next to nothing.

``python -m research.b6_stream --shape prod8192_gate --out benchmarks/results/b6_ablation.jsonl``

``b6_stream_kernel`` has fullk's grid and launch order (one program per chunk-head, b*hv
fastest), reads every input of the stage once (A and beta once more in the epilogue, as
fullk does; L2 hits) in fullk's tiles -- per V tile do, v_new, dv, v as [64, BV] and h, dh
as [BV, K] -- and writes every output once, in the stage's dtypes: dv2 per V tile, then
dq, dk, dg, dA and db. Its arithmetic only keeps each load live (sums and products of the
loaded values, no dot), so its time is what the access pattern costs at a given pipeline
depth and residency: with ``BV=64, num_stages=3`` it holds, like fullk, too much shared
memory for a second program per SM (144 KB against fullk's 184 KB); at two stages and
smaller tiles several programs share an SM.

The outputs are a fixed formula of the inputs (``reference_outputs``), checked in the
interpreter and on the GPU, so a run that drops a load or a store does not pass. This is an
instrument, not the stage: nothing dispatches to it.

Measured on the H200 (2026-11-30 / 12-01, torch 2.11, triton 3.6; rows in
``benchmarks/results/b6_ablation.jsonl`` runs 43-46, reading in docs/log/b6.md,
thirteenth round), prod8192_gate (15.85 GB): at fullk's tiles and residency (BV=64,
8 warps, 3 stages, one program per SM) with fullk's whole-tile epilogue and L2 prefetch
(``rows=64, prefetch_at=2``) 4.27 ms against fullk's 4.89 in the same process (b8 2.12 /
2.44); with 16-row strips and no prefetch 4.95-5.09, the strips' serial waits; two or three
programs per SM 4.10-4.30; 16 warps, one program per SM, 3.80 (BV=256, 4.17 TB/s) to 4.28;
BV=32 5.09-5.47 at any residency.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernel_fun._triton import prefetch_rows as _prefetch_rows, to as _to

# (BV, num_warps, num_stages) and, where not the default, ``heads_fast`` (launch order),
# ``rows`` (the epilogue's strip height) and ``prefetch_at`` (fullk's L2 prefetch of k, q,
# g, that many V tiles before the end). fullk's tiles and residency (BV=64 at three stages,
# 144 KB of shared memory: one program per SM) first, then configs that let several
# programs share an SM, wider V tiles (longer runs of each token row per request), and
# fla's launch order (chunks fastest).
CONFIGS = [dict(BV=64, num_warps=8, num_stages=3), dict(BV=64, num_warps=8, num_stages=2),
           dict(BV=64, num_warps=4, num_stages=2), dict(BV=32, num_warps=4, num_stages=2),
           dict(BV=32, num_warps=4, num_stages=3), dict(BV=32, num_warps=8, num_stages=2),
           dict(BV=64, num_warps=4, num_stages=1), dict(BV=32, num_warps=4, num_stages=1),
           dict(BV=128, num_warps=8, num_stages=2), dict(BV=128, num_warps=8, num_stages=1),
           dict(BV=128, num_warps=16, num_stages=2), dict(BV=256, num_warps=8, num_stages=1),
           dict(BV=256, num_warps=16, num_stages=1), dict(BV=64, num_warps=8, num_stages=1),
           dict(BV=64, num_warps=8, num_stages=2, heads_fast=False),
           dict(BV=64, num_warps=4, num_stages=1, heads_fast=False),
           dict(BV=128, num_warps=8, num_stages=1, heads_fast=False)]
# fullk's structure with its epilogue's shape and prefetch (the whole [64, K] tiles at once;
# k, q, g asked of L2 two V tiles before the end, as fullk does), and at 16 warps.
FULLK_LIKE = [dict(BV=64, num_warps=8, num_stages=3), dict(BV=64, num_warps=8, num_stages=3, rows=64),
              dict(BV=64, num_warps=8, num_stages=3, prefetch_at=2),
              dict(BV=64, num_warps=8, num_stages=3, rows=64, prefetch_at=2),
              dict(BV=64, num_warps=16, num_stages=3), dict(BV=64, num_warps=16, num_stages=3, prefetch_at=2),
              dict(BV=64, num_warps=8, num_stages=2), dict(BV=128, num_warps=16, num_stages=2)]
SETS = {"all": CONFIGS, "fullk-like": FULLK_LIKE}
# How far (relative RMS) an output may sit from ``reference_outputs``: fp32 sums in another
# order (at most 1.2e-7 in the H200 runs 43-48). Farther means other bytes were moved.
FORMULA_RTOL = 1e-6


@triton.jit(do_not_specialize=["T", "NBH"])
def b6_stream_kernel(q, k, v, v_new, g, beta, A, h, do, dh, dv,
                     dq, dk, dv2, dg, db, dA, T, NBH,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr, RS: tl.constexpr,
                     HEADS_FAST: tl.constexpr, PF_ITER: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if HEADS_FAST:
        i_t, i_bh = pid // NBH, pid % NBH
    else:
        NTC = tl.cdiv(T, BT)
        i_t, i_bh = pid % NTC, pid // NTC
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    row0 = i_b * T + i_t * BT
    i_tg = i_b * tl.cdiv(T, BT) + i_t
    n_t = (T - i_t * BT).to(tl.int32)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    o_k = tl.arange(0, K)

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    v += (row0 * HV + i_hv) * V
    v_new += (row0 * HV + i_hv) * V
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    A += (row0 * HV + i_hv) * BT
    h += (i_tg * HV + i_hv) * K * V
    dh += (i_tg * HV + i_hv) * K * V
    do += (row0 * HV + i_hv) * V
    dv += (row0 * HV + i_hv) * V
    dq += (row0 * HV + i_hv) * K
    dk += (row0 * HV + i_hv) * K
    dv2 += (row0 * HV + i_hv) * V
    dg += (row0 * HV + i_hv) * K
    db += row0 * HV + i_hv
    dA += (row0 * HV + i_hv) * BT

    p_tt = o_t[:, None] * (HV * BT) + o_t[None, :]
    b_s = tl.zeros([K], dtype=tl.float32)
    b_a = tl.zeros([BT, BT], dtype=tl.float32)
    b_x = tl.zeros([BT], dtype=tl.float32)
    for i_v in tl.range(0, V // BV, num_stages=NS):
        o_v = i_v * BV + tl.arange(0, BV)
        p_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32)
        b_do = tl.load(do + p_tv, mask=m_t[:, None], other=0).to(tl.float32)
        b_vn = tl.load(v_new + p_tv, mask=m_t[:, None], other=0).to(tl.float32)
        b_dvn = tl.load(dv + p_tv, mask=m_t[:, None], other=0).to(tl.float32)
        b_v = tl.load(v + p_tv, mask=m_t[:, None], other=0).to(tl.float32)
        p_vk = o_v[:, None] + o_k[None, :] * V
        b_s += tl.sum(tl.load(h + p_vk).to(tl.float32) * tl.load(dh + p_vk).to(tl.float32), axis=0)
        b_a += tl.load(A + p_tt, mask=m_t[:, None], other=0).to(tl.float32)
        if PF_ITER >= 0:
            if i_v == PF_ITER:  # as fullk: the epilogue's k, q, g into L2 while the last tiles stream
                _prefetch_rows(k, o_t, H * K, m_t, K)
                _prefetch_rows(q, o_t, H * K, m_t, K)
                _prefetch_rows(g, o_t, HV * K, m_t, K)
        b_y = (b_do + b_vn + b_dvn) * b_beta[:, None]
        tl.store(dv2 + p_tv, _to(b_y, dv2.dtype.element_ty), mask=m_t[:, None])
        b_x += tl.sum(b_y * b_v, axis=1)

    # the epilogue in strips of RS rows, so its live set stays small enough for several
    # programs per SM at the light configs; the same 128-byte lines are read and written
    for r0 in tl.static_range(0, BT, RS):
        o_r = r0 + tl.arange(0, RS)
        m_r = (o_r < n_t)[:, None]
        p_qk = o_r[:, None] * (H * K) + o_k[None, :]
        p_tk = o_r[:, None] * (HV * K) + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_r, other=0).to(tl.float32)
        b_k = tl.load(k + p_qk, mask=m_r, other=0).to(tl.float32)
        b_g = tl.load(g + p_tk, mask=m_r, other=0)
        tl.store(dq + p_tk, b_q + b_s[None, :], mask=m_r)
        tl.store(dk + p_tk, b_k * b_g, mask=m_r)
        tl.store(dg + p_tk, b_g - b_q, mask=m_r)
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32)
    b_A = tl.load(A + p_tt, mask=m_t[:, None], other=0).to(tl.float32)
    tl.store(dA + p_tt, b_a + b_A, mask=m_t[:, None])
    tl.store(db + o_t * HV, b_x + b_beta, mask=m_t)


def launch(inputs: dict, BV: int, num_warps: int, num_stages: int, heads_fast: bool = True,
           rows: int = 16, prefetch_at: int | None = None, with_kernel: bool = False):
    """Moves B6's bytes for ``inputs`` (benchmarks.stages.b6.make_inputs's dict, fixed-length sequences)
    and returns (dq, dk, dv2, dg, db, dA), and with ``with_kernel`` the compiled kernel too."""
    q, k, v, v_new, g, beta, A, h, do, dh, dv = (inputs[n] for n in
                                                ("q", "k", "v", "v_new", "gc", "beta", "A", "h", "do", "dh", "dv"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if inputs.get("cu_seqlens") is not None:
        raise ValueError("b6_stream takes fixed-length sequences only")
    if K not in (64, 128) or V % BV or inputs.get("chunk_size", 64) != 64:
        raise ValueError(f"b6_stream takes K in (64, 128), V a multiple of BV and chunk size 64, got K={K}, V={V}, BV={BV}")
    if rows not in (16, 32, 64):
        raise ValueError(f"b6_stream's epilogue strips are 16, 32 or 64 rows, got {rows}")
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dg = (torch.empty(B, T, HV, K, **f32) for _ in range(3))
    dv2 = torch.empty_like(v)
    db = torch.empty(B, T, HV, **f32)
    dA = torch.empty(B, T, HV, 64, **f32)
    NT = triton.cdiv(T, 64)
    kernel = b6_stream_kernel[(NT * B * HV,)](q, k, v, v_new, g, beta, A, h, do, dh, dv, dq, dk, dv2, dg, db, dA, T, B * HV,
                                     H=H, HV=HV, K=K, V=V, BT=64, BV=BV, NS=num_stages, RS=rows, HEADS_FAST=heads_fast,
                                     PF_ITER=max(V // BV - prefetch_at, 0) if prefetch_at else -1,
                                     num_warps=num_warps, num_stages=num_stages)
    outs = (dq, dk, dv2, dg, db, dA)
    return (outs, kernel) if with_kernel else outs


def reference_outputs(inputs: dict, BV: int):
    """What ``launch`` computes, in torch (fp32 sums; dv2 rounded to v's dtype)."""
    q, k, v, v_new, g, beta, A, h, do, dh, dv = (inputs[n] for n in
                                                ("q", "k", "v", "v_new", "gc", "beta", "A", "h", "do", "dh", "dv"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = -(-T // 64)
    rep = HV // H
    qf, kf = (x.float().repeat_interleave(rep, dim=2) for x in (q, k))
    bf = beta.float()
    y = (do.float() + v_new.float() + dv.float()) * bf[..., None]
    dv2 = y.to(v.dtype)
    hdh = (h.float() * dh.float()).sum(-1)  # [B*NT, HV, K]: sum over V
    s = hdh.view(B, NT, HV, K).repeat_interleave(64, dim=1)[:, :T]
    dq = qf + s
    dk = kf * g
    dg = g - qf
    dA = A.float() * (V // BV + 1)
    db = (y * v.float()).sum(-1) + bf
    return dq, dk, dv2, dg, db, dA


def run(shape: str, configs=CONFIGS, reps: int = 10, rounds: int = 6) -> list[dict]:
    from benchmarks import rows as results
    from benchmarks.stage import config_label
    from benchmarks.stages.b6 import b6_bytes, make_inputs
    from kernel_fun import versions
    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.kda import reference as ref_mod
    from kernel_fun.kda.kernels import b6_wy_bwd
    from kernel_fun.kda.problems import problem

    p = problem(shape)
    inputs = make_inputs(p, "cuda")
    names = ("dq", "dk", "dv2", "dg", "db", "dA")
    fns, checks, compiled = {}, {}, {}
    # the formula checked on the first sequence (the same binary: T and NBH are not specialized)
    one = {n: (t[:1] if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    for cfg in configs:
        if p.V % cfg["BV"]:
            continue
        tag = config_label("b6_stream", cfg)
        out, kern = launch(one, **cfg, with_kernel=True)
        want = reference_outputs(one, cfg["BV"])
        checks[tag] = {n: ref_mod.rel_rms(a, b) for n, a, b in zip(names, out, want)}
        del out, want
        compiled[tag] = dict(registers=kern.n_regs, spills=kern.n_spills, shared=kern.metadata.shared)
        fns[tag] = (lambda cfg=cfg: launch(inputs, **cfg))
    fns["fullk (shipped)"] = lambda: b6_wy_bwd.wy_dqkg_bwd(**inputs)
    torch.cuda.empty_cache()
    times = {t: [] for t in fns}
    for f in fns.values():
        f()
    for r in range(rounds):
        for t in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[t] += cuda_times(fns[t], reps)
    n_bytes = b6_bytes(p)
    rows = []
    for t in fns:
        s = summary(times[t])
        rows.append({
            "kind": "ablation", "stage": "B6", "shape": shape, "problem": p.describe(),
            "variant": t, "ms": round(s["median"], 4),
            "spread_ms": [round(s["p10"], 4), round(s["p90"], 4)], "TBps": round(n_bytes / s["median"] / 1e9, 3),
            "bytes": n_bytes, "compiled": compiled.get(t), "moves_bytes_exactly": checks.get(t),
            "computes_b6": t not in checks,
            "method": "research.b6_stream: median of CUDA-event timings, interleaved rounds "
                      f"({rounds} of {reps}, order reversed every other round), one process, with the shipped fullk",
            "gpu": torch.cuda.get_device_name(), "versions": versions(), "commit": results.commit(),
            "date": results.now(),
        })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.b6_stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="prod8192_gate")
    parser.add_argument("--out", default=None, help="a jsonl file to append the rows to")
    parser.add_argument("--configs", default="all", choices=sorted(SETS))
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    rows = run(args.shape, SETS[args.configs])
    bad = [r["variant"] for r in rows if r["moves_bytes_exactly"] and max(r["moves_bytes_exactly"].values()) > FORMULA_RTOL]
    if args.out:  # a variant off its formula moved other bytes than the stage's: no row for it
        from benchmarks import rows as results

        for row in rows:
            if row["variant"] not in bad:
                results.append(Path(args.out), row)
    for r in rows:
        print(json.dumps({k: r[k] for k in ("variant", "ms", "spread_ms", "TBps", "compiled", "moves_bytes_exactly")}))
    print("\n".join(f"{r['shape']:14s} {r['variant']:64s} {r['ms']:.3f} ms  {r['TBps']:.2f} TB/s  {r['compiled'] or ''}"
                    for r in rows))
    if bad:
        print("outputs off the formula:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
