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


def test_the_probe_s_decomposition_of_b6_is_the_reference_stage():
    """The full build's split of B6 (what each consumer sums over V, what the epilogues add,
    db as V and K parts, dA's two products after the pair's partials) written in torch, against
    ``b6_want`` (the package's reference B6 on the probe's layout), which the GPU check uses."""
    from research.b6_cute_probe import b6_want

    n, K, V = 3, 128, 256
    g = torch.Generator().manual_seed(1)
    bf = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).bfloat16()  # noqa: E731
    q, k = bf(n * BT, K, scale=K ** -0.5), bf(n * BT, K, scale=K ** -0.5)
    gc = -(torch.rand(n, BT, K, generator=g) * 0.1).cumsum(1).view(n * BT, K)
    beta, Akk = torch.rand(n * BT, generator=g), bf(n * BT, BT, scale=0.1)
    h, dh = bf(n * K, V, scale=0.1), bf(n * K, V, scale=0.1)
    vn, do, dv, v = (bf(n * BT, V) for _ in range(4))
    scale = K ** -0.5
    want = b6_want(q, k, gc, beta, Akk, h, dh, vn, do, dv, v, scale)

    r16 = lambda x: x.bfloat16().float()  # noqa: E731
    f = lambda x, *s: x.float().view(n, *s)  # noqa: E731
    qs, ks, gs, bs = f(q, BT, K), f(k, BT, K), f(gc, BT, K), f(beta, BT, 1)
    hs, dhs, At = f(h, K, V), f(dh, K, V), f(Akk, BT, BT).transpose(1, 2)
    vns, dos, dvs, vs = (f(x, BT, V) for x in (vn, do, dv, v))
    eg = torch.exp2(gs)
    acc_q, acc_k, acc_s = dos @ hs.transpose(1, 2), vns @ dhs.transpose(1, 2), hs @ dhs.transpose(1, 2)
    acc_w = dvs @ hs.transpose(1, 2)
    dvb = At @ dvs
    dq = acc_q * eg * scale
    dk_h = acc_k * torch.exp2(gs[:, -1:] - gs)
    kg = ks * eg
    dw = r16(-acc_w)
    dkgb = At @ dw
    kdk = ks * dk_h
    dg = qs * dq - kdk + kg * dkgb * bs
    dg[:, -1] += torch.diagonal(acc_s, dim1=1, dim2=2) * torch.exp2(gs[:, -1]) + kdk.sum(1)
    halves = [slice(0, 64), slice(64, 128)]
    parts = [sum(dvs[..., t] @ vs[..., t].transpose(1, 2) for t in (slice(64 * j, 64 * j + 64),
                                                                     slice(64 * j + 128, 64 * j + 192)))
             + dw[..., c] @ r16(kg[..., c]).transpose(1, 2) for j, c in enumerate(halves)]
    strict = torch.ones(BT, BT).tril(-1).bool()
    d1 = r16(torch.where(strict, (parts[0] + parts[1]) * bs.transpose(1, 2), 0.0))
    dA = torch.where(strict, -(At @ r16(d1 @ At)), 0.0)
    db = (dvb * vs).sum(-1) + sum((dkgb[..., c] * kg[..., c]).sum(-1) for c in halves)
    got = {"dq": dq, "dk": dk_h + dkgb * eg * bs, "dg": dg, "dv2": r16(dvb * bs), "db": db, "dA": dA}
    for name, w in want.items():
        err = ((got[name] - w).square().mean() / w.square().mean()).sqrt().item()
        assert err < 1e-6, (name, err)  # the same arithmetic, summed in another order


def test_the_op_layout_the_probe_reads():
    """What the probe as the op's B6 (``wy_dqkg_bwd``) relies on, for B=2, T=128, H=3: the op's
    [B, T, H, C] tensors viewed [B * T, H * C] give chunk-head c = rt * H + hh (rt = b * NT + t)
    its tile (rt, hh * 2 + j) for K half j and (rt, hh * NV + v) for V tile v; h viewed [c * K,
    V] gives it row block c * 2 + j; beta [B * T * H] its row r at (rt * 64 + r) * H + hh; and
    the pair's db partials, written at (c * 2 + j) * 64 + r, sum back to [B, T, H] as the
    wrapper adds them."""
    B, T, H, K, V = 2, 128, 3, 128, 256
    NT, NV = T // BT, V // 64
    g = torch.Generator().manual_seed(2)
    q, v, beta = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, V, generator=g), torch.randn(B, T, H)
    h = torch.randn(B, NT, H, K, V, generator=g)
    q2, v2, h2, beta1 = q.view(B * T, H * K), v.view(B * T, H * V), h.view(-1, V), beta.view(-1)
    db = torch.randn(B, T, H, generator=g)
    dbv, dbk = torch.zeros(2 * B * NT * H * BT), torch.zeros(2 * B * NT * H * BT)
    for b in range(B):
        for t in range(NT):
            for hh in range(H):
                rt = b * NT + t
                c = rt * H + hh
                rows = slice(rt * BT, (rt + 1) * BT)
                for j in range(2):
                    assert torch.equal(q2[rows, (hh * 2 + j) * KH:(hh * 2 + j + 1) * KH],
                                       q[b, t * BT:(t + 1) * BT, hh, j * KH:(j + 1) * KH])
                    assert torch.equal(h2[(c * 2 + j) * KH:(c * 2 + j + 1) * KH], h[b, t, hh, j * KH:(j + 1) * KH])
                for vt in range(NV):
                    assert torch.equal(v2[rows, (hh * NV + vt) * 64:(hh * NV + vt + 1) * 64],
                                       v[b, t * BT:(t + 1) * BT, hh, vt * 64:(vt + 1) * 64])
                r = torch.arange(BT)
                assert torch.equal(beta1[(rt * BT + r) * H + hh], beta[b, t * BT:(t + 1) * BT, hh])
                # the four partials of db: each value split among CTA j's V and K parts (0.1 + 0.3 and
                # 0.2 + 0.4 of it)
                for j in range(2):
                    dbv[(c * 2 + j) * BT + r] = db[b, t * BT:(t + 1) * BT, hh] * (0.1 + 0.2 * j)
                    dbk[(c * 2 + j) * BT + r] = db[b, t * BT:(t + 1) * BT, hh] * (0.2 + 0.2 * j)
    summed = (dbv + dbk).view(B * NT, H, 2, BT).sum(2).transpose(1, 2).reshape(B, T, H)  # as wy_dqkg_bwd adds them
    assert torch.allclose(summed, db, rtol=1e-6, atol=1e-6)
