"""The Gluon operand probe builds for sm_90a (in a process without the interpreter, where
Gluon cannot run): tf32 wgmmas from shared memory, no N=8 shape, no spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0", reason="Gluon's API as of Triton 3.6.0")
def test_the_probe_builds_tf32_wgmmas_from_shared_memory():
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "tools.gluon_b7_probe"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=root)
    rows = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [r["BK"] for r in rows] == [16, 32], out.stderr[-2000:]
    for r in rows:
        assert r["wgmma"] == [f"m64n{r['BK']}k8.f32.tf32.tf32"], r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
