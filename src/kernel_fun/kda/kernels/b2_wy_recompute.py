"""B2, the backward's WY recompute (fla's ``recompute_w_u_fwd``) without u: w = Akk_inv
(beta k exp2 g), kg = k exp2(g_last - g) and qg = q exp2 g for one chunk of one value head per
program.

Where fla's kernel loses time: it always writes u = Akk_inv (beta v) [B, T, HV, V] (1.07 GB
at prod8192_gate) for B3 to read back. kernel-fun's B3 (``f7_f8_b3_scan.scan_states``) forms
u in the V slice each of its programs holds, from v, beta and Akk_inv, so here u is not
written (the chain asks for none when its B3 forms u: the ``forms_u`` capability) and the
stage moves 4.0 GB instead of 6.2.

This kernel: fla's grid, one program a (chunk, value head), Akk_inv [64, 64] loaded once as
the dot's register operand, K in slices of BK channels, each slice's w, kg and qg written as
made.

Numerics: every rounding where fla's kernel makes it (k beta in beta's dtype when it is k's,
k beta exp2 g in k's dtype before the dot, fp32 sums, outputs in k's dtype); fp32 inputs take
the dot in three tf32 products (``dot3``). On the H200 w, qg and kg are within 1e-3 of fla's
and their float64 errors fla's to three digits.

Falls back (``supports``): chunk size other than 64, K > 256, u asked for (a B3 that reads u:
fla's kernel writes it). The forward's F6 stays fla's (inside F3-F6): its scan reads u, and
this kernel writing u measured slower than fla's.

Measured: the README's stage table (B2 rows; 1.41x fla's at prod8192_gate, 1.32x the floor).
The round is in docs/log/wy.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import chunk_head, config_over, dot, dot3, to


@triton.jit
def _dot_in(a, b):
    """The WY products: bf16/fp16 operands on the tensor cores (exact products, fp32 sums);
    fp32 operands in tf32x3, fp32-level like the reference's."""
    if a.dtype == tl.float32:
        return dot3(a, b)
    return dot(a, b)


@triton.jit
def _k_side(x_b, q, k, g, beta, b_c, w, kg, qg, row0, t, m_t, n_t, o_k, m_k, i_hv, K: tl.constexpr,
            SK: tl.constexpr, SG: tl.constexpr):
    """The K side on the chunk's channels o_k, from Akk_inv ``x_b`` ([BT, BT] in the input
    dtype): w = Akk_inv (beta k exp2 g), kg = k exp2(g_last - g) and qg = q exp2 g, each
    rounded where fla's ``recompute_w_u_fwd`` rounds (q, k, g at the program's chunk and
    head; w, kg, qg indexed from row0)."""
    dt = k.dtype.element_ty
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = (row0 + t)[:, None] * SG + i_hv * K + o_k[None, :]
    k_c = tl.load(k + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    g_c = tl.load(g + t[:, None] * SG + o_k[None, :], mask=m_tk, other=0)
    kb = k_c * b_c[:, None]
    if beta.dtype.element_ty == dt:  # k beta rounds to their dtype (fp32 when they differ), as in torch
        kb = to(kb, dt).to(tl.float32)
    kbg = to(kb * tl.exp2(g_c), dt)
    tl.store(w + p_k, to(_dot_in(x_b, kbg), w.dtype.element_ty), mask=m_tk)
    g_last = tl.load(g + (n_t - 1) * SG + o_k, mask=m_k, other=0)
    kgv = k_c * tl.exp2(tl.where(m_tk, g_last[None, :] - g_c, float("-inf")))
    tl.store(kg + p_k, to(kgv, kg.dtype.element_ty), mask=m_tk)
    q_c = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    tl.store(qg + p_k, to(q_c * tl.exp2(g_c), qg.dtype.element_ty), mask=m_tk)


@triton.jit
def wy_recompute_kernel(
    q, k, g, beta, Akk, w, kg, qg, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """w, kg and qg of one (chunk, value head) from its Akk_inv rows."""
    if IS_VARLEN:
        if tl.load(chunk_indices + tl.program_id(0) * 2) < 0:  # a capacity-shaped index's spare row
            return
    i_hv, i_h, row0, n_t = chunk_head(cu_seqlens, chunk_indices, T, H, HV, BT, IS_VARLEN)
    SK: tl.constexpr = H * K
    SG: tl.constexpr = HV * K
    t = tl.arange(0, BT)
    m_t = t < n_t
    b_c = tl.load(beta + (row0 + t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    x_b = tl.load(Akk + (row0 + t)[:, None] * (HV * BT) + i_hv * BT + t[None, :], mask=m_t[:, None], other=0)
    q_h = q + (row0 * H + i_h) * K
    k_h = k + (row0 * H + i_h) * K
    g_h = g + (row0 * HV + i_hv) * K
    for i_s in range(0, tl.cdiv(K, BK)):
        o_k = i_s * BK + tl.arange(0, BK)
        _k_side(x_b, q_h, k_h, g_h, beta, b_c, w, kg, qg, row0, t, m_t, n_t, o_k, o_k < K, i_hv, K, SK, SG)


# The pinned config. sm_90a (K=128, V=256, H=HV=16, bf16): 143 registers, no spills, 24 KB of
# shared memory, one program an SM. Measured at prod8192_gate (docs/log/wy.md): BK=128, 8
# warps, 1 stage 1.358 ms; BK=64 or 32 at 4 warps and 3 stages 1.394; BK=64 or 32 at 8 warps
# and 2 stages 1.44; BK=64 at 4 warps and 2 stages 1.470 (fla's 1.953 in the same run).
CONFIG = dict(BK=128, num_warps=8, num_stages=1)
# What ``config`` may set (the benchmarks' sweeps; a call runs the pinned config).
CONFIG_KEYS = frozenset({"BK", "num_warps", "num_stages"})


def wy_recompute(q, k, v, beta, A, gc, want_u, chunk_size, cu_seqlens, chunk_indices, config: dict | None = None):
    """B2 with fla's contract (``recompute_w_u_fwd``): (w, None, qg, kg) at value heads, from
    Akk_inv ``A`` and the chunk cumsum ``gc`` (fp32, log2 units); u is not written (``want_u``
    must be false: ``supports``). ``config`` overrides the pinned launch config
    (``CONFIG_KEYS``)."""
    if want_u:
        raise ValueError("kernel-fun's B2 writes no u (its B3 forms u); fla's stage writes it")
    for name, t in dict(q=q, k=k, beta=beta, A=A, gc=gc).items():
        if not t.is_contiguous():
            raise ValueError(f"the WY kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    cfg = config_over(CONFIG, config, CONFIG_KEYS, "B2")
    B, T, H, K = k.shape
    HV = v.shape[2]
    BT = chunk_size
    w = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
    kg = torch.empty_like(w)
    qg = torch.empty_like(w)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    wy_recompute_kernel[(NT, B * HV)](
        q=q, k=k, g=gc, beta=beta, Akk=A, w=w, kg=kg, qg=qg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, BT=BT, BK=min(cfg["BK"], max(16, triton.next_power_of_2(K))),
        IS_VARLEN=cu_seqlens is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return w, None, qg, kg


def supports(k, chunk_size, want_u, A, **_) -> str | None:
    """None when ``wy_recompute`` takes the call, else why B2 runs as fla's."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the WY kernel is built for 64)"
    if k.shape[-1] > 256:
        return f"K={k.shape[-1]} > 256"
    if want_u:
        return "u is asked for (read by a B3 that is not kernel-fun's): fla's kernel writes it"
    return None
