"""The B4-B5 unit's entry (``kda/kernels/b4_b5_dhu.py``): the reverse state scan with B4's dv
formed in it, and dAqk from its own kernel, against fla's B4 then B5.

The inputs are the chain's own: one forward through the reference stages at the shape (kg, w,
the cumsum, v_new, Aqk, the initial state) and qg = q exp2(g) as F6 rounds it, so the state
gradient's recurrence is a real WY transform's; do is drawn at unit scale, dht where the
problem returns a final state. Parity (``parity.dhu_misses``): against fla's stages within 2e-3
(bf16 dh and dv2 carried through the chunks, as the forward scan's bars), dAqk within 1e-4 (an
fp32 sum in another order); against the float64 stages within fla's budgets (dh and dv2 as dv,
dAqk as dq, which it feeds) and within 10% of fla's own error.
"""

from __future__ import annotations

import torch

from benchmarks.stages.common import StageBench, chain_runs

# Beside the picks (``launch_config``: BV=128 at 8 warps, two stages, 234 registers, 144 KB, one
# program an SM, on many chains; BV=32 on few; sm_90a,
# K=128, V=256, no spills anywhere): BV=128 at one stage (255 registers); BV=64 at 4 warps (255
# registers at one stage, 40 KB; 228 at two, 128 KB) and at 8 warps (172-187); BV=32 at 4 warps
# 220 at one stage, 215 and 70 KB at two (three programs an SM by its memory), an mma.sync kernel.
# Timed on an H100: docs/log/b5.md.
# BV=64 at 8 warps and one stage (6.34 ms at prod8192_gate, 0.85 at small, 0.76 at layer2x8192:
# never the pick) left the sweep after it gave NaN at K=64 V=64 on an H100: over 32-channel halves
# 8 warps make m64n16k16 wgmmas, whose operands Triton 3.6 reads past their shared allocation;
# the kernel declines BV=64 at 8 warps for K <= 64 (``declines``), and so does this entry; the
# same for a wgmma slice (BV >= 64) at one stage there, after BV=64 on 4 warps at one stage gave
# NaN at k64v64 on the H200 (2026-12-06).
SWEEP = (dict(BV=64, num_warps=4, num_stages=2), dict(BV=64, num_warps=8, num_stages=2),
         dict(BV=32, num_warps=4, num_stages=1), dict(BV=32, num_warps=4, num_stages=2),
         dict(BV=128, num_warps=8, num_stages=1), dict(BV=64, num_warps=4, num_stages=1))


def b4_b5_bytes(p) -> int:
    """The fewest bytes the unit moves: qg, kg, w, do and v_new (bf16) and Aqk (bf16, 64 a row)
    read once, the cumsum's last rows (fp32); dh (bf16, a [K, V] state a chunk), dv2 and dAqk
    (fp32, 64 a row) written once; the states in and out where the problem has them."""
    tok, nt, state = p.B * p.T * p.HV, p.B * -(-p.T // 64) * p.HV, p.B * p.HV * p.K * p.V * 4
    reads = 3 * tok * p.K * 2 + 2 * tok * p.V * 2 + tok * 64 * 2 + nt * p.K * 4
    writes = nt * p.K * p.V * 2 + tok * p.V * 2 + tok * 64 * 4
    return reads + writes + state * (int(p.initial_state) + int(p.output_final_state))


def make_inputs(p, device, seed: int = 0) -> dict:
    found = chain_runs(p, device, seed, ("F3-F6", "F7", "F8"))
    (f7, f7_out), (f8, _) = found["F7"], found["F8"]
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    do = torch.randn(f8["v_new"].shape, generator=gen, device=device).to(f8["v_new"].dtype)
    dht = 0.1 * torch.randn(f7_out[2].shape, generator=gen, device=device) if f7["output_final_state"] else None
    return dict(q=q, k=found["F3-F6"][0]["k"], v_new=f8["v_new"], do=do, Aqk=f8["Aqk"], qg=qg, kg=f7["kg"],
                w=f7["w"], gc=gc, h0=f7["initial_state"], dht=dht, scale=f8["scale"], state_v_first=False,
                chunk_size=f7["chunk_size"], cu_seqlens=f7["cu_seqlens"], chunk_indices=f7["chunk_indices"])


def _exact(**i):
    from kernel_fun.kda import reference as ref

    dAqk, dv = ref.dav_bwd(i["v_new"], i["do"], i["Aqk"], i["scale"], i["chunk_size"], i["cu_seqlens"], exact=True)
    return (dAqk, *ref.dhu_bwd(i["qg"], i["kg"], i["w"], i["gc"], i["h0"], i["dht"], i["do"], dv, i["scale"],
                               i["chunk_size"], i["cu_seqlens"], i["state_v_first"], exact=True))


def _ours(inputs, config):
    from kernel_fun.kda.kernels import b4_b5_dhu

    return b4_b5_dhu.dav_dhu(**inputs, config=config)


def _launch_config(p, overrides):
    from kernel_fun.kda.kernels import b4_b5_dhu

    chains = p.sequences * p.HV
    config = {**b4_b5_dhu.launch_config(chains, p.V, p.K), **(overrides or {})}
    why = b4_b5_dhu.declines(config, p.V, p.K)
    if why:
        raise ValueError(why)
    return config


def _misses(vs_exact, fla_exact, vs_fla):
    from benchmarks.parity import dhu_misses

    return dhu_misses(vs_exact, fla_exact, vs_fla)


BENCH = StageBench(stage="B4-B5", label="dhu-vk-dv", make_inputs=make_inputs, bytes=b4_b5_bytes, exact=_exact,
                   ours=_ours, launch_config=_launch_config, misses=_misses, sweep=SWEEP)
