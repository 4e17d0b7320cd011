"""B7, the intra-chunk backward: gradients through Aqk and Akk into dq, dk, db and dg.

Replaces fla's ``chunk_kda_bwd_kernel_intra`` (14.6 ms at prod8192_gate on the H200, 37%
of kernel-fun's fwd+bwd, 6.4x its 2.28 ms memory floor). fla runs one program per
(16-row sub-chunk, 32-channel K slice, chunk, head): 524,288 programs at prod8192_gate,
each reloading its neighbours' q, k, g and dA tiles, row-wise and transposed, and the
diagonal 16x16 blocks run two 16-step loops on CUDA cores with an exp2 per element over
the whole square.

This design: one program per chunk-head owns the chunk (64 rows) and walks K in BK-wide
slices, so q, k, g and the dA tiles are read once per slice by one program. For a row r
and an earlier column s the factor is e^(G_r - G_s) = exp2(g_r - g_s), with g the chunk
cumsum (log2 units, non-increasing along the chunk):

- across 16-row sub-chunks, as tensor-core dots through the sub-chunk boundaries, where
  every factor is one-sided: rows of sub-chunk i against earlier columns through the
  first row of i (exp2(g_r - a_i) * exp2(a_i - g_s), both <= 1), columns of sub-chunk i
  against later rows through its last row;
- inside each 16-row diagonal block, pairwise on CUDA cores: 16 steps, each a gathered
  [64, BK] row tile, one exp2 per (row, column, channel) of the exponent g_r - g_s with
  r >= s, never through an anchor, so it cannot overflow for any gate. ``pairwise``
  computes each pair's factor twice, once per role; ``pairwise-shared`` once, the column
  role summed per block from the row role's terms (in step j every row of a block pairs
  with the same column);
- or, with ``safe_gate`` only (``diagonal="anchored"``), inside the same sub-chunk dots
  through the same anchors: safe_gate's lower bound (-5 nats a token) keeps a block's
  factors within 2^(+-110), inside fp32's range, and the diagonal needs no exp2 loop.

Numerics: fp32 throughout (the dots in tf32, as fla's off-diagonal dots). The pairwise
forms keep the one-sided law for any gate; the anchored one rests on safe_gate's bound,
and the launcher refuses it without safe_gate. Outputs are fresh tensors (dq + its intra
part, and so on): no output is read back, so relaunching is idempotent.

Falls back (``supports``): chunk size other than 64.

Resources (sm_90a, K=128): 255 registers, 8 B of spills at BK=32 and 8 warps (anchored
16 B), so one program per SM (two at 4 warps).

Measured on the H200 (bench/results/stages.jsonl, a7cdba7; docs/log/b7.md): parity
everywhere, but slower than fla's stage at every config: prod8192_gate 20.1 ms at 4 warps,
25.4 at 8 (fla 15.1); prod8192_layer_safe anchored 16.0 (fla 7.9). The sub-chunk dots,
not the diagonal, take the time (~20 ms): each iteration reloads its dA tiles and waits on
them with no other program on the SM to hide the wait. Not registered: the chain keeps
fla's B7 (tests/test_gpu.py holds this kernel to fla's stage; tests/test_intra_bwd.py to
the float64 stage in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import chunk_coords, dot

BC = 16  # the diagonal block


@triton.jit
def intra_bwd_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg,
    dq2, dk2, db2, dg2,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, ANCHORED: tl.constexpr, SHARED_EXP: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    row0 = bos + i_c * BT
    n_t = (T - i_c * BT).to(tl.int32)  # rows of this chunk inside its sequence (may exceed BT)
    NC: tl.constexpr = BT // BC

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    dAqk += (row0 * HV + i_hv) * BT
    dAkk += (row0 * HV + i_hv) * BT
    dq += (row0 * HV + i_hv) * K
    dk += (row0 * HV + i_hv) * K
    dg += (row0 * HV + i_hv) * K
    db += row0 * HV + i_hv
    dq2 += (row0 * HV + i_hv) * K
    dk2 += (row0 * HV + i_hv) * K
    dg2 += (row0 * HV + i_hv) * K
    db2 += row0 * HV + i_hv

    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    sc = o_t // BC  # each row's sub-chunk
    st = sc * BC  # and its first row
    pos = o_t - st
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_qk = o_t[:, None] * (H * K) + o_k[None, :]
        p_tk = o_t[:, None] * (HV * K) + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_tk, other=0)  # in the input dtype: half the registers of fp32
        b_k = tl.load(k + p_qk, mask=m_tk, other=0)
        b_g = tl.load(g + p_tk, mask=m_tk, other=0).to(tl.float32)

        b_dq = tl.zeros([BT, BK], dtype=tl.float32)  # sum_s dAqk[r, s] k_s e(r, s)
        b_dkr = tl.zeros([BT, BK], dtype=tl.float32)  # sum_s dAkk[r, s] k_s e(r, s)  (k_r's row role, before beta)
        b_dkc = tl.zeros([BT, BK], dtype=tl.float32)  # sum_r (dAqk[r, s] q_r + dAkk[r, s] beta_r k_r) e(r, s)

        # By dots through the sub-chunk boundaries. Rows of sub-chunk i against earlier
        # columns through its first row a_i, columns of sub-chunk i against later rows
        # through its last row e_i: every factor <= 1. With ANCHORED (a bounded gate) the
        # same dots take the sub-chunk's own diagonal block too, whose factors through the
        # same anchors stay within 2^(+-15 * 7.3) (safe_gate's -5 nats a token, in log2).
        p_A = o_t[:, None] * (HV * BT) + o_t[None, :]
        causal = o_t[None, :] <= o_t[:, None]
        strict = o_t[None, :] < o_t[:, None]
        for i in range(0 if ANCHORED else 1, NC):
            if i * BC < n_t:
                a_i = tl.load(g + (i * BC) * (HV * K) + o_k, mask=m_k, other=0).to(tl.float32)
                rows_i = (sc == i) & m_t
                cols = o_t < (i + 1) * BC if ANCHORED else o_t < i * BC
                m_Aq = rows_i[:, None] & (causal if ANCHORED else cols[None, :])
                m_Ak = rows_i[:, None] & (strict if ANCHORED else cols[None, :])
                b_Aq = tl.load(dAqk + p_A, mask=m_Aq, other=0).to(tl.float32)
                b_Ak = tl.load(dAkk + p_A, mask=m_Ak, other=0).to(tl.float32)
                b_kx = b_k.to(tl.float32) * tl.exp2(tl.where(cols[:, None] & m_tk, a_i[None, :] - b_g, float("-inf")))
                f_i = tl.exp2(tl.where(rows_i[:, None] & m_k[None, :], b_g - a_i[None, :], float("-inf")))
                b_dq += dot(b_Aq, b_kx) * f_i
                b_dkr += dot(b_Ak, b_kx) * f_i
        for i in range(0, NC if ANCHORED else NC - 1):
            if (i * BC < n_t) if ANCHORED else ((i + 1) * BC < n_t):
                e_i = tl.load(g + (tl.minimum((i + 1) * BC, n_t) - 1) * (HV * K) + o_k, mask=m_k, other=0).to(tl.float32)
                cols_i = (sc == i) & m_t
                rows = (o_t >= i * BC if ANCHORED else o_t >= (i + 1) * BC) & m_t
                m_Aq = cols_i[None, :] & (causal & rows[:, None] if ANCHORED else rows[:, None])
                m_Ak = cols_i[None, :] & (strict & rows[:, None] if ANCHORED else rows[:, None])
                b_Aq = tl.load(dAqk + p_A, mask=m_Aq, other=0).to(tl.float32)
                b_Ak = tl.load(dAkk + p_A, mask=m_Ak, other=0).to(tl.float32)
                f_r = tl.exp2(tl.where(rows[:, None] & m_k[None, :], b_g - e_i[None, :], float("-inf")))
                f_s = tl.exp2(tl.where(cols_i[:, None] & m_k[None, :], e_i[None, :] - b_g, float("-inf")))
                b_dkc += (dot(tl.trans(b_Aq), b_q.to(tl.float32) * f_r)
                          + dot(tl.trans(b_Ak), b_k.to(tl.float32) * (b_beta[:, None] * f_r))) * f_s

        if not ANCHORED:
            # Inside each 16-row diagonal block, pairwise: step j pairs row r with column
            # st(r) + j (row role) and column s with row st(s) + j (column role); the exponent
            # is always g_later - g_earlier <= 0.
            for j in range(0, BC):
                o_j = st + j
                m_j = o_j < n_t
                m_jk = m_j[:, None] & m_k[None, :]
                b_kj = tl.load(k + o_j[:, None] * (H * K) + o_k[None, :], mask=m_jk, other=0).to(tl.float32)
                b_gj = tl.load(g + o_j[:, None] * (HV * K) + o_k[None, :], mask=m_jk, other=0).to(tl.float32)
                # row role: column o_j at or before row o_t
                row_ok = m_t & m_j & (j <= pos)
                a_q = tl.load(dAqk + o_t * (HV * BT) + o_j, mask=row_ok, other=0).to(tl.float32)
                a_k = tl.load(dAkk + o_t * (HV * BT) + o_j, mask=row_ok & (j < pos), other=0).to(tl.float32)
                e_r = tl.exp2(tl.where(row_ok[:, None] & m_k[None, :], b_g - b_gj, float("-inf")))
                b_dq += a_q[:, None] * b_kj * e_r
                b_dkr += a_k[:, None] * b_kj * e_r
                if SHARED_EXP:
                    # column role from the same factors: in step j every row of a block
                    # pairs with the block's column st + j, so that column's sum is the
                    # block's sum of these rows' terms, placed back at row st + j.
                    x = (a_q[:, None] * b_q.to(tl.float32) + (a_k * b_beta)[:, None] * b_k.to(tl.float32)) * e_r
                    blk = tl.sum(tl.reshape(x, (NC, BC, BK)), axis=1)
                    b_dkc += tl.where((pos == j)[:, None], tl.reshape(tl.broadcast_to(blk[:, None, :], (NC, BC, BK)),
                                                                      (BT, BK)), 0.0)
                else:
                    # column role: row o_j at or after column o_t, its own factors
                    b_qj = tl.load(q + o_j[:, None] * (H * K) + o_k[None, :], mask=m_jk, other=0).to(tl.float32)
                    b_bj = tl.load(beta + o_j * HV, mask=m_j, other=0).to(tl.float32)
                    col_ok = m_t & m_j & (j >= pos)
                    c_q = tl.load(dAqk + o_j * (HV * BT) + o_t, mask=col_ok, other=0).to(tl.float32)
                    c_k = tl.load(dAkk + o_j * (HV * BT) + o_t, mask=col_ok & (j > pos), other=0).to(tl.float32)
                    e_c = tl.exp2(tl.where(col_ok[:, None] & m_k[None, :], b_gj - b_g, float("-inf")))
                    b_dkc += (c_q[:, None] * b_qj + (c_k * b_bj)[:, None] * b_kj) * e_c

        b_kf = b_k.to(tl.float32)
        b_db += tl.sum(b_dkr * b_kf, axis=1)
        b_dkr *= b_beta[:, None]
        b_dgi = b_q.to(tl.float32) * b_dq + b_kf * (b_dkr - b_dkc)
        tl.store(dq2 + p_tk, tl.load(dq + p_tk, mask=m_tk, other=0) + b_dq, mask=m_tk)
        tl.store(dk2 + p_tk, tl.load(dk + p_tk, mask=m_tk, other=0) + b_dkr + b_dkc, mask=m_tk)
        tl.store(dg2 + p_tk, tl.load(dg + p_tk, mask=m_tk, other=0) + b_dgi, mask=m_tk)
    tl.store(db2 + o_t * HV, tl.load(db + o_t * HV, mask=m_t, other=0) + b_db, mask=m_t)


# Compiled for sm_90a offline (``python -m tools.compile_report --design pairwise``, K=128,
# H=HV=16): every config takes 255 registers; BK=32 at 8 warps spills 8 B (anchored 16 B;
# K=64 44 B), BK=64 at 8 warps 152 B, BK=64 at 4 warps ~1.2 KB; 16 warps cap the registers
# at 128 and spill 348-520 B. Unrolled, the 16-step diagonal loop spilled 1-10 KB at any
# width, and the sub-chunk loops ~0.2 KB more: all stay loops.
DEFAULT_CONFIG = dict(BK=32, num_warps=8, num_stages=1)
# The diagonal blocks' forms: both roles of a pair with their own exp2 (``pairwise``), one
# exp2 per pair with the column role summed per block (``pairwise-shared``), or through
# the sub-chunk anchors (``anchored``, safe_gate only).
DIAGONALS = ("pairwise", "pairwise-shared", "anchored")


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate,
              BK: int | None = None, num_warps: int = DEFAULT_CONFIG["num_warps"],
              num_stages: int = DEFAULT_CONFIG["num_stages"], diagonal: str = "pairwise"):
    """B7 with fla's contract: returns (dq, dk, db, dg), fp32, at value heads: the inputs
    plus the vector-Jacobian product of Aqk and Akk with dAqk and dAkk. ``diagonal`` is one
    of ``DIAGONALS``: the pairwise forms are exact for any gate; ``anchored`` needs
    ``safe_gate``, whose lower bound keeps a block's factors within fp32's range."""
    if diagonal not in DIAGONALS:
        raise ValueError(f"unknown diagonal form {diagonal!r}")
    if diagonal == "anchored" and not safe_gate:
        raise ValueError("the anchored diagonal needs safe_gate=True: an unbounded gate can overflow its factors")
    B, T, H, K = k.shape
    HV = gc.shape[2]
    BT = chunk_size
    for name, t in dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg).items():
        if not t.is_contiguous():
            raise ValueError(f"B7 kernels index {name} as a dense tensor; got strides {t.stride()}")
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    BK = BK or min(DEFAULT_CONFIG["BK"], triton.next_power_of_2(K))
    dq2 = torch.empty(B, T, HV, K, device=k.device, dtype=torch.float32)
    dk2, dg2 = torch.empty_like(dq2), torch.empty_like(dq2)
    db2 = torch.empty(B, T, HV, device=k.device, dtype=torch.float32)
    intra_bwd_kernel[(NT, B * HV)](
        q=q, k=k, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg,
        dq2=dq2, dk2=dk2, db2=db2, dg2=dg2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T,
        H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK, IS_VARLEN=cu_seqlens is not None, ANCHORED=diagonal == "anchored",
        SHARED_EXP=diagonal == "pairwise-shared",
        num_warps=num_warps, num_stages=num_stages,
    )
    return dq2, dk2, db2, dg2


def supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate):
    """None when ``intra_bwd`` takes the call, else why the stage stays on fla."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (B7's kernel is built for 64)"
    return None
