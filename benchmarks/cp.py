"""Context parallel on several GPUs: kernel-fun's ``chunk_kda`` with fla's context against the
single-GPU call on the whole batch (parity) and against fla's own context parallel (time).

    python -m benchmarks.cp --world 2 --tokens 32768,131072 --out $OUT/cp.jsonl
    python -m benchmarks.cp --world 2 --device cpu --tokens 256 --heads 2 --K 32 --V 16   # a rehearsal (gloo)
    python -m benchmarks.cp --world 2 --one-gpu --tokens 8192 --out $OUT/cp.jsonl   # parity on one GPU

One process a GPU (NCCL; gloo on the CPU), each holding its share of one packed batch of
``world x tokens`` tokens at the production head dims (16 heads of K=128, V=256, bf16, the
gate, l2norm and beta's sigmoid in the op), sequences of mixed lengths crossing the ranks'
boundaries. Per layout (contiguous, and fla 0.6's zigzag where it is installed):

- parity: every rank's o and gradients against the same rank's slice of the single-device
  call on the whole batch (each rank runs it on its own GPU), relative RMS, with the launch
  witness (the chain's record and its context-parallel note); the exchanges' summaries in
  torch (``KERNEL_FUN_CP_SUMMARIES=torch``) and, on GPUs, through fla's kernels (the default
  there);
- time: fwd+bwd of ours (fla's summaries, and the torch ones) and of fla's ``chunk_kda`` with the same context,
  interleaved round by round, CUDA events on every rank, a barrier before each call; the
  slowest rank's median.

``--one-gpu``: every rank on the one GPU there is, through gloo (which takes CUDA tensors by
way of the host): the parity of both summaries, fla's kernels' included, on a machine of one
GPU; no times (the ranks share the GPU).

A row a (layout, tokens) from rank 0, printed and appended to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import traceback
from pathlib import Path


def offsets(T: int, world: int) -> list[int]:
    """Mixed lengths over the whole batch: a long sequence crossing two or more rank
    boundaries, short ones, one ending exactly at a boundary."""
    share = T // world
    cuts = {0, T, share // 3, share + share // 2 + 7, max(T - share // 2 - 5, share + 1)}
    if world > 2:  # (with two ranks the one boundary is left for a sequence to cross)
        cuts.add(2 * share)
    cuts |= {T - 70, T - 3} if T > 140 else set()
    return sorted(c for c in cuts if 0 <= c <= T)


def local_tokens(x, rank: int, world: int, layout: str):
    """A rank's tokens of a [1, T, ...] tensor: one run of T / world (contiguous), or runs rank
    and 2 world - 1 - rank of T / (2 world) (fla 0.6's zigzag)."""
    import torch

    if layout == "contiguous":
        part = x.shape[1] // world
        return x[:, rank * part:(rank + 1) * part]
    part = x.shape[1] // (2 * world)
    back = 2 * world - 1 - rank
    return torch.cat([x[:, rank * part:(rank + 1) * part], x[:, back * part:(back + 1) * part]], dim=1)


def gloo_takes_stacked_gathers() -> None:
    """``torch.distributed.all_gather_into_tensor`` as NCCL takes it, under gloo: NCCL takes the
    output as the ranks' inputs stacked ([world, *shape], the layout fla's context-parallel
    kernels pass) or concatenated on dim 0; gloo only concatenated. A stacked output goes to
    gloo as its concatenated view: the same memory, the same result."""
    import torch.distributed as dist

    gather = dist.all_gather_into_tensor
    if getattr(gather, "takes_stacked", False):
        return

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if (input_tensor.dim() > 0 and output_tensor.dim() == input_tensor.dim() + 1
                and output_tensor.shape[1:] == input_tensor.shape and output_tensor.is_contiguous()):
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)

    all_gather_into_tensor.takes_stacked = True
    dist.all_gather_into_tensor = all_gather_into_tensor


def _rank_main(rank: int, world: int, args, init: str, out: str):
    import torch
    import torch.distributed as dist

    try:
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_device(0 if args.one_gpu else rank)
            from benchmarks import fla_configs  # (fla's stored autotune choices for this GPU, before fla is imported)

            fla_configs.use_stored_configs(torch.cuda.get_device_name())
        dist.init_process_group("nccl" if cuda and not args.one_gpu else "gloo", init_method=init, rank=rank,
                                world_size=world)
        if dist.get_backend() == "gloo":
            gloo_takes_stacked_gathers()
        rows = [_measure(rank, world, args, layout, tokens)
                for tokens in (int(t) for t in args.tokens.split(",")) for layout in _layouts()]
        if rank == 0:
            with open(out, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    except BaseException:
        with open(f"{out}.rank{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _layouts():
    from kernel_fun import _fla

    return ("contiguous", "zigzag") if _fla.version_tuple() >= (0, 6) else ("contiguous",)


def _measure(rank: int, world: int, args, layout: str, tokens: int) -> dict:
    import torch
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context

    from kernel_fun import _fla
    from kernel_fun.kda import chunk_kda, last_record, use_impls
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import GRAD_NAMES, Problem, cotangents, leaves, make_inputs

    cuda = args.device == "cuda"
    dev = f"cuda:{0 if args.one_gpu else rank}" if cuda else "cpu"
    T = world * tokens
    cu_list = offsets(T, world)
    p = Problem("cp", 1, T, args.heads, args.heads, args.K, args.V, beta_sigmoid_in_kernel=True,
                cu_seqlens=tuple(cu_list), dtype=torch.bfloat16 if cuda else torch.float32)
    kw = make_inputs(p, device=dev, seed=1)  # (the same draw on every rank)
    impls = use_impls("reference") if not cuda else contextlib.nullcontext()
    with impls:
        with torch.no_grad():
            o, _ = chunk_kda(**kw)
        cot = list(cotangents(o, None, seed=2))[:1]

        def step(fn, call, c):
            out, _ = fn(**call)
            named = leaves(call)
            grads = torch.autograd.grad([out], list(named.values()), c)
            return {"o": out.detach(), **{GRAD_NAMES[n]: g for n, g in zip(named, grads)}}

        whole = step(chunk_kda, kw, cot)
        cu = kw["cu_seqlens"].to(torch.int32)
        extra = {} if layout == "contiguous" else {"layout": layout}
        ctx = build_cp_context(cu, group=dist.group.WORLD, cu_seqlens_cpu=cu.cpu(), **extra)
        mine = lambda t: local_tokens(t, rank, world, layout)  # noqa: E731
        local = {n: (mine(v).detach().clone().requires_grad_(v.requires_grad) if n in ("q", "k", "v", "g", "beta")
                     else v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
                 for n, v in kw.items() if n not in ("cu_seqlens", "cu_seqlens_cpu")}
        local["cp_context"] = ctx
        lcot = [mine(cot[0])]
        errors, witness = {}, True
        # the exchanges' summaries in torch, and (on GPUs) through fla's kernels
        for variant in (("torch", "fla") if cuda else ("torch",)):
            os.environ["KERNEL_FUN_CP_SUMMARIES"] = variant
            got = step(chunk_kda, local, lcot)
            record = last_record()
            for n in ("o", "dq", "dk", "dv", "dg", "dbeta"):
                errors[f"{n}:{variant}"] = ref.rel_rms(got[n], mine(whole[n]))
            for n in ("dA_log", "ddt_bias"):
                total = got[n].float().clone()
                dist.all_reduce(total)
                errors[f"{n}:{variant}"] = ref.rel_rms(total, whole[n])
            witness &= bool(record is not None and record.engaged and f"({variant})" in record.notes.get("CP", ""))
        del whole, got
        ms = {}
        if cuda and not args.one_gpu:
            fla_fn = _fla.chunk_kda()

            def ours(variant):
                os.environ["KERNEL_FUN_CP_SUMMARIES"] = variant
                return step(chunk_kda, local, lcot)

            fns = {"ours": lambda: ours("fla"), "ours_torch_summaries": lambda: ours("torch"),
                   "fla": lambda: step(fla_fn, local, lcot)}
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    for _ in range(2):
                        fn()
                    for _ in range(args.reps):
                        dist.barrier()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        fn()
                        end.record()
                        end.synchronize()
                        times[k].append(start.elapsed_time(end))
            mine_ms = torch.tensor([statistics.median(times[k]) for k in fns], device=dev)
            dist.all_reduce(mine_ms, op=dist.ReduceOp.MAX)  # the slowest rank's
            ms = dict(zip(fns, mine_ms.tolist()))
    flags = torch.tensor([float(witness)], device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    worst = torch.tensor([errors[n] for n in sorted(errors)], device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"kind": "cp", "world": world, "layout": layout, "tokens_per_rank": tokens, "offsets": cu_list,
            "problem": p.describe(), "ms": ms, "speedup": (ms["fla"] / ms["ours"]) if ms else None,
            "vs_whole": dict(zip(sorted(errors), worst.tolist())), "witness_every_rank": bool(flags.item()),
            "one_gpu": bool(args.one_gpu), "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    from benchmarks import rows

    parser = argparse.ArgumentParser(prog="python -m benchmarks.cp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", default="32768,131072", help="each rank's share of the batch, comma list")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--one-gpu", action="store_true", help="every rank on GPU 0 through gloo: parity, no times")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "rows.jsonl")
    mp.start_processes(_rank_main, args=(args.world, args, f"file://{tmp}/rendezvous", out), nprocs=args.world,
                       start_method="spawn")
    found = [json.loads(line) for line in Path(out).read_text().splitlines()]
    for row in found:
        row = rows.stamp(row)
        print(json.dumps(row), flush=True)
        if args.out:
            rows.append(Path(args.out), row)
    print(f"{'layout':11s} {'tokens/rank':>11s} {'ours ms':>9s} {'fla ms':>9s} {'speedup':>8s} {'worst vs whole':>15s}")
    for r in found:
        ms = r["ms"] or {}
        print(f"{r['layout']:11s} {r['tokens_per_rank']:11d} {ms.get('ours', float('nan')):9.3f} "
              f"{ms.get('fla', float('nan')):9.3f} {r['speedup'] or float('nan'):8.3f} "
              f"{max(r['vs_whole'].values()):15.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
