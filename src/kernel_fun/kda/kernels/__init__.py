"""kernel-fun's kernels for KDA's stages, one module per stage unit, and their registration as
each stage's ``ours`` implementation (with its support predicate and what it declares of
``kernel_fun.kda.stages.CAPS``):

============  ========================  ================================================
stage         module                    what runs
============  ========================  ================================================
B2            ``b2_wy_recompute``       w, qg, kg recomputed from Akk_inv, no u
B3, F7-F8     ``f7_f8_b3_scan``         the state scan: with the output (F7 + F8 in one
                                        pass), or as B3 forming u itself
B4-B5         ``b4_b5_dhu``             the reverse state scan forming B4's dv, and
                                        B4's dAqk
B6            ``b6_wy_bwd``             the WY backward
B7-B9         ``b7_b9_intra_bwd``       the intra-chunk backward, dg's chunk cumsum and
                                        the gate's backward in one pass; on sm_90 with
                                        CuTe DSL, ``b7_b10_intra_bwd_sm90``'s kernel
                                        where it takes the call
B7-B10        ``b7_b10_intra_bwd_sm90`` that and the l2norm's backward in one CuTe DSL
                                        kernel (sm_90 with CuTe DSL only)
============  ========================  ================================================

Each Triton module holds its ``@triton.jit`` code, its launcher with fla's stage contract, its
pinned configs and its ``supports``; it imports torch, triton and ``kernel_fun._triton`` only.
``b7_b10_intra_bwd_sm90`` imports CuTe DSL (``nvidia-cutlass-dsl``, the ``sm90`` extra) only
when its kernel is built. Every other stage runs fla's kernel on a GPU and the torch
reference on a CPU.
"""

import logging

from kernel_fun._runtime import log_once
from kernel_fun.kda.kernels import (b2_wy_recompute, b4_b5_dhu, b6_wy_bwd, b7_b9_intra_bwd, b7_b10_intra_bwd_sm90,
                                   f7_f8_b3_scan)
from kernel_fun.kda.stages import add_impl


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
              cu_seqlens, chunk_indices):
    """B7-B9's ``ours``: the CuTe kernel where it takes the call (an sm_90 GPU with CuTe DSL, the
    gate in the op, K = 64 or 128), else the Triton unit, which takes every call B7-B9's
    ``supports`` does. Where a CUDA device's call goes to the Triton unit, one log line says why."""
    args = (q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound, chunk_size,
            cu_seqlens, chunk_indices)
    why = b7_b10_intra_bwd_sm90.supports(*args)
    if why is None:
        return b7_b10_intra_bwd_sm90.intra_bwd(*args)
    if k.is_cuda:
        log_once(logging.INFO, f"B7-B9: the CuTe kernel declined ({why}); the Triton unit runs")
    return b7_b9_intra_bwd.intra_bwd(*args)


add_impl("B2", "ours", b2_wy_recompute.wy_recompute, b2_wy_recompute.supports)
add_impl("B3", "ours", f7_f8_b3_scan.scan_states, f7_f8_b3_scan.supports_states, caps=("forms_u",))
add_impl("F7-F8", "ours", f7_f8_b3_scan.scan_output, f7_f8_b3_scan.supports, caps=("reads_qg",))
add_impl("B4-B5", "ours", b4_b5_dhu.dav_dhu, b4_b5_dhu.supports)
add_impl("B6", "ours", b6_wy_bwd.wy_dqkg_bwd, b6_wy_bwd.supports)
add_impl("B7-B9", "ours", intra_bwd, b7_b9_intra_bwd.supports)
add_impl("B7-B10", "ours", b7_b10_intra_bwd_sm90.intra_bwd_l2, b7_b10_intra_bwd_sm90.supports_l2)
