"""``patch_fla()`` / ``unpatch_fla()``: route fla's own layers to kernel-fun's ``chunk_kda``.

fla's layers call ``chunk_kda`` through the name their module bound at import
(``from fla.ops.kda import chunk_kda`` in ``fla.layers.kda``, and the re-exports in
``fla.ops`` and ``fla.ops.kda``). ``patch_fla()`` imports what of fla is installed (fla-core's
ops; fla's layers and models, which ship in the ``flash-linear-attention`` package), then
looks through every loaded ``fla`` module for an attribute that *is* fla's ``chunk_kda``
function object and rebinds it to ``kernel_fun.kda.chunk_kda``. Nothing is found by a
hard-coded list, so a module fla adds later is patched too. It is idempotent (a binding
already routed is left alone; a module imported since the last call is picked up) and
logged; ``unpatch_fla()`` puts back exactly the bindings it changed.

kernel-fun's own fallback keeps calling fla's original function, captured before any
binding changes, so a patched process never calls itself.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading

from kernel_fun._runtime import logger

_lock = threading.Lock()
_original = None
# (module name, attribute) -> the module object, for every binding patch_fla rebound
_patched: dict[tuple[str, str], object] = {}
# fla's packages that bind chunk_kda, imported (when installed) before the search
_FLA_PACKAGES = ("fla.ops", "fla.layers", "fla.models")


def fla_chunk_kda():
    """fla's own ``chunk_kda``, whether or not its bindings are patched."""
    global _original
    if _original is None:
        from fla.ops.kda.chunk import chunk_kda

        _original = chunk_kda
    return _original


def _bindings(target):
    """(module name, attribute, module) of every loaded fla module attribute that is ``target``."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is target:
                yield name, attr, module


def patch_fla() -> list[str]:
    """Route every fla binding of ``chunk_kda`` to ``kernel_fun.kda.chunk_kda``; returns the
    ``module.attribute`` names rebound by this call (empty when all were already)."""
    from kernel_fun.kda import chunk_kda

    with _lock:
        original = fla_chunk_kda()
        missing = []
        for package in _FLA_PACKAGES:
            try:
                importlib.import_module(package)
            except Exception as err:  # not installed, or broken by its own dependencies: patch the rest
                missing.append(f"{package} ({type(err).__name__}: {err})")
        changed = []
        for name, attr, module in _bindings(original):
            setattr(module, attr, chunk_kda)
            _patched[(name, attr)] = module
            changed.append(f"{name}.{attr}")
        routed = sorted(f"{n}.{a}" for n, a in _patched)
    if missing:
        logger.info("patch_fla: could not import, so not patched: %s (fla's layers and models ship in the "
                    "flash-linear-attention package)", "; ".join(missing))
    if changed:
        logger.info("patch_fla: fla's chunk_kda now runs kernel-fun's at %s", ", ".join(sorted(changed)))
    else:
        logger.info("patch_fla: already patched (%s)", ", ".join(routed) or "no binding found")
    return sorted(changed)


def unpatch_fla() -> list[str]:
    """Undo ``patch_fla``: every binding it rebound is fla's ``chunk_kda`` again (one that
    something else has rebound since is left as it is). Returns the names restored."""
    from kernel_fun.kda import chunk_kda

    with _lock:
        restored = []
        for (name, attr), module in list(_patched.items()):
            if getattr(module, attr, None) is chunk_kda:
                setattr(module, attr, fla_chunk_kda())
                restored.append(f"{name}.{attr}")
            del _patched[(name, attr)]
    if restored:
        logger.info("unpatch_fla: fla's own chunk_kda restored at %s", ", ".join(sorted(restored)))
    return sorted(restored)


@contextlib.contextmanager
def fla_patched():
    """``patch_fla()`` for the duration of a block, undone on the way out (tests, benches)."""
    patch_fla()
    try:
        yield
    finally:
        unpatch_fla()
