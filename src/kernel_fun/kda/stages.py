"""The staged chain's plumbing: stages, their implementations, and the per-call record.

Every stage of fla's KDA chain (F1-F8 forward, B1-B10 backward; a unit may cover a group
of them, e.g. ``F3-F6``) has up to three implementations behind one dispatcher:

- ``ours``: a kernel-fun Triton kernel (runs on CUDA; on the CPU through the interpreter);
- ``fla``: fla's own stage function (CUDA only);
- ``reference``: the torch stage reference (anywhere).

The dispatcher picks, per call: a forced choice (``use_impls``), else ``ours`` where it is
registered and says it supports the arguments, else ``fla`` on CUDA and ``reference`` on
the CPU. Every pick is written into the call's ``CallRecord``: the launch witness that
tests and the bench read.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Mapping

import torch

from kernel_fun._runtime import log_once
from kernel_fun._triton import interpreting

IMPLS = ("ours", "fla", "reference")
# What an implementation may declare when it is registered (``add_impl(..., caps=...)``):
# an input it reads or forms beyond the stage's contract, which the chain asks the producing
# stage for (or spares it) only when this implementation will run.
CAPS = {
    "reads_qg": "reads q exp2(g) as F6 rounds it: the chain has F3-F6 write qg",
    "forms_u": "forms u from v, beta and Akk_inv: the chain has B2 write no u",
}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One unit of the chain.

    ``covers`` names the stages of fla's chain it replaces; ``inputs`` are the keywords
    the chain passes every implementation (the stage's contract, with ``outputs`` in
    order); ``impls`` maps an implementation name to a callable taking exactly those
    keywords (others only with defaults); ``supports`` maps an implementation name to a
    predicate taking the same keywords and returning ``None`` (supported) or a reason;
    ``caps`` maps an implementation name to what it declared of ``CAPS``.
    """

    name: str
    covers: tuple[str, ...]
    title: str
    impls: Mapping[str, Callable]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    supports: Mapping[str, Callable[..., str | None]] = dataclasses.field(default_factory=dict)
    caps: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class CallRecord:
    """What one ``chunk_kda`` call did: engaged or fell back, and which implementation ran
    each stage of its forward and backward (in execution order)."""

    engaged: bool
    reason: str | None = None
    forward: dict[str, str] = dataclasses.field(default_factory=dict)
    backward: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    def impl_of(self, stage: str) -> str | None:
        return self.forward.get(stage, self.backward.get(stage))


_REGISTRY: dict[str, Stage] = {}
_profiler_enabled = torch.autograd._profiler_enabled
# Bumped on every change to the registry: a choice remembered under an older registration
# (Dispatcher's memo) is not reused.
_VERSION = [0]
_FORCED: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("kernel_fun_forced", default=None)
_TAP: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernel_fun_tap", default=None)
_TIMER: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernel_fun_timer", default=None)
_LAST = threading.local()


def _check_takes_inputs(stage: Stage, what: str, fn: Callable) -> None:
    """``fn`` must accept every input of ``stage`` as a keyword and need nothing else."""
    try:
        inspect.signature(fn).bind(**dict.fromkeys(stage.inputs))
    except TypeError as err:
        raise TypeError(f"stage {stage.name}: {what} does not take the stage's inputs {stage.inputs}: {err}") from None


def register(stage: Stage) -> Stage:
    for impl, fn in stage.impls.items():
        _check_takes_inputs(stage, impl, fn)
    _REGISTRY[stage.name] = stage
    _VERSION[0] += 1
    return stage


def add_impl(stage: str, impl: str, fn: Callable, supports: Callable[..., str | None] | None = None,
             caps: tuple[str, ...] = ()) -> None:
    """Attach an implementation to a registered stage, with its support predicate and what it
    declares of ``CAPS``."""
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")
    unknown = set(caps) - set(CAPS)
    if unknown:
        raise ValueError(f"unknown capabilities {sorted(unknown)}; known: {sorted(CAPS)}")
    old = _REGISTRY[stage]
    _check_takes_inputs(old, impl, fn)
    if supports is not None:
        _check_takes_inputs(old, f"{impl}'s supports", supports)
    impls = dict(old.impls)
    impls[impl] = fn
    sup = dict(old.supports)
    sup.pop(impl, None)
    if supports is not None:
        sup[impl] = supports
    declared = dict(old.caps)
    declared[impl] = frozenset(caps)
    _REGISTRY[stage] = dataclasses.replace(old, impls=impls, supports=sup, caps=declared)
    _VERSION[0] += 1


@contextlib.contextmanager
def registered(stage: str, impl: str, fn: Callable, supports: Callable[..., str | None] | None = None,
               caps: tuple[str, ...] = ()) -> Iterator[None]:
    """``add_impl`` for the block only: the stage's registration as it was is restored on the
    way out, whatever was registered inside (a candidate tested or measured before it is
    registered for users)."""
    old = _REGISTRY[stage]
    add_impl(stage, impl, fn, supports, caps)
    try:
        yield
    finally:
        _REGISTRY[stage] = old
        _VERSION[0] += 1


def stages() -> dict[str, Stage]:
    """The registered stages, by name."""
    return dict(_REGISTRY)


@contextlib.contextmanager
def use_impls(choice: str | Mapping[str, str]) -> Iterator[None]:
    """Force implementations for calls made inside the block.

    ``use_impls("fla")`` puts every stage on fla; ``use_impls({"B6": "ours", "*": "fla"})``
    picks per stage, ``*`` standing for the rest. The choice is captured when the forward
    runs, so a backward run later follows it too. A forced implementation that cannot run
    (fla on the CPU, or an unregistered one) raises instead of silently running another.
    """
    if isinstance(choice, str):
        choice = {"*": choice}
    for impl in choice.values():
        if impl not in IMPLS:
            raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")
    token = _FORCED.set(dict(choice))
    try:
        yield
    finally:
        _FORCED.reset(token)


def current_forced() -> Mapping[str, str] | None:
    return _FORCED.get()


def forces_fla_only(forced: Mapping[str, str] | None) -> bool:
    """Whether forced choices put every stage on fla (``use_impls("fla")``: the control chain)."""
    return bool(forced) and forced.get("*") == "fla" and set(forced.values()) == {"fla"}


@contextlib.contextmanager
def _collecting(var: contextvars.ContextVar) -> Iterator[list]:
    log: list = []
    token = var.set(log)
    try:
        yield log
    finally:
        var.reset(token)


def capture_stages():
    """Record ``(stage, impl, inputs, outputs)`` of every stage run by calls whose forward
    starts inside the block (their backward too). For stage-by-stage parity checks."""
    return _collecting(_TAP)


def current_tap() -> list | None:
    return _TAP.get()


def time_stages():
    """Put a pair of CUDA events around every stage run by calls whose forward starts inside
    the block (their backward too). ``stage_ms`` turns the marks into milliseconds: the
    device time between the stage's first launch and its last completing, which on a busy
    stream is the stage's device time."""
    return _collecting(_TIMER)


def current_timer() -> list | None:
    return _TIMER.get()


def stage_ms(marks: list) -> dict[str, float]:
    torch.cuda.synchronize()
    out: dict[str, float] = {}
    for name, start, end in marks:
        out[name] = out.get(name, 0.0) + start.elapsed_time(end)
    return out


# The choices of earlier calls, by (call key, forced choices, registry version): see
# Dispatcher.remember.
_MEMOS: dict = {}


def last_record() -> CallRecord | None:
    """The record of the most recent ``chunk_kda`` call on this thread (its backward too,
    once that has run)."""
    return getattr(_LAST, "record", None)


def set_last_record(record: CallRecord) -> None:
    _LAST.record = record


class Dispatcher:
    """Runs stages for one call, choosing and recording an implementation for each.

    ``Dispatcher.for_call`` takes the forced choices (``use_impls``), the capture tap and
    the stage timer from the context the call's forward runs in; the same dispatcher then
    runs the call's backward, which follows the forward's context wherever it runs."""

    def __init__(self, device: torch.device, record: CallRecord, forced: Mapping[str, str] | None = None,
                 tap: list | None = None, timer: list | None = None, memo: dict | None = None):
        self.device = device
        self.record = record
        self.forced = forced or {}
        self.tap = tap
        self.timer = timer if device.type == "cuda" else None
        self.memo = memo

    @classmethod
    def for_call(cls, device: torch.device, record: CallRecord) -> Dispatcher:
        return cls(device, record, _FORCED.get(), _TAP.get(), _TIMER.get())

    def remember(self, key) -> None:
        """Reuse the choices of earlier calls with the same ``key`` and keep this call's for
        later ones. ``key`` must determine every input the support predicates read (the
        call's metadata and flags, and for packed sequences their chunk count): with the
        forced choices in force, the registry's version and whether Triton interprets, it
        names one set of choices."""
        forced = tuple(sorted(self.forced.items())) if self.forced else ()
        full = (key, forced, _VERSION[0], interpreting())
        memo = _MEMOS.get(full)
        if memo is None:
            if len(_MEMOS) >= 256:
                _MEMOS.pop(next(iter(_MEMOS)))
            memo = _MEMOS[full] = {}
        self.memo = memo

    @property
    def fla_only(self) -> bool:
        """Every stage forced onto fla (``use_impls("fla")``): the control chain."""
        return forces_fla_only(self.forced)

    def _choice(self, name: str, inputs: dict) -> str:
        memo = self.memo
        if memo is not None:
            hit = memo.get(name)
            if hit is not None:
                if hit[1] is not None:
                    self.record.notes[name] = hit[1]
                return hit[0]
        impl = self._choose(name, inputs)
        if memo is not None:
            memo[name] = (impl, self.record.notes.get(name), _REGISTRY[name].impls[impl])
        return impl

    def _choose(self, name: str, inputs: dict) -> str:
        stage = _REGISTRY[name]
        explicit = self.forced.get(name)
        forced = explicit if explicit is not None else self.forced.get("*")
        if forced is not None:
            reason = self._cannot_run(stage, forced, inputs)
            if reason is None:
                return forced
            if explicit is not None or forced == "fla":
                raise RuntimeError(f"stage {name} cannot run {forced!r}: {reason}")
            # "*" naming an implementation this stage lacks: the default choice below.
        fallback = "fla" if self.device.type == "cuda" and "fla" in stage.impls else "reference"
        if "ours" in stage.impls and (self.device.type == "cuda" or interpreting()):
            reason = self._cannot_run(stage, "ours", inputs)
            if reason is None:
                return "ours"
            self.record.notes[name] = reason
            log_once(logging.INFO, f"{name}: kernel-fun's kernel declined ({reason}); this stage runs {fallback}")
        elif "ours" in stage.impls:
            log_once(logging.INFO, "on the CPU without TRITON_INTERPRET=1 kernel-fun's Triton kernels are skipped "
                                   "and their stages run the torch references; set TRITON_INTERPRET=1 before "
                                   "importing kernel_fun to run them through the Triton interpreter")
        return fallback

    def takes_ours(self, name: str, **inputs) -> bool:
        """Whether ``name`` would run kernel-fun's kernel on these inputs: how the chain
        decides to run a fused unit in place of the stages it covers (which then keep
        their own choices, fla's control chain included)."""
        return "ours" in _REGISTRY[name].impls and self._choice(name, inputs) == "ours"

    def answer(self, key: tuple, ask: Callable[[], object]):
        """``ask()``, a question about this call's choices (``wants``, ``takes_ours``), kept
        with the remembered choices (``remember``) under ``key`` together with the notes it
        wrote: a call with a remembered answer neither asks it again nor builds its inputs."""
        memo = self.memo
        if memo is None:
            return ask()
        hit = memo.get(key)
        if hit is None:
            before = dict(self.record.notes)
            value = ask()
            hit = memo[key] = (value, {k: v for k, v in self.record.notes.items() if before.get(k) != v})
        elif hit[1]:
            self.record.notes.update(hit[1])
        return hit[0]

    def wants(self, name: str, cap: str, **inputs) -> bool:
        """Whether the implementation of ``name`` that would run on these inputs declared
        ``cap`` (one of ``CAPS``) when it was registered: how the chain asks a producing stage
        for an optional output only some consumers read."""
        if cap not in CAPS:
            raise ValueError(f"unknown capability {cap!r}; known: {sorted(CAPS)}")
        return cap in _REGISTRY[name].caps.get(self._choice(name, inputs), ())

    def _cannot_run(self, stage: Stage, impl: str, inputs: dict) -> str | None:
        if impl not in stage.impls:
            return "not implemented"
        if impl == "fla" and self.device.type != "cuda":
            return f"fla's kernels need a CUDA device, got {self.device}"
        if impl == "ours" and self.device.type != "cuda" and not interpreting():
            return "Triton on the CPU needs TRITON_INTERPRET=1"
        check = stage.supports.get(impl)
        return check(**inputs) if check is not None else None

    def run(self, name: str, phase: str, **inputs):
        memo = self.memo
        hit = memo.get(name) if memo is not None else None
        if hit is None:  # (a remembered choice was made on inputs that passed this check)
            declared = _REGISTRY[name].inputs
            if len(inputs) != len(declared) or not all(n in inputs for n in declared):  # chain and contract disagree
                raise TypeError(f"stage {name} takes {sorted(declared)}; the chain passed {sorted(inputs)}")
            impl = self._choice(name, inputs)
            fn = _REGISTRY[name].impls[impl]
        else:
            impl, note, fn = hit
            if note is not None:
                self.record.notes[name] = note
        (self.record.forward if phase == "forward" else self.record.backward)[name] = impl
        if self.timer is None and self.tap is None and not _profiler_enabled():
            return fn(**inputs)
        if self.timer is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(**inputs)
            end.record()
            self.timer.append((name, start, end))
        elif _profiler_enabled():  # a named range per stage for the bench's profile
            with torch.profiler.record_function(f"kernel_fun::{name}"):
                out = fn(**inputs)
        else:
            out = fn(**inputs)
        if self.tap is not None:
            self.tap.append((name, impl, dict(inputs), out))
        return out
