"""The bench's CPU-side parts: fla's config files round-trip through fla's own loader, and
the README's numbers are exactly what the committed result rows generate."""

from __future__ import annotations

import json
import os

import triton

from kernel_fun.bench import fla_configs, results


def test_fla_config_dump_is_read_back_by_fla(tmp_path, monkeypatch):
    import fla.ops.utils.cache as cache
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_kernel_wy_dqkg_fused as kernel

    tuner = kernel.fn if not isinstance(kernel, cache.CachedAutotuner) else kernel
    assert isinstance(tuner, cache.CachedAutotuner)
    key = (64, 16, False, "torch.bfloat16", "torch.float32")
    chosen = triton.Config({"BK": 64, "BV": 128}, num_warps=4, num_stages=3)
    monkeypatch.setitem(tuner.cache, key, chosen)
    assert fla_configs.dump(tmp_path) >= 1
    data = json.loads((tmp_path / f"{tuner.kernel_name}.json").read_text())
    assert data["kernel_name"] == tuner.kernel_name

    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    cache.load_config_file.cache_clear()
    loaded = cache.load_cached_config(tuner.kernel_name, cache.AutotuneKey(autotune_key=key))
    assert loaded == {"kwargs": {"BK": 64, "BV": 128}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    other = cache.AutotuneKey(autotune_key=(64, 32, False, "torch.bfloat16", "torch.float32"))
    assert cache.load_cached_config(tuner.kernel_name, other) is None  # strict: exact keys only
    # a packed call's key (two more dtypes) matches no entry, even fuzzily; FULL runs the default
    packed = cache.AutotuneKey(autotune_key=key + ("torch.int64", "torch.int64"))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.FUZZY)
    cache.load_config_file.cache_clear()
    assert cache.load_cached_config(tuner.kernel_name, packed) is None
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.FULL)
    cache.load_config_file.cache_clear()
    assert cache.load_cached_config(tuner.kernel_name, packed) == loaded
    cache.load_config_file.cache_clear()


def test_stored_fla_configs_carry_a_default():
    for path in sorted((fla_configs.CONFIG_ROOT / "NVIDIA_H200").glob("*.json")):
        data = json.loads(path.read_text())
        assert data["default_config"] is not None, path.name


def _row(**kw):
    row = {"kind": "chunk_kda", "shape": "prod8192_gate", "impl": "fla", "fwd_ms": 9.0, "fwdbwd_ms": 46.0,
           "first_call_s": 250.0, "peak_gib": 22.6, "parity": {"ok": True}, "gpu": "NVIDIA H200",
           "date": "2026-11-30T10:00:00+00:00", "commit": "abc"}
    row.update(kw)
    return row


def test_readme_table_is_generated_from_rows(tmp_path):
    results.append(tmp_path / "a.jsonl", _row())
    results.append(tmp_path / "a.jsonl", _row(impl="chain_fla", fwdbwd_ms=46.46, parity={"ok": True, "bitwise_vs_fla": True}))
    results.append(tmp_path / "a.jsonl", _row(impl="chain_fla", fwdbwd_ms=50.0, date="2026-11-29T10:00:00+00:00"))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{results.TABLE_BEGIN}\nstale\n{results.TABLE_END}\noutro\n")
    assert results.update_readme(readme, tmp_path, sweep_docs={})
    text = readme.read_text()
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "| prod8192_gate | kernel-fun, every stage on fla (control) | 9.00 | 46.46 | 0.990x |" in text
    assert "50.00" not in text  # the newer row wins
    assert not results.update_readme(readme, tmp_path, sweep_docs={})


def test_repository_readme_and_sweep_doc_are_current(tmp_path):
    import shutil

    readme = tmp_path / "README.md"
    shutil.copy(results.README, readme)
    docs = {stage: tmp_path / doc.name for stage, doc in results.SWEEP_DOCS.items()}
    for stage, doc in results.SWEEP_DOCS.items():
        shutil.copy(doc, docs[stage])
    assert not results.update_readme(readme, results.RESULTS, docs), "run `python -m kernel_fun.bench.readme`"


def test_red_rows_say_so():
    assert "RED" not in results.op_table([_row(), _row(impl="ours")])
    assert "RED" in results.op_table([_row(), _row(impl="ours", parity={"ok": False})])
    assert "dk over budget" in results.op_table([_row(parity={"ok": True, "over_budget": ["dk"]})])


def test_readme_stage_table_lists_shipped_designs_only():
    from kernel_fun.kda.kernels.wy_bwd import CONFIGS

    pinned = dict(CONFIGS[("fullk", 128)], HEADS_FAST=True)  # b8: K=128, 128 (b, hv) pairs
    stage = dict(kind="stage", stage="B6", shape="b8", ms=1.0, spread_ms=[0.9, 1.1], floor_ms=0.5, gpu="H200",
                 date="2026-11-30T10:00:00+00:00", commit="abc", parity={"ok": True}, config=pinned)
    rows = [dict(stage, impl="fla", design="fla", ms=2.0), dict(stage, impl="fullk[x]", design="fullk"),
            dict(stage, impl="gone[x]", design="gone")]
    assert "| gone |" not in results.render(rows) and "| fullk |" in results.render(rows)
    assert "| gone |" in results.render_sweep(rows)
    # A faster row of a config that does not ship (another commit's kernel, another
    # blocking) stays in the sweep record and out of the README.
    faster = dict(stage, impl="fullk[y]", design="fullk", ms=0.5, config=dict(pinned, BV=32))
    assert "0.500" not in results.render(rows + [faster]) and "1.000" in results.render(rows + [faster])
    assert "0.500" in results.render_sweep(rows + [faster])

    # The newest run of the shipped config stands for it, even when an older kernel's row
    # with the same config was faster; within one run the fastest config.
    newer = dict(stage, impl="fullk[z]", design="fullk", ms=1.5, commit="def", date="2026-11-30T11:00:00+00:00")
    assert "1.500" in results.render(rows + [newer]) and "1.000" not in results.render(rows + [newer])
    older = dict(stage, impl="fullk[z]", design="fullk", ms=0.7, commit="old", date="2026-11-29T11:00:00+00:00")
    assert "1.000" in results.render(rows + [older]) and "0.700" not in results.render(rows + [older])


def test_readme_stage_rows_follow_the_launch_order_rule():
    """A fullk row counts as shipped only in the launch order the rule picks at its shape:
    b8 (K=128, 128 (b, hv) pairs) ships b*hv fastest, small (32 pairs) and k64 (K=64) fla's
    order; rows without the key ran fla's order."""
    from kernel_fun.kda.kernels.wy_bwd import CONFIGS

    def row(shape, ms, heads_fast=None, K=128):
        config = dict(CONFIGS[("fullk", K)])
        if heads_fast is not None:
            config["HEADS_FAST"] = heads_fast
        return dict(kind="stage", stage="B6", shape=shape, impl="fullk[x]", design="fullk", ms=ms,
                    spread_ms=[ms, ms], floor_ms=0.1, gpu="H200", date="2026-11-30T10:00:00+00:00",
                    commit="abc", parity={"ok": True}, config=config)

    table = results.render([row("b8", 0.777), row("b8", 0.888, True), row("small", 0.555, True),
                            row("small", 0.666), row("k64", 0.333, True, K=64), row("k64", 0.444, False, K=64)])
    assert "0.888" in table and "0.777" not in table
    assert "0.666" in table and "0.555" not in table
    assert "0.444" in table and "0.333" not in table


def test_readme_stage_rows_follow_the_v_tile_rule():
    """Where V fits one tile of the pinned BV (v64: K=128, V=64), the shipped fullk row is
    the one at the halved BV the launcher picks, not a faster or slower row at the pinned BV."""
    from kernel_fun.kda.kernels.wy_bwd import CONFIGS

    def row(ms, BV):
        config = dict(CONFIGS[("fullk", 128)], BV=BV, HEADS_FAST=True)
        return dict(kind="stage", stage="B6", shape="v64", impl=f"fullk[{BV}]", design="fullk", ms=ms,
                    spread_ms=[ms, ms], floor_ms=0.1, gpu="H200", date="2026-11-30T10:00:00+00:00",
                    commit="abc", parity={"ok": True}, config=config)

    table = results.render([row(9.202, 64), row(1.877, 32), row(1.111, 16)])
    assert "1.877" in table and "9.202" not in table and "1.111" not in table


def test_bench_paths_are_the_checkout_s_or_the_environment_s(tmp_path, monkeypatch):
    from pathlib import Path

    from kernel_fun.bench import paths

    root = Path(__file__).resolve().parents[1]
    assert paths.checkout() == root
    assert paths.results_dir() == root / "bench" / "results"
    monkeypatch.setenv("KERNEL_FUN_RESULTS", str(tmp_path / "rows"))
    monkeypatch.setenv("KERNEL_FUN_FLA_CONFIGS", str(tmp_path / "configs"))
    assert paths.results_dir() == tmp_path / "rows" and paths.fla_configs_dir() == tmp_path / "configs"
    # installed (no checkout above the package): under the working directory, not site-packages
    monkeypatch.delenv("KERNEL_FUN_RESULTS")
    monkeypatch.setattr(paths, "checkout", lambda: None)
    monkeypatch.chdir(tmp_path)
    assert paths.results_dir() == tmp_path / "kernel_fun_results"


def test_every_bench_entry_point_imports_and_parses_its_arguments():
    """The GPU-only entry points at least import and take --help here, so a broken name
    at module level surfaces in CI rather than on the H200."""
    import importlib
    import subprocess
    import sys

    for name in ("kernel_fun.bench.kda", "kernel_fun.bench.stage_b6", "kernel_fun.bench.layer", "kernel_fun.bench.cconv",
                 "kernel_fun.bench.readme", "kernel_fun.bench.timing", "kernel_fun.demo",
                 "tools.b6_stream", "tools.b6_timeline", "tools.profile_stage", "tools.compile_report", "tools.ws_probe"):
        importlib.import_module(name)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for module in ("kernel_fun.bench", "kernel_fun.bench.stage_b6", "kernel_fun.bench.layer", "kernel_fun.bench.cconv"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=root,
                             timeout=120)
        assert out.returncode == 0 and "usage:" in out.stdout, (module, out.stderr[-2000:])


def test_stage_bench_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """The stage bench's whole path (inputs, parity against fla's stage and the float64
    stage, timings, rows) for B6 under the interpreter, with the rounding reference standing
    in for fla's stage and a stopwatch for CUDA events; a config that fails parity gets a
    RED row and no time."""
    import dataclasses
    import time

    import pytest

    from kernel_fun.bench import stage
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import Problem

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel through the interpreter")
    tiny = Problem("tiny", 1, 70, 1, 2, 64, 64)
    monkeypatch.setattr(stage, "problem", lambda name: tiny)

    def stopwatch(fn, reps):
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def broken(inputs, design, config):  # a kernel that gets dq wrong
        out = stage.entries()["B6"].ours(inputs, design, config)
        return (out[0] * 1.01,) + tuple(out[1:])

    bench = dataclasses.replace(
        stage.entries()["B6"],
        fla=lambda **inputs: ref.wy_dqkg_bwd(**{n: t for n, t in inputs.items() if n != "chunk_indices"}))
    out = tmp_path / "stages.jsonl"
    rows = stage.bench_shape(bench, "tiny", [("fullk", {})], reps=1, rounds=1, out_path=out, device="cpu",
                             timer=stopwatch)
    assert [r["impl"] for r in rows][0] == "fla" and rows[1]["design"] == "fullk"
    assert all(r["parity"]["ok"] and r["ms"] > 0 for r in rows), [r["parity"] for r in rows]
    assert rows[1]["config"] == bench.launch_config(tiny, "fullk", None) and bench.ships(dict(rows[1], shape="tiny"))
    red = stage.bench_shape(dataclasses.replace(bench, ours=broken), "tiny", [("fullk", {})], reps=1, rounds=1,
                            out_path=out, device="cpu", timer=stopwatch)
    assert not red[1]["parity"]["ok"] and red[1]["ms"] is None
    assert len(out.read_text().splitlines()) == 4



def test_stage_bench_holds_per_head_outputs_only_where_it_covers_every_sequence(tmp_path, monkeypatch):
    """A stage with per-head outputs (B9's dA_log and dt_bias's gradient, sums over every
    sequence): at B=3 the float64 stage runs on the first two sequences, so its per-token
    output is held to it and its per-head ones only to fla's stage; at B=2 all of them."""
    import time

    import torch

    from kernel_fun.bench import stage
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import Problem

    def make_inputs(p, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        return dict(g=torch.randn(p.B, p.T, p.HV, p.K, generator=gen), A_log=torch.randn(p.HV, generator=gen),
                    dt_bias=torch.randn(p.HV * p.K, generator=gen), dyg=torch.randn(p.B, p.T, p.HV, p.K, generator=gen),
                    lower_bound=None)

    def stopwatch(fn, reps):
        t0 = time.perf_counter()
        fn()
        return [(time.perf_counter() - t0) * 1e3]

    bench = stage.StageBench(
        stage="B9", make_inputs=make_inputs, bytes=lambda p: 1, fla=ref.gate_bwd,
        exact=lambda **kw: ref.gate_bwd(**{n: t.double() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}),
        ours=lambda inputs, design, config: ref.gate_bwd(**inputs), launch_config=lambda p, design, overrides: {},
        misses=lambda vs_exact, fla_exact, vs_fla: {}, sweep={}, designs=())
    for B, whole in ((3, False), (2, True)):
        monkeypatch.setattr(stage, "problem", lambda name, B=B: Problem("tiny", B, 70, 2, 2, 8, 8))
        rows = stage.bench_shape(bench, "tiny", [("torch", {})], reps=1, rounds=1, out_path=tmp_path / "stages.jsonl",
                                 device="cpu", timer=stopwatch)
        ours = rows[1]["parity"]
        assert ours["ok"] and rows[1]["ms"] > 0, ours
        assert "dg" in ours["vs_exact"] and ({"dA_log", "ddt_bias"} <= set(ours["vs_exact"])) == whole, ours
        assert {"dg", "dA_log", "ddt_bias"} <= set(ours["vs_fla"]), ours


def test_candidate_designs_register_for_the_run_and_stay_out_of_the_readme(monkeypatch):
    import importlib

    import pytest

    from kernel_fun.bench import kda

    registry = importlib.import_module("kernel_fun.kda.stages")
    for stage in kda.CANDIDATES:
        monkeypatch.setitem(registry._REGISTRY, stage, registry._REGISTRY[stage])
    assert kda.register_candidates(["B7-B9=wide-pairwise", "B7=wide-pairwise"]) == {"B7-B9": "wide-pairwise",
                                                                                       "B7": "wide-pairwise"}
    assert "ours" in registry._REGISTRY["B7-B9"].impls and "ours" in registry._REGISTRY["B7"].impls
    from kernel_fun.kda.kernels import scan_fwd

    assert "ours" not in registry._REGISTRY["B1-B2"].impls
    assert kda.register_candidates(["B1-B2=recompute"]) == {"B1-B2": "recompute"}
    assert "ours" in registry._REGISTRY["B1-B2"].impls
    assert registry._REGISTRY["B3"].impls["ours"] is scan_fwd.scan_states  # registered: a candidate replaces it
    assert kda.register_candidates(["B3=scan"]) == {"B3": "scan"}
    assert registry._REGISTRY["B3"].impls["ours"] is not scan_fwd.scan_states
    for bad in ("B6=fullk", "B7", "B7=no-such-design", "F7-F8=wide"):
        with pytest.raises((SystemExit, ValueError)):
            kda.register_candidates([bad])
    assert kda.stages_off(["B7-B9", "F7-F8"]) == {"B7-B9": "fla", "F7-F8": "fla"}  # --off: a unit on fla's
    with pytest.raises(SystemExit):
        kda.stages_off(["B7-B10"])
    candidate = _row(impl="ours", fwdbwd_ms=30.0, candidate={"B7-B9": "wide-pairwise"})
    assert "30.00" not in results.render([_row(), candidate]) and "30.00" in results.op_table([_row(), candidate])
