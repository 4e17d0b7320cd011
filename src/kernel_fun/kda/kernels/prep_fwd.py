"""F3-F6 in one kernel: the intra-chunk scores Aqk and Akk, the solve (I + Akk)^-1, and the
WY vectors w, u and kg (qg too with ``disable_recompute``), for one chunk of one value head
per program.

Replaces fla's ``chunk_kda_fwd_intra`` (F3-F6, 4.57 ms at prod8192_gate on the H200, the
forward's largest unit), which builds Aqk and Akk per 16-row sub-chunk, solves them in a
second pass and reads them back for w and u. Here the chunk's q, k, g and beta are loaded
once and every intermediate stays on chip; only the outputs fla's chain saves are written.

The scores, Aqk[r, s] = scale sum_c q_rc k_sc exp2(g_rc - g_sc) (s <= r) and
Akk[r, s] = beta_r sum_c k_rc k_sc exp2(g_rc - g_sc) (s < r), are taken per 16-column
block j through the block's last row e_j: k_s exp2(e_j - g_s) <= 1 on the block's columns
and q_r exp2(g_r - e_j) <= 1 on every later row, one [16, K] x [K, 64] dot per block and
score (tf32x3, the transposed block: see _block_scores). A block's own diagonal rides in the same dot where its gate span over the
K channels is within 2^64 (GUARD_SPAN, as B7's kernel), else it is summed pairwise on CUDA
cores (16 steps, one exp2(g_r - g_s) <= 1 per pair): exact for any gate, so ``safe_gate``
changes nothing here. The solve is blocked: each 16x16 diagonal block D (nilpotent) is
inverted as (I - D)(I + D^2)(I + D^4)(I + D^8), then the off-diagonal part through
M = (I + D)^-1 N, nilpotent of order 4: (I + Akk)^-1 = (I - M + M^2 - M^3)(I + D)^-1, ten
[64, 64] dots in tf32x3. Akk_inv is rounded to the input dtype before w and u, as fla does,
and every rounding of w, u, kg and qg is the reference's.

``prep_fwd_fused`` runs F1 (the l2norm of q and k) and F2 (the gate's activation, softplus
or lower-bounded, and its chunk cumsum) in the same program first: it writes the normalized
rows, their rstds and the gate's cumsum (what the scan and the backward read) and reads them
back after a barrier, so the rest is the same code; with GVA every program of a q/k head
writes the same normalized rows.

``wy_recompute`` is the backward's B2 (w, u, qg, kg from the saved Akk_inv) from the same
kernel with the scores and the solve compiled out.

Numerics: the scores and the solve in fp32 (tf32x3 dots), the outputs in the input dtype:
within the rounding of fla's outputs (the solve's sums run in another order than fla's
substitution, so a bf16 value can move by one unit in the last place).

Falls back (``supports``): chunk size other than 64, K > 256. Not dispatched: it loses to
fla's stage. Measured on the H200 (bench/results/stages.jsonl at 7a87298, docs/log/prep.md):
parity within every bar (against the float64 stage at or below fla's error for every
output), but 19.2 ms at prod8192_gate against fla's 4.83 (predicted 2.5-3.5). What the time
is (Nsight Compute, grid1024, before the hand-split dots): one 8-warp program an SM at 255
registers, ~16,800 instructions a warp issued every 8.3 cycles; the sm_90a listing puts
the solve's ten [64, 64] dots with their operand splits and layout changes at ~45% of the
code and the score dots at ~30%. B2 from it (``wy_recompute``) is bit for bit fla's
``recompute_w_u_fwd`` but 2.61 ms against 1.90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import GUARD_SPAN, chunk_coords, dot3, to
from kernel_fun.kda.kernels.wy_fwd import wy_k, wy_v
from kernel_fun.kda.reference import RCP_LN2 as _RCP_LN2

BC = 16  # the anchor block
RCP_LN2 = tl.constexpr(_RCP_LN2)  # the chunk cumsum in log2 units, as the chain's gc


@triton.jit
def _side_by_side(x0, x1, x2, x3, BT: tl.constexpr, BC: tl.constexpr):
    """Four [BT, BC] tiles as one [BT, 4 BC] tile, in order."""
    a = tl.reshape(tl.permute(tl.join(x0, x1), (0, 2, 1)), (BT, 2 * BC))
    b = tl.reshape(tl.permute(tl.join(x2, x3), (0, 2, 1)), (BT, 2 * BC))
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (BT, 4 * BC))


@triton.jit
def _block_scores(q, k, g, st, n_t, t, K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, SK: tl.constexpr,
                  SG: tl.constexpr, BC: tl.constexpr):
    """Column block j (columns st .. st + BC - 1) of both scores, unscaled, through the
    block's last row e_j, for rows from the block's own first row (its span over the K
    channels within the guard) or the next block's: ([BT, BC] q.k, [BT, BC] k.k, whether
    the diagonal was in). The K sum runs in slices of BKS channels (fewer live registers)."""
    cols = st + tl.arange(0, BC)
    m_c = cols < n_t
    last = tl.minimum(st + BC, n_t) - 1
    live = st < n_t
    o_all = tl.arange(0, BK)
    m_all = (o_all < K) & live
    span = tl.load(g + st * SG + o_all, mask=m_all, other=0) - tl.load(g + last * SG + o_all, mask=m_all, other=0)
    diag = tl.max(span, axis=0) <= GUARD_SPAN
    lo = tl.where(diag, st, st + BC)
    m_r = (t < n_t) & (t >= lo)  # rows before lo are not read: their factor would pass 1
    s_q = tl.zeros([BC, t.shape[0]], dtype=tl.float32)
    s_k = tl.zeros([BC, t.shape[0]], dtype=tl.float32)
    for i_k in tl.static_range(BK // BKS):
        o_k = i_k * BKS + tl.arange(0, BKS)
        m_k = o_k < K
        e = tl.load(g + last * SG + o_k, mask=m_k & live, other=0)
        m_ck = m_c[:, None] & m_k[None, :]
        k_j = tl.load(k + cols[:, None] * SK + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
        g_j = tl.load(g + cols[:, None] * SG + o_k[None, :], mask=m_ck, other=0)
        kx = k_j * tl.exp2(tl.where(m_ck, e[None, :] - g_j, float("-inf")))  # <= 1
        m_rk = m_r[:, None] & m_k[None, :]
        g_r = tl.load(g + t[:, None] * SG + o_k[None, :], mask=m_rk, other=0)
        f = tl.exp2(tl.where(m_rk, g_r - e[None, :], float("-inf")))  # <= 1 past the block, <= 2^span in it
        q_r = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
        # transposed ([BC, BT]: M=16, the mma.sync path): as [BT, BC] at 8 warps Triton 3.6
        # builds N=8 tf32 wgmmas, whose unpadded shared operand it reads out of bounds on the
        # H200 (an illegal address, triton-lang/triton#10629)
        s_q = dot3(kx, tl.trans(q_r * f), s_q)  # accumulated in the dot
        k_r = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
        s_k = dot3(kx, tl.trans(k_r * f), s_k)
    return tl.trans(s_q), tl.trans(s_k), diag


@triton.jit
def _l2norm_rows(x_raw, x_out, rstd_out, t, m_t, o_k, m_k, H: tl.constexpr, SK: tl.constexpr):
    """F1 on the chunk's rows of one q/k head: x / sqrt(sum x^2 + 1e-6) in x's dtype, and
    the rstd (fp32)."""
    m_tk = m_t[:, None] & m_k[None, :]
    x = tl.load(x_raw + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
    tl.store(x_out + t[:, None] * SK + o_k[None, :], to(x * rstd[:, None], x_out.dtype.element_ty), mask=m_tk)
    tl.store(rstd_out + t * H, rstd, mask=m_t)


@triton.jit
def prep_fwd_kernel(
    q, k, v, g, beta, Aqk, Akk, w, u, kg, qg, cu_seqlens, chunk_indices, scale, T,
    q_raw, k_raw, q_rstd, k_rstd, g_raw, A_log, dt_bias, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_QG: tl.constexpr,
    L2NORM: tl.constexpr = False, GATE: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False,
    RECOMPUTE: tl.constexpr = False,
):
    """F3-F6 on one (chunk, value head); with L2NORM also F1 (q_raw, k_raw normalized into q,
    k, their rstds), with GATE also F2 into g (1: the chunk cumsum of a given log-decay; 2
    the softplus gate, 3 the lower-bounded one, from g_raw, A_log and dt_bias). The fused
    parts write their outputs first and the rest reads them back (L1/L2) after a barrier,
    as in the unfused kernel: every program of a q/k head writes the same normalized rows.
    With RECOMPUTE (the backward's B2) Akk holds the saved Akk_inv: no scores, no solve,
    only w, u, kg and qg from it."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    row0 = bos + i_c * BT
    n_t = tl.minimum(T - i_c * BT, BT).to(tl.int32)
    tl.static_assert(BT == 4 * BC, "written for four blocks a chunk")
    SK: tl.constexpr = H * K
    SG: tl.constexpr = HV * K

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_t = t < n_t
    m_tk = m_t[:, None] & m_k[None, :]
    if L2NORM:
        _l2norm_rows(q_raw + (row0 * H + i_h) * K, q, q_rstd + row0 * H + i_h, t, m_t, o_k, m_k, H, SK)
        _l2norm_rows(k_raw + (row0 * H + i_h) * K, k, k_rstd + row0 * H + i_h, t, m_t, o_k, m_k, H, SK)
    if GATE > 0:
        x = tl.load(g_raw + (row0 * HV + i_hv) * K + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
        if GATE == 1:
            a = x
        else:
            if HAS_BIAS:
                x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
            A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
            if GATE == 2:  # -exp(A_log) softplus(x), softplus as torch's (x past 20 passes through)
                y = tl.exp(tl.minimum(x, 20.0))
                one = 1.0 + y
                log1p = tl.where(one == 1.0, y, tl.log(one) * (y / (one - 1.0)))
                a = -A * tl.where(x > 20.0, x, log1p)
            else:  # lower_bound * sigmoid(exp(A_log) x)
                a = lower_bound * tl.sigmoid(A * x)
        tl.store(g + t[:, None] * SG + o_k[None, :], tl.cumsum(tl.where(m_tk, a, 0.0), axis=0) * RCP_LN2, mask=m_tk)
    if L2NORM or GATE > 0:
        tl.debug_barrier()  # the rows just written, read back below by other threads of the program
    b_c = tl.load(beta + t * HV, mask=m_t, other=0).to(tl.float32)

    if RECOMPUTE:  # B2: w, u, qg, kg from the saved Akk_inv
        x_b = tl.load(Akk + (row0 + t)[:, None] * (HV * BT) + i_hv * BT + t[None, :], mask=m_t[:, None], other=0)
    else:
        # F3: the scores, column block by column block
        sq0, sk0, d0 = _block_scores(q, k, g, 0, n_t, t, K, BK, BKS, SK, SG, BC)
        sq1, sk1, d1 = _block_scores(q, k, g, BC, n_t, t, K, BK, BKS, SK, SG, BC)
        sq2, sk2, d2 = _block_scores(q, k, g, 2 * BC, n_t, t, K, BK, BKS, SK, SG, BC)
        sq3, sk3, d3 = _block_scores(q, k, g, 3 * BC, n_t, t, K, BK, BKS, SK, SG, BC)
        s_q = _side_by_side(sq0, sq1, sq2, sq3, BT, BC)
        s_k = _side_by_side(sk0, sk1, sk2, sk3, BT, BC)
        blk = t // BC
        if d0.to(tl.int32) + d1.to(tl.int32) + d2.to(tl.int32) + d3.to(tl.int32) < 4:
            # the diagonals whose span passed the guard, pairwise: row r against s = r's block
            # start + jj, exp2(g_r - g_s) <= 1
            pair = tl.where(blk == 0, d0, tl.where(blk == 1, d1, tl.where(blk == 2, d2, d3))).to(tl.int32) == 0
            q_c = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
            k_c = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
            g_c = tl.load(g + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0)
            for jj in range(0, BC):
                o = blk * BC + jj
                on = pair & m_t & (o <= t)
                m_ok = on[:, None] & m_k[None, :]
                k_o = tl.load(k + o[:, None] * SK + o_k[None, :], mask=m_ok, other=0).to(tl.float32)
                g_o = tl.load(g + o[:, None] * SG + o_k[None, :], mask=m_ok, other=0)
                kx = k_o * tl.exp2(tl.where(m_ok, g_c - g_o, float("-inf")))
                at = t[None, :] == o[:, None]
                s_q += tl.where(at, tl.sum(q_c * kx, axis=1)[:, None], 0.0)
                s_k += tl.where(at, tl.sum(k_c * kx, axis=1)[:, None], 0.0)
        valid = m_t[:, None] & m_t[None, :]
        lower = valid & (t[:, None] >= t[None, :])
        strict = valid & (t[:, None] > t[None, :])
        p_a = (row0 + t)[:, None] * (HV * BT) + i_hv * BT + t[None, :]
        m_a = m_t[:, None] & (t[None, :] < BT)
        tl.store(Aqk + p_a, to(tl.where(lower, s_q * scale, 0.0), Aqk.dtype.element_ty), mask=m_a)
        L = tl.where(strict, s_k * b_c[:, None], 0.0)

        # F4-F5: (I + L)^-1 through the diagonal blocks' inverses
        eye = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
        same = blk[:, None] == blk[None, :]
        D = tl.where(same, L, 0.0)
        N = tl.where(same, 0.0, L)
        D2 = dot3(D, D)
        P = dot3(eye - D, eye + D2)
        D4 = dot3(D2, D2)
        P = dot3(P, eye + D4)
        Dinv = dot3(P, eye + dot3(D4, D4))
        M = dot3(Dinv, N)
        X = dot3(eye - dot3(M, eye - dot3(M, eye - M)), Dinv)
        X = tl.where(lower, X, 0.0)

        x_b = to(X, Akk.dtype.element_ty)
        tl.store(Akk + p_a, x_b, mask=m_a)

    # F6: w = Akk_inv (beta k exp2 g), u = Akk_inv (beta v), kg = k exp2(g_last - g)
    wy_k(x_b, q, k, g, beta, b_c, w, kg, qg, row0, t, m_t, n_t, o_k, m_k, i_hv, K, SK, SG, STORE_QG)
    wy_v(x_b, v, b_c, u, row0, t, m_t, i_hv, HV, V, BV)


# Compiled for sm_90a offline (K=128, V=256, H=HV=16): 255 registers at every config; the
# pin (BKS=64, 8 warps) 232 B of spills (300 loaded; fused 264 and 308), 13,104 SASS
# instructions, no N=8 tf32 wgmma (tests/test_prep_fwd.py holds both). Measured at
# prod8192_gate before the hand-split dots: 23.1 ms at the pin, 25.5 at BKS=32, 25.0 at
# BV=32, 23.0 at 4 warps; 19.2 at the pin after.
DEFAULT_CONFIG = dict(BKS=64, BV=64, num_warps=8, num_stages=1)


def prep_fwd(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate, disable_recompute,
             BKS: int = DEFAULT_CONFIG["BKS"], BV: int = DEFAULT_CONFIG["BV"], num_warps: int = DEFAULT_CONFIG["num_warps"],
             num_stages: int = DEFAULT_CONFIG["num_stages"]):
    """F3-F6 with fla's contract: (w, u, kg, Aqk, Akk_inv, qg), at value heads in the input
    dtypes; qg is None unless ``disable_recompute``. Exact for any gate (``safe_gate``
    changes nothing here)."""
    out = _launch(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, disable_recompute,
                  dict(BKS=BKS, BV=BV, num_warps=num_warps, num_stages=num_stages))
    return out["w"], out["u"], out["kg"], out["Aqk"], out["Akk"], out["qg"]


def prep_fwd_fused(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel,
                   scale, chunk_size, cu_seqlens, chunk_indices, safe_gate, disable_recompute, **config):
    """F1, F2 and F3-F6 in one pass, from the raw q, k and gate: (q, q_rstd, k, k_rstd, gc,
    w, u, kg, Aqk, Akk_inv, qg) as the three stages give them (q_rstd and k_rstd None
    without the l2norm, in which case q and k are the inputs)."""
    B, T, H, K = k.shape
    HV = v.shape[2]
    norm = use_qk_l2norm_in_kernel
    qn = torch.empty_like(q) if norm else q
    kn = torch.empty_like(k) if norm else k
    q_rstd = torch.empty(B, T, H, device=k.device, dtype=torch.float32) if norm else None
    k_rstd = torch.empty_like(q_rstd) if norm else None
    gc = torch.empty(B, T, HV, K, device=k.device, dtype=torch.float32)
    gate = 1 if not use_gate_in_kernel else (2 if lower_bound is None else 3)
    fused = dict(q_raw=q if norm else None, k_raw=k if norm else None, q_rstd=q_rstd, k_rstd=k_rstd,
                 g_raw=g, A_log=A_log, dt_bias=dt_bias,
                 lower_bound=0.0 if lower_bound is None else float(lower_bound), L2NORM=norm, GATE=gate,
                 HAS_BIAS=dt_bias is not None)
    out = _launch(qn, kn, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, disable_recompute,
                  {**DEFAULT_CONFIG, **config}, fused)
    return (qn, q_rstd, kn, k_rstd, gc, out["w"], out["u"], out["kg"], out["Aqk"], out["Akk"], out["qg"])


def wy_recompute(q, k, v, beta, A, gc, chunk_size, cu_seqlens, chunk_indices, **config):
    """B2 with fla's contract (``recompute_w_u_fwd``): (w, u, qg, kg) from the saved Akk_inv
    ``A``, by the same kernel's F6 code."""
    out = _launch(q, k, v, gc, beta, 1.0, chunk_size, cu_seqlens, chunk_indices, True, {**DEFAULT_CONFIG, **config},
                  recompute=A)
    return out["w"], out["u"], out["qg"], out["kg"]


def _launch(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, disable_recompute, config,
            fused: dict | None = None, recompute: torch.Tensor | None = None) -> dict:
    raw = {n: fused[n] for n in ("q_raw", "k_raw", "g_raw")} if fused else {}
    for name, t in dict(q=q, k=k, v=v, gc=gc, beta=beta, **raw).items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"the prep kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    out = dict(w=torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype))
    out["kg"] = torch.empty_like(out["w"])
    out["qg"] = torch.empty_like(out["w"]) if disable_recompute else None
    out["u"] = torch.empty_like(v)
    if recompute is None:
        out["Aqk"] = torch.empty(B, T, HV, BT, device=k.device, dtype=k.dtype)
        out["Akk"] = torch.empty_like(out["Aqk"])
    else:  # read, not written
        out["Aqk"], out["Akk"] = None, recompute
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    BK = max(16, triton.next_power_of_2(K))
    fused = fused or dict(q_raw=None, k_raw=None, q_rstd=None, k_rstd=None, g_raw=None, A_log=None, dt_bias=None,
                          lower_bound=0.0)
    prep_fwd_kernel[(NT, B * HV)](
        q=q, k=k, v=v, g=gc, beta=beta, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T,
        H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=BK, BKS=min(BK, config["BKS"]),
        BV=min(config["BV"], max(16, triton.next_power_of_2(V))), IS_VARLEN=cu_seqlens is not None,
        STORE_QG=disable_recompute, RECOMPUTE=recompute is not None, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **out, **fused,
    )
    return out


def supports(q, k, v, chunk_size, **_) -> str | None:
    """None when ``prep_fwd`` takes the call, else why F3-F6 stay on fla."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the prep kernel is built for 64)"
    if k.shape[-1] > 256:
        return f"K={k.shape[-1]} > 256"
    return None
