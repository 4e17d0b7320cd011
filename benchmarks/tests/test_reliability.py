"""The reliability harness (benchmarks.reliability) on the CPU: its comparisons, its NaN map and
its sanitizer parsing on known inputs (each shown to fail where it should), the planted
fault's copy of B6, and the extreme-input and NaN cases through the chain with kernel-fun's
B6 in the interpreter. The GPU run itself (sanitizers, streams, soak) is the harness's
own command on the H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import needs_interpreter
from benchmarks import reliability as rel
from kernel_fun.kda.problems import Problem

# The harness's GPU parts rehearsed through the interpreter, the chain run at every sanitizer
# and extreme shape (minutes on two cores): ``bash scripts/test-research`` runs them, CI's
# default run does not (every kernel they run has its own tests on awkward shapes there).
SLOW = pytest.mark.slow

# The harness's extreme base shrunk for the interpreter: GVA, two sequences, K=64 for B6.
SMALL = Problem("extreme-small", 2, 130, 1, 2, 64, 32, initial_state=True, output_final_state=True)


def test_differences_are_bitwise_and_nan_aware():
    a = {"x": torch.tensor([1.0, float("nan"), 3.0]), "y": None}
    assert rel.differences(a, {"x": a["x"].clone(), "y": None}) == {}
    nudged = a["x"].clone()
    nudged[0] = torch.nextafter(nudged[0], torch.tensor(2.0))
    diff = rel.differences({"x": nudged, "y": None}, a)
    assert set(diff) == {"x"} and 0 < diff["x"] < 1e-6
    assert rel.differences({"x": a["x"], "y": torch.ones(1)}, a) == {"y": float("inf")}


def test_parse_summary():
    assert rel.parse_summary("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n") == 0
    assert rel.parse_summary("========= Invalid __global__ write\n========= ERROR SUMMARY: 12 errors\n") == 12
    assert rel.parse_summary("========= ERROR SUMMARY: 1 error\n") == 1
    assert rel.parse_summary("Traceback (most recent call last):\n") is None  # a child that died says nothing
    racecheck = "========= RACECHECK SUMMARY: {} hazards displayed ({} errors, {} warnings)\n"
    assert rel.parse_summary(racecheck.format(0, 0, 0)) == 0
    assert rel.parse_summary(racecheck.format(3, 1, 2)) == 3


def test_planted_copy_moves_one_store(tmp_path):
    from kernel_fun.kda.kernels import b6_wy_bwd
    from kernel_fun.kda.stages import stages

    module = rel.planted_module(tmp_path)
    source = (tmp_path / rel.PLANTED_FILE).read_text()
    assert rel.PLANT_TO in source and rel.PLANT_FROM not in source
    assert stages()["B6"].impls["ours"] is b6_wy_bwd.wy_dqkg_bwd  # the copy is not the chain's B6
    assert module.wy_dqkg_kernel is not None and module.__file__ == str(tmp_path / rel.PLANTED_FILE)


def _clean_result(p: Problem) -> dict:
    z = lambda *s: torch.zeros(*s)  # noqa: E731
    B, T, H, HV, K, V = p.B, p.T, p.H, p.HV, p.K, p.V
    N = B if p.cu_seqlens is None else len(p.cu_seqlens) - 1
    return {"o": z(B, T, HV, V), "final_state": z(N, HV, K, V), "dq": z(B, T, H, K), "dk": z(B, T, H, K),
            "dv": z(B, T, HV, V), "dg": z(B, T, HV, K), "dbeta": z(B, T, HV), "dh0": z(N, HV, K, V),
            "dA_log": z(HV), "ddt_bias": z(HV * K)}


def test_nan_escapes_knows_the_allowed_region():
    p = dataclasses.replace(SMALL, H=2, HV=4)
    b, t, h = 1, 70, 1  # value heads 2 and 3, chunk [64, 128)
    r = _clean_result(p)
    r["o"][b, t, 2:4] = float("nan")
    r["dk"][b, :128, 1] = float("nan")
    r["dA_log"][2:4] = float("nan")
    assert rel.nan_escapes(r, p, b, t, h) == {}
    for name, where in [("o", (b, t + 1, 2)), ("dk", (b, 128, 1)), ("dk", (0, 3, 1)), ("dv", (b, 10, 1)),
                        ("dA_log", (0,)), ("final_state", (0, 0, 0))]:
        bad = {n: x.clone() for n, x in r.items()}
        bad[name][where] = float("nan")
        assert name in rel.nan_escapes(bad, p, b, t, h), (name, where)
    silent = {n: x.clone() for n, x in r.items()}
    silent["o"][b, t, 3] = 0.0  # a head of the group that lost its NaN
    assert "o" in rel.nan_escapes(silent, p, b, t, h)


def test_nan_escapes_packed_chunks_restart_at_sequence_starts():
    p = dataclasses.replace(SMALL, B=1, T=150, cu_seqlens=(0, 10, 150))
    r = _clean_result(p)
    r["o"][0, 80, 0:2] = float("nan")
    r["dk"][0, 10:138, 0] = float("nan")  # sequence 1's chunks are [10, 74), [74, 138)
    assert rel.nan_escapes(r, p, 0, 80, 0) == {}
    r["dk"][0, 9, 0] = float("nan")  # the other sequence
    assert "dk" in rel.nan_escapes(r, p, 0, 80, 0)


@SLOW
@needs_interpreter
def test_nan_in_one_token_of_q_stays_where_the_math_puts_it():
    row = rel.nan_case("cpu", base=SMALL)
    assert row["ok"], row["escapes"]


@SLOW
@needs_interpreter
@pytest.mark.parametrize("name", list(rel.EXTREME))
def test_extreme_inputs_run_the_chain_within_budgets(name):
    row = rel.extreme_case(name, "cpu", base=SMALL)
    assert row["impls"]["B6"] == "ours", row
    assert row["ok"], row


@SLOW
@needs_interpreter
def test_determinism_repeats_on_the_cpu():
    from kernel_fun.kda import chunk_kda
    from kernel_fun.kda.problems import make_inputs, run_fwd_bwd

    kw = make_inputs(SMALL, seed=2)
    report = rel.determinism(lambda: run_fwd_bwd(chunk_kda, kw, grid=SMALL.dtype), torch.device("cpu"))
    assert report == {"repeat1": {}, "repeat2": {}}


@SLOW
@needs_interpreter
def test_capture_gives_every_kernel_of_ours_every_sanitizer_shape_and_the_child_runs_them(tmp_path, capsys):
    captured = rel.capture_inputs(device="cpu")
    mine = ("F7-F8", "B2", "B3", "B6", "B7-B9")  # in the chain's order of execution
    want = [(stage, p.name) for p in rel.SANITIZE_SHAPES for stage in mine]
    assert [(c["stage"], c["shape"]) for c in captured] == want
    path = tmp_path / "captured.pt"
    torch.save(captured, path)
    rel.run_captured(path, planted=False, device="cpu")
    out = capsys.readouterr().out
    assert {out.count(f"ran {stage} ") for stage in mine} == {len(rel.SANITIZE_SHAPES)}


def test_ours_stages_lists_b6_and_the_b7_b9_unit():
    assert {"F7-F8", "B2", "B3", "B6", "B7-B9"} <= set(rel.ours_stages())


def test_cli_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("the harness runs for real on a GPU")
    assert rel.main(["--parts", "extreme"]) == 2


def test_cli_names_an_unknown_extreme_case(capsys):
    with pytest.raises(SystemExit) as exit_info:
        rel.main(["--parts", "extreme", "--extreme", "T1,no-such-case"])
    assert exit_info.value.code == 2
    assert "no-such-case" in capsys.readouterr().err


def test_cli_names_an_unknown_sanitizer_tool(capsys):
    with pytest.raises(SystemExit) as exit_info:
        rel.main(["--parts", "sanitize", "--tools", "memcheck,leakcheck"])
    assert exit_info.value.code == 2
    assert "leakcheck" in capsys.readouterr().err


@needs_interpreter
def test_offset_child_runs_the_convolution_kernels_on_every_malformed_case(capsys):
    """The memcheck child's kernel case on the CPU: every malformed offsets list reaches the
    convolution's kernels (the interpreter would fault on an access outside a tensor) and
    returns."""
    rel.run_offsets("cconv-kernels", device="cpu")
    assert capsys.readouterr().out.count("ran cconv-kernels ") == len(rel.BAD_OFFSETS)


@pytest.mark.parametrize("which", ["cconv-op", "kda-op"])
def test_offset_child_ops_refuse_the_first_malformed_case(which):
    """On the CPU the ops check host offsets before anything runs (on a GPU, the device
    assert with the same words)."""
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens must rise from 0"):
        rel.run_offsets(which, device="cpu")
