"""Each shipped kernel's entry in the stage bench (``benchmarks.stage``), one module a stage
unit: its inputs, its bytes, its float64 stage, the configs worth timing and its parity bars.
Adding a kernel adds one module and one line in ``entries()``."""

from __future__ import annotations

from benchmarks.stages.common import StageBench


def entries() -> dict[str, StageBench]:
    """Every kernel with a bench entry, by its entry's name (the stage's, or for B7-B9's CuTe
    kernel ``B7-B9-sm90``)."""
    from benchmarks.stages import b2, b3, b4_b5, b6, b7_b9, f7_f8

    return {e.name: e for e in (b2.BENCH, b3.BENCH, b4_b5.BENCH, b6.BENCH, b7_b9.BENCH,
                                b7_b9.BENCH_SM90, f7_f8.BENCH)}
