"""Which forward stages leak the future: a full ``chunk_kda`` call with values planted after a
cut against the call on the tokens before it, stage by stage.

A stage leaks when every token- and chunk-shaped input it got is, before the cut, bit for
bit the prefix call's, and one of its outputs is not. (A stage fed by a leaking one is not
counted: its inputs already differ.) ``python -m benchmarks.causal`` prints the table for
the device present (the chain as it runs: kernel-fun's kernels where registered, fla's
elsewhere on a GPU, the references on a CPU); the tests hold kernel-fun's stages to none.
"""

from __future__ import annotations

import argparse
import functools

import torch

from kernel_fun.kda import chunk_kda
from kernel_fun.kda.problems import Problem, make_inputs
from kernel_fun.kda.stages import capture_stages, stages

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
KINDS = ("random", "nan", "inf", "-inf")


def bits(x: torch.Tensor) -> torch.Tensor:
    """x's bits as integers (NaN compares equal to the same NaN; -0 differs from +0)."""
    return x.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def prefix_call(p: Problem, kw: dict, cut: int) -> dict:
    """The call on the first ``cut`` tokens (packed: the sequences cut there)."""
    out = {n: (t[:, :cut] if n in TOKEN_INPUTS else t) for n, t in kw.items()}
    if p.cu_seqlens is not None:
        bounds = [b for b in p.cu_seqlens if b < cut] + [cut]
        out["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=kw["q"].device)
        if kw.get("initial_state") is not None:
            out["initial_state"] = kw["initial_state"][:len(bounds) - 1]
    return out


def planted(kw: dict, cut: int, kind: str, seed: int = 0) -> dict:
    """kw with every token input changed after ``cut``: all of it fresh random values
    (``random``), or values of ``kind`` (nan, inf, -inf) planted in each input at tokens of
    its own (a few tokens past the cut, and one chunk on)."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(kw)
    T = kw["q"].shape[1]
    for i, name in enumerate(TOKEN_INPUTS):
        x = kw[name].clone()
        if kind == "random":
            x[:, cut:] = torch.randn(x[:, cut:].shape, generator=gen).to(x.device, x.dtype)
        else:
            for t in {cut + 3 * i, cut + 70 + i}:
                for b in range(x.shape[0] if t < T else 0):
                    x[b, t].view(-1)[i % 3::3] = float(kind)
        out[name] = x
    return out


# kg = k exp2(g_last - g) is anchored at its chunk's last row: it feeds only the state after
# the chunk, so it is compared over the chunks that end at or before the cut.
CHUNK_GRANULAR = ("kg",)


def _prefix_equal(name: str, full, pre, T: int, T_pre: int, NT: int, NT_pre: int, whole: int) -> bool | None:
    """Whether a token- or chunk-shaped tensor of the full call equals the prefix call's over
    the prefix (``whole``: the tokens before the cut's chunk, for ``CHUNK_GRANULAR``); None
    for anything else (states, offsets, scalars)."""
    if not (isinstance(full, torch.Tensor) and isinstance(pre, torch.Tensor)) or full.dim() < 2 or pre.dim() < 2:
        return None
    if not full.is_floating_point() or full.shape[0] != pre.shape[0] or full.shape[2:] != pre.shape[2:]:
        return None
    if (full.shape[1], pre.shape[1]) in ((T, T_pre), (NT, NT_pre)):
        n = whole if name in CHUNK_GRANULAR and full.shape[1] == T else pre.shape[1]
        return torch.equal(bits(full[:, :n]), bits(pre[:, :n]))
    return None


def _chunks(p: Problem, T: int) -> int:
    """Chunks a batch row of the call on the first T tokens holds (h's second dimension)."""
    bounds = [b for b in (p.cu_seqlens or (0,)) if b < T] + [T]
    return sum(-(-(b - a) // 64) for a, b in zip(bounds, bounds[1:]))


def stage_leaks(p: Problem, cut: int, kinds=KINDS, device: str = "cpu", seed: int = 0) -> dict[str, dict]:
    """{stage: {"impl": ..., "leaks": [kinds], "fed": [kinds whose inputs already differed]}}
    for the forward stages of ``p``'s call cut at ``cut``, and ``"o"``'s own verdict."""
    kw = make_inputs(p, device=device, requires_grad=False, seed=seed)
    with torch.no_grad(), capture_stages() as pre_log:
        o_pre, _ = chunk_kda(**prefix_call(p, kw, cut))
    T, T_pre = kw["q"].shape[1], cut
    NT, NT_pre = _chunks(p, T), _chunks(p, cut)
    bos = max(b for b in (p.cu_seqlens or (0,)) if b < cut)
    whole = bos + (cut - bos) // 64 * 64
    same = functools.partial(_prefix_equal, T=T, T_pre=T_pre, NT=NT, NT_pre=NT_pre, whole=whole)
    verdict: dict[str, dict] = {}
    for j, kind in enumerate(kinds):
        with torch.no_grad(), capture_stages() as log:
            o, _ = chunk_kda(**planted(kw, cut, kind, seed=seed + j))
        assert [(s, i) for s, i, _, _ in log] == [(s, i) for s, i, _, _ in pre_log], "the two calls ran other stages"
        for (stage, impl, inputs, outputs), (_, _, pre_in, pre_out) in zip(log, pre_log):
            entry = verdict.setdefault(stage, {"impl": impl, "leaks": [], "fed": []})
            same_in = [same(n, inputs[n], pre_in[n]) for n in inputs]
            outs = outputs if isinstance(outputs, tuple) else (outputs,)
            pre_outs = pre_out if isinstance(pre_out, tuple) else (pre_out,)
            same_out = [same(n, a, b) for n, a, b in zip(stages()[stage].outputs, outs, pre_outs)]
            if False in same_in:
                entry["fed"].append(kind)
            elif False in same_out:
                entry["leaks"].append(kind)
        op = verdict.setdefault("o", {"impl": "op", "leaks": [], "fed": []})
        if not torch.equal(bits(o[:, :cut]), bits(o_pre)):
            op["leaks"].append(kind)
    return verdict


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    problems = [Problem("pregated", 1, 300, 2, 2, 128, 64, gate_in_kernel=False, initial_state=True),
                Problem("gate", 1, 300, 2, 2, 128, 64),
                Problem("safe-gate", 1, 300, 2, 2, 128, 64, lower_bound=-5.0, safe_gate=True)]
    for p in problems:
        for cut in (37, 128):
            v = stage_leaks(p, cut, device=args.device)
            print(f"{p.name} cut {cut}: " + "; ".join(
                f"{s} ({e['impl']}): leaks {','.join(e['leaks']) or '-'}" for s, e in v.items()))


if __name__ == "__main__":
    main()
