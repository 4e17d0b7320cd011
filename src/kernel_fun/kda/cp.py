"""Context parallel for ``chunk_kda``: fla's contract (``cp_context`` from
``fla.ops.cp.build_cp_context``) through kernel-fun's chain.

Each rank holds a contiguous slice of the packed tokens; a sequence that crosses a rank
boundary is split into fragments, one a rank, each chunked from its own start (the context's
local ``cu_seqlens``). A delta-rule chunk step is affine in the state, S' = M_c S + E_c with
M_c = diag(gamma_c) - kg_c^T w_c and E_c = kg_c^T u_c (gamma_c the chunk's decay, exp2 of its
last cumsum row), so a fragment is summarised by its end state from a zero start, S_ext, and
its transition M = M_last ... M_first ([HV, K, V + K] in fp32: S_ext | M). Forward, after the
intra stages (F3-F6): every rank whose last sequence continues on the next rank summarises
that fragment, one all-gather shares the summaries, and a rank whose first sequence began
on an earlier rank folds its predecessors' oldest first (h = M_r h + S_ext_r) into that
sequence's initial state before the state scan. Backward, after dAv (B4): the mirror image,
each rank whose first sequence began earlier summarises that fragment's reverse scan from a
zero dh (dh_ext, and M^T as the product of the transposed steps), and a rank whose last
sequence continues folds its successors' farthest first into that sequence's dht before the
reverse scan (B5). So every rank's outputs and gradients are complete locally, as fla's.

The summaries here are torch, per chunk (exact in fp32, any device): a fragment of n chunks
costs n small batched products a head. fla's kernels for the same (``fla/ops/cp/``) are
the GPU's candidate, for measurement (issue 52's run).

Handled: fla 0.5.2's and 0.6's contexts in the contiguous layout. fla 0.6's zigzag layout,
``use_graph`` with a context, and a call under ``torch.compile`` go to fla. As fla: no
initial state and no final state with a context, and the context's ``cu_seqlens`` replace
the call's.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from kernel_fun.kda import reference as ref


def unsupported(ctx, c) -> str | None:
    """Why a call with context ``ctx`` goes to fla, else None (``c`` the bound call)."""
    layout = getattr(ctx, "layout", "contiguous")
    if layout != "contiguous":
        return f"cp_context with layout={layout!r} (kernel-fun takes the contiguous layout)"
    if getattr(ctx, "group", None) is None or getattr(ctx, "cu_seqlens", None) is None:
        return "cp_context without a process group or cu_seqlens (fla's own check)"
    if c.initial_state is not None or c.output_final_state:
        return "cp_context with an initial or final state (fla's own check)"
    if c.use_graph:
        return "cp_context with use_graph"
    if c.return_intermediate_states:
        return "cp_context with return_intermediate_states"
    if not dist.is_available() or not dist.is_initialized():
        return "cp_context without an initialized torch.distributed"
    return None


def all_gather(summary: torch.Tensor, group) -> torch.Tensor:
    """[world, *summary.shape]: every rank's summary (every rank calls it)."""
    world = dist.get_world_size(group)
    out = summary.new_empty(world * summary.shape[0], *summary.shape[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (renamed all_gather_single in later torch)
        dist.all_gather_into_tensor(out, summary.contiguous(), group=group)
    return out.view(world, *summary.shape)


def _chunks(bos: int, eos: int, chunk_size: int):
    return [(s, min(s + chunk_size, eos)) for s in range(bos, eos, chunk_size)]


def _heads(x: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Rows s..e of a [1, T, HV, D] tensor as [HV, e - s, D] in fp32."""
    return x[0, s:e].transpose(0, 1).float()


def forward_summary(kg, w, u, gc, bos: int, eos: int, chunk_size: int) -> torch.Tensor:
    """[HV, K, V + K] fp32: the fragment bos..eos's end state from a zero start and its
    transition, from the chain's kg, w, u and chunk cumsum (log2), [1, T, HV, *]."""
    HV, K, V = kg.shape[2], kg.shape[3], u.shape[3]
    S = torch.zeros(HV, K, V, dtype=torch.float32, device=kg.device)
    M = torch.eye(K, dtype=torch.float32, device=kg.device).repeat(HV, 1, 1)
    for s, e in _chunks(bos, eos, chunk_size):
        kg_c, w_c, u_c = _heads(kg, s, e), _heads(w, s, e), _heads(u, s, e)
        gamma = torch.exp2(gc[0, e - 1].float())[..., None]  # [HV, K, 1]
        kt = kg_c.transpose(1, 2)
        S = gamma * S + kt @ (u_c - w_c @ S)
        M = gamma * M - kt @ (w_c @ M)
    return torch.cat([S, M], dim=2)


def backward_summary(qg, kg, w, do, dv, gc, scale: float, bos: int, eos: int, chunk_size: int) -> torch.Tensor:
    """[HV, K, V + K] fp32: the fragment bos..eos's reverse scan from a zero dh (the gradient
    of its start state) and its transition transposed, from the chain's qg, kg, w, do, B4's
    dv and the chunk cumsum."""
    HV, K, V = kg.shape[2], kg.shape[3], do.shape[3]
    dh = torch.zeros(HV, K, V, dtype=torch.float32, device=kg.device)
    dM = torch.eye(K, dtype=torch.float32, device=kg.device).repeat(HV, 1, 1)
    for s, e in reversed(_chunks(bos, eos, chunk_size)):
        qg_c, kg_c, w_c = _heads(qg, s, e), _heads(kg, s, e), _heads(w, s, e)
        do_c, dv_c = _heads(do, s, e), _heads(dv, s, e)
        gamma = torch.exp2(gc[0, e - 1].float())[..., None]
        dv2 = kg_c @ dh + dv_c
        wt = w_c.transpose(1, 2)
        dh = gamma * dh + scale * (qg_c.transpose(1, 2) @ do_c) - wt @ dv2
        dM = gamma * dM - wt @ (kg_c @ dM)
    return torch.cat([dh, dM], dim=2)


def _fold(gathered: torch.Tensor, ranks, V: int) -> torch.Tensor:
    """h = M_r h + S_r over ``ranks`` in order, from zero: [HV, K, V] fp32."""
    h = torch.zeros_like(gathered[0, :, :, :V])
    for r in ranks:
        h = gathered[r, :, :, V:] @ h + gathered[r, :, :, :V]
    return h


def _bounds(cu_seqlens_cpu: torch.Tensor):
    cu = [int(x) for x in cu_seqlens_cpu.tolist()]
    return cu


def initial_state(ctx, kg, w, u, gc, cu_seqlens_cpu, chunk_size: int, v_first: bool) -> torch.Tensor:
    """The forward's exchange: [N, HV, K, V] fp32 (or [N, HV, V, K] with ``v_first``), zeros
    but for the first local sequence where it continues an earlier rank's."""
    cu = _bounds(cu_seqlens_cpu)
    N, HV, K, V = len(cu) - 1, kg.shape[2], kg.shape[3], u.shape[3]
    group = ctx.group
    rank = dist.get_rank(group)
    if ctx.is_last_rank:
        summary = torch.zeros(HV, K, V + K, dtype=torch.float32, device=kg.device)
    else:
        summary = forward_summary(kg, w, u, gc, cu[-2], cu[-1], chunk_size)
    gathered = all_gather(summary, group)
    h0 = torch.zeros(N, HV, K, V, dtype=torch.float32, device=kg.device)
    if not ctx.is_first_rank:
        h0[0] = _fold(gathered, range(rank - ctx.pre_num_ranks, rank), V)
    return ref.swap_state(h0) if v_first else h0


def final_state_grad(ctx, qg, kg, w, do, dv, gc, scale: float, cu_seqlens_cpu, chunk_size: int,
                     v_first: bool) -> torch.Tensor:
    """The backward's exchange: dht [N, HV, K, V] fp32 (or V-first), zeros but for the last
    local sequence where it continues on a later rank."""
    cu = _bounds(cu_seqlens_cpu)
    N, HV, K, V = len(cu) - 1, kg.shape[2], kg.shape[3], do.shape[3]
    group = ctx.group
    rank = dist.get_rank(group)
    if ctx.is_first_rank:
        summary = torch.zeros(HV, K, V + K, dtype=torch.float32, device=kg.device)
    else:
        summary = backward_summary(qg, kg, w, do, dv, gc, scale, cu[0], cu[1], chunk_size)
    gathered = all_gather(summary, group)
    dht = torch.zeros(N, HV, K, V, dtype=torch.float32, device=kg.device)
    if not ctx.is_last_rank:
        dht[-1] = _fold(gathered, range(rank + ctx.post_num_ranks, rank, -1), V)
    return ref.swap_state(dht) if v_first else dht
