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

On CUDA the summaries, the all-gather and the folds are fla's own kernels
(``fla/ops/cp/chunk_delta_h.py``, one call each way) on the chain's stage outputs, which are
fla's layout. On an H100 (``benchmarks.cp --world 2 --one-gpu --tokens 8192``, six packed
sequences over two ranks, gate and l2norm in the op) every output and gradient of both ranks
matched the single-process call as closely with them as with the torch summaries (worst
6.6e-3 relative RMS, dbeta, both). The torch summaries (fp32, any device: every chunk's step
formed at once, then composed pairwise as a tree, 64 chunks a block) run on every other
device, and on CUDA with ``KERNEL_FUN_CP_SUMMARIES=torch``.

Handled: fla 0.5.2's and 0.6's contexts, in the contiguous layout (a rank one run of the
tokens) and fla 0.6's zigzag (a rank runs r and 2 world - 1 - r, its local sequences split
at ``front_num_seqs``: ``parts``); the runs' summaries all-gathered in chain order, each run
folded from its own neighbours. ``use_graph`` with a context and a call under
``torch.compile`` go to fla. As fla: no initial state and no final state with a context,
and the context's ``cu_seqlens`` replace the call's.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist

from kernel_fun import _fla as fla
from kernel_fun._runtime import env_choice
from kernel_fun.kda import reference as ref


def context_reason(ctx, initial_state, output_final_state, traced: bool = False) -> str | None:
    """Why an op's call with context ``ctx`` goes to fla, else None: what both ops check
    (``traced``: the call is under torch.compile, export or a dispatch mode)."""
    layout = getattr(ctx, "layout", "contiguous")
    if layout not in ("contiguous", "zigzag"):
        return f"cp_context with layout={layout!r}"
    if getattr(ctx, "group", None) is None or getattr(ctx, "cu_seqlens", None) is None:
        return "cp_context without a process group or cu_seqlens (fla's own check)"
    if initial_state is not None or output_final_state:
        return "cp_context with an initial or final state (fla's own check)"
    if not dist.is_available() or not dist.is_initialized():
        return "cp_context without an initialized torch.distributed"
    if traced:
        return "cp_context under torch.compile, export or a dispatch mode"
    return None


def unsupported(ctx, c, traced: bool = False) -> str | None:
    """Why a ``chunk_kda`` call with context ``ctx`` goes to fla, else None (``c`` the bound
    call, ``traced`` as ``context_reason``'s)."""
    if c.use_graph:
        return "cp_context with use_graph"
    if c.return_intermediate_states:
        return "cp_context with return_intermediate_states"
    return context_reason(ctx, c.initial_state, c.output_final_state, traced)


def all_gather(summary: torch.Tensor, group) -> torch.Tensor:
    """[world, *summary.shape]: every rank's summary (every rank calls it)."""
    world = dist.get_world_size(group)
    out = summary.new_empty(world * summary.shape[0], *summary.shape[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (renamed all_gather_single in later torch)
        dist.all_gather_into_tensor(out, summary.contiguous(), group=group)
    return out.view(world, *summary.shape)


# chunks whose affine steps are formed at once and combined as a tree (memory: a block of
# BLOCK chunks holds [BLOCK, HV, K, K + V] fp32)
BLOCK = 64


def _by_chunk(x: torch.Tensor, bos: int, eos: int, chunk_size: int) -> torch.Tensor:
    """Rows bos..eos of a [1, T, HV, D] tensor as [NT, HV, chunk_size, D] fp32, the last
    chunk zero-padded (a zero row adds nothing to a chunk's products)."""
    seg = x[0, bos:eos].float()
    n = eos - bos
    NT = -(-n // chunk_size)
    seg = torch.nn.functional.pad(seg, (0, 0, 0, 0, 0, NT * chunk_size - n))
    return seg.view(NT, chunk_size, *seg.shape[1:]).transpose(1, 2)


def _decays(gc: torch.Tensor, bos: int, eos: int, chunk_size: int) -> torch.Tensor:
    """[NT, HV, K]: each chunk's decay, exp2 of its last row's cumsum."""
    last = torch.arange(bos + chunk_size - 1, eos + chunk_size - 1, chunk_size, device=gc.device).clamp(max=eos - 1)
    return torch.exp2(gc[0, last].float())


def _compose(M: torch.Tensor, E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The steps s -> M_i s + E_i applied in order i = 0, 1, ... as one (M, E), pairwise as a
    tree ([n, HV, K, K], [n, HV, K, X] -> [HV, K, K], [HV, K, X])."""
    while M.shape[0] > 1:
        if M.shape[0] % 2:  # (the odd one out carried to the next level as it is)
            M_last, E_last = M[-1:], E[-1:]
            M, E = M[:-1], E[:-1]
        else:
            M_last = None
        M_a, M_b, E_a, E_b = M[0::2], M[1::2], E[0::2], E[1::2]
        M, E = M_b @ M_a, M_b @ E_a + E_b
        if M_last is not None:
            M, E = torch.cat([M, M_last]), torch.cat([E, E_last])
    return M[0], E[0]


def _chain(steps, n: int):
    """The composition of n steps, made BLOCK at a time by ``steps(lo, hi)`` (each block's
    tree, then the blocks in order)."""
    total = None
    for lo in range(0, n, BLOCK):
        M, E = _compose(*steps(lo, min(lo + BLOCK, n)))
        total = (M, E) if total is None else (M @ total[0], M @ total[1] + E)
    return total


def forward_summary(kg, w, u, gc, bos: int, eos: int, chunk_size: int) -> torch.Tensor:
    """[HV, K, V + K] fp32: the fragment bos..eos's end state from a zero start and its
    transition, from the chain's kg, w, u and chunk cumsum (log2), [1, T, HV, *]. A chunk
    is S -> (diag(gamma) - kg^T w) S + kg^T u."""
    kg_c, w_c, u_c = (_by_chunk(x, bos, eos, chunk_size) for x in (kg, w, u))
    gamma = _decays(gc, bos, eos, chunk_size)

    def steps(lo, hi):
        kt = kg_c[lo:hi].transpose(-1, -2)
        return torch.diag_embed(gamma[lo:hi]) - kt @ w_c[lo:hi], kt @ u_c[lo:hi]

    M, S = _chain(steps, kg_c.shape[0])
    return torch.cat([S, M], dim=2)


def backward_summary(qg, kg, w, do, dv, gc, scale: float, bos: int, eos: int, chunk_size: int) -> torch.Tensor:
    """[HV, K, V + K] fp32: the fragment bos..eos's reverse scan from a zero dh (the gradient
    of its start state) and its transition transposed, from the chain's qg, kg, w, do, B4's
    dv and the chunk cumsum. A chunk, last first, is dh -> (diag(gamma) - w^T kg) dh +
    scale qg^T do - w^T dv."""
    qg_c, kg_c, w_c, do_c, dv_c = (_by_chunk(x, bos, eos, chunk_size) for x in (qg, kg, w, do, dv))
    gamma = _decays(gc, bos, eos, chunk_size)
    NT = kg_c.shape[0]

    def steps(lo, hi):  # (steps lo..hi of the reversed chunks)
        idx = torch.arange(NT - 1 - lo, NT - 1 - hi, -1, device=kg_c.device)
        wt = w_c[idx].transpose(-1, -2)
        return (torch.diag_embed(gamma[idx]) - wt @ kg_c[idx],
                scale * (qg_c[idx].transpose(-1, -2) @ do_c[idx]) - wt @ dv_c[idx])

    dM, dh = _chain(steps, NT)
    return torch.cat([dh, dM], dim=2)


def _fold(gathered: torch.Tensor, ranks, V: int) -> torch.Tensor:
    """h = M_r h + S_r over ``ranks`` in order, from zero: [HV, K, V] fp32."""
    h = torch.zeros_like(gathered[0, :, :, :V])
    for r in ranks:
        h = gathered[r, :, :, V:] @ h + gathered[r, :, :, :V]
    return h


@dataclasses.dataclass(frozen=True)
class Part:
    """One contiguous run of a rank's tokens in the chain of ranks' runs: its position in
    that chain, its first and last local sequences, whether they continue from or into the
    neighbouring runs, over how many runs, and the first sequence's tokens before it."""

    pos: int
    first: int
    last: int
    is_first: bool
    is_last: bool
    pre: int
    post: int
    pre_tokens: int


def parts(ctx, n_seqs: int) -> tuple[Part, ...]:
    """The rank's runs: one (chain position = rank) in the contiguous layout; two in fla 0.6's
    zigzag (positions rank and 2 world - 1 - rank, the local sequences split at
    ``front_num_seqs``)."""
    rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
    if getattr(ctx, "layout", "contiguous") != "zigzag":
        return (Part(rank, 0, n_seqs - 1, bool(ctx.is_first_rank), bool(ctx.is_last_rank), int(ctx.pre_num_ranks or 0),
                     int(ctx.post_num_ranks or 0), int(getattr(ctx, "pre_num_conv_tokens", 0) or 0)),)
    front = int(ctx.front_num_seqs)
    bounds = ((rank, 0, front - 1), (2 * world - 1 - rank, front, n_seqs - 1))
    return tuple(Part(pos, first, last, bool(ctx.is_first_by_part[i]), bool(ctx.is_last_by_part[i]),
                      int(ctx.pre_num_ranks_by_part[i]), int(ctx.post_num_ranks_by_part[i]),
                      int(ctx.pre_num_conv_tokens_by_part[i]))
                 for i, (pos, first, last) in enumerate(bounds))


def gather_chain(per_part: torch.Tensor, group) -> torch.Tensor:
    """Every run's tensor in chain order, from each rank's [P, ...] (P runs a rank)."""
    g = all_gather(per_part, group)  # [world, P, ...]
    if g.shape[1] == 1:
        return g[:, 0]
    return torch.cat([g[:, 0], g[:, 1].flip(0)])


def fla_summaries(device: torch.device) -> bool:
    """Whether the exchanges run fla's own kernels (``fla/ops/cp/chunk_delta_h.py``: the
    summary, the all-gather and the fold in one call each way) instead of the torch ones: on
    CUDA unless ``KERNEL_FUN_CP_SUMMARIES=torch`` (``benchmarks.cp`` checks and times both).
    The tensors the chain hands them are fla's own stage outputs."""
    return device.type == "cuda" and env_choice("KERNEL_FUN_CP_SUMMARIES", ("fla", "torch"), "fla") == "fla"


def initial_state(ctx, kg, w, u, gc, cu_seqlens_cpu, chunk_size: int, v_first: bool,
                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The forward's exchange: [N, HV, K, V] fp32 (or [N, HV, V, K] with ``v_first``), zeros
    but for each run's first local sequence where it continues an earlier run's."""
    if cu_seqlens is not None and fla_summaries(kg.device):
        return fla.cp_forward_exchange(kg, w, u, gc, chunk_size, v_first, cu_seqlens, ctx)
    cu = cu_seqlens_cpu.tolist()
    N, HV, K, V = len(cu) - 1, kg.shape[2], kg.shape[3], u.shape[3]
    runs = parts(ctx, N)
    zero = torch.zeros(HV, K, V + K, dtype=torch.float32, device=kg.device)
    summaries = torch.stack([zero if r.is_last else forward_summary(kg, w, u, gc, cu[r.last], cu[r.last + 1],
                                                                   chunk_size) for r in runs])
    chain = gather_chain(summaries, ctx.group)
    h0 = torch.zeros(N, HV, K, V, dtype=torch.float32, device=kg.device)
    for r in runs:
        if not r.is_first:
            h0[r.first] = _fold(chain, range(r.pos - r.pre, r.pos), V)
    return ref.swap_state(h0) if v_first else h0


def final_state_grad(ctx, qg, kg, w, do, dv, gc, scale: float, cu_seqlens_cpu, chunk_size: int,
                     v_first: bool, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The backward's exchange: dht [N, HV, K, V] fp32 (or V-first), zeros but for each run's
    last local sequence where it continues into a later run."""
    if cu_seqlens is not None and fla_summaries(kg.device):
        return fla.cp_backward_exchange(qg, kg, w, do, dv, gc, scale, chunk_size, v_first, cu_seqlens, ctx)
    cu = cu_seqlens_cpu.tolist()
    N, HV, K, V = len(cu) - 1, kg.shape[2], kg.shape[3], do.shape[3]
    runs = parts(ctx, N)
    zero = torch.zeros(HV, K, V + K, dtype=torch.float32, device=kg.device)
    summaries = torch.stack([zero if r.is_first else backward_summary(qg, kg, w, do, dv, gc, scale, cu[r.first],
                                                                     cu[r.first + 1], chunk_size) for r in runs])
    chain = gather_chain(summaries, ctx.group)
    dht = torch.zeros(N, HV, K, V, dtype=torch.float32, device=kg.device)
    for r in runs:
        if not r.is_last:
            dht[r.last] = _fold(chain, range(r.pos + r.post, r.pos, -1), V)
    return ref.swap_state(dht) if v_first else dht
