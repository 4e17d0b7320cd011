"""The measuring harness of kernel-fun's shipped kernels (not installed; run from the
repository root): every bench writes its rows here, and the README's numbers are generated
from them.

- ``python -m benchmarks.op``: the whole op (``kernel_fun.bench``'s), rows to
  ``results/chunk_kda.jsonl``; ``--candidate STAGE=module:function`` measures an
  implementation not yet registered, ``--off STAGE`` a stage of ours put on fla's.
- ``python -m benchmarks.layer``, ``python -m benchmarks.cconv``: fla's layer and the
  convolution (``--configs sweep``).
- ``python -m benchmarks.stage --stage B6``: one stage alone against fla's stage, its config
  sweep (each stage's entry in ``stages/``).
- ``python -m benchmarks.compile_report``: the shipped kernels compiled for sm_90a without a
  GPU: registers, spills, shared memory, the machine code's fingerprint.
- ``python -m benchmarks.reliability``: determinism, the compute sanitizers, a soak and
  extreme inputs, on the GPU.
- ``python -m benchmarks.readme``: the README's tables from the rows.

Rows are JSON lines with the GPU, versions, commit and date (``rows.py``); fla's autotune
choices are stored beside them (``fla_configs/``, ``fla_configs.py``).
"""
