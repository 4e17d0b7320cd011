"""B7's three sums at a cost that does not depend on the gates: a candidate for the registered
B7-B9 kernel's levels (``kda/kernels/b7_b9_intra_bwd.py``, its ``SUMS`` hook). Not registered.

Why: each of the levels is a full pass of the [64, 64] dots for the rows it holds, and under
strong gates a level holds a few rows, so a chunk takes up to ~9 passes: in the compile rows'
core module (2026-12-05, an H100) the kernel took 4.67 ms where the layer's gentler gates
took 1.33 and fla's B7-B9 1.87 in both (docs/log/b7.md).

The chunk in four 16-row blocks, the factor exp2(g_r - g_s) of a pair (r >= s, g the chunk
cumsum in log2, non-increasing) split by where the pair lies:
- r and s in different blocks (s in block j, r in block i > j): through two fixed anchors,
  the first row n of block j + 1 and the first row a of block i:
  exp2(g_r - g_a) exp2(g_a - g_n) exp2(g_n - g_s), each factor at most 1 (a >= n > s and
  r >= a), so none can overflow, and one that underflows stands for a product smaller still.
  Row role (dq, dk's row part): per column block j one [64, 16] x [16, BK] product of dA's
  columns with k exp2(g_n - g_s), scaled per row by exp2(g_a - g_n) and, once at the end,
  exp2(g_r - g_a). Column role (dk's column part): per row block i one [64, 16] x [16, BK]
  product of dA's rows (transposed) with q or beta k times exp2(g_r - g_a), scaled per row s
  by exp2(g_a - g_n(s)) and at the end by exp2(g_n(s) - g_s). Three blocks a role and dA: a
  quarter of a [64, 64] dot each, 3 dots' worth in all (a level is 4).
- r and s in the same block: elementwise on the CUDA cores, 16 steps; step j pairs every row
  t with the row s = a(t) + j of its block, one exp2 a (row, channel) serving both roles
  (exp2(g_t - g_s) where s <= t, exp2(g_s - g_t) where s >= t: at most 1 either way).
Every anchor of a pair is a row at or before its later row, fixed by position: causal to the
bit like the levels (a pair with its later row past t has dA = 0 and finite factors).

Measured (an H100, 2026-12-05, benchmarks/results/b7_blocks_gpu.jsonl): under strong gates
2.5x the levels and level with fla (prod8192_strong 16.2 ms, levels 40.3, fla 16.9); at the
initialisation's gates 7-17% slower than the levels (prod8192_gate 12.4-12.6 against
10.6-10.8), so not registered. Choosing per program by the previous chunk, in one kernel or
as two launches, lost at those gates too (docs/log/b7.md). The fused backward kernel's B7 is
where these sums are meant to go.

    python -m research.b7_blocks compile        # sm_90a rows: the pinned kernel and with these sums
    python -m research.b7_blocks gpu --out $OUT/b7_blocks.jsonl   # parity, then timed against the pin
"""

from __future__ import annotations

import argparse
import json
import sys

import triton
import triton.language as tl

from kernel_fun._triton import dot3


@triton.jit
def block_sums(q, k, beta, dAqk, dAkk, g, n_t, o_k, m_k, HV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               SK: tl.constexpr, SG: tl.constexpr, GUARD: tl.constexpr, SCALE: tl.constexpr):
    """acc_q, acc_kr, acc_c for one (K slice, chunk, head), as the registered kernel's levels
    leave them: sum over s <= r of dAqk[r, s] k_s f(r, s); over s < r of dAkk[r, s] k_s f(r, s)
    (beta applied after, by the caller); and at row s the sum over r >= s of dAqk[r, s] q_r
    f(r, s) + (r > s) dAkk[r, s] beta_r k_r f(r, s), f(r, s) = exp2(g_r - g_s)."""
    BC: tl.constexpr = 16
    NB: tl.constexpr = BT // BC
    NEG: tl.constexpr = float("-inf")
    t = tl.arange(0, BT)
    c = tl.arange(0, BC)
    m_t = t < n_t
    m_tk = m_t[:, None] & m_k[None, :]
    a = (t // BC) * BC  # each row's block's first row
    nx = a + BC  # the next block's first row
    m_n = m_tk & (nx < n_t)[:, None]  # rows whose block has a later one in the chunk
    # pairs within a block: the registered kernel's levels, per 16-row block and channel, on
    # [NB, BC, BK] tiles with batched [BC, BC] x [BC, BK] products (a quarter of a level's
    # dots): a level from its first row u while the factor through g_u (less GUARD for the
    # first) stays within 2^+-GUARD, a block of span <= 2 GUARD in one level
    b3 = tl.arange(0, NB)
    rows = b3[:, None] * BC + c[None, :]  # [NB, BC]
    n_b = tl.minimum(tl.maximum(n_t - b3 * BC, 0), BC)  # [NB] each block's rows in the chunk
    m_r3 = (c[None, :] < n_b[:, None])[:, :, None] & m_k[None, None, :]  # [NB, BC, BK]
    p_g3 = rows[:, :, None] * SG + o_k[None, None, :]
    p_x3 = rows[:, :, None] * SK + o_k[None, None, :]
    p_A3 = rows[:, :, None] * (HV * BT) + rows[:, None, :]  # [NB, BC(r), BC(s)]
    m_A3 = (c[None, :] < n_b[:, None])[:, :, None] & (c[None, :] < n_b[:, None])[:, None, :]
    causal_q = (c[:, None] >= c[None, :])[None, :, :]
    causal_k = (c[:, None] > c[None, :])[None, :, :]
    d_q = tl.zeros([NB, BC, BK], dtype=tl.float32)
    d_kr = tl.zeros([NB, BC, BK], dtype=tl.float32)
    d_c = tl.zeros([NB, BC, BK], dtype=tl.float32)
    u = tl.where(m_k[None, :], 0, BC) + tl.zeros([NB, BK], dtype=tl.int32)  # [NB, BK] each level's first row
    u = tl.where(n_b[:, None] > 0, u, BC)
    shift = tl.full([NB, BK], GUARD, tl.float32)
    while tl.min(tl.min(u - n_b[:, None], axis=1), axis=0) < 0:
        g3 = tl.load(g + p_g3, mask=m_r3, other=0)
        live = u < n_b[:, None]
        g_u = tl.load(g + (b3[:, None] * BC + u) * SG + o_k[None, :], mask=live, other=0)
        past = (c[None, :, None] > u[:, None, :]) & m_r3 & (tl.abs(g_u[:, None, :] - shift[:, None, :] - g3) > GUARD)
        nxt3 = tl.min(tl.where(past, c[None, :, None], n_b[:, None, None]), axis=1)
        S = (c[None, :, None] < nxt3[:, None, :]) & live[:, None, :] & m_r3
        R = S & (c[None, :, None] >= u[:, None, :])
        # the factor's halves as the registered kernel's: the exponent kept exact
        dd = g_u[:, None, :] - g3
        near3 = dd >= 0.5 * shift[:, None, :]
        e3 = tl.where(near3, dd - shift[:, None, :], dd)
        lo3 = near3 | (shift[:, None, :] == 0)
        up3 = tl.exp2(tl.where(S, e3, NEG)) * tl.where(lo3, 1.0, SCALE)
        down3 = tl.exp2(tl.where(R, -e3, NEG)) * tl.where(lo3, 1.0, 1.0 / SCALE)
        k3 = tl.load(k + p_x3, mask=m_r3, other=0).to(tl.float32)
        q3 = tl.load(q + p_x3, mask=m_r3, other=0).to(tl.float32)
        be3 = tl.load(beta + rows * HV, mask=c[None, :] < n_b[:, None], other=0).to(tl.float32)
        kx3 = k3 * up3
        dA3 = tl.load(dAqk + p_A3, mask=m_A3 & causal_q, other=0)
        d_q += down3 * dot3(dA3, kx3)
        part3 = dot3(tl.permute(dA3, (0, 2, 1)), q3 * down3)
        dA3 = tl.load(dAkk + p_A3, mask=m_A3 & causal_k, other=0)
        d_kr += down3 * dot3(dA3, kx3)
        d_c += up3 * dot3(tl.permute(dA3, (0, 2, 1)), (be3[:, :, None] * k3) * down3, part3)
        u = nxt3
        shift = tl.zeros([NB, BK], tl.float32)
    acc_q = tl.reshape(d_q, [BT, BK])
    acc_kr = tl.reshape(d_kr, [BT, BK])
    acc_c = tl.reshape(d_c, [BT, BK])

    # across blocks (each role's tiles loaded where it starts, its outer factor applied where it ends)
    g_a = tl.load(g + a[:, None] * SG + o_k[None, :], mask=m_tk, other=0)
    x_q = tl.zeros([BT, BK], dtype=tl.float32)
    x_kr = tl.zeros([BT, BK], dtype=tl.float32)
    # row role, pairs across blocks: column block j against the rows of every later block
    for j in tl.static_range(NB - 1):
        s = j * BC + c
        m_s = s < n_t
        m_sk = m_s[:, None] & m_k[None, :]
        nj = (j + 1) * BC
        g_j = tl.load(g + s[:, None] * SG + o_k[None, :], mask=m_sk, other=0)
        g_nj = tl.load(g + nj * SG + o_k, mask=m_k & (nj < n_t), other=0)
        k_j = tl.load(k + s[:, None] * SK + o_k[None, :], mask=m_sk, other=0).to(tl.float32)
        kx = k_j * tl.exp2(tl.where(m_sk & (nj < n_t), g_nj[None, :] - g_j, NEG))
        later = m_t & (t >= nj)
        e = tl.exp2(tl.where(later[:, None] & m_k[None, :], g_a - g_nj[None, :], NEG))
        p_A = t[:, None] * (HV * BT) + s[None, :]
        m_A = later[:, None] & m_s[None, :]
        dA = tl.load(dAqk + p_A, mask=m_A, other=0)
        x_q += e * dot3(dA, kx)
        dA = tl.load(dAkk + p_A, mask=m_A, other=0)
        x_kr += e * dot3(dA, kx)

    down = tl.exp2(tl.where(m_tk, tl.load(g + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0) - g_a, NEG))
    acc_q += x_q * down
    acc_kr += x_kr * down
    g_n = tl.load(g + nx[:, None] * SG + o_k[None, :], mask=m_n, other=0)
    x_c = tl.zeros([BT, BK], dtype=tl.float32)
    # column role, pairs across blocks: row block i against the columns of every earlier block
    for i in tl.static_range(1, NB):
        r = i * BC + c
        m_r = r < n_t
        m_rk = m_r[:, None] & m_k[None, :]
        ai = i * BC
        g_i = tl.load(g + r[:, None] * SG + o_k[None, :], mask=m_rk, other=0)
        g_ai = tl.load(g + ai * SG + o_k, mask=m_k & (ai < n_t), other=0)
        down_i = tl.exp2(tl.where(m_rk, g_i - g_ai[None, :], NEG))
        q_i = tl.load(q + r[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
        k_i = tl.load(k + r[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
        b_i = tl.load(beta + r * HV, mask=m_r, other=0).to(tl.float32)
        earlier = m_t & (t < ai) & (ai < n_t)
        p_A = r[:, None] * (HV * BT) + t[None, :]
        m_A = m_r[:, None] & earlier[None, :]
        dA = tl.load(dAqk + p_A, mask=m_A, other=0)
        part = dot3(tl.trans(dA), q_i * down_i)
        dA = tl.load(dAkk + p_A, mask=m_A, other=0)
        part = dot3(tl.trans(dA), (b_i[:, None] * k_i) * down_i, part)
        x_c += tl.exp2(tl.where(earlier[:, None] & m_k[None, :], g_ai[None, :] - g_n, NEG)) * part

    acc_c += x_c * tl.exp2(tl.where(m_n, g_n - tl.load(g + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0), NEG))
    return acc_q, acc_kr, acc_c


def intra_bwd(_guard: float | None = None, **inputs):
    """The registered unit with these sums in its levels' place (same arguments, same outputs;
    ``_guard`` a smaller level span, for tests)."""
    from kernel_fun.kda.kernels import b7_b9_intra_bwd as unit

    return unit.intra_bwd(**inputs, sums=block_sums, _guard=_guard)


def compile_rows() -> list[dict]:
    """sm_90a (offline): the pinned kernel and the kernel with these sums, K=128 with the gate
    and dt_bias, at the pinned config."""
    from benchmarks.compile_report import b7_b9_report

    rows = []
    for name, sums in (("the levels, pinned", None), ("blocks sums, candidate", block_sums)):
        row = b7_b9_report(sums=sums)
        rows.append({"kind": "compile_sm90_candidate", "build": f"b7-b9 K128 gate ({name})", **{
            n: row.get(n) for n in ("registers", "spill_stores", "spill_loads", "stack", "shared", "sass_instructions",
                                    "wgmma", "sass_code_sha")}})
    return rows


GPU_SHAPES = "prod8192_gate,prod8192_strong,kimi,grid1024,grid1024_strong"


def gpu_rows(shapes: str, reps: int, rounds: int, device: str = "cuda") -> list[dict]:
    """On a GPU, per shape: both against the float64 stage (fla's budgets) and each other,
    then the two interleaved round by round (CUDA-event medians), with the share of programs
    on each count of levels."""
    import torch

    from benchmarks.stages.b7_b9 import BENCH, level_shares, make_inputs
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.kernels import b7_b9_intra_bwd as unit
    from kernel_fun.kda.problems import problem
    from research.causal_cost import time_pair

    names = ("dq", "dk", "db", "dg", "dA_log", "ddt_bias")
    rows = []
    for name in shapes.split(","):
        inputs = make_inputs(problem(name), device)
        pinned, blocks = unit.intra_bwd(**inputs), intra_bwd(**inputs)
        want = dict(zip(names, BENCH.exact(**inputs)))
        errors = {label: {n: ref.rel_rms(x, want[n]) for n, x in zip(names, out) if x is not None}
                  for label, out in (("levels", pinned), ("blocks", blocks))}
        between = {n: ref.rel_rms(x, y) for n, x, y in zip(names, blocks, pinned) if x is not None}
        del pinned, blocks, want
        ms = (time_pair({"levels": lambda: unit.intra_bwd(**inputs), "blocks": lambda: intra_bwd(**inputs)},
                        reps, rounds) if device == "cuda" else {})
        rows.append({"kind": "b7_blocks", "shape": name, "ms": ms, "vs_exact": errors, "blocks_vs_levels": between,
                     "level_shares": level_shares(inputs["gc"][:1]),
                     "gpu": torch.cuda.get_device_name() if device == "cuda" else device})
        print(json.dumps(rows[-1]), flush=True)
        inputs = None
        torch.cuda.empty_cache()
    print(f"{'shape':18s} {'levels ms':>10s} {'blocks ms':>10s}")
    for r in rows:
        print(f"{r['shape']:18s} {r['ms'].get('levels', float('nan')):10.3f} {r['ms'].get('blocks', float('nan')):10.3f}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.b7_blocks", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("compile", "gpu"))
    parser.add_argument("--shapes", default=GPU_SHAPES)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda (timed), or cpu for the parity alone (interpreter)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = compile_rows() if args.what == "compile" else gpu_rows(args.shapes, args.reps, args.rounds, args.device)
    if args.what == "compile":
        for r in rows:
            print(json.dumps(r))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
