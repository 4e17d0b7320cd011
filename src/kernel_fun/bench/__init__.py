"""Benchmarks that cannot lie: a parity gate before any speed, CUDA-event medians with their
spread, per-stage device time, first-call seconds and peak memory, appended as data rows
under ``bench/results/``. ``python -m kernel_fun.bench`` runs it (on a GPU);
``python -m kernel_fun.bench.readme`` regenerates the README's numbers from the rows."""
