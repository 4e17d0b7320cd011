"""The F7-F8 unit's entry in the stage bench (``kernel_fun.bench.stage``): the forward's
state scan with its output, kernel-fun's one-pass scan (``kda/kernels/scan_fwd.py``)
against fla's F7 then F8.

``python -m kernel_fun.bench.stage --stage F7-F8 --shapes prod8192_gate,step8192 --configs sweep``

The inputs are the chain's own: one forward through the reference stages (torch, on the
same device) at the shape, and F7's and F8's inputs taken from it (kg, w, u, gc, q, Aqk,
the initial state where the problem has one; v, beta and Akk_inv from F3-F6's, for the
designs forming u), so w and u are a real WY transform's and the state stays bounded. step8192 (one sequence, one head: 2-8 programs, one a V slice, each
of 128 dependent chunk steps) times the scan's step latency: its time over 128 is one step's.
Parity (``kda.parity.scan_misses``): o and the final state against fla's within 2e-3 and
against the float64 stage within fla's budget (0.005) and within 10% of fla's own error.
"""

from __future__ import annotations

import sys

import torch

from kernel_fun.bench.stage import StageBench, chain_runs, main as _stage_main

# The configs worth timing (the note at scan_fwd.DEFAULT_CONFIG): the default (BV=128 at 8
# warps, the prod8192_gate winner), BV=64 at 8 warps and BV=32 at 4 (the one-head winner),
# all one program an SM; and BV=64 and BV=32 at 4 warps and one stage, two an SM (the
# pipeliner's buffers gone: 57 and 45 KB of shared memory).
# ``scan`` reads F6's qg (q exp2(g) in q's dtype; here formed in torch from the chain's q and
# cumsum), ``scan-forms-qg`` forms it from q and the cumsum in the chunk loop.
_CONFIGS = [dict(BV=128, num_warps=8, num_stages=2), dict(BV=64, num_warps=8, num_stages=2),
            dict(BV=32, num_warps=4, num_stages=2), dict(BV=64, num_warps=4, num_stages=1),
            dict(BV=32, num_warps=4, num_stages=1)]
SWEEP = {"scan": _CONFIGS, "scan-forms-qg": _CONFIGS, "scan-hoist": _CONFIGS, "scan-pf": _CONFIGS,
         "scan-hoist-pf": _CONFIGS,
         # the transposed state (offline, the note at scan_fwd.VK_STEP_CONFIGS: no spills at two
         # stages, 36-72 B at one; BV=256 at 16 warps, one program a head, spilled and measured
         # 4.28 ms at prod8192_gate)
         "scan-vk": [dict(BV=64, num_warps=4, num_stages=2), dict(BV=128, num_warps=8, num_stages=2),
                     dict(BV=64, num_warps=4, num_stages=1), dict(BV=128, num_warps=8, num_stages=1),
                     dict(BV=32, num_warps=4, num_stages=2)]}
# ``scan-vk-u``: the transposed kernel forming u from v, beta and Akk_inv (F6 writing none;
# offline one program an SM at BV=64 and 128, 136 and 144 KB of shared memory, two at BV=32,
# 80 KB). Measured slower than reading F6's u (VKU_STEP_CONFIGS' note): not the unit's pin.
SWEEP["scan-vk-u"] = [dict(BV=128, num_warps=8, num_stages=2), dict(BV=64, num_warps=4, num_stages=2),
                      dict(BV=32, num_warps=4, num_stages=2)]
FORMS_U = {"scan-vk-u": "scan-vk"}  # design -> the load schedule it runs


def scan_bytes(p) -> int:
    """The fewest bytes F7 + F8 move as one pass over fla's stage inputs: q, kg, w, u
    (bf16), gc (fp32) and Aqk (bf16) read once, o written once; the states in and out where
    the problem has them. Kept as the unit's floor for both designs (reading F6's qg in
    place of q and gc moves fewer here, but F6 pays for writing it; the whole op counts
    both)."""
    tok_h, tok_hv, states = p.B * p.T * p.H, p.B * p.T * p.HV, p.B * p.HV * p.K * p.V * 4
    reads = tok_h * p.K * 2 + 2 * tok_hv * p.K * 2 + tok_hv * p.V * 2 + tok_hv * p.K * 4 + tok_hv * 64 * 2
    return reads + tok_hv * p.V * 2 + states * (int(p.initial_state) + int(p.output_final_state))


def make_inputs(p, device, seed: int = 0) -> dict:
    found = chain_runs(p, device, seed, ("F3-F6", "F7", "F8"))
    (f36, f36_out), (f7, _), (f8, _) = found["F3-F6"], found["F7"], found["F8"]
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    return dict(q=q, qg=qg, Aqk=f8["Aqk"], scale=f8["scale"], save_states=False, v=f36["v"], beta=f36["beta"],
                Akk=f36_out[4],
                **{n: f7[n] for n in ("kg", "w", "u", "gc", "initial_state", "output_final_state", "cu_seqlens_cpu",
                                      "state_v_first", "chunk_size", "cu_seqlens", "chunk_indices")})


def _reading_u(inputs: dict) -> dict:
    """The unit's inputs without v, beta and Akk_inv (read only by the designs forming u)."""
    return {n: t for n, t in inputs.items() if n not in ("v", "beta", "Akk")}


def _fla(**inputs):
    from kernel_fun.kda.chain import _fla_scan_output

    return _fla_scan_output(**_reading_u(inputs))


def _exact(**inputs):
    from kernel_fun.kda.chain import _ref_scan_output

    return _ref_scan_output(**_reading_u(inputs), exact=True)


def _ours(inputs, design, config):
    from kernel_fun.kda.kernels import scan_fwd

    if design == "scan-forms-qg":
        inputs = {**inputs, "qg": None}
    config = config or _launch_config(None, design, None, inputs)
    if design in FORMS_U:
        inputs, design = {**inputs, "u": None}, FORMS_U[design]
    else:
        inputs = _reading_u(inputs)
    return scan_fwd.scan_output(**inputs, **config, **scan_fwd.DESIGNS[design])


def _launch_config(p, design, overrides, inputs=None):
    from kernel_fun.kda.kernels import scan_fwd

    if design not in SWEEP:
        raise ValueError(f"unknown F7-F8 design {design!r}")
    if p is None:  # from the inputs (a direct call without a config)
        kg, cu = inputs["kg"], inputs["cu_seqlens"]
        chains, V = (kg.shape[0] if cu is None else len(cu) - 1) * kg.shape[2], inputs["u"].shape[3]
    else:
        chains, V = (p.B if p.cu_seqlens is None else len(p.cu_seqlens) - 1) * p.HV, p.V
    return {**scan_fwd.launch_config(chains, V, reads_qg=design != "scan-forms-qg",
                                     vk=design in ("scan-vk", "scan-vk-u"), forms_u=design in FORMS_U),
            **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from kernel_fun.kda.parity import scan_misses

    return scan_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="F7-F8", make_inputs=make_inputs, bytes=scan_bytes, fla=_fla, exact=_exact, ours=_ours,
                   launch_config=_launch_config, misses=_misses, sweep=SWEEP, designs=("scan-vk",))


def main(argv=None) -> int:
    return _stage_main(argv, stage="F7-F8")


if __name__ == "__main__":
    sys.exit(main())
