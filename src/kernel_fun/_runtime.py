"""Switches and logging shared by every op.

Switches are environment variables read on every call, so a running job can be steered
without a restart. A malformed value never raises: it is reported once and the default
is kept.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

logger = logging.getLogger("kernel_fun")

_seen: set[tuple[int, str]] = set()
_seen_lock = threading.Lock()


def log_once(level: int, message: str) -> None:
    """Log ``message`` at ``level`` on the ``kernel_fun`` logger, once per distinct text."""
    key = (level, message)
    with _seen_lock:
        if key in _seen:
            return
        _seen.add(key)
    logger.log(level, message)


def reset_log_once() -> None:
    """Forget which messages were logged (tests use this to observe the next one)."""
    with _seen_lock:
        _seen.clear()


def env_flag(name: str) -> bool:
    """True when ``name`` is set to 1/true/yes/on; unset, empty or 0/false/no/off is False."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return False
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    log_once(logging.WARNING, f"ignoring {name}={raw!r}: expected 0 or 1; keeping the default (off)")
    return False


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer switch; a malformed or out-of-range value warns once and keeps ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        log_once(
            logging.WARNING,
            f"ignoring {name}={raw!r}: expected an integer >= {minimum}; keeping the default ({default})",
        )
        return default
    return value


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """A switch among ``choices`` (case and surrounding spaces ignored); a value not among them
    warns once and keeps ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        log_once(logging.WARNING, f"ignoring {name}={raw!r}: expected one of {', '.join(choices)}; "
                                  f"keeping the default ({default})")
        return default
    return value


# Offsets tensors already checked on the device, each kept while it lives unmodified (the
# same object at the same version: torch bumps ``_version`` on every in-place write), so a
# model's layers, which share one cu_seqlens, enqueue the check once a step.
_checked: dict = {}


def offsets_error(bounds: list[int], total: int, capacity: bool = False) -> str | None:
    """Why host offsets are not packed sequences covering ``total`` tokens (``capacity``: at
    most ``total``, the rest padding), or None."""
    end = f"at most T={total}" if capacity else f"T={total}"
    if bounds[0] != 0 or (bounds[-1] > total if capacity else bounds[-1] != total):
        return f"must rise from 0 to {end}"
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        return f"must rise from 0 to {end} without a step down"
    return None


def host_offsets_error(cu_seqlens, cu_seqlens_cpu, total: int, capacity: bool = False) -> tuple[str, list[int]] | None:
    """(why, the offsets) where a host copy of the offsets is at hand (``cu_seqlens_cpu``, or
    ``cu_seqlens`` itself on the CPU: reading it costs no synchronization) and they are not
    packed sequences covering ``total`` tokens; else None (device offsets go to
    ``assert_offsets``)."""
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else (cu_seqlens if cu_seqlens.device.type == "cpu" else None)
    if host is None:
        return None
    bounds = host.tolist()
    why = offsets_error(bounds, total, capacity)
    return None if why is None else (why, bounds)


def assert_offsets(cu_seqlens, total: int, who: str, capacity: bool = False) -> None:
    """Check device offsets without a host synchronization: a device-side assert (the
    stream stops with ``who``'s message before any kernel reads them) unless cu_seqlens
    rises from 0 to ``total`` (``capacity``: to at most ``total``) without a step down. A
    capacity-shaped call's offsets are checked on every call (a CUDA graph that captures the
    call then checks them at every replay, whatever was written into them)."""
    key = (id(cu_seqlens), cu_seqlens._version, total)
    hit = _checked.get(key)
    if hit is not None and hit() is cu_seqlens and not capacity:
        return
    cu = cu_seqlens.long()
    ok = (cu[0] == 0) & ((cu[-1] <= total) if capacity else (cu[-1] == total)) & (cu[1:] >= cu[:-1]).all()
    end = f"at most T={total}" if capacity else f"T={total}"
    torch._assert_async(ok, f"{who}: cu_seqlens must rise from 0 to {end} without a step down")
    if capacity:
        return
    if len(_checked) >= 8:
        _checked.pop(next(iter(_checked)))
    _checked[key] = weakref.ref(cu_seqlens)


def first_order_only(who: str):
    """A custom Function's backward that says so when asked for a graph of itself
    (``create_graph=True``: autograd runs the backward with grad mode on), instead of
    returning gradients that silently carry no graph."""

    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"{who}: double backward (create_graph=True through {who}) is not supported: "
                                   f"its backward kernels are not differentiable")
            return backward(ctx, *grads)

        return run

    return wrap


def wants_operator(t: torch.Tensor) -> bool:
    """Whether a supported call with ``t`` among its inputs takes the ops' PyTorch operators
    (``kernel_fun.kda.ops``, ``kernel_fun.cconv.op``) rather than their eager autograd
    Functions: under ``torch.compile`` / ``torch.export``, under a dispatch mode (fake
    tensors, ``make_fx``), on meta tensors or tensor subclasses."""
    return (torch.compiler.is_compiling() or t.is_meta or type(t) not in PLAIN_TENSORS
            or is_in_torch_dispatch_mode())


# Plain tensors (a model's parameters, A_log and dt_bias, are nn.Parameters): any other kind of
# tensor is a subclass the operators trace
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@torch.compiler.assume_constant_result  # (under torch.compile: read at trace time, not traced)
def cuda_device(index: int) -> tuple[int, int, str]:
    """(major, minor, name) of CUDA device ``index``: what the ops' gates ask of a device."""
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor, torch.cuda.get_device_name(index)


def not_hopper(device: torch.device) -> str | None:
    """Why a CUDA device is outside kernel-fun's box, or None for sm_90."""
    major, minor, name = cuda_device(device.index if device.index is not None else torch.cuda.current_device())
    if (major, minor) != (9, 0):
        return f"device {name} is sm_{major}{minor}; kernel-fun targets Hopper (sm_90)"
    return None
