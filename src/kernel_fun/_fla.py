"""fla as kernel-fun calls it: the one module that imports flash-linear-attention.

- ``chunk_kda()`` and ``causal_conv1d()``: fla's own public functions, captured the first
  time they are asked for and kept, so a fallback calls fla's original even after
  ``patch_fla()`` has rebound fla's module attributes to kernel-fun's (a patched process
  never calls itself).
- The stage functions of fla's KDA chain (fla-core 0.5.2's ``chunk_kda_fwd`` /
  ``chunk_kda_bwd`` boundaries), each taking the chain's keyword contract for its stage
  (``kernel_fun.kda.chain`` declares them) and calling fla's function with fla's
  arguments, so a chain forced onto fla alone launches exactly fla's kernels in fla's order.
- ``version()``: the installed fla-core's version.

fla is imported on first use, never at import: it is the fallback, not an import cost.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import importlib
import inspect
import sys
import threading

import torch

_originals: dict[str, object] = {}

# fla's 1/ln 2 (fla.ops.utils.constant.RCP_LN2): the chunk cumsum carries it (log2 units)
RCP_LN2 = 1.4426950216


@torch.compiler.assume_constant_result  # under torch.compile: a constant read at trace time, not traced
def version() -> str:
    """fla-core's installed version ("missing" without it); read once a process (the package
    metadata's parse costs ~2.5 ms, and every call's validation asks)."""
    return _version()


@functools.cache
def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


@torch.compiler.assume_constant_result
def version_tuple() -> tuple[int, int]:
    """(major, minor) of the installed fla-core ((0, 0) without it)."""
    return _version_tuple()


def at_least_0_6() -> bool:
    """Whether the installed fla-core is 0.6 or later. Compared as integers: torch 2.11's
    dynamo fails on a tuple comparison (``>=`` of two tuples) in a traced call."""
    major, minor = version_tuple()
    return major > 0 or minor >= 6


@functools.cache
def _version_tuple() -> tuple[int, int]:
    parts = version().split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return 0, 0


def chunk_kda_backend(call: dict) -> str | None:
    """The backend fla's ``chunk_kda`` would hand this call to instead of its own Triton
    chain (fla 0.6: FlashKDA, when the ``flash_kda`` package is installed, enabled and
    accepts the call), or None: fla 0.5.2 has no such dispatch. ``call``: every argument by
    name. Asked of fla's own registry for ``chunk_kda``, in fla's order; a registry of
    another shape (a later fla) is read as none."""
    if not at_least_0_6():
        return None
    try:
        from inspect import unwrap

        import fla.backends as backends
        from fla.ops.kda.chunk import chunk_kda as dispatched

        registry = backends._function_registries.get(unwrap(dispatched))  # fla's own, by function
        candidates = registry._get_sorted_backends() if registry is not None else []
    except Exception:  # noqa: BLE001 - another fla: no dispatch kernel-fun knows of
        return None
    for backend in candidates:
        try:
            if not (backend.is_available() and backend.is_enabled()):
                continue
            accepted, _ = backend.verify("chunk_kda", **call)
        except Exception:  # noqa: BLE001 - a backend that cannot say takes nothing
            continue
        if accepted and backend.get_implementation("chunk_kda") is not None:
            return backend.backend_type
    return None


@torch.compiler.assume_constant_result  # (under torch.compile: read at trace time)
def chunk_kda_backend_possible() -> bool:
    """Whether any backend of fla's ``chunk_kda`` registry is installed and enabled now (fla
    0.6; read every call: fla reads its switches from the environment), so that
    ``chunk_kda_backend`` must be asked of each call; False under fla 0.5.2."""
    if not at_least_0_6():
        return False
    try:
        from inspect import unwrap

        import fla.backends as backends
        from fla.ops.kda.chunk import chunk_kda as dispatched

        registry = backends._function_registries.get(unwrap(dispatched))
        candidates = registry._get_sorted_backends() if registry is not None else []
        return any(backend.is_available() and backend.is_enabled() for backend in candidates)
    except Exception:  # noqa: BLE001 - another fla: ask chunk_kda_backend every call
        return True


@torch.compiler.assume_constant_result  # (under torch.compile: read at trace time, fla's registry not traced)
def causal_conv1d_backend() -> str | None:
    """The backend fla 0.6's convolution would run its forward on instead of its Triton
    kernels (its Gluon convolution, registered on NVIDIA GPUs and switched on by the user
    with ``FLA_CONV_GLUON=1``), or None. fla asks its backend per stage, on the stage's own
    arguments; this names the first one available and switched on."""
    if not at_least_0_6():
        return None
    try:
        from inspect import unwrap

        import fla.backends as backends
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

        registry = backends._function_registries.get(unwrap(causal_conv1d_fwd))  # fla's own, by function
        for backend in (registry._get_sorted_backends() if registry is not None else []):
            if backend.is_available() and backend.is_enabled():
                return backend.backend_type
    except Exception:  # noqa: BLE001 - another fla: no dispatch kernel-fun knows of
        return None
    return None


def chunk_kda():
    """fla's own ``chunk_kda``, whether or not its bindings are patched."""
    if "chunk_kda" not in _originals:
        from fla.ops.kda.chunk import chunk_kda as original

        _originals["chunk_kda"] = original
    return _originals["chunk_kda"]


def causal_conv1d():
    """fla's own ``causal_conv1d``, whether or not its bindings are patched."""
    if "causal_conv1d" not in _originals:
        importlib.import_module("fla.modules.conv.causal_conv1d")
        _originals["causal_conv1d"] = sys.modules["fla.modules.conv.causal_conv1d"].causal_conv1d
    return _originals["causal_conv1d"]


def kimi_delta_attention():
    """fla's ``KimiDeltaAttention`` layer class (``fla.layers``, from the
    flash-linear-attention package)."""
    from fla.layers.kda import KimiDeltaAttention

    return KimiDeltaAttention


def captured_causal_conv1d():
    """fla's ``causal_conv1d`` if it was captured already, else None (nothing is imported)."""
    return _originals.get("causal_conv1d")


def prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=None):
    """fla's (sequence, chunk) index of a packed batch (``prepare_chunk_indices``)."""
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


# The chunk offsets of the capacity-shaped packed call whose stages run now (None outside
# one): fla's stages are then told use_graph=True (and given the offsets where they take
# them); kernel-fun's kernels and references see the index's spare rows themselves.
_GRAPH_OFFSETS: contextvars.ContextVar = contextvars.ContextVar("kernel_fun_graph_offsets", default=None)


@contextlib.contextmanager
def capacity_shaped(chunk_offsets):
    """The stages run inside are one capacity-shaped packed call's (``chunk_offsets``: each
    sequence slot's first chunk row, [N + 1]); a None changes nothing."""
    if chunk_offsets is None:
        yield
        return
    token = _GRAPH_OFFSETS.set(chunk_offsets)
    try:
        yield
    finally:
        _GRAPH_OFFSETS.reset(token)


# fla's identity-keyed tensor cache (``fla.utils.tensor_cache``): its stages derive the
# sequence lengths and chunk offsets from cu_seqlens (B5's ``prepare_chunk_offsets``) and keep
# the last few results, device memory that outlives the call. Under
# ``torch.compile(mode="reduce-overhead")`` the CUDA-graph trees refuse a call that leaves
# memory of their pool alive beyond its outputs, so a packed call turns the cache off while
# its stages run (fla reads the switch at every call; the chain builds its chunk index before
# and hands it to every stage, so nothing fla would recompute synchronizes). Nested and
# concurrent scopes count.
_NO_CACHE = {"depth": 0, "saved": None}
_NO_CACHE_LOCK = threading.Lock()


@contextlib.contextmanager
def no_tensor_cache():
    utils = sys.modules.get("fla.utils")
    if utils is None or not hasattr(utils, "FLA_DISABLE_TENSOR_CACHE"):
        yield
        return
    with _NO_CACHE_LOCK:
        if _NO_CACHE["depth"] == 0:
            _NO_CACHE["saved"] = utils.FLA_DISABLE_TENSOR_CACHE
            utils.FLA_DISABLE_TENSOR_CACHE = True
        _NO_CACHE["depth"] += 1
    try:
        yield
    finally:
        with _NO_CACHE_LOCK:
            _NO_CACHE["depth"] -= 1
            if _NO_CACHE["depth"] == 0:
                utils.FLA_DISABLE_TENSOR_CACHE = _NO_CACHE["saved"]


def static_chunk_indices(cu_seqlens, chunk_size: int, T: int):
    """fla 0.6's capacity-shaped (sequence, chunk) index of a packed batch: [nt_max, 2] with
    nt_max = ceil(T / chunk_size) + N - 1 for N sequence slots, built on the device (no
    synchronization: a CUDA graph records it); the rows past the real chunks name sequence -1."""
    from fla.ops.utils.index import prepare_chunk_indices_static

    nt_max = -(-T // chunk_size) + cu_seqlens.shape[0] - 2
    return prepare_chunk_indices_static(cu_seqlens=cu_seqlens, chunk_size=chunk_size, nt_max=nt_max)[0]


_ACCEPTS: dict = {}


def _graph(fn, chunk_indices) -> dict:
    """The keywords that put fla's stage ``fn`` in its capacity-shaped mode (``use_graph``,
    and the chunk offsets where it takes them) inside ``capacity_shaped``; else none."""
    offsets = _GRAPH_OFFSETS.get()
    if offsets is None or chunk_indices is None:
        return {}
    accepts = _ACCEPTS.get(fn)
    if accepts is None:
        accepts = _ACCEPTS[fn] = frozenset(inspect.signature(fn).parameters)
    return {name: value for name, value in (("use_graph", True), ("chunk_offsets", offsets)) if name in accepts}


# --------------------------------------------------------------------------------------
# fla's stage functions, with the chain's contracts (kernel_fun.kda.chain declares them)
# --------------------------------------------------------------------------------------
def l2norm_fwd(q, k):
    """F1."""
    from fla.modules.l2norm import l2norm_fwd as fwd

    q, q_rstd = fwd(q)
    k, k_rstd = fwd(k)
    return q, q_rstd, k, k_rstd


def beta_sigmoid(beta, scale):
    """F1b."""
    from fla.ops.common.gate import fused_beta_sigmoid

    return fused_beta_sigmoid(beta, scale=scale)


def gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices):
    """F2 and B1: the gate's activation (in the op) and the chunk cumsum, log2 units."""
    if use_gate_in_kernel:
        from fla.ops.kda.gate import kda_gate_chunk_cumsum

        return kda_gate_chunk_cumsum(
            g=g, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=chunk_size,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, lower_bound=lower_bound,
            **_graph(kda_gate_chunk_cumsum, chunk_indices),
        )
    from fla.ops.utils import chunk_local_cumsum

    return chunk_local_cumsum(
        g=g, scale=RCP_LN2, chunk_size=chunk_size, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        **_graph(chunk_local_cumsum, chunk_indices),
    )


def intra(q, k, v, gc, beta, scale, chunk_size, cu_seqlens, chunk_indices, safe_gate, disable_recompute):
    """F3-F6: (w, u, kg, Aqk, Akk_inv, qg); qg only with ``disable_recompute``."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        chunk_indices=chunk_indices, safe_gate=safe_gate, disable_recompute=disable_recompute,
        **_graph(chunk_kda_fwd_intra, chunk_indices),
    )
    return w, u, kg, Aqk, Akk, qg


def _needs_u(u) -> None:
    if u is None:  # the chain asks F6 / B2 for u whenever the scan that runs reads it
        raise RuntimeError("fla's state scan reads u, and F6 / B2 did not write it")


def state_scan(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens, cu_seqlens_cpu,
               chunk_indices, state_v_first, v=None, beta=None, Akk=None):
    """F7 and B3: (h, v_new, final_state). fla's reads F6's u (v, beta and Akk_inv are B3's
    contract, for a scan that forms u itself)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    _needs_u(u)
    return chunk_gated_delta_rule_fwd_h(
        k=kg, w=w, u=u, gk=gc, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_size=chunk_size,
        state_v_first=state_v_first, **_graph(chunk_gated_delta_rule_fwd_h, chunk_indices),
    )


def output(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    """F8."""
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    return chunk_gla_fwd_o_gk(
        q=q, v=v_new, g=gc, A=Aqk, h=h, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        chunk_indices=chunk_indices, state_v_first=state_v_first, **_graph(chunk_gla_fwd_o_gk, chunk_indices),
    )


def scan_output(q, qg, kg, w, u, gc, Aqk, scale, initial_state, output_final_state, save_states, cu_seqlens_cpu,
                state_v_first, chunk_size, cu_seqlens, chunk_indices):
    """The F7-F8 unit as fla's two stages in turn (fla's F8 forms q exp2(g) itself: qg is
    not read)."""
    h, v_new, final_state = state_scan(kg, w, u, gc, initial_state, output_final_state, chunk_size, cu_seqlens,
                                       cu_seqlens_cpu, chunk_indices, state_v_first)
    o = output(q, v_new, gc, Aqk, h, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first)
    return (o, final_state) + ((h, v_new) if save_states else (None, None))


def wy_recompute(q, k, v, beta, A, gc, want_u, chunk_size, cu_seqlens, chunk_indices):
    """B2: (w, u, qg, kg). fla's kernel writes u whether or not it is wanted."""
    from fla.ops.kda.wy_fast import recompute_w_u_fwd

    return recompute_w_u_fwd(
        q=q, k=k, v=v, beta=beta, A=A, gk=gc, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        **_graph(recompute_w_u_fwd, chunk_indices),
    )


def dav(q, k, v_new, do, Aqk, scale, chunk_size, cu_seqlens, chunk_indices):
    """B4: (dAqk, dv)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv

    return chunk_kda_bwd_dAv(
        q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        chunk_indices=chunk_indices, **_graph(chunk_kda_bwd_dAv, chunk_indices),
    )


def dhu(qg, kg, w, gc, h0, dht, do, dv, scale, chunk_size, cu_seqlens, chunk_indices, state_v_first):
    """B5: (dh, dh0, dv2)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    return chunk_gated_delta_rule_bwd_dhu(
        q=qg, k=kg, w=w, gk=gc, h0=h0, dht=dht, do=do, dv=dv, scale=scale, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, chunk_indices=chunk_indices, state_v_first=state_v_first,
        **_graph(chunk_gated_delta_rule_bwd_dhu, chunk_indices),
    )


def wy_dqkg(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
            state_v_first):
    """B6: (dq, dk, dv, db, dg, dA)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    return chunk_kda_bwd_wy_dqkg_fused(
        q=q, k=k, v=v, v_new=v_new, g=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv, scale=scale,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices, state_v_first=state_v_first,
        **_graph(chunk_kda_bwd_wy_dqkg_fused, chunk_indices),
    )


def intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices, safe_gate):
    """B7: (dq, dk, db, dg)."""
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    return chunk_kda_bwd_intra(
        q=q, k=k, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_size=chunk_size, safe_gate=safe_gate,
        **_graph(chunk_kda_bwd_intra, chunk_indices),
    )


def reverse_cumsum(dg, chunk_size, cu_seqlens, chunk_indices):
    """B8."""
    from fla.ops.utils import chunk_local_cumsum

    return chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, cu_seqlens=cu_seqlens,
                              chunk_indices=chunk_indices, **_graph(chunk_local_cumsum, chunk_indices))


def gate_bwd(g, A_log, dt_bias, dyg, lower_bound):
    """B9: (dg, dA_log, ddt_bias)."""
    from fla.ops.kda.gate import kda_gate_bwd

    return kda_gate_bwd(g=g, A_log=A_log, dt_bias=dt_bias, dyg=dyg, lower_bound=lower_bound)


def intra_bwd_tail(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, safe_gate, g, A_log, dt_bias, lower_bound,
                   chunk_size, cu_seqlens, chunk_indices):
    """The B7-B9 unit as fla's three stages in turn: (dq, dk, db, dg, dA_log, ddt_bias), the
    last two None for a pre-computed gate."""
    dq, dk, db, dg = intra_bwd(q, k, gc, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size, cu_seqlens, chunk_indices,
                               safe_gate)
    dg = reverse_cumsum(dg, chunk_size, cu_seqlens, chunk_indices)
    if A_log is None:
        return dq, dk, db, dg, None, None
    return (dq, dk, db) + tuple(gate_bwd(g, A_log, dt_bias, dg, lower_bound))


def l2norm_bwd(q, q_rstd, dq, k, k_rstd, dk):
    """B10."""
    from fla.modules.l2norm import l2norm_bwd as bwd

    return bwd(q, q_rstd, dq), bwd(k, k_rstd, dk)


def beta_sigmoid_bwd(beta, db, scale):
    """B10b."""
    from fla.ops.common.gate import fused_beta_sigmoid_bwd

    return fused_beta_sigmoid_bwd(beta, db, scale=scale)


def cp_forward_exchange(kg, w, u, gc, chunk_size, state_v_first, cu_seqlens, context):
    """fla's context-parallel forward exchange (summary, all-gather, fold) on the chain's
    kg, w, u and chunk cumsum: the initial state of the local sequences."""
    from fla.ops.cp.chunk_delta_h import chunk_gated_delta_rule_fwd_h_pre_process

    return chunk_gated_delta_rule_fwd_h_pre_process(k=kg, w=w, u=u, gk=gc, chunk_size=chunk_size,
                                                    state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                                    initial_state=None, context=context)


def cp_backward_exchange(qg, kg, w, do, dv, gc, scale, chunk_size, state_v_first, cu_seqlens, context):
    """fla's context-parallel backward exchange on the chain's qg, kg, w, do, B4's dv and the
    chunk cumsum: the dht of the local sequences."""
    from fla.ops.cp.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu_pre_process

    dht, _ = chunk_gated_delta_rule_bwd_dhu_pre_process(q=qg, k=kg, w=w, do=do, dv=dv, gk=gc, scale=scale,
                                                       state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                                       dht=None, context=context, chunk_size=chunk_size)
    return dht
