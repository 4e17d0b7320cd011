"""B2, the backward's WY recompute from Akk_inv: w = Akk_inv (beta k exp2 g), kg =
k exp2(g_last - g) and qg = q exp2 g, for one chunk of one value head per program, and u =
Akk_inv (beta v) only when asked.

Replaces fla's ``recompute_w_u_fwd`` as B2 (1.67 ms inside the whole op at prod8192_gate on
the H200, 6.2 GB at 87% of the copy rate). fla's kernel always writes u [B, T, HV, V] (1.07
GB at prod8192_gate) for B3 to read back; kernel-fun's B3 (``scan_fwd.scan_states``) forms
u in the V slice each program holds, from v, beta and Akk_inv, so here u is not written
(``want_u`` false: what the chain asks when its B3 forms u) and the stage moves 4.0 GB
(0.95 ms at the copy rate) instead of 6.2.

Design: fla's grid, one program a (chunk, value head), Akk_inv [64, 64] loaded once as the
dot's register operand, K in slices of BK channels, each slice's w, kg and qg written as
made; u (when asked) in V tiles of BV after.

Numerics: every rounding where fla's kernel makes it (k beta in beta's dtype when it is
k's, k beta exp2 g in k's dtype before the dot, fp32 sums, outputs in k's and v's dtypes);
on the H200 w, qg and kg within 1e-3 of fla's (tests/test_gpu.py, prod8192_gate among
them), the float64 errors fla's to three digits (w 0.00425, qg 0.00165, kg 0.00156).

Falls back (``supports``): chunk size other than 64, K > 256, u asked for (fla's kernel
writes it: a B3 that reads u). The forward's F6 stays fla's (inside F3-F6): its scan reads
u, and this kernel writing u measured slower than fla's (below).

Measured (H200, prod8192_gate, bench/results/stages.jsonl at 7e65710 and cab86c7; the round
in docs/log/wy.md): 1.256 ms against fla's 1.766 in the same run (1.41x; 1.32x its floor),
1.358 against 1.953 in another; with u written 1.97 and 2.47 (slower than fla's). In the
whole op (chunk_kda.jsonl at 7e65710) B2 takes 1.21 ms against fla's 1.67 and B1-B3 3.69
against 3.87.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_fun._triton import chunk_head, dot, dot3, to
from kernel_fun.kda.stages import add_impl


@triton.jit
def _dot_in(a, b):
    """The WY products: bf16/fp16 operands on the tensor cores (exact products, fp32 sums);
    fp32 operands in tf32x3, fp32-level like the reference's."""
    if a.dtype == tl.float32:
        return dot3(a, b)
    return dot(a, b)


@triton.jit
def wy_k(x_b, q, k, g, beta, b_c, w, kg, qg, row0, t, m_t, n_t, o_k, m_k, i_hv, K: tl.constexpr,
         SK: tl.constexpr, SG: tl.constexpr, STORE_QG: tl.constexpr):
    """F6's K side on the chunk's channels o_k, from Akk_inv ``x_b`` ([BT, BT] in the input
    dtype): w = Akk_inv (beta k exp2 g), kg = k exp2(g_last - g) and with STORE_QG qg = q
    exp2 g, each rounded where fla's ``recompute_w_u_fwd`` rounds (q, k, g at the program's
    chunk and head; w, kg, qg indexed from row0)."""
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
    if STORE_QG:
        q_c = tl.load(q + t[:, None] * SK + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
        tl.store(qg + p_k, to(q_c * tl.exp2(g_c), qg.dtype.element_ty), mask=m_tk)


@triton.jit
def wy_v(x_b, v, b_c, u, row0, t, m_t, i_hv, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """F6's V side: u = Akk_inv (beta v), V in tiles of BV (v and u indexed from row0)."""
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (row0 + t)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        v_c = tl.load(v + p_v, mask=m_tv, other=0).to(tl.float32)
        vb = to(v_c * b_c[:, None], v.dtype.element_ty)
        tl.store(u + p_v, to(_dot_in(x_b, vb), u.dtype.element_ty), mask=m_tv)


@triton.jit
def wy_fwd_kernel(
    q, k, v, g, beta, Akk, w, u, kg, qg, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_QG: tl.constexpr, STORE_U: tl.constexpr,
):
    """w, kg (and qg, u when stored) of one (chunk, value head) from its Akk_inv rows."""
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
        wy_k(x_b, q_h, k_h, g_h, beta, b_c, w, kg, qg, row0, t, m_t, n_t, o_k, o_k < K, i_hv, K, SK, SG, STORE_QG)
    if STORE_U:
        wy_v(x_b, v, b_c, u, row0, t, m_t, i_hv, HV, V, BV)


# Compiled for sm_90a offline (K=128, V=256, H=HV=16, bf16, qg written; ``python -m
# tools.compile_report --design wy``), no spills but at 4 warps with BK=128 (64 B): BK=128 at 8
# warps 143 registers and 24 KB of shared memory (the pin: one program an SM); BK=64 at 8
# warps 94-102, at 4 warps 174-182; BK=32 60-93. Measured at prod8192_gate (stages.jsonl at
# cab86c7): BK=128/8 warps/1 stage 1.358 ms, BK=64/4/3 and BK=32/4/3 1.394, BK=64/8/2 1.443,
# BK=32/8/2 1.445, BK=64/4/2 1.470 (fla's 1.953 in the same run).
DEFAULT_CONFIG = dict(BK=128, BV=64, num_warps=8, num_stages=1)


def wy_vectors(q, k, v, beta, A, gc, want_u, chunk_size, cu_seqlens, chunk_indices, **config):
    """B2 (and F6) with fla's contract (``recompute_w_u_fwd``): (w, u, qg, kg) at value heads, u
    None unless ``want_u``, qg None unless ``q`` is given; from Akk_inv ``A`` and the chunk
    cumsum ``gc`` (fp32, log2 units)."""
    for name, t in dict(q=q, k=k, v=v, beta=beta, A=A, gc=gc).items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"the WY kernel indexes {name} as a dense tensor; got strides {t.stride()}")
    cfg = {**DEFAULT_CONFIG, **config}
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    w = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
    kg = torch.empty_like(w)
    qg = torch.empty_like(w) if q is not None else None
    u = torch.empty_like(v) if want_u else None
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    BKP = max(16, triton.next_power_of_2(K))
    wy_fwd_kernel[(NT, B * HV)](
        q=k if q is None else q, k=k, v=v, g=gc, beta=beta, Akk=A, w=w, u=u, kg=kg, qg=qg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BK=min(cfg["BK"], BKP),
        BV=min(cfg["BV"], max(16, triton.next_power_of_2(V))), IS_VARLEN=cu_seqlens is not None,
        STORE_QG=q is not None, STORE_U=want_u, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return w, u, qg, kg


def supports(k, chunk_size, want_u, A, **_) -> str | None:
    """None when ``wy_vectors`` takes the call, else why B2 stays on fla."""
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (the WY kernel is built for 64)"
    if k.shape[-1] > 256:
        return f"K={k.shape[-1]} > 256"
    if want_u:
        return "u is asked for (read by a B3 that is not kernel-fun's): fla's kernel writes it"
    return None


add_impl("B2", "ours", wy_vectors, supports)
