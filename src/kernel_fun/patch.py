"""``patch_fla()`` / ``unpatch_fla()``: route fla's own layers to kernel-fun's ``chunk_kda``
and ``causal_conv1d``.

fla's layers call ``chunk_kda`` through the name their module bound at import
(``from fla.ops.kda import chunk_kda`` in ``fla.layers.kda``, and the re-exports in
``fla.ops`` and ``fla.ops.kda``). ``patch_fla()`` imports what of fla is installed (fla-core's
ops; fla's layers and models, which ship in the ``flash-linear-attention`` package), then
looks through every loaded ``fla`` module for an attribute that *is* fla's ``chunk_kda``
function object and rebinds it to ``kernel_fun.kda.chunk_kda``; the same for fla's
``causal_conv1d`` (``fla.modules.conv``, re-exported by ``fla.modules.convolution``; fla's
``ShortConvolution`` imports it from its module at every call), rebound to
``kernel_fun.cconv.causal_conv1d``. Nothing is found by a
hard-coded list, so a module fla adds later is patched too. It is idempotent (a binding
already routed is left alone; a module imported since the last call is picked up) and
logged; ``unpatch_fla()`` puts back exactly the bindings it changed.

kernel-fun's own fallbacks keep calling fla's original functions, captured before any
binding changes (``kernel_fun._fla``), so a patched process never calls itself.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading

from kernel_fun import _fla as fla
from kernel_fun._runtime import logger

_lock = threading.Lock()
# (module name, attribute) -> (the module object, fla's function it held), for every
# binding patch_fla rebound
_patched: dict[tuple[str, str], tuple[object, object]] = {}
# fla's packages that bind chunk_kda or causal_conv1d, imported (when installed) before the search
_FLA_PACKAGES = ("fla.ops", "fla.modules", "fla.modules.conv", "fla.modules.convolution", "fla.layers", "fla.models")


def _bindings(target):
    """(module name, attribute, module) of every loaded fla module attribute that is ``target``."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is target:
                yield name, attr, module


def patch_fla() -> list[str]:
    """Route every fla binding of ``chunk_kda`` and ``causal_conv1d`` to kernel-fun's; returns
    the ``module.attribute`` names rebound by this call (empty when all were already)."""
    from kernel_fun.cconv import causal_conv1d
    from kernel_fun.kda import chunk_kda

    with _lock:
        missing = []
        for package in _FLA_PACKAGES:
            try:
                importlib.import_module(package)
            except Exception as err:  # not installed, or broken by its own dependencies: patch the rest
                missing.append(f"{package} ({type(err).__name__}: {err})")
        pairs = [("chunk_kda", fla.chunk_kda(), chunk_kda)]
        try:
            pairs.append(("causal_conv1d", fla.causal_conv1d(), causal_conv1d))
        except Exception as err:
            missing.append(f"fla.modules.conv.causal_conv1d ({type(err).__name__}: {err})")
        changed = {}
        for op_name, original, ours in pairs:
            for name, attr, module in _bindings(original):
                setattr(module, attr, ours)
                _patched[(name, attr)] = (module, original)
                changed.setdefault(op_name, []).append(f"{name}.{attr}")
        routed = sorted(f"{n}.{a}" for n, a in _patched)
    if missing:
        logger.info("patch_fla: could not import, so not patched: %s (fla's layers and models ship in the "
                    "flash-linear-attention package)", "; ".join(missing))
    for op_name, names in changed.items():
        logger.info("patch_fla: fla's %s now runs kernel-fun's at %s", op_name, ", ".join(sorted(names)))
    if not changed:
        logger.info("patch_fla: already patched (%s)", ", ".join(routed) or "no binding found")
    return sorted(n for names in changed.values() for n in names)


def unpatch_fla() -> list[str]:
    """Undo ``patch_fla``: every binding it rebound is fla's function again (one that
    something else has rebound since is left as it is). Returns the names restored."""
    from kernel_fun.cconv import causal_conv1d
    from kernel_fun.kda import chunk_kda

    ours = {id(fla.chunk_kda()): chunk_kda}
    if fla.captured_causal_conv1d() is not None:
        ours[id(fla.captured_causal_conv1d())] = causal_conv1d
    with _lock:
        restored = []
        for (name, attr), (module, original) in list(_patched.items()):
            if getattr(module, attr, None) is ours.get(id(original)):
                setattr(module, attr, original)
                restored.append(f"{name}.{attr}")
            del _patched[(name, attr)]
    if restored:
        logger.info("unpatch_fla: fla's own functions restored at %s", ", ".join(sorted(restored)))
    return sorted(restored)


@contextlib.contextmanager
def fla_patched():
    """``patch_fla()`` for the duration of a block, undone on the way out (tests, benches)."""
    patch_fla()
    try:
        yield
    finally:
        unpatch_fla()
