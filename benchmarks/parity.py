"""Stage-level comparisons and bars: one stage's outputs from two implementations on the same
inputs (the stage bench's parity gate, and the GPU tests' against fla's stages)."""

from __future__ import annotations

import torch

from kernel_fun.kda import reference as ref
from kernel_fun.kda.stages import stages


def tril_mask(A: torch.Tensor, chunk: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """[B, T, HV, BT] score layout: True where the column is at or before the row in its chunk
    (chunks restart at every sequence start of a packed batch)."""
    pos = ref.sequence_positions(A.shape[1], cu_seqlens, A.device)
    col = torch.arange(A.shape[-1], device=A.device)
    return (col[None, :] <= (pos % chunk)[:, None])[None, :, None, :]


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def stage_errors(stage: str, out, want, chunk: int = 64, cu_seqlens: torch.Tensor | None = None) -> dict[str, float]:
    """Relative RMS error of each output of ``stage`` (``out`` against ``want``). Parts a
    kernel leaves unwritten by contract are compared as zero: the upper triangle of Aqk
    (never read downstream)."""
    names = stages()[stage].outputs
    errors = {}
    for name, a, b in zip(names, as_tuple(out), as_tuple(want)):
        if a is None or b is None:
            if (a is None) != (b is None):
                errors[name] = float("inf")
            continue
        if name == "Aqk":
            mask = tril_mask(b, chunk, cu_seqlens)
            a, b = torch.where(mask, a, 0), torch.where(mask, b, 0)
        errors[name] = ref.rel_rms(a, b)
    return errors


# B6 (the WY backward) against fla's stage on the same inputs: dq, dk and dv2 are fp32
# reassociations of fla's sums (1e-4); db, dg and dA carry cancelling terms, so fla's budgets.
B6_VS_FLA = {"dq": 1e-4, "dk": 1e-4, "dv": 1e-4, "db": 0.02, "dg": 0.02, "dA": 0.02}
# B6 against the float64 stage: fla's budgets for the gradients these feed (db feeds dbeta;
# dA, an intermediate, takes the looser one).
B6_BUDGETS = {"dq": ref.BUDGETS["dq"], "dk": ref.BUDGETS["dk"], "dv": ref.BUDGETS["dv"],
              "db": ref.BUDGETS["dbeta"], "dg": ref.BUDGETS["dg"], "dA": ref.BUDGETS["dg"]}


def bar_misses(vs_exact: dict, baseline_exact: dict, vs_fla: dict | None, fla_bars: dict,
               exact_bars: dict) -> dict[str, tuple]:
    """A stage's outputs that miss their bar, with (error, bar): against fla's stage (when
    ``vs_fla`` is given) within ``fla_bars``; against the float64 stage within ``exact_bars``
    and no more than 10% worse than ``baseline_exact`` (fla's own error, or that of the
    reference which rounds where fla rounds). Where that baseline itself misses its float64
    bar (fla's dA_log under gates strong enough that a chunk's decay underflows: 0.41 on the
    H100), fla's stage is no reference for that output and only the float64 bar holds it."""
    misses = {}
    for name, err in (vs_fla or {}).items():
        if baseline_exact.get(name, 0.0) > exact_bars[name]:
            continue
        if not err <= fla_bars[name]:
            misses[f"{name} vs fla"] = (err, fla_bars[name])
    for name, err in vs_exact.items():
        bar = min(exact_bars[name], 1.1 * baseline_exact[name] + 1e-7)
        if not err <= bar:
            misses[f"{name} vs exact"] = (err, bar)
    return misses


def b6_misses(vs_exact: dict, baseline_exact: dict, vs_fla: dict | None = None) -> dict[str, tuple]:
    """B6's misses (``bar_misses``): ``B6_VS_FLA`` against fla's stage, ``B6_BUDGETS``
    against the float64 stage."""
    return bar_misses(vs_exact, baseline_exact, vs_fla, B6_VS_FLA, B6_BUDGETS)


# B7 (the intra-chunk backward): fla's budgets for the gradients these outputs are (db feeds
# dbeta, dg the gate's), against fla's stage and the float64 stage alike.
B7_BARS = {"dq": ref.BUDGETS["dq"], "dk": ref.BUDGETS["dk"], "db": ref.BUDGETS["dbeta"], "dg": ref.BUDGETS["dg"]}


# The B7-B9 unit: B7's bars, and the gate parameters' gradients at fla's budgets
TAIL_BARS = {**B7_BARS, "dA_log": ref.BUDGETS["dA_log"], "ddt_bias": ref.BUDGETS["ddt_bias"]}


def tail_misses(vs_exact: dict, baseline_exact: dict, vs_fla: dict | None = None) -> dict[str, tuple]:
    """The B7-B9 unit's misses (``bar_misses``), ``TAIL_BARS`` on both sides."""
    return bar_misses(vs_exact, baseline_exact, vs_fla, TAIL_BARS, TAIL_BARS)


# The F7-F8 unit (the scan with its output): against fla's two stages, the bf16 roundings
# fla makes at the same points leave fp32 reassociation only (2e-3 covers a last-bit flip of
# a rounded h or v_new carried through the chunks); against the float64 stage, fla's budgets
# for o and the final state (h and v_new are o's inputs: the same bars).
SCAN_VS_FLA = {"o": 2e-3, "final_state": 2e-3, "h": 2e-3, "v_new": 2e-3}
SCAN_BUDGETS = {"o": ref.BUDGETS["o"], "final_state": ref.BUDGETS["final_state"], "h": ref.BUDGETS["o"],
                "v_new": ref.BUDGETS["o"]}


def scan_misses(vs_exact: dict, baseline_exact: dict, vs_fla: dict | None = None) -> dict[str, tuple]:
    """The F7-F8 unit's misses (``bar_misses``): ``SCAN_VS_FLA`` against fla's stages,
    ``SCAN_BUDGETS`` against the float64 stage."""
    return bar_misses(vs_exact, baseline_exact, vs_fla, SCAN_VS_FLA, SCAN_BUDGETS)


# B2 (the WY vectors recomputed): w, qg and kg are bf16 and what the backward's stages read, so
# against fla's stage each within fla's own budget for o (its sums in another order move a
# bf16 value by a unit: ~1e-3 relative RMS of fla's, measured on the H200); against the float64
# stage, o's budget and no more than 10% worse than fla's own error. u, not written, is not
# compared.
WY_BARS = dict.fromkeys(("w", "u", "qg", "kg"), ref.BUDGETS["o"])


def wy_misses(vs_exact: dict, baseline_exact: dict, vs_fla: dict | None = None) -> dict[str, tuple]:
    """B2's misses (``bar_misses``), ``WY_BARS`` on both sides."""
    return bar_misses(vs_exact, baseline_exact, vs_fla, WY_BARS, WY_BARS)


# The reverse state scan (B5, and the B4-B5 unit): against fla's stages, dh, dv2 and dh0 carry bf16
# roundings at fla's points through the chunks (the forward scan's 2e-3), dAqk is an fp32 sum in
# another order (1e-4); against the float64 stages, fla's budgets for the gradients they are or
# feed (dh and dv2 as dv, dAqk as dq).
DHU_VS_FLA = {"dAqk": 1e-4, "dh": 2e-3, "dh0": 2e-3, "dv2": 2e-3}
DHU_BUDGETS = {"dAqk": ref.BUDGETS["dq"], "dh": ref.BUDGETS["dv"], "dh0": ref.BUDGETS["dh0"], "dv2": ref.BUDGETS["dv"]}


def dhu_misses(vs_exact: dict, baseline_exact: dict, vs_fla: dict | None = None) -> dict[str, tuple]:
    """B5's and the B4-B5 unit's misses (``bar_misses``): ``DHU_VS_FLA`` against fla's stages,
    ``DHU_BUDGETS`` against the float64 stages."""
    return bar_misses(vs_exact, baseline_exact, vs_fla, DHU_VS_FLA, DHU_BUDGETS)
