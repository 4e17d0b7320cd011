"""fla's ``KimiDeltaAttention`` layer, unpatched and through ``kernel_fun.patch_fla()``
(``kernel_fun.bench.layer``'s bench): rows stamped and appended to ``results/layer.jsonl``.

    python -m benchmarks.layer --B 2 --T 8192 [--safe-gate]
        [--candidate STAGE=research.<module>:<function>:<supports>]

Each row also carries its kernels' device time (the 25 largest by name, and their sum) and the
time a fwd+bwd takes issued back to back (``fwdbwd_stream_ms``). ``--candidate`` (as
``benchmarks.op``'s) registers a stage's candidate as its ``ours`` for the
run; its rows carry ``candidate`` and the README skips them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    from kernel_fun.bench import layer

    parser = layer.parser()
    parser.prog = "python -m benchmarks.layer"
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--candidate", action="append", default=[], metavar="STAGE=module:function[:supports]",
                        help="a candidate registered as the stage's ours for this run (its rows say so)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks import fla_configs, rows

    fla_configs.use_stored_configs(torch.cuda.get_device_name())
    from benchmarks.op import register_candidates

    candidate = register_candidates(args.candidate) or None
    written = [rows.stamp({**r, **({"candidate": candidate} if candidate and r.get("impl") != "fla" else {})})
               for r in layer.run(args.B, args.T, args.safe_gate, args.reps, args.rounds, profile=True)]
    for r in written:
        rows.append(args.out or rows.RESULTS / "layer.jsonl", r)
    # the layer's own kernels (convolutions, norms) autotune too: keep fla's choices for the next run
    stored = fla_configs.dump(fla_configs.gpu_dir(torch.cuda.get_device_name()))
    print(f"stored {stored} fla autotune entries", flush=True)
    print(layer.format_rows(written))
    return 0 if written[0]["parity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
