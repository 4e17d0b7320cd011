"""B7-B10's CuTe kernel called through CuTe DSL's TVM-FFI convention: a candidate for the
host time of a small call, not in the package.

What it changes: the host side of one call, not the kernel. The shipped `_run` turns each
of the kernel's 21 tensors into a CuTe tensor in Python (`dlpack_args`), and CuTe's JIT
executor converts each again when called. On an H100 host, B7-B10 took 0.53 ms of the
2.76 ms that our fwd+bwd takes to issue at layer2x8192 (benchmarks/results/host_time.jsonl,
kind `host_issue`). That is the largest share of any stage. Compiled with `--enable-tvm-ffi`,
the build takes the torch tensors as they are. apache-tvm-ffi's C++ reads them through
DLPack and checks each dtype, shape, stride, device and alignment against the build. The
machine code of the kernel is the same (the CPU test holds the two builds' cubins equal).

Two ways to pass the stream, the first one found to work on a GPU to be kept:
- `env`: the build skips the stream parameter and reads tvm-ffi's environment stream
  (torch's current stream, set by tvm-ffi from the torch tensors it is called with);
- `explicit`: the stream is passed as an argument, torch's current stream's handle.

Predicted: ~0.4 ms less host issue time a fwd+bwd at layer2x8192, of the 0.53 ms. What
stays is `views`' conversions and allocations and `outputs`' three reductions. The GPU
script (`research/gpu/b7_ffi_ab.py`) checks the outputs bit for bit against the shipped call,
on torch's default stream and on a side stream. It then times the stage's issue and the op's
fwd+bwd, synced and back to back, in one process.

    install("env" | "explicit")   # the op's B7-B10 through this call, in this process
    uninstall()
"""
import torch

from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90 as m

_SHIPPED = m._run
_COMPILED: dict = {}


def ffi_args(tensors: dict, var: bool, use_ffi: bool = True) -> list:
    """``tensors`` as CuTe tensors for the compile: as ``dlpack_args``, with tvm-ffi's view."""
    from cutlass.cute.runtime import from_dlpack

    dynamic = set(m.ROW_ARGS) | {"chunk_rows", "q_rstd", "k_rstd"} if var else set()
    out = []
    for n in m.ARGS:
        t = from_dlpack(tensors[n], assumed_align=16, enable_tvm_ffi=use_ffi)
        out.append(t.mark_compact_shape_dynamic(mode=0, divisibility=1) if n in dynamic else t)
    return out


def compile_build(build_args: tuple, tensors: dict, var: bool, stream: str):
    """One build compiled for TVM-FFI's call (``stream``: ``env`` or ``explicit``)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    s = make_fake_stream(use_tvm_ffi_env_stream=True) if stream == "env" else cuda.CUstream(0)
    return cute.compile(m.build(*build_args), *ffi_args(tensors, var), s, options="--enable-tvm-ffi")


def run(stream: str, q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, g, A_log, dt_bias, lower_bound, q_rstd, k_rstd,
        cu_seqlens, chunk_indices):
    """The shipped ``_run``'s contract and builds, each build called with torch tensors."""
    B, T, Hq, K = k.shape
    H, dev = gc.shape[2], k.device
    l2 = q_rstd is not None
    var = cu_seqlens is not None or T % m.BT != 0
    tensors = m.views(q, k, gc, beta, dAqk, dAkk, dq, dk, dg, g, A_log, dt_bias, q_rstd, k_rstd, cu_seqlens,
                      chunk_indices)
    raw = "bf16" if g.dtype == torch.bfloat16 else "fp32"
    lb = None if lower_bound is None else float(lower_bound)
    if var:
        n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
        runs = [(whole, rows) for whole, rows in zip((True, False), m.split_chunks(tensors["chunk_rows"], n_seq))
                if rows.shape[0]]
    else:
        runs = [(False, None)]
    with torch.cuda.device(dev):
        extra = () if stream == "env" else (torch.cuda.current_stream(dev).cuda_stream,)
        for whole, rows in runs:
            these = tensors if rows is None else {**tensors, "chunk_rows": rows}
            key = (stream, None if var else B * T, H, Hq, K, raw, dt_bias is not None, lb, l2, var, whole, dev.index)
            fn = _COMPILED.get(key)
            if fn is None:
                fn = _COMPILED[key] = compile_build((K, H, H // Hq, l2, var, raw, dt_bias is not None, lb, whole),
                                                    these, var, stream)
            fn(*(these[n] for n in m.ARGS), *extra)
    return m.outputs(tensors, db, A_log, dt_bias)


def install(stream: str = "env") -> None:
    """Route the op's B7-B10 (and B7-B9) CuTe calls through ``run`` in this process."""
    if stream not in ("env", "explicit"):
        raise ValueError(f"stream={stream!r}: 'env' or 'explicit'")
    m._run = lambda *a: run(stream, *a)


def uninstall() -> None:
    m._run = _SHIPPED
