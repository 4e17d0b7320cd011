"""Context parallel (kernel_fun.kda.cp, kernel_fun.cconv.cp) on the CPU: 2 and 4 ranks
forked with the gloo backend, each holding its slice of a packed batch and fla's context for
it (``fla.ops.cp.build_cp_context``; the contiguous layout, and fla 0.6's zigzag where fla
0.6 is installed). Sequences cross rank boundaries (one spanning three
ranks, one shorter than a chunk, one ending exactly at a boundary); with and without the
gate and l2norm in the op, GVA, the V-first state layout. Every rank's output and every
gradient equal the single-process call on the whole batch within fp32 rounding (the
parameters' gradients summed over the ranks) and are within fla's budgets of the float64
oracle on the whole batch, kernel-fun's chain witnessed on every rank
(its record, with the exchanges noted); what the chain leaves to fla still goes there."""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.cp import local_tokens
from kernel_fun.kda import chunk_kda, last_record, use_impls
from kernel_fun.kda import reference as ref
from kernel_fun.kda.problems import GRAD_NAMES, Problem, as_oracle_inputs, cotangents, leaves, make_inputs

# (name, world, global offsets, problem)
CASES = [
    ("cp2-cross", 2, (0, 50, 150, 256), Problem("cp2", 1, 256, 2, 2, 32, 16)),
    # a sequence over three ranks, one shorter than a chunk, one ending at a boundary (64)
    ("cp4-span3", 4, (0, 20, 64, 230, 256), Problem("cp4", 1, 256, 1, 2, 32, 16)),
    ("cp2-pregated-vfirst", 2, (0, 100, 192), Problem("cp2p", 1, 192, 1, 1, 32, 16, gate_in_kernel=False,
                                                       l2norm_in_kernel=False, state_v_first=True)),
    # fla's disable_recompute (the forward keeps w, u, qg, kg, h; the backward's exchange reads them)
    ("cp2-keep", 2, (0, 90, 128), Problem("cp2k", 1, 128, 2, 2, 32, 16, disable_recompute=True)),
]


# fla's budgets against the float64 oracle (relative RMS)
BUDGETS = {"o": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02, "dA_log": 0.02,
           "ddt_bias": 0.02}
CONV_OFFSETS = (0, 62, 130, 256)
# what each spawned world checks, in one set of processes (a spawn costs seconds of imports)
WORLDS = {2: ("cp2-cross", "cp2-pregated-vfirst", "cp2-keep", "conv"), 4: ("cp4-span3", "conv")}


def _in_group(rank: int, world: int, init: str, out_dir: str, check) -> None:
    """``check()`` on this rank of a gloo group; the rank's file in ``out_dir`` says "ok" or
    holds the traceback."""
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        check()
        text = "ok"
    except BaseException:
        text = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(text)


def _worker(rank: int, world: int, init: str, out_dir: str):
    def check():
        torch.manual_seed(0)
        from kernel_fun import _fla

        layouts = ("contiguous", "zigzag") if _fla.version_tuple() >= (0, 6) else ("contiguous",)
        for layout in layouts:  # (fla 0.6's zigzag layout: rank r holds runs r and 2 world - 1 - r)
            for case in WORLDS[world]:
                if case == "conv":
                    _check_conv_rank(rank, world, CONV_OFFSETS, layout)
                else:
                    _, _, offsets, p = next(c for c in CASES if c[0] == case)
                    _check_rank(rank, world, offsets, p, layout)

    _in_group(rank, world, init, out_dir, check)


def _context(cu: torch.Tensor, layout: str, **kw):
    from fla.ops.cp import build_cp_context

    extra = {} if layout == "contiguous" else {"layout": layout}
    return build_cp_context(cu, group=dist.group.WORLD, cu_seqlens_cpu=cu, **kw, **extra)


def _check_rank(rank: int, world: int, offsets, p: Problem, layout: str):
    cu = torch.tensor(offsets, dtype=torch.int32)
    p = dataclasses.replace(p, cu_seqlens=tuple(offsets), dtype=torch.float32)
    kw = make_inputs(p, seed=1)
    with use_impls("reference"):
        with torch.no_grad():
            o, _ = chunk_kda(**kw)
        cot = list(cotangents(o, None, seed=2))[:1]
        whole = _step(kw, cot)
    ctx = _context(cu, layout)
    mine = lambda t: local_tokens(t, rank, world, layout)  # noqa: E731
    local = {n: (mine(v).detach().clone().requires_grad_(v.requires_grad) if n in ("q", "k", "v", "g", "beta")
                 else v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
             for n, v in kw.items() if n not in ("cu_seqlens", "cu_seqlens_cpu")}
    with use_impls("reference"):
        got = _step(dict(local, cp_context=ctx), [mine(cot[0])])
    record = last_record()
    assert record is not None and record.engaged and "CP" in record.notes, record
    if p.name == "cp2":  # through fla's own binding after patch_fla(): the same call, the same numbers
        import fla.ops.kda as fla_kda

        from kernel_fun.patch import fla_patched

        with fla_patched(), use_impls("reference"):
            again = _step(dict(local, cp_context=ctx), [mine(cot[0])], fla_kda.chunk_kda)
        assert "CP" in last_record().notes and all(torch.equal(again[n], got[n]) for n in got)
    oracle = _step(as_oracle_inputs(kw), [cot[0].double()], ref.recurrent_kda)  # (the whole batch, float64)
    for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        a, b = got[name], mine(whole[name])
        assert ref.rel_rms(a, b) < 1e-5, (layout, rank, name, ref.rel_rms(a, b))
        assert ref.rel_rms(a, mine(oracle[name])) <= BUDGETS[name], (layout, rank, name, "oracle")
    for name in ("dA_log", "ddt_bias"):
        if name in got:
            total = got[name].clone()
            dist.all_reduce(total)
            assert ref.rel_rms(total, whole[name]) < 1e-5, (layout, rank, name)
            assert ref.rel_rms(total, oracle[name]) <= BUDGETS[name], (layout, rank, name, "oracle")


def _check_conv_rank(rank: int, world: int, offsets, layout: str):
    """causal_conv1d (W=4, silu, bias, a residual) on this rank's slice with the context:
    y and dx the whole batch's slice, dweight and dbias summed over the ranks; a sequence
    starting two tokens before a rank boundary (fewer than W - 1 there)."""
    from kernel_fun.cconv import causal_conv1d, last_route
    from kernel_fun.cconv.reference import conv_reference

    cu = torch.tensor(offsets, dtype=torch.int32)
    T, D, W = offsets[-1], 8, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, T, D, generator=gen, requires_grad=True)
    res = torch.randn(1, T, D, generator=gen)
    weight = torch.randn(D, W, generator=gen, requires_grad=True)
    bias = torch.randn(D, generator=gen, requires_grad=True)
    dy = torch.randn(1, T, D, generator=gen)
    # (the whole batch through the torch reference; the ranks through kernel-fun's convolution:
    # its kernels where the interpreter runs them)
    y, _ = conv_reference(x, weight, bias, res, None, False, "silu", cu)
    want = [y.detach(), *torch.autograd.grad(y, [x, weight, bias], dy)]
    ctx = _context(cu, layout, conv1d_kernel_size=W)
    mine = lambda t: local_tokens(t, rank, world, layout)  # noqa: E731
    xl = mine(x.detach()).clone().requires_grad_()
    yl, _ = causal_conv1d(xl, weight, bias, mine(res), activation="silu", cp_context=ctx)
    assert "halo exchanged" in last_route(), last_route()
    dxl, dw, db = torch.autograd.grad(yl, [xl, weight, bias], mine(dy))
    for t in (dw, db):
        dist.all_reduce(t)
    for name, a, b in (("y", yl, mine(want[0])), ("dx", dxl, mine(want[1])), ("dweight", dw, want[2]),
                       ("dbias", db, want[3])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (layout, rank, name, (a - b).abs().max())


def _step(kw: dict, cot, fn=chunk_kda) -> dict:
    o, _ = fn(**kw)
    named = leaves(kw)
    grads = torch.autograd.grad([o], list(named.values()), cot)
    return {"o": o.detach(), **{GRAD_NAMES[n]: g for n, g in zip(named, grads)}}


def _warm():
    """fla's context module imported and the chain's first call made here, once, so each
    forked rank starts warm (a rank's first call otherwise costs seconds)."""
    import fla.ops.cp  # noqa: F401

    from kernel_fun.cconv import causal_conv1d

    p = dataclasses.replace(CASES[0][3], T=64, cu_seqlens=(0, 30, 64), dtype=torch.float32)
    kw = make_inputs(p, seed=1)
    with use_impls("reference"):
        o, _ = chunk_kda(**kw)
        o.sum().backward()
    causal_conv1d(torch.randn(1, 8, 4, requires_grad=True), torch.randn(4, 4), activation="silu")[0].sum().backward()


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.every_fla), 4])
def test_context_parallel_equals_the_whole_batch(world, tmp_path):
    """Each world's cases (``WORLDS``): chunk_kda's and causal_conv1d's."""
    _warm()
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_worker, args=(world, init, str(tmp_path)), nprocs=world, start_method="fork")
    for rank in range(world):
        text = (tmp_path / f"rank{rank}").read_text()
        assert text == "ok", f"rank {rank}:\n{text}"


@dataclasses.dataclass
class _Context:
    """fla's context's fields, for the gate's checks (no process group needed)."""

    group: object = "group"
    cu_seqlens: torch.Tensor = dataclasses.field(default_factory=lambda: torch.tensor([0, 40, 64], dtype=torch.int32))
    cu_seqlens_cpu: torch.Tensor = dataclasses.field(default_factory=lambda: torch.tensor([0, 40, 64], dtype=torch.int32))
    is_first_rank: bool = True
    is_last_rank: bool = False
    pre_num_ranks: int = 0
    post_num_ranks: int = 1
    layout: str = "contiguous"


@pytest.mark.parametrize("change, why", [
    (dict(call=dict(output_final_state=True)), "initial or final state"),
    (dict(call=dict(initial_state=True)), "initial or final state"),
    (dict(), "without an initialized torch.distributed"),
])
def test_what_context_parallel_leaves_to_fla(change, why):
    """The calls with a context kernel-fun does not take go to fla, which gives its own error
    or runs them: an initial or final state (fla's assert), and a context without
    torch.distributed initialized."""
    from kernel_fun.kda import is_supported

    p = Problem("cp-gate", 1, 64, 1, 1, 32, 16, cu_seqlens=(0, 40, 64), dtype=torch.float32)
    kw = make_inputs(p, seed=1)
    for name in ("cu_seqlens", "cu_seqlens_cpu"):
        kw.pop(name, None)
    call = change.get("call", {})
    if call.get("initial_state"):
        kw["initial_state"] = torch.zeros(2, 1, 32, 16)
    kw["output_final_state"] = bool(call.get("output_final_state"))
    ok, reason = is_supported(**kw, cp_context=_Context(**change.get("ctx", {})))
    assert not ok and why in reason, reason


@pytest.mark.parametrize("block", [64, 3])
def test_the_summaries_are_the_chunk_steps_in_order(block, monkeypatch):
    """The summaries' tree (``BLOCK`` chunks at a time, here also 3: blocks and an odd one out
    at every level) against the chunk steps applied one after another in float64, on a
    fragment of 7.6 chunks starting mid-tensor."""
    from kernel_fun.kda import cp

    monkeypatch.setattr(cp, "BLOCK", block)
    gen = torch.Generator().manual_seed(3)
    T, HV, K, V, BT, bos, eos = 600, 2, 16, 8, 64, 37, 523

    def rnd(*shape, scale=0.3):
        return torch.randn(1, *shape, generator=gen) * scale

    kg, w, qg = rnd(T, HV, K), rnd(T, HV, K), rnd(T, HV, K)
    u, do, dv = rnd(T, HV, V), rnd(T, HV, V), rnd(T, HV, V)
    gc = -torch.rand(1, T, HV, K, generator=gen).cumsum(1) * 0.1
    S = torch.zeros(HV, K, V, dtype=torch.float64)
    M = torch.eye(K, dtype=torch.float64).repeat(HV, 1, 1)
    chunks = [(s, min(s + BT, eos)) for s in range(bos, eos, BT)]
    for s, e in chunks:
        kt, wc = kg[0, s:e].transpose(0, 1).double().transpose(1, 2), w[0, s:e].transpose(0, 1).double()
        step = torch.diag_embed(torch.exp2(gc[0, e - 1].double())) - kt @ wc
        S, M = step @ S + kt @ u[0, s:e].transpose(0, 1).double(), step @ M
    got = cp.forward_summary(kg, w, u, gc, bos, eos, BT)
    assert ref.rel_rms(got, torch.cat([S, M], 2)) < 1e-6
    dh = torch.zeros(HV, K, V, dtype=torch.float64)
    dM = torch.eye(K, dtype=torch.float64).repeat(HV, 1, 1)
    for s, e in reversed(chunks):
        h = lambda x: x[0, s:e].transpose(0, 1).double()  # noqa: E731
        wt = h(w).transpose(1, 2)
        step = torch.diag_embed(torch.exp2(gc[0, e - 1].double())) - wt @ h(kg)
        dh, dM = step @ dh + 0.5 * (h(qg).transpose(1, 2) @ h(do)) - wt @ h(dv), step @ dM
    got = cp.backward_summary(qg, kg, w, do, dv, gc, 0.5, bos, eos, BT)
    assert ref.rel_rms(got, torch.cat([dh, dM], 2)) < 1e-6


def _gather_worker(rank: int, world: int, init: str, out_dir: str):
    from benchmarks.cp import gloo_takes_stacked_gathers

    def check():
        from fla.ops.cp.comm import all_gather_into_tensor

        inp = torch.arange(6.0).view(3, 2) + 10 * rank
        with pytest.raises(Exception, match="invalid tensor size"):  # (gloo alone: the stacked output refused)
            all_gather_into_tensor(inp)
        gloo_takes_stacked_gathers()
        gloo_takes_stacked_gathers()  # (a second call wraps nothing twice)
        got, _ = all_gather_into_tensor(inp)  # fla's layout: [world, *shape]
        want = torch.stack([torch.arange(6.0).view(3, 2) + 10 * r for r in range(world)])
        assert got.shape == want.shape and torch.equal(got, want), got
        flat = torch.empty(world * 3, 2)  # (the concatenated layout passes as before)
        dist.all_gather_into_tensor(flat, inp)
        assert torch.equal(flat, want.view(-1, 2)), flat

    _in_group(rank, world, init, out_dir, check)


def test_the_one_gpu_run_s_gloo_takes_fla_s_stacked_gathers(tmp_path):
    """``benchmarks.cp --one-gpu`` runs fla's context-parallel kernels over gloo, whose
    all-gather takes the output concatenated on dim 0 only; fla passes it stacked, as NCCL
    takes it. With ``gloo_takes_stacked_gathers`` fla's gather gives every rank's input in rank
    order."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_gather_worker, args=(2, init, str(tmp_path)), nprocs=2, start_method="fork")
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == "ok", (tmp_path / f"rank{rank}").read_text()


def test_fla_s_summary_kernels_are_the_gpu_s_exchanges_unless_asked_otherwise(monkeypatch, caplog):
    """On CUDA the exchanges take fla's summary kernels by default (parity checked on an H100:
    benchmarks/results/cp.jsonl), ``KERNEL_FUN_CP_SUMMARIES=torch`` the torch ones; other
    devices always take the torch ones; any other value warns once and keeps the default, as
    every switch does (a running job is never stopped by one)."""
    from kernel_fun.kda import cp

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("KERNEL_FUN_CP_SUMMARIES", raising=False)
    assert cp.fla_summaries(cuda) and not cp.fla_summaries(cpu)
    monkeypatch.setenv("KERNEL_FUN_CP_SUMMARIES", "torch")
    assert not cp.fla_summaries(cuda) and not cp.fla_summaries(cpu)
    monkeypatch.setenv("KERNEL_FUN_CP_SUMMARIES", " FLA ")
    assert cp.fla_summaries(cuda)
    monkeypatch.setenv("KERNEL_FUN_CP_SUMMARIES", "triton")
    with caplog.at_level(logging.WARNING, logger="kernel_fun"):
        assert cp.fla_summaries(cuda) and cp.fla_summaries(cuda)
    warned = [r.getMessage() for r in caplog.records if "KERNEL_FUN_CP_SUMMARIES" in r.getMessage()]
    assert len(warned) == 1 and "'triton'" in warned[0] and "(fla)" in warned[0], warned
