"""B7-B9, the intra-chunk backward with dg's chunk cumsum and the gate's backward in the same
pass: the gradients through Aqk and Akk into dq, dk, db and dg (fla's
``chunk_kda_bwd_intra``), then dg's reverse cumsum within each chunk (B8) and, with the gate
in the op, the raw gate's gradient with dA_log's and dt_bias's (B9, ``kda_gate_bwd``).

Where fla loses time: one program per (16-row sub-chunk, 32-channel K slice, chunk, head),
524,288 at prod8192_gate, each reloading its neighbours' q, k, g and dA tiles; the diagonal
16x16 blocks run two 16-step loops on CUDA cores; B8 and B9 then read dg back twice.

For a row r and an earlier column s the factor is exp2(g_r - g_s), g the chunk cumsum (log2
units, non-increasing along the chunk). This kernel: one program per (32-channel K slice,
chunk, head), 4 warps, the chunk as one [64, 32] tile per output, dA read along its rows
only (the column role's tiles are the row role's transposed on chip). The factor goes
through an anchor as two one-sided halves, in levels, per channel: the first level takes
rows from 0 while the factor through row 0's gate less GUARD_SPAN stays within 2^+-64 (a
chunk span of 128), each later level from its first row u while the factor through g_u
does; a level sums every pair whose later row is in it (pairs with an earlier level's row
have factors <= 1 through g_u), each role one [64, 64] x [64, 32] dot per dA. So any gate
is exact (``safe_gate`` changes nothing), and causal to the bit: which level a row is in,
and its anchor, follow from that row and the rows before it, so dq, dk, dg and db before
token t are the call cut at t's whatever the gates after t (the middle-row and per-block
anchors this replaced picked the tier from the whole chunk). The program loops until every
channel of its slice is done: on the stage bench's Kimi-style gate at prod8192_gate 52-79%
of the programs take one level (by the draw) and most of the rest two
(``benchmarks.stages.b7_b9.levels`` counts them; ``research.b7_tiers`` on the chain's).
Every dot is three tf32 products (``dot3``). db sums the K slices' partials in slice order;
dg's reverse cumsum runs over the chunk tile in registers; dA_log's and dt_bias's partials
are per chunk, summed in order (no atomics). The incoming dq, dk and dg are asked of L2 at
the program's start.

Numerics: fp32 throughout, the dots at fp32 level: ~3e-8 relative RMS of the float64 stage at
prod8192_gate, where fla's (tf32 off the diagonal) is ~2e-5. Outputs are fresh tensors
(input + intra part), so a relaunch is idempotent.

Falls back (``supports``): chunk size other than 64.

Measured: the README's stage table (B7-B9 rows); the levels against the non-causal tiers
they replaced, same run, stage inputs: 10.38 ms against 8.65 at prod8192_gate (+20%; kimi
+19%, grid1024 +14%): 556 B of spills (from 144) with the loop's accumulators live; fla's
three stages ~15. The rounds and the designs measured slower are in docs/log/b7.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import GUARD_SPAN, chunk_coords, config_over, dot3, prefetch_rows, to

@triton.jit
def _gate_bwd(st, n_t, dy, g_raw, dt_bias, dg_out, A, lower_bound, o_k, m_k,
              HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
              USE_LOWER_BOUND: tl.constexpr):
    """B9 on rows st .. st + BC - 1 (the kernel passes the whole chunk): dy (d loss / d
    log-decay, fp32) to the raw gate's gradient, written in the raw gate's dtype; returns
    these rows' dA_log sum and their [BK] sum of the written (rounded) gradient, dt_bias's."""
    rows = st + tl.arange(0, BC)
    m_rk = (rows < n_t)[:, None] & m_k[None, :]
    p = rows[:, None] * (HV * K) + o_k[None, :]
    x = tl.load(g_raw + p, mask=m_rk, other=0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dt_bias + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
    if USE_LOWER_BOUND:
        sg = tl.sigmoid(A * x)
        dx = dy * (lower_bound * sg * (1.0 - sg)) * A
        da = tl.sum(tl.sum(tl.where(m_rk, dx * x, 0.0), axis=1), axis=0)
    else:
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        dx = -A * (dy * tl.sigmoid(x))
        da = tl.sum(tl.sum(tl.where(m_rk, dy * (-A * softplus), 0.0), axis=1), axis=0)
    dx_out = to(dx, dg_out.dtype.element_ty)
    tl.store(dg_out + p, dx_out, mask=m_rk)
    return da, tl.sum(tl.where(m_rk, dx_out.to(tl.float32), 0.0), axis=0)


@triton.jit
def _level_sums(q, k, beta, dAqk, dAkk, t, n_t, g_c, g_u, shift, R, S, o_k, m_k, acc_q, acc_kr, acc_c,
                HV: tl.constexpr, BT: tl.constexpr, SK: tl.constexpr, SCALE: tl.constexpr):
    """B7's three sums over the pairs (r, s), s <= r, with r in R and s in S (per element
    [BT, BK] masks), each pair's factor exp2(g_r - g_s) through the per-channel anchor a [BK]
    as exp2(g_r - a) exp2(a - g_s): each role one [BT, BT] x [BT, BK] dot per dA, the factor's
    other half applied once after. The caller picks a and the masks so that every factor of a
    masked-in element is within 2^GUARD_SPAN; a masked-out element's factor is an exact 0."""
    m_t = t < n_t
    m_tk = m_t[:, None] & m_k[None, :]
    # exp2(a - g) with a = g_u - shift, the exponent kept exact: d = g_u - g as the gate's own
    # difference, less the shift only where that subtraction is exact (d >= shift / 2,
    # Sterbenz), else the shift applied as the exact power of two SCALE = 2^-shift after
    # (with g_u - shift - g rounded instead, dq's error of the float64 stage was 4-5x larger
    # at the interpreter's test shapes: 8.8e-7 against 1.7e-7)
    d = g_u[None, :] - g_c
    near = d >= 0.5 * shift[None, :]
    e = tl.where(near, d - shift[None, :], d)
    lo = near | (shift[None, :] == 0)
    up = tl.exp2(tl.where(S, e, float("-inf"))) * tl.where(lo, 1.0, SCALE)  # the column factor, 0 off S
    down = tl.exp2(tl.where(R, -e, float("-inf"))) * tl.where(lo, 1.0, 1.0 / SCALE)  # the row factor, 0 off R
    k_c = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    q_c = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_c = tl.load(beta + t * HV, mask=m_t, other=0).to(tl.float32)
    m_2 = m_t[:, None] & m_t[None, :]
    p_A = t[:, None] * (HV * BT) + t[None, :]
    kx = k_c * up
    # each dA tile read along its rows for the row role; the column role's tiles ([s, r]) are
    # those transposed on chip, one tile live at a time
    dA = tl.load(dAqk + p_A, mask=m_2 & (t[:, None] >= t[None, :]), other=0)
    acc_q += down * dot3(dA, kx)
    part = dot3(tl.trans(dA), q_c * down)
    dA = tl.load(dAkk + p_A, mask=m_2 & (t[:, None] > t[None, :]), other=0)
    acc_kr += down * dot3(dA, kx)
    acc_c += up * dot3(tl.trans(dA), (b_c[:, None] * k_c) * down, part)
    return acc_q, acc_kr, acc_c


@triton.jit
def intra_bwd_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg,
    dq2, dk2, dg2, db_part,
    g_raw, A_log, dt_bias, dA_part, dbias_part, lower_bound,
    cu_seqlens, chunk_indices, T, NT_ROWS, NT_ALL,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, GUARD: tl.constexpr, SCALE: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, SUMS: tl.constexpr = None,
):
    """B7 and B8 on one (K slice, chunk, head), the chunk as one [BT, BK] tile per output, dg
    reverse-cumsummed within the chunk (fp32) into dg2; with GATE also B9: the raw gate's
    gradient into dg2 in its dtype, dA_log's and dt_bias's per-chunk partials into dA_part
    [NK, NT_ALL, HV] and dbias_part [NT_ALL, HV, K]. GUARD is GUARD_SPAN on every call;
    tests pass smaller ones to send chunks through many levels. SUMS: a candidate (research)
    for the three sums in the levels' place, a jit function of (q, k, beta, dAqk, dAkk, g,
    n_t, o_k, m_k, HV, BT, BK, SK, SG, GUARD, SCALE) returning acc_q, acc_kr, acc_c as the
    levels leave them."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        # a capacity-shaped index's spare row (sequence -1): no tokens; its parameter
        # partials are zeros (they are summed over every row)
        if tl.load(chunk_indices + i_t * 2) < 0:
            if GATE:
                tl.store(dA_part + (i_k * NT_ALL + i_t) * HV + i_hv, 0.0)
                if HAS_BIAS:
                    o_z = i_k * BK + tl.arange(0, BK)
                    tl.store(dbias_part + (i_t * HV + i_hv) * K + o_z, tl.zeros([BK], tl.float32), mask=o_z < K)
            return
    i_c, i_tg, bos, T = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    row0 = bos + i_c * BT
    n_t = tl.minimum(T - i_c * BT, BT).to(tl.int32)
    SK: tl.constexpr = H * K
    SG: tl.constexpr = HV * K

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    dAqk += (row0 * HV + i_hv) * BT
    dAkk += (row0 * HV + i_hv) * BT
    off = (row0 * HV + i_hv) * K
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    t = tl.arange(0, BT)
    m_t = t < n_t
    m_tk = m_t[:, None] & m_k[None, :]
    # the epilogue's incoming dq, dk, dg asked of L2 while the dots run (7.15 ms against 7.36
    # without at prod8192_gate; the same bits)
    prefetch_rows(dq + off + i_k * BK, t, SG, m_t, BK)
    prefetch_rows(dk + off + i_k * BK, t, SG, m_t, BK)
    prefetch_rows(dg + off + i_k * BK, t, SG, m_t, BK)

    # Levels, per channel: a level is the rows from its first row u up to (not including) the
    # first row whose factor through the level's anchor leaves [2^-GUARD, 2^GUARD]; it sums
    # every pair whose later row is in it. The first level's anchor is row 0's gate shifted by
    # GUARD (a chunk span of 2 GUARD), each later one's its own first row's (every factor of
    # an earlier row then <= 1). Which level a row is in follows from it and the rows before
    # it, so the sums for tokens before t never see a gate after t.
    if SUMS is not None:
        acc_q, acc_kr, acc_c = SUMS(q, k, beta, dAqk, dAkk, g, n_t, o_k, m_k, HV, BT, BK, SK, SG, GUARD, SCALE)
    else:
        acc_q = tl.zeros([BT, BK], dtype=tl.float32)
        acc_kr = tl.zeros([BT, BK], dtype=tl.float32)
        acc_c = tl.zeros([BT, BK], dtype=tl.float32)
        u = tl.where(m_k, 0, n_t)  # [BK] each channel's first row of the level
        shift = tl.full([BK], GUARD, tl.float32)
        while tl.min(u, axis=0) < n_t:
            g_c = tl.load(g + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0)  # (L1: held, it spills)
            g_u = tl.load(g + u * SG + o_k, mask=u < n_t, other=0)
            past = (t[:, None] > u[None, :]) & m_tk & (tl.abs(g_u[None, :] - shift[None, :] - g_c) > GUARD)
            nxt = tl.min(tl.where(past, t[:, None], n_t), axis=0)
            S = (t[:, None] < nxt[None, :]) & (u < n_t)[None, :] & m_tk  # none for a channel already done
            R = S & (t[:, None] >= u[None, :])
            acc_q, acc_kr, acc_c = _level_sums(q, k, beta, dAqk, dAkk, t, n_t, g_c, g_u, shift, R, S, o_k, m_k,
                                               acc_q, acc_kr, acc_c, HV, BT, SK, SCALE)
            u = nxt
            shift = tl.zeros([BK], tl.float32)

    # outputs: db's partial for this K slice; dq, dk, dg (input + intra part)
    p = off + t[:, None] * SG + o_k[None, :]
    q_c = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    k_c = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_c = tl.load(beta + t * HV, mask=m_t, other=0).to(tl.float32)
    tl.store(db_part + i_k * NT_ROWS + (row0 + t) * HV + i_hv, tl.sum(acc_kr * k_c, axis=1), mask=m_t)
    acc_kr *= b_c[:, None]
    tl.store(dq2 + p, tl.load(dq + p, mask=m_tk, other=0) + acc_q, mask=m_tk)
    tl.store(dk2 + p, tl.load(dk + p, mask=m_tk, other=0) + acc_kr + acc_c, mask=m_tk)
    b_dg = tl.load(dg + p, mask=m_tk, other=0) + q_c * acc_q + k_c * (acc_kr - acc_c)
    # B8: each row's dg summed with every later row's of the chunk (rows past the end are 0)
    b_dg = tl.cumsum(tl.where(m_tk, b_dg, 0.0), axis=0, reverse=True)
    if GATE:
        # B9 (dg2 has the raw gate's dtype here), its parameter sums per chunk
        A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_BIAS:
            dt_bias += i_hv * K
        da, dbias = _gate_bwd(0, n_t, b_dg, g_raw + off, dt_bias, dg2 + off, A, lower_bound, o_k, m_k, HV, K, BT,
                              HAS_BIAS, USE_LOWER_BOUND)
        tl.store(dA_part + (i_k * NT_ALL + i_tg) * HV + i_hv, da)
        if HAS_BIAS:
            tl.store(dbias_part + (i_tg * HV + i_hv) * K + o_k, dbias, mask=m_k)
    else:
        tl.store(dg2 + p, b_dg, mask=m_tk)


# The pinned config. sm_90a (K=128, H=HV=16): 255 registers, 556 B of spills (K=64: ~560), 40 KB
# of shared memory: two programs an SM. Measured at prod8192_gate:
# 16-channel slices 10.53 ms and 8 warps 13.41 against 7.49 at this config (docs/log/b7.md).
CONFIG = dict(BK=32, num_warps=4, num_stages=1)
# What ``config`` may set (the benchmarks' sweeps; a call runs the pinned config).
CONFIG_KEYS = frozenset({"BK", "num_warps", "num_stages", "maxnreg"})


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
              cu_seqlens, chunk_indices, config: dict | None = None, _guard: float | None = None, sums=None):
    """B7, B8 and (with ``A_log``) B9 with fla's contracts: (dq, dk, db, dg, dA_log, ddt_bias).
    dq, dk and db (fp32, at value heads) are the inputs plus the vector-Jacobian product of
    Aqk and Akk with dAqk and dAkk. Without ``A_log`` (a pre-computed gate) dg is B8's, the
    within-chunk reverse cumsum of B7's dg (fp32), and the last two are None; with it (the
    gate in the op: ``g`` the raw gate, ``dt_bias`` or None, ``lower_bound`` or None) dg is
    B9's in g's dtype, with dA_log's and dt_bias's gradients. Exact for any gate
    (``safe_gate`` changes nothing). ``config`` overrides the pinned launch config
    (``CONFIG_KEYS``); ``_guard`` (tests) a smaller level span than ``GUARD_SPAN``; ``sums`` a
    candidate jit function for the kernel's three sums (``SUMS``, research)."""
    for name, t in dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, g=g,
                        A_log=A_log, dt_bias=dt_bias).items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"B7-B9's kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    cfg = config_over(CONFIG, config, CONFIG_KEYS, "B7-B9")
    guard = float(GUARD_SPAN.value if _guard is None else _guard)
    B, T, H, K = k.shape
    HV = gc.shape[2]
    BK = min(cfg["BK"], triton.next_power_of_2(K))
    NK = triton.cdiv(K, BK)
    NT = triton.cdiv(T, chunk_size) if cu_seqlens is None else len(chunk_indices)
    NT_ALL = NT * (B if cu_seqlens is None else 1)
    dev = k.device
    gate = A_log is not None
    dq2 = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
    dk2 = torch.empty_like(dq2)
    dg2 = torch.empty(B, T, HV, K, device=dev, dtype=g.dtype if gate else torch.float32)
    # db's per-slice partials and the gate parameters' per-chunk partials, summed in a fixed
    # order below: deterministic, no atomics
    db_part = torch.empty(NK, B, T, HV, device=dev, dtype=torch.float32)
    dA_part = torch.empty(NK, NT_ALL, HV, device=dev, dtype=torch.float32) if gate else None
    dbias_part = torch.empty(NT_ALL, HV, K, device=dev, dtype=torch.float32) if gate and dt_bias is not None else None
    intra_bwd_kernel[(NK, NT, B * HV)](
        q=q, k=k, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, dg=dg, dq2=dq2, dk2=dk2, dg2=dg2,
        db_part=db_part, g_raw=g if gate else None, A_log=A_log, dt_bias=dt_bias if gate else None,
        dA_part=dA_part, dbias_part=dbias_part, lower_bound=0.0 if lower_bound is None or not gate else float(lower_bound),
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, NT_ROWS=B * T * HV, NT_ALL=NT_ALL,
        H=H, HV=HV, K=K, BT=chunk_size, BK=BK, IS_VARLEN=cu_seqlens is not None,
        GUARD=guard, SCALE=2.0 ** -guard,
        GATE=gate, HAS_BIAS=gate and dt_bias is not None, USE_LOWER_BOUND=gate and lower_bound is not None,
        **({} if sums is None else {"SUMS": sums}), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    db2 = db.float() + (db_part[0] if NK == 1 else db_part.sum(0))
    dA_log = ddt_bias = None
    if gate:
        dA_log = dA_part.sum((0, 1)).view_as(A_log).to(A_log.dtype)
        if dt_bias is not None:
            ddt_bias = dbias_part.sum(0).view_as(dt_bias).to(dt_bias.dtype)
    return dq2, dk2, db2, dg2, dA_log, ddt_bias


def supports(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
             cu_seqlens, chunk_indices):
    """None when ``intra_bwd`` takes the B7-B9 unit, else why B7, B8 and B9 run as fla's."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (B7's kernel is built for 64)"
    return None
