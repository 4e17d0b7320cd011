"""Does kernel-fun help on this GPU? Three benches, each with a parity gate before any speed
(a red gate times nothing), CUDA-event medians with their spread, fla timed in the same
process:

- ``python -m kernel_fun.bench``: the whole ``chunk_kda`` op (``op.py``), fla's against
  kernel-fun's, with first-call seconds, peak memory and device time per stage;
- ``python -m kernel_fun.bench.layer``: fla's own ``KimiDeltaAttention`` layer, unpatched and
  through ``kernel_fun.patch_fla()``;
- ``python -m kernel_fun.bench.cconv``: ``causal_conv1d``, forward and fwd+bwd.

Each returns its results as rows (dicts) and prints them; the repository's ``benchmarks/``
writes the rows its README is generated from.
"""
