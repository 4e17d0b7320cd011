"""The chunked chain of torch stage references against the float64 recurrence.

This is what a CPU call of ``kernel_fun.kda.chunk_kda`` runs, so these tests also pin the
CPU path. Every output and gradient is held to fla's budgets (relative RMS against the
oracle), on awkward shapes: T not a multiple of 64, K = 60 / 100, GVA, initial state,
every in-op flag, packed sequences.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from kernel_fun.kda import chunk_kda, last_record, reference as ref, use_impls
from kernel_fun.kda.problems import Problem, as_oracle_inputs, make_inputs, run_fwd_bwd

CASES = [
    Problem("T63-K60-gva-h0", 2, 63, 2, 4, 60, 32, initial_state=True, output_final_state=True),
    Problem("T100-K100-gate-l2", 1, 100, 2, 2, 100, 48),
    Problem("T500-K64-gva", 1, 500, 1, 2, 64, 32, output_final_state=True),
    Problem("T100-pregated-h0", 2, 100, 2, 2, 32, 64, gate_in_kernel=False, l2norm_in_kernel=False,
            initial_state=True, output_final_state=True),
    Problem("T70-beta-sigmoid-neg", 1, 70, 2, 4, 32, 32, beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    Problem("T90-beta-sigmoid", 1, 90, 1, 2, 48, 40, beta_sigmoid_in_kernel=True, initial_state=True),
    Problem("T130-lower-bound", 1, 130, 2, 2, 64, 32, lower_bound=-5.0, output_final_state=True),
    Problem("varlen-3seq-h0", 1, 200, 2, 4, 60, 32, initial_state=True, output_final_state=True,
            cu_seqlens=(0, 1, 137, 200)),
    Problem("varlen-4seq", 1, 260, 2, 2, 64, 64, cu_seqlens=(0, 64, 65, 128, 260)),
    # empty sequences in a packed batch: no chunk, the state leaves as it came (fla accepts them)
    Problem("varlen-empty-seqs-h0", 1, 70, 1, 2, 64, 32, initial_state=True, output_final_state=True,
            cu_seqlens=(0, 0, 64, 64, 70)),
]


# float16 is the dtype fla's own tests hold chunk_kda to these budgets in; float32 runs
# every stage reference without bf16/fp16 roundings, so it must match the recurrence to
# float32 accuracy (measured ~1e-6; the bound leaves 100x).
FP32_BOUND = 1e-4


def check_against_oracle(result: dict, oracle: dict, dtype: torch.dtype) -> dict[str, float]:
    errors = {}
    for name, want in oracle.items():
        if want is None:
            assert result.get(name) is None, name
            continue
        got = result[name]
        assert got is not None, f"{name} missing"
        assert got.shape == want.shape, (name, got.shape, want.shape)
        errors[name] = ref.rel_rms(got, want)
    bound = (lambda n: FP32_BOUND) if dtype == torch.float32 else (lambda n: ref.BUDGETS[n])
    bad = {n: e for n, e in errors.items() if not e <= bound(n)}
    assert not bad, f"over budget: {bad} (all: {errors})"
    return errors


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("p", CASES, ids=lambda p: p.name)
def test_reference_chain_matches_recurrence(p: Problem, dtype: torch.dtype):
    p = dataclasses.replace(p, dtype=dtype)
    kwargs = make_inputs(p, seed=zlib.crc32(p.name.encode()) % 1000)
    with use_impls("reference"):
        result = run_fwd_bwd(chunk_kda, kwargs, grid=p.dtype)
    record = last_record()
    assert record.engaged and set(record.forward.values()) == {"reference"}
    assert set(record.backward.values()) == {"reference"}
    oracle = run_fwd_bwd(ref.recurrent_kda, as_oracle_inputs(kwargs), grid=p.dtype)
    expected = {"dq", "dk", "dv", "dg", "dbeta"}
    if p.initial_state:
        expected.add("dh0")
    if p.gate_in_kernel:
        expected |= {"dA_log", "ddt_bias"}
    assert expected <= set(oracle), sorted(oracle)
    check_against_oracle(result, oracle, dtype)


def test_stage_units_cover_fla_chain():
    from kernel_fun.kda import stages

    covered = [c for s in stages().values() for c in s.covers]
    for name in ["F1", "F2", "F3", "F4", "F5", "F6", "F7", "F8"] + [f"B{i}" for i in range(1, 11)]:
        assert name in covered, name


def test_oracle_is_the_recurrence():
    """The oracle itself against a closed form: one token from a zero state gives
    o = scale * beta * (q.k) v and S = beta k v^T."""
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    g = -torch.rand(1, 1, 1, 8, dtype=torch.float64)
    beta = torch.rand(1, 1, 1, dtype=torch.float64)
    o, S = ref.recurrent_kda(q, k, v, g, beta, scale=0.5, output_final_state=True)
    assert torch.allclose(S[0, 0], beta[0, 0, 0] * k[0, 0, 0][:, None] * v[0, 0, 0][None, :])
    assert torch.allclose(o[0, 0, 0], 0.5 * beta[0, 0, 0] * (q * k).sum() * v[0, 0, 0])


def test_rel_rms_propagates_nan():
    x = torch.ones(4)
    assert ref.rel_rms(x, x) == 0.0
    y = x.clone()
    y[1] = float("nan")
    assert not ref.rel_rms(y, x) <= 1.0


def test_stage_errors_ignore_the_unwritten_upper_triangle_per_sequence():
    """Aqk's upper triangle is never written by fla; the comparison masks it per chunk, with
    chunks restarting at each packed sequence."""
    from benchmarks.parity import stage_errors

    p = Problem("mask", 1, 150, 1, 1, 16, 16, cu_seqlens=(0, 10, 150))
    kw = make_inputs(p, requires_grad=False)
    cu = kw["cu_seqlens"]
    gc = ref.gate_cumsum(kw["g"], True, kw["A_log"], kw["dt_bias"], cu_seqlens=cu)
    q, _ = ref.l2norm_fwd(kw["q"])
    k, _ = ref.l2norm_fwd(kw["k"])
    Aqk, Akk = ref.intra_scores(q, k, gc, kw["beta"], 0.25, cu_seqlens=cu)
    pos = torch.tensor(list(range(10)) + list(range(140)))
    garbage = Aqk.clone()
    upper = torch.arange(64)[None, :] > (pos % 64)[:, None]
    garbage[0].masked_fill_(upper[:, None, :], float("nan"))
    w = torch.zeros(1)
    out = (w, w, w, garbage, Akk)
    assert stage_errors("F3-F6", out, (w, w, w, Aqk, Akk), cu_seqlens=cu)["Aqk"] == 0.0
    garbage[0, 12, :, 5] = 1.0  # row 2 of the second sequence, column 5: above its diagonal
    assert stage_errors("F3-F6", out, (w, w, w, Aqk, Akk), cu_seqlens=cu)["Aqk"] == 0.0
    garbage[0, 15, :, 3] += 1.0  # row 5 of the second sequence, column 3: compared
    assert stage_errors("F3-F6", out, (w, w, w, Aqk, Akk), cu_seqlens=cu)["Aqk"] > 0.0


def test_every_stage_declares_the_inputs_its_implementations_take():
    """A stage's inputs are its contract: every implementation (and support predicate)
    registered for it takes exactly those keywords, and one that does not is refused at
    registration, before any call could pass it the wrong thing."""
    import inspect

    import pytest

    from kernel_fun.kda import stages
    from kernel_fun.kda.stages import add_impl

    for stage in stages().values():
        assert stage.inputs, stage.name
        for fn in (*stage.impls.values(), *stage.supports.values()):
            inspect.signature(fn).bind(**dict.fromkeys(stage.inputs))
    with pytest.raises(TypeError, match="stage B8: ours does not take"):
        add_impl("B8", "ours", lambda dg, chunk_size: dg)
    assert "ours" not in stages()["B8"].impls


def test_capabilities_are_declared_at_registration():
    """What an implementation reads or forms beyond its stage's contract is declared where it
    is registered (``CAPS``), checked by name there and where the chain asks; a registration
    for a block is undone on the way out, whatever was registered inside."""
    import pytest
    import torch

    from kernel_fun.kda import stages
    from kernel_fun.kda.stages import CAPS, CallRecord, Dispatcher, add_impl, registered

    assert set(CAPS) == {"reads_qg", "forms_u"}
    assert stages()["F7-F8"].caps["ours"] == {"reads_qg"} and stages()["B3"].caps["ours"] == {"forms_u"}
    assert stages()["F7-F8"].caps.get("reference", frozenset()) == frozenset()
    reference = stages()["B8"].impls["reference"]
    with pytest.raises(ValueError, match="unknown capabilities"):
        add_impl("B8", "ours", reference, caps=("reads_u",))
    run = Dispatcher(torch.device("cpu"), CallRecord(engaged=True))
    with pytest.raises(ValueError, match="unknown capability"):
        run.wants("B8", "reads_u", dg=None, chunk_size=64, cu_seqlens=None, chunk_indices=None)
    before = stages()["B8"]
    with registered("B8", "ours", reference, caps=("forms_u",)):
        assert stages()["B8"].caps["ours"] == {"forms_u"}
        add_impl("B8", "ours", reference)  # replaced inside the block: still undone
    assert stages()["B8"] is before and "ours" not in stages()["B8"].impls


def test_the_oracle_takes_every_flag_the_chain_handles():
    """The float64 oracle keeps its own explicit signature (the flags the math depends on,
    named), so a flag the chain starts to carry must be added to it too: this fails until
    it is. Only the chain's bookkeeping stays out: the host copy of cu_seqlens, the chunk
    size, returning F7's h, fla 0.6's capacity-shaped switch (use_graph, max_num_seqs:
    how the chain indexes the chunks; the oracle takes the padded offsets as they are), and
    the context-parallel context (a rank's slice of the call the oracle takes whole:
    tests/test_cp.py holds the ranks to the whole call)."""
    import inspect

    from kernel_fun.kda import PARAMETERS

    oracle = set(inspect.signature(ref.recurrent_kda).parameters)
    bookkeeping = {"cu_seqlens_cpu", "chunk_size", "return_intermediate_states", "use_graph", "max_num_seqs",
                   "cp_context"}
    handled = {n for n, what in PARAMETERS.items() if what.startswith("handled")}
    assert handled - bookkeeping <= oracle, sorted(handled - bookkeeping - oracle)


def test_the_oracle_s_size_of_a_packed_shape_keeps_its_documents():
    """The op bench checks each shape against float64 at 512 tokens (``shrunk``): a dense shape
    as one sequence, the packed production shape with its documents scaled into them, in order,
    each boundary a token index, the first 0 and the last the new length."""
    from kernel_fun.kda.problems import SHAPES, shrunk

    dense = shrunk(SHAPES["prod8192_gate"], 512)
    assert (dense.B, dense.T, dense.cu_seqlens) == (1, 512, None)
    p = SHAPES["prod_packed"]
    assert p.cu_seqlens[0] == 0 and p.cu_seqlens[-1] == p.B * p.T
    small = shrunk(p, 512)
    bounds = small.cu_seqlens
    assert (small.B, small.T, bounds[0], bounds[-1]) == (1, 512, 0, 512)
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert len(bounds) == len(p.cu_seqlens)  # (no two of its documents meet at 512 tokens)
    for c in p.cu_seqlens:  # every boundary where its share of the tokens puts it
        assert c * 512 // p.T in bounds
    assert make_inputs(small)["cu_seqlens"].tolist() == list(bounds)
