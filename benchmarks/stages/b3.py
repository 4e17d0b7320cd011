"""B3's entry (``kda/kernels/f7_f8_b3_scan.py``'s ``scan_states``): the state scan the backward
recomputes, kernel-fun's forming u from v, beta and Akk_inv, against fla's (as F7, reading
u).

The inputs are the chain's own (the F7-F8 entry's: a reference forward at the shape).
Parity (``parity.scan_misses``): h, v_new and the final state against fla's within 2e-3,
against the float64 stage within 0.005 and within 10% of fla's own error.
"""

from __future__ import annotations

from benchmarks.stages.common import StageBench
from benchmarks.stages.f7_f8 import chain_inputs

# Every V slice of the launcher's table (``STATES_STEPS``), whichever the chains pick.
SWEEP = (dict(BV=64, num_warps=4, num_stages=2), dict(BV=128, num_warps=8, num_stages=2),
         dict(BV=32, num_warps=4, num_stages=2))
_SCAN = ("kg", "w", "u", "gc", "initial_state", "output_final_state", "chunk_size", "cu_seqlens", "cu_seqlens_cpu",
         "chunk_indices", "state_v_first")


def b3_bytes(p) -> int:
    """The fewest bytes the state scan moves: kg, w, u (bf16) and gc (fp32) read once; h
    (bf16, a [K, V] state a chunk) and v_new written once."""
    tok_hv, nt = p.B * p.T * p.HV, p.B * -(-p.T // 64) * p.HV
    return 2 * tok_hv * p.K * 2 + tok_hv * p.V * 2 + tok_hv * p.K * 4 + nt * p.K * p.V * 2 + tok_hv * p.V * 2


def make_inputs(p, device, seed: int = 0) -> dict:
    unit = chain_inputs(p, device, seed)
    return {n: unit[n] for n in _SCAN + ("v", "beta", "Akk")}


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    i = inputs
    return ref.h_fwd(i["kg"], i["w"], i["u"], i["gc"], i["initial_state"], i["output_final_state"], i["chunk_size"],
                     i["cu_seqlens"], i["state_v_first"], exact=True)


def _ours(inputs, config):
    from kernel_fun.kda.kernels import f7_f8_b3_scan

    return f7_f8_b3_scan.scan_states(**inputs, config=config)


def _launch_config(p, overrides):
    from kernel_fun.kda.kernels import f7_f8_b3_scan

    return {**f7_f8_b3_scan.states_config(p.sequences * p.HV, p.V), **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from benchmarks.parity import scan_misses

    return scan_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B3", label="scan-vk-u", make_inputs=make_inputs, bytes=b3_bytes, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP)
