"""Research instruments: probes and ablation kernels that helped find and explain the shipped
designs, kept beside the package with their tests (``bash scripts/test-research``) and not
installed. Nothing under ``src/`` or ``tests/`` imports them. Run from the repository root,
e.g. ``python -m research.b7_tiers --shapes prod8192_gate``.

- ``b6_stream``: a kernel that moves exactly B6's bytes and computes next to nothing (what
  B6's access pattern costs at a given residency).
- ``ws_probe``: what Triton 3.6's Hopper warp specialization takes, compiled for sm_90a.
- ``b7_tiers``: the share of B7's programs taking one, two, three or more levels on the chain's own gate.
- ``profile_stage``: a stage's kernel run a few times for Nsight Compute.
- ``b6_ws_probe``, ``b6_gluon``: B6 as warp-specialized Gluon kernels (docs/log/bwd-fused.md).
- ``b7_cute_probe``: B7-B10's CuTe DSL kernel (``kernel_fun.kda.kernels.b7_b10_intra_bwd_sm90``)
  as an instrument: its sums in float64, its arithmetic in torch, one head timed on a GPU
  against the Triton unit (docs/log/bwd-fused.md).

A candidate kernel (one not yet measured the winner on the H200) lives here too, with its
tests, until it is registered in the package: ``python -m benchmarks.op --candidate
STAGE=research.<module>:<function>`` measures it in the whole op.
"""
