"""F1, F2 and F4 in one kernel: the l2norm of q and k, the gate's activation and chunk
cumsum, and the diagonal 16x16 blocks of Aqk and Akk, for one chunk of one value head per
program; fla's F5 (the off-diagonal blocks and the solve) and F6 (w, u, kg) follow on its
outputs (``prep_f1_f6``, the F1-F6 unit).

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

Numerics: the normalized rows, their rstds and the cumsum as fla's F1 and F2 form them
(fp32, rounded to the input dtype where fla's are); the blocks in fp32 from the rounded
rows, Aqk rounded to the input dtype, Akk's blocks kept in fp32 for F5's solve, as fla's.
Outputs are fresh tensors: relaunching is idempotent.

Falls back (``supports``): chunk size other than 64, K > 256.

Not measured on the H200 yet, not dispatched: ``candidate`` registers the F1-F6 unit for a
bench run (``python -m kernel_fun.bench --candidate F1-F6=diag``; the stage bench's entry
``F1-F6``). Predicted from its bytes (4.2 GB at prod8192_gate, 0.9 ms at the memory floor)
and the latency of two 4-warp programs an SM: 1.3-1.8 ms against fla's 2.86 for F1 + F2 + F4
inside the op, the F1-F6 unit 4.2-4.7 ms against fla's 5.80 (docs/log/prep.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import GUARD_SPAN, chunk_coords, dot3, to
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
        y = tl.exp(tl.minimum(x, 20.0))
        one = 1.0 + y
        log1p = tl.where(one == 1.0, y, tl.log(one) * (y / (one - 1.0)))
        return -A * tl.where(x > 20.0, x, log1p)
    else:
        return lower_bound * tl.sigmoid(A * x)


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
def prep_diag_kernel(
    q_raw, k_raw, g_raw, beta, A_log, dt_bias, lower_bound,
    q, k, q_rstd, k_rstd, gc, Aqk, Akkd, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PAIRWISE: tl.constexpr,
):
    """F1 (with L2NORM), F2 and F4 on one (chunk, value head), K in slices of BKS channels.
    PAIRWISE sends every diagonal block to the pairwise form (the tests' other path)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    row0 = bos + i_c * BT
    n_t = tl.minimum(T - i_c * BT, BT).to(tl.int32)
    tl.static_assert(BT == 4 * BC, "written for four blocks a chunk")
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
        x = tl.load(g_raw + o_g + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
        a = tl.where(m_tk, _log_decay(x, A, lower_bound, GATE), 0.0)
        g_s = tl.cumsum(a, axis=0) * RCP_LN2
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


# Compiled for sm_90a offline (``python -m tools.compile_report --design diag --BV 32 --warps 4``,
# K=128, H=HV=16, the l2norm and the softplus gate): 255 registers, no spills, 4,792
# instructions (the slice loops unrolled: 48 B of spills, 15,384); 16-channel slices 211
# registers, 2,568; at 8 warps 205 and 132 registers; two stages (the slice loop's loads
# pipelined) 4 B of spills and 45 KB of shared memory at the default. Not yet timed: the
# default is the build that holds two programs an SM (B7's lesson: two 4-warp programs beat
# one 8-warp one); the stage bench's sweep times the others.
DEFAULT_CONFIG = dict(BKS=32, num_warps=4, num_stages=1)


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
    gate = 1 if not use_gate_in_kernel else (2 if lower_bound is None else 3)
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


def prep_f1_f6(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, scale,
               safe_gate, disable_recompute, chunk_size, cu_seqlens, chunk_indices, **config):
    """The F1-F6 unit: F1, F2 and F4 here, then fla's F5 and F6 on their outputs (on the
    CPU, where fla's kernels do not run, the reference's F5 on the same diagonal blocks and
    its F6): (q, q_rstd, k, k_rstd, gc, w, u, kg, Aqk, Akk_inv, qg) as the chain's stages
    give them."""
    from kernel_fun.kda.chain import _fla_f5_f6, _ref_f5_f6

    qn, q_rstd, kn, k_rstd, gc, Aqk, Akkd = prep_diag(q, k, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel,
                                                      use_qk_l2norm_in_kernel, scale, chunk_size, cu_seqlens,
                                                      chunk_indices, **config)
    rest = _fla_f5_f6 if k.device.type == "cuda" else _ref_f5_f6
    w, u, kg, Aqk, Akk, qg = rest(qn, kn, v, gc, beta, Aqk, Akkd, scale, chunk_size, cu_seqlens, chunk_indices,
                                  safe_gate, disable_recompute)
    return qn, q_rstd, kn, k_rstd, gc, w, u, kg, Aqk, Akk, qg


def candidate(stage: str, design: str):
    """(implementation, supports) of the F1-F6 unit on this kernel, for a bench run that
    measures it in the whole op before it is registered (``python -m kernel_fun.bench
    --candidate F1-F6=diag``)."""
    if stage != "F1-F6" or design != "diag":
        raise ValueError(f"diag_fwd has the candidate F1-F6=diag, not {stage}={design}")
    return prep_f1_f6, supports


def supports(q, k, chunk_size, **_) -> str | None:
    """None when the kernel takes the F1-F6 unit's first part, else why F1-F6 stay on fla."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the F1-F4 kernel is built for 64)"
    if k.shape[-1] > 256:
        return f"K={k.shape[-1]} > 256"
    return None
