"""The multi-GPU context-parallel bench (benchmarks.cp) rehearsed on the CPU with gloo: two
ranks, a small batch whose sequences cross the boundary, the torch reference stages; its
row holds every rank's parity against the whole batch and the witness. (Its timing runs
only on GPUs.) Slow: ``bash scripts/test-research`` runs it, CI's default run does not."""

from __future__ import annotations

import json

import pytest

from benchmarks import cp


@pytest.mark.slow
def test_the_bench_rehearses_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "cp.jsonl"
    cp.main(["--world", "2", "--device", "cpu", "--tokens", "256", "--heads", "2", "--K", "32", "--V", "16",
             "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["witness_every_rank"] for r in rows)
    for r in rows:
        assert max(r["vs_whole"].values()) < 1e-5, r
        assert r["offsets"][0] == 0 and any(a < 256 < b for a, b in zip(r["offsets"], r["offsets"][1:])), r


def test_the_offsets_cross_the_ranks():
    for world, T in ((2, 65536), (4, 4 * 32768), (2, 512)):
        cu = cp.offsets(T, world)
        share = T // world
        assert cu[0] == 0 and cu[-1] == T and cu == sorted(set(cu))
        assert any(a < share < b for a, b in zip(cu, cu[1:]))  # a sequence over the first boundary
