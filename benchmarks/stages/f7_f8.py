"""The F7-F8 unit's entry (``kda/kernels/f7_f8_b3_scan.py``'s ``scan_output``): the forward's
state scan with its output in one pass, against fla's F7 then F8.

The inputs are the chain's own: one forward through the reference stages (torch, on the same
device) at the shape, F7's and F8's inputs taken from it (kg, w, u, gc, q, Aqk, the initial
state where the problem has one) and qg = q exp2(g) formed as F6 rounds it, so w and u are a
real WY transform's and the state stays bounded. step8192 (one sequence, one head: 2-8
programs, one a V slice, each of 128 dependent chunk steps) times the scan's step latency:
its time over 128 is one step's. Parity (``parity.scan_misses``): o and the final state
against fla's within 2e-3 and against the float64 stage within fla's budget (0.005) and
within 10% of fla's own error.
"""

from __future__ import annotations

import torch

from benchmarks.stages.common import StageBench, chain_runs

# Beside the config the launcher picks: each V slice at its other warps and stages (the
# transposed kernel: no spills at two stages, 36-72 B at one).
SWEEP = (dict(BV=64, num_warps=4, num_stages=2), dict(BV=128, num_warps=8, num_stages=2),
         dict(BV=64, num_warps=4, num_stages=1), dict(BV=128, num_warps=8, num_stages=1),
         dict(BV=32, num_warps=4, num_stages=2))


def scan_bytes(p) -> int:
    """The fewest bytes F7 + F8 move as one pass over fla's stage inputs: q, kg, w, u (bf16),
    gc (fp32) and Aqk (bf16) read once, o written once; the states in and out where the
    problem has them (reading F6's qg in place of q and gc moves fewer here, but F6 pays for
    writing it; the whole op counts both)."""
    tok_h, tok_hv, states = p.B * p.T * p.H, p.B * p.T * p.HV, p.B * p.HV * p.K * p.V * 4
    reads = tok_h * p.K * 2 + 2 * tok_hv * p.K * 2 + tok_hv * p.V * 2 + tok_hv * p.K * 4 + tok_hv * 64 * 2
    return reads + tok_hv * p.V * 2 + states * (int(p.initial_state) + int(p.output_final_state))


def chain_inputs(p, device, seed: int = 0) -> dict:
    """The F7-F8 unit's inputs, and v, beta and Akk_inv (B3's), from one reference forward."""
    found = chain_runs(p, device, seed, ("F3-F6", "F7", "F8"))
    (f36, f36_out), (f7, _), (f8, _) = found["F3-F6"], found["F7"], found["F8"]
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    return dict(q=q, qg=qg, Aqk=f8["Aqk"], scale=f8["scale"], save_states=False, v=f36["v"], beta=f36["beta"],
                Akk=f36_out[4],
                **{n: f7[n] for n in ("kg", "w", "u", "gc", "initial_state", "output_final_state", "cu_seqlens_cpu",
                                      "state_v_first", "chunk_size", "cu_seqlens", "chunk_indices")})


def make_inputs(p, device, seed: int = 0) -> dict:
    return {n: t for n, t in chain_inputs(p, device, seed).items() if n not in ("v", "beta", "Akk")}


def _exact(**inputs):
    from kernel_fun.kda import reference as ref

    i = inputs
    h, v_new, final_state = ref.h_fwd(i["kg"], i["w"], i["u"], i["gc"], i["initial_state"], i["output_final_state"],
                                      i["chunk_size"], i["cu_seqlens"], i["state_v_first"], exact=True)
    o = ref.o_fwd(i["q"], v_new, i["gc"], i["Aqk"], h, i["scale"], i["chunk_size"], i["cu_seqlens"],
                  i["state_v_first"], exact=True)
    return (o, final_state) + ((h, v_new) if i["save_states"] else (None, None))


def _ours(inputs, config):
    from kernel_fun.kda.kernels import f7_f8_b3_scan

    return f7_f8_b3_scan.scan_output(**inputs, config=config)


def _launch_config(p, overrides):
    from kernel_fun.kda.kernels import f7_f8_b3_scan

    chains = p.sequences * p.HV
    return {**f7_f8_b3_scan.launch_config(chains, p.V, p.K), **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from benchmarks.parity import scan_misses

    return scan_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="F7-F8", label="scan-vk", make_inputs=make_inputs, bytes=scan_bytes, exact=_exact,
                   ours=_ours, launch_config=_launch_config, misses=_misses, sweep=SWEEP)
