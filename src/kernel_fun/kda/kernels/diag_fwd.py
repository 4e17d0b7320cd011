"""The forward's F1-F6 unit in kernel-fun's kernels: F1, F2 and F4 in one kernel (the l2norm
of q and k, the gate's activation and chunk cumsum, the diagonal 16x16 blocks of Aqk and
Akk), then F5 (the blocks below the diagonal and the solve: fla's, or ``inter_solve``
here), then fla's F6 (w, u, kg); one program a (chunk, value head) each (``prep_f1_f6``).

Replaces fla's ``l2norm_fwd`` (F1, 0.81 ms inside the op at prod8192_gate on the H200),
``kda_gate_chunk_cumsum`` (F2, 0.42) and ``chunk_kda_fwd_kernel_intra_token_parallel`` (F4,
1.63): three passes over the same rows, F4 one program a token (131,072 x 16 at
prod8192_gate) reading back the normalized q, k and the gate's cumsum that F1 and F2 wrote,
its diagonal blocks pairwise on CUDA cores, an exp2 per pair and channel. Here each K slice
of the chunk is read raw once more after its rows' norms are summed, normalized, activated
and cumsummed in registers, written once (what F5, F6, the scan and the backward read), and
used where it is. With GVA every value head's program writes its q/k head's normalized rows
(the same values), so the pairwise blocks below read back only what their own program wrote.

The diagonal blocks: Aqk[r, s] = scale sum_c q_rc k_sc exp2(g_rc - g_sc) and Akk[r, s] =
beta_r sum_c k_rc k_sc exp2(g_rc - g_sc) for r, s in one 16-row block, s <= r (s < r for
Akk), through the block's first row a: q_r exp2(g_r - g_a) <= 1 and k_s exp2(g_a - g_s)
<= 2^span, span the block's first row minus its last, the largest over the channels. All
four blocks in one [64, BKS] x [BKS, 64] dot a score and K slice (three tf32 products,
``dot3``: fp32-level), each row's factor through its own block's first row, the entries
across blocks discarded. A block whose span passes GUARD_SPAN (2^64) takes its pairs on
CUDA cores instead (16 steps, one exp2(g_r - g_s) <= 1 a pair and channel): exact for any
gate, so ``safe_gate`` changes nothing here (fla's safe_gate F4 is an anchored product
valid for a bounded gate).

F5 (``inter_solve``, fla's ``chunk_kda_fwd_kernel_inter_solve_fused``'s contract): the
blocks below the diagonal through each column block's last row (both factors at most 1 for
any gate), [64, BKS] x [BKS, 16] dots in three tf32 products; the solve in fp32 on CUDA
cores, the diagonal blocks' inverses by substitution (four at once in block-local form,
15 steps) and the six blocks below by X_mj = -Dinv_m sum_p L_mp X_pj in three dependent
levels of 16x16 products, each block stored as it is made (fla: the same structure, tf32
products). With F6 in the same program (``diag-solve-wy``) Akk_inv is read back as the
[64, 64] operand after a barrier and ``wy_fwd``'s WY code (``wy_k``, ``wy_v``, fla's
roundings) runs in 64-channel slices (``WY_BK``: at the scores' 16-channel slices its bf16
products read shared memory past the allocation on the H200, compute-sanitizer's finding).

fla's F5 takes the blocks as this kernel leaves them (the blocks themselves, fla's F4's
form without ``safe_gate``) whatever the gate: with ``safe_gate`` fla's F4 stores the
diagonal blocks' inverses and its F5 skips the substitution, so ``chain._fla_f5`` launches
it with that switch off.

Numerics: the normalized rows, their rstds and the cumsum as fla's F1 and F2 form them
(fp32, rounded to the input dtype where fla's are); the blocks in fp32 from the rounded
rows, Aqk and Akk_inv rounded to the input dtype, Akk's diagonal blocks kept in fp32 for
the solve, as fla's. Outputs are fresh tensors (Aqk's blocks below the diagonal F5's, in
place): relaunching is idempotent.

The backward's recompute (``recompute_b1_b2``, the B1-B2 unit): B1 (the gate's cumsum from
the raw gate, with the gate in the op) and B2 (w, u, qg, kg from the saved Akk_inv) in one
program a (chunk, value head): the F1-F4 kernel's gate code writes gc, and after a barrier
prep_fwd's WY code reads it back from the lines just written (fla: two passes, B2 re-reading
gc's 1.07 GB at prod8192_gate from DRAM). Predicted from the bytes (6.7 GB, 1.40 ms at the
floor) at fla's B2 efficiency (77% of its floor): 1.7-1.9 ms against fla's B1 + B2 2.09
inside the op; measured 3.03 against fla's 2.21 (below). A candidate
(``--candidate B1-B2=recompute``; the stage bench's entry ``B1-B2``).

Falls back (``supports``): chunk size other than 64, K > 256; the B1-B2 unit also a
pre-computed gate (its cumsum is saved: B1 does not run).

On the H200 (2026-12-02; stages.jsonl at 13572cf, docs/log/prep.md): every design runs
clean under compute-sanitizer at B1 T256 and passes the GPU parity tests (T=500 with h0,
with and without recompute, packed sequences, strong gates, layer-safe, prod8192_gate), and
every one is slower than fla: at prod8192_gate the unit 8.83 ms (``diag``), 11.54
(``diag-solve``), 12.08 (``diag-solve-wy``) against fla's F1-F6 5.76; B1-B2 3.03 against
fla's 2.21 (predicted 4.2-4.7, 3.3-4.5 and 1.7-1.9). Not dispatched: ``candidate`` registers
a unit for a bench run (``python -m kernel_fun.bench --candidate F1-F6=diag``). What the
time is (Nsight Compute): the F1-F4 kernel issues 14,800 instructions a warp at two 4-warp
programs an SM (255 registers), and 20% of chunk-heads on the chain's gate take the
pairwise path (the guard over the whole K), ~1.1 ms of its 5.6; the softplus through
``tl.log`` was 28% of its instructions, now the ``softplus`` helper (5.58 -> 4.93 ms). B1-B2's
time is prep_fwd's WY code, not the gate.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernel_fun._triton import GUARD_SPAN, chunk_head, dot3, softplus, to
from kernel_fun.kda.kernels.wy_fwd import wy_k, wy_v
from kernel_fun.kda.reference import RCP_LN2 as _RCP_LN2

BC = 16  # the diagonal block
RCP_LN2 = tl.constexpr(_RCP_LN2)  # the chunk cumsum in log2 units, as the chain's gc


@triton.jit
def _log_decay(x, A, lower_bound, GATE: tl.constexpr):
    """The gate's per-token log-decay (natural log) from the raw input plus dt_bias: 1 the
    input itself (a pre-computed gate), 2 -exp(A_log) softplus(x) (softplus as torch's: x
    past 20 passes through), 3 lower_bound sigmoid(exp(A_log) x)."""
    if GATE == 1:
        return x
    elif GATE == 2:
        return -A * softplus(x)
    else:
        return lower_bound * tl.sigmoid(A * x)


@triton.jit
def _gate_cumsum(g_raw, dt_bias, A, lower_bound, t, o_k, m_k, m_tk, i_hv, K: tl.constexpr, SG: tl.constexpr,
                 GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The chunk's gate on channels o_k (``g_raw`` at its first row and head): the raw input
    plus dt_bias through ``_log_decay``, cumsummed down the chunk in log2 units (the chain's
    gc), zero on masked entries. The forward's F1-F4 kernel and the backward's B1-B2 kernel
    both form gc here."""
    x = tl.load(g_raw + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
    a = tl.where(m_tk, _log_decay(x, A, lower_bound, GATE), 0.0)
    return tl.cumsum(a, axis=0) * RCP_LN2


@triton.jit
def _per_block(x, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, FIRST: tl.constexpr):
    """[BT, BKS] -> each row's block's first row (FIRST) or the block's largest value over
    its rows (not FIRST), per channel, broadcast back to the block's rows."""
    x3 = tl.reshape(x, (BT // BC, BC, BKS))
    if FIRST:
        pos = tl.arange(0, BC)
        v = tl.sum(tl.where(pos[None, :, None] == 0, x3, 0.0), axis=1)
    else:
        v = tl.max(x3, axis=1)
    return tl.reshape(tl.broadcast_to(v[:, None, :], (BT // BC, BC, BKS)), (BT, BKS))


@triton.jit
def _local(S, t, BT: tl.constexpr, BC: tl.constexpr):
    """[BT, BT] -> [BT, BC]: each row's entries in its own block's columns."""
    S3 = tl.reshape(S, (BT, BT // BC, BC))
    blk = tl.arange(0, BT // BC)
    return tl.sum(tl.where(blk[None, :, None] == (t // BC)[:, None, None], S3, 0.0), axis=1)


@triton.jit
def _chunk_head(cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The program's (value head, q/k head, the chunk's first token row, its token count)."""
    tl.static_assert(BT == 4 * BC, "written for four blocks a chunk")
    return chunk_head(cu_seqlens, chunk_indices, T, H, HV, BT, IS_VARLEN)


@triton.jit
def prep_diag_kernel(
    q_raw, k_raw, g_raw, beta, A_log, dt_bias, lower_bound,
    q, k, q_rstd, k_rstd, gc, Aqk, Akkd, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PAIRWISE: tl.constexpr,
):
    """F1 (with L2NORM), F2 and F4 on one (chunk, value head), K in slices of BKS channels.
    PAIRWISE sends every diagonal block to the pairwise form (the tests' other path)."""
    i_hv, i_h, row0, n_t = _chunk_head(cu_seqlens, chunk_indices, T, H, HV, BT, BC, IS_VARLEN)
    SK: tl.constexpr = H * K
    SG: tl.constexpr = HV * K
    NKS: tl.constexpr = (K + BKS - 1) // BKS

    o_qk = (row0 * H + i_h) * K
    o_g = (row0 * HV + i_hv) * K
    t = tl.arange(0, BT)
    m_t = t < n_t
    b_c = tl.load(beta + (row0 + t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    if GATE > 1:
        A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        A = 0.0

    # F1's norms: the rows' sums of squares over every slice first
    if L2NORM:
        ss_q = tl.zeros([BT], dtype=tl.float32)
        ss_k = tl.zeros([BT], dtype=tl.float32)
        for i_s in range(0, NKS):
            o_k = i_s * BKS + tl.arange(0, BKS)
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            p = o_qk + t[:, None] * SK + o_k[None, :]
            x = tl.load(q_raw + p, mask=m_tk, other=0).to(tl.float32)
            ss_q += tl.sum(x * x, axis=1)
            x = tl.load(k_raw + p, mask=m_tk, other=0).to(tl.float32)
            ss_k += tl.sum(x * x, axis=1)
        r_q = 1.0 / tl.sqrt(ss_q + 1e-6)
        r_k = 1.0 / tl.sqrt(ss_k + 1e-6)
        tl.store(q_rstd + (row0 + t) * H + i_h, r_q, mask=m_t)
        tl.store(k_rstd + (row0 + t) * H + i_h, r_k, mask=m_t)

    # each slice: the normalized rows and the cumsum, written, and their part of the blocks
    s_q = tl.zeros([BT, BT], dtype=tl.float32)
    s_k = tl.zeros([BT, BT], dtype=tl.float32)
    span = tl.zeros([BT, BKS], dtype=tl.float32)  # per row: its block's span, the slices' largest
    for i_s in range(0, NKS):  # (pipelined at num_stages > 1)
        o_k = i_s * BKS + tl.arange(0, BKS)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p = o_qk + t[:, None] * SK + o_k[None, :]
        q_s = tl.load(q_raw + p, mask=m_tk, other=0)
        k_s = tl.load(k_raw + p, mask=m_tk, other=0)
        if L2NORM:
            q_s = to(q_s.to(tl.float32) * r_q[:, None], q.dtype.element_ty)
            k_s = to(k_s.to(tl.float32) * r_k[:, None], k.dtype.element_ty)
            tl.store(q + p, q_s, mask=m_tk)
            tl.store(k + p, k_s, mask=m_tk)
        q_s = q_s.to(tl.float32)
        k_s = k_s.to(tl.float32)
        g_s = _gate_cumsum(g_raw + o_g, dt_bias, A, lower_bound, t, o_k, m_k, m_tk, i_hv, K, SG, GATE, HAS_BIAS)
        tl.store(gc + o_g + t[:, None] * SG + o_k[None, :], g_s, mask=m_tk)
        # through each row's block's first row: <= 1 for the block's rows, <= 2^span for its
        # columns (span: the largest |g_a - g| in the block, so a given gate that grows is
        # bounded too; the exponents capped where a block goes pairwise, whose values are
        # discarded)
        g_a = _per_block(g_s, BT, BC, BKS, True)
        span = tl.maximum(span, _per_block(tl.abs(g_a - g_s), BT, BC, BKS, False))
        down = tl.exp2(tl.where(m_tk, tl.minimum(g_s - g_a, GUARD_SPAN), float("-inf")))
        up = tl.exp2(tl.where(m_tk, tl.minimum(g_a - g_s, GUARD_SPAN), float("-inf")))
        k_t = tl.trans(k_s * up)
        s_q = dot3(q_s * down, k_t, s_q)
        s_k = dot3(k_s * down, k_t, s_k)
    d_q = _local(s_q, t, BT, BC)
    d_k = _local(s_k, t, BT, BC)
    pos = tl.arange(0, BC)
    if PAIRWISE:
        pair = m_t
    else:
        pair = m_t & (tl.max(span, axis=1) > GUARD_SPAN)

    if tl.max(pair.to(tl.int32), axis=0) > 0:
        # the blocks past the guard: row r against s = r's block start + jj (s <= r), from the
        # rows just written (this program's: after a barrier) or the raw ones
        tl.debug_barrier()
        p_q = q if L2NORM else q_raw
        p_k = k if L2NORM else k_raw
        for jj in range(0, BC):
            o = (t // BC) * BC + jj
            on = pair & (o <= t)
            v_q = tl.zeros([BT], dtype=tl.float32)
            v_k = tl.zeros([BT], dtype=tl.float32)
            for i_s in range(0, NKS):
                o_k = i_s * BKS + tl.arange(0, BKS)
                m_ok = on[:, None] & (o_k < K)[None, :]
                q_r = tl.load(p_q + o_qk + t[:, None] * SK + o_k[None, :], mask=m_ok, other=0).to(tl.float32)
                k_r = tl.load(p_k + o_qk + t[:, None] * SK + o_k[None, :], mask=m_ok, other=0).to(tl.float32)
                k_o = tl.load(p_k + o_qk + o[:, None] * SK + o_k[None, :], mask=m_ok, other=0).to(tl.float32)
                g_r = tl.load(gc + o_g + t[:, None] * SG + o_k[None, :], mask=m_ok, other=0)
                g_o = tl.load(gc + o_g + o[:, None] * SG + o_k[None, :], mask=m_ok, other=0)
                k_e = k_o * tl.exp2(tl.where(m_ok, g_r - g_o, float("-inf")))  # <= 1 a factor
                v_q += tl.sum(q_r * k_e, axis=1)
                v_k += tl.sum(k_r * k_e, axis=1)
            at = pair[:, None] & (pos[None, :] == jj)
            d_q = tl.where(at, v_q[:, None], d_q)
            d_k = tl.where(at, v_k[:, None], d_k)

    # the blocks: Aqk's (s <= r, scaled, in the input dtype) into its [BT]-wide rows at the
    # block's columns, Akk's (s < r, times beta_r, fp32) into Akkd's [BC]-wide rows; zeros
    # above the diagonal
    r_in = t % BC
    m_w = m_t[:, None] & (pos[None, :] < BC)
    p_a = (row0 + t)[:, None] * (HV * BT) + i_hv * BT + ((t // BC) * BC)[:, None] + pos[None, :]
    tl.store(Aqk + p_a, to(tl.where(pos[None, :] <= r_in[:, None], d_q * scale, 0.0), Aqk.dtype.element_ty), mask=m_w)
    # and zeros past the block (the upper blocks, which nothing computes): Aqk holds no
    # unwritten entry once F5 has written the blocks below the diagonal
    above = m_t[:, None] & (t[None, :] >= ((t // BC + 1) * BC)[:, None])
    p_u = (row0 + t)[:, None] * (HV * BT) + i_hv * BT + t[None, :]
    tl.store(Aqk + p_u, tl.zeros([BT, BT], dtype=Aqk.dtype.element_ty), mask=above)
    p_d = (row0 + t)[:, None] * (HV * BC) + i_hv * BC + pos[None, :]
    tl.store(Akkd + p_d, tl.where(pos[None, :] < r_in[:, None], d_k * b_c[:, None], 0.0), mask=m_w)


@triton.jit
def _rows_of_block(x, i, BT: tl.constexpr, BC: tl.constexpr, W: tl.constexpr):
    """[BT, W] -> the rows of 16-row block i, [BC, W]."""
    x3 = tl.reshape(x, (BT // BC, BC, W))
    blk = tl.arange(0, BT // BC)
    return tl.sum(tl.where(blk[:, None, None] == i, x3, 0.0), axis=0)


@triton.jit
def _mm(a, b):
    """[M, J] x [J, N] in fp32 on CUDA cores (the solve's 16x16 blocks)."""
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _diag_inverses(D, BT: tl.constexpr, BC: tl.constexpr):
    """(I + D_b)^-1 for every 16x16 diagonal block b at once, D in block-local form [BT, BC]
    (strictly lower in each block): forward substitution, row i = e_i - sum_m D[i, m] X[m]."""
    NB: tl.constexpr = BT // BC
    pos = tl.arange(0, BC)
    # only the strictly lower part is read (fla's F4 leaves the rest of Akkd unwritten)
    D3 = tl.where(pos[None, :, None] > pos[None, None, :], tl.reshape(D, (NB, BC, BC)), 0.0)
    X3 = tl.broadcast_to(tl.where(pos[:, None] == pos[None, :], 1.0, 0.0)[None, :, :], (NB, BC, BC))
    for i in range(1, BC):
        sel = pos[None, :, None] == i
        d_i = tl.sum(tl.where(sel, D3, 0.0), axis=1)  # [NB, BC]: row i of each block
        X3 = tl.where(sel, X3 - tl.sum(d_i[:, :, None] * X3, axis=1)[:, None, :], X3)
    return tl.reshape(X3, (BT, BC))


@triton.jit
def _col_block(q_s, k_s, g_s, k, gc, st, n_t, t, o_k, m_k, acc_q, acc_k, SK: tl.constexpr, SG: tl.constexpr,
               BC: tl.constexpr):
    """Column block st's part of both scores for the rows below it, through the block's last
    row e: k_s exp2(e - g_s) <= 1 on its columns, q_r exp2(g_r - e) <= 1 below it (any gate)."""
    cols = st + tl.arange(0, BC)
    m_c = cols < n_t
    last = tl.minimum(st + BC, n_t) - 1
    e = tl.load(gc + last * SG + o_k, mask=m_k & (st < n_t), other=0)
    m_ck = m_c[:, None] & m_k[None, :]
    k_j = tl.load(k + cols[:, None] * SK + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
    g_j = tl.load(gc + cols[:, None] * SG + o_k[None, :], mask=m_ck, other=0)
    kx = tl.trans(k_j * tl.exp2(tl.where(m_ck, e[None, :] - g_j, float("-inf"))))
    below = (t >= st + BC) & (t < n_t)
    f = tl.exp2(tl.where(below[:, None] & m_k[None, :], g_s - e[None, :], float("-inf")))
    acc_q = dot3(q_s * f, kx, acc_q)
    acc_k = dot3(k_s * f, kx, acc_k)
    return acc_q, acc_k


@triton.jit
def inter_solve_kernel(
    q, k, gc, beta, Aqk, Akkd, Akk, v, w, u, kg, qg, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BV: tl.constexpr, WY_BK: tl.constexpr, IS_VARLEN: tl.constexpr, WY: tl.constexpr,
    STORE_QG: tl.constexpr,
):
    """F5 on one (chunk, value head), from the diagonal blocks F4 left (Aqk's, Akkd): Aqk's
    blocks below the diagonal (scaled, in the input dtype) and Akk_inv = (I + Akk)^-1 (lower,
    in the input dtype, zeros above the diagonal blocks). The scores through each column
    block's last row, K in slices of BKS (three tf32 products a dot); the solve on CUDA cores
    in fp32: the diagonal blocks' inverses by substitution, the blocks below by
    X_mj = -Dinv_m sum_p L_mp X_pj, each stored as it is made."""
    i_hv, i_h, row0, n_t = _chunk_head(cu_seqlens, chunk_indices, T, H, HV, BT, BC, IS_VARLEN)
    SK: tl.constexpr = H * K
    SG: tl.constexpr = HV * K
    NKS: tl.constexpr = (K + BKS - 1) // BKS
    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    gc += (row0 * HV + i_hv) * K
    t = tl.arange(0, BT)
    m_t = t < n_t
    pos = tl.arange(0, BC)
    b_c = tl.load(beta + (row0 + t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)

    sq0 = tl.zeros([BT, BC], dtype=tl.float32)
    sk0 = tl.zeros([BT, BC], dtype=tl.float32)
    sq1 = tl.zeros([BT, BC], dtype=tl.float32)
    sk1 = tl.zeros([BT, BC], dtype=tl.float32)
    sq2 = tl.zeros([BT, BC], dtype=tl.float32)
    sk2 = tl.zeros([BT, BC], dtype=tl.float32)
    for i_s in range(0, NKS):
        o_k = i_s * BKS + tl.arange(0, BKS)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        q_s = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
        k_s = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
        g_s = tl.load(gc + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0)
        sq0, sk0 = _col_block(q_s, k_s, g_s, k, gc, 0, n_t, t, o_k, m_k, sq0, sk0, SK, SG, BC)
        sq1, sk1 = _col_block(q_s, k_s, g_s, k, gc, BC, n_t, t, o_k, m_k, sq1, sk1, SK, SG, BC)
        sq2, sk2 = _col_block(q_s, k_s, g_s, k, gc, 2 * BC, n_t, t, o_k, m_k, sq2, sk2, SK, SG, BC)

    # Aqk below the diagonal, column block j at its columns for the rows below it
    p_row = (row0 + t)[:, None] * (HV * BT) + i_hv * BT
    dt = Aqk.dtype.element_ty
    blk = t // BC
    tl.store(Aqk + p_row + pos[None, :], to(sq0 * scale, dt), mask=m_t[:, None] & (blk >= 1)[:, None])
    tl.store(Aqk + p_row + BC + pos[None, :], to(sq1 * scale, dt), mask=m_t[:, None] & (blk >= 2)[:, None])
    tl.store(Aqk + p_row + 2 * BC + pos[None, :], to(sq2 * scale, dt), mask=m_t[:, None] & (blk >= 3)[:, None])

    # the solve: L = beta_r Akk (strictly lower), its diagonal blocks from Akkd
    l0 = sk0 * b_c[:, None]
    l1 = sk1 * b_c[:, None]
    l2 = sk2 * b_c[:, None]
    dinv = _diag_inverses(tl.load(Akkd + (row0 + t)[:, None] * (HV * BC) + i_hv * BC + pos[None, :],
                                  mask=m_t[:, None], other=0), BT, BC)
    # the diagonal blocks of the inverse, and zeros above them
    dta = Akk.dtype.element_ty
    tl.store(Akk + p_row + (blk * BC)[:, None] + pos[None, :], to(dinv, dta), mask=m_t[:, None])
    above = m_t[:, None] & (t[None, :] >= ((blk + 1) * BC)[:, None])
    tl.store(Akk + p_row + t[None, :], tl.zeros([BT, BT], dtype=dta), mask=above)
    d0 = _rows_of_block(dinv, 0, BT, BC, BC)
    d1 = _rows_of_block(dinv, 1, BT, BC, BC)
    d2 = _rows_of_block(dinv, 2, BT, BC, BC)
    d3 = _rows_of_block(dinv, 3, BT, BC, BC)
    # L's blocks below the diagonal: L_mp = rows of block m of column block p
    l10 = _rows_of_block(l0, 1, BT, BC, BC)
    l20 = _rows_of_block(l0, 2, BT, BC, BC)
    l30 = _rows_of_block(l0, 3, BT, BC, BC)
    l21 = _rows_of_block(l1, 2, BT, BC, BC)
    l31 = _rows_of_block(l1, 3, BT, BC, BC)
    l32 = _rows_of_block(l2, 3, BT, BC, BC)
    x10 = -_mm(d1, _mm(l10, d0))
    x21 = -_mm(d2, _mm(l21, d1))
    x32 = -_mm(d3, _mm(l32, d2))
    x20 = -_mm(d2, _mm(l20, d0) + _mm(l21, x10))
    x31 = -_mm(d3, _mm(l31, d1) + _mm(l32, x21))
    x30 = -_mm(d3, _mm(l30, d0) + _mm(l31, x10) + _mm(l32, x20))
    r_b = row0 + tl.arange(0, BC)
    _store_block(Akk, x10, r_b + BC, 0, n_t - BC, i_hv, HV, BT, BC)
    _store_block(Akk, x20, r_b + 2 * BC, 0, n_t - 2 * BC, i_hv, HV, BT, BC)
    _store_block(Akk, x21, r_b + 2 * BC, BC, n_t - 2 * BC, i_hv, HV, BT, BC)
    _store_block(Akk, x30, r_b + 3 * BC, 0, n_t - 3 * BC, i_hv, HV, BT, BC)
    _store_block(Akk, x31, r_b + 3 * BC, BC, n_t - 3 * BC, i_hv, HV, BT, BC)
    _store_block(Akk, x32, r_b + 3 * BC, 2 * BC, n_t - 3 * BC, i_hv, HV, BT, BC)
    if WY:
        # F6 in the same program: Akk_inv read back as the dot's [BT, BT] operand (this
        # program's stores, after a barrier), then prep_fwd's WY code in slices of WY_BK
        # channels, not the scores' BKS: at 16 bf16 channels the product's shared operand has
        # 32-byte rows, which Triton 3.6 reads past its end on the H200 (compute-sanitizer:
        # an invalid shared read; the N=8 tf32 hazard's kind)
        tl.debug_barrier()
        x_b = tl.load(Akk + p_row + t[None, :], mask=m_t[:, None], other=0)
        for i_s in range(0, (K + WY_BK - 1) // WY_BK):
            o_k = i_s * WY_BK + tl.arange(0, WY_BK)
            wy_k(x_b, q, k, gc, beta, b_c, w, kg, qg, row0, t, m_t, n_t, o_k, o_k < K, i_hv, K, SK, SG, STORE_QG)
        wy_v(x_b, v, b_c, u, row0, t, m_t, i_hv, HV, V, BV)


@triton.jit
def _store_block(A, x, rows, c0, n_rows, i_hv, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """A 16x16 block of the inverse at (rows, columns c0 ..), rounded to A's dtype; the
    block's first n_rows rows are tokens."""
    pos = tl.arange(0, BC)
    m = (pos < n_rows)[:, None] & (pos[None, :] < BC)
    tl.store(A + rows[:, None] * (HV * BT) + i_hv * BT + c0 + pos[None, :], to(x, A.dtype.element_ty), mask=m)


# Compiled for sm_90a offline (``python -m tools.compile_report --design diag --BV 32 --warps 4``,
# K=128, H=HV=16, the l2norm and the softplus gate): 255 registers, no spills, 3,928
# instructions (4,792 with the softplus through tl.log; the slice loops unrolled: 48 B of
# spills, 15,384); 16-channel slices 211 registers; at 8 warps 205 and 132 registers; two
# stages 4 B of spills and 45 KB of shared memory. Measured alone at prod8192_gate: 4.93 ms
# on the chain's gate (5.58 with tl.log), 4.14 on a gate that sends no block pairwise;
# 16-channel slices and two stages 4.69 and 4.68 against 4.51 at this config (tl.log builds).
DEFAULT_CONFIG = dict(BKS=32, num_warps=4, num_stages=1)


def _gate_form(use_gate_in_kernel: bool, lower_bound) -> int:
    """``_log_decay``'s GATE: 1 a pre-computed gate, 2 the softplus form, 3 the lower-bounded."""
    return 1 if not use_gate_in_kernel else (2 if lower_bound is None else 3)


def prep_diag(q, k, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, scale,
              chunk_size, cu_seqlens, chunk_indices, pairwise: bool = False, **config):
    """F1, F2 and F4: (q, q_rstd, k, k_rstd, gc, Aqk, Akkd) with Aqk [B, T, HV, 64] in q's
    dtype holding the diagonal blocks (s <= r, scaled) and zeros above them (the blocks
    below the diagonal left for F5), and Akkd [B, T, HV, 16] fp32 the diagonal blocks of Akk
    (s < r, times beta_r; zero elsewhere), as fla's F4 leaves them for F5.
    Without the l2norm q and k are returned as given and the rstds are None."""
    for name, t in dict(q=q, k=k, g=g, beta=beta).items():
        if not t.is_contiguous():
            raise ValueError(f"the F1-F4 kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    cfg = {**DEFAULT_CONFIG, **config}
    B, T, H, K = k.shape
    HV = g.shape[2]
    BT = chunk_size
    norm = use_qk_l2norm_in_kernel
    dev = k.device
    qn = torch.empty_like(q) if norm else q
    kn = torch.empty_like(k) if norm else k
    q_rstd = torch.empty(B, T, H, device=dev, dtype=torch.float32) if norm else None
    k_rstd = torch.empty_like(q_rstd) if norm else None
    gc = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
    Aqk = torch.empty(B, T, HV, BT, device=dev, dtype=k.dtype)
    Akkd = torch.empty(B, T, HV, BC, device=dev, dtype=torch.float32)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    gate = _gate_form(use_gate_in_kernel, lower_bound)
    prep_diag_kernel[(NT, B * HV)](
        q_raw=q, k_raw=k, g_raw=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
        lower_bound=0.0 if lower_bound is None else float(lower_bound),
        q=qn, k=kn, q_rstd=q_rstd, k_rstd=k_rstd, gc=gc, Aqk=Aqk, Akkd=Akkd, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, BT=BT, BC=BC,
        BKS=min(cfg["BKS"], max(16, triton.next_power_of_2(K))), IS_VARLEN=cu_seqlens is not None, L2NORM=norm,
        GATE=gate, HAS_BIAS=use_gate_in_kernel and dt_bias is not None, PAIRWISE=pairwise,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return qn, q_rstd, kn, k_rstd, gc, Aqk, Akkd


# The F5 kernel at 4 warps (sm_90a, K=128): 16-channel slices 158 registers (three programs
# an SM), no spills, 2,272 instructions; 32-channel 202 and 2,624; with F6 (V=256, its K side
# in WY_BK=64 slices) 194 and 3,000 (two an SM), 234 and 3,336. At 8 warps Triton 3.6 builds
# its [64, 16] score dots as N=8 tf32 wgmmas, which the H200 runs out of bounds
# (tools/compile_report.py): refused.
SOLVE_CONFIG = dict(BKS=16, num_stages=1)
# F6's K side in the F5 program: 64-channel slices (bf16 N=64 products, prep_fwd's measured
# shape), whatever the scores' slice
WY_BK = 64


def inter_solve(q, k, gc, beta, Aqk, Akkd, scale, chunk_size, cu_seqlens, chunk_indices,
                BKS: int = SOLVE_CONFIG["BKS"], num_stages: int = SOLVE_CONFIG["num_stages"], v=None,
                disable_recompute: bool = False):
    """F5 with the contract of fla's ``chunk_kda_fwd_kernel_inter_solve_fused``: fills Aqk's
    blocks below the diagonal (in place; the diagonal blocks are F4's) and returns Akk_inv
    [B, T, HV, 64] in k's dtype (lower, zeros above). With ``v``, F6 in the same program
    too: returns (Akk_inv, w, u, qg, kg) as fla's ``recompute_w_u_fwd`` (qg only with
    ``disable_recompute``). Always 4 warps."""
    num_warps = 4
    for name, t in dict(q=q, k=k, gc=gc, beta=beta, Aqk=Aqk, Akkd=Akkd, v=v).items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"the F5 kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    B, T, H, K = k.shape
    HV = gc.shape[2]
    BT = chunk_size
    Akk = torch.empty(B, T, HV, BT, device=k.device, dtype=k.dtype)
    wy = v is not None
    w = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype) if wy else None
    kg = torch.empty_like(w) if wy else None
    qg = torch.empty_like(w) if wy and disable_recompute else None
    u = torch.empty_like(v) if wy else None
    V = v.shape[-1] if wy else 16
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    inter_solve_kernel[(NT, B * HV)](
        q=q, k=k, gc=gc, beta=beta, Aqk=Aqk, Akkd=Akkd, Akk=Akk, v=v, w=w, u=u, kg=kg, qg=qg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BC=BC,
        BKS=min(BKS, max(16, triton.next_power_of_2(K))), BV=min(64, max(16, triton.next_power_of_2(V))),
        WY_BK=WY_BK, IS_VARLEN=cu_seqlens is not None, WY=wy, STORE_QG=qg is not None, num_warps=num_warps,
        num_stages=num_stages,
    )
    return (Akk, w, u, qg, kg) if wy else Akk


def prep_f1_f6(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, scale,
               safe_gate, disable_recompute, chunk_size, cu_seqlens, chunk_indices, design: str = "diag", **config):
    """The F1-F6 unit: F1, F2 and F4 here, then by ``design`` (``DESIGNS``) fla's F5 and F6
    (``diag``), this module's F5 (``inter_solve``) and fla's F6 (``diag-solve``), or F5 and F6
    in this module's one program (``diag-solve-wy``); on the CPU, where fla's kernels do not
    run, the reference's F5 on the same diagonal blocks and its F6 stand in for fla's: (q,
    q_rstd, k, k_rstd, gc, w, u, kg, Aqk, Akk_inv, qg) as the chain's stages give them."""
    if design not in DESIGNS:
        raise ValueError(f"unknown F1-F6 design {design!r}; expected one of {DESIGNS}")
    from kernel_fun.kda import chain

    # SOLVE_BKS / SOLVE_STAGES: the F5 kernel's slice and stages; the rest the F1-F4 kernel's
    config = dict(config)
    solve = dict(BKS=config.pop("SOLVE_BKS", SOLVE_CONFIG["BKS"]),
                 num_stages=config.pop("SOLVE_STAGES", SOLVE_CONFIG["num_stages"]))
    qn, q_rstd, kn, k_rstd, gc, Aqk, Akkd = prep_diag(q, k, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel,
                                                      use_qk_l2norm_in_kernel, scale, chunk_size, cu_seqlens,
                                                      chunk_indices, **config)
    on_gpu = k.device.type == "cuda"
    if design == "diag-solve-wy":
        Akk, w, u, qg, kg = inter_solve(qn, kn, gc, beta, Aqk, Akkd, scale, chunk_size, cu_seqlens, chunk_indices,
                                        **solve, v=v, disable_recompute=disable_recompute)
        return qn, q_rstd, kn, k_rstd, gc, w, u, kg, Aqk, Akk, qg
    if design == "diag-solve":
        Akk = inter_solve(qn, kn, gc, beta, Aqk, Akkd, scale, chunk_size, cu_seqlens, chunk_indices, **solve)
    else:
        Akk = (chain._fla_f5 if on_gpu else chain._ref_f5)(qn, kn, gc, beta, Aqk, Akkd, scale, chunk_size,
                                                           cu_seqlens, chunk_indices)
    # F6: the WY stage (B2's), qg only where fla's F6 makes it
    w, u, qg, kg = (chain._fla_wy if on_gpu else chain._ref_wy)(qn if disable_recompute else None, kn, v, beta, Akk,
                                                                gc, chunk_size, cu_seqlens, chunk_indices)
    return qn, q_rstd, kn, k_rstd, gc, w, u, kg, Aqk, Akk, qg


@triton.jit
def recompute_kernel(
    g_raw, A_log, dt_bias, lower_bound, q, k, v, beta, Akk, gc, w, u, kg, qg, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    GBKS: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """B1 and B2 on one (chunk, value head): the gate's activation and chunk cumsum from the
    raw gate, the F1-F4 kernel's code on slices of its width (GBKS), written; then, after a
    barrier, w, u, kg and qg from the saved Akk_inv by prep_fwd's WY code, reading the
    cumsum back from the lines just written, K and V in slices of BKS and BV."""
    i_hv, i_h, row0, n_t = _chunk_head(cu_seqlens, chunk_indices, T, H, HV, BT, BC, IS_VARLEN)
    SK: tl.constexpr = H * K
    SG: tl.constexpr = HV * K
    NKS: tl.constexpr = (K + BKS - 1) // BKS
    t = tl.arange(0, BT)
    m_t = t < n_t
    o_g = (row0 * HV + i_hv) * K
    if GATE > 1:
        A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        A = 0.0
    for i_s in range(0, (K + GBKS - 1) // GBKS):
        o_k = i_s * GBKS + tl.arange(0, GBKS)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        g_s = _gate_cumsum(g_raw + o_g, dt_bias, A, lower_bound, t, o_k, m_k, m_tk, i_hv, K, SG, GATE, HAS_BIAS)
        tl.store(gc + o_g + t[:, None] * SG + o_k[None, :], g_s, mask=m_tk)
    tl.debug_barrier()
    b_c = tl.load(beta + (row0 + t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    x_b = tl.load(Akk + (row0 + t)[:, None] * (HV * BT) + i_hv * BT + t[None, :], mask=m_t[:, None], other=0)
    q_h = q + (row0 * H + i_h) * K
    k_h = k + (row0 * H + i_h) * K
    for i_s in range(0, NKS):
        o_k = i_s * BKS + tl.arange(0, BKS)
        wy_k(x_b, q_h, k_h, gc + o_g, beta, b_c, w, kg, qg, row0, t, m_t, n_t, o_k, o_k < K, i_hv, K, SK, SG, True)
    wy_v(x_b, v, b_c, u, row0, t, m_t, i_hv, HV, V, BV)


# Compiled for sm_90a offline (``python -m tools.compile_report --design recompute --BV 64
# --warps 4 --stages 1``, K=128, V=256, H=HV=16, the softplus gate): 184 registers (two
# programs an SM), no spills, 1,736 instructions (2,112 with tl.log's softplus; 3.00 and
# 3.01 ms at prod8192_gate: its time is the WY part). 64-channel WY slices: bf16 N=64 products,
# the shape prep_fwd's kernel ran on the H200 (no 32-byte operand rows); the gate's slices
# the F1-F4 kernel's default width and warps, so its scan is laid out as that kernel's (the
# GPU test holds the two cumsums to each other bit for bit).
RECOMPUTE_CONFIG = dict(BKS=64, BV=64, num_warps=4)


def recompute_b1_b2(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, q, k, v, beta, A, chunk_size, cu_seqlens,
                    chunk_indices, BKS: int = RECOMPUTE_CONFIG["BKS"], BV: int = RECOMPUTE_CONFIG["BV"],
                    num_warps: int = RECOMPUTE_CONFIG["num_warps"]):
    """The backward's B1-B2 unit with the contract of fla's ``kda_gate_chunk_cumsum`` then
    ``recompute_w_u_fwd`` (q given): (gc, w, u, qg, kg), gc fp32 [B, T, HV, K] in log2
    units, the rest in k's (v's for u) dtype, from the raw gate and the saved Akk_inv ``A``.
    Only with the gate in the op (``supports_recompute``)."""
    if not use_gate_in_kernel:
        raise ValueError("the B1-B2 unit recomputes the gate's cumsum from the raw gate: use_gate_in_kernel only")
    for name, t in dict(g=g, q=q, k=k, v=v, beta=beta, A=A).items():
        if not t.is_contiguous():
            raise ValueError(f"the B1-B2 kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    dev = k.device
    gc = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
    w = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype)
    kg, qg = torch.empty_like(w), torch.empty_like(w)
    u = torch.empty_like(v)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    recompute_kernel[(NT, B * HV)](
        g_raw=g, A_log=A_log, dt_bias=dt_bias, lower_bound=0.0 if lower_bound is None else float(lower_bound),
        q=q, k=k, v=v, beta=beta, Akk=A, gc=gc, w=w, u=u, kg=kg, qg=qg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BC=BC,
        GBKS=min(DEFAULT_CONFIG["BKS"], max(16, triton.next_power_of_2(K))),
        BKS=min(BKS, max(16, triton.next_power_of_2(K))), BV=min(BV, max(16, triton.next_power_of_2(V))),
        IS_VARLEN=cu_seqlens is not None, GATE=_gate_form(True, lower_bound), HAS_BIAS=dt_bias is not None,
        num_warps=num_warps,
    )
    return gc, w, u, qg, kg


def supports_recompute(k, v, use_gate_in_kernel, chunk_size, **_) -> str | None:
    """None when the B1-B2 kernel takes the call, else why B1 and B2 stay on fla."""
    if not use_gate_in_kernel:
        return "a pre-computed gate (its cumsum is saved; B1 does not run)"
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the kernel is built for 64)"
    if k.shape[-1] > 256:
        return f"K={k.shape[-1]} > 256"
    return None


def candidate(stage: str, design: str):
    """(implementation, supports) of a unit on this module's kernels, for a bench run that
    measures it in the whole op before it is registered (``python -m kernel_fun.bench
    --candidate F1-F6=diag``): F1-F6 ``diag`` the F1-F4 kernel with fla's F5 and F6,
    ``diag-solve`` with this module's F5, ``diag-solve-wy`` with F6 in the F5 kernel; B1-B2
    ``recompute`` the backward's gate cumsum and WY recompute in one kernel."""
    if stage == "B1-B2" and design == "recompute":
        return recompute_b1_b2, supports_recompute
    if stage != "F1-F6" or design not in DESIGNS:
        raise ValueError(f"diag_fwd has the candidates F1-F6={'/'.join(DESIGNS)} and B1-B2=recompute, "
                         f"not {stage}={design}")
    return functools.partial(prep_f1_f6, design=design), supports


DESIGNS = ("diag", "diag-solve", "diag-solve-wy")


def supports(q, k, chunk_size, **_) -> str | None:
    """None when the kernel takes the F1-F6 unit's first part, else why F1-F6 stay on fla."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the F1-F4 kernel is built for 64)"
    if k.shape[-1] > 256:
        return f"K={k.shape[-1]} > 256"
    return None
