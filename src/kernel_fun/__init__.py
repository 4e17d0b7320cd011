"""kernel-fun: drop-in, faster Triton kernels for flash-linear-attention's KDA on Hopper.

Change one import -- ``from kernel_fun.kda import chunk_kda`` -- and the call runs through
kernel-fun's stage chain where it is supported, and through fla's own ``chunk_kda``
(verbatim, with one log line saying why) where it is not. A user of fla's own layers
(``fla.layers.KimiDeltaAttention``) calls ``kernel_fun.patch_fla()`` once instead.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "versions", "patch_fla", "unpatch_fla"]


def patch_fla() -> list[str]:
    """Route every fla binding of ``chunk_kda`` (fla's layers included) to kernel-fun's;
    idempotent, logged, undone by ``unpatch_fla``. See ``kernel_fun.patch``."""
    from kernel_fun.patch import patch_fla as _patch

    return _patch()


def unpatch_fla() -> list[str]:
    """Put back fla's own ``chunk_kda`` wherever ``patch_fla`` rebound it."""
    from kernel_fun.patch import unpatch_fla as _unpatch

    return _unpatch()


def versions() -> dict[str, str]:
    """Versions of kernel-fun, torch, triton and fla, and the device a call would run on."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a hard dependency
        triton_version = "missing"
    from kernel_fun import _fla

    fla_version = _fla.version()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    else:
        device = "cpu"
    return {
        "kernel_fun": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "fla": fla_version,
        "device": device,
    }
