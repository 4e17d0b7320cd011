"""Bench of fla's own ``KimiDeltaAttention`` layer, fwd+bwd, with and without ``kernel_fun.patch_fla()``.

``python -m kernel_fun.bench.layer --B 2 --T 8192``

The layer at fla's defaults (hidden 2048, 16 heads, head dims 128, short convolutions;
``--safe-gate`` builds it with ``safe_gate=True, lower_bound=-5``), bf16. One process,
the same weights and inputs: parity first (the output, the input's gradient and every
parameter's gradient of the patched layer within fla's budgets of the unpatched one, and
the record showing kernel-fun's chain engaged), then the median of CUDA-event timings of
fwd+bwd (``backward`` of a random projection of the output), the two interleaved round by
round. One row per side (a dict); the command prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

import torch


# The layer's parameters whose gradients carry a gate or beta term take those gradients'
# budget (fla's 0.02); the output fla's o budget; every other gradient dq/dk/dv's (0.008).
GATE_PARAMS = ("A_log", "dt_bias", "f_proj", "b_proj")


def parity_bar(name: str) -> float:
    """The relative RMS bar against fla's own layer for the output (``o``), the input's
    gradient (``dx``) or a parameter's gradient (by parameter name)."""
    if name == "o":
        return 0.005
    return 0.02 if any(k in name for k in GATE_PARAMS) else 0.008


def fla_layer(seed: int = 0, **flags):
    """fla's KimiDeltaAttention at fla's defaults (hidden 2048, 16 heads, head dims 128, short
    convolutions), on the GPU in bf16, its weights drawn from ``seed``."""
    from kernel_fun import _fla

    torch.manual_seed(seed)
    return _fla.kimi_delta_attention()(hidden_size=2048, head_dim=128, num_heads=16, **flags).cuda().to(torch.bfloat16)


def fwd_bwd(layer, x, w, attention_mask=None):
    """One fwd+bwd of ``(layer(x)[0] * w).sum()`` (``layer``: a module or its compiled
    wrapper); returns the output."""
    o = (layer(x) if attention_mask is None else layer(x, attention_mask=attention_mask))[0]
    (o.float() * w).sum().backward()
    return o


def layer_grads(layer, x, w, attention_mask=None, call=None) -> dict:
    """One fwd+bwd of ``(o * w).sum()`` from fresh gradients: the output (``o``), the
    input's gradient (``dx``) and every parameter's gradient, by parameter name. ``call``
    (default ``layer``) runs the step, a compiled wrapper of ``layer`` say; the parameters
    are named as ``layer`` names them."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    o = fwd_bwd(layer if call is None else call, x, w, attention_mask)  # (a compiled module has no truth value)
    return {"o": o.detach(), "dx": x.grad, **{n: p.grad.detach().clone() for n, p in layer.named_parameters()}}


def parity_misses(ours: dict, fla: dict) -> tuple[dict, dict]:
    """(relative RMS error of every entry of ``layer_grads`` against fla's layer, those over
    their ``parity_bar``)."""
    from kernel_fun.kda import reference as ref

    errors = {n: ref.rel_rms(ours[n], fla[n]) for n in fla}
    return errors, {n: (e, parity_bar(n)) for n, e in errors.items() if not e <= parity_bar(n)}


def run(B: int = 2, T: int = 8192, safe_gate: bool = False, reps: int = 10, rounds: int = 5,
        profile: bool = False) -> list[dict]:
    """fla's layer and the patched one at (B, T): parity first, then the interleaved timings;
    one row each (fla's first). ``profile``: each row also gets its kernels' device time
    (``kernel_profile``) and the time a call issued back to back (``stream_time``: the GPU's
    time where the host runs ahead, as in a training step)."""
    from kernel_fun import versions
    from kernel_fun.bench.timing import cuda_times, summary
    from kernel_fun.cconv import last_route
    from kernel_fun.kda import last_record
    from kernel_fun.patch import fla_patched

    flags = dict(safe_gate=True, lower_bound=-5.0) if safe_gate else {}
    fla_side = fla_layer(**flags)
    ours_layer = copy.deepcopy(fla_side)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = torch.randn(B, T, 2048, device="cuda", generator=gen)
    # Each side in its own context, entered once per round: patch_fla() walks every loaded
    # fla module, host time that is no part of a training step's.
    layers = {"fla": (fla_side, contextlib.nullcontext), "ours": (ours_layer, fla_patched)}

    fla_grads = layer_grads(fla_side, x, w)
    with fla_patched():
        ours_grads = layer_grads(ours_layer, x, w)
        record = last_record()
        conv = last_route()  # the short convolutions' launch witness
    errors, misses = parity_misses(ours_grads, fla_grads)
    ok = bool(record.engaged and record.backward.get("B6") == "ours" and not misses)
    del fla_grads, ours_grads
    print(f"parity: {'ok' if ok else 'RED'} (convolutions: {conv}) {errors}", flush=True)

    times = {"fla": [], "ours": []}
    for name, (layer, context) in layers.items():  # warm-up
        with context():
            for _ in range(3):
                fwd_bwd(layer, x, w)
    if ok:
        for _ in range(rounds):
            for name, (layer, context) in layers.items():
                with context():
                    times[name] += cuda_times(lambda: fwd_bwd(layer, x, w), reps)
    extra = {name: {} for name in layers}
    if ok and profile:
        from kernel_fun.bench.timing import kernel_profile, stream_time

        for name, (layer, context) in layers.items():
            with context():
                extra[name] = {**kernel_profile(lambda: fwd_bwd(layer, x, w)),
                               "fwdbwd_stream_ms": stream_time(lambda: fwd_bwd(layer, x, w), reps)}
    info = versions()
    shape = f"kda_layer_B{B}_T{T}" + ("_safe" if safe_gate else "")
    rows = []
    for name in ("fla", "ours"):
        s = summary(times[name]) if times[name] else None
        rows.append({
            "kind": "layer", "shape": shape, "impl": name,
            "problem": f"fla KimiDeltaAttention hidden 2048, 16 heads, head dims 128, short conv, bf16, "
                       f"B{B} T{T}" + (", safe_gate, lower_bound=-5" if safe_gate else ""),
            "fwdbwd_ms": s["median"] if s else None, "fwdbwd_spread_ms": [s["p10"], s["p90"]] if s else None,
            "reps": s["n"] if s else 0,
            "parity": {"ok": ok, "vs_fla": errors, "impls": {**record.forward, **record.backward},
                       "convolutions": conv},
            "gpu": torch.cuda.get_device_name(), "versions": info,
            "fla_cache_mode": os.environ.get("FLA_CACHE_MODE", "disabled"), **extra[name],
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    fla_ms = rows[0]["fwdbwd_ms"]
    return "\n".join(f"{r['shape']} {r['impl']:<5} {r['fwdbwd_ms']:.2f} ms  {fla_ms / r['fwdbwd_ms']:.3f}x"
                     if r["fwdbwd_ms"] and fla_ms else f"{r['shape']} {r['impl']} RED" for r in rows)


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(prog="python -m kernel_fun.bench.layer", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--B", type=int, default=2)
    out.add_argument("--T", type=int, default=8192)
    out.add_argument("--safe-gate", action="store_true")
    out.add_argument("--reps", type=int, default=10)
    out.add_argument("--rounds", type=int, default=5)
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(args.B, args.T, args.safe_gate, args.reps, args.rounds)
    print(format_rows(rows))
    return 0 if rows[0]["parity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
