"""The cluster probe's GPU diagnosis (research.b6_cute_probe.diagnose) names the operands and
V tiles a wrong sum was made of, per K half: the torch part of its GPU check, here on the CPU."""

from __future__ import annotations

import torch

from research.b6_cute_probe import BT, KH, diagnose


def test_the_diagnosis_names_what_each_half_summed():
    n, K, V = 3, 128, 256
    g = torch.Generator().manual_seed(0)
    do, vn, dv = (torch.randn(n, BT, V, generator=g) for _ in range(3))
    h, dh = (torch.randn(n, K, V, generator=g) for _ in range(2))
    got = do @ h.transpose(1, 2)  # K half 0 right; K half 1: v_new h^T over V tiles 0 and 2 only
    got[..., KH:] = sum(vn[..., t] @ h[:, KH:, t].transpose(1, 2) for t in (slice(0, 64), slice(128, 192)))
    got[0, 0, 0] = float("nan")
    out = diagnose(got, {"do": do, "v_new": vn, "dv": dv}, {"h": h, "dh": dh}, K, V)
    assert out["K half 1"]["nearest"] == "v_new h^T over tiles [0, 2]" and out["K half 1"]["error"] < 1e-6
    assert out["K half 1"]["finite"] == 1.0
    assert out["K half 0"]["nearest"] == "do h^T over tiles [0, 1, 2, 3]" and out["K half 0"]["error"] < 1e-6
    assert out["K half 0"]["finite"] < 1.0  # the NaN reported, the comparison made where finite
