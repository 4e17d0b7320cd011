"""Stage-level comparisons: one stage's outputs from two implementations on the same inputs."""

from __future__ import annotations

import torch

from kernel_fun.kda import reference as ref
from kernel_fun.kda.stages import stages


def _tril_mask(A: torch.Tensor, chunk: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """[B, T, HV, BT] score layout: True where the column is at or before the row in its chunk
    (chunks restart at every sequence start of a packed batch)."""
    T = A.shape[1]
    pos = torch.arange(T, device=A.device)
    if cu_seqlens is not None:
        starts = cu_seqlens.to(A.device)
        pos = pos - starts[torch.searchsorted(starts, pos, right=True) - 1]
    col = torch.arange(A.shape[-1], device=A.device)
    return (col[None, :] <= (pos % chunk)[:, None])[None, :, None, :]


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def stage_errors(stage: str, out, want, chunk: int = 64, cu_seqlens: torch.Tensor | None = None) -> dict[str, float]:
    """Relative RMS error of each output of ``stage`` (``out`` against ``want``). Parts a
    kernel leaves unwritten by contract are compared as zero: the upper triangle of Aqk
    (never read downstream)."""
    names = stages()[stage].outputs
    errors = {}
    for name, a, b in zip(names, as_tuple(out), as_tuple(want)):
        if a is None or b is None:
            if (a is None) != (b is None):
                errors[name] = float("inf")
            continue
        if name == "Aqk":
            mask = _tril_mask(b, chunk, cu_seqlens)
            a, b = torch.where(mask, a, 0), torch.where(mask, b, 0)
        errors[name] = ref.rel_rms(a, b)
    return errors
