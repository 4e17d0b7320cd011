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
F7          the state scan (``chunk_gated_delta_rule_fwd_h``)
F8          the output (``chunk_gla_fwd_o_gk``)
F7-F8       F7 and F8 as one unit, run in their place when kernel-fun's kernel takes it
B1          F2 recomputed (gate in the op only)
B2          w, u, qg, kg recomputed (``recompute_w_u_fwd``)
B3          F7 recomputed
B4          dAqk and dv through Aqk (``chunk_kda_bwd_dAv``)
B5          the reverse scan (``chunk_gated_delta_rule_bwd_dhu``)
B4-B5       B4 and B5 as one unit (B4's dv formed in the scan), in their place when
            kernel-fun's kernel takes it
B6          the WY backward (``chunk_kda_bwd_wy_dqkg_fused``)
B7          gradients through Aqk/Akk (``chunk_kda_bwd_intra``)
B8          reverse chunk cumsum of dg (``chunk_local_cumsum``)
B9          the gate's backward (``kda_gate_bwd``)
B7-B9       B7, B8 and B9 as one unit, run in their place when kernel-fun's kernel takes it
B6-B9       B6 through B9 as one unit (the gate in the op), in their place when kernel-fun's
            kernel takes it
B10         l2norm backward of dq and dk (``l2norm_bwd``)
B7-B10      B7 through B10 as one unit (the l2norm in the op), in their place when kernel-fun's
            kernel takes it
B10b        beta sigmoid backward (``fused_beta_sigmoid_bwd``)
==========  ============================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable

import torch

from kernel_fun import _fla as fla
from kernel_fun._runtime import first_order_only, log_once
from kernel_fun._triton import chunk_offsets
from kernel_fun.kda import cp
from kernel_fun.kda import reference as ref
from kernel_fun.kda.stages import CallRecord, Dispatcher, Stage, register, set_last_record


# --------------------------------------------------------------------------------------
# The reference implementations, with the shared stage signatures
# --------------------------------------------------------------------------------------
def _ref_l2norm_fwd(q, k):
    q, q_rstd = ref.l2norm_fwd(q)
    k, k_rstd = ref.l2norm_fwd(k)
    return q, q_rstd, k, k_rstd


def _ref_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices):
    return ref.gate_cumsum(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens)


def _ref_intra(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate, disable_recompute):
    # safe_gate changes how fla's kernels form the diagonal blocks (an anchored tensor-core
    # product, valid for a bounded gate), not their values: the reference stays pairwise.
    Aqk, Akk = ref.intra_scores(q, k, gc, beta, scale, chunk_size, cu_seqlens)
    w, u, qg, kg = ref.wy_fwd(k, v, beta, Akk, gc, q if disable_recompute else None, chunk_size, cu_seqlens)
    return w, u, kg, Aqk, Akk, qg


def _ref_h(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens, cu_seqlens_cpu, chunk_indices,
           state_v_first, v=None, beta=None, Akk=None):
    if u is None:  # the chain asks F6 / B2 for u whenever the scan that runs reads it
        raise RuntimeError("the reference state scan reads u, and F6 / B2 did not write it")
    h, v_new, final_state = ref.h_fwd(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens,
                                      state_v_first)
    return ref.pad_chunks(h, chunk_indices), v_new, final_state


def _ref_o(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    return ref.o_fwd(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, state_v_first)


def _ref_scan_output(q, qg, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, save_states, cu_seqlens_cpu,
                     state_v_first, chunk_size, cu_seqlens, chunk_indices):
    # (the reference's F8 forms q exp2(g) itself: qg, when given, is not read)
    h, v_new, final_state = ref.h_fwd(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens,
                                      state_v_first)
    o = ref.o_fwd(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, state_v_first)
    return (o, final_state) + ((ref.pad_chunks(h, chunk_indices), v_new) if save_states else (None, None))


def _ref_wy(q, k, v, beta, A, gc, chunk_size, cu_seqlens, chunk_indices, want_u=True):
    return ref.wy_fwd(k, v, beta, A, gc, q, chunk_size, cu_seqlens)


def _ref_dav(q, k, v_new, do, Aqk, scale, chunk_size, cu_seqlens, chunk_indices):
    return ref.dav_bwd(v_new, do, Aqk, scale, chunk_size, cu_seqlens)


def _ref_dhu(qg, kg, w, gc, h0, dht, do, dv, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    dh, dh0, dv2 = ref.dhu_bwd(qg, kg, w, gc, h0, dht, do, dv, scale, chunk_size, cu_seqlens, state_v_first)
    return ref.pad_chunks(dh, chunk_indices), dh0, dv2


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


def intra_l2_unit(tail, l2norm):
    """The B7-B10 unit as the B7-B9 unit ``tail``, GVA's group sum and B10 ``l2norm`` in turn."""
    def unit(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
             cu_seqlens, chunk_indices, q_rstd, k_rstd):
        dq, dk, db, dg, dA_log, ddt_bias = tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log,
                                                dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices)
        dq, dk = ref.group_sum(dq, dk, q.shape[2])
        return (*l2norm(q, q_rstd, dq, k, k_rstd, dk), db, dg, dA_log, ddt_bias)
    return unit


def dav_dhu_unit(dav, dhu):
    """The B4-B5 unit as B4 ``dav`` then B5 ``dhu``: B4's dv passes between them."""
    def unit(q, k, v_new, do, Aqk, qg, kg, w, gc, h0, dht, scale, state_v_first, chunk_size, cu_seqlens,
             chunk_indices):
        common = dict(chunk_size=chunk_size, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        dAqk, dv = dav(q=q, k=k, v_new=v_new, do=do, Aqk=Aqk, scale=scale, **common)
        dh, dh0, dv2 = dhu(qg=qg, kg=kg, w=w, gc=gc, h0=h0, dht=dht, do=do, dv=dv, scale=scale,
                           state_v_first=state_v_first, **common)
        return dAqk, dh, dh0, dv2
    return unit


def wy_intra_unit(wy, tail):
    """The B6-B9 unit as B6 ``wy`` then the B7-B9 unit ``tail``: dAkk passes between them."""
    def unit(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, state_v_first, chunk_size, cu_seqlens, chunk_indices,
             dAqk, safe_gate, g, A_log, dt_bias, lower_bound):
        dq, dk, dv, db, dg, dAkk = wy(q=q, k=k, v=v, v_new=v_new, gc=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv,
                                      scale=scale, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                                      chunk_indices=chunk_indices, state_v_first=state_v_first)
        dq, dk, db, dg, dA_log, ddt_bias = tail(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                                dg=dg, safe_gate=safe_gate, g=g, A_log=A_log, dt_bias=dt_bias,
                                                lower_bound=lower_bound, chunk_size=chunk_size,
                                                cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        return dq, dk, dv, db, dg, dA_log, ddt_bias
    return unit


def _stage(name, covers, title, inputs, outputs, fla_impl, reference):
    register(Stage(name=name, covers=covers, title=title, inputs=tuple(inputs.split()), outputs=outputs,
                   impls={"fla": fla_impl, "reference": reference}))


_C = "chunk_size cu_seqlens chunk_indices"  # every chunked stage's packing inputs
_stage("F1", ("F1",), "l2norm fwd (q, k)", "q k", ("q", "q_rstd", "k", "k_rstd"), fla.l2norm_fwd, _ref_l2norm_fwd)
_stage("F1b", ("F1b",), "beta sigmoid", "beta scale", ("beta",), fla.beta_sigmoid, ref.beta_sigmoid_fwd)
_GATE_IN = f"g use_gate_in_kernel A_log dt_bias lower_bound {_C}"
_stage("F2", ("F2",), "gate + chunk cumsum", _GATE_IN, ("gc",), fla.gate, _ref_gate)
# (qg only with disable_recompute, which changes nothing else there: what kernel-fun's F7-F8
# reads, "reads_qg")
_stage("F3-F6", ("F3", "F4", "F5", "F6"), "intra scores, solve, w/u/kg",
       f"q k v gc beta scale safe_gate disable_recompute {_C}", ("w", "u", "kg", "Aqk", "Akk", "qg"),
       fla.intra, _ref_intra)
_SCAN_IN = f"kg w u gc initial_state output_final_state cu_seqlens_cpu state_v_first {_C}"
_stage("F7", ("F7",), "state scan", _SCAN_IN, ("h", "v_new", "final_state"), fla.state_scan, _ref_h)
_stage("F8", ("F8",), "output", f"q v_new gc Aqk h scale state_v_first {_C}", ("o",), fla.output, _ref_o)
# F7 and F8 as one unit (the scan computes o from the state it carries; h and v_new only when
# saved): run in their place when kernel-fun's kernel for it takes the call; fla's side is
# fla's two stages in turn.
_stage("F7-F8", ("F7", "F8"), "state scan with the output (one pass)",
       f"q qg kg w u gc Aqk scale initial_state output_final_state save_states cu_seqlens_cpu state_v_first {_C}",
       ("o", "final_state", "h", "v_new"), fla.scan_output, _ref_scan_output)
_stage("B1", ("B1",), "gate + chunk cumsum (recompute)", _GATE_IN, ("gc",), fla.gate, _ref_gate)
# (u only when B3 reads it: kernel-fun's B3 forms it from v, beta and Akk_inv, "forms_u")
_stage("B2", ("B2",), "w/u/qg/kg (recompute)", f"q k v beta A gc want_u {_C}", ("w", "u", "qg", "kg"),
       fla.wy_recompute, _ref_wy)
# (v, beta and Akk_inv for a scan that forms u itself, B2 then writing none)
_stage("B3", ("B3",), "state scan (recompute)", _SCAN_IN + " v beta Akk", ("h", "v_new", "final_state"),
       fla.state_scan, _ref_h)
_stage("B4", ("B4",), "dAqk, dv through Aqk", f"q k v_new do Aqk scale {_C}", ("dAqk", "dv"), fla.dav, _ref_dav)
_stage("B5", ("B5",), "reverse state scan", f"qg kg w gc h0 dht do dv scale state_v_first {_C}",
       ("dh", "dh0", "dv2"), fla.dhu, _ref_dhu)
# B4 and B5 as one unit (B4's dv formed in the reverse scan, never written), in their place only
# when kernel-fun's kernel for it takes the call and no context-parallel exchange reads B4's dv;
# fla's side is fla's two stages in turn.
_stage("B4-B5", ("B4", "B5"), "dAqk and the reverse state scan (B4's dv formed in the scan)",
       f"q k v_new do Aqk qg kg w gc h0 dht scale state_v_first {_C}", ("dAqk", "dh", "dh0", "dv2"),
       dav_dhu_unit(fla.dav, fla.dhu), dav_dhu_unit(_ref_dav, _ref_dhu))
_stage("B6", ("B6",), "WY backward dq/dk/dv/db/dg/dA", f"q k v v_new gc beta A h do dh dv scale state_v_first {_C}",
       ("dq", "dk", "dv", "db", "dg", "dA"), fla.wy_dqkg, _ref_wy_dqkg)
_stage("B7", ("B7",), "intra backward", f"q k gc beta dAqk dAkk dq dk db dg safe_gate {_C}",
       ("dq", "dk", "db", "dg"), fla.intra_bwd, _ref_intra_bwd)
_stage("B8", ("B8",), "reverse chunk cumsum of dg", f"dg {_C}", ("dg",), fla.reverse_cumsum, _ref_reverse_cumsum)
_stage("B9", ("B9",), "gate backward", "g A_log dt_bias dyg lower_bound", ("dg", "dA_log", "ddt_bias"),
       fla.gate_bwd, ref.gate_bwd)
# B7, B8 and (with the gate in the op) B9 as one unit: the chain runs it in their place only
# when kernel-fun's kernel for it takes the call (Dispatcher.takes_ours); fla's side is
# fla's three stages in turn.
_stage("B7-B9", ("B7", "B8", "B9"), "intra backward, dg cumsum, gate backward (one pass)",
       f"q k gc beta dAqk dAkk dq dk db dg safe_gate g A_log dt_bias lower_bound {_C}",
       ("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), fla.intra_bwd_tail, _ref_intra_tail)
# With the gate in the op, B6 through B9 as one unit (dAkk, dq, dk and dg never leave it), in
# their place only when kernel-fun's kernel for it takes the call; fla's side is fla's B6, then
# fla's B7-B9 unit.
_stage("B6-B9", ("B6", "B7", "B8", "B9"), "WY backward, intra backward, dg cumsum, gate backward (one pass)",
       f"q k v v_new gc beta A h do dh dv scale state_v_first {_C} dAqk safe_gate g A_log dt_bias lower_bound",
       ("dq", "dk", "dv", "db", "dg", "dA_log", "ddt_bias"), wy_intra_unit(fla.wy_dqkg, fla.intra_bwd_tail),
       wy_intra_unit(_ref_wy_dqkg, _ref_intra_tail))
_stage("B10", ("B10",), "l2norm bwd (q, k)", "q q_rstd dq k k_rstd dk", ("dq", "dk"), fla.l2norm_bwd,
       _ref_l2norm_bwd)
# With the l2norm in the op, B7 through B10 as one unit, in their place only when kernel-fun's
# kernel for it takes the call; fla's side is fla's B7-B9 unit, GVA's group sum and B10.
_stage("B7-B10", ("B7", "B8", "B9", "B10"), "intra backward, dg cumsum, gate and l2norm backward (one pass)",
       f"q k gc beta dAqk dAkk dq dk db dg safe_gate g A_log dt_bias lower_bound {_C} q_rstd k_rstd",
       ("dq", "dk", "db", "dg", "dA_log", "ddt_bias"), intra_l2_unit(fla.intra_bwd_tail, fla.l2norm_bwd),
       intra_l2_unit(_ref_intra_tail, _ref_l2norm_bwd))
_stage("B10b", ("B10b",), "beta sigmoid bwd", "beta db scale", ("dbeta",), fla.beta_sigmoid_bwd,
       ref.beta_sigmoid_bwd)


# --------------------------------------------------------------------------------------
# The log line: which implementation ran each stage, once per distinct shape and flags
# --------------------------------------------------------------------------------------
# The flags a call's key names, in the order it names them (also the order of the bits of
# the operators' ``flags``: kernel_fun.kda.ops).
FLAG_NAMES = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
              "safe_gate", "disable_recompute", "state_v_first", "output_final_state", "return_intermediate_states",
              "use_graph")


def call_key(q, v, packed: bool, flags: dict, lower_bound, has_initial_state: bool, phases: str) -> str:
    """The shape and flags of a call, as the log names it. A packed batch is named without
    its token and sequence counts, which change from step to step of packed training: one
    line per head layout, not one per batch."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    shape = "packed" if packed else f"B={B} T={T}"
    named = [name for name in FLAG_NAMES if flags[name]]
    if lower_bound is not None:
        named.append(f"lower_bound={lower_bound}")
    if has_initial_state:
        named.append("initial_state")
    return (f"{shape} H={H} HV={HV} K={K} V={V} {str(q.dtype).replace('torch.', '')} on {q.device.type}"
            f"{', ' + ', '.join(named) if named else ''}; {phases}")


def describe_impls(record: CallRecord) -> str:
    """Which implementation ran each stage, runs of stages collapsed in chain order:
    ``"forward F1-F8 fla; backward B1-B5 fla, B6-B9 ours, B10-B10b fla"``."""
    parts = []
    for phase, stages_ in (("forward", record.forward), ("backward", record.backward)):
        if not stages_:
            continue
        runs: list[list] = []
        for name, impl in stages_.items():
            if runs and runs[-1][2] == impl:
                runs[-1][1] = name
            else:
                runs.append([name, name, impl])
        # a run from a unit's start to another's end (B6 then the B7-B9 unit: "B6-B9")
        parts.append(phase + " " + ", ".join(f"{a.split('-')[0]}-{b.split('-')[-1]} {impl}" if a != b else f"{a} {impl}"
                                             for a, b, impl in runs))
    return "; ".join(parts)


def reporter(key: str) -> Callable[[CallRecord], None]:
    """The report an ``Options`` carries: logs the record's stages under ``key``, once."""
    def report(record: CallRecord) -> None:
        log_once(logging.INFO, f"engaged ({key}): {describe_impls(record)}")
    return report


# --------------------------------------------------------------------------------------
# The autograd Function
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False, slots=True)
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
    # fla 0.6's capacity-shaped packed mode: the chunk index has ceil(T / 64) + N - 1 rows,
    # built on the device, the rows past the real chunks spare (sequence -1)
    use_graph: bool = False
    # Called with the record once the call's last phase has run (the backward, or the
    # forward of a call no backward will follow): the "which stages ran what" log line.
    report: Callable[[CallRecord], None] | None = None
    expects_backward: bool = True
    # The call's metadata (shapes, dtypes, devices, flags) when the caller has it as a key:
    # the dispatcher then reuses the stage choices of earlier calls with the same key.
    memo_key: object = None
    # fla's context-parallel context (``kernel_fun.kda.cp``): the initial state of the first
    # local sequence and the dht of the last come from the other ranks' summaries
    cp: object = None

    @property
    def beta_scale(self) -> float:
        return 2.0 if self.allow_neg_eigval else 1.0


_NO_SCOPE = contextlib.nullcontext()


def _device_scope(t: torch.Tensor):
    if t.is_cuda:
        return torch.cuda.device(t.device)
    return _NO_SCOPE


def _chunk_indices(opts: Options, T: int):
    """The packed batch's (sequence, chunk) index, [NT, 2] in cu_seqlens' dtype and device:
    capacity-shaped (``use_graph``: fla's, built on the device at the most chunks T tokens
    in the offsets' sequence slots can make), from the host offsets where the caller gave
    them (no synchronization), else fla's, from the device offsets (one synchronization:
    the chunk count is their data)."""
    if opts.cu_seqlens is None:
        return None
    if opts.use_graph:
        return fla.static_chunk_indices(opts.cu_seqlens, opts.chunk_size, T)
    if opts.cu_seqlens_cpu is not None:
        return host_chunk_indices(opts.cu_seqlens, opts.cu_seqlens_cpu, opts.chunk_size)
    return fla.prepare_chunk_indices(opts.cu_seqlens, opts.chunk_size)


# The host-built chunk index of each live cu_seqlens tensor (the layers of a model share one:
# built once a step, and the backward finds it), dropped when that tensor dies. Only the host
# copy is kept (pinned where the offsets are on a GPU); each call copies it to a device
# tensor of its own, so no device memory outlives the call that made it: under
# ``torch.compile(mode="reduce-overhead")`` every allocation in the CUDA-graph pool must be
# an output or dead when the graph ends, and a device tensor shared between calls would tie
# eager calls to memory a graph writes at every replay. A pinned copy that a call under
# CUDA-graph capture read is kept until the offsets die, whatever happens to them
# meanwhile: the graph's copy reads it at every replay.
_HOST_INDICES: dict[int, "_HostIndex"] = {}
_HOST_INDEX_LIMIT = 64  # live entries, beyond which the oldest holding no captured memory goes


class _HostIndex:
    __slots__ = ("cu", "cu_cpu", "key", "host", "kept")

    def __init__(self, cu_seqlens: torch.Tensor):
        self.cu = weakref.ref(cu_seqlens, functools.partial(_forget_host_index, id(cu_seqlens)))
        self.cu_cpu, self.key, self.host, self.kept = None, None, None, []


def _forget_host_index(key: int, ref) -> None:
    entry = _HOST_INDICES.get(key)
    if entry is not None and entry.cu is ref:
        del _HOST_INDICES[key]


def host_chunk_indices(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fla's chunk index built from the host copy of the offsets, moved to cu_seqlens' device
    by an asynchronous copy from pinned memory: fla's own (``prepare_chunk_indices`` with
    ``cu_seqlens_cpu``) ends in a blocking copy, which waits for the stream. The host index
    is built once while the offsets stay unchanged; the device copy is the call's own."""
    key = (cu_seqlens._version, cu_seqlens_cpu._version, chunk_size)
    entry = _HOST_INDICES.get(id(cu_seqlens))
    if entry is not None and entry.cu() is not cu_seqlens:
        entry = None
    if entry is None or entry.key != key or entry.cu_cpu() is not cu_seqlens_cpu:
        cu = cu_seqlens_cpu.long()
        counts = (cu[1:] - cu[:-1]).clamp(min=0).add(chunk_size - 1).div(chunk_size, rounding_mode="floor")
        seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        first = counts.cumsum(0) - counts  # each sequence's first chunk's row
        host = torch.stack((seq, torch.arange(seq.numel()) - first[seq]), 1).to(cu_seqlens.dtype)
        if cu_seqlens.is_cuda:
            host = host.pin_memory()
        if entry is None:
            entry = _HostIndex(cu_seqlens)
        if id(cu_seqlens) not in _HOST_INDICES and len(_HOST_INDICES) >= _HOST_INDEX_LIMIT:
            for old, e in list(_HOST_INDICES.items()):
                if not e.kept:
                    del _HOST_INDICES[old]
                    break
        entry.cu_cpu, entry.key, entry.host = weakref.ref(cu_seqlens_cpu), key, host
        _HOST_INDICES[id(cu_seqlens)] = entry
    if not cu_seqlens.is_cuda:
        return entry.host.to(cu_seqlens.device)  # (the host index itself on the CPU)
    if torch.cuda.is_current_stream_capturing() and not any(t is entry.host for t in entry.kept):
        entry.kept.append(entry.host)
    return entry.host.to(cu_seqlens.device, non_blocking=True)


@dataclasses.dataclass(slots=True)
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
_NONE_SAVED = dict.fromkeys(_SAVED)
_SAVED_NAMES: dict = {}


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, opts: Options, record: CallRecord):
        if q.is_cuda:
            with torch.cuda.device(q.device):
                res = run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record)
        else:
            res = run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record)
        # only the tensors a call has (unpacking a saved None costs as much as a tensor); which
        # ones follows from the flags, so a call's plan (opts.memo_key) keeps the names
        saved = res.saved
        names = _SAVED_NAMES.get(opts.memo_key) if opts.memo_key is not None else None
        if names is None:
            names = tuple(n for n in _SAVED if saved.get(n) is not None)
            if opts.memo_key is not None:
                if len(_SAVED_NAMES) >= 256:
                    _SAVED_NAMES.pop(next(iter(_SAVED_NAMES)))
                _SAVED_NAMES[opts.memo_key] = names
        ctx.names = names
        ctx.save_for_backward(*(saved[n] for n in names))
        ctx.opts = opts
        ctx.run = res.run
        return res.o, res.final_state

    @staticmethod
    @first_order_only("chunk_kda")
    def backward(ctx, do, dht):
        saved = _NONE_SAVED | dict(zip(ctx.names, ctx.saved_tensors))
        if do.is_cuda:
            with torch.cuda.device(do.device):
                return run_backward(saved, ctx.opts, ctx.run, do, dht)
        return run_backward(saved, ctx.opts, ctx.run, do, dht)


def _swaps_states(opts: Options, run: Dispatcher) -> bool:
    """Whether the call's states cross the boundary transposed: a [V, K] caller whose chain
    keeps [K, V] inside (every chain but the one forced onto fla alone)."""
    return opts.state_v_first and not run.fla_only


def capacity_offsets(opts: Options):
    """A capacity-shaped call's per-slot first chunk rows ([N + 1], the offsets' dtype and
    device, formed there), or None for any other call."""
    if not opts.use_graph or opts.cu_seqlens is None:
        return None
    return chunk_offsets(opts.cu_seqlens, opts.chunk_size).to(opts.cu_seqlens.dtype)


def run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts: Options, record: CallRecord) -> ForwardResult:
    """The forward chain F1-F8 (``_run_forward``); a packed call's stages with fla's tensor
    cache off (``fla.no_tensor_cache``), a capacity-shaped call's told so. The packed chunk
    index is built before, with the cache as the user has it: from device offsets fla's
    builder synchronizes on a miss, and a step's layers share one index. An input that starts
    off a 16-byte boundary is copied first (``_aligned``)."""
    q, k, v, g, beta, A_log, dt_bias, initial_state = (
        _aligned(x) for x in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    chunk_indices = _chunk_indices(opts, q.shape[1])
    if opts.cu_seqlens is None:
        return _run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record, chunk_indices)
    with fla.no_tensor_cache(), fla.capacity_shaped(capacity_offsets(opts)):
        return _run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record, chunk_indices)


def _aligned(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x``, or its copy where it starts off a 16-byte boundary (a caller's view at an odd offset
    into a larger buffer). Every stage may take its tensors as 16-byte aligned (B7-B10's CuTe
    build does), and the dispatcher keeps its choices per metadata, which holds no address."""
    return x if x is None or x.data_ptr() % 16 == 0 else x.clone()


def _run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts: Options, record: CallRecord,
                 chunk_indices) -> ForwardResult:
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
    common["chunk_indices"] = chunk_indices
    if opts.memo_key is not None:  # (a packed batch's chunk count is the one input the key lacks)
        run.remember((opts.memo_key, None if chunk_indices is None else chunk_indices.shape[0]))
    keep = opts.disable_recompute
    scan = dict(initial_state=initial_state, output_final_state=opts.output_final_state,
                cu_seqlens_cpu=opts.cu_seqlens_cpu, **common, **layout)
    save_states = keep or opts.return_intermediate_states
    # kernel-fun's F7-F8 scan reads q exp2(g) as F6 rounds it instead of forming it from q and
    # the cumsum in its chain of chunk steps; F6 writes qg only on request (fla's
    # disable_recompute switch of F3-F6, which changes nothing else there), so it is asked
    # for qg whenever that scan will run (asked before F3-F6 has run: its outputs as None)
    want_qg = keep or run.answer(("wants", "F7-F8", "reads_qg"), lambda scan=scan: run.wants(
        "F7-F8", "reads_qg", q=q, Aqk=None, scale=opts.scale, save_states=save_states, qg=None, kg=None, w=None,
        u=None, gc=None, **scan))
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
    if opts.cp is not None:  # context parallel: the state entering this rank's first sequence
        initial_state = scan["initial_state"] = cp.initial_state(
            opts.cp, kg, w, u, gc, _host_offsets(opts), opts.chunk_size, layout["state_v_first"], opts.cu_seqlens)
        record.notes["CP"] = f"forward exchange ({'fla' if cp.fla_summaries(q.device) else 'torch'})"
    scan = dict(kg=kg, w=w, u=u, gc=gc, **scan)
    unit = dict(q=q, Aqk=Aqk, scale=opts.scale, save_states=save_states, qg=qg, **scan)
    o = None
    if run.answer(("takes", "F7-F8"), lambda unit=unit: run.takes_ours("F7-F8", **unit)):
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
    return ForwardResult(o=_as(o, q), final_state=final_state, h=h_out, saved=saved, run=run)


def run_backward(s: dict, opts: Options, run: Dispatcher, do, dht):
    """The backward chain B1-B10b (``_run_backward``); a packed call's stages with fla's
    tensor cache off, a capacity-shaped call's told so."""
    if opts.cu_seqlens is None:
        return _run_backward(s, opts, run, do, dht)
    with fla.no_tensor_cache(), fla.capacity_shaped(capacity_offsets(opts)):
        return _run_backward(s, opts, run, do, dht)


def _run_backward(s: dict, opts: Options, run: Dispatcher, do, dht):
    """The backward chain B1-B10 from the forward's saved tensors (``_SAVED`` by name, None
    where absent): the ten gradients of ``ChunkKDAFunction.forward``'s inputs."""
    q, q_rstd, k, k_rstd, v, gc = s["q"], s["q_rstd"], s["k"], s["k_rstd"], s["v"], s["gc"]
    g_input, beta_raw, beta, A_log, dt_bias = s["g"], s["beta_raw"], s["beta"], s["A_log"], s["dt_bias"]
    Aqk, Akk, initial_state, cu_seqlens, chunk_indices = (
        s["Aqk"], s["Akk"], s["initial_state"], s["cu_seqlens"], s["chunk_indices"])
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
        want_u = not run.answer(("wants", "B3", "forms_u"),
                                lambda: run.wants("B3", "forms_u", kg=k, w=None, u=None, gc=None, **b3))
        if opts.use_gate_in_kernel:
            gc = run.run(
                "B1", "backward", g=g_input, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                lower_bound=opts.lower_bound, **common,
            )
        w, u, qg, kg = run.run("B2", "backward", q=q, k=k, v=v, beta=beta, A=Akk, gc=gc, want_u=want_u, **common)
        h, v_new, _ = run.run("B3", "backward", kg=kg, w=w, u=u, gc=gc, **b3)
        del u, b3
    b5 = dict(qg=qg, kg=kg, w=w, gc=gc, h0=initial_state, scale=opts.scale, **common, **layout)
    b45 = dict(q=q, k=k, v_new=v_new, do=do, Aqk=Aqk, dht=dht, **b5)
    if opts.cp is None and run.answer(("takes", "B4-B5"), lambda b45=b45: run.takes_ours("B4-B5", **b45)):
        dAqk, dh, dh0, dv = run.run("B4-B5", "backward", **b45)
    else:
        dAqk, dv = run.run("B4", "backward", q=q, k=k, v_new=v_new, do=do, Aqk=Aqk, scale=opts.scale, **common)
        if opts.cp is not None:  # context parallel: the gradient leaving this rank's last sequence
            dht = cp.final_state_grad(opts.cp, qg, kg, w, do, dv, gc, opts.scale, _host_offsets(opts),
                                      opts.chunk_size, layout["state_v_first"], cu_seqlens)
            record.notes["CP"] = (f"forward and backward exchanges "
                                  f"({'fla' if cp.fla_summaries(q.device) else 'torch'})")
        dh, dh0, dv = run.run("B5", "backward", dht=dht, do=do, dv=dv, **b5)
    del b5, b45, qg, kg, w  # (no dict keeps them past here)
    if opts.cp is not None:  # (the initial state was the exchange's, not an input)
        dh0 = None
    if swap and dh0 is not None:
        dh0 = ref.swap_state(dh0)
    wy = dict(q=q, k=k, v=v, v_new=v_new, gc=gc, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv, scale=opts.scale,
              **common, **layout)
    gate = (dict(g=g_input, A_log=A_log, dt_bias=dt_bias, lower_bound=opts.lower_bound) if opts.use_gate_in_kernel
            else dict(g=None, A_log=None, dt_bias=None, lower_bound=None))
    dA_log = ddt_bias = None
    rstd = dict(q_rstd=q_rstd, k_rstd=k_rstd)
    l2_done = False  # (B10 run inside a unit)
    # (the B6-B9 unit only with the gate in the op: its kernel ends with the gate's backward)
    if opts.use_gate_in_kernel and run.answer(
            ("takes", "B6-B9"), lambda: run.takes_ours("B6-B9", **wy, dAqk=dAqk, safe_gate=opts.safe_gate, **gate)):
        dq, dk, dv, db, dg, dA_log, ddt_bias = run.run("B6-B9", "backward", **wy, dAqk=dAqk,
                                                       safe_gate=opts.safe_gate, **gate)
        del wy, h, dh, v_new, dAqk
    else:
        dq, dk, dv, db, dg, dAkk = run.run("B6", "backward", **wy)
        del wy, h, dh, v_new
        intra = dict(q=q, k=k, gc=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg,
                     safe_gate=opts.safe_gate, **common)
        if opts.use_qk_l2norm_in_kernel and run.answer(("takes", "B7-B10"),
                                                       lambda: run.takes_ours("B7-B10", **intra, **gate, **rstd)):
            dq, dk, db, dg, dA_log, ddt_bias = run.run("B7-B10", "backward", **intra, **gate, **rstd)
            l2_done = True
        elif run.answer(("takes", "B7-B9"), lambda: run.takes_ours("B7-B9", **intra, **gate)):
            dq, dk, db, dg, dA_log, ddt_bias = run.run("B7-B9", "backward", **intra, **gate)
        else:
            dq, dk, db, dg = run.run("B7", "backward", **intra)
            dg = run.run("B8", "backward", dg=dg, **common)
            if opts.use_gate_in_kernel:
                dg, dA_log, ddt_bias = run.run("B9", "backward", dyg=dg, **gate)
        del intra, dAqk, dAkk
    if not l2_done:
        dq, dk = ref.group_sum(dq, dk, H)  # GVA: each q/k head sums its value heads' dq, dk
        if opts.use_qk_l2norm_in_kernel:
            dq, dk = run.run("B10", "backward", q=q, q_rstd=q_rstd, dq=dq, k=k, k_rstd=k_rstd, dk=dk)
    if opts.use_beta_sigmoid_in_kernel:
        db = run.run("B10b", "backward", beta=beta_raw, db=db, scale=opts.beta_scale)
    set_last_record(record)
    if opts.report is not None:
        opts.report(record)
    # in the parameters' own shapes (a [HV, K] dt_bias gets a [HV, K] gradient)
    if dA_log is not None and dA_log.shape != A_log.shape:
        dA_log = dA_log.reshape(A_log.shape)
    if ddt_bias is not None and ddt_bias.shape != dt_bias.shape:
        ddt_bias = ddt_bias.reshape(dt_bias.shape)
    return (_as(dq, q), _as(dk, k), _as(dv, v), _as(dg, g_input), _as(db, beta_raw), dA_log, ddt_bias, dh0, None,
            None)


def _host_offsets(opts: Options) -> torch.Tensor:
    return opts.cu_seqlens_cpu if opts.cu_seqlens_cpu is not None else opts.cu_seqlens.cpu()


def _as(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` in ``like``'s dtype (``Tensor.to(other)`` and ``type_as`` cost a few
    microseconds even when they have nothing to do)."""
    return x if x.dtype == like.dtype else x.to(like.dtype)
