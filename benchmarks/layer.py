"""fla's ``KimiDeltaAttention`` layer, unpatched and through ``kernel_fun.patch_fla()``
(``kernel_fun.bench.layer``'s bench): rows stamped and appended to ``results/layer.jsonl``.

    python -m benchmarks.layer --B 2 --T 8192 [--safe-gate]
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks import fla_configs, rows

    fla_configs.use_stored_configs(torch.cuda.get_device_name())
    written = [rows.stamp(r) for r in layer.run(args.B, args.T, args.safe_gate, args.reps, args.rounds)]
    for r in written:
        rows.append(args.out or rows.RESULTS / "layer.jsonl", r)
    print(layer.format_rows(written))
    return 0 if written[0]["parity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
