"""KDA's forward and backward as a chain of stages, and the autograd Function over it.

The stage boundaries are fla's (``chunk_kda_fwd`` / ``chunk_kda_bwd`` in fla-core 0.5.2),
so with every stage on ``fla`` the chain launches exactly fla's kernels, in fla's order,
with fla's arguments: its results equal fla's ``chunk_kda`` bit for bit, and the bench
row of that configuration measures what the wrapper alone costs. The Function saves what
fla saves (the normalized q/k with their rstd, v, the raw gate input, the raw and used
beta, A_log, dt_bias, Aqk, Akk_inv, the initial state and -- for a pre-computed gate --
its chunk cumsum), and recomputes the rest in the backward as fla does; with
``disable_recompute`` it also saves gc, w, u, qg, kg, v_new and h and skips B1-B3, as
fla's does. The call's flags reach the stages fla passes them to: ``safe_gate`` the intra
forward and B7, ``lower_bound`` the gate stages. ``state_v_first`` is the caller's layout
of the states that cross the boundary (h0, the final state, dht, dh0, a returned h):
inside, h and dh stay in [K, V], the layout kernel-fun's B6 reads fastest (4.66 ms against
6.96 in [V, K] at prod8192_layer) and fla's scans a little faster too, and each boundary
state is transposed once. A chain forced onto fla alone (``use_impls("fla")``) keeps the
caller's layout throughout, so it is fla's call exactly.

Stage units and the fla functions they stand for:

==========  ============================================================================
F1          l2norm of q and k (``fla.modules.l2norm.l2norm_fwd``)
F1b         beta = scale * sigmoid(beta_raw) (``fla.ops.common.gate.fused_beta_sigmoid``)
F2          gate activation + chunk cumsum (``kda_gate_chunk_cumsum`` / ``chunk_local_cumsum``)
F3-F6       intra-chunk Aqk, Akk, their solve, w/u/kg (``chunk_kda_fwd_intra``)
F1-F6       F1, F2 and F3-F6 as one unit, run in their place when kernel-fun's kernel takes it
F7          the state scan (``chunk_gated_delta_rule_fwd_h``)
F8          the output (``chunk_gla_fwd_o_gk``)
F7-F8       F7 and F8 as one unit, run in their place when kernel-fun's kernel takes it
B1          F2 recomputed (gate in the op only)
B2          w, u, qg, kg recomputed (``recompute_w_u_fwd``)
B3          F7 recomputed
B4          dAqk and dv through Aqk (``chunk_kda_bwd_dAv``)
B5          the reverse scan (``chunk_gated_delta_rule_bwd_dhu``)
B6          the WY backward (``chunk_kda_bwd_wy_dqkg_fused``)
B7          gradients through Aqk/Akk (``chunk_kda_bwd_intra``)
B8          reverse chunk cumsum of dg (``chunk_local_cumsum``)
B9          the gate's backward (``kda_gate_bwd``)
B7-B9       B7, B8 and B9 as one unit, run in their place when kernel-fun's kernel takes it
B10         l2norm backward of dq and dk (``l2norm_bwd``)
B10b        beta sigmoid backward (``fused_beta_sigmoid_bwd``)
==========  ============================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch

from kernel_fun.kda import reference as ref
from kernel_fun.kda.stages import CallRecord, Dispatcher, Stage, register, set_last_record

RCP_LN2 = ref.RCP_LN2


# --------------------------------------------------------------------------------------
# fla's stage functions (imported on first use: fla is the fallback, not an import cost)
# --------------------------------------------------------------------------------------
def _fla_l2norm_fwd(q, k):
    from fla.modules.l2norm import l2norm_fwd

    q, q_rstd = l2norm_fwd(q)
    k, k_rstd = l2norm_fwd(k)
    return q, q_rstd, k, k_rstd


def _fla_beta_sigmoid(beta, scale):
    from fla.ops.common.gate import fused_beta_sigmoid

    return fused_beta_sigmoid(beta, scale=scale)


def _fla_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices):
    if use_gate_in_kernel:
        from fla.ops.kda.gate import kda_gate_chunk_cumsum

        return kda_gate_chunk_cumsum(
            g=g, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=chunk_size,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, lower_bound=lower_bound,
        )
    from fla.ops.utils import chunk_local_cumsum

    return chunk_local_cumsum(
        g=g, scale=RCP_LN2, chunk_size=chunk_size, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
    )


def _fla_intra(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate,
               disable_recompute):
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        chunk_indices=chunk_indices, safe_gate=safe_gate, disable_recompute=disable_recompute,
    )
    return w, u, kg, Aqk, Akk, qg


def _fla_f5(q, k, gc, beta, Aqk, Akkd, scale, chunk_size, cu_seqlens, chunk_indices):
    """fla's F5 (``chunk_kda_fwd_kernel_inter_solve_fused``) on given diagonal blocks (F4's:
    Aqk's, Akkd), launched as ``chunk_kda_fwd_intra`` launches it: fills Aqk's blocks below
    the diagonal in place and returns Akk_inv. Akkd holds the blocks themselves, as fla's F4
    leaves them without ``safe_gate``; with it fla's F4 stores their inverses and its F5 skips
    the substitution (``USE_SAFE_GATE``), so the flag is off here whatever the gate."""
    import triton
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_kernel_inter_solve_fused

    B, T, H, K = k.shape
    HV = gc.shape[2]
    BT, BC = chunk_size, 16
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    Akk = torch.zeros(B, T, HV, BT, device=k.device, dtype=k.dtype)  # fla's F3: the kernel writes the lower part
    chunk_kda_fwd_kernel_inter_solve_fused[(NT, B * HV)](
        q=q, k=k, g=gc, beta=beta, Aqk=Aqk, Akkd=Akkd, Akk=Akk, scale=scale, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, BT=BT, BC=BC, NC=triton.cdiv(BT, BC),
        USE_SAFE_GATE=False,
    )
    return Akk


def _ref_f5(q, k, gc, beta, Aqk, Akkd, scale, chunk_size, cu_seqlens, chunk_indices):
    """``_fla_f5`` in torch (the stand-in where fla's kernels cannot run): the reference's F5
    on the given diagonal blocks; Aqk's blocks below the diagonal written into Aqk."""
    full, Akk = ref.intra_scores(q, k, gc, beta, scale, chunk_size, cu_seqlens, Aqk_diag=Aqk, Akk_diag=Akkd)
    Aqk.copy_(full)
    return Akk


def _fla_h(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens, cu_seqlens_cpu, chunk_indices,
           state_v_first, v=None, beta=None, Akk=None):
    # (v, beta and Akk_inv: B3's contract, for a scan that forms u; fla's reads F6's u)
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    _needs_u(u, "fla's state scan")
    return chunk_gated_delta_rule_fwd_h(
        k=kg, w=w, u=u, gk=gc, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_size=chunk_size,
        state_v_first=state_v_first,
    )


def _fla_o(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    return chunk_gla_fwd_o_gk(
        q=q, v=v_new, g=gc, A=Aqk, h=h, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        chunk_indices=chunk_indices, state_v_first=state_v_first,
    )


def _needs_u(u, who: str) -> None:
    if u is None:  # the chain asks F6 / B2 for u whenever its scan reads it
        raise RuntimeError(f"{who} reads u, and F6 / B2 did not write it")


def _fla_wy(q, k, v, beta, A, gc, chunk_size, cu_seqlens, chunk_indices, want_u=True):
    # (fla's kernel writes u whether or not it is wanted)
    from fla.ops.kda.wy_fast import recompute_w_u_fwd

    return recompute_w_u_fwd(
        q=q, k=k, v=v, beta=beta, A=A, gk=gc, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
    )


def _fla_dav(q, k, v_new, do, Aqk, scale, chunk_size, cu_seqlens, chunk_indices):
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv

    return chunk_kda_bwd_dAv(
        q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        chunk_indices=chunk_indices,
    )


def _fla_dhu(qg, kg, w, gc, h0, dht, do, dv, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    return chunk_gated_delta_rule_bwd_dhu(
        q=qg, k=kg, w=w, gk=gc, h0=h0, dht=dht, do=do, dv=dv, scale=scale, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, chunk_indices=chunk_indices, state_v_first=state_v_first,
    )


def _fla_wy_dqkg(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                 state_v_first):
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    return chunk_kda_bwd_wy_dqkg_fused(
        q=q, k=k, v=v, v_new=v_new, g=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv, scale=scale,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices, state_v_first=state_v_first,
    )


def _fla_intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices,
                   safe_gate):
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    return chunk_kda_bwd_intra(
        q=q, k=k, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_size=chunk_size, safe_gate=safe_gate,
    )


def _fla_reverse_cumsum(dg, chunk_size, cu_seqlens, chunk_indices):
    from fla.ops.utils import chunk_local_cumsum

    return chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


def _fla_gate_bwd(g, A_log, dt_bias, dyg, lower_bound):
    from fla.ops.kda.gate import kda_gate_bwd

    return kda_gate_bwd(g=g, A_log=A_log, dt_bias=dt_bias, dyg=dyg, lower_bound=lower_bound)


def _prep_in_turn(l2norm_fwd, gate, intra):
    """The F1-F6 unit as its three stages in turn (fla's, or the references)."""
    def prep(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, scale,
             safe_gate, disable_recompute, chunk_size, cu_seqlens, chunk_indices):
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd, k, k_rstd = l2norm_fwd(q, k)
        gc = gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices)
        return (q, q_rstd, k, k_rstd, gc) + tuple(intra(q, k, v, gc, beta, scale, chunk_size, cu_seqlens,
                                                        chunk_indices, safe_gate, disable_recompute))
    return prep


def _fla_scan_output(q, qg, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, save_states, cu_seqlens_cpu,
                     state_v_first, chunk_size, cu_seqlens, chunk_indices):
    # (fla's F8 forms q exp2(g) itself: qg, when given, is not read)
    h, v_new, final_state = _fla_h(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens,
                                   cu_seqlens_cpu, chunk_indices, state_v_first)
    o = _fla_o(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first)
    return (o, final_state) + ((h, v_new) if save_states else (None, None))


def _fla_intra_tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound,
                    chunk_size, cu_seqlens, chunk_indices):
    dq, dk, db, dg = _fla_intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens,
                                    chunk_indices, safe_gate)
    dg = _fla_reverse_cumsum(dg, chunk_size, cu_seqlens, chunk_indices)
    if A_log is None:
        return dq, dk, db, dg, None, None
    return (dq, dk, db) + tuple(_fla_gate_bwd(g, A_log, dt_bias, dg, lower_bound))


def _group_sum(dq, dk, H):
    """GVA: dq and dk come at value heads; each q/k head sums its group."""
    if dq.shape[2] == H:
        return dq, dk
    return tuple(d.view(*d.shape[:2], H, -1, d.shape[-1]).sum(dim=3) for d in (dq, dk))


def _fla_l2norm_bwd(q, q_rstd, dq, k, k_rstd, dk):
    from fla.modules.l2norm import l2norm_bwd

    return l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)


def _fla_beta_sigmoid_bwd(beta, db, scale):
    from fla.ops.common.gate import fused_beta_sigmoid_bwd

    return fused_beta_sigmoid_bwd(beta, db, scale=scale)


# --------------------------------------------------------------------------------------
# The reference implementations, with the shared stage signatures
# --------------------------------------------------------------------------------------
def _ref_l2norm_fwd(q, k):
    q, q_rstd = ref.l2norm_fwd(q)
    k, k_rstd = ref.l2norm_fwd(k)
    return q, q_rstd, k, k_rstd


def _ref_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices):
    return ref.gate_cumsum(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens)


def _ref_intra(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate,
               disable_recompute, exact=False):
    # safe_gate changes how fla's kernels form the diagonal blocks (an anchored tensor-core
    # product, valid for a bounded gate), not their values: the reference stays pairwise.
    Aqk, Akk = ref.intra_scores(q, k, gc, beta, scale, chunk_size, cu_seqlens, exact=exact)
    w, u, qg, kg = ref.wy_fwd(k, v, beta, Akk, gc, q if disable_recompute else None, chunk_size, cu_seqlens,
                              exact=exact)
    return w, u, kg, Aqk, Akk, qg


def _ref_h(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens, cu_seqlens_cpu, chunk_indices,
           state_v_first, v=None, beta=None, Akk=None):
    _needs_u(u, "the reference state scan")
    return ref.h_fwd(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens, state_v_first)


def _ref_o(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    return ref.o_fwd(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, state_v_first)


def _ref_scan_output(q, qg, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, save_states, cu_seqlens_cpu,
                     state_v_first, chunk_size, cu_seqlens, chunk_indices, exact=False):
    # (the reference's F8 forms q exp2(g) itself: qg, when given, is not read)
    h, v_new, final_state = ref.h_fwd(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens,
                                      state_v_first, exact=exact)
    o = ref.o_fwd(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, state_v_first, exact=exact)
    return (o, final_state) + ((h, v_new) if save_states else (None, None))


def _ref_wy(q, k, v, beta, A, gc, chunk_size, cu_seqlens, chunk_indices, want_u=True):
    return ref.wy_fwd(k, v, beta, A, gc, q, chunk_size, cu_seqlens)


def _ref_dav(q, k, v_new, do, Aqk, scale, chunk_size, cu_seqlens, chunk_indices):
    return ref.dav_bwd(v_new, do, Aqk, scale, chunk_size, cu_seqlens)


def _ref_dhu(qg, kg, w, gc, h0, dht, do, dv, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    return ref.dhu_bwd(qg, kg, w, gc, h0, dht, do, dv, scale, chunk_size, cu_seqlens, state_v_first)


def _ref_wy_dqkg(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                 state_v_first):
    return ref.wy_dqkg_bwd(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens,
                           state_v_first=state_v_first)


def _ref_intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices,
                   safe_gate):
    return ref.intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens)


def _ref_reverse_cumsum(dg, chunk_size, cu_seqlens, chunk_indices):
    return ref.chunk_cumsum(dg, reverse=True, chunk_size=chunk_size, cu_seqlens=cu_seqlens)


def _ref_intra_tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound,
                    chunk_size, cu_seqlens, chunk_indices):
    return ref.intra_bwd_tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, g=g, A_log=A_log,
                              dt_bias=dt_bias, lower_bound=lower_bound)


def _ref_l2norm_bwd(q, q_rstd, dq, k, k_rstd, dk):
    return ref.l2norm_bwd(q, q_rstd, dq), ref.l2norm_bwd(k, k_rstd, dk)


def _recompute_in_turn(gate, wy):
    """The B1-B2 unit as its two stages in turn (fla's, or the references)."""
    def recompute(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, q, k, v, beta, A, chunk_size, cu_seqlens,
                  chunk_indices):
        gc = gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices)
        return (gc,) + tuple(wy(q, k, v, beta, A, gc, chunk_size, cu_seqlens, chunk_indices))
    return recompute


def _stage(name, covers, title, inputs, outputs, fla, reference):
    register(Stage(name=name, covers=covers, title=title, inputs=tuple(inputs.split()), outputs=outputs,
                   impls={"fla": fla, "reference": reference}))


_C = "chunk_size cu_seqlens chunk_indices"  # every chunked stage's packing inputs
_stage("F1", ("F1",), "l2norm fwd (q, k)", "q k", ("q", "q_rstd", "k", "k_rstd"), _fla_l2norm_fwd, _ref_l2norm_fwd)
_stage("F1b", ("F1b",), "beta sigmoid", "beta scale", ("beta",), _fla_beta_sigmoid, ref.beta_sigmoid_fwd)
_GATE_IN = f"g use_gate_in_kernel A_log dt_bias lower_bound {_C}"
_stage("F2", ("F2",), "gate + chunk cumsum", _GATE_IN, ("gc",), _fla_gate, _ref_gate)
_stage("F3-F6", ("F3", "F4", "F5", "F6"), "intra scores, solve, w/u/kg",
       f"q k v gc beta scale safe_gate disable_recompute {_C}", ("w", "u", "kg", "Aqk", "Akk", "qg"),
       _fla_intra, _ref_intra)
# F1, F2 and F3-F6 as one unit (from the raw q, k and gate): run in their place when
# kernel-fun's kernel for it takes the call; fla's side is fla's three stages in turn.
_fla_prep = _prep_in_turn(_fla_l2norm_fwd, _fla_gate, _fla_intra)
_stage("F1-F6", ("F1", "F2", "F3", "F4", "F5", "F6"), "l2norm, gate + cumsum, intra scores, solve, w/u/kg (one pass)",
       "q k v g beta A_log dt_bias lower_bound use_gate_in_kernel use_qk_l2norm_in_kernel scale safe_gate "
       f"disable_recompute {_C}", ("q", "q_rstd", "k", "k_rstd", "gc", "w", "u", "kg", "Aqk", "Akk", "qg"),
       _fla_prep, _prep_in_turn(_ref_l2norm_fwd, _ref_gate, _ref_intra))
_SCAN_IN = f"kg w u gc initial_state output_final_state cu_seqlens_cpu state_v_first {_C}"
_stage("F7", ("F7",), "state scan", _SCAN_IN, ("h", "v_new", "final_state"), _fla_h, _ref_h)
_stage("F8", ("F8",), "output", f"q v_new gc Aqk h scale state_v_first {_C}", ("o",), _fla_o, _ref_o)
# F7 and F8 as one unit (the scan computes o from the state it carries; h and v_new only when
# saved): run in their place when kernel-fun's kernel for it takes the call; fla's side is
# fla's two stages in turn.
_stage("F7-F8", ("F7", "F8"), "state scan with the output (one pass)",
       f"q qg kg w u gc Aqk scale initial_state output_final_state save_states cu_seqlens_cpu state_v_first {_C}",
       ("o", "final_state", "h", "v_new"), _fla_scan_output, _ref_scan_output)
_stage("B1", ("B1",), "gate + chunk cumsum (recompute)", _GATE_IN, ("gc",), _fla_gate, _ref_gate)
# (u only when B3 reads it: kernel-fun's B3 forms it from v, beta and Akk_inv)
_stage("B2", ("B2",), "w/u/qg/kg (recompute)", f"q k v beta A gc want_u {_C}", ("w", "u", "qg", "kg"), _fla_wy,
       _ref_wy)
# B1 and B2 as one unit (the gate's cumsum and the WY recompute from the raw gate and the
# saved Akk_inv): run in their place when kernel-fun's kernel for it takes the call; fla's
# side is fla's two stages in turn.
_stage("B1-B2", ("B1", "B2"), "gate + chunk cumsum, w/u/qg/kg (recompute, one pass)",
       f"g use_gate_in_kernel A_log dt_bias lower_bound q k v beta A {_C}", ("gc", "w", "u", "qg", "kg"),
       _recompute_in_turn(_fla_gate, _fla_wy), _recompute_in_turn(_ref_gate, _ref_wy))
# (v, beta and Akk_inv for a scan that forms u itself, B2 then writing none)
_stage("B3", ("B3",), "state scan (recompute)", _SCAN_IN + " v beta Akk", ("h", "v_new", "final_state"), _fla_h,
       _ref_h)
_stage("B4", ("B4",), "dAqk, dv through Aqk", f"q k v_new do Aqk scale {_C}", ("dAqk", "dv"), _fla_dav, _ref_dav)
_stage("B5", ("B5",), "reverse state scan", f"qg kg w gc h0 dht do dv scale state_v_first {_C}",
       ("dh", "dh0", "dv2"), _fla_dhu, _ref_dhu)
_stage("B6", ("B6",), "WY backward dq/dk/dv/db/dg/dA", f"q k v v_new gc beta A h do dh dv scale state_v_first {_C}",
       ("dq", "dk", "dv", "db", "dg", "dA"), _fla_wy_dqkg, _ref_wy_dqkg)
_stage("B7", ("B7",), "intra backward", f"q k gc beta dAqk dAkk dq dk db dg safe_gate {_C}",
       ("dq", "dk", "db", "dg"), _fla_intra_bwd, _ref_intra_bwd)
_stage("B8", ("B8",), "reverse chunk cumsum of dg", f"dg {_C}", ("dg",), _fla_reverse_cumsum, _ref_reverse_cumsum)
_stage("B9", ("B9",), "gate backward", "g A_log dt_bias dyg lower_bound", ("dg", "dA_log", "ddt_bias"),
       _fla_gate_bwd, ref.gate_bwd)
# B7, B8 and (with the gate in the op) B9 as one unit: the chain runs it in their place only
# when kernel-fun's kernel for it takes the call (Dispatcher.takes_ours); fla's side is
# fla's three stages in turn.
_stage("B7-B9", ("B7", "B8", "B9"), "intra backward, dg cumsum, gate backward (one pass)",
       f"q k gc beta dAqk dAkk dq dk db dg safe_gate g A_log dt_bias lower_bound {_C}",
       ("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), _fla_intra_tail, _ref_intra_tail)
_stage("B10", ("B10",), "l2norm bwd (q, k)", "q q_rstd dq k k_rstd dk", ("dq", "dk"), _fla_l2norm_bwd,
       _ref_l2norm_bwd)
_stage("B10b", ("B10b",), "beta sigmoid bwd", "beta db scale", ("dbeta",), _fla_beta_sigmoid_bwd, ref.beta_sigmoid_bwd)


# --------------------------------------------------------------------------------------
# The autograd Function
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Options:
    """The non-tensor arguments of one call, after validation."""

    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    lower_bound: float | None
    chunk_size: int
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    state_v_first: bool = False
    safe_gate: bool = False
    disable_recompute: bool = False
    return_intermediate_states: bool = False
    # Called with the record once the call's last phase has run (the backward, or the
    # forward of a call no backward will follow): the "which stages ran what" log line.
    report: Callable[[CallRecord], None] | None = None
    expects_backward: bool = True

    @property
    def beta_scale(self) -> float:
        return 2.0 if self.allow_neg_eigval else 1.0


def _device_scope(t: torch.Tensor):
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _chunk_indices(opts: Options):
    if opts.cu_seqlens is None:
        return None
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(opts.cu_seqlens, opts.chunk_size, cu_seqlens_cpu=opts.cu_seqlens_cpu)


@dataclasses.dataclass
class ForwardResult:
    """What the forward chain produced: the outputs, and what the backward needs."""

    o: torch.Tensor
    final_state: torch.Tensor | None
    h: torch.Tensor | None  # F7's h when return_intermediate_states or disable_recompute keeps it
    saved: dict
    run: Dispatcher  # the dispatcher the backward continues with


# The tensors the Function saves, in order; None where a call's flags make one unneeded.
_SAVED = ("q", "q_rstd", "k", "k_rstd", "v", "gc", "g", "beta_raw", "beta", "A_log", "dt_bias", "Aqk", "Akk",
          "initial_state", "cu_seqlens", "chunk_indices", "w", "u", "qg", "kg", "v_new", "h")


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, opts: Options, record: CallRecord):
        with _device_scope(q):
            res = run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record)
        ctx.save_for_backward(*(res.saved.get(n) for n in _SAVED))
        ctx.opts = opts
        ctx.run = res.run
        return res.o, res.final_state

    @staticmethod
    def backward(ctx, do, dht):
        with _device_scope(do):
            return _backward(ctx, do, dht)


def _swaps_states(opts: Options, run: Dispatcher) -> bool:
    """Whether the call's states cross the boundary transposed: a [V, K] caller whose chain
    keeps [K, V] inside (every chain but the one forced onto fla alone)."""
    return opts.state_v_first and not run.fla_only


def run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts: Options, record: CallRecord) -> ForwardResult:
    """The forward chain F1-F8. Saves what fla saves: with ``disable_recompute`` also gc, w,
    u, qg, kg, v_new and h, so the backward skips B1-B3 as fla's does."""
    run = Dispatcher.for_call(q.device, record)
    common = dict(chunk_size=opts.chunk_size, cu_seqlens=opts.cu_seqlens)
    swap = _swaps_states(opts, run)
    layout = dict(state_v_first=opts.state_v_first and not swap)
    if swap:
        initial_state = ref.swap_state(initial_state)
    q_rstd = k_rstd = None
    beta_raw = beta
    common["chunk_indices"] = chunk_indices = _chunk_indices(opts)
    keep = opts.disable_recompute
    scan = dict(initial_state=initial_state, output_final_state=opts.output_final_state,
                cu_seqlens_cpu=opts.cu_seqlens_cpu, **common, **layout)
    unit = dict(q=q, Aqk=None, scale=opts.scale, save_states=keep or opts.return_intermediate_states, qg=None,
                kg=None, w=None, u=None, gc=None, **scan)
    # kernel-fun's F7-F8 scan reads q exp2(g) as F6 rounds it instead of forming it from q and
    # the cumsum in its chain of chunk steps; F6 writes qg only on request (fla's
    # disable_recompute switch of F3-F6, which changes nothing else there), so it is asked
    # for qg whenever that scan will run
    want_qg = keep or run.wants("F7-F8", "reads_qg", **unit)
    prep = dict(q=q, k=k, v=v, g=g, beta=beta_raw, A_log=A_log, dt_bias=dt_bias, lower_bound=opts.lower_bound,
                use_gate_in_kernel=opts.use_gate_in_kernel, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
                scale=opts.scale, safe_gate=opts.safe_gate, disable_recompute=want_qg, **common)
    if run.takes_ours("F1-F6", **prep):  # (beta's values do not enter the choice)
        if opts.use_beta_sigmoid_in_kernel:
            beta = prep["beta"] = run.run("F1b", "forward", beta=beta_raw, scale=opts.beta_scale)
        q, q_rstd, k, k_rstd, gc, w, u, kg, Aqk, Akk, qg = run.run("F1-F6", "forward", **prep)
    else:
        if opts.use_qk_l2norm_in_kernel:
            q, q_rstd, k, k_rstd = run.run("F1", "forward", q=q, k=k)
        if opts.use_beta_sigmoid_in_kernel:
            beta = run.run("F1b", "forward", beta=beta_raw, scale=opts.beta_scale)
        gc = run.run(
            "F2", "forward", g=g, use_gate_in_kernel=opts.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            lower_bound=opts.lower_bound, **common,
        )
        w, u, kg, Aqk, Akk, qg = run.run(
            "F3-F6", "forward", q=q, k=k, v=v, gc=gc, beta=beta, scale=opts.scale, safe_gate=opts.safe_gate,
            disable_recompute=want_qg, **common,
        )
    del prep
    scan = dict(kg=kg, w=w, u=u, gc=gc, **scan)
    unit = dict(unit, q=q, Aqk=Aqk, qg=qg, **scan)
    o = None
    if run.takes_ours("F7-F8", **unit):
        o, final_state, h, v_new = run.run("F7-F8", "forward", **unit)
    else:
        h, v_new, final_state = run.run("F7", "forward", **scan)
    del unit, scan
    if not keep:  # freed before F8; fla keeps them only with disable_recompute
        w = u = kg = qg = None
    if o is None:
        o = run.run("F8", "forward", q=q, v_new=v_new, gc=gc, Aqk=Aqk, h=h, scale=opts.scale, **common, **layout)
    if not keep:
        v_new = None
        if not opts.return_intermediate_states:
            h = None
    saved = dict(
        q=q, q_rstd=q_rstd, k=k, k_rstd=k_rstd, v=v, g=g, beta_raw=beta_raw, beta=beta, A_log=A_log, dt_bias=dt_bias,
        Aqk=Aqk, Akk=Akk, initial_state=initial_state, cu_seqlens=opts.cu_seqlens, chunk_indices=chunk_indices,
        # fla keeps a pre-computed gate's cumsum, and with disable_recompute every gate's
        gc=gc if (keep or not opts.use_gate_in_kernel) else None,
        w=w, u=u, qg=qg, kg=kg, v_new=v_new, h=h if keep else None,
    )
    if swap:
        final_state = ref.swap_state(final_state)
        h_out = ref.swap_state(h) if opts.return_intermediate_states else h
    else:
        h_out = h
    set_last_record(record)
    if opts.report is not None and not opts.expects_backward:
        opts.report(record)
    return ForwardResult(o=o.type_as(q), final_state=final_state, h=h_out, saved=saved, run=run)


def _backward(ctx, do, dht):
    s = dict(zip(_SAVED, ctx.saved_tensors))
    q, q_rstd, k, k_rstd, v, gc = s["q"], s["q_rstd"], s["k"], s["k_rstd"], s["v"], s["gc"]
    g_input, beta_raw, beta, A_log, dt_bias = s["g"], s["beta_raw"], s["beta"], s["A_log"], s["dt_bias"]
    Aqk, Akk, initial_state, cu_seqlens, chunk_indices = (
        s["Aqk"], s["Akk"], s["initial_state"], s["cu_seqlens"], s["chunk_indices"])
    opts: Options = ctx.opts
    run: Dispatcher = ctx.run
    record = run.record
    do = do.contiguous()
    swap = _swaps_states(opts, run)  # the saved initial state is already in the chain's layout
    dht = (ref.swap_state(dht) if swap else dht.contiguous()) if dht is not None else None
    common = dict(chunk_size=opts.chunk_size, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    layout = dict(state_v_first=opts.state_v_first and not swap)
    H = q.shape[2]

    if opts.disable_recompute:  # fla's mode: the forward kept them, B1-B3 do not run
        w, qg, kg, v_new, h = s["w"], s["qg"], s["kg"], s["v_new"], s["h"]
    else:
        b3 = dict(initial_state=initial_state, output_final_state=False, cu_seqlens_cpu=None, v=v, beta=beta, Akk=Akk,
                  **common, **layout)
        # B2 writes u only where B3 reads it (kernel-fun's B3 forms u, as its F7-F8 does)
        # (asked before B2 makes kg: k stands in for it, the support checks read only K)
        want_u = not run.wants("B3", "forms_u", kg=k, w=None, u=None, gc=None, **b3)
        unit = dict(g=g_input, use_gate_in_kernel=opts.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                    lower_bound=opts.lower_bound, q=q, k=k, v=v, beta=beta, A=Akk, **common)
        if opts.use_gate_in_kernel and run.takes_ours("B1-B2", **unit):
            gc, w, u, qg, kg = run.run("B1-B2", "backward", **unit)
        else:
            if opts.use_gate_in_kernel:
                gc = run.run(
                    "B1", "backward", g=g_input, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                    lower_bound=opts.lower_bound, **common,
                )
            w, u, qg, kg = run.run("B2", "backward", q=q, k=k, v=v, beta=beta, A=Akk, gc=gc, want_u=want_u, **common)
        h, v_new, _ = run.run("B3", "backward", kg=kg, w=w, u=u, gc=gc, **b3)
        del u, b3
    dAqk, dv = run.run("B4", "backward", q=q, k=k, v_new=v_new, do=do, Aqk=Aqk, scale=opts.scale, **common)
    dh, dh0, dv = run.run(
        "B5", "backward", qg=qg, kg=kg, w=w, gc=gc, h0=initial_state, dht=dht, do=do, dv=dv,
        scale=opts.scale, **common, **layout,
    )
    del qg, kg, w
    if swap:
        dh0 = ref.swap_state(dh0)
    dq, dk, dv, db, dg, dAkk = run.run(
        "B6", "backward", q=q, k=k, v=v, v_new=v_new, gc=gc, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv,
        scale=opts.scale, **common, **layout,
    )
    del h, dh, v_new
    intra = dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg,
                 safe_gate=opts.safe_gate, **common)
    gate = (dict(g=g_input, A_log=A_log, dt_bias=dt_bias, lower_bound=opts.lower_bound) if opts.use_gate_in_kernel
            else dict(g=None, A_log=None, dt_bias=None, lower_bound=None))
    dA_log = ddt_bias = None
    if run.takes_ours("B7-B9", **intra, **gate):
        dq, dk, db, dg, dA_log, ddt_bias = run.run("B7-B9", "backward", **intra, **gate)
        del intra, dAqk, dAkk
    else:
        dq, dk, db, dg = run.run("B7", "backward", **intra)
        del intra, dAqk, dAkk
        dg = run.run("B8", "backward", dg=dg, **common)
        if opts.use_gate_in_kernel:
            dg, dA_log, ddt_bias = run.run("B9", "backward", dyg=dg, **gate)
    dq, dk = _group_sum(dq, dk, H)  # GVA: each q/k head sums its value heads' dq, dk
    if opts.use_qk_l2norm_in_kernel:
        dq, dk = run.run("B10", "backward", q=q, q_rstd=q_rstd, dq=dq, k=k, k_rstd=k_rstd, dk=dk)
    if opts.use_beta_sigmoid_in_kernel:
        db = run.run("B10b", "backward", beta=beta_raw, db=db, scale=opts.beta_scale)
    set_last_record(record)
    if opts.report is not None:
        opts.report(record)
    return (dq.to(q), dk.to(k), dv.to(v), dg.to(g_input), db.to(beta_raw), dA_log, ddt_bias, dh0, None, None)
