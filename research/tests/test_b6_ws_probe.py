"""The fused backward's step 1 (research.b6_ws_probe) builds for sm_90a without a GPU: a
warp-specialized cubin with wgmmas in it, inside an SM's shared memory."""

from __future__ import annotations

import os

import pytest


def _offline_compile_available() -> str | None:
    """Why the sm_90a compile cannot run here, or None."""
    try:
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except Exception as e:  # an older or a CPU-only Triton
        return f"no Gluon in this Triton: {e}"
    for tool in ("ptxas", "nvdisasm"):
        if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)):
            return f"Triton ships no {tool}"
    return None


_WHY = _offline_compile_available()


@pytest.mark.skipif(_WHY is not None, reason=f"offline sm_90a compile unavailable: {_WHY}")
def test_b6_ws_probe_main_compiles():
    from research.b6_ws_probe import SM90_SHARED_BYTES, compile_rows

    (row,) = compile_rows(["main"])
    assert row["ok"], row.get("error")
    assert row["wgmma_sass"] >= 1, row
    assert 0 < row["shared"] <= SM90_SHARED_BYTES, row
    assert row["setmaxnreg"] and row["setmaxnreg_sass"], row  # warp-specialized
    assert row["spill_stores"] == 0, row
