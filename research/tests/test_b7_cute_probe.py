"""The CuTe DSL B7 probe (research.b7_cute_probe) on the CPU: its definition of the row sums
across blocks is the package's reference B7's dq less the pairs within a block; its twin (the
kernel's arithmetic in torch: anchors, masks, bf16 split) meets that definition at the split's
precision, and one bf16 product does not; and where CuTe DSL is installed, both builds
compile for sm_90a without spills or ptxas's speed notes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from research.b7_cute_probe import BC, BT, _tensors, twin, want


def test_the_row_sums_across_blocks_are_b7_s_dq_less_the_blocks():
    from kernel_fun.kda import reference as ref

    n, K = 3, 64
    t = _tensors(n, K, "cpu", seed=1)
    x_q, _ = want(t["dAqk"], t["dAkk"], t["k"], t["g"])
    tok = lambda x: x.view(1, n * BT, 1, *x.shape[1:])  # noqa: E731
    zeros = torch.zeros(1, n * BT, 1, K, dtype=torch.float64)
    q = torch.zeros(1, n * BT, 1, K, dtype=torch.bfloat16)
    beta = torch.zeros(1, n * BT, 1)
    dq, *_ = ref.intra_bwd(q, tok(t["k"]), tok(t["g"]), beta, tok(t["dAqk"]), tok(t["dAkk"]), zeros, zeros,
                           torch.zeros(1, n * BT, 1, dtype=torch.float64), zeros, exact=True)
    rows = torch.arange(BT)
    within = (rows[None, :] <= rows[:, None]) & (rows[None, :] >= rows[:, None] // BC * BC)  # s in r's block, s <= r
    kk, gg = t["k"].double().view(n, BT, K), t["g"].double().view(n, BT, K)
    f = torch.exp2(gg[:, :, None, :] - gg[:, None, :, :])
    blocks = torch.einsum("nrs,nrsc,nsc->nrc", t["dAqk"].double().view(n, BT, BT) * within, f, kk)
    assert ref.rel_rms(x_q.view(n, BT, K) + blocks, dq.view(n, BT, K)) < 1e-12


def test_the_twin_meets_the_definition_at_the_split_s_precision():
    t = _tensors(4, 128, "cpu", seed=2)
    w_q, w_kr = want(t["dAqk"], t["dAkk"], t["k"], t["g"])
    rel = lambda got, w: ((got.double() - w).square().mean() / w.square().mean()).sqrt().item()  # noqa: E731
    s_q, s_kr = twin(t["dAqk"], t["dAkk"], t["k"], t["g"], split=True)
    o_q, o_kr = twin(t["dAqk"], t["dAkk"], t["k"], t["g"], split=False)
    assert rel(s_q, w_q) < 2e-5 and rel(s_kr, w_kr) < 2e-5  # fla's B7 (tf32 off the diagonal): ~2e-5
    assert rel(o_q, w_q) > 5e-4 and rel(o_kr, w_kr) > 5e-4  # one bf16 product: the split is needed
    assert w_q.view(4, BT, -1)[:, :BC].abs().max() == 0  # the first block has no earlier one


def test_the_probe_compiles_for_sm90a(tmp_path: Path):
    pytest.importorskip("cutlass.cute", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "research.b7_cute_probe", "compile", str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["split"] for r in rows] == [True, False]
    for r in rows:
        assert (r["spill_stores"], r["sass_stl"], r["ptxas_notes"]) == (0, 0, {}), r
        # three blocks, two dA's, three products each with the split (one without)
        assert r["wgmma"] == r["sass_hgmma"] == (18 if r["split"] else 6), r
