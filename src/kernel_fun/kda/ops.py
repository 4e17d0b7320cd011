"""``chunk_kda``'s supported path as two PyTorch operators, for graphs: ``torch.compile``,
fake tensors, export.

``kernel_fun::chunk_kda_fwd`` runs the forward chain and ``kernel_fun::chunk_kda_bwd`` the
backward chain (``kernel_fun.kda.chain``), the second registered as the first's autograd
formula. Packed calls other than fla 0.6's capacity-shaped ones take the same pair under
other names, ``_fwd_packed`` / ``_bwd_packed``, tagged ``cudagraph_unsafe``: their chunk
count is the offsets' data, so CUDA-graph trees run them between their graphs. Everything
that crosses between them is a tensor or a constant: the call's flags as one integer
(``FLAG_NAMES``' bits), ``scale``, ``lower_bound``; the forward returns a fixed list of
tensors (``OUTPUTS``: o, the final state, h, then what the backward reads), an absent one
as a size-0 placeholder, and each operator's fake implementation gives every output's
shape, dtype and strides from the inputs' metadata and the flags alone. Which
implementation runs each stage is decided inside, when the operator runs (the dispatcher
of ``kernel_fun.kda.stages``, as in eager mode): it never changes an output's shape, so the
fake implementation need not know it, and a compiled model follows ``use_impls``, the
stage capture and ``KERNEL_FUN_*`` switches as they stand when it runs.

Eager calls on plain tensors do not go through these operators: the dispatcher overhead of
a Python custom operator with registered autograd is ~85 us a forward and ~150 us a
fwd+bwd on a 2-core CPU (measured beside a bare ``torch.autograd.Function``), more than the
whole chain's own host time; they take ``chain.ChunkKDAFunction`` over the same chain.
``chunk_kda`` takes the operators under ``torch.compile`` / ``torch.export``, under a
dispatch mode (fake tensors, ``make_fx``) and on meta tensors.

The witness: the operators set ``last_record()`` when they run (so after a compiled step
too), log the same once-per-shape line, and the backward continues the forward's record
and forced choices where it is handed the forward's own Aqk tensor (eager and under
aot_eager and inductor, in the tests); otherwise it starts a record of its own. The packed
chunk index is not an output: the backward rebuilds it from the offsets (cached per
offsets tensor, so eager calls pay nothing).
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref

import torch

from kernel_fun._runtime import assert_offsets, first_order_only, host_offsets_error, logger
from kernel_fun.kda import chain
from kernel_fun.kda.chain import FLAG_NAMES, Options, run_backward, run_forward
from kernel_fun.kda.stages import CallRecord, Dispatcher, current_forced, forces_fla_only, set_last_record

# The forward operator's outputs, in order: the call's results, then what the backward reads.
OUTPUTS = ("o", "final_state", "h", "q", "q_rstd", "k", "k_rstd", "beta", "gc", "Aqk", "Akk", "initial_state", "w",
           "u", "qg", "kg", "v_new")
# The backward operator's outputs: the gradients of the forward operator's tensor inputs.
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
# The flag that is not a chunk_kda argument: whether a backward will follow the forward
# (the forward then leaves the log line to it).
_EXPECTS_BACKWARD = len(FLAG_NAMES)


def pack_flags(flags: dict, expects_backward: bool) -> int:
    """The call's boolean flags (``FLAG_NAMES`` by name) and ``expects_backward`` as the
    operators' ``flags`` integer."""
    bits = sum(1 << i for i, name in enumerate(FLAG_NAMES) if flags[name])
    return bits | (int(expects_backward) << _EXPECTS_BACKWARD)


def _unpack(flags: int) -> dict:
    return {name: bool(flags >> i & 1) for i, name in enumerate(FLAG_NAMES)}


def _options(f: dict, flags: int, scale: float, lower_bound, cu_seqlens, cu_seqlens_cpu, q, v, initial_state,
             phases: str | None) -> Options:
    report = None
    if phases is not None and logger.isEnabledFor(logging.INFO):  # the line's text only where it is written
        report = chain.reporter(chain.call_key(q, v, cu_seqlens is not None, f, lower_bound,
                                               initial_state is not None, phases))
    return Options(scale=scale, lower_bound=lower_bound, chunk_size=64, cu_seqlens=cu_seqlens,
                   cu_seqlens_cpu=cu_seqlens_cpu, report=report, expects_backward=bool(flags >> _EXPECTS_BACKWARD & 1),
                   **{name: f[name] for name in FLAG_NAMES})


def check_offsets(cu_seqlens, cu_seqlens_cpu, T: int, capacity: bool = False) -> None:
    """The offsets' checks that read data: on the host where a copy is at hand (a clear
    ValueError), else a device-side assert enqueued before the first kernel. ``capacity``
    (fla 0.6's use_graph): the sequences cover at most T tokens, the rest padding."""
    bad = host_offsets_error(cu_seqlens, cu_seqlens_cpu, T, capacity)
    if bad is not None:
        raise ValueError(f"cu_seqlens {bad[0]}, got {bad[1]}.")
    if cu_seqlens.device.type != "cpu":
        assert_offsets(cu_seqlens, T, "chunk_kda", capacity)


# The forward's dispatcher, by the forward's Aqk: the backward continues it (its record, its
# forced choices, the capture tap) when it is handed that same tensor.
_RUNS: dict[int, tuple[weakref.ref, Dispatcher]] = {}
_RUNS_LOCK = threading.Lock()


def _remember(aqk: torch.Tensor, run: Dispatcher) -> None:
    key = id(aqk)

    def forget(_ref, _key=key):
        with _RUNS_LOCK:
            entry = _RUNS.get(_key)
            if entry is not None and entry[0] is _ref:
                del _RUNS[_key]

    with _RUNS_LOCK:
        _RUNS[key] = (weakref.ref(aqk, forget), run)


def _recall(aqk: torch.Tensor) -> Dispatcher | None:
    with _RUNS_LOCK:
        entry = _RUNS.get(id(aqk))
    if entry is not None and entry[0]() is aqk:
        return entry[1]
    return None


def _swaps(f: dict) -> bool:
    """``chain._swaps_states`` from the flags and the forced choices in force now."""
    return f["state_v_first"] and not forces_fla_only(current_forced())


# --------------------------------------------------------------------------------------
# The forward operator
# --------------------------------------------------------------------------------------
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
    scale: float, lower_bound: float | None, flags: int,
) -> list[torch.Tensor]:
    f = _unpack(flags)
    if cu_seqlens is not None:
        check_offsets(cu_seqlens, cu_seqlens_cpu, q.shape[1], f["use_graph"])
    opts = _options(f, flags, scale, lower_bound, cu_seqlens, cu_seqlens_cpu, q, v, initial_state, "fwd")
    record = CallRecord(engaged=True)
    set_last_record(record)
    with chain._device_scope(q):
        res = run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record)
    s = res.saved
    _remember(s["Aqk"], res.run)
    swapped = _swaps(f) and initial_state is not None
    produced = {
        "o": res.o, "final_state": res.final_state, "h": res.h if (f["return_intermediate_states"] or
                                                                   f["disable_recompute"]) else None,
        "q": s["q"] if f["use_qk_l2norm_in_kernel"] else None, "q_rstd": s["q_rstd"],
        "k": s["k"] if f["use_qk_l2norm_in_kernel"] else None, "k_rstd": s["k_rstd"],
        "beta": s["beta"] if f["use_beta_sigmoid_in_kernel"] else None, "gc": s["gc"],
        "Aqk": s["Aqk"], "Akk": s["Akk"], "initial_state": s["initial_state"] if swapped else None,
        "w": s["w"], "u": s["u"], "qg": s["qg"], "kg": s["kg"], "v_new": s["v_new"],
    }
    return [q.new_empty(0) if produced[n] is None else produced[n] for n in OUTPUTS]  # (a placeholder each:
    # a custom operator's outputs may not alias one another)


# Two registrations of each operator, one body: ``kernel_fun::chunk_kda_fwd`` / ``_bwd`` for
# dense calls and fla 0.6's capacity-shaped packed calls (``use_graph``), whose launches
# depend on tensor shapes alone; ``kernel_fun::chunk_kda_fwd_packed`` / ``_bwd_packed`` for
# the other packed calls, tagged ``cudagraph_unsafe``. Their chunk count is the offsets' data
# (read from ``cu_seqlens_cpu``, or from the device offsets by a synchronization), so a CUDA
# graph could only replay the offsets it was recorded with; inductor's CUDA-graph trees
# (``mode="reduce-overhead"``) run a tagged operator eagerly between their graphs.
_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # (torch 2.9 on; before it the trees skip CPU inputs whole)
_PACKED_TAGS = ({"tags": (_UNSAFE,)} if _UNSAFE is not None
                and "tags" in inspect.signature(torch.library.custom_op).parameters else {})

chunk_kda_fwd = torch.library.custom_op("kernel_fun::chunk_kda_fwd", mutates_args=())(_forward)
chunk_kda_fwd_packed = torch.library.custom_op("kernel_fun::chunk_kda_fwd_packed", mutates_args=(),
                                               **_PACKED_TAGS)(_forward)


def replayable(flags: int, cu_seqlens) -> bool:
    """Whether a call's launches depend on tensor shapes alone (dense, or capacity-shaped
    packed): it takes ``chunk_kda_fwd``; otherwise ``chunk_kda_fwd_packed``."""
    return cu_seqlens is None or _unpack(flags)["use_graph"]


def forward_operator(flags: int, cu_seqlens):
    """The forward operator for a call's flags and offsets (``replayable``)."""
    ops = torch.ops.kernel_fun
    return ops.chunk_kda_fwd if replayable(flags, cu_seqlens) else ops.chunk_kda_fwd_packed


def _state_shape(N, HV, K, V, v_first: bool):
    return (N, HV, V, K) if v_first else (N, HV, K, V)


def _chunk_kda_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                        lower_bound, flags):
    f = _unpack(flags)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    keep = f["disable_recompute"]
    swap = _swaps(f)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    out = {n: q.new_empty(0) for n in OUTPUTS}
    out["o"] = q.new_empty(B, T, HV, V)
    if f["output_final_state"]:
        out["final_state"] = q.new_empty(_state_shape(N, HV, K, V, f["state_v_first"]), dtype=torch.float32)
    if f["return_intermediate_states"] or keep:
        # h's chunk count: ceil(T / 64) a sequence, which for packed sequences only their
        # offsets' values give; capacity-shaped (use_graph), the most T tokens in N slots make
        if cu_seqlens is None:
            NT = (T + 63) // 64
        elif f["use_graph"]:
            NT = (T + 63) // 64 + N - 1
        else:
            NT = torch.library.get_ctx().new_dynamic_size()
        # returned in the caller's layout; saved (disable_recompute) in the chain's
        v_first = f["state_v_first"] and (f["return_intermediate_states"] or not swap)
        out["h"] = k.new_empty(B, NT, HV, *((V, K) if v_first else (K, V)))
    if f["use_qk_l2norm_in_kernel"]:
        out["q"], out["k"] = torch.empty_like(q), torch.empty_like(k)
        out["q_rstd"] = q.new_empty(B, T, H, dtype=torch.float32)
        out["k_rstd"] = k.new_empty(B, T, H, dtype=torch.float32)
    if f["use_beta_sigmoid_in_kernel"]:
        out["beta"] = beta.new_empty(B, T, HV, dtype=torch.float32)
    if keep or not f["use_gate_in_kernel"]:
        out["gc"] = g.new_empty(B, T, HV, K, dtype=torch.float32)
    out["Aqk"] = k.new_empty(B, T, HV, 64)
    out["Akk"] = k.new_empty(B, T, HV, 64)
    if swap and initial_state is not None:
        out["initial_state"] = initial_state.new_empty(_state_shape(N, HV, K, V, False))
    if keep:
        out["w"], out["kg"], out["qg"] = (k.new_empty(B, T, HV, K) for _ in range(3))
        out["u"], out["v_new"] = v.new_empty(B, T, HV, V), v.new_empty(B, T, HV, V)
    return [out[n] for n in OUTPUTS]


chunk_kda_fwd.register_fake(_chunk_kda_fwd_fake)
chunk_kda_fwd_packed.register_fake(_chunk_kda_fwd_fake)


# --------------------------------------------------------------------------------------
# The backward operator
# --------------------------------------------------------------------------------------
def _backward_op(
    do: torch.Tensor, dht: torch.Tensor | None,
    q: torch.Tensor, q_rstd: torch.Tensor | None, k: torch.Tensor, k_rstd: torch.Tensor | None, v: torch.Tensor,
    gc: torch.Tensor | None, g: torch.Tensor, beta_raw: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, Aqk: torch.Tensor, Akk: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
    w: torch.Tensor | None, u: torch.Tensor | None, qg: torch.Tensor | None, kg: torch.Tensor | None,
    v_new: torch.Tensor | None, h: torch.Tensor | None,
    scale: float, lower_bound: float | None, flags: int,
) -> list[torch.Tensor]:
    f = _unpack(flags)
    run = _recall(Aqk)
    if run is None:  # a saved Aqk that is not the forward's own tensor: a record of its own
        run = Dispatcher.for_call(q.device, CallRecord(engaged=True))
    opts = _options(f, flags, scale, lower_bound, cu_seqlens, cu_seqlens_cpu, q, v, initial_state, "fwd+bwd")
    saved = dict(q=q, q_rstd=q_rstd, k=k, k_rstd=k_rstd, v=v, gc=gc, g=g, beta_raw=beta_raw, beta=beta, A_log=A_log,
                 dt_bias=dt_bias, Aqk=Aqk, Akk=Akk, initial_state=initial_state, cu_seqlens=cu_seqlens,
                 chunk_indices=chain._chunk_indices(opts, q.shape[1]), w=w, u=u, qg=qg, kg=kg, v_new=v_new, h=h)
    with chain._device_scope(do):
        dq, dk, dv, dg, db, dA_log, ddt_bias, dh0, _, _ = run_backward(saved, opts, run, do, dht)
    return [dq, dk, dv, dg, db, do.new_empty(0) if dA_log is None else dA_log.to(A_log.dtype),
            do.new_empty(0) if ddt_bias is None else ddt_bias.to(dt_bias.dtype),
            do.new_empty(0) if dh0 is None else dh0]


def _chunk_kda_bwd_fake(do, dht, q, q_rstd, k, k_rstd, v, gc, g, beta_raw, beta, A_log, dt_bias, Aqk, Akk,
                        initial_state, cu_seqlens, cu_seqlens_cpu, w, u, qg, kg, v_new, h, scale, lower_bound, flags):
    f = _unpack(flags)
    has_gate = f["use_gate_in_kernel"]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dh0 = do.new_empty(0)
    if initial_state is not None:  # in the caller's layout
        dh0 = initial_state.new_empty(_state_shape(N, HV, K, V, f["state_v_first"]), dtype=torch.float32)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta_raw),
            torch.empty_like(A_log) if has_gate and A_log is not None else do.new_empty(0),
            torch.empty_like(dt_bias) if has_gate and dt_bias is not None else do.new_empty(0), dh0]


chunk_kda_bwd = torch.library.custom_op("kernel_fun::chunk_kda_bwd", mutates_args=())(_backward_op)
chunk_kda_bwd_packed = torch.library.custom_op("kernel_fun::chunk_kda_bwd_packed", mutates_args=(),
                                               **_PACKED_TAGS)(_backward_op)
chunk_kda_bwd.register_fake(_chunk_kda_bwd_fake)
chunk_kda_bwd_packed.register_fake(_chunk_kda_bwd_fake)


# --------------------------------------------------------------------------------------
# The autograd formula
# --------------------------------------------------------------------------------------
_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "cu_seqlens_cpu")


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, lower_bound, flags = inputs
    f = _unpack(flags)
    out = dict(zip(OUTPUTS, output))
    l2, keep = f["use_qk_l2norm_in_kernel"], f["disable_recompute"]
    swapped = _swaps(f) and initial_state is not None

    def kept(name, when):
        return out[name] if when else None

    ctx.save_for_backward(
        out["q"] if l2 else q, kept("q_rstd", l2), out["k"] if l2 else k, kept("k_rstd", l2), v,
        kept("gc", keep or not f["use_gate_in_kernel"]), g, beta,
        out["beta"] if f["use_beta_sigmoid_in_kernel"] else beta, A_log, dt_bias, out["Aqk"], out["Akk"],
        out["initial_state"] if swapped else initial_state, cu_seqlens, cu_seqlens_cpu,
        *(kept(n, keep) for n in ("w", "u", "qg", "kg", "v_new", "h")),
    )
    ctx.scale, ctx.lower_bound, ctx.flags = scale, lower_bound, flags
    ctx.mark_non_differentiable(*output[2:])  # h and what the backward reads
    ctx.set_materialize_grads(False)


@first_order_only("chunk_kda")
def _backward(ctx, grads):
    do, dht = grads[0], grads[1]  # (the rest are not differentiable)
    (q, q_rstd, k, k_rstd, v, gc, g, beta_raw, beta, A_log, dt_bias, Aqk, Akk, initial_state, cu_seqlens,
     cu_seqlens_cpu, w, u, qg, kg, v_new, h) = ctx.saved_tensors
    f = _unpack(ctx.flags)
    if do is None:  # only the final state reaches the loss
        do = torch.zeros(*v.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    if not f["output_final_state"]:
        dht = None
    op = chunk_kda_bwd if replayable(ctx.flags, cu_seqlens) else chunk_kda_bwd_packed
    grads = op(do, dht, q, q_rstd, k, k_rstd, v, gc, g, beta_raw, beta, A_log, dt_bias, Aqk, Akk, initial_state,
               cu_seqlens, cu_seqlens_cpu, w, u, qg, kg, v_new, h, ctx.scale, ctx.lower_bound, ctx.flags)
    d = dict(zip(GRADIENTS, grads))
    has_gate = f["use_gate_in_kernel"]
    return (d["dq"], d["dk"], d["dv"], d["dg"], d["dbeta"],
            d["dA_log"] if has_gate and A_log is not None else None,
            d["ddt_bias"] if has_gate and dt_bias is not None else None,
            d["dh0"] if initial_state is not None else None,
            None, None, None, None, None)


chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)
chunk_kda_fwd_packed.register_autograd(_backward, setup_context=_setup_context)

