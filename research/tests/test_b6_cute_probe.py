"""The CuTe DSL cluster probe (research.b6_cute_probe) builds for sm_90a without a GPU where
CuTe DSL is installed: a 2-CTA cluster whose v_new, do and dv copies are multicast, twelve
wgmmas a V tile, no spills, with and without two tiles' products in flight; dA's
K-contracted part summed across the pair through a bulk copy into the peer's shared memory;
B6's V-side sums (dA's and db's V parts, A^T dv) split between the pair by V tile; and those
sums warp-specialized (a producer warpgroup at 40 registers, two consumers at 232, no spills);
and the whole of B6 on that split (300 B spilled: the epilogues' fragments)."""

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
    assert [(r["stages"], r["overlap"], r["exchange"], r["vside"], r["ws"], r["full"]) for r in rows] == [
        (2, True, False, False, False, False), (3, True, False, False, False, False),
        (3, False, False, False, False, False), (2, True, True, False, False, False),
        (2, True, False, True, False, False), (3, True, False, True, True, False), (4, True, False, True, True, False),
        (2, True, False, True, True, True)]
    for r in rows:
        # the one-warpgroup V-side build holds three more [64, 64] fp32 accumulators: 255
        # registers, 8 B spilled; warp-specialized, each consumer holds its own share
        spills = (8, 8) if r["vside"] and not r["ws"] else (300, 300) if r["full"] else (0, 0)
        assert (r["spill_stores"], r["spill_loads"]) == spills, r
        # the V loop unrolled (V=256: four tiles of 12 wgmmas); 3 tensors multicast and 2 of the
        # CTA's own, copied in the prologue's loop and after each tile's release (the first
        # tile's stage is released only after the second's products are issued, with overlap);
        # the exchange adds dw kg^T's 4 wgmmas, kg's copy and the one bulk copy to the peer
        want = (48, 12, 8, 0) if r["overlap"] else (48, 15, 10, 0)
        if r["exchange"]:
            want = (52, 12, 9, 1)
        if r["vside"]:  # + v multicast, Akk read once, each tile's dv v^T and A^T dv (compiled on both CTAs)
            want = (80, 16, 9, 0)
        if r["ws"]:  # the producer's copies in a loop of its own (not unrolled): one of each in the listing
            want = (80, 4, 3, 0)
        if r["full"]:  # + h dh^T a tile (16), A^T dw, dw kg^T and dA's two products (16), the pair's dA partial
            want = (112, 4, 3, 1)
            assert r["registers"] == 168 and r["threads"] == 384, r  # 384 threads at 168: setmaxnreg 40 / 232 / 232
        assert (r["wgmma"], r["tma_multicast"], r["tma_own"], r["bulk_s2s"]) == want, r
        assert r["shared_ring"] <= 227 * 1024
