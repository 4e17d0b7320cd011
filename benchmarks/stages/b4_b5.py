"""The reverse state scan's entries (``kda/kernels/b4_b5_dhu.py``): the B4-B5 unit (B4's dv formed
in the scan, dAqk from its own kernel) against fla's B4 then B5, and the scan alone reading B4's
dv against fla's B5 (what the fusion is worth beside the scan; not registered as B5).

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

# Beside the pin (BV=64 at 4 warps, one stage: 255 registers, 40 KB, two programs an SM; sm_90a,
# K=128, V=256, forming dv, no spills anywhere): two stages (228 registers, 128 KB, one an SM); at
# 8 warps 172-187 registers; BV=128 at 8 warps 255 (one stage) and 230 (two, 144 KB: half the
# programs reading a head's kg, qg and w, each with its loads a stage ahead, not yet timed); BV=32
# at 4 warps 220, an mma.sync kernel. LOADS_FIRST: qg and w loaded ahead of the step's chain.
SWEEP = (dict(BV=64, num_warps=4, num_stages=2), dict(BV=64, num_warps=8, num_stages=1),
         dict(BV=64, num_warps=8, num_stages=2), dict(BV=32, num_warps=4, num_stages=1),
         dict(BV=128, num_warps=8, num_stages=1), dict(BV=128, num_warps=8, num_stages=2),
         dict(LOADS_FIRST=True), dict(BV=128, num_warps=8, num_stages=1, LOADS_FIRST=True))


def _tokens(p):
    return p.B * p.T * p.HV, p.B * -(-p.T // 64) * p.HV, p.B * p.HV * p.K * p.V * 4


def b5_bytes(p) -> int:
    """The fewest bytes B5 moves: qg, kg, w, do and dv (bf16) read once, the cumsum's last rows
    (fp32), dh (bf16, a [K, V] state a chunk) and dv2 written once; the states in and out where
    the problem has them."""
    tok, nt, state = _tokens(p)
    return 3 * tok * p.K * 2 + 2 * tok * p.V * 2 + nt * p.K * 4 + nt * p.K * p.V * 2 + tok * p.V * 2 + state * (
        int(p.initial_state) + int(p.output_final_state))


def b4_b5_bytes(p) -> int:
    """The fewest bytes the B4-B5 unit moves: B5's with v_new read in place of dv (the same
    size), plus Aqk (bf16, 64 a row) read and dAqk (fp32, 64 a row) written."""
    tok, _, _ = _tokens(p)
    return b5_bytes(p) + tok * 64 * 2 + tok * 64 * 4


def make_inputs(p, device, seed: int = 0) -> dict:
    """The B4-B5 unit's inputs (``make_b5_inputs`` adds B4's dv, drops what B5 does not read)."""
    found = chain_runs(p, device, seed, ("F3-F6", "F7", "F8"))
    (f7, f7_out), (f8, _) = found["F7"], found["F8"]
    q, gc = f8["q"], f7["gc"]
    qg = (q.repeat_interleave(gc.shape[2] // q.shape[2], dim=2).float() * torch.exp2(gc)).to(q.dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    do = torch.randn(f8["v_new"].shape, generator=gen, device=device).to(f8["v_new"].dtype)
    h0 = f7["initial_state"]
    dht = None
    if f7["output_final_state"]:
        dht = 0.1 * torch.randn(f7_out[2].shape, generator=gen, device=device)
    k = found["F3-F6"][0]["k"]
    return dict(q=q, k=k, v_new=f8["v_new"], do=do, Aqk=f8["Aqk"], qg=qg, kg=f7["kg"], w=f7["w"], gc=gc, h0=h0,
                dht=dht, scale=f8["scale"], state_v_first=False, chunk_size=f7["chunk_size"],
                cu_seqlens=f7["cu_seqlens"], chunk_indices=f7["chunk_indices"])


def make_b5_inputs(p, device, seed: int = 0) -> dict:
    from kernel_fun.kda import reference as ref

    i = make_inputs(p, device, seed)
    _, dv = ref.dav_bwd(i["v_new"], i["do"], i["Aqk"], i["scale"], i["chunk_size"], i["cu_seqlens"])
    return {n: t for n, t in i.items() if n not in ("q", "k", "v_new", "Aqk")} | {"dv": dv}


def _exact_b5(**i):
    from kernel_fun.kda import reference as ref

    return ref.dhu_bwd(i["qg"], i["kg"], i["w"], i["gc"], i["h0"], i["dht"], i["do"], i["dv"], i["scale"],
                       i["chunk_size"], i["cu_seqlens"], i["state_v_first"], exact=True)


def _exact_unit(**i):
    from kernel_fun.kda import reference as ref

    dAqk, dv = ref.dav_bwd(i["v_new"], i["do"], i["Aqk"], i["scale"], i["chunk_size"], i["cu_seqlens"], exact=True)
    return (dAqk, *ref.dhu_bwd(i["qg"], i["kg"], i["w"], i["gc"], i["h0"], i["dht"], i["do"], dv, i["scale"],
                               i["chunk_size"], i["cu_seqlens"], i["state_v_first"], exact=True))


def _ours_b5(inputs, config):
    from kernel_fun.kda.kernels import b4_b5_dhu

    return b4_b5_dhu.dhu(**inputs, config=config)


def _ours_unit(inputs, config):
    from kernel_fun.kda.kernels import b4_b5_dhu

    return b4_b5_dhu.dav_dhu(**inputs, config=config)


def _launch_config(p, overrides):
    from kernel_fun.kda.kernels import b4_b5_dhu

    return {**b4_b5_dhu.CONFIG, **(overrides or {})}


def _misses(vs_exact, fla_exact, vs_fla):
    from benchmarks.parity import dhu_misses

    return dhu_misses(vs_exact, fla_exact, vs_fla)


BENCH_B5 = StageBench(stage="B5", label="dhu-vk", make_inputs=make_b5_inputs, bytes=b5_bytes, exact=_exact_b5,
                      ours=_ours_b5, launch_config=_launch_config, misses=_misses, sweep=SWEEP)
BENCH = StageBench(stage="B4-B5", label="dhu-vk-dv", make_inputs=make_inputs, bytes=b4_b5_bytes, exact=_exact_unit,
                   ours=_ours_unit, launch_config=_launch_config, misses=_misses, sweep=SWEEP)
