"""``chunk_kda`` and ``causal_conv1d`` under ``torch.compile``, fake tensors and
``torch.library.opcheck`` (kernel_fun.kda.ops, kernel_fun.cconv.op), on the CPU.

- Every operator passes ``opcheck`` (schema, autograd registration, fake tensors against
  the real outputs' shapes, dtypes and strides, AOT dispatch with dynamic shapes): dense
  and packed, initial and final state, both state layouts, every flag the chain carries.
- ``torch.compile(fullgraph=True)`` with ``aot_eager`` and with inductor: the forward and
  every gradient bit for bit eager's (the same kernels run on the same inputs: inductor
  fuses only the torch ops around the operators), kernel-fun's kernels witnessed
  (``last_record()`` after the compiled step), and ``torch._dynamo.explain`` shows one
  graph and no break.
- Fake tensors and meta tensors: every output's shape and dtype without data.
- Dynamic shapes: one compile across T, the batch and the packed lengths.
- What goes to fla still goes to fla (the break is at fla's op), and offsets are still
  checked when the compiled call runs.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from kernel_fun.cconv import op as conv_op
from kernel_fun.kda import chunk_kda, last_record, ops, use_impls
from kernel_fun.kda.chain import FLAG_NAMES
from kernel_fun.kda.problems import Problem, make_inputs, run_fwd_bwd

from conftest import fla_layers, needs_interpreter

# Small shapes (each call runs kernel-fun's kernels through the interpreter; opcheck runs
# an operator about ten times)
PROBLEMS = [
    Problem("gva-h0-gate", 2, 70, 1, 2, 32, 16, initial_state=True, output_final_state=True, dtype=torch.float16),
    Problem("packed-vfirst-keep", 1, 90, 1, 2, 32, 16, cu_seqlens=(0, 40, 90), initial_state=True,
            output_final_state=True, state_v_first=True, disable_recompute=True, dtype=torch.float16),
    Problem("pregated-sigmoid-neg", 1, 70, 1, 1, 32, 16, gate_in_kernel=False, l2norm_in_kernel=False,
            beta_sigmoid_in_kernel=True, allow_neg_eigval=True, dtype=torch.float32),
    Problem("packed-safe-gate", 1, 70, 1, 1, 32, 16, lower_bound=-5.0, safe_gate=True, cu_seqlens=(0, 30, 70),
            output_final_state=True, dtype=torch.float32),
]


# opcheck without its AOT-dispatch test (the costly one): for the backward operators, whose
# AOT dispatch the forward's opcheck already runs through the autograd formula
NO_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")


def _inputs(p: Problem, host_offsets: bool = True) -> dict:
    kw = make_inputs(p, seed=3)
    if "cu_seqlens" in kw and host_offsets:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    return kw


def fwd_op_args(kw: dict) -> tuple:
    """``chunk_kda_fwd``'s arguments for a ``chunk_kda`` call's keywords."""
    flags = {n: bool(kw.get(n, False)) for n in FLAG_NAMES}
    q = kw["q"]
    return (q, kw["k"], kw["v"], kw["g"], kw["beta"], kw.get("A_log"), kw.get("dt_bias"), kw.get("initial_state"),
            kw.get("cu_seqlens"), kw.get("cu_seqlens_cpu"), q.shape[-1] ** -0.5, kw.get("lower_bound"),
            ops.pack_flags(flags, True))


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if a[name] is None:
            assert b[name] is None, name
        else:
            assert torch.equal(a[name], b[name]), (name, (a[name].float() - b[name].float()).abs().max())


# --------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: p.name)
def test_chunk_kda_operators_pass_opcheck(p, monkeypatch):
    """Both operators (the backward on the arguments the autograd formula hands it). The
    stages run the torch references but for the problem whose forward keeps F7-F8's h and
    v_new: which implementation runs changes no output's shape or dtype, and the interpreter
    would run every kernel ten times over."""
    args = fwd_op_args(_inputs(p))
    fwd = ops.forward_operator(args[-1], args[8])
    bwd_name = "chunk_kda_bwd" if ops.replayable(args[-1], args[8]) else "chunk_kda_bwd_packed"
    seen = []
    real = getattr(ops, bwd_name)

    def spy(*a):
        seen.append(a)
        return real(*a)

    monkeypatch.setattr(ops, bwd_name, spy)
    # (AOT dispatch, the costly part, on the first two: the compile tests below trace the rest)
    utils = None if p in PROBLEMS[:2] else NO_AOT
    with use_impls("reference") if not p.disable_recompute else contextlib.nullcontext():
        torch.library.opcheck(fwd.default, args, **({} if utils is None else {"test_utils": utils}))
        seen.clear()
        out = fwd(*args)
        loss = out[0].float().sum() + (out[1].sum() if p.output_final_state else 0)
        loss.backward()
        assert len(seen) == 1
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in seen[0])
        torch.library.opcheck(getattr(torch.ops.kernel_fun, bwd_name).default, detached, test_utils=NO_AOT)


@needs_interpreter
def test_causal_conv1d_operators_pass_opcheck(monkeypatch):
    """Packed sequences with every optional tensor (a dense call: the layer tests below)."""
    torch.manual_seed(0)
    B, T, D, W = 1, 16, 8, 4
    cu = torch.tensor([0, 5, 12, 16])
    N = 3
    x = torch.randn(B, T, D, requires_grad=True)
    w, b = torch.randn(D, W, requires_grad=True), torch.randn(D, requires_grad=True)
    res = torch.randn(B, T, D, requires_grad=True)
    h0 = torch.randn(N, D, W, requires_grad=True)
    args = (x, w, b, res, h0, cu, cu, True, True)
    torch.library.opcheck(torch.ops.kernel_fun.causal_conv1d_fwd.default, args)
    seen = []
    real = conv_op.causal_conv1d_bwd
    monkeypatch.setattr(conv_op, "causal_conv1d_bwd", lambda *a: seen.append(a) or real(*a))
    y, final = torch.ops.kernel_fun.causal_conv1d_fwd(*args)
    (y.sum() + final.square().sum()).backward()
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in seen[0])
    torch.library.opcheck(torch.ops.kernel_fun.causal_conv1d_bwd.default, detached, test_utils=NO_AOT)


# --------------------------------------------------------------------------------------
# torch.compile: one graph, eager's numbers, the witness
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, backend", [(PROBLEMS[0], "aot_eager"), (PROBLEMS[0], "inductor"),
                                        (PROBLEMS[1], "aot_eager"), (PROBLEMS[3], "inductor")],
                         ids=lambda x: x if isinstance(x, str) else x.name)
def test_compiled_chunk_kda_is_eager_bit_for_bit(p, backend):
    kw = _inputs(p)
    eager = run_fwd_bwd(chunk_kda, kw)
    eager_record = last_record()
    torch._dynamo.reset()
    compiled = run_fwd_bwd(torch.compile(chunk_kda, fullgraph=True, backend=backend), kw)
    record = last_record()
    _assert_same(eager, compiled)
    # the compiled step ran the chain, stage for stage as eager did (its backward continuing
    # the forward's record)
    assert record is not eager_record and record.engaged
    assert record.forward == eager_record.forward and record.backward == eager_record.backward


def _operators_in_graphs(kw: dict) -> dict:
    """The kernel_fun operators in the forward and backward graphs of a compiled step."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = {}

    def grab(phase):
        def compiler(gm, example_inputs):
            seen[phase] = [n.target for n in gm.graph.nodes
                           if n.op == "call_function" and str(n.target).startswith("kernel_fun.")]
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    with use_impls("reference"):
        run_fwd_bwd(torch.compile(chunk_kda, fullgraph=True, backend=aot_autograd(fw_compiler=grab("fwd"),
                                                                                   bw_compiler=grab("bwd"))), kw)
    return seen


@pytest.mark.parametrize("p, host_offsets", [(PROBLEMS[0], False), (PROBLEMS[3], True), (PROBLEMS[3], False)],
                         ids=["dense", "packed-host", "packed-device"])
def test_a_packed_call_takes_the_operators_cuda_graphs_leave_out(p, host_offsets):
    """A packed call's chunk count is its offsets' data: a CUDA graph of its launches could
    replay only the offsets it recorded. Compiled, it takes the ``_packed`` operators, tagged
    ``cudagraph_unsafe`` (inductor's CUDA-graph trees run them between their graphs); a
    dense call takes the untagged ones."""
    seen = _operators_in_graphs(_inputs(p, host_offsets))
    names = {phase: [t.name() for t in targets] for phase, targets in seen.items()}
    suffix = "_packed" if p.cu_seqlens else ""
    assert names == {"fwd": [f"kernel_fun::chunk_kda_fwd{suffix}"], "bwd": [f"kernel_fun::chunk_kda_bwd{suffix}"]}
    for targets in seen.values():
        assert (torch.Tag.cudagraph_unsafe in targets[0].tags) == bool(p.cu_seqlens)


def _layer(x, w_q, w_k, w_v, conv_w, g_proj, b_proj, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu):
    """A KDA layer's core: projections, short convolutions, chunk_kda, the output's norm."""
    B, T, _ = x.shape
    H, K = A_log.shape[0], conv_w.shape[0] // A_log.shape[0]

    def conv(t):
        y, _ = conv_op.causal_conv1d(t, conv_w, activation="silu", cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return y.view(B, T, H, K)

    q, k, v = conv(x @ w_q), conv(x @ w_k), conv(x @ w_v)
    g = (x @ g_proj).view(B, T, H, K)
    beta = (x @ b_proj).view(B, T, H)
    o, _ = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens,
                     cu_seqlens_cpu=cu_seqlens_cpu)
    return torch.nn.functional.rms_norm(o, (K,)).flatten(2)


def _packed_layer_inputs():
    gen = torch.Generator().manual_seed(5)
    B, T, C, H, K = 1, 30, 16, 2, 16

    def p(*shape, scale=0.2):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    cu = torch.tensor([0, 20, 30])
    return dict(x=torch.randn(B, T, C, generator=gen), w_q=p(C, H * K), w_k=p(C, H * K), w_v=p(C, H * K),
                conv_w=p(H * K, 4, scale=0.5), g_proj=p(C, H * K), b_proj=p(C, H), A_log=torch.zeros(H).requires_grad_(),
                dt_bias=torch.zeros(H * K).requires_grad_(), cu_seqlens=cu, cu_seqlens_cpu=cu)


@pytest.mark.every_fla  # (the gates dynamo traces follow the installed fla)
def test_explain_finds_one_graph_and_no_break():
    kw = _inputs(PROBLEMS[2])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(chunk_kda)(**kw)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    x, w = torch.randn(2, 20, 8), torch.randn(8, 4)
    explained = torch._dynamo.explain(lambda x, w: conv_op.causal_conv1d(x, w, activation="silu"))(x, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_packed_layer_with_both_ops_is_one_graph():
    """(fullgraph=True: any break raises)"""
    kw = _packed_layer_inputs()
    params = [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    eager = _layer(**kw)
    eager_grads = torch.autograd.grad(eager.square().sum(), params)
    torch._dynamo.reset()
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")(**kw)
    grads = torch.autograd.grad(compiled.square().sum(), params)
    assert torch.equal(eager, compiled)
    for a, b in zip(eager_grads, grads):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
# Fake and meta tensors
# --------------------------------------------------------------------------------------
def _expected_shapes(p: Problem, kw: dict):
    N = p.B if p.cu_seqlens is None else len(p.cu_seqlens) - 1
    state = (N, p.HV, p.V, p.K) if p.state_v_first else (N, p.HV, p.K, p.V)
    return (p.B, p.T, p.HV, p.V), (state if p.output_final_state else None)


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: p.name)
def test_fake_tensors_give_every_shape(p):
    kw = _inputs(p)
    o_shape, state_shape = _expected_shapes(p, kw)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:  # (a shape environment: h's packed chunk count)
        fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        o, final = chunk_kda(**fake)
        assert tuple(o.shape) == o_shape and o.dtype == p.dtype
        assert (final is None) == (state_shape is None)
        if final is not None:
            assert tuple(final.shape) == state_shape and final.dtype == torch.float32
        (o.float().sum() + (final.sum() if final is not None else 0)).backward()
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"):
            if name in fake:
                assert fake[name].grad is not None and fake[name].grad.shape == fake[name].shape, name


def test_meta_tensors_give_every_shape():
    p = PROBLEMS[0]
    kw = {n: (t.detach().to("meta").requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t)
          for n, t in _inputs(p).items()}
    o, final = chunk_kda(**kw)
    assert o.device.type == "meta" and tuple(o.shape) == (p.B, p.T, p.HV, p.V)
    assert tuple(final.shape) == (p.B, p.HV, p.K, p.V)
    with torch.inference_mode():
        o, final, h = chunk_kda(**dict(kw, return_intermediate_states=True))
    assert tuple(h.shape) == (p.B, -(-p.T // 64), p.HV, p.K, p.V)
    y, state = conv_op.causal_conv1d(torch.empty(2, 9, 16, device="meta"), torch.empty(16, 4, device="meta"),
                                     output_final_state=True)
    assert tuple(y.shape) == (2, 9, 16) and tuple(state.shape) == (2, 16, 4)


# --------------------------------------------------------------------------------------
# Dynamic shapes: one compile
# --------------------------------------------------------------------------------------
def test_dynamic_shapes_compile_once():
    """T, the batch and the packed lengths (and the number of sequences) change: one graph
    each for dense and packed calls, no recompile per value (sizes kept apart from the head
    dims, so no size coincides with another by chance)."""
    counter = CompileCounterWithBackend("eager")  # (dynamo's frames: what recompiles)
    torch._dynamo.reset()
    compiled = torch.compile(chunk_kda, fullgraph=True, backend=counter, dynamic=True)
    for B, T in [(2, 70), (3, 130)]:  # (the first compile is already dynamic)
        p = Problem("dense", B, T, 1, 4, 16, 8, initial_state=True, output_final_state=True, dtype=torch.float32)
        compiled(**_inputs(p))  # (eager's numbers, and the backward: the tests above)
    assert counter.frame_count == 1
    for cu in [(0, 7, 50, 90, 100), (0, 30, 60, 61, 70, 75)]:
        p = Problem("packed", 1, cu[-1], 1, 2, 16, 8, output_final_state=True, cu_seqlens=cu, dtype=torch.float32,
                    disable_recompute=True)
        compiled(**_inputs(p))
    assert counter.frame_count == 2


# --------------------------------------------------------------------------------------
# What the gate sends to fla, and the offsets' checks, under compile
# --------------------------------------------------------------------------------------
def test_a_call_for_fla_still_goes_to_fla_under_compile():
    kw = _inputs(PROBLEMS[0])
    compiled = torch.compile(lambda **a: chunk_kda(**a, chunk_size=32), backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"this call goes to fla \(chunk_size=32"):  # eager's error
        compiled(**kw)


@pytest.mark.parametrize("host_offsets", [True, False], ids=["cu_seqlens_cpu", "device-offsets-on-cpu"])
def test_bad_offsets_are_caught_when_the_compiled_call_runs(host_offsets):
    p = PROBLEMS[1]
    kw = _inputs(p, host_offsets)
    torch._dynamo.reset()
    compiled = torch.compile(chunk_kda, fullgraph=True, backend="aot_eager")
    compiled(**kw)
    bad = torch.tensor([0, 95, 90], dtype=torch.int64)  # a step down
    kw = dict(kw, cu_seqlens=bad, **({"cu_seqlens_cpu": bad.clone()} if host_offsets else {}))
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T=90 without a step down"):
        compiled(**kw)



# --------------------------------------------------------------------------------------
# fla's layer after patch_fla()
# --------------------------------------------------------------------------------------
@needs_interpreter
def test_fla_s_layer_after_patch_fla_breaks_only_at_fla_s_own_ops():
    """fla's KimiDeltaAttention, patched, under dynamo: every graph break is at one of fla's
    own functions (its gated norm is ``torch.compiler.disable``d), none at kernel-fun's ops,
    and the compiled step runs kernel-fun's chain and convolution."""
    import kernel_fun

    layers = fla_layers()
    kernel_fun.patch_fla()
    try:
        torch.manual_seed(0)
        layer = layers.KimiDeltaAttention(hidden_size=32, head_dim=16, num_heads=2, mode="chunk")
        x = torch.randn(1, 40, 32, requires_grad=True)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        compiled = torch.compile(layer, backend="aot_eager")
        compiled(x)  # (the backward through the operators: the packed layer above)
        reasons = list(counters["graph_break"])
        # (the breaks name the function dynamo skipped: fla's gated norm, never one of ours)
        assert reasons and all("layer_norm_gated" in r for r in reasons), reasons
        record = last_record()
        assert record.engaged and record.forward
        assert conv_op.last_route() == "kernels"
    finally:
        kernel_fun.unpatch_fla()


# --------------------------------------------------------------------------------------
# The operators and the eager Function: one chain
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PROBLEMS[1:3], ids=lambda p: p.name)  # (the others: the compile tests above)
def test_the_operators_are_the_eager_function_bit_for_bit(p, monkeypatch):
    """KERNEL_FUN_KDA_OPS=1 puts an eager call through the operators: o, the final state and
    every gradient are the autograd Function's bit for bit, stage for stage; and so is
    return_intermediate_states' h in inference mode."""
    kw = _inputs(p)
    function = run_fwd_bwd(chunk_kda, kw)
    function_record = last_record()
    ran = []  # (the witness: the forward operator's implementation ran)
    remember = ops._remember
    monkeypatch.setattr(ops, "_remember", lambda *a: ran.append(1) or remember(*a))
    monkeypatch.setenv("KERNEL_FUN_KDA_OPS", "1")
    operators = run_fwd_bwd(chunk_kda, kw)
    assert len(ran) == 1
    assert last_record().forward == function_record.forward and last_record().backward == function_record.backward
    _assert_same(function, operators)
    if p.disable_recompute:  # (return_intermediate_states excludes it)
        return
    with torch.inference_mode():
        via_ops = chunk_kda(**kw, return_intermediate_states=True)
        monkeypatch.delenv("KERNEL_FUN_KDA_OPS")
        via_function = chunk_kda(**kw, return_intermediate_states=True)
    assert len(ran) == 2
    for a, b in zip(via_ops, via_function):
        assert (a is None and b is None) or torch.equal(a, b)


# --------------------------------------------------------------------------------------
# Packed calls given cu_seqlens_cpu: the chunk index from the host offsets
# --------------------------------------------------------------------------------------
@pytest.mark.every_fla
@pytest.mark.parametrize("offsets", [(0, 1, 137, 200), (0, 0, 64, 64, 70), (0, 64), (0, 65, 65, 200, 329)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_host_chunk_index_is_fla_s(offsets, dtype):
    """Built from cu_seqlens_cpu without synchronizing (fla's own ends in a blocking copy):
    the same rows, dtype and device as fla's from the device offsets."""
    from fla.ops.utils.index import prepare_chunk_indices

    from kernel_fun.kda.chain import host_chunk_indices

    cu = torch.tensor(offsets, dtype=dtype)
    ours, fla_s = host_chunk_indices(cu, cu.clone(), 64), prepare_chunk_indices(cu.clone(), 64)
    assert ours.dtype == fla_s.dtype and ours.device == fla_s.device and torch.equal(ours, fla_s)


def test_the_host_chunk_index_lives_with_its_offsets():
    """Built once while the offsets live unchanged, rebuilt when either changes in place,
    forgotten when the device offsets die (a CUDA graph's index is kept until then: the GPU
    test)."""
    import gc

    from kernel_fun.kda import chain

    cu, cu_cpu = torch.tensor([0, 70, 200]), torch.tensor([0, 70, 200])
    first = chain.host_chunk_indices(cu, cu_cpu, 64)
    assert chain.host_chunk_indices(cu, cu_cpu, 64) is first
    assert chain.host_chunk_indices(cu, cu_cpu.clone(), 64) is not first  # another host tensor
    cu_cpu.copy_(torch.tensor([0, 10, 200]))  # (2 + 3 chunks become 1 + 3)
    assert chain.host_chunk_indices(cu, cu_cpu, 64).shape == (4, 2)
    key = id(cu)
    assert key in chain._HOST_INDICES
    del cu
    gc.collect()
    assert key not in chain._HOST_INDICES


@pytest.mark.every_fla
def test_a_packed_call_runs_its_stages_with_fla_s_tensor_cache_off():
    """fla's stages keep what they derive from cu_seqlens (``fla.utils.tensor_cache``: B5's
    chunk offsets), device memory that under ``mode="reduce-overhead"`` would outlive the
    call in the graph trees' pool. Inside a packed call's scope fla's cache is off, nested
    scopes restore the user's setting, and the chunk index the chain builds from device
    offsets is built before the scope, from the cache (a miss synchronizes; a step's layers
    share it)."""
    import fla.utils
    from fla.ops.utils.index import prepare_chunk_offsets

    from kernel_fun import _fla
    from kernel_fun.kda import chain

    cu = torch.tensor([0, 70, 200])
    user = fla.utils.FLA_DISABLE_TENSOR_CACHE
    assert prepare_chunk_offsets(cu, 64) is prepare_chunk_offsets(cu, 64)  # (the cache, outside)
    with _fla.no_tensor_cache():
        assert fla.utils.FLA_DISABLE_TENSOR_CACHE is True
        with _fla.no_tensor_cache():
            assert prepare_chunk_offsets(cu, 64) is not prepare_chunk_offsets(cu, 64)
    assert fla.utils.FLA_DISABLE_TENSOR_CACHE == user

    seen, built = [], []
    real, real_index = chain._run_forward, _fla.prepare_chunk_indices

    def spy(*args, **kwargs):
        seen.append(fla.utils.FLA_DISABLE_TENSOR_CACHE)
        return real(*args, **kwargs)

    def index_spy(*args, **kwargs):
        built.append(fla.utils.FLA_DISABLE_TENSOR_CACHE)
        return real_index(*args, **kwargs)

    p = PROBLEMS[3]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chain, "_run_forward", spy)
        mp.setattr(_fla, "prepare_chunk_indices", index_spy)
        chunk_kda(**_inputs(p, host_offsets=False))  # (the index from the device offsets: fla's builder)
        chunk_kda(**make_inputs(dataclasses.replace(p, cu_seqlens=None), seed=3))
    assert seen == [True, user] and built == [user]
    assert fla.utils.FLA_DISABLE_TENSOR_CACHE == user


def test_a_packed_call_is_the_same_with_and_without_host_offsets():
    p = PROBLEMS[3]
    with_host, without = run_fwd_bwd(chunk_kda, _inputs(p, True)), run_fwd_bwd(chunk_kda, _inputs(p, False))
    _assert_same(with_host, without)


# --------------------------------------------------------------------------------------
# fla 0.6's capacity-shaped packed mode (use_graph, max_num_seqs)
# --------------------------------------------------------------------------------------
def _capacity_pair(p: Problem, pad: int, spare: int, seed: int = 7):
    """A capacity-shaped call's keywords (``pad`` tokens past the last sequence, ``spare``
    zero-length sequence slots, random data everywhere) and the ordinary packed call on its
    sequences' tokens; with each call's cotangents (the packed call's the capacity call's
    rows)."""
    kw = make_inputs(dataclasses.replace(p, T=p.T + pad, cu_seqlens=p.cu_seqlens + (p.T,) * spare,
                                         initial_state=True, output_final_state=True), seed=seed)
    kw.update(use_graph=True, max_num_seqs=len(p.cu_seqlens) - 1 + spare)
    N = len(p.cu_seqlens) - 1
    packed = {}
    for name, t in kw.items():
        if name in ("use_graph", "max_num_seqs"):
            continue
        if name == "cu_seqlens":
            packed[name] = torch.tensor(p.cu_seqlens, dtype=t.dtype)
        elif isinstance(t, torch.Tensor) and t.dim() >= 3 and name != "initial_state":
            packed[name] = t.detach()[:, :p.T].clone().requires_grad_(t.requires_grad)
        elif name == "initial_state":
            packed[name] = t.detach()[:N].clone().requires_grad_()
        elif isinstance(t, torch.Tensor):
            packed[name] = t.detach().clone().requires_grad_(t.requires_grad)
        else:
            packed[name] = t
    gen = torch.Generator().manual_seed(seed + 1)
    B, T, HV, V = kw["v"].shape
    K = kw["q"].shape[-1]
    state = (N + spare, HV, V, K) if p.state_v_first else (N + spare, HV, K, V)
    do, dht = torch.randn(B, T, HV, V, generator=gen).to(kw["v"].dtype), torch.randn(*state, generator=gen)
    return kw, packed, (do, dht), (do[:, :p.T].clone(), dht[:N].clone())


def _step(kw: dict, cot) -> dict:
    from kernel_fun.kda.problems import GRAD_NAMES, leaves

    o, final_state = chunk_kda(**kw)
    named = leaves(kw)
    grads = torch.autograd.grad([o, final_state], list(named.values()), list(cot))
    return {"o": o, "final_state": final_state, **{GRAD_NAMES[n]: g for n, g in zip(named, grads)}}


CAPACITY = [
    Problem("capacity-gate", 1, 150, 1, 2, 64, 32, cu_seqlens=(0, 1, 70, 150), dtype=torch.float16),
    Problem("capacity-layer-safe", 1, 130, 1, 1, 64, 32, cu_seqlens=(0, 64, 130), beta_sigmoid_in_kernel=True,
            state_v_first=True, safe_gate=True, lower_bound=-5.0, dtype=torch.float16),
    Problem("capacity-pregated", 1, 100, 1, 1, 64, 32, cu_seqlens=(0, 100), gate_in_kernel=False,
            l2norm_in_kernel=False, dtype=torch.float16),
]


@pytest.mark.every_fla
@pytest.mark.parametrize("p", CAPACITY, ids=lambda p: p.name)
def test_a_capacity_shaped_call_is_the_packed_call_on_its_tokens(p):
    """use_graph=True: the chunk index has ceil(T / 64) + N - 1 rows, built on the device, its
    spare rows skipped by every stage. On its sequences' tokens o and every gradient are the
    ordinary packed call's bit for bit (the same chunks through the same kernels; dA_log's
    and dt_bias's sums, over more rows, to rounding); an empty slot carries its initial
    state through and its gradient back; whatever the padding tokens hold changes nothing."""
    from kernel_fun import _fla

    kw, packed, cot, packed_cot = _capacity_pair(p, pad=45, spare=2)
    if _fla.version_tuple() < (0, 6):
        supported, reason = chunk_kda_is_supported(**kw)
        assert not supported and "no capacity-shaped mode" in reason
        return
    got = _step(kw, cot)
    record = last_record()
    assert record.engaged and record.backward["B6"] == "ours" and record.backward["B7-B9"] == "ours", record
    want = _step(packed, packed_cot)
    N, T = len(p.cu_seqlens) - 1, p.T
    for name, w in want.items():
        g = got[name]
        if name in ("final_state", "dh0"):
            assert torch.equal(g[:N], w), name
            tail = kw["initial_state"] if name == "final_state" else cot[1]
            assert torch.equal(g[N:], tail[N:].to(g.dtype)), name  # an empty slot's state passes through
        elif name in ("dA_log", "ddt_bias"):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(g[:, :T], w), name
    # the padding tokens' data and cotangents reach no real row
    other = {n: (t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t)
             for n, t in kw.items()}
    with torch.no_grad():
        for name in ("q", "k", "v", "g", "beta"):
            other[name][:, T:] = torch.randn_like(other[name][:, T:]) * 3
    do = cot[0].clone()
    do[:, T:] = 7
    again = _step(other, (do, cot[1]))
    for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        assert torch.equal(again[name][:, :T], got[name][:, :T]), name


def chunk_kda_is_supported(**kw):
    from kernel_fun.kda import is_supported

    return is_supported(**kw)


@pytest.mark.every_fla
def test_a_capacity_shaped_call_compiles_once_for_any_offsets():
    """Under torch.compile the capacity-shaped call's shapes are its capacity's: new offsets
    in the same slots (written in place, as a CUDA graph's replay reads them) recompile
    nothing, and the result follows the new offsets."""
    from kernel_fun import _fla

    if _fla.version_tuple() < (0, 6):
        pytest.skip("fla-core 0.5.2 has no capacity-shaped mode")
    p = CAPACITY[0]
    kw, packed, cot, packed_cot = _capacity_pair(p, pad=45, spare=2)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(chunk_kda, fullgraph=True, backend=counter)
    first = fn(**kw)[0].detach().clone()
    kw["cu_seqlens"].copy_(torch.tensor([0, 50, 60, 190, 190, 195], dtype=kw["cu_seqlens"].dtype))
    second = fn(**kw)[0]
    assert counter.frame_count == 1
    eager = chunk_kda(**kw)[0]
    assert torch.equal(second[:, :195], eager[:, :195]) and not torch.equal(second[:, :150], first[:, :150])


@pytest.mark.every_fla
def test_a_capacity_shaped_forward_operator_passes_opcheck():
    """The fake's h (kept by the return of intermediate states) has the capacity's static
    chunk count, ceil(T / 64) + N - 1, as the chain's does."""
    from kernel_fun import _fla

    if _fla.version_tuple() < (0, 6):
        pytest.skip("fla-core 0.5.2 has no capacity-shaped mode")
    kw, _, _, _ = _capacity_pair(CAPACITY[0], pad=45, spare=2)
    flags = {n: bool(kw.get(n, False)) for n in FLAG_NAMES}
    flags["return_intermediate_states"] = True
    q = kw["q"].detach()
    args = (q, kw["k"].detach(), kw["v"].detach(), kw["g"].detach(), kw["beta"].detach(), kw["A_log"].detach(),
            kw["dt_bias"].detach(), kw["initial_state"].detach(), kw["cu_seqlens"], None, q.shape[-1] ** -0.5,
            None, ops.pack_flags(flags, False))
    assert ops.forward_operator(args[-1], args[8]) is torch.ops.kernel_fun.chunk_kda_fwd  # (replayable: untagged)
    with torch.inference_mode():
        out = torch.ops.kernel_fun.chunk_kda_fwd(*args)
    assert out[2].shape[1] == -(-q.shape[1] // 64) + kw["cu_seqlens"].shape[0] - 2
    with use_impls("reference"):
        torch.library.opcheck(torch.ops.kernel_fun.chunk_kda_fwd.default, args, test_utils=NO_AOT)
