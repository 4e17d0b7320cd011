"""The fused backward's step 1 (research.b6_ws_probe) builds for sm_90a without a GPU: a
warp-specialized cubin with wgmmas in it, inside an SM's shared memory."""

from __future__ import annotations


import pytest

from research.b6_ws_probe import offline_compile_available


_WHY = offline_compile_available()


@pytest.mark.skipif(_WHY is not None, reason=f"offline sm_90a compile unavailable: {_WHY}")
def test_b6_ws_probe_main_compiles():
    from research.b6_ws_probe import SM90_SHARED_BYTES, compile_rows

    (row,) = compile_rows(["main"])
    assert row["ok"], row.get("error")
    assert row["wgmma_sass"] >= 1, row
    assert 0 < row["shared"] <= SM90_SHARED_BYTES, row
    assert row["setmaxnreg"] and row["setmaxnreg_sass"], row  # warp-specialized
    assert row["spill_stores"] == 0, row


def test_b6_ws_probe_gpu_launch_args_match_the_compile():
    """The ``gpu`` subcommand's launch (built on CPU tensors, not launched): host descriptors of the
    types the offline compile signs, and arguments that bind to each build's kernel."""
    import inspect

    from triton.runtime.jit import mangle_type

    from research.b6_ws_probe import VARIANTS, desc_type, gpu_inputs, launch_args

    K, V, nch = 128, 256, 4
    t = gpu_inputs(nch, K, V, device="cpu")
    for name, build in VARIANTS.items():
        kernel, args, kw = launch_args(t, K, V, **build)
        assert [mangle_type(d) for d in args[:5]] == [desc_type(b) for b in ([K, 64], [K, 64]) + ([64, 64],) * 3]
        assert kw["num_warps"] == (4 if build.get("split") else 8), name
        consts = {k: v for k, v in kw.items() if k not in ("num_warps", "maxnreg")}
        inspect.signature(kernel.fn).bind(*args, **consts)  # every parameter given, none twice
        assert args[-1] == nch


def test_b6_ws_probe_gpu_check_outputs():
    """The ``gpu`` subcommand's value check on CPU tensors: right outputs pass, wrong or unwritten fail."""
    import torch

    from research.b6_ws_probe import ERR_BAR, check_outputs, gpu_inputs

    K, V, BT, nch = 128, 256, 64, 6
    t = gpu_inputs(nch, K, V, device="cpu")
    h, dh = (t[n].float().view(nch, K, V) for n in ("h", "dh"))
    vn, do, dv = (t[n].float().view(nch, BT, V) for n in ("v_new", "do", "dv"))
    t["dq"].copy_((do @ h.mT).reshape(-1, K))
    t["dkh"].copy_((vn @ dh.mT).reshape(-1, K))
    t["dw"].copy_((dv @ h.mT).reshape(-1, K))
    t["dav"].copy_((dv @ vn.mT).reshape(-1, BT))
    idx = torch.tensor([0, 2, nch - 1])
    got = check_outputs(t, K, True, idx)
    assert all(e < 1e-5 for e in got["errors"].values()) and all(got["finite"].values()), got
    assert check_outputs(t, K, False, idx)["errors"]["dav"] is None
    t["dkh"].view(nch, BT, K)[2] = (vn[2] @ h[2].mT)  # dh swapped for h on a checked chunk-head
    t["dw"].view(nch, BT, K)[3] = float("nan")  # not checked for values: only the finiteness sees it
    got = check_outputs(t, K, True, idx)
    assert got["errors"]["dkh"] > ERR_BAR and got["errors"]["dq"] < 1e-5, got
    assert got["errors"]["dw"] < 1e-5 and got["finite"]["dw"] is False, got
