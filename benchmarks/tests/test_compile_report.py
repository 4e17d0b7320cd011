"""Every shipped kernel build as ptxas assembles it for sm_90a (``benchmarks.compile_report``,
no GPU needed): it compiles, ptxas notes no lost speed (wgmmas serialised, waits or fences
added), it spills no more than its committed row says, it has no more
wgmma with 32-byte operand rows than its row (the shape that read past its shared allocation
on the H200 in a kernel since removed: docs/log/prep.md; B6 at V=64 has four, sanitizer-clean
on the H200: docs/log/layout.md), and its machine code is the committed row's, so a change to
a kernel's code shows here before it reaches the H200 and its rows are rewritten on purpose
(``python -m benchmarks.compile_report --out benchmarks/results/compile_sm90.jsonl``). Slow
(every build compiled, a minute or more): run by ``bash scripts/test-research``, not by CI's
default run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

from benchmarks import compile_report, rows

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(triton.__version__ != "3.6.0", reason="rows recorded with Triton 3.6.0's ptxas")]


def committed() -> dict[str, dict]:
    """The newest committed row of each shipped build."""
    found = rows.latest([r for r in rows.load(kind="compile_sm90") if r.get("triton") == triton.__version__], "build")
    return {r["build"]: r for r in found}


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """Every shipped build, compiled in one process without the interpreter."""
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.compile_report"], capture_output=True, text=True, env=env,
                         timeout=1800, cwd=rows.REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["build"]: r for r in map(json.loads, out.stdout.strip().splitlines())}


def test_every_shipped_build_compiles_as_committed(compiled):
    want = committed()
    assert set(compiled) == set(compile_report.SHIPPED) == set(want), (sorted(compiled), sorted(want))
    bad = {}
    for name, row in compiled.items():
        if "error" in row:
            bad[name] = row["error"]
            continue
        old = want[name]
        problems = []
        if row["spill_stores"] > old["spill_stores"] or row["spill_loads"] > old["spill_loads"]:
            problems.append(f"spills {row['spill_stores']}/{row['spill_loads']} past {old['spill_stores']}/"
                            f"{old['spill_loads']}")
        if row["wgmma_32B_rows"] > old["wgmma_32B_rows"]:
            problems.append(f"{row['wgmma_32B_rows']} wgmma with 32-byte operand rows, committed "
                            f"{old['wgmma_32B_rows']}")
        if row["ptxas_notes"]:  # none today: a serialised wgmma or an added wait is lost speed
            problems.append(f"ptxas notes {row['ptxas_notes']}")
        if row["sass_sha"] != old["sass_sha"]:
            problems.append(f"machine code {row['sass_sha']}, committed {old['sass_sha']}")
        if problems:
            bad[name] = problems
    assert not bad, bad


def test_the_cute_builds_compile_as_committed():
    """B7-B10's CuTe DSL builds (``compile_report.CUTE_SHIPPED``, where CuTe DSL is installed: the
    ``sm90`` extra) compile for sm_90a, spill no more than their committed rows, keep ptxas's notes
    empty and their machine code the committed rows'."""
    pytest.importorskip("cutlass.cute", reason="CuTe DSL (the sm90 extra) is not installed")
    want = {r["build"]: r for r in rows.latest([r for r in rows.load(kind="compile_sm90_cute")
                                                if r.get("triton") == triton.__version__], "build")}
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.compile_report", "--cute", "all"], capture_output=True,
                         text=True, env=env, timeout=1800, cwd=rows.REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = {r["build"]: r for r in map(json.loads, out.stdout.strip().splitlines())}
    assert set(got) == set(compile_report.CUTE_SHIPPED) == set(want), (sorted(got), sorted(want))
    bad = {}
    for name, row in got.items():
        old = want[name]
        if "error" in row:
            bad[name] = row["error"]
        elif row["spill_stores"] > old["spill_stores"] or row["spill_loads"] > old["spill_loads"] or \
                row["ptxas_notes"] or row["sass_sha"] != old["sass_sha"]:
            bad[name] = {n: (row[n], old[n]) for n in ("spill_stores", "spill_loads", "ptxas_notes", "sass_sha")}
        if "error" not in row and row["cluster_copies"] != row["cluster_copies_mapped"]:  # (rows rewritten or not)
            bad.setdefault(name, {})["cluster copies with a barrier not mapped into the peer"] = \
                row["cluster_copies"] - row["cluster_copies_mapped"]
    assert not bad, bad
    # the cluster builds (B10 with K = 128: the halves a 2-CTA cluster) exchange by one copy each
    assert {n for n, r in got.items() if r["cluster_copies"]} == {"b7-b10 cute K128", "b7-b10 cute K128 var",
                                                                  "b7-b10 cute K128 var whole"}
