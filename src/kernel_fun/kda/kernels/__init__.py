"""kernel-fun's kernels for KDA's stages, one module per stage unit, and their registration as
each stage's ``ours`` implementation (with its support predicate and what it declares of
``kernel_fun.kda.stages.CAPS``):

============  ========================  ================================================
stage         module                    what runs
============  ========================  ================================================
B2            ``b2_wy_recompute``       w, qg, kg recomputed from Akk_inv, no u
B3, F7-F8     ``f7_f8_b3_scan``         the state scan: with the output (F7 + F8 in one
                                        pass), or as B3 forming u itself
B6            ``b6_wy_bwd``             the WY backward
B7-B9         ``b7_b9_intra_bwd``       the intra-chunk backward, dg's chunk cumsum and
                                        the gate's backward in one pass
============  ========================  ================================================

Each module holds its ``@triton.jit`` code, its launcher with fla's stage contract, its pinned
configs and its ``supports``; it imports torch, triton and ``kernel_fun._triton`` only. Every
other stage runs fla's kernel on a GPU and the torch reference on a CPU.
"""

from kernel_fun.kda.kernels import b2_wy_recompute, b6_wy_bwd, b7_b9_intra_bwd, f7_f8_b3_scan
from kernel_fun.kda.stages import add_impl

add_impl("B2", "ours", b2_wy_recompute.wy_recompute, b2_wy_recompute.supports)
add_impl("B3", "ours", f7_f8_b3_scan.scan_states, f7_f8_b3_scan.supports_states, caps=("forms_u",))
add_impl("F7-F8", "ours", f7_f8_b3_scan.scan_output, f7_f8_b3_scan.supports, caps=("reads_qg",))
add_impl("B6", "ours", b6_wy_bwd.wy_dqkg_bwd, b6_wy_bwd.supports)
add_impl("B7-B9", "ours", b7_b9_intra_bwd.intra_bwd, b7_b9_intra_bwd.supports)
