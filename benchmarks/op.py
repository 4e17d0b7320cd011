"""Whole-op rows: ``kernel_fun.bench``'s whole ``chunk_kda`` bench, its rows stamped and
appended to ``results/chunk_kda.jsonl``, fla's autotune choices stored after every shape.

    python -m benchmarks.op --shapes prod8192_gate,kimi
    python -m benchmarks.op --shapes prod8192_gate --impls fla,ours --off B7-B9
    python -m benchmarks.op --shapes prod8192_gate --impls fla,ours \\
        --candidate B6=research.<module>:<function>:<supports>

``--candidate STAGE=module:function[:supports]`` registers an implementation that is not
registered for users (a candidate kept under ``research/``) as the stage's ``ours`` for this
run; ``--off STAGE`` puts a stage (or a fused unit) of ours on fla's. Rows of either carry
``candidate`` and the README skips them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch


def register_candidates(specs: list[str]) -> dict[str, str]:
    """``STAGE=module:function[:supports]`` each: that function registered as the stage's
    ``ours`` for this process."""
    from kernel_fun.kda.stages import add_impl, stages

    chosen = {}
    for spec in specs:
        stage, _, target = spec.partition("=")
        parts = target.split(":")
        if stage not in stages() or len(parts) not in (2, 3):
            raise SystemExit(f"--candidate takes STAGE=module:function[:supports] with STAGE one of "
                             f"{sorted(stages())}; got {spec!r}")
        module = importlib.import_module(parts[0])
        add_impl(stage, "ours", getattr(module, parts[1]), getattr(module, parts[2]) if len(parts) == 3 else None)
        chosen[stage] = target
    return chosen


def stages_off(names: list[str]) -> dict[str, str]:
    """``--off STAGE`` each: the stage (or fused unit) on fla's for the run, e.g. ``B7-B9`` to
    time B7, B8 and B9 each on its own choice in the whole op."""
    from kernel_fun.kda.stages import stages

    known = stages()
    for name in names:
        if name not in known:
            raise SystemExit(f"--off takes a stage name, one of {sorted(known)}; got {name!r}")
    return {name: "fla" for name in names}


def main(argv=None) -> int:
    from kernel_fun.bench import op

    parser = op.parser()
    parser.prog = "python -m benchmarks.op"
    parser.add_argument("--out", type=Path, default=None, help="JSONL file to append rows to")
    parser.add_argument("--candidate", action="append", default=[], metavar="STAGE=module:function[:supports]",
                        help="measure an implementation not registered for users as the stage's ours")
    parser.add_argument("--off", action="append", default=[], metavar="STAGE",
                        help="run this stage (or fused unit) of ours on fla's, e.g. B7-B9 (repeatable)")
    parser.add_argument("--fla-configs", type=Path, default=None,
                        help="where to store fla's autotune choices (default: benchmarks/fla_configs/<gpu>)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.op needs a CUDA GPU; `python -m kernel_fun.demo` runs anywhere.", file=sys.stderr)
        return 2

    from benchmarks import fla_configs, readme, rows

    gpu = torch.cuda.get_device_name()
    stored = fla_configs.use_stored_configs(gpu)
    print(f"fla configs: {stored or 'none stored for this GPU; fla autotunes'}", flush=True)
    candidate = {**register_candidates(args.candidate), **stages_off(args.off)} or None
    off = stages_off(args.off) or None
    out = args.out or rows.RESULTS / "chunk_kda.jsonl"
    written = []
    for name in op.shapes_of(args.shapes):
        for row in op.bench_shape(name, args.impls.split(","), args.reps, args.rounds, off=off):
            row = rows.stamp({**row, **({"candidate": candidate} if candidate and row["impl"] == "ours" else {})})
            rows.append(out, row)
            written.append(row)
        torch.cuda.empty_cache()
        # after every shape, so a run stopped at a time limit keeps the choices fla's
        # autotuner made for the shapes it finished (a new head family costs ~3 min)
        n = fla_configs.dump(args.fla_configs or fla_configs.gpu_dir(gpu))
        print(f"[{name}] stored {n} fla autotune entries", flush=True)
    print()
    print(readme.op_table(written))
    return 0 if all(r["parity"]["ok"] for r in written) else 1


if __name__ == "__main__":
    sys.exit(main())
