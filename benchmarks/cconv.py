"""``causal_conv1d`` rows (``kernel_fun.bench.cconv``'s bench), stamped and appended to
``results/cconv.jsonl``; ``--configs`` times other launch configs of the kernels beside the
pinned one.

    python -m benchmarks.cconv --shapes d2048,d4096,packed2048 [--configs sweep | '[{"BD": 128, "num_warps": 1}]']
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# The builds worth timing (sm_90a offline, D=2048: none spills): the pin (256-channel strips
# at 2 warps, 256-token segments: four channels a lane, 8-byte loads and stores), its
# neighbours (strips and warps, a longer segment), and eight channels a lane (512 at 2 warps,
# 256 at 1: 16-byte loads and stores; the forward 102 registers, the backward 255).
SWEEP = [dict(BD=256, num_warps=2), dict(BD=256, num_warps=4), dict(BD=512, num_warps=4), dict(BD=128, num_warps=1),
         dict(BD=256, num_warps=2, TS=1024), dict(BD=512, num_warps=2), dict(BD=256, num_warps=1)]


def main(argv=None) -> int:
    from kernel_fun.bench import cconv

    parser = cconv.parser()
    parser.prog = "python -m benchmarks.cconv"
    parser.add_argument("--configs", default="pinned",
                        help="'pinned', 'sweep', or a JSON list of config overrides (each on the pin)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks import rows

    configs = {"pinned": [{}], "sweep": SWEEP}.get(args.configs) or json.loads(args.configs)
    written = [rows.stamp(r) for r in cconv.run(args.shapes.split(","), configs, args.reps, args.rounds)]
    for r in written:
        rows.append(args.out or rows.RESULTS / "cconv.jsonl", r)
    print(cconv.format_rows(written))
    return 0 if all(r["parity"]["ok"] for r in written) else 1


if __name__ == "__main__":
    sys.exit(main())
