"""Torch references for KDA: the float64 oracle and one reference per stage.

Two kinds of reference live here, and every test, the bench and the CPU path share them:

(a) ``recurrent_kda`` -- the token-by-token recurrence in float64, the ground truth. Every
    gradient (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) comes from torch autograd
    through it.

(b) The stage references -- one torch function per stage of fla's chunked chain (F1-F8,
    B1-B10, named in ``kernel_fun.kda.chain``), each computing that stage's outputs from
    that stage's inputs, with fla's layouts and dtypes. They compute in
    float32 and round where fla's kernels round (a bf16 operand before a dot, a bf16
    store), so a stage reference and fla's stage agree to accumulation order, and a
    Triton stage can be checked against either. The chain of stage references is what a
    CPU call of ``kernel_fun.kda.chunk_kda`` runs.

Conventions (fla's): q, k are ``[B, T, H, K]``; v, g, every intermediate and every
per-value-head gradient are at HV = G*H heads; ``gc`` is the chunk-local cumulative
log-decay times 1/ln 2 (so ``exp2(gc_r - gc_s) = exp(Gamma_r - Gamma_s)``), float32; the
gradients the backward stages produce for the gate are with respect to the natural-log
cumsum Gamma. Packed sequences (``cu_seqlens``, B = 1) run once per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kernel_fun._fla import RCP_LN2  # fla's 1/ln 2: the stored gc carries it

LN2 = math.log(2.0)
CHUNK = 64
# The lowest log-decay the chunk references carry (F2): exp2(RESET * RCP_LN2) underflows to 0
# in fp32 (below 2^-149), so a -inf log-decay is an exact reset with a finite cumsum.
RESET = -200.0
# Pairwise-decay tensors are [B, HV, chunks, 64, 64, K] floats; process chunks in groups
# that keep one group under this many elements (~256 MB in float32).
_PAIRWISE_BUDGET = 64 * 1024 * 1024


# --------------------------------------------------------------------------------------
# Error metric
# --------------------------------------------------------------------------------------
def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """rms(x - ref) / rms(ref), in float64. NaN anywhere gives NaN (which fails any bound)."""
    x = x.detach().to(device="cpu", dtype=torch.float64)
    ref = ref.detach().to(device="cpu", dtype=torch.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(ref.shape)}")
    num = (x - ref).pow(2).mean().sqrt()
    den = ref.pow(2).mean().sqrt()
    if torch.isnan(num) or torch.isnan(den):
        return float("nan")
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return (num / den).item()


# fla's test budgets (relative RMS against a float64 oracle).
BUDGETS = {
    "o": 0.005,
    "final_state": 0.005,
    "dq": 0.008,
    "dk": 0.008,
    "dv": 0.008,
    "dh0": 0.008,
    "dg": 0.02,
    "dbeta": 0.02,
    "dA_log": 0.02,
    "ddt_bias": 0.02,
}


# --------------------------------------------------------------------------------------
# (a) The float64 oracle
# --------------------------------------------------------------------------------------
def gate_activation(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """KDA's log-decay from the raw gate input, ``[..., HV, K]``, in ``dtype``.

    Default: ``-exp(A_log) * softplus(g + dt_bias)``. With ``lower_bound`` L:
    ``L * sigmoid(exp(A_log) * (g + dt_bias))``, which lies in (L, 0).
    """
    HV, K = g.shape[-2:]
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).view(HV, K)
    if lower_bound is None:
        return -A_log.to(dtype).exp().view(HV, 1) * F.softplus(x)
    a = A_log.to(dtype).exp().view(HV, 1) if A_log is not None else 1.0
    return lower_bound * torch.sigmoid(a * x)


def _sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, bos, eos) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = cu_seqlens.detach().cpu().tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    safe_gate: bool = False,
    disable_recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KDA recurrence token by token, in float64: ``(o [B,T,HV,V], final_state [N,HV,K,V])``.

    Per value head, with S in R^{K x V}: ``S <- Diag(exp(a_t)) S``, then
    ``S <- S + beta_t k_t (v_t - S^T k_t)^T``, then ``o_t = scale * S^T q_t``. Takes the same
    flags as ``chunk_kda``; differentiable in every tensor argument. ``state_v_first``: the
    initial and final states are ``[N, HV, V, K]``. ``safe_gate`` and ``disable_recompute``
    change how fla's kernels compute, not what: the recurrence ignores them.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    if scale is None:
        scale = K ** -0.5
    f64 = torch.float64
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    a = gate_activation(g, A_log, dt_bias, lower_bound, dtype=f64) if use_gate_in_kernel else g
    q = q.repeat_interleave(G, dim=2) * scale
    k = k.repeat_interleave(G, dim=2)

    outputs, finals = [], []
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    for i_n, (b, bos, eos) in enumerate(_sequence_bounds(B, T, cu_seqlens)):
        if initial_state is not None:
            S = initial_state[i_n].to(f64)
        else:
            S = q.new_zeros(HV, K, V)
        rows = []
        for t in range(bos, eos):
            S = S * a[b, t].exp()[..., None]
            k_t = k[b, t]
            kv = (S * k_t[..., None]).sum(-2)
            S = S + beta[b, t][:, None, None] * k_t[..., None] * (v[b, t] - kv)[:, None, :]
            rows.append((S * q[b, t][..., None]).sum(-2))
        outputs.append(torch.stack(rows, 0) if rows else v.new_zeros(0, HV, V))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(outputs, 0)
    else:  # (offsets ending before T: a capacity-shaped batch, whose padding rows are zeros here)
        o = pad_rows(torch.cat(outputs, 0).unsqueeze(0), T)
    final_state = torch.stack(finals, 0) if output_final_state else None
    if final_state is not None and state_v_first:
        final_state = final_state.transpose(-1, -2)
    return o, final_state


# --------------------------------------------------------------------------------------
# Chunk layout helpers
# --------------------------------------------------------------------------------------
def _num_chunks(T: int, BT: int) -> int:
    return (T + BT - 1) // BT


def to_chunks(x: torch.Tensor, BT: int = CHUNK) -> torch.Tensor:
    """``[B, T, H, *rest]`` -> ``[B, H, NT, BT, *rest]``, zero-padding T up to NT*BT."""
    B, T = x.shape[:2]
    NT = _num_chunks(T, BT)
    pad = NT * BT - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], 1)
    return x.reshape(B, NT, BT, *x.shape[2:]).movedim(3, 1)


def from_chunks(y: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of ``to_chunks``: ``[B, H, NT, BT, *rest]`` -> ``[B, T, H, *rest]``, contiguous
    (stage outputs have fla's dense layouts)."""
    B, H, NT, BT = y.shape[:4]
    return y.movedim(1, 3).reshape(B, NT * BT, H, *y.shape[4:])[:, :T].contiguous()


def _valid_rows(T: int, BT: int, device) -> torch.Tensor:
    """``[NT, BT]`` True where the chunk row is a real token."""
    NT = _num_chunks(T, BT)
    return (torch.arange(NT * BT, device=device) < T).view(NT, BT)


def _last_rows(x: torch.Tensor, T: int, BT: int) -> torch.Tensor:
    """Per chunk, the row of ``x`` (``[B, H, NT, BT, *rest]``) at the chunk's last real token."""
    NT = x.shape[2]
    last = torch.clamp(torch.arange(NT, device=x.device) * BT + BT, max=T) - 1 - torch.arange(NT, device=x.device) * BT
    index = last.view(1, 1, NT, 1, *([1] * (x.dim() - 4))).expand(*x.shape[:3], 1, *x.shape[4:])
    return x.gather(3, index).squeeze(3)


def swap_state(x: torch.Tensor | None) -> torch.Tensor | None:
    """A state-shaped tensor between fla's two layouts, ``[..., K, V]`` <-> ``[..., V, K]``
    (``state_v_first``), dense. The stage references compute in ``[K, V]`` and take or give
    the other layout through this."""
    return None if x is None else x.transpose(-1, -2).contiguous()


def _expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """q/k heads -> value heads (GVA): head hv reads qk head hv // G."""
    H = x.shape[2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=2)


def _mask_pairs(T: int, BT: int, device, strict: bool) -> torch.Tensor:
    """``[NT, BT, BT]``: (r, s) with s <= r (s < r when strict), both real tokens."""
    valid = _valid_rows(T, BT, device)
    r = torch.arange(BT, device=device)
    tri = (r[:, None] > r[None, :]) if strict else (r[:, None] >= r[None, :])
    return tri & valid[:, :, None] & valid[:, None, :]


def _pairwise_decay(gc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``exp2(gc_r - gc_s)`` for the (r, s) pairs in ``mask``, 0 elsewhere.

    gc: ``[B, HV, n, BT, K]``, mask: ``[n, BT, BT]`` -> ``[B, HV, n, BT, BT, K]``. Masked
    pairs never see an exponent, so a steep decay cannot overflow into them.
    """
    diff = gc[..., :, None, :] - gc[..., None, :, :]
    return torch.exp2(torch.where(mask[..., None], diff, float("-inf")))


def _tril_dot(A: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``A @ X`` for ``A`` lower-triangular in each chunk (``[..., BT, BT]``, 0 above the
    diagonal), causal to the bit: row r reads X's rows s <= r alone. A non-finite entry of X
    (NaN, +-inf) would reach the rows before it through a masked product (0 * NaN = NaN), so
    it is selected away from them and its column is NaN from its own row on. With finite X
    (the usual case) this is ``A @ X``, bit for bit."""
    bad = ~torch.isfinite(X)
    if not bool(bad.any()):
        return A @ X
    return torch.where(bad.cumsum(-2) > 0, float("nan"), A @ torch.where(bad, 0.0, X))


def _chunk_groups(B: int, HV: int, NT: int, BT: int, K: int) -> list[slice]:
    per_chunk = B * HV * BT * BT * max(K, 1)
    step = max(1, _PAIRWISE_BUDGET // per_chunk)
    return [slice(i, min(i + step, NT)) for i in range(0, NT, step)]


# --------------------------------------------------------------------------------------
# Packed sequences: run a dense stage once per sequence and stitch the results
# --------------------------------------------------------------------------------------
def pad_rows(x: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``x`` with zero rows appended along dim 1 up to ``n`` (a capacity-shaped batch's
    padding tokens, or its index's spare chunk rows)."""
    if x is None or x.shape[1] >= n:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], n - x.shape[1], *x.shape[2:])], 1)


def pad_chunks(x: torch.Tensor | None, chunk_indices: torch.Tensor | None) -> torch.Tensor | None:
    """A per-chunk output ([1, NT, ...] from ``per_sequence``) with zero rows up to the chunk
    index's row count."""
    return x if chunk_indices is None else pad_rows(x, chunk_indices.shape[0])


def _chunk_counts(cu_seqlens: torch.Tensor, BT: int) -> list[int]:
    bounds = cu_seqlens.detach().cpu().tolist()
    return [_num_chunks(bounds[i + 1] - bounds[i], BT) for i in range(len(bounds) - 1)]


def per_sequence(
    fn: Callable,
    cu_seqlens: torch.Tensor,
    kwargs: dict,
    kinds: dict[str, str],
    out_kinds: Sequence[str | None],
    BT: int = CHUNK,
):
    """Run dense ``fn`` on each sequence of a packed batch (B = 1) and concatenate.

    ``kinds`` says how each argument splits: ``token`` ([1, T, ...] along dim 1 by
    cu_seqlens), ``chunk`` ([1, NT, ...] along dim 1 by per-sequence chunk counts),
    ``state`` ([N, ...], one row each). ``out_kinds`` says the same of the outputs, in order.
    Offsets that end before T (fla 0.6's capacity-shaped batches) leave the last tokens out
    of every sequence: their rows of a token output are zeros.
    """
    bounds = cu_seqlens.detach().cpu().tolist()
    counts = _chunk_counts(cu_seqlens, BT)
    chunk_starts = [sum(counts[:i]) for i in range(len(counts))]
    results = []
    for i in range(len(bounds) - 1):
        bos, eos = bounds[i], bounds[i + 1]
        c0, nc = chunk_starts[i], counts[i]
        call = {}
        for name, value in kwargs.items():
            kind = kinds.get(name)
            if value is None or kind is None:
                call[name] = value
            elif kind == "token":
                call[name] = value[:, bos:eos]
            elif kind == "chunk":
                call[name] = value[:, c0:c0 + nc]
            elif kind == "state":
                call[name] = value[i:i + 1]
            else:  # pragma: no cover - programming error
                raise ValueError(kind)
        out = fn(**call)
        results.append(out if isinstance(out, tuple) else (out,))
    # the tokens past the last sequence (a capacity-shaped batch's padding) get zeros
    T = next((v.shape[1] for n, v in kwargs.items() if kinds.get(n) == "token" and v is not None), bounds[-1])
    stitched = []
    for j, kind in enumerate(out_kinds):
        parts = [r[j] for r in results]
        if kind is None or parts[0] is None:
            stitched.append(parts[0] if kind is None else None)
        elif kind == "token":
            stitched.append(pad_rows(torch.cat(parts, 1), T))
        elif kind == "chunk":
            stitched.append(torch.cat(parts, 1))
        elif kind == "state":
            stitched.append(torch.cat(parts, 0))
        else:  # pragma: no cover
            raise ValueError(kind)
    return tuple(stitched) if len(stitched) > 1 else stitched[0]


# --------------------------------------------------------------------------------------
# (b) Stage references
# --------------------------------------------------------------------------------------
# F1 / B10: l2norm of q and k rows ---------------------------------------------------------
def l2norm_fwd(x: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x * rstd in x.dtype, rstd float32), rstd = 1/sqrt(sum x^2 + eps)."""
    xf = x.float()
    rstd = 1.0 / torch.sqrt((xf * xf).sum(-1) + eps)
    return (xf * rstd[..., None]).to(x.dtype), rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx = rstd * (dy - (dy . y) y), y the normalized rows; in y.dtype."""
    yf, dyf, r = y.float(), dy.float(), rstd.float()[..., None]
    dx = dyf * r - (dyf * yf).sum(-1, keepdim=True) * yf * r
    return dx.to(y.dtype)


def group_sum(dq: torch.Tensor, dk: torch.Tensor, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GVA: dq and dk come at value heads ([B, T, HV, K]); each of the H q/k heads sums its group."""
    if dq.shape[2] == H:
        return dq, dk
    return tuple(d.view(*d.shape[:2], H, -1, d.shape[-1]).sum(dim=3) for d in (dq, dk))


# F1b / B10b: beta = scale * sigmoid(beta_raw) ---------------------------------------------
def beta_sigmoid_fwd(beta: torch.Tensor, scale: float) -> torch.Tensor:
    """float32, as fla's fused kernel writes it."""
    return scale * torch.sigmoid(beta.float())


def beta_sigmoid_bwd(beta: torch.Tensor, db: torch.Tensor, scale: float) -> torch.Tensor:
    s = torch.sigmoid(beta.float())
    return (db.float() * scale * s * (1.0 - s)).to(beta.dtype)


# F2 / B1 / B8: chunk-local cumulative sums --------------------------------------------------
def _chunk_cumsum_dense(x: torch.Tensor, reverse: bool, BT: int) -> torch.Tensor:
    T = x.shape[1]
    c = to_chunks(x if x.dtype == torch.float64 else x.float(), BT)  # float64 stays float64 (the exact stages)
    c = c.flip(3).cumsum(3).flip(3) if reverse else c.cumsum(3)
    return from_chunks(c, T)


def chunk_cumsum(
    x: torch.Tensor,
    reverse: bool = False,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inclusive cumsum within each chunk (reversed: from the chunk's end), float32 (float64
    for a float64 input)."""
    if cu_seqlens is not None:
        return per_sequence(
            _chunk_cumsum_dense, cu_seqlens, dict(x=x, reverse=reverse, BT=chunk_size),
            {"x": "token"}, ("token",), chunk_size,
        )
    return _chunk_cumsum_dense(x, reverse, chunk_size)


def gate_cumsum(
    g: torch.Tensor,
    use_gate_in_kernel: bool,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """F2/B1: gc = RCP_LN2 * chunk-local cumsum of the log-decay (activated in-op or given).

    A log-decay below ``RESET`` (-inf: a full reset of the state) is taken as ``RESET``: the
    cumsum stays finite, so decays between two tokens on the same side of a reset are
    differences of finite numbers, and every decay across one is exp(<= RESET) = 0 in fp32,
    as the recurrence's exp(-inf) is."""
    a = gate_activation(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.float()
    a = torch.where(a < RESET, RESET, a)  # NaN stays NaN
    return chunk_cumsum(a, chunk_size=chunk_size, cu_seqlens=cu_seqlens) * RCP_LN2


# F3-F6: intra-chunk scores, their solve, and the WY vectors ---------------------------------
def _intra_dense(q, k, gc, beta, scale, BT, exact=False):
    B, T, H, K = q.shape
    HV = gc.shape[2]
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    qc = to_chunks(f(_expand_heads(q, HV)), BT)
    kc = to_chunks(f(_expand_heads(k, HV)), BT)
    gcc = to_chunks(f(gc), BT)
    bc = to_chunks(f(beta), BT)
    NT = qc.shape[2]
    m_incl = _mask_pairs(T, BT, q.device, strict=False)
    m_strict = _mask_pairs(T, BT, q.device, strict=True)
    Aqk = qc.new_zeros(B, HV, NT, BT, BT)
    Akk = qc.new_zeros(B, HV, NT, BT, BT)
    for sl in _chunk_groups(B, HV, NT, BT, K):
        E = _pairwise_decay(gcc[:, :, sl], m_incl[sl])
        aqk = scale * torch.einsum("bhnrk,bhnsk,bhnrsk->bhnrs", qc[:, :, sl], kc[:, :, sl], E)
        Aqk[:, :, sl] = torch.where(m_incl[sl], aqk, 0.0)  # (0 * a non-finite k above the diagonal is not 0)
        kk = torch.einsum("bhnrk,bhnsk,bhnrsk->bhnrs", kc[:, :, sl], kc[:, :, sl], E)
        Akk[:, :, sl] = torch.where(m_strict[sl], kk * bc[:, :, sl, :, None], 0.0)
    eye = torch.eye(BT, device=q.device, dtype=Akk.dtype)
    Akk_inv = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False, unitriangular=True)
    Akk_inv = torch.where(m_incl, Akk_inv, 0.0)  # 0 above the diagonal and on padding rows and columns
    if exact:
        return from_chunks(Aqk, T), from_chunks(Akk_inv, T)
    return from_chunks(Aqk, T).to(k.dtype), from_chunks(Akk_inv, T).to(k.dtype)


def intra_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    gc: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """F3-F5: ``Aqk`` (scaled, s <= r; 0 above) and ``Akk_inv = (I + Akk)^-1`` (lower, unit
    diagonal), both ``[B, T, HV, BT]`` in k.dtype, with
    ``Akk[r, s] = beta_r * sum_i k_ri k_si exp2(gc_ri - gc_si)`` for s < r. ``exact=True``:
    float64 throughout, returned unrounded."""
    if cu_seqlens is not None:
        return per_sequence(
            _intra_dense, cu_seqlens, dict(q=q, k=k, gc=gc, beta=beta, scale=scale, BT=chunk_size, exact=exact),
            {"q": "token", "k": "token", "gc": "token", "beta": "token"}, ("token", "token"), chunk_size,
        )
    return _intra_dense(q, k, gc, beta, scale, chunk_size, exact)


def sequence_positions(T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """``[T]``: each token's index inside its sequence (a packed batch's sequences restart at
    their ``cu_seqlens`` offsets; a dense batch's at 0), so ``% BT`` is its row in its chunk."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t
    starts = cu_seqlens.to(device)
    return t - starts[torch.searchsorted(starts, t, right=True) - 1]


def _wy_dense(k, v, beta, A, gc, q, BT, exact=False):
    B, T, H, K = k.shape
    HV = v.shape[2]
    ke = _expand_heads(k, HV)
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    r = (lambda x, dtype: x) if exact else (lambda x, dtype: x.to(dtype))  # fla's roundings
    A_c = to_chunks(f(A), BT)  # [B, HV, NT, BT, BT]
    kb = f(ke) * f(beta)[..., None] if exact else ke * beta[..., None]  # rounds like the kernel: bf16 * bf16 stays bf16
    kbg = r(f(kb) * torch.exp2(f(gc)), k.dtype)
    w = r(from_chunks(_tril_dot(A_c, to_chunks(f(kbg), BT)), T), k.dtype)
    vb = r(f(v) * f(beta)[..., None], v.dtype)
    u = r(from_chunks(_tril_dot(A_c, to_chunks(f(vb), BT)), T), v.dtype)
    gcc = to_chunks(f(gc), BT)
    g_last = _last_rows(gcc, T, BT)  # [B, HV, NT, K]
    valid = _valid_rows(T, BT, k.device)[..., None]
    kg = to_chunks(f(ke), BT) * torch.where(valid, torch.exp2(g_last[:, :, :, None] - gcc), 0.0)
    kg = r(from_chunks(kg, T), k.dtype)
    qg = None
    if q is not None:
        qg = r(f(_expand_heads(q, HV)) * torch.exp2(f(gc)), k.dtype)
    return w, u, qg, kg


def wy_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    gc: torch.Tensor,
    q: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    exact: bool = False,
):
    """F6/B2: ``w = A (beta k exp2 gc)``, ``u = A (beta v)``, ``kg = k exp2(gc_last - gc)`` and,
    when q is given, ``qg = q exp2 gc``; all at HV heads in the input dtypes (``exact=True``:
    float64, unrounded)."""
    if cu_seqlens is not None:
        return per_sequence(
            _wy_dense, cu_seqlens, dict(k=k, v=v, beta=beta, A=A, gc=gc, q=q, BT=chunk_size, exact=exact),
            {"k": "token", "v": "token", "beta": "token", "A": "token", "gc": "token", "q": "token"},
            ("token", "token", "token", "token"), chunk_size,
        )
    return _wy_dense(k, v, beta, A, gc, q, chunk_size, exact)


# F7 / B3: the state scan ----------------------------------------------------------------
def _h_dense(kg, w, u, gc, initial_state, output_final_state, BT, exact=False):
    B, T, HV, K = kg.shape
    V = u.shape[-1]
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    kgc, wc, uc = (to_chunks(f(x), BT) for x in (kg, w, u))
    g_last = _last_rows(to_chunks(f(gc), BT), T, BT)
    NT = kgc.shape[2]
    S = f(initial_state).clone() if initial_state is not None else kgc.new_zeros(B, HV, K, V)
    # fla rounds h and v_new to the input dtype; the exact variant keeps float64 throughout
    h = kgc.new_empty(B, NT, HV, K, V) if exact else kg.new_empty(B, NT, HV, K, V)
    v_new = []
    for c in range(NT):
        Sb = S if exact else S.to(kg.dtype)
        h[:, c] = Sb
        vn = uc[:, :, c] - wc[:, :, c] @ f(Sb)
        vn = vn if exact else vn.to(u.dtype)
        v_new.append(vn)
        S = S * torch.exp2(g_last[:, :, c])[..., None] + kgc[:, :, c].transpose(-1, -2) @ f(vn)
    # (an empty sequence of a packed batch has no chunk: no v_new, and S leaves as it came)
    v_new = from_chunks(torch.stack(v_new, 2), T) if v_new else u.new_empty(B, 0, HV, V)
    return h, v_new, (S if output_final_state else None)


def h_fwd(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gc: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    exact: bool = False,
):
    """F7/B3: per chunk, ``h[c] = S`` (bf16), ``v_new = u - w h[c]``,
    ``S <- exp2(gc_last) S + kg^T v_new``. Returns (h [B,NT,HV,K,V], v_new, final state fp32);
    with ``state_v_first`` the states (h, the initial and the final) are ``[..., V, K]``.
    ``exact=True`` computes in float64 without fla's roundings of h and v_new and returns
    float64: the float64 stage."""
    if state_v_first:
        h, v_new, final = h_fwd(kg, w, u, gc, swap_state(initial_state), output_final_state, chunk_size, cu_seqlens,
                                exact=exact)
        return swap_state(h), v_new, swap_state(final)
    if cu_seqlens is not None:
        return per_sequence(
            _h_dense, cu_seqlens,
            dict(kg=kg, w=w, u=u, gc=gc, initial_state=initial_state,
                 output_final_state=output_final_state, BT=chunk_size, exact=exact),
            {"kg": "token", "w": "token", "u": "token", "gc": "token", "initial_state": "state"},
            ("chunk", "token", "state"), chunk_size,
        )
    return _h_dense(kg, w, u, gc, initial_state, output_final_state, chunk_size, exact)


# F8: the output --------------------------------------------------------------------------
def _o_dense(q, v_new, gc, Aqk, h, scale, BT, exact=False):
    B, T, H, K = q.shape
    HV = v_new.shape[2]
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    r = (lambda x: x) if exact else (lambda x: x.to(q.dtype).float())  # fla's roundings before the dots
    qgc = to_chunks(r(f(_expand_heads(q, HV)) * torch.exp2(f(gc))), BT)
    hc = f(h).movedim(2, 1)  # [B, HV, NT, K, V]
    m_incl = _mask_pairs(T, BT, q.device, strict=False)
    A = torch.where(m_incl, to_chunks(f(Aqk), BT), 0)
    A = A if exact else A.to(v_new.dtype).float()
    o = scale * (qgc @ hc) + _tril_dot(A, to_chunks(f(v_new), BT))
    return from_chunks(o, T) if exact else from_chunks(o, T).to(v_new.dtype)


def o_fwd(
    q: torch.Tensor,
    v_new: torch.Tensor,
    gc: torch.Tensor,
    Aqk: torch.Tensor,
    h: torch.Tensor,
    scale: float,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    exact: bool = False,
) -> torch.Tensor:
    """F8: ``o = scale (q exp2 gc) h[c] + tril(Aqk) v_new``, in v_new.dtype (h ``[..., V, K]``
    with ``state_v_first``); ``exact=True``: float64, without fla's roundings."""
    if state_v_first:
        h = swap_state(h)
    if cu_seqlens is not None:
        return per_sequence(
            _o_dense, cu_seqlens,
            dict(q=q, v_new=v_new, gc=gc, Aqk=Aqk, h=h, scale=scale, BT=chunk_size, exact=exact),
            {"q": "token", "v_new": "token", "gc": "token", "Aqk": "token", "h": "chunk"}, ("token",), chunk_size,
        )
    return _o_dense(q, v_new, gc, Aqk, h, scale, chunk_size, exact)


# B4: dAqk and the intra-chunk part of dv ------------------------------------------------------
def _dav_dense(v_new, do, Aqk, scale, BT, exact=False):
    T = do.shape[1]
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    m_incl = _mask_pairs(T, BT, do.device, strict=False)
    A = torch.where(m_incl, to_chunks(Aqk, BT), 0)
    A = f(A if exact else A.to(do.dtype))  # (fla rounds Aqk to do's dtype)
    doc = to_chunks(f(do), BT)
    dA = torch.where(m_incl, scale * (doc @ to_chunks(f(v_new), BT).transpose(-1, -2)), 0.0)
    dv = (A.transpose(-1, -2) @ doc)
    return from_chunks(dA, T), from_chunks(dv, T) if exact else from_chunks(dv, T).to(do.dtype)


def dav_bwd(
    v_new: torch.Tensor,
    do: torch.Tensor,
    Aqk: torch.Tensor,
    scale: float,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    exact: bool = False,
):
    """B4: ``dAqk = scale tril(do v_new^T)`` (fp32; the gradient of the unscaled score) and
    ``dv = tril(Aqk)^T do`` (do.dtype); ``exact=True``: float64, without fla's roundings."""
    if cu_seqlens is not None:
        return per_sequence(
            _dav_dense, cu_seqlens, dict(v_new=v_new, do=do, Aqk=Aqk, scale=scale, BT=chunk_size, exact=exact),
            {"v_new": "token", "do": "token", "Aqk": "token"}, ("token", "token"), chunk_size,
        )
    return _dav_dense(v_new, do, Aqk, scale, chunk_size, exact)


# B5: the reverse state-gradient scan -----------------------------------------------------------
def _dhu_dense(qg, kg, w, gc, h0, dht, do, dv, scale, BT, exact=False):
    B, T, HV, K = kg.shape
    V = do.shape[-1]
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    r = (lambda x, dtype: x) if exact else (lambda x, dtype: x.to(dtype))  # fla's roundings
    qgc, kgc, wc = (to_chunks(f(x), BT) for x in (qg, kg, w))
    doc, dvc = to_chunks(f(do), BT), to_chunks(f(dv), BT)
    g_last = _last_rows(to_chunks(f(gc), BT), T, BT)
    NT = kgc.shape[2]
    dS = f(dht).clone() if dht is not None else kgc.new_zeros(B, HV, K, V)
    dh = kgc.new_empty(B, NT, HV, K, V) if exact else kg.new_empty(B, NT, HV, K, V)
    dv2 = [None] * NT
    for c in range(NT - 1, -1, -1):
        dSb = r(dS, kg.dtype)
        dh[:, c] = dSb
        dvn = r(dvc[:, :, c] + kgc[:, :, c] @ f(dSb), dv.dtype)
        dv2[c] = dvn
        dS = (dS * torch.exp2(g_last[:, :, c])[..., None]
              + scale * (qgc[:, :, c].transpose(-1, -2) @ doc[:, :, c])
              - wc[:, :, c].transpose(-1, -2) @ f(dvn))
    dv2 = from_chunks(torch.stack(dv2, 2), T) if dv2 else dv.new_empty(B, 0, HV, V)
    return dh, (dS if h0 is not None else None), dv2


def dhu_bwd(
    qg: torch.Tensor,
    kg: torch.Tensor,
    w: torch.Tensor,
    gc: torch.Tensor,
    h0: torch.Tensor | None,
    dht: torch.Tensor | None,
    do: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    exact: bool = False,
):
    """B5: reverse scan from dht. Per chunk c (last first): ``dh[c] = dS`` (the gradient of the
    state leaving c), ``dv2 = dv + kg dS``, ``dS <- exp2(gc_last) dS + scale qg^T do - w^T dv2``.
    Returns (dh [B,NT,HV,K,V], dh0 fp32 when h0 is given, dv2); with ``state_v_first`` the
    states (h0, dht, dh, dh0) are ``[..., V, K]``; ``exact=True``: float64, without fla's
    roundings."""
    if state_v_first:
        dh, dh0, dv2 = dhu_bwd(qg, kg, w, gc, swap_state(h0), swap_state(dht), do, dv, scale, chunk_size, cu_seqlens,
                               exact=exact)
        return swap_state(dh), swap_state(dh0), dv2
    if cu_seqlens is not None:
        return per_sequence(
            _dhu_dense, cu_seqlens,
            dict(qg=qg, kg=kg, w=w, gc=gc, h0=h0, dht=dht, do=do, dv=dv, scale=scale, BT=chunk_size, exact=exact),
            {"qg": "token", "kg": "token", "w": "token", "gc": "token", "h0": "state", "dht": "state",
             "do": "token", "dv": "token"},
            ("chunk", "state", "token"), chunk_size,
        )
    return _dhu_dense(qg, kg, w, gc, h0, dht, do, dv, scale, chunk_size, exact)


# B6: the WY backward ----------------------------------------------------------------------
def _wy_dqkg_dense(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, BT, exact=False):
    B, T, H, K = q.shape
    HV = v.shape[2]
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    # Where fla rounds to the input dtype before a dot; the exact variant does not round.
    r = (lambda x: x) if exact else (lambda x: x.to(k.dtype).float())
    qc = to_chunks(f(_expand_heads(q, HV)), BT)
    kc = to_chunks(f(_expand_heads(k, HV)), BT)
    gcc = to_chunks(f(gc), BT)
    bc = to_chunks(f(beta), BT)[..., None]  # [B, HV, NT, BT, 1]
    vc, vnc, doc, dvc = (to_chunks(f(x), BT) for x in (v, v_new, do, dv))
    Ac = to_chunks(f(A), BT)
    S = f(h).movedim(2, 1)  # [B, HV, NT, K, V]
    dS = f(dh).movedim(2, 1)
    valid = _valid_rows(T, BT, q.device)[..., None]
    m_strict = _mask_pairs(T, BT, q.device, strict=True)
    NT = _num_chunks(T, BT)
    last = torch.clamp((torch.arange(NT, device=q.device) + 1) * BT, max=T) - 1 - torch.arange(NT, device=q.device) * BT
    is_last = (torch.arange(BT, device=q.device)[None, :] == last[:, None])[..., None]

    g_last = _last_rows(gcc, T, BT)[:, :, :, None, :]  # [B, HV, NT, 1, K]
    g_exp = torch.exp2(gcc)
    dq = (doc @ S.transpose(-1, -2)) * g_exp * scale
    dk_h = (vnc @ dS.transpose(-1, -2)) * torch.where(valid, torch.exp2(g_last - gcc), 0.0)
    dw = r(-(dvc @ S.transpose(-1, -2)))
    dg_last = (S * dS).sum(-1)[:, :, :, None, :] * torch.exp2(g_last)  # [B, HV, NT, 1, K]
    kg = kc * g_exp
    At = Ac.transpose(-1, -2)
    dvb = At @ dvc
    dv2 = dvb * bc
    dkgb = At @ dw
    db = (dvb * vc).sum(-1) + (dkgb * kg).sum(-1)
    dA = dvc @ vc.transpose(-1, -2) + dw @ r(kg).transpose(-1, -2)
    dA = r(torch.where(m_strict, dA * bc.transpose(-1, -2), 0.0))
    dA = At @ r(dA @ At)
    dA = torch.where(m_strict, -dA, 0.0)
    kdk = kc * dk_h
    dg = qc * dq - kdk + is_last * (dg_last + kdk.sum(-2, keepdim=True)) + kg * dkgb * bc
    dk = dk_h + dkgb * g_exp * bc
    dv2 = from_chunks(dv2, T)
    return (from_chunks(dq, T), from_chunks(dk, T), dv2 if exact else dv2.to(v.dtype),
            from_chunks(db, T), from_chunks(dg, T), from_chunks(dA, T))


def wy_dqkg_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_new: torch.Tensor,
    gc: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    h: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    exact: bool = False,
    state_v_first: bool = False,
):
    """B6, with S = h[c], dS = dh[c], dvn = dv (B5's dv2), A = Akk_inv:

    - ``dq = scale (do S^T) exp2 gc``; ``dk_h = (v_new dS^T) exp2(gc_last - gc)``; ``dw = -dvn S^T``;
    - ``dv2 = beta (A^T dvn)``; ``dk = dk_h + beta exp2(gc) (A^T dw)``;
    - ``db = rowsum(A^T dvn * v) + rowsum(A^T dw * k exp2 gc)``;
    - ``dA = -A^T strict_lower([dvn v^T + dw (k exp2 gc)^T] Diag(beta)) A^T``, strictly lower;
    - ``dg = q dq - k dk_h + beta (k exp2 gc)(A^T dw)``, plus on the chunk's last row
      ``sum_V(S dS) exp2(gc_last) + sum_rows(k dk_h)``.

    Returns dq, dk (fp32, HV heads), dv2 (v.dtype), db, dg, dA (fp32). ``exact=True``
    computes in float64 without fla's intermediate bf16 roundings and returns float64: the
    stage's oracle. ``state_v_first``: h and dh are ``[..., V, K]``.
    """
    if state_v_first:
        h, dh = swap_state(h), swap_state(dh)
    if cu_seqlens is not None:
        return per_sequence(
            _wy_dqkg_dense, cu_seqlens,
            dict(q=q, k=k, v=v, v_new=v_new, gc=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv,
                 scale=scale, BT=chunk_size, exact=exact),
            {"q": "token", "k": "token", "v": "token", "v_new": "token", "gc": "token", "beta": "token",
             "A": "token", "h": "chunk", "do": "token", "dh": "chunk", "dv": "token"},
            ("token",) * 6, chunk_size,
        )
    return _wy_dqkg_dense(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, exact)


# B7: gradients through the intra-chunk scores -------------------------------------------------
def _intra_bwd_dense(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, BT, exact=False):
    B, T, H, K = q.shape
    HV = gc.shape[2]
    f = (lambda x: x.double()) if exact else (lambda x: x.float())
    qc = to_chunks(f(_expand_heads(q, HV)), BT)
    kc = to_chunks(f(_expand_heads(k, HV)), BT)
    Gc = to_chunks(f(gc), BT) * LN2  # natural-log cumsum: the gradients are d/dGamma
    bc = to_chunks(f(beta), BT)
    dAqk_c, dAkk_c = to_chunks(f(dAqk), BT), to_chunks(f(dAkk), BT)
    NT = qc.shape[2]
    m_incl = _mask_pairs(T, BT, q.device, strict=False)
    m_strict = _mask_pairs(T, BT, q.device, strict=True)
    grads = [torch.zeros_like(x) for x in (qc, kc, Gc, bc)]
    # The vector-Jacobian product written out (no autograd: the reference also runs inside
    # the operators' implementations, below autograd). With E[r,s,i] = e^{G_ri - G_si} on
    # the masks and P[r,s,i] the loss's derivative through E[r,s,i] times E[r,s,i]:
    # dq_r = sum_s dAqk_rs k_s E_rs, dk_s += sum_r dAqk_rs q_r E_rs, the Akk terms alike with
    # beta_r, db_r = sum_s dAkk_rs Akk_rs / beta_r, dG_r += sum_s P_rs, dG_s -= sum_r P_rs.
    for sl in _chunk_groups(B, HV, NT, BT, K):
        ql, kl, Gl, bl = (x[:, :, sl] for x in (qc, kc, Gc, bc))
        diff = Gl[..., :, None, :] - Gl[..., None, :, :]
        E = torch.exp(torch.where(m_incl[sl][..., None], diff, float("-inf")))
        wq = torch.where(m_incl[sl], dAqk_c[:, :, sl], 0.0)  # [.., r, s]
        wk = torch.where(m_strict[sl], dAkk_c[:, :, sl], 0.0)
        wkb = wk * bl[..., None]
        Eq, Ek = E * wq[..., None], E * wkb[..., None]  # [.., r, s, i]
        dq_c = torch.einsum("bhnrsk,bhnsk->bhnrk", Eq, kl)
        dk_c = (torch.einsum("bhnrsk,bhnrk->bhnsk", Eq, ql) + torch.einsum("bhnrsk,bhnsk->bhnrk", Ek, kl)
                + torch.einsum("bhnrsk,bhnrk->bhnsk", Ek, kl))
        db_c = torch.einsum("bhnrs,bhnrk,bhnsk,bhnrsk->bhnr", wk, kl, kl, E)
        P = Eq * (ql[..., :, None, :] * kl[..., None, :, :]) + Ek * (kl[..., :, None, :] * kl[..., None, :, :])
        dG_c = P.sum(-2) - P.sum(-3)
        for acc, grad in zip(grads, (dq_c, dk_c, dG_c, db_c)):
            acc[:, :, sl] = grad
    dq_i, dk_i, dg_i, db_i = (from_chunks(x, T) for x in grads)
    return f(dq) + dq_i, f(dk) + dk_i, f(db) + db_i, f(dg) + dg_i


def intra_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    gc: torch.Tensor,
    beta: torch.Tensor,
    dAqk: torch.Tensor,
    dAkk: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    db: torch.Tensor,
    dg: torch.Tensor,
    chunk_size: int = CHUNK,
    cu_seqlens: torch.Tensor | None = None,
    exact: bool = False,
):
    """B7: adds to dq, dk, db, dg (fp32, HV heads) the vector-Jacobian product of
    ``(Aqk_raw, Akk)`` with ``(dAqk, dAkk)``, where ``Aqk_raw[r,s] = sum_i q_ri k_si e^{G_ri - G_si}``
    (s <= r) and ``Akk[r,s] = beta_r sum_i k_ri k_si e^{G_ri - G_si}`` (s < r). ``exact=True``
    computes in float64 (from the same inputs): with strong gates the fp32 cumsum's
    conversion to natural-log units alone moves the fp32 result by ~1e-4."""
    if cu_seqlens is not None:
        return per_sequence(
            _intra_bwd_dense, cu_seqlens,
            dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, BT=chunk_size,
                 exact=exact),
            {name: "token" for name in ("q", "k", "gc", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg")},
            ("token",) * 4, chunk_size,
        )
    return _intra_bwd_dense(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, exact)


def intra_bwd_tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size: int = CHUNK,
                   cu_seqlens: torch.Tensor | None = None, g=None, A_log=None, dt_bias=None, lower_bound=None,
                   exact: bool = False):
    """B7, then B8 on its dg, then (with ``A_log``: the gate in the op) B9: (dq, dk, db, dg,
    dA_log, ddt_bias), the last two None without the gate. ``exact=True``: every part in
    float64 (B9's outputs too, unrounded)."""
    dq, dk, db, dg = intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, exact=exact)
    dy = chunk_cumsum(dg.double() if exact else dg, reverse=True, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if A_log is None:
        return dq, dk, db, dy, None, None
    if exact:
        g, A_log = g.double(), A_log.double()
        dt_bias = dt_bias.double() if dt_bias is not None else None
    return (dq, dk, db) + gate_bwd(g, A_log, dt_bias, dy, lower_bound)


# B9: the gate's backward ------------------------------------------------------------------
def gate_bwd(
    g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dyg: torch.Tensor,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """B9: from da (d loss / d log-decay, fp32) to (dg in g.dtype, dA_log, ddt_bias)."""
    HV, K = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(HV, K)
    dy = dyg.float()
    a = A_log.float().exp().view(HV, 1)
    if lower_bound is None:
        dx = -a * dy * torch.sigmoid(x)
        dA = (dy * (-a * F.softplus(x))).sum(dim=tuple(range(g.dim() - 2)) + (-1,))
    else:
        s = torch.sigmoid(a * x)
        dx = dy * lower_bound * s * (1.0 - s) * a
        dA = (dx * x).sum(dim=tuple(range(g.dim() - 2)) + (-1,))
    dg = dx.to(g.dtype)
    dbias = dg.float().reshape(-1, HV * K).sum(0).to(dt_bias.dtype) if dt_bias is not None else None
    return dg, dA.view_as(A_log).to(A_log.dtype), dbias
