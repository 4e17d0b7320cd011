"""Result rows: one JSON object per line under ``benchmarks/results/`` (``KERNEL_FUN_RESULTS``
names another folder), each with the commit and date it was measured at."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ["KERNEL_FUN_RESULTS"]) if os.environ.get("KERNEL_FUN_RESULTS") else \
    REPO / "benchmarks" / "results"


def commit() -> str:
    """The commit the bench ran at: ``KERNEL_FUN_COMMIT`` (set by whoever copied the tree to
    the GPU machine), else git, else ``unknown``."""
    if os.environ.get("KERNEL_FUN_COMMIT"):
        return os.environ["KERNEL_FUN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def stamp(row: dict) -> dict:
    """The row with the commit and date it was measured at."""
    return {**row, "commit": commit(), "date": now()}


def append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def load(directory: Path = RESULTS, kind: str | None = None) -> list[dict]:
    rows = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if kind is None or row.get("kind") == kind:
                    rows.append(row)
    return rows


def latest(rows: list[dict], *keys: str) -> list[dict]:
    """The newest row (by date) for each distinct combination of ``keys``, in first-seen order."""
    best: dict[tuple, dict] = {}
    for row in rows:
        k = tuple(row.get(key) for key in keys)
        if k not in best or row["date"] >= best[k]["date"]:
            best[k] = row
    return list(best.values())
