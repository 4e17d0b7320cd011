"""kernel-fun's causal_conv1d: its kernels (through the Triton interpreter here) against the
float64 reference, on every gradient, at awkward shapes; the public op's validation,
gate and fallback; fla's ShortConvolution through patch_fla()."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import INTERPRETING, needs_triton
from kernel_fun import _fla
from kernel_fun.cconv import causal_conv1d, is_supported, last_route
from kernel_fun.cconv import kernels as K
from kernel_fun.cconv import op
from kernel_fun.cconv.reference import conv_reference
from kernel_fun.kda.reference import rel_rms

# Against the float64 reference: fla's budgets (y and the final state as o, 0.005; dx and
# dh0 as dq, 0.008 -- a bf16 result rounds by up to half a unit, ~2e-3 relative RMS; dweight
# and dbias, summed in fp32, 2e-3). Against the fp32 reference, which rounds where the
# kernels round: the parity bars (bf16 1e-3, fp32 1e-5).
ORACLE_BARS = {torch.bfloat16: dict(y=5e-3, final=5e-3, dx=8e-3, dh0=8e-3, dw=2e-3, db=2e-3),
               torch.float32: dict(y=1e-5, final=1e-5, dx=1e-5, dh0=1e-5, dw=2e-5, db=2e-5)}
PARITY_BARS = {torch.bfloat16: 1e-3, torch.float32: 1e-5}


def conv_inputs(B, T, D, W, dtype, bias=True, residual=False, h0=False, seqlens=None, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    N = B if seqlens is None else len(seqlens)
    total = T if seqlens is None else sum(seqlens)
    Bx = B if seqlens is None else 1
    if strided:  # a split of a fused projection: the channel stride is 1, the token stride 2D
        x = torch.randn(Bx, total, 2 * D, generator=g).to(dtype)[..., D:]
    else:
        x = torch.randn(Bx, total, D, generator=g).to(dtype)
    kw = dict(x=x, weight=(torch.randn(D, W, generator=g) / W ** 0.5),
              bias=torch.randn(D, generator=g) if bias else None,
              residual=torch.randn(Bx, total, D, generator=g).to(dtype) if residual else None,
              initial_state=torch.randn(N, D, W, generator=g).to(dtype) if h0 else None)
    if seqlens is not None:
        kw["cu_seqlens"] = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32)
    return kw


def conv_grads(fn, kw, activation, final, seed=1):
    """Outputs and every gradient of fn(**kw) against fixed random cotangents."""
    leaves = {n: kw[n].detach().clone().requires_grad_(True) for n in ("x", "weight", "bias", "residual",
                                                                        "initial_state") if kw.get(n) is not None}
    args = {**kw, **leaves}
    y, fs = fn(**args, activation=activation, output_final_state=final)
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(y.shape, generator=g).to(y.device, y.dtype)
    loss = (y.double() * dy.double()).sum()
    if final:
        dht = torch.randn(fs.shape, generator=g).to(fs.device, fs.dtype)
        loss = loss + (fs.double() * dht.double()).sum()
    loss.backward()
    out = {"y": y.detach(), "final": fs.detach() if final else None}
    names = {"x": "dx", "weight": "dw", "bias": "db", "residual": "dres", "initial_state": "dh0"}
    out.update({names[n]: t.grad for n, t in leaves.items()})
    return out


def conv_oracle(**kw):
    def f(x, weight, bias=None, residual=None, initial_state=None, cu_seqlens=None, activation=None,
          output_final_state=False):
        d = lambda t: None if t is None else t.double()  # noqa: E731
        return conv_reference(d(x), d(weight), d(bias), d(residual), d(initial_state), output_final_state, activation,
                              cu_seqlens)
    return f


def _kernels(x, weight, bias=None, residual=None, initial_state=None, cu_seqlens=None, activation=None,
             output_final_state=False):
    """The kernels through the autograd function, as the op runs them on a GPU."""
    D, W = weight.shape
    seg_index, TS = op.segments(cu_seqlens, x.shape[1], x.device)
    y, fs = op.CausalConv1dFunction.apply(x, weight, bias, residual, initial_state, output_final_state,
                                          activation in ("silu", "swish"), cu_seqlens, seg_index, TS)
    return y, fs


def _reference(x, weight, bias=None, residual=None, initial_state=None, cu_seqlens=None, activation=None,
               output_final_state=False):
    return conv_reference(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens)


def _check(kw, activation, final, dtype, label):
    ours = conv_grads(_kernels, kw, activation, final)
    want = conv_grads(conv_oracle(**kw), kw, activation, final)
    same = conv_grads(_reference, kw, activation, final)
    names = [n for n in want if want[n] is not None and n != "dres"]
    errs = {n: rel_rms(ours[n], want[n]) for n in names}
    parity = {n: rel_rms(ours[n], same[n]) for n in names}
    misses = {n: (e, ORACLE_BARS[dtype][n]) for n, e in errs.items() if not e <= ORACLE_BARS[dtype][n]}
    misses.update({f"{n} vs the fp32 reference": (e, PARITY_BARS[dtype]) for n, e in parity.items()
                   if not e <= PARITY_BARS[dtype]})
    assert not misses, (label, misses, errs, parity)
    return errs


CASES = [  # (B, T, D, W, bias, residual, h0, final, activation, seqlens)
    (2, 1, 40, 4, True, False, True, True, "silu", None),
    (2, 3, 40, 4, False, True, True, True, "silu", None),
    (1, 63, 300, 4, True, False, False, False, None, None),
    (1, 300, 40, 4, True, True, True, True, "swish", None),
    (1, 70, 33, 3, True, False, True, True, "silu", None),
    (1, 70, 33, 2, False, False, True, True, None, None),
    (1, 70, 33, 1, True, False, True, True, "silu", None),
    (1, None, 48, 4, True, False, True, True, "silu", (2, 300, 1, 65, 3)),
    (1, None, 48, 3, False, True, False, True, None, (130, 2, 70)),
    (1, None, 40, 4, True, False, True, True, "silu", (3, 0, 70, 0)),  # sequences of no tokens
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1] or sum(c[9])}-D{c[2]}-W{c[3]}"
                         + ("-varlen" if c[9] else "") + ("-h0" if c[6] else "") + ("-bias" if c[4] else ""))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_match_the_float64_reference(case, dtype):
    """y, the final state and every gradient (dx, dweight, dbias, dh0) against the float64
    reference's autograd: T = 1, 3, 63, 300 (two segments); D not a multiple of the strip; W = 1..4; bias
    on and off; residual; initial state; packed sequences, some shorter than W; a
    final-state gradient (which reaches dh0 where a sequence is shorter than W)."""
    B, T, D, W, bias, residual, h0, final, act, seqlens = case
    kw = conv_inputs(B, T, D, W, dtype, bias, residual, h0, seqlens)
    _check(kw, act, final, dtype, case)


@needs_triton
def test_strided_x_and_packed_equals_per_sequence_calls():
    """x as a strided view (half of a fused projection) gives the dense result bit for bit;
    a packed batch equals one call per sequence (the convolution does not cross a
    boundary), the final states included."""
    kw = conv_inputs(2, 90, 64, 4, torch.bfloat16, h0=True, strided=True)
    dense = {**kw, "x": kw["x"].contiguous()}
    a = _kernels(**kw, activation="silu", output_final_state=True)
    b = _kernels(**dense, activation="silu", output_final_state=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    lens = (5, 130, 2)
    kw = conv_inputs(1, None, 64, 4, torch.bfloat16, h0=True, seqlens=lens)
    y, fs = _kernels(**kw, activation="silu", output_final_state=True)
    bounds = kw["cu_seqlens"].tolist()
    for n in range(len(lens)):
        one = dict(x=kw["x"][:, bounds[n]:bounds[n + 1]], weight=kw["weight"], bias=kw["bias"],
                   initial_state=kw["initial_state"][n:n + 1])
        y1, fs1 = _kernels(**one, activation="silu", output_final_state=True)
        assert torch.equal(y[:, bounds[n]:bounds[n + 1]], y1) and torch.equal(fs[n:n + 1], fs1)


def test_segment_index_is_built_on_the_device_from_the_offsets():
    """The packed segment list from cu_seqlens alone: every sequence's segments in order,
    an empty sequence none, and the spare slots of the host's bound ceil(tokens / TS) + N
    on the last sequence past its end (their programs run no token)."""
    lens = [70, 0, 200, 3, 512]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seg = K.segment_index(cu, sum(lens), 64)
    want = [(n, i) for n, L in enumerate(lens) for i in range(-(-L // 64))]
    assert seg.dtype == torch.int32 and seg.shape == (-(-sum(lens) // 64) + len(lens), 2)
    assert [tuple(r) for r in seg[:len(want)].tolist()] == want
    spare = seg[len(want):]
    assert (spare[:, 0] == len(lens) - 1).all() and (spare[:, 1] * 64 >= lens[-1]).all()


def test_segment_list_is_reused_for_the_same_offsets_only():
    """The list is built once for one offsets tensor (a layer's q, k and v convolutions share
    it) and rebuilt for another tensor, after an in-place write to it, or for another length."""
    cu = torch.tensor([0, 70, 270, 273], dtype=torch.int32)
    a, TS = op.segments(cu, 273, cu.device)
    assert op.segments(cu, 273, cu.device)[0] is a
    other = cu.clone()
    b = op.segments(other, 273, other.device)[0]
    assert b is not a and torch.equal(a, b)
    assert op.segments(cu, 300, cu.device)[0] is not a
    cu[1] = 10  # in place: the version moves
    c = op.segments(cu, 273, cu.device)[0]
    assert c is not a and torch.equal(c, K.segment_index(cu, 273, TS))


@needs_triton
def test_packed_call_ignores_the_host_hints():
    """cu_seqlens_cpu and fla's chunk_indices change nothing: the same outputs bit for bit
    with and without them (the segments come from cu_seqlens on the device)."""
    from fla.ops.utils import prepare_chunk_indices

    kw = conv_inputs(1, None, 48, 4, torch.float32, h0=True, seqlens=(70, 200, 3))
    ci = prepare_chunk_indices(kw["cu_seqlens"], 64)
    y1, f1 = causal_conv1d(**kw, activation="silu", output_final_state=True)
    y2, f2 = causal_conv1d(**kw, activation="silu", output_final_state=True, chunk_indices=ci,
                           cu_seqlens_cpu=kw["cu_seqlens"].cpu())
    assert last_route() == "kernels" and torch.equal(y1, y2) and torch.equal(f1, f2)


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="the interpreter runs programs one at a time: run to run, a GPU's question")
def test_dweight_is_deterministic():
    """The weight's and bias's gradients are partials per program summed in a fixed order:
    two runs agree bit for bit."""
    kw = conv_inputs(2, 300, 40, 4, torch.bfloat16, h0=True)
    a = conv_grads(_kernels, kw, "silu", True)
    b = conv_grads(_kernels, kw, "silu", True)
    assert all(torch.equal(a[n], b[n]) for n in ("dw", "db", "dx", "dh0"))


@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_public_op_on_the_cpu(path, monkeypatch):
    """The public op on CPU tensors, through the kernels (as under the interpreter) and
    through the torch reference (a CPU without the interpreter): y, the final state and
    every gradient within the bars of the float64 result; the residual's gradient is dy."""
    if path == "reference":
        monkeypatch.setattr(op, "uses_kernels", lambda x: False)
    elif not op.uses_kernels(torch.zeros(1)):
        pytest.skip("the kernels need the interpreter on a CPU")
    kw = conv_inputs(2, 70, 40, 4, torch.bfloat16, residual=True, h0=True)
    ours = conv_grads(causal_conv1d, kw, "silu", True)
    want = conv_grads(conv_oracle(**kw), kw, "silu", True)
    for n in ("y", "final", "dx", "dw", "db", "dh0"):
        assert rel_rms(ours[n], want[n]) <= ORACLE_BARS[torch.bfloat16][n], n
    assert torch.equal(ours["dres"].float(), want["dres"].float())


@pytest.mark.every_fla
def test_invalid_inputs_get_clear_errors():
    x = torch.randn(2, 8, 16)
    w = torch.randn(16, 4)
    bad = {
        "no weight": dict(x=x),
        "2-D x": dict(x=x[0], weight=w),
        "channels": dict(x=x, weight=torch.randn(15, 4)),
        "bias shape": dict(x=x, weight=w, bias=torch.randn(15)),
        "residual shape": dict(x=x, weight=w, residual=torch.randn(2, 7, 16)),
        "activation": dict(x=x, weight=w, activation="gelu"),
        "varlen batch": dict(x=x, weight=w, cu_seqlens=torch.tensor([0, 3, 8])),
        "offsets past x": dict(x=x[:1], weight=w, cu_seqlens=torch.tensor([0, 3, 9]),
                               cu_seqlens_cpu=torch.tensor([0, 3, 9])),
        "offsets decreasing": dict(x=x[:1], weight=w, cu_seqlens=torch.tensor([0, 5, 3, 8]),
                                   cu_seqlens_cpu=torch.tensor([0, 5, 3, 8])),
        "state shape": dict(x=x, weight=w, initial_state=torch.randn(2, 16, 3)),
    }
    for name, kw in bad.items():
        with pytest.raises(ValueError):
            causal_conv1d(**kw)
        ok, reason = is_supported(**kw)
        assert not ok and reason.startswith("invalid arguments"), name


@pytest.mark.every_fla
def test_outside_the_box_goes_to_fla_with_one_log_line(caplog, monkeypatch):
    """Another backend, context parallel, an unknown argument, W > 4, a switch: fla's own
    function with the caller's arguments (here on a CPU, the clear error that fla's kernels
    need a GPU), one log line saying why."""
    x = torch.randn(1, 8, 16)
    w = torch.randn(16, 4)
    assert is_supported(x, w) == (True, None)
    cases = {"backend='cuda'": dict(backend="cuda"), "seq_idx": dict(seq_idx=None),
             "W=5": dict(weight=torch.randn(16, 5))}
    for why, extra in cases.items():
        kw = {"x": x, "weight": w, **extra}
        ok, reason = is_supported(**kw)
        assert not ok and why.split("=")[0] in reason, (why, reason)
        with pytest.raises(RuntimeError, match="goes to fla"):
            causal_conv1d(**kw)
    monkeypatch.setenv("KERNEL_FUN_CCONV_DISABLE", "1")
    assert is_supported(x, w) == (False, "KERNEL_FUN_CCONV_DISABLE=1")

    calls = []
    monkeypatch.delenv("KERNEL_FUN_CCONV_DISABLE")
    monkeypatch.setattr(_fla, "causal_conv1d", lambda: (lambda *a, **k: calls.append(k) or ("fla", None)))
    monkeypatch.setattr(op, "_require_cuda", lambda *a: None)  # the fallback itself, past the CPU guard
    with caplog.at_level(logging.WARNING, logger="kernel_fun"):
        from kernel_fun._runtime import reset_log_once

        reset_log_once()
        assert causal_conv1d(x, w, backend="cuda", output_final_state=True) == ("fla", None)
    assert calls and calls[0]["backend"] == "cuda" and calls[0]["output_final_state"] is True
    assert calls[0]["weight"] is w and calls[0]["cu_seqlens"] is None
    assert any("falling back to fla" in r.message and "backend='cuda'" in r.message for r in caplog.records)


@pytest.mark.every_fla
def test_fla_short_convolution_through_patch_fla():
    """fla's ShortConvolution (the layer KimiDeltaAttention builds for q, k and v) after
    kernel_fun.patch_fla(): forward and backward run kernel-fun's op (on the CPU: the
    reference or the interpreter's kernels) and agree with the layer's own nn.Conv1d math
    (causal padding, SiLU) in float64."""
    from fla.modules import ShortConvolution

    from kernel_fun.patch import fla_patched

    torch.manual_seed(0)
    layer = ShortConvolution(hidden_size=48, kernel_size=4, bias=False, activation="silu")
    x = torch.randn(2, 37, 48, requires_grad=True)
    import sys

    with fla_patched():
        mod = sys.modules["fla.modules.conv.causal_conv1d"]  # (the package's attribute of that name is the function)
        assert mod.causal_conv1d is causal_conv1d
        y, _ = layer(x)
    y.backward(torch.ones_like(y))
    xd = x.detach().double().requires_grad_(True)
    wd = layer.weight.detach().double().requires_grad_(True)
    ref = F.silu(F.conv1d(xd.transpose(1, 2), wd, padding=3, groups=48)[..., :37]).transpose(1, 2)
    ref.backward(torch.ones_like(ref))
    assert op.last_route() in ("kernels", "reference")
    assert rel_rms(y, ref) < 1e-5 and rel_rms(x.grad, xd.grad) < 1e-5 and rel_rms(layer.weight.grad, wd.grad) < 1e-5
    assert mod.causal_conv1d is not causal_conv1d  # unpatched on the way out


@pytest.mark.every_fla
def test_patch_fla_routes_every_causal_conv1d_binding():
    """Every loaded fla module's binding of fla's convolution -- its defining module (fla
    0.5.2: fla.modules.conv.causal_conv1d; fla 0.6: fla.modules.causal_conv1d.ops, also
    loaded under the old names as an alias), the packages' re-exports -- rebound, and
    restored; the fallback still reaches fla's own function (ShortConvolution's route: the
    test above)."""
    import sys

    import kernel_fun

    def bindings(target):
        return [(n, a) for n, m in list(sys.modules.items()) if m is not None and n.startswith("fla")
                for a, v in list(vars(m).items()) if v is target]

    original = _fla.causal_conv1d()
    try:
        changed = kernel_fun.patch_fla()
        assert not bindings(original), "a binding of fla's convolution was left"
        for name in ("fla.modules.convolution", "fla.modules.conv"):
            assert sys.modules[name].causal_conv1d is causal_conv1d, name
        assert any(n.endswith(".causal_conv1d") for n in changed) and _fla.causal_conv1d() is original
    finally:
        restored = kernel_fun.unpatch_fla()
    assert set(changed) <= set(restored) and sys.modules["fla.modules.convolution"].causal_conv1d is original


@pytest.mark.slow  # configs the benchmarks sweep, not the pinned one a call runs
@needs_triton
@pytest.mark.parametrize("config", [dict(BD=32, TS=16, num_warps=1), dict(BD=64, TS=64, num_warps=2),
                                    dict(BD=32, TS=20, num_warps=1), dict(BD=128, TS=64, num_warps=4)],
                         ids=["BD32-TS16", "BD64-TS64", "BD32-TS20", "BD128-TS64"])
def test_other_builds_match_the_reference(config):
    """Other strips, segment lengths and unrolls (the bench's sweep), through use_config: a
    segment that ends mid-iteration, many segments a sequence (each with its halo), a
    strip wider than D's tail; forward and backward launch with the same config."""
    kw = conv_inputs(2, 150, 70, 4, torch.float32, h0=True, residual=True)
    with K.use_config(**config):
        seg_index, TS = op.segments(None, kw["x"].shape[1], kw["x"].device)
        assert TS == config["TS"]
        ours = conv_grads(causal_conv1d, kw, "silu", True)
    want = conv_grads(conv_oracle(**kw), kw, "silu", True)
    errs = {n: rel_rms(ours[n], want[n]) for n in ("y", "final", "dx", "dw", "db", "dh0")}
    assert all(e <= ORACLE_BARS[torch.float32][n] for n, e in errs.items()), errs


@pytest.mark.every_fla
def test_fla_s_own_convolution_backend_switched_on_takes_the_call(monkeypatch):
    """fla 0.6 runs its convolution on its Gluon kernels when the user switches them on
    (``FLA_CONV_GLUON=1``): such a call goes to fla, which dispatches it, with the reason
    (on the CPU: the error naming it). The backend is asked of fla's own registry: one
    registered, available and switched on is named; under fla 0.5.2 there is none."""
    monkeypatch.setattr(_fla, "causal_conv1d_backend", lambda: "gluon")
    x, w = torch.randn(1, 8, 16), torch.randn(16, 4)
    with pytest.raises(RuntimeError, match=r"goes to fla \(fla's gluon convolution is switched on\)"):
        causal_conv1d(x, w)
    assert is_supported(x, w) == (False, "fla's gluon convolution is switched on")
    monkeypatch.undo()
    if _fla.version_tuple() < (0, 6):
        assert _fla.causal_conv1d_backend() is None
        return
    import inspect

    import fla.backends as fla_backends
    from fla.backends import BaseBackend
    from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

    registry = fla_backends._function_registries[inspect.unwrap(causal_conv1d_fwd)]

    class Fake(BaseBackend):
        backend_type = "fake_conv"
        env_var = "KERNEL_FUN_TEST_FAKE_CONV"
        default_enable = False

    saved = dict(registry._backends)
    try:
        registry._backends = {**saved, "fake_conv": Fake()}
        assert _fla.causal_conv1d_backend() is None  # registered, not switched on
        monkeypatch.setenv("KERNEL_FUN_TEST_FAKE_CONV", "1")
        assert _fla.causal_conv1d_backend() == "fake_conv"
    finally:
        registry._backends = saved


@needs_triton
@pytest.mark.every_fla
def test_final_state_gradient_beside_the_installed_fla():
    """A loss through the final state too, fla's causal_conv1d run through the interpreter
    beside kernel-fun's: kernel-fun's dx and dh0 within the bars of the float64 reference;
    fla's dx off at exactly the tokens its version is known to miss. fla 0.6 drops the
    final state's slot 0 (each sequence's token eos - W, for a sequence of at least W
    tokens) and nothing else; fla 0.5.2 drops it too, misplaces the gradient of a sequence
    shorter than W - 1 and never carries it into dh0."""
    W, lens = 4, (1, 3, 20, 9, 2, 6)
    kw = conv_inputs(1, None, 16, W, torch.bfloat16, h0=True, seqlens=lens)
    ours = conv_grads(_kernels, kw, "silu", True)
    want = conv_grads(conv_oracle(**kw), kw, "silu", True)
    theirs = conv_grads(_fla.causal_conv1d(), kw, "silu", True)
    assert rel_rms(ours["dx"], want["dx"]) <= 8e-3 and rel_rms(ours["dh0"], want["dh0"]) <= 8e-3
    off = (theirs["dx"].double() - want["dx"]).abs().amax(-1)[0] > 1e-2 * want["dx"].abs().max()
    ends = torch.tensor(lens).cumsum(0)
    slot0 = {int(e) - W for e, n in zip(ends, lens) if n >= W}
    found = set(off.nonzero().flatten().tolist())
    if _fla.version_tuple() >= (0, 6):
        assert found == slot0, (found, slot0)
        assert rel_rms(theirs["dh0"], want["dh0"]) <= 8e-3
    else:
        assert slot0 < found, (found, slot0)
        assert rel_rms(theirs["dh0"], want["dh0"]) > 0.1
