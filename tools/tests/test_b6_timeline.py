"""The timeline instrument (tools.b6_timeline): its stamp checks and statistics on known
rows, its command line, and on the GPU a real timeline of fullk's programs."""

from __future__ import annotations

import json
import os

import pytest
import torch


def test_stamps_complete_needs_every_row_written_and_in_order():
    import numpy as np

    from tools.b6_timeline import stamps_complete

    good = np.array([[0, 10, 20, 30], [131, 5, 5, 9]])
    assert stamps_complete(good, 132)
    assert not stamps_complete(good, 131)  # an SM id outside the device
    assert not stamps_complete(np.array([[1, 10, 9, 30]]), 132)  # the loop ends before it starts
    assert not stamps_complete(np.array([[1, 0, 0, 0]]), 132)  # a row its program never wrote


def test_timeline_stats_on_a_known_schedule():
    import numpy as np

    from tools.b6_timeline import timeline_stats

    # (smid, start, V loop done, end) in ns: two SMs, two programs each
    stamps = np.array([[0, 0, 1000, 2000], [0, 2500, 3500, 4500], [1, 0, 1500, 2000], [1, 2200, 3200, 4400]])
    st = timeline_stats(stamps)
    assert st["loop_us"][1] == 1.0 and st["epilogue_us"][1] == 1.0
    assert st["program_us"] == [2.0, 2.0, 2.14]  # 2000, 2000, 2000, 2200 ns
    assert sorted(st["same_sm_gap_us"]) == sorted([round(np.percentile([500, 200], p) * 1e-3, 3) for p in (10, 50, 90)])
    assert st["n_sm"] == 2 and st["programs_per_sm"] == [2, 2] and st["span_ms"] == 0.0045
    assert max(st["programs_in_loop"]) <= 2 and max(st["programs_in_epilogue"]) <= 2


def test_timeline_cli_appends_its_row(tmp_path, monkeypatch):
    from tools import b6_timeline

    row = {"kind": "timeline", "shape": "b8", "outputs_bitwise_equal": True, "stamps_complete": True}
    monkeypatch.setattr(b6_timeline, "run", lambda shape: dict(row, shape=shape))
    # main() drops TRITON_INTERPRET (it times compiled kernels); give it back to later tests
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    out = tmp_path / "sub" / "timeline.jsonl"
    assert b6_timeline.main(["--shape", "small", "--out", str(out)]) == 0
    assert b6_timeline.main(["--shape", "b8", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["shape"] for r in rows] == ["small", "b8"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["grid1024", "b8"])
def test_b6_timeline_instrument(shape):
    """The timeline instrument on the GPU: outputs bitwise equal to the plain kernel, every
    program stamped, stamps in order, SM ids inside the device."""
    from tools import b6_timeline

    row = b6_timeline.run(shape, reps=2, rounds=1)
    assert row["outputs_bitwise_equal"] and row["stamps_complete"]
    assert row["loop_us"][0] > 0 and row["epilogue_us"][0] > 0
    assert row["n_sm"] <= torch.cuda.get_device_properties(0).multi_processor_count
