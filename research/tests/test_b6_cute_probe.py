"""The CuTe DSL cluster probe (research.b6_cute_probe) builds for sm_90a without a GPU where
CuTe DSL is installed: a 2-CTA cluster whose v_new, do and dv copies are multicast, twelve
wgmmas a V tile, with and without two tiles' products in flight; dA's K-contracted part
summed across the pair through a bulk copy into the peer's shared memory; B6's V-side sums
(dA's and db's V parts, A^T dv) split between the pair by V tile; those sums
warp-specialized (a producer warpgroup at 40 registers, two consumers at 232); the whole of B6
on that split; and that build persistent. Every build without spills and without any of
ptxas's notes that cost speed (setmaxnreg ignored, wgmmas serialised, waits or fences added)."""

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
    assert [(r["stages"], r["overlap"], r["exchange"], r["vside"], r["ws"], r["full"], r["persist"]) for r in rows] == [
        (2, True, False, False, False, False, False), (3, True, False, False, False, False, False),
        (3, False, False, False, False, False, False), (2, True, True, False, False, False, False),
        (2, True, False, True, False, False, False), (3, True, False, True, True, False, False),
        (4, True, False, True, True, False, False), (2, True, False, True, True, True, False),
        (2, True, False, True, True, True, True)]
    for r in rows:
        assert (r["spill_stores"], r["spill_loads"], r["sass_stl"]) == (0, 0, 0), r
        # no accumulator zeroed by stores (they would sink between fence and wgmma), no branch
        # between a group's wgmmas, no accumulator read while a later group runs in the loop
        # over chunk-heads, and the kernel's register count at entry known (.minnctapersm)
        assert r["ptxas_notes"] == {}, r
        # the V loop unrolled (V=256: four tiles of 12 wgmmas); 3 tensors multicast and 2 of the
        # CTA's own, copied in the prologue's loop and after each tile's release (the first
        # tile's stage is released only after the second's products are issued, with overlap);
        # the exchange adds dw kg^T's 4 wgmmas, kg's copy and the one bulk copy to the peer
        want = (48, 12, 8, 0) if r["overlap"] else (48, 15, 10, 0)
        if r["exchange"]:
            want = (52, 12, 9, 1)
        if r["vside"]:  # + v multicast, Akk read once; a tile's products in two whole branches (this
            # CTA's tile: A^T dv, then q, k, w and dA's V part, 20 wgmmas; the peer's: 12)
            want = (128, 16, 9, 0)
        if r["ws"]:  # the producer's copies in loops of their own (one of each in the listing); the
            # first consumer 8 a tile, the second 16 (12 + 4) a tile
            want = (96, 4, 3, 0)
        if r["full"]:  # + h dh^T a tile (16), A^T dw, dw kg^T and dA's two products (16), the pair's dA partial
            want = (128, 4, 3, 1)
        if r["ws"]:  # 384 threads at 168: setmaxnreg 40 / 232 / 232, kept in the machine code
            assert (r["registers"], r["threads"], r["sass_setmaxnreg"]) == (168, 384, 3), r
        assert (r["wgmma"], r["tma_multicast"], r["tma_own"], r["bulk_s2s"]) == want, r
        assert r["sass_hgmma"] == r["wgmma"], r
        assert r["shared_ring"] <= 227 * 1024


@pytest.mark.parametrize("form", [[], ["both"], ["fused"]])
def test_the_persistent_build_compiles_at_the_op_s_heads(tmp_path: Path, form):
    """The persistent whole B6 on the op's layout at 16 heads (as ``wy_dqkg_bwd`` builds it for
    prod8192_gate), with dA's exchange both ways (both CTAs forming dA), and with the B7-B9 unit
    after B6 in the same CTAs (``fused``: B7's 66 wgmmas on the consumers, its tiles over the
    epilogue's buffers, inside the 227 KB an H100 or H200 gives a CTA): as clean as at one."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "research.b6_cute_probe", "compile-one", "2", "1", "0", "1", "1", "1",
                           "1", str(tmp_path), "16", *form], cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    from research.b6_cute_probe import sm90_row

    r = sm90_row(str(tmp_path), 2, True, False, True, True, True, True, both=bool(form), fused="fused" in form)
    assert (r["spill_stores"], r["sass_stl"], r["ptxas_notes"], r["sass_setmaxnreg"]) == (0, 0, {}, 3), r
    n = 128 + (66 if "fused" in form else 0)
    assert (r["wgmma"], r["sass_hgmma"], r["bulk_s2s"]) == (n, n, 1), r
    assert r["shared_bytes"] <= 227 * 1024, r
