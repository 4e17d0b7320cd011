"""The public ``chunk_kda``: fla's signature and contract, kernel-fun's chain inside.

A call is validated exactly as the installed fla-core (0.5.2 or 0.6.x) validates it (same
exceptions, same messages), plus clearer checks where fla would fail inside a kernel or
silently compute on malformed input (offsets: on the host where a copy is free, else by a
device-side assert enqueued before the first kernel). Then a whitelist gate decides: a call
it knows is supported runs kernel-fun's staged chain (``kernel_fun.kda.chain``) with every
flag the chain carries (``state_v_first``, ``safe_gate``, ``disable_recompute``,
``return_intermediate_states`` included: a stage that cannot take one falls back alone);
anything else -- an argument it does not know, ``chunk_size=32``, context parallel, a
dtype or device outside the box, a call fla 0.6 would give another backend, a switch --
goes to fla's ``chunk_kda`` with the caller's arguments untouched, so the fallback is
bitwise fla (on a CPU, where fla's kernels cannot run, a clear error instead). Inputs of
any strides are made dense once, at the entry, as fla's ``input_guard`` does (and copied
where they start off a 16-byte boundary, in ``chain.run_forward``). Each
distinct decision is logged once on the ``kernel_fun`` logger, and once per distinct shape
and flags one line names the implementation of every stage the call ran.

Validation and the gate read metadata only (the offsets' values are checked apart, every
call), so a supported call's decisions are kept per metadata key (each argument's shape,
dtype, device, requires_grad or scalar value, grad and inference mode, the switches) as a
plan that the next call with that key reuses: ~40 us of host time a forward instead of
~200 (docs/log/host.md). Under ``torch.compile``, ``torch.export``, fake tensors or meta
tensors, dynamo traces the same validation and gate, and the call runs through the
operators of ``kernel_fun.kda.ops``: one graph, no break.

Switches (environment variables, read on every call; a malformed value warns and keeps
the default):

- ``KERNEL_FUN_DISABLE=1``: every op goes to fla.
- ``KERNEL_FUN_KDA_DISABLE=1``: ``chunk_kda`` goes to fla.
- ``KERNEL_FUN_KDA_OPS=1``: eager calls take the PyTorch operators too (``kernel_fun.kda.ops``),
  as calls under ``torch.compile`` always do (the same chain; ~85-150 us more host time).
- ``KERNEL_FUN_KDA_MIN_CTAS=<n>``: calls with fewer than n chunk-heads (chunks x value
  heads: the grid of the chunk-parallel stages) go to fla. Default 0 (no floor).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import numbers
import os
import warnings
from typing import Any

import torch

from kernel_fun import _fla as fla
from kernel_fun._runtime import PLAIN_TENSORS, env_flag, env_int, log_once, not_hopper, wants_operator
from kernel_fun._runtime import logger as _runtime_logger
from kernel_fun.kda import cp
from kernel_fun.kda.chain import FLAG_NAMES, ChunkKDAFunction, Options, call_key, reporter, run_forward
from kernel_fun.kda.ops import check_offsets, forward_operator, pack_flags
from kernel_fun.kda.stages import CallRecord, set_last_record

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KNOWN_KWARGS = ("A_log", "dt_bias", "chunk_size")


def _signature(
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
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):  # pragma: no cover - only its signature is used
    ...


_SIG = inspect.signature(_signature)

# Every parameter of fla 0.5.2's and 0.6.0's chunk_kda, and what the gate does with it.
PARAMETERS = {
    "q": "handled", "k": "handled", "v": "handled", "g": "handled", "beta": "handled",
    "scale": "handled", "initial_state": "handled", "output_final_state": "handled",
    "use_qk_l2norm_in_kernel": "handled", "use_gate_in_kernel": "handled",
    "use_beta_sigmoid_in_kernel": "handled", "allow_neg_eigval": "handled",
    "lower_bound": "handled", "cu_seqlens": "handled", "cu_seqlens_cpu": "handled",
    "A_log": "handled (omitted with lower_bound under fla 0.6: the chain runs it)", "dt_bias": "handled",
    "chunk_size": "handled when 64; 32 falls back",
    "safe_gate": "handled (fla's intra forward and B7 take it)",
    "disable_recompute": "handled (the forward saves what fla saves; B1-B3 skipped)",
    "return_intermediate_states": "handled (inference mode; returns h as fla does)",
    "state_v_first": "handled (h0, final state, dh0 and a returned h in [V, K]; [K, V] inside the chain)",
    "transpose_state_layout": "falls back whenever given (deprecated alias of state_v_first)",
    "cp_context": "handled in fla's contiguous and zigzag layouts (kernel_fun.kda.cp: the states across ranks "
                  "exchanged and folded in torch); falls back with use_graph or under torch.compile",
    "use_graph": "handled under fla 0.6 (capacity-shaped packed indices: the kernels skip the spare rows); "
                 "falls back under 0.5.2 and with disable_recompute",
    "max_num_seqs": "handled with use_graph when it is cu_seqlens' slot count (else fla's error); "
                    "falls back without use_graph",
}


@dataclasses.dataclass
class _Call:
    """A bound call: the caller's arguments with defaults applied."""

    args: dict[str, Any]
    kwargs: dict[str, Any]

    def __getattr__(self, name):
        try:
            return self.args[name]
        except KeyError:
            raise AttributeError(name) from None


_NAMES = tuple(n for n, p in _SIG.parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAME_SET = frozenset(_NAMES)
_DEFAULTS = {n: p.default for n, p in _SIG.parameters.items() if p.default is not inspect.Parameter.empty}


def _bind(args, kwargs) -> _Call:
    """The call's arguments by name, defaults filled in, in the signature's order: by hand
    (``Signature.bind`` took ~40 us of a call's host time); any call it cannot bind cleanly
    (too many positional arguments, one given twice, one missing) goes through
    ``Signature.bind`` for Python's own error."""
    if len(args) <= len(_NAMES) and not any(n in kwargs for n in _NAMES[:len(args)]):
        given = dict(zip(_NAMES, args))
        extra = {}
        for n, value in kwargs.items():
            if n in _NAME_SET:
                given[n] = value
            else:
                extra[n] = value
        if all(n in given or n in _DEFAULTS for n in _NAMES):
            return _Call({n: given[n] if n in given else _DEFAULTS[n] for n in _NAMES}, extra)
    bound = _SIG.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    extra = arguments.pop("kwargs")
    return _Call(arguments, dict(extra))


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device.type}"
    return type(t).__name__


# --------------------------------------------------------------------------------------
# Validation: fla-core 0.5.2's checks in fla's order, then clearer ones of our own
# --------------------------------------------------------------------------------------
def _head_first_warning(c: _Call) -> str | None:
    """As fla's other chunked ops warn (its chunk_kda does not): a dense call with T < H."""
    T, H = c.q.shape[1], c.q.shape[2]
    if c.cu_seqlens is None and T < H:
        return f"chunk_kda: q has T={T} < H={H}; inputs look head-first ([B, H, T, K]), and chunk_kda takes [B, T, H, K]"
    return None


def _validate(c: _Call, stacklevel: int = 4) -> None:
    kw = c.kwargs
    if kw.get("head_first"):  # fla's chunk_kda would take it as an unknown keyword and compute on [B, H, T, K]
        raise ValueError("head_first=True is not supported: chunk_kda takes inputs as [B, T, H, ...] "
                         "(fla removed head_first; its chunk_kda ignores the flag).")
    if "transpose_state_layout" in kw and c.state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    q, k, v, g, beta = c.q, c.k, c.v, c.g, c.beta
    for name in ("q", "k", "v", "g", "beta"):
        t = c.args[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}.")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {list(q.shape)}.")
    if v.dim() != 4:
        raise ValueError(f"v must have shape [B, T, HV, V], got {list(v.shape)}.")
    for name in ("cu_seqlens", "cu_seqlens_cpu"):
        t = c.args[name]
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"`{name}` must be a 1-D int32/int64 torch.Tensor of N+1 offsets, got {type(t).__name__}"
                f" (fla takes a tensor: torch.tensor(offsets, dtype=torch.int32, device=q.device))."
            )
    for name in ("cu_seqlens", "cu_seqlens_cpu"):  # before fla's len(cu_seqlens), which fails on a 0-d tensor
        t = c.args[name]
        if t is not None and (t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or len(t) < 2):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor of N+1 >= 2 offsets, got {_describe(t)}.")
    if c.cu_seqlens_cpu is not None and (c.cu_seqlens is None or len(c.cu_seqlens_cpu) != len(c.cu_seqlens)):
        raise ValueError(f"cu_seqlens_cpu must be cu_seqlens's offsets on the host, got {_describe(c.cu_seqlens_cpu)} "
                         f"beside cu_seqlens {_describe(c.cu_seqlens)}.")
    if c.scale is not None and (isinstance(c.scale, bool) or not isinstance(c.scale, numbers.Real)):
        raise TypeError(f"`scale` must be a Python float or None, got {_describe(c.scale)} "
                        f"(a tensor would reach the kernels as a pointer: pass float(scale)).")
    for name in ("initial_state",):
        t = c.args[name]
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor or None, got {type(t).__name__}.")
    cu_seqlens = c.cu_seqlens
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                f"Please flatten variable-length inputs before processing.",
            )
        if c.initial_state is not None and c.initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(
                f"The number of initial states is expected to be equal to the number of input sequences, "
                f"i.e., {len(cu_seqlens) - 1} rather than {c.initial_state.shape[0]}.",
            )
    if c.initial_state is not None:
        assert c.initial_state.dtype == torch.float32, "initial_state must be in float32."
    if c.use_gate_in_kernel:
        A_log = kw.get("A_log")
        if fla.at_least_0_6():  # fla 0.6: A_log may be omitted when lower_bound is set
            if A_log is None and c.lower_bound is None:
                raise ValueError(
                    "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
        else:
            if "A_log" not in kw:
                raise AssertionError("A_log must be provided when use_gate_in_kernel=True.")
            if A_log is None:
                raise TypeError(f"A_log must be a tensor of HV elements when use_gate_in_kernel=True, got NoneType "
                                f"(fla-core {fla.version()} needs it; fla 0.6 takes None with lower_bound).")
        if A_log is not None and not isinstance(A_log, torch.Tensor):
            raise TypeError(f"A_log must be a tensor of HV elements when use_gate_in_kernel=True, "
                            f"got {_describe(A_log)}.")
        if kw.get("dt_bias") is not None and not isinstance(kw["dt_bias"], torch.Tensor):
            raise TypeError(f"dt_bias must be a tensor of HV*K elements or None, got {_describe(kw['dt_bias'])}.")
    chunk_size = kw.get("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if c.safe_gate and c.use_gate_in_kernel:
        if c.lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (-5 <= c.lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {c.lower_bound}.")
    if c.allow_neg_eigval and not c.use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if c.return_intermediate_states:  # fla asserts these once its forward has run; here before
        assert torch.is_inference_mode_enabled(), "return_intermediate_states is only allowed in inference mode"
        assert c.disable_recompute is False, "return_intermediate_states must be used with disable_recompute=False"
    B, T, H, K = q.shape
    HV = v.shape[2]
    assert q.shape == k.shape, f"q and k must have the same shape, got q={q.shape} vs k={k.shape}"
    assert K <= 256, f"Currently we only support key headdim <=256 for KDA, got {K}."
    if H == 0 or HV == 0:
        raise ValueError(f"the head counts must be positive, got H={H}, HV={HV}.")
    assert HV % H == 0, (
        f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H}), "
        f"but got HV % H = {HV % H}"
    )
    assert g.shape == (B, T, HV, K), f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}"
    assert beta.shape == (B, T, HV), f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}"
    # Checks fla does not make, where it would fail inside a kernel or compute on bad input.
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B, T, HV, V] with B={B}, T={T}, got {list(v.shape)}.")
    if B == 0 or T == 0 or K == 0 or v.shape[3] == 0:
        raise ValueError(f"chunk_kda needs B, T, K and V >= 1, got q {list(q.shape)}, v {list(v.shape)}.")
    warning = _head_first_warning(c)
    if warning is not None:
        warnings.warn(warning, stacklevel=stacklevel)
    for name in ("q", "k", "v", "g", "beta"):
        if not c.args[name].is_floating_point():
            raise TypeError(f"`{name}` must be a floating-point tensor, got {c.args[name].dtype}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}.")
    tensors = {n: c.args[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")}
    tensors.update({n: kw.get(n) for n in ("A_log", "dt_bias")})
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}.")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    V = v.shape[3]
    state_shape, state_dims = ((N, HV, V, K), "[N, HV, V, K] (state_v_first)") if c.state_v_first else \
        ((N, HV, K, V), "[N, HV, K, V]")
    if c.initial_state is not None and tuple(c.initial_state.shape) != state_shape:
        raise ValueError(
            f"initial_state must have shape {state_dims}={list(state_shape)}, got {list(c.initial_state.shape)}."
        )
    if c.use_gate_in_kernel:
        A_log, dt_bias = kw.get("A_log"), kw.get("dt_bias")
        if A_log is not None and A_log.numel() != HV:
            raise ValueError(f"A_log must have HV={HV} elements, got shape {list(A_log.shape)}.")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV*K={HV * K} elements, got shape {list(dt_bias.shape)}.")


# --------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------
def _switch_reason() -> str | None:
    if env_flag("KERNEL_FUN_DISABLE"):
        return "KERNEL_FUN_DISABLE=1"
    if env_flag("KERNEL_FUN_KDA_DISABLE"):
        return "KERNEL_FUN_KDA_DISABLE=1"
    return None


def _capacity_reason(c: _Call) -> str | None:
    """Why a ``use_graph=True`` call (fla 0.6's capacity-shaped packed mode) goes to fla, or
    None: the chain takes it under fla 0.6, whose stages skip the index's spare rows."""
    if not fla.at_least_0_6():
        return f"use_graph=True (fla-core {fla.version()} has no capacity-shaped mode)"
    if c.disable_recompute:
        return "use_graph=True with disable_recompute=True (fla does not support the pair)"
    if c.cu_seqlens is not None and c.max_num_seqs is not None and c.max_num_seqs != c.cu_seqlens.shape[0] - 1:
        return f"max_num_seqs={c.max_num_seqs} is not cu_seqlens' {c.cu_seqlens.shape[0] - 1} sequence slots"
    return None


def _gate(c: _Call) -> str | None:
    """None when kernel-fun's chain takes the call; otherwise the reason it goes to fla."""
    unknown = sorted(set(c.kwargs) - set(_KNOWN_KWARGS) - {"transpose_state_layout"})
    if unknown:
        return f"unknown keyword argument(s) {', '.join(unknown)}"
    if "transpose_state_layout" in c.kwargs:
        return "transpose_state_layout given (deprecated alias of state_v_first; not supported)"
    if c.use_graph:
        why = _capacity_reason(c)
        if why is not None:
            return why
    elif c.max_num_seqs is not None:
        return f"max_num_seqs={c.max_num_seqs} without use_graph"
    chunk_size = c.kwargs.get("chunk_size", 64)
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (only 64 is supported)"
    q = c.q
    if q.dtype not in _DTYPES:
        return f"q dtype {str(q.dtype).replace('torch.', '')} (supported: bfloat16, float16, float32)"
    for name in ("g", "beta"):
        if c.args[name].dtype not in _DTYPES:
            return f"{name} dtype {str(c.args[name].dtype).replace('torch.', '')} (supported: bfloat16, float16, float32)"
    device = q.device
    if device.type == "cuda":
        why = not_hopper(device)
        if why is not None:
            return why
    elif device.type not in ("cpu", "meta"):  # meta: the operators' shapes (kernel_fun.kda.ops)
        return f"device type {device.type} is not supported"
    # (asked only where fla has a backend installed and enabled: under torch.compile that is
    # read once, at trace time, and fla's registry is not traced)
    other = fla.chunk_kda_backend({**c.args, **c.kwargs}) if fla.chunk_kda_backend_possible() else None
    if other is not None:  # FlashKDA's forward is reported ~2x fla's, kernel-fun's 1.2x: not measured faster
        return f"fla gives this call to its {other} backend"
    min_ctas = env_int("KERNEL_FUN_KDA_MIN_CTAS", 0)
    if min_ctas:
        B, T = q.shape[:2]
        HV = c.v.shape[2]
        n_seq = 1 if c.cu_seqlens is None else len(c.cu_seqlens) - 1
        # Without a host copy of cu_seqlens, count the fewest chunks the tokens can make.
        chunks = B * -(-T // 64) if c.cu_seqlens is None else max(-(-T // 64), n_seq)
        if chunks * HV < min_ctas:
            return f"{chunks * HV} chunk-heads < KERNEL_FUN_KDA_MIN_CTAS={min_ctas}"
    return None


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor):
            return t
    return None


def _require_cuda(reason: str, args, kwargs) -> None:
    """A call that goes to fla with its tensors off CUDA gets this error, not a crash deep in
    Triton's launcher ("0 active drivers") from fla's first kernel."""
    t = _first_tensor(args, kwargs)
    if t is not None and t.device.type != "cuda":
        raise RuntimeError(
            f"chunk_kda: this call goes to fla ({reason}), and fla's kernels need a CUDA device; "
            f"the inputs are on {t.device}. kernel-fun runs every other call on the CPU with its "
            f"torch references."
        )


@torch.compiler.disable  # under torch.compile: the graph breaks here, at fla's op, never at ours
def _fallback(reason: str, c: _Call | None, args, kwargs):
    if c is not None and c.cp_context is None and c.cu_seqlens is not None:  # not yet checked where traced
        check_offsets(c.cu_seqlens, c.cu_seqlens_cpu, c.q.shape[1], bool(c.use_graph))
    _require_cuda(reason, args, kwargs)
    log_once(logging.WARNING, f"falling back to fla — {reason}")
    set_last_record(CallRecord(engaged=False, reason=reason))
    return fla.chunk_kda()(*args, **kwargs)


def _decide(args, kwargs, traced: bool = False, stacklevel: int = 4) -> tuple[_Call | None, str | None]:
    """The bound call and the gate's reason to send it to fla (None: the chain takes it),
    from the arguments' metadata; the offsets' data checks too unless ``traced`` (the
    operator makes them when it runs)."""
    switch = _switch_reason()
    if switch is not None:
        return None, switch
    c = _bind(args, kwargs)
    if c.cp_context is not None:  # (its offsets already in the call: chunk_kda put them there)
        why = cp.unsupported(c.cp_context, c, traced)
        if why is not None:
            return c, why
    _validate(c, stacklevel)  # (the warning's stack level: the caller of the caller's caller)
    if c.cu_seqlens is not None and not traced:
        check_offsets(c.cu_seqlens, c.cu_seqlens_cpu, c.q.shape[1], bool(c.use_graph))
    return c, _gate(c)


def is_supported(*args, **kwargs) -> tuple[bool, str | None]:
    """``(True, None)`` when ``chunk_kda`` with these arguments runs kernel-fun's chain,
    else ``(False, reason)``. Takes ``chunk_kda``'s arguments; arguments ``chunk_kda``
    would reject give ``(False, "invalid arguments — <the error>")``."""
    try:
        _, reason = _decide(args, _context_offsets(kwargs))
    except (TypeError, ValueError, AssertionError) as err:
        return False, f"invalid arguments — {err}"
    return reason is None, reason


# --------------------------------------------------------------------------------------
# The call: a plan per call shape, kept for the next call with the same metadata
# --------------------------------------------------------------------------------------
# The tensors a supported call hands the chain, in the order the plan fetches them.
_FETCHED = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens", "cu_seqlens_cpu")
_SCALARS = (bool, int, float, str)
_SWITCHES = ("KERNEL_FUN_DISABLE", "KERNEL_FUN_KDA_DISABLE", "KERNEL_FUN_KDA_MIN_CTAS", "KERNEL_FUN_KDA_OPS")


def _metadata_key(args, kwargs):
    """Everything the validation, the gate and the chain's stage choices read of a call,
    as a key: each argument's metadata (a tensor's shape, dtype, device and requires_grad;
    a scalar's type and value), the keywords' names, grad and inference mode, the switches'
    raw values. None for a call with an argument of another kind."""
    parts = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind in PLAIN_TENSORS:
            parts.append((value.shape, value.dtype, value.device, value.requires_grad))
        elif value is None or kind in _SCALARS:
            parts.append((kind, value))
        else:
            return None
    return (tuple(kwargs), tuple(parts), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *_switch_values())


# os.environ's own mapping, keys and values as the OS holds them (bytes on POSIX): reading it
# costs ~0.1 us a switch, ``os.environ.get`` ~2.5 us (it encodes the key and decodes the
# value). Where it is not there, os.environ.
_ENV = getattr(os.environ, "_data", None)
_ENV_KEYS = tuple(os.environ.encodekey(n) for n in _SWITCHES) if _ENV is not None else None


def _switch_values() -> tuple:
    """The switches' raw values now (a switch changed mid-run is seen at the next call)."""
    if _ENV is not None:
        return tuple(_ENV.get(k) for k in _ENV_KEYS)
    return tuple(os.environ.get(n) for n in _SWITCHES)


@dataclasses.dataclass(eq=False)
class _Plan:
    """A supported call shape: where each tensor sits in the call, and the chain's options."""

    fetch: tuple  # per _FETCHED name: its position in args, its keyword, or None (absent)
    options: dict  # Options' fields but the offsets and the report
    key_text: str  # the log line's key
    packed: bool
    zero_A_log: bool  # fla 0.6's gate without A_log: the chain's with A_log = 0
    warning: str | None  # the head-first layout's warning, given every call
    # a dense call's Options, without and with the log line's report (built at first use)
    dense_options: list = dataclasses.field(default_factory=lambda: [None, None])


_PLANS: dict = {}


def _expects_backward(c: _Call) -> bool:
    """Whether a backward will follow the call's forward: grad mode on, an input needing a
    gradient, and not ``return_intermediate_states`` (inference)."""
    differentiable = [c.args[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    if c.use_gate_in_kernel:
        differentiable += [c.kwargs.get("A_log"), c.kwargs.get("dt_bias")]
    return (not c.return_intermediate_states and torch.is_grad_enabled()
            and any(x is not None and x.requires_grad for x in differentiable))


def _scale(c: _Call) -> float:
    return c.q.shape[3] ** -0.5 if c.scale is None else c.scale


def _plan_of(c: _Call, args, kwargs) -> _Plan:
    positions = {n: i for i, n in enumerate(_NAMES[:len(args)])}
    fetch = tuple(positions[n] if n in positions else (n if n in kwargs else None) for n in _FETCHED)
    q, v = c.q, c.v
    expects_backward = _expects_backward(c)
    options = dict(
        scale=_scale(c),
        lower_bound=c.lower_bound,
        chunk_size=64,
        expects_backward=expects_backward,
        **{n: bool(c.args[n]) for n in FLAG_NAMES},
    )
    key_text = call_key(q, v, c.cu_seqlens is not None, c.args, c.lower_bound, c.initial_state is not None,
                        "fwd+bwd" if expects_backward else "fwd")
    if c.cp_context is not None:  # (a call with a context has no metadata key: its plan is its own)
        options["cp"] = c.cp_context
    plan = _Plan(fetch=fetch, options=options, key_text=key_text, packed=c.cu_seqlens is not None,
                 zero_A_log=bool(c.use_gate_in_kernel) and c.kwargs.get("A_log") is None,
                 warning=_head_first_warning(c))
    # the plan stands for its metadata key: the stage choices of calls with this plan are
    # remembered under it (kernel_fun.kda.stages.Dispatcher.remember)
    options["memo_key"] = plan
    return plan


def _slow_path(args, kwargs, traced: bool, key, given: dict | None = None):
    """Validation and the gate in full: the call's plan, or fla's answer (fla handed the
    caller's keywords, ``given`` where the call's were rewritten)."""
    c, reason = _decide(args, kwargs, traced, stacklevel=5)
    if reason is not None:
        return None, _fallback(reason, c if traced else None, args, kwargs if given is None else given)
    if traced:
        return None, _traced_call(c)
    plan = _plan_of(c, args, kwargs)
    if key is not None and not fla.chunk_kda_backend_possible():  # (else fla's backends are asked every call)
        if len(_PLANS) >= 256:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan, None


def _context_offsets(kwargs: dict) -> dict:
    """fla's contract for a call with ``cp_context``: the context's local offsets replace the
    call's."""
    ctx = kwargs.get("cp_context")
    if ctx is None or getattr(ctx, "cu_seqlens", None) is None:
        return kwargs
    return {**kwargs, "cu_seqlens": getattr(ctx, "cu_seqlens", None), "cu_seqlens_cpu": getattr(ctx, "cu_seqlens_cpu", None)}


def chunk_kda(*args, **kwargs):
    given = None  # (a call with a context goes to fla, if it does, with the caller's own arguments)
    if kwargs.get("cp_context") is not None:
        given, kwargs = kwargs, _context_offsets(kwargs)
    first = args[0] if args and type(args[0]) in PLAIN_TENSORS else _first_tensor(args, kwargs)
    if first is not None and wants_operator(first):  # (first: dynamo traces what follows)
        return _slow_path(args, kwargs, True, None, given)[1]
    key = _metadata_key(args, kwargs)
    # (the key holds the switch's raw value last: unset, it is not read again)
    if first is not None and (key is None or key[-1] is not None) and env_flag("KERNEL_FUN_KDA_OPS"):
        return _slow_path(args, kwargs, True, None, given)[1]
    plan = _PLANS.get(key) if key is not None else None
    fresh = plan is None or fla.chunk_kda_backend_possible()
    if fresh:
        plan, answer = _slow_path(args, kwargs, False, key, given)
        if plan is None:
            return answer
    elif plan.warning is not None:
        warnings.warn(plan.warning, stacklevel=2)
    # Inputs as fla takes them: any strides (a split of a fused projection is a strided
    # view). The chain's stages index dense tensors, so each input is made contiguous once,
    # here, as fla's input_guard does; a dense input passes through untouched.
    q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu = [
        None if f is None else (args[f] if type(f) is int else kwargs[f]) for f in plan.fetch]
    if plan.packed and not fresh:  # the offsets' data checks, every call (_decide's on the slow path)
        check_offsets(cu_seqlens, cu_seqlens_cpu, q.shape[1], plan.options["use_graph"])
    q, k, v, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous()
    initial_state = initial_state.contiguous() if initial_state is not None else None
    o = plan.options
    if o["use_gate_in_kernel"]:
        # (no gradient is returned for the zeros: exp(0) = 1 exactly)
        A_log = A_log.contiguous() if not plan.zero_A_log else torch.zeros(v.shape[2], device=q.device)
        dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    else:
        A_log = dt_bias = None
    # the log line's text built only where the logger would write it (host time)
    logs = _runtime_logger.isEnabledFor(logging.INFO)
    if cu_seqlens is None:  # a dense call's options are its plan's (nothing in them is per call)
        opts = plan.dense_options[logs]
        if opts is None:
            opts = plan.dense_options[logs] = Options(cu_seqlens=None, cu_seqlens_cpu=None,
                                                      report=reporter(plan.key_text) if logs else None, **o)
    else:
        opts = Options(cu_seqlens=cu_seqlens.contiguous(), cu_seqlens_cpu=cu_seqlens_cpu,
                       report=reporter(plan.key_text) if logs else None, **o)
    record = CallRecord(engaged=True)
    set_last_record(record)
    if not opts.expects_backward:  # no autograd graph to record (grad mode off, no input needing a gradient,
        # or return_intermediate_states in inference mode, which returns h)
        res = run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record)
        return (res.o, res.final_state, res.h) if opts.return_intermediate_states else (res.o, res.final_state)
    return ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, record)


def _traced_call(c: _Call):
    """A supported call under torch.compile, export or a dispatch mode: the operators
    (kernel_fun.kda.ops), the chain inside."""
    t = {n: (c.args[n].contiguous() if c.args[n] is not None else None) for n in ("q", "k", "v", "g", "beta",
                                                                                    "initial_state")}
    q, v = t["q"], t["v"]
    A_log = dt_bias = None
    if c.use_gate_in_kernel:
        A_log, dt_bias = c.kwargs.get("A_log"), c.kwargs.get("dt_bias")
        A_log = A_log.contiguous() if A_log is not None else torch.zeros(v.shape[2], device=q.device)
        dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    cu_seqlens = c.cu_seqlens.contiguous() if c.cu_seqlens is not None else None
    flags = pack_flags({n: c.args[n] for n in FLAG_NAMES}, _expects_backward(c))
    out = forward_operator(flags, cu_seqlens)(q, t["k"], v, t["g"], t["beta"], A_log, dt_bias, t["initial_state"],
                                              cu_seqlens, c.cu_seqlens_cpu, float(_scale(c)),
                                              None if c.lower_bound is None else float(c.lower_bound), flags)
    final_state = out[1] if c.output_final_state else None
    return (out[0], final_state, out[2]) if c.return_intermediate_states else (out[0], final_state)


chunk_kda.__signature__ = _SIG
chunk_kda.__doc__ = """Chunked Kimi Delta Attention: ``fla.ops.kda.chunk_kda``'s contract, kernel-fun's kernels.

Same signature, defaults, validation errors and return value as the installed fla-core's
``chunk_kda`` (0.5.2 or 0.6.x; ``docs/errors.md`` shows where the two differ); also accepts
fla 0.6's ``use_graph`` and ``max_num_seqs`` under 0.5.2 (a call that sets them goes to fla).
Calls outside the supported box go to fla with the same arguments, and so do calls fla 0.6
would give another backend (FlashKDA, when installed: its forward is reported ~2x fla's,
kernel-fun's is 1.2x).

Causal to the bit on kernel-fun's paths: o at token t and a prefix's final state do not
depend on any input after t, finite or not (a non-finite value is selected away from the
tokens before it, never multiplied by zero); on a GPU the chain's F1-F6 are fla's kernels,
not held to it. A log-decay of -inf is a full reset (outputs on both sides finite) on the
CPU path. The backward is not itself differentiable: a double backward raises.

Args:
    q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` with HV a multiple of H (GVA).
    g: ``[B, T, HV, K]``: the log-decay, or with ``use_gate_in_kernel=True`` the raw gate
        input of ``-exp(A_log) * softplus(g + dt_bias)`` (``lower_bound`` L:
        ``L * sigmoid(exp(A_log) * (g + dt_bias))``); pass ``A_log`` ``[HV]`` and optional
        ``dt_bias`` ``[HV * K]`` as keywords (under fla 0.6, ``A_log`` may be omitted with
        ``lower_bound``: ``L * sigmoid(g + dt_bias)``).
    beta: ``[B, T, HV]`` (raw logits with ``use_beta_sigmoid_in_kernel``; doubled range
        with ``allow_neg_eigval``).
    scale: defaults to ``K ** -0.5``.
    initial_state: float32 ``[N, HV, K, V]`` (N = B, or the number of packed sequences);
        ``[N, HV, V, K]`` with ``state_v_first``.
    output_final_state: also return the final state (float32, the initial state's layout).
    safe_gate: fla's tensor-core form of the diagonal blocks, valid for a gate bounded by
        ``lower_bound`` (required with ``use_gate_in_kernel``, in [-5, 0)).
    disable_recompute: save the forward's intermediates instead of recomputing them.
    return_intermediate_states: in ``torch.inference_mode()`` only; also returns h
        ``[B, NT, HV, K, V]`` (``[..., V, K]`` with ``state_v_first``).
    state_v_first: every state-shaped tensor in the V-first ``[V, K]`` layout.
    use_qk_l2norm_in_kernel: l2-normalize q and k rows inside the op.
    cu_seqlens / cu_seqlens_cpu: ``[N + 1]`` offsets of packed sequences (B must be 1).
    chunk_size (keyword): 64 (32 goes to fla).

Returns:
    ``(o [B, T, HV, V] in q.dtype, final_state or None)``; with
    ``return_intermediate_states``, ``(o, final_state, h)``.
"""
