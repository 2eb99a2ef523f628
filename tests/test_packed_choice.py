"""Packed sequences' automatic chunks by modelled IPU time within ``memory_budget``
(:mod:`popxl_flash.plan.packed`).

* The packed pass model against the emulator's run profile over drawn packings, shapes and
  chunkings: matmul FLOPs, boundary bytes copied and loop iterations exact, ops within
  ``OPS_TOLERANCE`` (a fit), vector work within 0.4x-3x (an estimate: the plain pass's fitted
  parts on the running steps; 0.50-2.60 measured over 120 drawn cases, the worst at the
  smallest shapes, where compute sets dominate the modelled time); the host classification
  is the device's.
* The memory bound: the emulator's peak live bytes minus the call's inputs and outputs never
  exceed ``flash_bytes + segment_bytes``.
* The choice: the least modelled time among the candidates that fit; an explicit budget is
  kept on the emulator; a budget nothing meets raises ``ValueError`` naming it; the varlen
  function prices its ``max_seqlen_*`` packing; explicit counts are kept.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash import popxl
from popxl_flash.api.functional import segmented_attention, segmented_attention_grad
from popxl_flash.checks.harness import run_graph
from popxl_flash.api import provenance
from popxl_flash.plan import memory, packed, schedule, steps
from popxl_flash.plan.segments import SegmentConfig
from test_forward import emulator_only

pytestmark = emulator_only


def _run(case, memory_budget=None):
    """Run one packed pass on the emulator: ``(profile, bytes beyond inputs and outputs,
    outputs)``."""
    L, G, Gk, D, dtype = case["L"], case["G"], case["Gk"], case["D"], case["dtype"]
    rng = np.random.default_rng(case["seed"])
    q = rng.standard_normal((G, L, D)).astype(dtype)
    k, v = (rng.standard_normal((Gk, L, D)).astype(dtype) for _ in range(2))
    opts = dict(num_chunks_q=case["nq"], num_chunks_kv=case["nkv"], causal=case["causal"],
                window=case["window"], memory_budget=memory_budget)
    ids, pos = case["ids"][None].astype(np.int32), case["pos"]
    seg = [ids, ids] + ([pos[None].astype(np.int32)] * 2 if pos is not None else [])
    lse = rng.standard_normal((G, L)).astype(np.float32)
    if pos is None:
        def named(a, b):
            return dict(q_segment_ids=a, kv_segment_ids=b)
        if not case["backward"]:
            arrays = [q, k, v, *seg]
            result = run_graph(lambda q, k, v, *s: list(pf.flash_attention(
                q, k, v, return_lse=True, **named(*s), **opts)), arrays)
        else:
            arrays = [q, q, k, v, q.copy(), lse, *seg]
            result = run_graph(lambda do, q, k, v, o, l, *s: list(pf.flash_attention_grad(
                do, q, k, v, o, l, **named(*s), **opts)), arrays)
    else:
        if not case["backward"]:
            arrays = [q, k, v, *seg]
            result = run_graph(lambda q, k, v, *s: list(segmented_attention(q, k, v, *s, **opts)),
                               arrays)
        else:
            arrays = [q, q, k, v, q.copy(), lse, *seg]
            result = run_graph(lambda do, q, k, v, o, l, *s: list(segmented_attention_grad(
                do, q, k, v, o, l, *s, **opts)), arrays)
    io = sum(a.nbytes for a in arrays) + sum(o.nbytes for o in result.outputs)
    return result.profile, result.profile.peak_live_bytes - io, result.outputs


@st.composite
def cases(draw, max_len=96):
    L = draw(st.integers(8, max_len))
    doc = draw(st.integers(3, 2 * L))
    ids = np.arange(L) // doc
    if draw(st.booleans()):
        ids[L - draw(st.integers(1, L - 1)):] = -1  # padding rows at the end
    positions = draw(st.booleans())
    ends = np.minimum((ids + 1) * doc, L)
    side = st.integers(-1, 40)
    G, Gk = draw(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2)]))
    return dict(L=L, G=G, Gk=Gk, D=draw(st.sampled_from([8, 16])),
                dtype=draw(st.sampled_from(["float16", "float32"])),
                nq=draw(st.integers(1, min(L, 7))), nkv=draw(st.integers(1, min(L, 7))),
                causal=draw(st.booleans()),
                window=draw(st.one_of(st.none(), st.tuples(side, side))),
                ids=ids, pos=(np.arange(L) - ends) if positions else None,
                backward=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


def _model(case):
    """(schedule, classes, segments) of a case as the configuration plans it."""
    L = case["L"]
    cq, ckv = -(-L // case["nq"]), -(-L // case["nkv"])
    window = schedule.normalise_window(case["window"])
    positions = case["pos"] is not None
    static = (False, (-1, -1)) if positions else (case["causal"], window)
    sched = schedule.plan(L, L, cq, ckv, causal=static[0], window=static[1])
    classes = packed.classify(case["ids"], case["ids"], case["pos"], case["pos"],
                              sched.chunk_q, sched.chunk_kv, causal=case["causal"],
                              window=window)
    return sched, classes, SegmentConfig(1, 1, positions), window


@settings(max_examples=30, deadline=None)
@given(cases())
def test_pass_counts_equal_the_emulator(case):
    profile, _, _ = _run(case)
    sched, classes, seg, window = _model(case)
    model = packed.pass_counts(sched, classes, groups=case["G"], kv_groups=case["Gk"],
                               head_dim=case["D"], dtype=case["dtype"],
                               backward=case["backward"], segments=seg, causal=case["causal"],
                               window=window)
    assert model.matmul_flops == profile.matmul_flops
    assert model.boundary_bytes == profile.boundary_bytes_copied
    assert model.iterations == profile.loop_iterations
    ops = profile.ops_excluding_views
    assert abs(model.ops - ops) <= packed.OPS_TOLERANCE * ops, (model.ops, ops)
    assert 0.4 * profile.vector_elements <= model.vector_elements <= 3 * profile.vector_elements


@settings(max_examples=25, deadline=None)
@given(cases())
def test_memory_model_bounds_the_emulator(case):
    _, measured, _ = _run(case)
    sched, _, seg, _ = _model(case)
    args = dict(groups=case["G"], kv_groups=case["Gk"], head_dim=case["D"],
                dtype=case["dtype"], backward=case["backward"])
    model = memory.flash_bytes(sched, steps=steps.loop_steps(sched, True), **args) + \
        packed.segment_bytes(sched, segments=seg, **args)
    assert measured <= model, (measured, model)


def test_host_classes_of_the_assumed_packings():
    """One sequence over the row runs every visited block; sequences of max_seqlen skip the
    blocks between them and, causal with positions, above each sequence's diagonal."""
    q_ids, kv_ids, _, _ = packed.ONE_SEQUENCE.rows(256, 256, False)
    classes = packed.classify(q_ids, kv_ids, None, None, 64, 64)
    assert (classes == packed.RT_FULL).all()
    rows = packed.max_seqlen(64, 64).rows(256, 256, True)
    classes = packed.classify(*rows, 64, 64, causal=True)
    assert (classes != packed.RT_SKIP).sum() == 4  # the diagonal blocks only
    assert (np.diag(classes) == packed.RT_MASKED).all()


def test_choice_is_the_least_modelled_time_that_fits():
    seg = SegmentConfig(1, 1, True)
    budget = 24 * 2 ** 20
    choice = packed.choose(2048, 2048, head_dim=64, groups=4, dtype="float16", causal=True,
                           window=(-1, -1), segments=seg, packing=packed.max_seqlen(256, 256),
                           memory_budget=budget)
    fitting = [c for c in choice.candidates if c.fits]
    assert choice.chosen.fits and choice.chosen.memory_bytes <= budget
    assert choice.chosen.seconds == min(c.seconds for c in fitting)
    assert any(not c.fits for c in choice.candidates)  # the budget binds
    text = choice.table()
    assert "modelled" in text and "earlier 64-row rule" in text and "max_seqlen 256" in text
    # the 64-row rule (supersteps ignored) is slower by the model
    assert choice.seed.seconds > choice.chosen.seconds


def test_explain_prints_the_packed_choice():
    choice = pf.explain(1024, 1024, head_dim=64, groups=2, causal=True, segment_ids=True)
    assert "one sequence over the whole row" in choice.reason and "modelled" in choice.table()
    varlen = pf.explain(1024, 1024, head_dim=64, groups=2, causal=True, max_seqlen=128)
    assert "max_seqlen 128" in varlen.reason


@pytest.mark.parametrize("budget_kib", [600, 1500])
@pytest.mark.parametrize("backward", [False, True])
def test_automatic_packed_choice_keeps_to_the_budget_on_the_emulator(budget_kib, backward):
    L = 256
    ids = np.arange(L) // 100
    case = dict(L=L, G=2, Gk=2, D=16, dtype="float16", nq=None, nkv=None, causal=True,
                window=None, ids=ids, pos=None, backward=backward, seed=3)
    _, measured, _ = _run(case, memory_budget=budget_kib * 1024)
    assert measured <= budget_kib * 1024, measured


def test_budget_nothing_meets_is_a_value_error():
    spec = popxl.TensorSpec
    q = spec((2, 512, 64), popxl.float16)
    ids = spec((1, 512), popxl.int32)
    with pytest.raises(ValueError, match=r"memory_budget=700,000 bytes: no chunking of this "
                                         r"packed call fits it .*expected a budget of at least"):
        pf.FlashAttention(causal=True, memory_budget=700_000).config(q, q, q, ids, ids)


def test_varlen_prices_its_max_seqlen():
    """flash_attn_varlen_func's automatic chunks are the packed choice for sequences of
    max_seqlen_* back to back; explicit counts are kept."""
    total, H, D = 512, 2, 16
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.variable(np.zeros((total, H, D), np.float16))
        cu = popxl.variable(np.array([0, 100, 300, 512], np.int32))
        pf.flash_attn_varlen_func(q, q, q, cu, cu, 200, 200, causal=True)
        pf.flash_attn_varlen_func(q, q, q, cu, cu, 200, 200, causal=True, num_chunks_q=8,
                                  num_chunks_kv=4)
    chunks = sorted((r.config.chunk_q, r.config.chunk_kv)
                    for r in provenance.ir_record(ir).graphs.values())
    choice = packed.choose(total, total, head_dim=D, groups=H, dtype="float16", causal=True,
                           window=(-1, -1), segments=SegmentConfig(1, 1, True),
                           packing=packed.max_seqlen(200, 200))
    assert chunks == sorted([(choice.chosen.chunk_q, choice.chosen.chunk_kv), (64, 128)])


@pytest.mark.parametrize("budget_kib", [2400, 3000])
def test_varlen_keeps_to_the_budget_on_the_emulator(budget_kib):
    """flash_attn_varlen_func's automatic chunks under an explicit budget: the emulator's peak
    beyond the call's inputs and outputs is within it (and the budget binds: the default
    chooses larger chunks)."""
    total, H, D = 512, 2, 32
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((total, H, D)).astype(np.float16) for _ in range(3))
    cu = np.array([0, 100, 250, 400, 512], np.int32)
    budget = budget_kib * 1024
    result = run_graph(lambda q, k, v, a, b: [pf.flash_attn_varlen_func(
        q, k, v, a, b, 160, 160, causal=True, memory_budget=budget)], [q, k, v, cu, cu])
    io = 4 * q.nbytes + 2 * cu.nbytes
    assert result.profile.peak_live_bytes - io <= budget
    chosen = pf.explain(total, total, head_dim=D, groups=H, causal=True, max_seqlen=160,
                        memory_budget=budget).chosen
    default = pf.explain(total, total, head_dim=D, groups=H, causal=True, max_seqlen=160).chosen
    assert chosen.memory_bytes <= budget < default.memory_bytes
