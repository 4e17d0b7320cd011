"""B3's entry in the stage bench (``kernel_fun.bench.stage``): the state scan the backward
recomputes (fla's ``chunk_gated_delta_rule_fwd_h``, as F7), against kernel-fun's scan
kernel without o (``kda/kernels/scan_fwd.py``, ``scan_states``).

``python -m kernel_fun.bench.stage --stage B3 --shapes prod8192_gate,step8192 --configs sweep``

The inputs are the chain's own F7 inputs (the F7-F8 entry's: a reference forward at the
shape). Parity (``kda.parity.scan_misses``): h, v_new and the final state against fla's
within 2e-3, against the float64 stage within 0.005 and within 10% of fla's own error.
"""

from __future__ import annotations

import sys

from kernel_fun.bench import stage_f7f8
from kernel_fun.bench.stage import StageBench, main as _stage_main

# The configs worth timing (offline, sm_90a): BV=64 at 4 warps fits two programs an SM at
# one stage (206 registers, 41 KB) and at two (200, 98 KB); BV=128 at 8 warps, one.
SWEEP = {"scan": [dict(BV=64, num_warps=4, num_stages=2), dict(BV=64, num_warps=4, num_stages=1),
                  dict(BV=128, num_warps=8, num_stages=2), dict(BV=32, num_warps=4, num_stages=2)]}
SWEEP.update({d: SWEEP["scan"] for d in ("scan-pf", "scan-hoist", "scan-hoist-pf")})
SWEEP["scan-vk"] = [dict(BV=64, num_warps=4, num_stages=2), dict(BV=128, num_warps=8, num_stages=2)]
# forming u from v, beta and Akk_inv (B2 writing none, the pin): BV=64 at 4 warps two programs
# an SM (90 KB), BV=128 at 8 warps one
SWEEP["scan-vk-u"] = [dict(BV=64, num_warps=4, num_stages=2), dict(BV=128, num_warps=8, num_stages=2)]
FORMS_U = {"scan-vk-u": "scan-vk"}
_SCAN = ("kg", "w", "u", "gc", "initial_state", "output_final_state", "chunk_size", "cu_seqlens", "cu_seqlens_cpu",
         "chunk_indices", "state_v_first")


def b3_bytes(p) -> int:
    """The fewest bytes the state scan moves: kg, w, u (bf16) and gc (fp32) read once; h
    (bf16, a [K, V] state a chunk) and v_new written once."""
    tok_hv, nt = p.B * p.T * p.HV, p.B * -(-p.T // 64) * p.HV
    return 2 * tok_hv * p.K * 2 + tok_hv * p.V * 2 + tok_hv * p.K * 4 + nt * p.K * p.V * 2 + tok_hv * p.V * 2


def make_inputs(p, device, seed: int = 0) -> dict:
    unit = stage_f7f8.make_inputs(p, device, seed)
    return {n: unit[n] for n in _SCAN + ("v", "beta", "Akk")}


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_h

    return _fla_h(**inputs)


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    return ref.h_fwd(inputs["kg"], inputs["w"], inputs["u"], inputs["gc"], inputs["initial_state"],
                     inputs["output_final_state"], inputs["chunk_size"], inputs["cu_seqlens"], inputs["state_v_first"],
                     exact=True)


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import scan_fwd

    if design in FORMS_U:
        inputs, design = {**inputs, "u": None}, FORMS_U[design]
    flags = {"vk": False, **scan_fwd.DESIGNS[design]}  # (the kernel a design names, whatever the pin's)
    return scan_fwd.scan_states(**inputs, **(config or {}), **flags)


def _launch_config(p, design, overrides):
    from kernel_fun.kda.kernels import scan_fwd

    if design not in SWEEP:
        raise ValueError(f"unknown B3 design {design!r}")
    base = scan_fwd.STATES_U_CONFIG if design == "scan-vk-u" else scan_fwd.STATES_CONFIG
    return {k: v for k, v in {**base, **(overrides or {})}.items() if k != "vk"}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import scan_misses

    return scan_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B3", make_inputs=make_inputs, bytes=b3_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=("scan-vk-u",))


def main(argv=None) -> int:
    return _stage_main(argv, stage="B3")


if __name__ == "__main__":
    sys.exit(main())
