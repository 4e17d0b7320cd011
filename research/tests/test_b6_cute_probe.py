"""The CuTe DSL cluster probe (research.b6_cute_probe) builds for sm_90a without a GPU where
CuTe DSL is installed: a 2-CTA cluster whose v_new, do and dv copies are multicast, twelve
wgmmas a V tile, no spills, with and without two tiles' products in flight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass.cute", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")


def test_the_probe_compiles_for_sm90a(tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "research.b6_cute_probe", "compile", str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["stages"], r["overlap"]) for r in rows] == [(2, True), (3, True), (3, False)]
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        # 3 tensors multicast and 2 of the CTA's own, issued at the prologue and in the loop
        # the V loop unrolled (V=256: four tiles of 12 wgmmas); 3 tensors multicast and 2 of the
        # CTA's own, copied in the prologue's loop and after each tile's release (the first
        # tile's stage is released only after the second's products are issued, with overlap)
        want = (48, 12, 8) if r["overlap"] else (48, 15, 10)
        assert (r["wgmma"], r["tma_multicast"], r["tma_own"]) == want, r
        assert r["shared_ring"] <= 227 * 1024
