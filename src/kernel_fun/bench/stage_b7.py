"""B7's entry in the stage bench (``kernel_fun.bench.stage``): its inputs, its bytes, the
configs worth timing, and its parity bars.

``python -m kernel_fun.bench.stage --stage B7 --shapes prod8192_gate,prod8192_layer_safe --configs sweep``

B7's inputs are random, of the magnitudes a real chain gives: unit q/k rows, a Kimi-style
gate cumsum, beta in (0, 1), fp32 dAqk/dAkk with B6's zeros (dAqk above the diagonal, dAkk
on and above it) and the dq, dk, db, dg B6 hands on. Parity
(``kda.parity.b7_misses``): against fla's stage within fla's budgets (dq, dk 0.008; db,
dg 0.02); against the float64 stage within the same and within 10% of fla's own error.
"""

from __future__ import annotations

import sys

import torch

from kernel_fun.bench.stage import StageBench, main as _stage_main, qk_and_gate
from kernel_fun.kda.kernels import intra_bwd
from kernel_fun.kda.kernels.intra_bwd import PIN

# The configs worth timing (the note at intra_bwd.DEFAULT_CONFIG): the pin (wide-halves-pf:
# the chunk anchor, the half-chunk anchors, the per-block form, the epilogue's incoming tiles
# asked of L2 at the start), the same with two-product dots (wide-halves-pf-x2), the pin
# without the prefetch (wide-halves) at its build and at
# 16-channel slices (no spills, twice the programs), and the designs without a tier each:
# wide-chunk (no half-chunk tier), wide (the per-block form only) and wide-pairwise (every
# diagonal pairwise: what a saturated gate costs).
_B = dict(BK=32, num_warps=4, num_stages=1)
_B16 = dict(BK=16, num_warps=4, num_stages=1)
SWEEP = {"wide-halves-pf": [_B], "wide-halves-pf-x2": [_B], "wide-halves": [_B, _B16], "wide-chunk": [_B], "wide": [_B], "wide-pairwise": [_B]}


def b7_reads(p) -> int:
    """The bytes B7 reads at the fewest: q, k, gc, beta, dAqk, dAkk and the incoming dq, dk,
    db, dg once each."""
    tok_h, tok_hv = p.B * p.T * p.H, p.B * p.T * p.HV
    return 2 * tok_h * p.K * 2 + tok_hv * p.K * 4 + tok_hv * 2 + 2 * tok_hv * 64 * 4 + 3 * tok_hv * p.K * 4 + tok_hv * 4


def b7_bytes(p) -> int:
    """The fewest bytes B7 moves: its reads, and dq, dk, db, dg (fp32) written once."""
    tok_hv = p.B * p.T * p.HV
    return b7_reads(p) + 3 * tok_hv * p.K * 4 + tok_hv * 4


def make_inputs(p, device, seed: int = 0) -> dict:
    randn, q, k, gc = qk_and_gate(p, device, seed)
    B, T, HV, K = p.B, p.T, p.HV, p.K
    f32 = torch.float32
    # dA as B6 writes it: zero above the diagonal, and dAkk on it too (Akk is strictly lower).
    # fla's B7 reads dAkk's diagonal and relies on that zero; ours reads only s < r.
    pos = torch.arange(T, device=device) % 64
    col = torch.arange(64, device=device)
    lower = (col[None, :] <= pos[:, None]).view(1, T, 1, 64)
    strict = (col[None, :] < pos[:, None]).view(1, T, 1, 64)
    return dict(
        q=q, k=k, gc=gc, beta=torch.sigmoid(randn(B, T, HV, dtype=f32)).bfloat16(),
        dAqk=randn(B, T, HV, 64, scale=0.1, dtype=f32) * lower,
        dAkk=randn(B, T, HV, 64, scale=0.1, dtype=f32) * strict,
        dq=randn(B, T, HV, K, dtype=f32), dk=randn(B, T, HV, K, dtype=f32), db=randn(B, T, HV, dtype=f32),
        dg=randn(B, T, HV, K, dtype=f32),
        chunk_size=64, cu_seqlens=None, chunk_indices=None, safe_gate=p.safe_gate,
    )


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_intra_bwd

    return _fla_intra_bwd(**inputs)


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    return ref.intra_bwd(**{n: t for n, t in inputs.items() if n not in ("chunk_indices", "safe_gate")}, exact=True)


def _ours(inputs, design, config):
    return intra_bwd.intra_bwd(**inputs, **(config or intra_bwd.DEFAULT_CONFIG), design=design)


def _launch_config(p, design, overrides):
    if design not in intra_bwd.DESIGNS:
        raise ValueError(f"unknown B7 design {design!r}")
    return {**intra_bwd.DEFAULT_CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import b7_misses

    return b7_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B7", make_inputs=make_inputs, bytes=b7_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=(PIN,))


def main(argv=None) -> int:
    return _stage_main(argv, stage="B7")


if __name__ == "__main__":
    sys.exit(main())
