"""The public ``causal_conv1d``: fla's signature and contract (the same in fla-core 0.5.2 and
0.6), kernel-fun's kernels.

A call is validated first (clear errors where fla would crash inside a kernel, index
garbage or silently ignore a flag: a missing weight, shapes that disagree, an activation
other than None / silu / swish, packed sequences with B > 1, offsets that do not rise from 0
to x's T -- checked on the host where a copy is free, else by a device-side assert enqueued
before the first kernel, and the kernels clamp every sequence to x's rows besides). Then a
whitelist gate: a call it knows runs kernel-fun's kernels (``cconv/kernels.py``) on Hopper,
or the torch reference on a CPU; anything else -- another backend, context parallel, an
argument it does not know, W > 4, a dtype or device outside the box, fla 0.6's Gluon
convolution switched on (``FLA_CONV_GLUON=1``), a switch -- goes to fla's ``causal_conv1d``
with the caller's arguments untouched, logged once.

Switches: ``KERNEL_FUN_DISABLE=1`` or ``KERNEL_FUN_CCONV_DISABLE=1`` send every call to fla;
``KERNEL_FUN_CCONV_OPS=1`` routes eager calls through the operators below.

Under ``torch.compile`` / ``torch.export``, a dispatch mode (fake tensors) or on meta
tensors, the kernels' path runs as the PyTorch operators ``kernel_fun::causal_conv1d_fwd``
and ``_bwd`` (autograd registered, fake implementations from shapes): one graph, no break;
eager calls keep ``CausalConv1dFunction``, which costs less host time. The offsets' data
checks run inside the operators, when they run.

The final state's gradient is the derivative of the forward (the float64 reference's
autograd agrees). fla's backward differs: 0.6 drops the gradient of the final state's
slot 0 (x[eos - W] of each sequence of at least W tokens); 0.5.2 drops it too, places the
gradient on the wrong tokens for a sequence shorter than W - 1, and never carries it into
the initial state's gradient where the final state holds initial-state slots (both run
through the interpreter beside this one in tests/test_cconv.py). With a final-state
gradient of zero (the usual case: the state feeds decoding, not the loss) all three agree.
The backward is not itself differentiable: a double backward raises.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch

from kernel_fun import _fla as fla
from kernel_fun._runtime import (assert_offsets, env_flag, first_order_only, host_offsets_error, log_once,
                                 not_hopper, wants_operator)
from kernel_fun._triton import interpreting
from kernel_fun.cconv import cp as conv_cp
from kernel_fun.cconv import kernels as K
from kernel_fun.cconv.reference import conv_reference
from kernel_fun.kda.cp import context_reason

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_last = {"route": None}
_ACTIVATIONS = (None, "silu", "swish")


def last_route() -> str | None:
    """Where the last ``causal_conv1d`` call ran in this process: "kernels", "reference",
    or "fla: <reason>" (the launch witness tests and benches read)."""
    return _last["route"]


def check_host_offsets(cu_seqlens, cu_seqlens_cpu, T: int) -> None:
    """Offsets checked where the host copy is free (a device one would sync); on the device
    by an assert enqueued before the first kernel (``segments``)."""
    bad = host_offsets_error(cu_seqlens, cu_seqlens_cpu, T)
    if bad is not None:
        why, bounds = bad
        raise ValueError(f"causal_conv1d: cu_seqlens {why} (x has T={T} tokens); got {bounds[:8]}"
                         f"{'...' if len(bounds) > 8 else ''}")


def _validate(x, weight, bias, residual, initial_state, activation, cu_seqlens, cu_seqlens_cpu=None, traced=False):
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise ValueError(f"causal_conv1d: x must be [B, T, D] (or [B, T, ...] with D the product of the rest); "
                         f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if weight is None:
        raise ValueError("causal_conv1d: weight [D, W] is required")
    if weight.dim() != 2:
        raise ValueError(f"causal_conv1d: weight must be [D, W]; got {tuple(weight.shape)}")
    D, W = weight.shape
    if math.prod(x.shape[2:]) != D:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)} has {math.prod(x.shape[2:])} channels a token, "
                         f"the weight {tuple(weight.shape)} has {D}")
    if W < 1:
        raise ValueError("causal_conv1d: the weight's width W must be at least 1")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"causal_conv1d: bias must be [{D}]; got {tuple(bias.shape)}")
    if residual is not None and residual.numel() != x.numel():
        raise ValueError(f"causal_conv1d: residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be None, 'silu' or 'swish'; got {activation!r} "
                         "(fla's kernels would apply none)")
    for name, t in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"causal_conv1d: {name} must be a 1-D int32/int64 torch.Tensor of N+1 offsets, got "
                            f"{type(t).__name__} (torch.tensor(offsets, dtype=torch.int32, device=x.device))")
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"causal_conv1d: with cu_seqlens x must be [1, total tokens, D]; got batch {x.shape[0]}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"causal_conv1d: cu_seqlens must be a 1-D int32/int64 tensor of N + 1 >= 2 offsets; "
                             f"got {tuple(cu_seqlens.shape)} {str(cu_seqlens.dtype).replace('torch.', '')}")
        if cu_seqlens.device != x.device:
            raise ValueError(f"causal_conv1d: cu_seqlens is on {cu_seqlens.device}, x on {x.device}")
        if cu_seqlens_cpu is not None and (cu_seqlens_cpu.dim() != 1 or cu_seqlens_cpu.numel() != cu_seqlens.numel()
                                           or cu_seqlens_cpu.is_floating_point() or cu_seqlens_cpu.is_complex()):
            raise ValueError(f"causal_conv1d: cu_seqlens_cpu must be cu_seqlens's {cu_seqlens.numel()} integer "
                             f"offsets on the host; got {tuple(cu_seqlens_cpu.shape)} {cu_seqlens_cpu.dtype}")
        if not traced:  # (traced: the operator checks them when it runs)
            check_host_offsets(cu_seqlens, cu_seqlens_cpu, x.shape[1])
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, D, W):
        raise ValueError(f"causal_conv1d: initial_state must be [N, D, W] = [{N}, {D}, {W}]; "
                         f"got {tuple(initial_state.shape)}")


def _gate(x, weight, bias, residual, initial_state, backend, cp_context, kwargs) -> str | None:
    if env_flag("KERNEL_FUN_DISABLE"):
        return "KERNEL_FUN_DISABLE=1"
    if env_flag("KERNEL_FUN_CCONV_DISABLE"):
        return "KERNEL_FUN_CCONV_DISABLE=1"
    if cp_context is not None:  # (causal_conv1d takes a supported context before the gate)
        why = context_reason(cp_context, initial_state, False)
        if why is not None:
            return why
    if backend != "triton":
        return f"backend={backend!r} (kernel-fun replaces the 'triton' backend)"
    if kwargs:
        return f"unknown keyword argument(s) {', '.join(sorted(kwargs))}"
    other = fla.causal_conv1d_backend()
    if other is not None:  # switched on by the user; kernel-fun's is not measured against it
        return f"fla's {other} convolution is switched on"
    W = weight.shape[1]
    if W > K.W_MAX:
        return f"W={W} > {K.W_MAX}"
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual),
                    ("initial_state", initial_state)):
        if t is not None and t.dtype not in _DTYPES:
            return f"{name} dtype {str(t.dtype).replace('torch.', '')} (supported: bfloat16, float16, float32)"
    if x.device.type == "cuda":
        why = not_hopper(x.device)
        if why is not None:
            return why
    elif x.device.type not in ("cpu", "meta"):  # meta: the operators' shapes
        return f"device type {x.device.type} is not supported"
    return None


@torch.compiler.disable  # under torch.compile: the graph breaks here, at fla's op, never at ours
def _fallback(reason: str, traced: bool, x, **kwargs):
    if traced and kwargs["cu_seqlens"] is not None and kwargs["cp_context"] is None:  # not yet checked
        check_host_offsets(kwargs["cu_seqlens"], kwargs["cu_seqlens_cpu"], x.shape[1])
    _require_cuda(x, reason)
    log_once(logging.WARNING, f"causal_conv1d: falling back to fla — {reason}")
    _last["route"] = f"fla: {reason}"
    return fla.causal_conv1d()(x, **kwargs)


def is_supported(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                 activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                 cp_context=None, **kwargs) -> tuple[bool, str | None]:
    """``(True, None)`` when ``causal_conv1d`` with these arguments runs kernel-fun's
    kernels (or its reference on a CPU), else ``(False, reason)``."""
    try:
        _validate(x, weight, bias, residual, initial_state, activation, cu_seqlens, cu_seqlens_cpu)
    except (TypeError, ValueError) as err:
        return False, f"invalid arguments — {err}"
    reason = _gate(x, weight, bias, residual, initial_state, backend, cp_context, kwargs)
    return reason is None, reason


def _require_cuda(x, reason: str) -> None:
    """A call that goes to fla with x off CUDA gets this error, not a crash in Triton's
    launcher from fla's first kernel."""
    if isinstance(x, torch.Tensor) and x.device.type != "cuda":
        raise RuntimeError(f"causal_conv1d: this call goes to fla ({reason}), and fla's kernels need a CUDA device; "
                           f"the inputs are on {x.device}")


def uses_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or interpreting() or x.device.type == "meta"


def segments(cu_seqlens, total, device):
    """(segment index, segment length): None for dense batches, else the packed sequences'
    segments at the pinned length, indexed on the device (``cu_seqlens_cpu`` and
    ``chunk_indices`` are not needed)."""
    TS = K.DEFAULT_CONFIG["TS"]
    if cu_seqlens is None:
        return None, TS
    key = (id(cu_seqlens), cu_seqlens._version, total, TS, str(device))
    hit = _SEGMENTS.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        return hit[1], TS
    if cu_seqlens.device.type != "cpu":
        assert_offsets(cu_seqlens, total, "causal_conv1d")
    seg = K.segment_index(cu_seqlens.to(device), total, TS)
    if len(_SEGMENTS) >= 8:
        _SEGMENTS.pop(next(iter(_SEGMENTS)))
    _SEGMENTS[key] = (weakref.ref(cu_seqlens), seg)
    return seg, TS


# The last few segment lists, each kept while its offsets tensor lives and is unmodified (the
# same object at the same version: torch bumps ``_version`` on every in-place write). A
# layer's q, k and v convolutions share one cu_seqlens, so its list is built once a step, not
# three times (about a dozen small launches on the host each).
_SEGMENTS: dict = {}


def _final_state(x3, initial_state, cu_seqlens, W):
    """[N, D, W] in x's dtype: each sequence's last W rows of (initial state, x), from x's
    rows by index (no copy of x, any strides, no host copy of the offsets)."""
    B, T, D = x3.shape
    dev = x3.device
    c = torch.arange(W, device=dev)
    if cu_seqlens is None:
        lens = torch.full((B,), T, device=dev, dtype=torch.long)
        rel = lens[:, None] - W + c[None, :]  # [N, W]: the row within the sequence
        rows = x3[torch.arange(B, device=dev)[:, None], rel.clamp(min=0)] if T else x3.new_zeros(B, W, D)  # [N, W, D]
    else:
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        lens = cu[1:] - cu[:-1]
        rel = lens[:, None] - W + c[None, :]
        rows = x3[0, (cu[:-1, None] + rel).clamp(min=0)] if T else x3.new_zeros(len(lens), W, D)
    out = torch.where((rel >= 0)[:, None, :], rows.transpose(1, 2), torch.zeros((), dtype=x3.dtype, device=dev))
    if initial_state is not None:
        slot = (lens[:, None] + c[None, :]).clamp(max=W - 1)  # the initial state's slot where rel < 0
        init = initial_state.gather(2, slot[:, None, :].expand(-1, D, -1)).to(x3.dtype)
        out = torch.where((rel < 0)[:, None, :], init, out)
    return out.contiguous()


class CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x3, weight, bias, residual, initial_state, output_final_state, silu, cu_seqlens, seg_index, TS,
                config=None):
        ctx.config = dict(config or K.DEFAULT_CONFIG)  # the backward launches with the forward's config
        y = K.conv_fwd(x3, weight, bias, residual, initial_state, silu, cu_seqlens, seg_index, TS, ctx.config)
        final = _final_state(x3, initial_state, cu_seqlens, weight.shape[1]) if output_final_state else None
        ctx.save_for_backward(x3, weight, bias, initial_state, cu_seqlens, seg_index)
        ctx.silu, ctx.TS, ctx.has_residual = silu, TS, residual is not None
        return y, final

    @staticmethod
    @first_order_only("causal_conv1d")
    def backward(ctx, dy, dht):
        x3, weight, bias, initial_state, cu_seqlens, seg_index = ctx.saved_tensors
        dx, dw, db, dh0 = K.conv_bwd(x3, weight, bias, initial_state, dy.contiguous(),
                                     dht.contiguous() if dht is not None else None, ctx.silu, cu_seqlens, seg_index,
                                     ctx.TS, want_dh0=ctx.needs_input_grad[4], config=ctx.config)
        dres = dy if ctx.has_residual and ctx.needs_input_grad[3] else None
        return dx, dw, db, dres, dh0, None, None, None, None, None, None


# --------------------------------------------------------------------------------------
# The kernels' path as PyTorch operators (under torch.compile, export, fake tensors)
# --------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_fun::causal_conv1d_fwd", mutates_args=())
def causal_conv1d_fwd(x3: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor | None, initial_state: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
                      output_final_state: bool, silu: bool) -> list[torch.Tensor]:
    """``CausalConv1dFunction.forward`` as an operator: [y, the final state] (a size-0
    placeholder without ``output_final_state``)."""
    if cu_seqlens is not None:
        check_host_offsets(cu_seqlens, cu_seqlens_cpu, x3.shape[1])
    seg_index, TS = segments(cu_seqlens, x3.shape[1], x3.device)
    _last["route"] = "kernels"
    y = K.conv_fwd(x3, weight, bias, residual, initial_state, silu, cu_seqlens, seg_index, TS)
    final = _final_state(x3, initial_state, cu_seqlens, weight.shape[1]) if output_final_state else x3.new_empty(0)
    return [y, final]


@causal_conv1d_fwd.register_fake
def _causal_conv1d_fwd_fake(x3, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu, output_final_state,
                            silu):
    B, T, D = x3.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = x3.new_empty(N, D, weight.shape[1]) if output_final_state else x3.new_empty(0)
    return [x3.new_empty(B, T, D), final]


@torch.library.custom_op("kernel_fun::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd(dy: torch.Tensor, dht: torch.Tensor | None, x3: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                      silu: bool, want_dh0: bool) -> list[torch.Tensor]:
    """``CausalConv1dFunction.backward`` as an operator: [dx, dw, db, dh0] (size-0
    placeholders for an absent bias or initial state)."""
    seg_index, TS = segments(cu_seqlens, x3.shape[1], x3.device)
    dx, dw, db, dh0 = K.conv_bwd(x3, weight, bias, initial_state, dy.contiguous(),
                                 dht.contiguous() if dht is not None else None, silu, cu_seqlens, seg_index, TS,
                                 want_dh0=want_dh0)
    return [dx, dw, db if db is not None else dy.new_empty(0), dh0 if dh0 is not None else dy.new_empty(0)]


@causal_conv1d_bwd.register_fake
def _causal_conv1d_bwd_fake(dy, dht, x3, weight, bias, initial_state, cu_seqlens, silu, want_dh0):
    B, T, D = x3.shape
    return [x3.new_empty(B, T, D), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else dy.new_empty(0),
            torch.empty_like(initial_state) if initial_state is not None and want_dh0 else dy.new_empty(0)]


def _conv_setup_context(ctx, inputs, output):
    x3, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu, output_final_state, silu = inputs
    ctx.save_for_backward(x3, weight, bias, initial_state, cu_seqlens)
    ctx.silu, ctx.has_residual, ctx.output_final_state = silu, residual is not None, output_final_state
    ctx.set_materialize_grads(False)


@first_order_only("causal_conv1d")
def _conv_backward(ctx, grads):
    dy, dht = grads
    x3, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
    if dy is None:  # only the final state reaches the loss
        dy = torch.zeros(x3.shape, dtype=x3.dtype, device=x3.device)
    want_dh0 = initial_state is not None and ctx.needs_input_grad[4]
    dx, dw, db, dh0 = causal_conv1d_bwd(dy, dht if ctx.output_final_state else None, x3, weight, bias,
                                        initial_state, cu_seqlens, ctx.silu, want_dh0)
    dres = dy if ctx.has_residual and ctx.needs_input_grad[3] else None
    return (dx, dw, db if bias is not None else None, dres, dh0 if want_dh0 else None, None, None, None, None)


causal_conv1d_fwd.register_autograd(_conv_backward, setup_context=_conv_setup_context)


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    """A depthwise causal convolution over the tokens (fla's ``causal_conv1d``).

    Args:
        x: ``[B, T, D]`` (or ``[B, T, ...]``, D the product of the rest), any strides.
        weight: ``[D, W]``. bias: ``[D]`` or None. residual: x's shape, added after the
            activation, or None.
        initial_state: ``[N, D, W]`` (N = B, or the number of packed sequences): slot W - 1
            the token before the first, slot 0 unused.
        output_final_state: also return the ``[N, D, W]`` state after the last token.
        activation: None, ``'silu'`` or ``'swish'``.
        backend: ``'triton'`` (kernel-fun's kernels); ``'cuda'`` and ``'mix'`` go to fla.
        cu_seqlens / cu_seqlens_cpu: ``[N + 1]`` offsets of packed sequences (B must be 1);
            the convolution never crosses a sequence boundary; the segments are indexed
            on the device from ``cu_seqlens``. chunk_indices: fla's 64-token chunk
            index (accepted; not needed).
        cp_context: fla's context-parallel context (``kernel_fun.cconv.cp``: the contiguous
            layout through kernel-fun's convolution, the halo exchanged; else fla).

    Returns:
        ``(y in x's shape and dtype, final_state in x's dtype or None)``.
    """
    traced = isinstance(x, torch.Tensor) and (wants_operator(x) or env_flag("KERNEL_FUN_CCONV_OPS"))
    if cp_context is not None and weight is not None:
        why = context_reason(cp_context, initial_state, output_final_state, traced)
        if why is None:  # the rank before's last tokens as the first sequence's initial state
            x3 = x if x.dim() == 3 else x.reshape(x.shape[0], x.shape[1], weight.shape[0])
            h0 = conv_cp.halo_state(x3, weight.shape[1], cp_context)
            out = causal_conv1d(x, weight, bias, residual, h0, False, activation, backend, cp_context.cu_seqlens,
                                getattr(cp_context, "cu_seqlens_cpu", None), None, None, **kwargs)
            _last["route"] = f"{_last['route']}, the halo exchanged (context parallel)"
            return out
        return _fallback(why, traced, x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                         output_final_state=output_final_state, activation=activation, backend=backend,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                         cp_context=cp_context, **kwargs)
    if cp_context is None:
        _validate(x, weight, bias, residual, initial_state, activation, cu_seqlens, cu_seqlens_cpu, traced)
    reason = _gate(x, weight, bias, residual, initial_state, backend, cp_context, kwargs) if weight is not None else \
        "no weight"
    if reason is not None:
        return _fallback(reason, traced, x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                         output_final_state=output_final_state, activation=activation, backend=backend,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                         cp_context=cp_context, **kwargs)
    silu = activation in ("silu", "swish")
    if not uses_kernels(x):
        log_once(logging.INFO, "causal_conv1d: on the CPU through kernel-fun's torch reference")
        _last["route"] = "reference"
        return conv_reference(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens)
    shape = x.shape
    D, W = weight.shape
    x3 = x if x.dim() == 3 else x.reshape(shape[0], shape[1], D)
    if traced:  # torch.compile, export, fake tensors: the operators
        y, final = torch.ops.kernel_fun.causal_conv1d_fwd(
            x3, weight, bias, residual.reshape(x3.shape) if residual is not None else None, initial_state,
            cu_seqlens, cu_seqlens_cpu, bool(output_final_state), silu)
        return y.reshape(shape), (final if output_final_state else None)
    seg_index, TS = segments(cu_seqlens, x3.shape[1], x.device)
    log_once(logging.INFO, f"causal_conv1d: kernel-fun's kernels (D={D}, W={W}, {x.dtype})")
    _last["route"] = "kernels"
    y, final = CausalConv1dFunction.apply(
        x3, weight.contiguous(), bias.contiguous() if bias is not None else None,
        residual.reshape(x3.shape).contiguous() if residual is not None else None,
        initial_state.contiguous() if initial_state is not None else None, bool(output_final_state), silu,
        cu_seqlens.contiguous() if cu_seqlens is not None else None, seg_index, TS)
    return y.reshape(shape), final
