"""The test harness.

- Without a GPU, Triton runs through its interpreter (``TRITON_INTERPRET=1``, set before
  triton is imported), and every autotuner takes its first config only: the interpreter
  would otherwise run every config of every kernel.
- Fresh floating-point allocations (``torch.empty``, ``empty_like``, ``new_empty``) are
  filled with NaN during tests, so a kernel that leaves part of an output unwritten fails
  loudly instead of passing on whatever the allocator returned.
- Tests marked ``gpu`` are skipped without CUDA. Where B7-B10's CuTe kernel runs (sm_90 with
  CuTe DSL), the other tests see the chain with the Triton unit, as every other machine runs it.
- On a GPU, each test's tensors are collected and the caching allocator's free blocks
  handed back after it: the workers of ``pytest -n`` share one GPU, and a worker that ran
  a production-size test would otherwise keep that test's reservation for the rest of the
  session.
"""

from __future__ import annotations

import functools
import gc
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.runtime.autotuner as _autotuner  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Where kernel-fun's Triton kernels can run in this session, and the device their tests use.
DEVICE = "cuda" if HAS_CUDA else "cpu"


def chain_problems():
    """Two small whole-chain problems a kernel's chain test runs against the float64
    recurrence: GVA with h0 and the final state, and packed sequences at safe_gate, fp16."""
    from kernel_fun.kda.problems import Problem

    return [
        Problem("chain-K64-gva-h0", 2, 100, 2, 4, 64, 32, initial_state=True, output_final_state=True,
                dtype=torch.float16),
        Problem("chain-K128-varlen-safe", 1, 150, 1, 1, 128, 32, cu_seqlens=(0, 80, 150), dtype=torch.float16,
                lower_bound=-5.0, safe_gate=True),
    ]
needs_triton = pytest.mark.skipif(not (INTERPRETING or HAS_CUDA),
                                  reason="Triton kernels need the interpreter or a CUDA device")
# CPU-path tests that expect kernel-fun's kernels to run on CPU tensors; on a GPU machine
# the same kernels are held to fla's stages on CUDA tensors by tests/test_gpu.py.
needs_interpreter = pytest.mark.skipif(not INTERPRETING,
                                       reason="runs kernel-fun's Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")

if INTERPRETING:
    _init = _autotuner.Autotuner.__init__

    def _first_config_only(self, fn, arg_names, configs, *args, **kwargs):
        _init(self, fn, arg_names, list(configs)[:1], *args, **kwargs)

    _autotuner.Autotuner.__init__ = _first_config_only


_empty, _empty_like, _new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty


def _poison(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
        t.fill_(float("nan"))
    return t


def _nan_empty(*args, **kwargs):
    return _poison(_empty(*args, **kwargs))


def _nan_empty_like(*args, **kwargs):
    return _poison(_empty_like(*args, **kwargs))


def _nan_new_empty(self, *args, **kwargs):
    return _poison(_new_empty(self, *args, **kwargs))


@pytest.fixture(autouse=True)
def nan_fill_fresh_allocations(monkeypatch):
    monkeypatch.setattr(torch, "empty", _nan_empty)
    monkeypatch.setattr(torch, "empty_like", _nan_empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", _nan_new_empty)
    yield


@pytest.fixture(autouse=True)
def clean_switches(monkeypatch):
    for name in ("KERNEL_FUN_DISABLE", "KERNEL_FUN_KDA_DISABLE", "KERNEL_FUN_KDA_MIN_CTAS"):
        monkeypatch.delenv(name, raising=False)
    from kernel_fun._runtime import reset_log_once

    reset_log_once()
    yield


@functools.cache
def cute_runs() -> bool:
    """Whether B7-B9 and B7-B10's CuTe kernel can run here (an sm_90 GPU with CuTe DSL)."""
    if not HAS_CUDA:
        return False
    from kernel_fun.kda.kernels import b7_b10_intra_bwd_sm90

    return b7_b10_intra_bwd_sm90.cute_unavailable(torch.empty(1, device="cuda")) is None


@pytest.fixture(autouse=True)
def triton_unit_outside_the_gpu_tests(request):
    """Where the CuTe kernel can run, tests not marked ``gpu`` (nor ``shipped_dispatch``) see the
    chain as every other machine runs it: B7-B9 on the Triton unit, B7-B10's kernel declined.
    Tests marked ``gpu`` run the chain as it ships (tests/test_gpu_sm90.py holds the CuTe kernel)."""
    import contextlib

    if "gpu" in request.keywords or "shipped_dispatch" in request.keywords or not cute_runs():
        yield
        return
    from kernel_fun.kda.kernels import b7_b9_intra_bwd, b7_b10_intra_bwd_sm90
    from kernel_fun.kda.stages import registered

    with contextlib.ExitStack() as stack:
        stack.enter_context(registered("B7-B9", "ours", b7_b9_intra_bwd.intra_bwd, b7_b9_intra_bwd.supports))
        stack.enter_context(registered("B7-B10", "ours", b7_b10_intra_bwd_sm90.intra_bwd_l2,
                                       lambda **kw: "the CuTe kernel is for the gpu tests"))
        yield


@pytest.fixture(autouse=True)
def release_gpu_memory():
    yield
    if HAS_CUDA and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def b6_launches(monkeypatch):
    """The launch witness for B6's kernel: every launch of ``b6_wy_bwd.wy_dqkg_kernel`` during
    the test, as (grid, keyword arguments), the kernel still running as it would."""
    from kernel_fun.kda.kernels import b6_wy_bwd

    launches, real = [], b6_wy_bwd.wy_dqkg_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(b6_wy_bwd, "wy_dqkg_kernel", Spy())
    return launches


@pytest.fixture
def register_ours():
    """``register_ours(stage, fn, supports=None, caps=())`` registers ``fn`` as ``stage``'s
    ``ours`` for the test (a candidate's, under research/, runs in the chain there); every
    registration is undone after it (``kernel_fun.kda.stages.registered``)."""
    import contextlib

    from kernel_fun.kda.stages import registered

    with contextlib.ExitStack() as stack:
        yield lambda stage, fn, supports=None, caps=(): stack.enter_context(
            registered(stage, "ours", fn, supports, caps))


def fla_layers():
    """fla's layers module (``fla.layers.kda``), or a skip where flash-linear-attention is not
    installed (CI installs it: there a missing module fails)."""
    try:
        import fla.layers.kda
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("fla's layers (flash-linear-attention) are not installed")
    return fla.layers.kda
