"""kernel-fun's kernels for KDA's stages, one module per stage unit: each holds its
``@triton.jit`` code, its launcher with fla's stage contract, its pinned configs and its
``supports`` predicate, and registers itself as the stage's ``ours`` implementation.

- ``wy_bwd``: B6, the WY backward.
- ``intra_bwd``: B7 and the B7-B9 unit (B7 with B8 and B9 in the same pass).
- ``scan_fwd``: the F7-F8 unit (the state scan with the output) and B3 (the scan recomputed,
  forming u itself).
- ``wy_fwd``: B2, the WY vectors recomputed from Akk_inv (without u where B3 forms it).
- ``prep_fwd``: F3-F6 and the F1-F6 unit, candidates.
- ``diag_fwd``: F1, F2 and F4 in one kernel, with fla's F5 and F6 after it the F1-F6 unit, a
  candidate.
"""
