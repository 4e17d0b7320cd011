"""B4-B5 (kda/kernels/b4_b5_dhu.py) through the interpreter: the unit (B4's dv formed in the scan,
dAqk from its own kernel) on the inputs the reference chain gives B4 and B5, against the rounding
references of fla's stages and the float64 ones; and the whole op with the unit in the chain
against the float64 recurrence. T not a multiple of 64, GVA, packed sequences (a 1-token and
zero-length ones among them), initial and final states, a pre-gated call, K 48 / 64 / 100 / 128, V of
one and two slices and of no power of two, fp16 and bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.parity import DHU_VS_FLA, dhu_misses, stage_errors
from benchmarks.stages import b4_b5 as b4_b5_entry
from conftest import DEVICE, needs_triton
from kernel_fun.kda import chunk_kda, last_record
from kernel_fun.kda import reference as ref
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd
from kernel_fun.kda.kernels import b4_b5_dhu
from kernel_fun.kda.stages import capture_stages, stages, use_impls
from test_f7_f8_b3_scan import SHAPES as SCAN_SHAPES

pytestmark = needs_triton

# the scan's awkward shapes (kda/kernels/f7_f8_b3_scan.py's tests) up to K = 128, the unit's reach
SHAPES = [p for p in SCAN_SHAPES if p.K <= 128]


def stage_inputs(p: Problem, seed: int = 8) -> tuple[dict, dict]:
    """B4's and B5's inputs as the reference chain's backward gives them."""
    kw = make_inputs(p, device=DEVICE, seed=seed)
    with use_impls("reference"), capture_stages() as log:
        run_fwd_bwd(chunk_kda, kw, grid=p.dtype)
    found = {name: x for name, _, x, _ in log if name in ("B4", "B5")}
    return found["B4"], found["B5"]


def unit_inputs(b4: dict, b5: dict) -> dict:
    return dict(b4, **{n: t for n, t in b5.items() if n not in ("do", "dv")})


def exact_unit(i: dict) -> tuple:
    """The float64 B4 then B5 (the stage bench entry's)."""
    return b4_b5_entry.BENCH.exact(**i)


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.name)
def test_unit_matches_b4_then_b5(p):
    """dAqk, dh, dh0 and dv2 as the rounding references of fla's B4 then B5 give them, and
    within fla's budgets of the float64 stages, no more than 10% over the references' own
    error."""
    b4, b5 = stage_inputs(p)
    i = unit_inputs(b4, b5)
    got = b4_b5_dhu.dav_dhu(**i)
    want = stages()["B4-B5"].impls["reference"](**i)
    exact = exact_unit(i)
    vs_want = stage_errors("B4-B5", got, want)
    assert set(vs_want) == {"dAqk", "dh", "dv2"} | ({"dh0"} if p.initial_state else set()), vs_want
    misses = dhu_misses(stage_errors("B4-B5", got, exact), stage_errors("B4-B5", want, exact), vs_want)
    assert not misses, (misses, vs_want)


def test_launch_picks_the_v_slice_by_chains():
    """Many chains (prod8192_gate's 256 of V=256, kimi's 256 of V=128, b8's 128) take BV=128 at
    one program an SM; 32 chains (small, fla's layer at B2 T8192) and one take BV=32 at two
    stages. K <= 64 by V alone: BV=128's config where V > 64, else BV=64 at 4 warps, never 8 (BV=64
    at 8 warps over 32-channel halves makes m64n16k16 wgmmas: Triton 3.6 reads their operands past
    the shared allocation, NaN on a GPU)."""
    wide = dict(BV=128, num_warps=8, num_stages=2)
    assert b4_b5_dhu.launch_config(256, 256, 128) == wide
    assert b4_b5_dhu.launch_config(256, 128, 128) == wide
    assert b4_b5_dhu.launch_config(128, 256, 128) == wide
    assert b4_b5_dhu.launch_config(32, 256, 128) == dict(BV=32, num_warps=4, num_stages=2)
    assert b4_b5_dhu.launch_config(32, 128, 128)["BV"] == 32
    assert b4_b5_dhu.launch_config(1, 256, 100)["BV"] == 32
    assert b4_b5_dhu.launch_config(32, 256, 64) == wide
    assert b4_b5_dhu.launch_config(1, 128, 48) == wide
    assert b4_b5_dhu.launch_config(1, 64, 64) == dict(BV=64, num_warps=4, num_stages=2)
    assert b4_b5_dhu.launch_config(256, 32, 64)["num_warps"] == 4


def test_the_launcher_never_picks_a_config_it_declines():
    """No chain count, V or K takes BV=64 at 8 warps over 32-channel halves (K <= 64), whose
    m64n16k16 wgmmas Triton 3.6 reads past their shared allocation, nor a wgmma slice at one
    stage there (NaN and an illegal address on the H200); asked for, either is declined before
    any launch. At K > 64 both run."""
    for chains in (1, 16, 32, 96, 256, 4096):
        for V in (16, 32, 40, 64, 100, 128, 256):
            for K in (32, 48, 64, 100, 128):
                assert b4_b5_dhu.declines(b4_b5_dhu.launch_config(chains, V, K), V, K) is None
    assert b4_b5_dhu.declines(dict(BV=128, num_warps=8), 64, 64)  # (clipped to V: BV=64 at 8 warps)
    for bv, warps in ((64, 4), (128, 8)):
        one_stage = dict(BV=bv, num_warps=warps, num_stages=1)
        assert "one stage" in b4_b5_dhu.declines(one_stage, 256, 64)
        assert "one stage" in b4_b5_dhu.declines(one_stage, 128, 48)
        assert b4_b5_dhu.declines(one_stage, 256, 100) is None
        assert b4_b5_dhu.declines(dict(one_stage, num_stages=2), 256, 64) is None
    assert b4_b5_dhu.declines(dict(BV=32, num_warps=4, num_stages=1), 256, 64) is None  # (mma.sync)
    assert b4_b5_dhu.declines(dict(BV=128, num_warps=8, num_stages=1), 32, 64) is None  # (clipped: BV=32)
    b4, b5 = stage_inputs(dataclasses.replace(SHAPES[0], name="T63-K64-V64-h0", V=64))
    with pytest.raises(ValueError, match="m64n16k16"):
        b4_b5_dhu.dav_dhu(**unit_inputs(b4, b5), config=dict(BV=64, num_warps=8, num_stages=2))
    with pytest.raises(ValueError, match="one stage"):
        b4_b5_dhu.dav_dhu(**unit_inputs(b4, b5), config=dict(BV=64, num_warps=4, num_stages=1))


def test_a_wrong_scan_misses_its_bars():
    """The bars can fail: dv formed without Aqk's diagonal, or one chunk's dh left out."""
    b4, b5 = stage_inputs(SHAPES[0])
    i = unit_inputs(b4, b5)
    want = stages()["B4-B5"].impls["reference"](**i)
    exact = exact_unit(i)
    pos = ref.sequence_positions(i["Aqk"].shape[1], i["cu_seqlens"], i["Aqk"].device) % 64
    diagonal = (torch.arange(64)[None, :] == pos[:, None])[None, :, None, :]
    got = b4_b5_dhu.dav_dhu(**dict(i, Aqk=i["Aqk"].masked_fill(diagonal, 0)))
    assert dhu_misses(stage_errors("B4-B5", got, exact), stage_errors("B4-B5", want, exact),
                      stage_errors("B4-B5", got, want))
    dA, dh, dh0, dv2 = b4_b5_dhu.dav_dhu(**i)
    dh[:, 0] = 0
    assert stage_errors("B4-B5", (dA, dh, dh0, dv2), want)["dh"] > DHU_VS_FLA["dh"]


@pytest.mark.parametrize("p", [SHAPES[1], SHAPES[3],
                               Problem("layer-vfirst", 1, 100, 2, 2, 64, 32, initial_state=True,
                                       output_final_state=True, state_v_first=True),
                               Problem("varlen-empty", 1, 130, 1, 2, 64, 32, initial_state=True,
                                       output_final_state=True, cu_seqlens=(0, 0, 70, 70, 130))],
                         ids=lambda p: p.name)
def test_chain_with_the_unit_against_the_oracle(p):
    """The chain runs the unit in place of B4 and B5 (the launch witness: the call's record),
    and the forward and every gradient stay within fla's budgets of the float64 recurrence;
    zero-length sequences among packed ones included."""
    kwargs = make_inputs(p, device=DEVICE, seed=12)
    result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.backward["B4-B5"] == "ours" and not {"B4", "B5"} & set(record.backward), record.backward
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    errors = {n: ref.rel_rms(result[n], oracle[n]) for n in oracle if oracle[n] is not None}
    assert all(errors[n] <= ref.BUDGETS[n] for n in errors), errors


def test_what_the_unit_declines_runs_as_b4_then_b5():
    """K > 128, states in [V, K], fp32 inputs and another chunk size are declined with the reason;
    the chain then runs B4 and B5."""
    kg = torch.empty(1, 64, 1, 160)
    assert "K=160" in b4_b5_dhu.supports(kg=kg.bfloat16(), chunk_size=64)
    assert "[V, K]" in b4_b5_dhu.supports(kg=kg[..., :64].bfloat16(), chunk_size=64, state_v_first=True)
    assert "chunk_size=32" in b4_b5_dhu.supports(kg=kg[..., :64].bfloat16(), chunk_size=32)
    assert "float32" in b4_b5_dhu.supports(kg=kg[..., :64], chunk_size=64)
    p = Problem("T70-K160", 1, 70, 1, 1, 160, 16, initial_state=True, output_final_state=True)
    run_fwd_bwd(chunk_kda, make_inputs(p, device=DEVICE, seed=3), grid=p.dtype)
    record = last_record()
    assert "B4-B5" not in record.backward and {"B4", "B5"} <= set(record.backward), record.backward
    assert "K=160" in record.notes["B4-B5"]


def test_the_stage_bench_entry_runs_on_the_cpu(tmp_path, monkeypatch):
    """benchmarks.stage's B4-B5 entry end to end under the interpreter (the rounding references
    standing in for fla's stages): parity green at the pin and at another config; the pin's row
    ships, the other's does not."""
    import time

    from benchmarks import stage
    from benchmarks.stages import common

    tiny = Problem("tiny", 1, 70, 1, 2, 64, 64, initial_state=True, output_final_state=True)
    monkeypatch.setattr(stage, "problem", lambda name: tiny)
    monkeypatch.setattr(common, "problem", lambda name: tiny)

    def stopwatch(fn, reps):
        t0 = time.perf_counter()
        fn()
        return [(time.perf_counter() - t0) * 1e3]

    bench = stage.entries()["B4-B5"]
    monkeypatch.setattr(type(bench), "fla", lambda self, **i: stages()[self.stage].impls["reference"](**i))
    found = stage.bench_shape(bench, "tiny", [{}, dict(BV=32, num_warps=4, num_stages=1)], reps=1, rounds=1,
                              out_path=tmp_path / "stages.jsonl", device="cpu", timer=stopwatch)
    assert [r["impl"] for r in found][0] == "fla" and len(found) == 3
    assert all(r["parity"]["ok"] and r["ms"] > 0 for r in found), [r["parity"] for r in found]
    assert [bench.ships(dict(r, shape="tiny")) for r in found] == [False, True, False]
