"""The measuring harness's CPU-side parts: fla's config files round-trip through fla's own
loader; the README's numbers are exactly what the committed result rows generate, with only
the configs that ship in the stage table; the stage bench's whole path on the CPU; candidates
register for a run; every entry point imports and takes --help."""

from __future__ import annotations

import json
import os

import triton

from benchmarks import fla_configs, readme, rows


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
    rows.append(tmp_path / "a.jsonl", _row())
    rows.append(tmp_path / "a.jsonl", _row(impl="chain_fla", fwdbwd_ms=46.46, parity={"ok": True, "bitwise_vs_fla": True}))
    rows.append(tmp_path / "a.jsonl", _row(impl="chain_fla", fwdbwd_ms=50.0, date="2026-11-29T10:00:00+00:00"))
    doc = tmp_path / "README.md"
    doc.write_text(f"intro\n{readme.TABLE_BEGIN}\nstale\n{readme.TABLE_END}\noutro\n")
    assert readme.update_readme(doc, tmp_path, sweep_docs={})
    text = doc.read_text()
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "| prod8192_gate | kernel-fun, every stage on fla (control) | 9.00 | 46.46 | 0.990x |" in text
    assert "50.00" not in text  # the newer row wins
    assert not readme.update_readme(doc, tmp_path, sweep_docs={})


def test_repository_readme_and_sweep_doc_are_current(tmp_path):
    import shutil

    doc = tmp_path / "README.md"
    shutil.copy(readme.README, doc)
    docs = {stage: tmp_path / log.name for stage, log in readme.SWEEP_DOCS.items()}
    for stage, log in readme.SWEEP_DOCS.items():
        shutil.copy(log, docs[stage])
    assert not readme.update_readme(doc, rows.RESULTS, docs), "run `python -m benchmarks.readme`"


def test_red_rows_say_so():
    assert "RED" not in readme.op_table([_row(), _row(impl="ours")])
    assert "RED" in readme.op_table([_row(), _row(impl="ours", parity={"ok": False})])
    assert "dk over budget" in readme.op_table([_row(parity={"ok": True, "over_budget": ["dk"]})])


def test_op_table_keeps_each_gpu_and_compares_within_it():
    h100 = dict(gpu="NVIDIA H100 80GB HBM3", date="2026-12-01T10:00:00+00:00", commit="def")
    table = readme.op_table([_row(), _row(impl="ours", fwdbwd_ms=23.0),
                             _row(**h100, fwdbwd_ms=60.0), _row(**h100, impl="ours", fwdbwd_ms=40.0)])
    lines = [line for line in table.splitlines() if line.startswith("| prod8192_gate")]
    assert len(lines) == 4 and "H200" in lines[0] and "H100" in lines[-1]  # (the H200's first, both kept)
    assert "| 2.000x |" in lines[1] and "| 1.500x |" in lines[3]  # (each against fla on its own GPU)


def test_readme_stage_table_lists_shipped_designs_only():
    from kernel_fun.kda.kernels.b6_wy_bwd import CONFIGS

    pinned = dict(CONFIGS[128], HEADS_FAST=True)  # b8: K=128, 128 (b, hv) pairs
    stage = dict(kind="stage", stage="B6", shape="b8", ms=1.0, spread_ms=[0.9, 1.1], floor_ms=0.5, gpu="H200",
                 date="2026-11-30T10:00:00+00:00", commit="abc", parity={"ok": True}, config=pinned)
    rows = [dict(stage, impl="fla", design="fla", ms=2.0), dict(stage, impl="fullk[x]", design="fullk"),
            dict(stage, impl="gone[x]", design="gone")]
    assert "| gone |" not in readme.render(rows) and "| kernel-fun |" in readme.render(rows)
    assert "| gone |" in readme.render_sweep(rows) and "| fullk |" in readme.render_sweep(rows)
    # A faster row of a config that does not ship (another commit's kernel, another
    # blocking) stays in the sweep record and out of the README.
    faster = dict(stage, impl="fullk[y]", design="fullk", ms=0.5, config=dict(pinned, BV=32))
    assert "0.500" not in readme.render(rows + [faster]) and "1.000" in readme.render(rows + [faster])
    assert "0.500" in readme.render_sweep(rows + [faster])

    # The newest run of the shipped config stands for it, even when an older kernel's row
    # with the same config was faster; within one run the fastest config.
    newer = dict(stage, impl="fullk[z]", design="fullk", ms=1.5, commit="def", date="2026-11-30T11:00:00+00:00")
    assert "1.500" in readme.render(rows + [newer]) and "1.000" not in readme.render(rows + [newer])
    older = dict(stage, impl="fullk[z]", design="fullk", ms=0.7, commit="old", date="2026-11-29T11:00:00+00:00")
    assert "1.000" in readme.render(rows + [older]) and "0.700" not in readme.render(rows + [older])


def test_readme_stage_rows_follow_the_launch_order_rule():
    """A B6 row counts as shipped only in the launch order the rule picks at its shape:
    b8 (K=128, 128 (b, hv) pairs) ships b*hv fastest, small (32 pairs) and k64 (K=64) fla's
    order; rows without the key ran fla's order."""
    from kernel_fun.kda.kernels.b6_wy_bwd import CONFIGS

    def row(shape, ms, heads_fast=None, K=128):
        config = dict(CONFIGS[K])
        if heads_fast is not None:
            config["HEADS_FAST"] = heads_fast
        return dict(kind="stage", stage="B6", shape=shape, impl="fullk[x]", design="fullk", ms=ms,
                    spread_ms=[ms, ms], floor_ms=0.1, gpu="H200", date="2026-11-30T10:00:00+00:00",
                    commit="abc", parity={"ok": True}, config=config)

    table = readme.render([row("b8", 0.777), row("b8", 0.888, True), row("small", 0.555, True),
                            row("small", 0.666), row("k64", 0.333, True, K=64), row("k64", 0.444, False, K=64)])
    assert "0.888" in table and "0.777" not in table
    assert "0.666" in table and "0.555" not in table
    assert "0.444" in table and "0.333" not in table


def test_readme_stage_rows_follow_the_v_tile_rule():
    """Where V fits one tile of the pinned BV (v64: K=128, V=64), the shipped B6 row is the
    one at the halved BV the launcher picks, not a faster or slower row at the pinned BV."""
    from kernel_fun.kda.kernels.b6_wy_bwd import CONFIGS

    def row(ms, BV):
        config = dict(CONFIGS[128], BV=BV, HEADS_FAST=True)
        return dict(kind="stage", stage="B6", shape="v64", impl=f"fullk[{BV}]", design="fullk", ms=ms,
                    spread_ms=[ms, ms], floor_ms=0.1, gpu="H200", date="2026-11-30T10:00:00+00:00",
                    commit="abc", parity={"ok": True}, config=config)

    table = readme.render([row(9.202, 64), row(1.877, 32), row(1.111, 16)])
    assert "1.877" in table and "9.202" not in table and "1.111" not in table


def test_rows_and_configs_live_in_the_repository_or_where_the_environment_says(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert rows.RESULTS == root / "benchmarks" / "results" and rows.REPO == root
    assert fla_configs.CONFIG_ROOT == root / "benchmarks" / "fla_configs"
    env = dict(os.environ, KERNEL_FUN_RESULTS=str(tmp_path / "rows"), KERNEL_FUN_FLA_CONFIGS=str(tmp_path / "configs"))
    out = subprocess.run([sys.executable, "-c", "from benchmarks import rows, fla_configs; "
                          "print(rows.RESULTS); print(fla_configs.CONFIG_ROOT)"], capture_output=True, text=True,
                         cwd=root, env=env, timeout=120)
    assert out.stdout.split() == [str(tmp_path / "rows"), str(tmp_path / "configs")], out.stderr


_HELP = """
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            assert done.code in (0, None), (module, done.code)
    assert "usage:" in out.getvalue(), module
    print("ok", module)
"""


def test_every_bench_entry_point_imports_and_parses_its_arguments():
    """The GPU-only entry points at least import and take --help here (as ``python -m``
    runs them), so a broken name at module level surfaces in CI rather than on the H200."""
    import subprocess
    import sys

    modules = ("kernel_fun.bench", "kernel_fun.bench.layer", "kernel_fun.bench.cconv", "benchmarks.op",
               "benchmarks.layer", "benchmarks.cconv", "benchmarks.stage", "benchmarks.compile_report",
               "benchmarks.reliability")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _HELP, *modules], capture_output=True, text=True, cwd=root,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:-1] == [f"ok {m}" for m in modules], out.stdout


def stage_reference(stage: str, inputs: dict):
    """The chain's reference implementation of ``stage`` on the inputs."""
    from kernel_fun.kda.stages import stages

    return stages()[stage].impls["reference"](**inputs)


def test_stage_bench_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """The stage bench's whole path (inputs, parity against fla's stage and the float64
    stage, timings, rows) for B6 under the interpreter, with the rounding reference standing
    in for fla's stage and a stopwatch for CUDA events; a config that fails parity gets a
    RED row and no time."""
    import dataclasses
    import time

    import pytest

    from benchmarks import stage
    from kernel_fun.kda.problems import Problem

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel through the interpreter")
    from benchmarks.stages import common

    tiny = Problem("tiny", 1, 70, 1, 2, 64, 64)
    monkeypatch.setattr(stage, "problem", lambda name: tiny)
    monkeypatch.setattr(common, "problem", lambda name: tiny)

    def stopwatch(fn, reps):
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def broken(inputs, config):  # a kernel that gets dq wrong
        out = stage.entries()["B6"].ours(inputs, config)
        return (out[0] * 1.01,) + tuple(out[1:])

    # the rounding reference stands in for fla's stage (whose kernels need a GPU)
    bench = dataclasses.replace(stage.entries()["B6"], fla_outputs=tuple)
    monkeypatch.setattr(type(bench), "fla", lambda self, **inputs: stage_reference("B6", inputs))
    out = tmp_path / "stages.jsonl"
    found = stage.bench_shape(bench, "tiny", [{}], reps=1, rounds=1, out_path=out, device="cpu", timer=stopwatch)
    assert [r["impl"] for r in found][0] == "fla" and found[1]["design"] == "fullk"
    assert all(r["parity"]["ok"] and r["ms"] > 0 for r in found), [r["parity"] for r in found]
    assert found[1]["config"] == bench.launch_config(tiny, None) and bench.ships(dict(found[1], shape="tiny"))
    red = stage.bench_shape(dataclasses.replace(bench, ours=broken), "tiny", [{}], reps=1, rounds=1,
                            out_path=out, device="cpu", timer=stopwatch)
    assert not red[1]["parity"]["ok"] and red[1]["ms"] is None
    assert len(out.read_text().splitlines()) == 4



def test_stage_bench_holds_per_head_outputs_only_where_it_covers_every_sequence(tmp_path, monkeypatch):
    """A stage with per-head outputs (B9's dA_log and dt_bias's gradient, sums over every
    sequence): at B=3 the float64 stage runs on the first two sequences, so its per-token
    output is held to it and its per-head ones only to fla's stage; at B=2 all of them."""
    import time

    import torch

    from benchmarks import stage
    from benchmarks.stages.common import StageBench
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

    bench = StageBench(
        stage="B9", label="torch", make_inputs=make_inputs, bytes=lambda p: 1,
        exact=lambda **kw: ref.gate_bwd(**{n: t.double() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}),
        ours=lambda inputs, config: ref.gate_bwd(**inputs), launch_config=lambda p, overrides: {},
        misses=lambda vs_exact, fla_exact, vs_fla: {})
    monkeypatch.setattr(StageBench, "fla", lambda self, **inputs: ref.gate_bwd(**inputs))
    for B, whole in ((3, False), (2, True)):
        monkeypatch.setattr(stage, "problem", lambda name, B=B: Problem("tiny", B, 70, 2, 2, 8, 8))
        found = stage.bench_shape(bench, "tiny", [{}], reps=1, rounds=1, out_path=tmp_path / "stages.jsonl",
                                  device="cpu", timer=stopwatch)
        ours = found[1]["parity"]
        assert ours["ok"] and found[1]["ms"] > 0, ours
        assert "dg" in ours["vs_exact"] and ({"dA_log", "ddt_bias"} <= set(ours["vs_exact"])) == whole, ours
        assert {"dg", "dA_log", "ddt_bias"} <= set(ours["vs_fla"]), ours


def test_candidates_register_for_the_run_and_stay_out_of_the_readme():
    """``--candidate STAGE=module:function[:supports]`` registers any implementation (a
    research candidate's) as the stage's ours for the run; ``--off`` names a stage or unit to
    put on fla's; their rows carry ``candidate`` and the README skips them."""
    import pytest

    from benchmarks import op

    from kernel_fun import _fla
    from kernel_fun.kda.stages import registered, stages

    assert "ours" not in stages()["B7"].impls
    with registered("B7", "reference", stages()["B7"].impls["reference"]):  # restored on the way out
        # any importable function with the stage's contract will do: here fla's own B7
        assert op.register_candidates(["B7=kernel_fun._fla:intra_bwd"]) == {"B7": "kernel_fun._fla:intra_bwd"}
        assert stages()["B7"].impls["ours"] is _fla.intra_bwd
        for bad in ("B7", "B7=no_such_module:f", "B10c=kernel_fun._fla:gate_bwd",
                    "B3=kernel_fun.kda.kernels.b6_wy_bwd:wy_dqkg_bwd"):  # (the last: not B3's contract)
            with pytest.raises((SystemExit, ImportError, TypeError)):
                op.register_candidates([bad])
    assert "ours" not in stages()["B7"].impls
    assert op.stages_off(["B7-B9", "F7-F8"]) == {"B7-B9": "fla", "F7-F8": "fla"}  # --off: a unit on fla's
    with pytest.raises(SystemExit):
        op.stages_off(["B7-B11"])
    candidate = _row(impl="ours", fwdbwd_ms=30.0, candidate={"B7-B9": "fla"})
    assert "30.00" not in readme.render([_row(), candidate]) and "30.00" in readme.op_table([_row(), candidate])
    # (the layer bench's rows the same: its --candidate is the op bench's)
    layer = dict(kind="layer", shape="prod8192_layer", problem="B2 T8192", fwdbwd_spread_ms=[1.0, 2.0])
    layer_rows = [_row(**layer, fwdbwd_ms=40.0), _row(**layer, impl="ours", fwdbwd_ms=31.0),
                  _row(**layer, impl="ours", fwdbwd_ms=27.0, candidate={"B7-B10": "research.x:f"},
                       date="2026-12-01T10:00:00+00:00")]
    assert "27.00" in readme.layer_table(layer_rows) and "27.00" not in readme.render(layer_rows)
    assert "31.00" in readme.render(layer_rows)


def test_the_readme_table_shows_the_pinned_config_against_fla():
    """Result rows of kind cconv: fla's and the pinned config's, the ratio against
    fla's row of the same run; a sweep config that is not the pin stays out. A row from
    before the one-token loop's deletion counts as the pin where it ran today's loop
    (AHEAD=True, its ignored unroll G), not where it ran the deleted one (G alone)."""
    from kernel_fun.bench.cconv import label
    from kernel_fun.cconv import kernels as K

    pinned = label(K.DEFAULT_CONFIG)  # as the bench labels it
    base = dict(kind="cconv", shape="d2048", phase="fwd+bwd", spread_ms=[0.7, 0.8], floor_ms=0.63,
                parity={"ok": True}, gpu="NVIDIA H200", date="2026-12-02T00:00:00", commit="abc")
    rows = [dict(base, impl="fla", ms=2.34, stream_ms=2.3), dict(base, impl=pinned, ms=0.78, stream_ms=0.46),
            dict(base, impl="ours[BD=512]", ms=0.5)]
    table = readme.cconv_table(rows)
    assert "| d2048 | fwd+bwd | kernel-fun | 0.780 (0.700–0.800) | 3.00x | 0.460 | 5.00x | 0.63 | ok |" in table
    assert "0.500" not in table and readme.cconv_table([]) == ""
    old = dict(base, commit="old", date="2026-12-01T00:00:00")
    then = [dict(old, impl="fla", ms=2.4), dict(old, impl="ours[...]", ms=1.2, config={**K.DEFAULT_CONFIG, "AHEAD": True, "G": 8}),
            dict(old, impl="ours[G=8]", ms=1.7, config={**K.DEFAULT_CONFIG, "G": 8})]
    table = readme.cconv_table(then)
    assert "| kernel-fun | 1.200 (0.700–0.800) | 2.00x | — | — |" in table and "1.700" not in table, table


def test_the_compile_report_counts_cluster_copies_whose_barrier_is_the_peer_s():
    """``compile_report.cluster_copies`` on the two forms B7-B10's CuTe kernel has had (PTX as CuTe
    DSL 4.8.1 wrote them): the copy whose barrier was this CTA's address (memcheck: "Barrier ... is
    not located in destination CTA") counts as unmapped; with the barrier through ``mapa`` too, mapped."""
    from benchmarks.compile_report import cluster_copies

    common = """
	and.b32 	%r5899, %r5894, 1;
	mapa.shared::cluster.u32 	%r5900, %r5898, %r5899;
"""
    unmapped = common + """	mov.b32 	%r5901, 512;
	cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%r5900], [%r5897+100480], %r5901, [%r5902];
"""
    mapped = common + """	mapa.shared::cluster.u32 	%r5901, %r5903, %r5899;
	mov.b32 	%r5902, 512;
	cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%r5900], [%r5897+100480], %r5902, [%r5901];
"""
    assert cluster_copies(unmapped) == (1, 0)
    assert cluster_copies(mapped) == (1, 1)
    assert cluster_copies("\tbar.sync 	0;\n") == (0, 0)
