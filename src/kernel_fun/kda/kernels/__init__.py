"""kernel-fun's kernels for KDA's stages, one module per stage unit: each holds its
``@triton.jit`` code, its launcher with fla's stage contract, its pinned configs and its
``supports`` predicate, and registers itself as the stage's ``ours`` implementation.

- ``wy_bwd``: B6, the WY backward.
"""
