"""Bench of ``causal_conv1d``: kernel-fun's kernels against fla's, forward and fwd+bwd.

``python -m kernel_fun.bench.cconv --shapes d2048,d4096,packed2048``

Shapes (bf16 x, fp32 weight, W=4, SiLU, no bias: a KimiDeltaAttention layer's q/k and v
convolutions): d2048 and d4096 are B16 T8192; packed2048 is the same tokens as one packed
batch of documents (lengths drawn once, seeded, 1 to 16,384 tokens). Parity first: y and
every gradient against fla's on the same inputs (bf16: y and dx within 1e-3 relative RMS,
dweight 2e-3), and
y, dx and dweight against the float64 reference on the whole batch (no more than 10% worse
than fla's own error); the launch witness
(``kernel_fun.cconv.last_route``). Then the median of CUDA-event timings, fla and every
config interleaved round by round: ``ms`` each call alone (synced, its host time included),
``stream_ms`` a call of calls issued back to back (the host running ahead, as in a training
step: the GPU's time where the host keeps up; the figure the memory floor is held to). One
row per (shape, phase, implementation); the command prints them.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

SHAPES = {"d2048": dict(B=16, T=8192, D=2048), "d4096": dict(B=16, T=8192, D=4096),
          "packed2048": dict(B=16, T=8192, D=2048, packed=True), "small": dict(B=2, T=1000, D=512)}
# the parity bars against fla in bf16 (both take SiLU's derivative at the pre-activation
# rounded to x's dtype); the float64 check holds each output to fla's own error.
BARS = dict(y=1e-3, dx=1e-3, dw=2e-3, db=2e-3)


def floors_bytes(B, T, D, dtype_bytes=2) -> dict:
    """The fewest bytes: forward x read, y written; backward x and dy read, dx written."""
    n = B * T * D * dtype_bytes
    return {"fwd": 2 * n, "fwd+bwd": 5 * n}


def make_inputs(shape: dict, device="cuda", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T, D = shape["B"], shape["T"], shape["D"]
    kw = dict(weight=(torch.randn(D, 4, generator=g) / 2).to(device), bias=None, activation="silu")
    if shape.get("packed"):
        total, lens = B * T, []
        while sum(lens) < total:
            lens.append(int(torch.randint(1, 16385, (1,), generator=g)))
        lens[-1] -= sum(lens) - total
        lens = [n for n in lens if n > 0]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kw.update(x=torch.randn(1, total, D, generator=g).to(device, torch.bfloat16), cu_seqlens=cu.to(device),
                  cu_seqlens_cpu=cu)
    else:
        kw["x"] = torch.randn(B, T, D, generator=g).to(device, torch.bfloat16)
    return kw


def _run(fn, kw, dy, backward: bool):
    x = kw["x"].detach().requires_grad_(backward)
    w = kw["weight"].detach().requires_grad_(backward)
    y, _ = fn(**{**kw, "x": x, "weight": w})
    if backward:
        y.backward(dy)
        return y, x.grad, w.grad
    return y, None, None


def label(config: dict) -> str:
    """A kernel-fun row's implementation name: its launch config."""
    return "ours[" + ",".join(f"{k}={v}" for k, v in sorted(config.items())) + "]"


def run(shapes: list[str], configs: list[dict] | None = None, reps: int = 20, rounds: int = 3) -> list[dict]:
    """Rows of fla's and kernel-fun's convolution (each config in ``configs``, over the pinned
    one; the pinned one alone by default) at each shape, forward and fwd+bwd."""
    from kernel_fun import _fla, versions
    from kernel_fun.bench.timing import cuda_times, stream_time, summary
    from kernel_fun.cconv import causal_conv1d, kernels as K, last_route
    from kernel_fun.cconv.reference import conv_reference
    from kernel_fun.kda.reference import rel_rms

    fla = _fla.causal_conv1d()
    configs = [{**K.DEFAULT_CONFIG, **c} for c in (configs or [{}])]
    rows = []
    for name in shapes:
        shape = SHAPES[name]
        kw = make_inputs(shape)
        dy = torch.randn_like(kw["x"])
        nbytes = floors_bytes(shape["B"], shape["T"], shape["D"])

        def ours_with(cfg):
            def fn(**k):
                with K.use_config(**cfg):
                    return causal_conv1d(**k)
            return fn

        theirs = _run(fla, kw, dy, True)
        # the float64 reference on the whole batch (y, dx, dweight: dweight sums every sequence)
        x64 = kw["x"].detach().double().requires_grad_(True)
        w64 = kw["weight"].detach().double().requires_grad_(True)
        y64, _ = conv_reference(x64, w64, None, None, None, False, "silu", kw.get("cu_seqlens"))
        y64.backward(dy.double())
        exact = (y64.detach(), x64.grad, w64.grad)
        del x64, w64, y64
        vs_exact = lambda got, exact=exact: {n: rel_rms(got[i], exact[i])  # noqa: E731
                                             for i, n in enumerate(("y", "dx", "dw"))}
        fla_err = vs_exact(theirs)
        impls = {"fla": (fla, None)}
        checks = {"fla": {"ok": True, "vs_exact": fla_err}}
        for cfg in configs:
            fn = ours_with(cfg)
            got = _run(fn, kw, dy, True)
            route = last_route()
            errs = {"y": rel_rms(got[0], theirs[0]), "dx": rel_rms(got[1], theirs[1]), "dw": rel_rms(got[2], theirs[2])}
            our_err = vs_exact(got)
            ok = (route == "kernels" and all(errs[n] <= BARS[n] for n in errs)
                  and all(our_err[n] <= 1.1 * fla_err[n] + 1e-6 for n in our_err))
            checks[label(cfg)] = {"ok": ok, "vs_fla": errs, "vs_exact": our_err, "route": route}
            impls[label(cfg)] = (fn, cfg)
            del got
        del exact, vs_exact
        times = {(lb, phase): [] for lb in impls for phase in ("fwd", "fwd+bwd")}
        streams = {(lb, phase): [] for lb in impls for phase in ("fwd", "fwd+bwd")}
        for lb, (fn, _) in impls.items():  # warm-up
            if checks[lb]["ok"]:
                _run(fn, kw, dy, True)
        for _ in range(rounds):
            for lb, (fn, _) in impls.items():
                if not checks[lb]["ok"]:
                    continue
                with torch.no_grad():
                    times[(lb, "fwd")] += cuda_times(lambda fn=fn, kw=kw: fn(**kw), reps)
                times[(lb, "fwd+bwd")] += cuda_times(lambda fn=fn, kw=kw, dy=dy: _run(fn, kw, dy, True), reps)
                with torch.no_grad():
                    streams[(lb, "fwd")].append(stream_time(lambda fn=fn, kw=kw: fn(**kw), reps))
                streams[(lb, "fwd+bwd")].append(stream_time(lambda fn=fn, kw=kw, dy=dy: _run(fn, kw, dy, True), reps))
        for lb, (_, cfg) in impls.items():
            for phase in ("fwd", "fwd+bwd"):
                s = summary(times[(lb, phase)]) if times[(lb, phase)] else None
                rows.append({"kind": "cconv", "shape": name, "problem": shape, "impl": lb, "config": cfg,
                             "phase": phase, "ms": s["median"] if s else None,
                             "spread_ms": [s["p10"], s["p90"]] if s else None,
                             "stream_ms": statistics.median(streams[(lb, phase)]) if streams[(lb, phase)] else None,
                             "floor_ms": nbytes[phase] / 4.25e12 * 1e3, "parity": checks[lb],
                             "gpu": torch.cuda.get_device_name(), "versions": versions()})
        del kw, dy, theirs
        torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict]) -> str:
    base = {(r["shape"], r["phase"]): r["ms"] for r in rows if r["impl"] == "fla"}
    lines = []
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] else "  RED"
        ratio = f"{base[(r['shape'], r['phase'])] / r['ms']:.2f}x" if r["ms"] and base.get((r["shape"], r["phase"])) else ""
        stream = f"{r['stream_ms']:.3f}" if r["stream_ms"] else "  RED"
        lines.append(f"{r['shape']:<11} {r['phase']:<8} {r['impl']:<52} {ms} ms {ratio:>6} back to back {stream} ms "
                     f"floor {r['floor_ms']:.2f}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(prog="python -m kernel_fun.bench.cconv", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--shapes", default="d2048,d4096,packed2048")
    out.add_argument("--reps", type=int, default=20)
    out.add_argument("--rounds", type=int, default=3)
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(args.shapes.split(","), reps=args.reps, rounds=args.rounds)
    print(format_rows(rows))
    return 0 if all(r["parity"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
