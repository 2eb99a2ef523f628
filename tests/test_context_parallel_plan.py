"""Context parallelism's plan by modelled IPU time within ``memory_budget``
(:mod:`popxl_flash.plan.context_parallel`).

* The split (the layout's parts; per (part, round) no call where no replica sees a pair, a
  plain call where every replica sees every pair) and the run-time step tables (each
  replica's own blocks, picked by its replica index) give the whole sequence's attention and
  gradients under the tolerance rule, forced on and off over drawn cases.
* The per-replica model against the emulator: forward FLOPs exact, loop iterations equal on
  every replica (SPMD), ops within ``OPS_TOLERANCE``; the memory bound above
  every replica's peak live bytes beyond the call's inputs and outputs.
* The choice: the least modelled time among the settings that fit; an explicit budget kept on
  the emulator; a budget nothing meets raises ``ValueError`` naming it; ``explain`` prints the
  modelled times.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash import popxl
from popxl_flash.api import context_parallel as cp
from popxl_flash.plan import context_parallel as pcp

from attention_utils import DEVICE, random_qkv
from test_context_parallel import check_backward, check_forward, cp_cases, run_cp
from test_forward import emulator_only

ops = popxl.ops


@settings(max_examples=20, deadline=None)
@given(cp_cases(), st.booleans())
def test_split_forward_matches_whole_sequence(case, split):
    check_forward(case, split=split)


@settings(max_examples=15, deadline=None)
@given(cp_cases(max_dim=6), st.booleans())
def test_split_backward_matches_whole_sequence(case, split):
    check_backward(case, split=split)


@st.composite
def table_cases(draw):
    """A drawn case with explicit chunk counts (every setting given: the run-time step tables
    are used wherever they drop a step) and the split on or off."""
    case = draw(cp_cases())
    G, L, D = case["shape"]
    local = L // case["R"]
    cols = case["R"] * (local // case["steps"])
    nq = draw(st.sampled_from([d for d in (1, 2, 4) if local % d == 0]))
    nkv = draw(st.sampled_from([d for d in (1, 2, 4, 8) if cols % d == 0]))
    return case, dict(num_chunks_q=nq, num_chunks_kv=nkv, split=draw(st.booleans()))


@settings(max_examples=20, deadline=None)
@given(table_cases())
def test_step_tables_forward_match_whole_sequence(args):
    case, options = args
    check_forward(case, **options)


@settings(max_examples=15, deadline=None)
@given(table_cases())
def test_step_tables_backward_match_whole_sequence(args):
    case, options = args
    check_backward(case, **options)


@emulator_only
def test_step_tables_loop_only_over_each_replicas_blocks():
    """Zigzag, causal, one round, 8 x 16 blocks per call: every replica loops over the blocks
    its positions run (padded to the longest list) instead of all 128; FLOPs and results are
    unchanged, the trip counts equal on every replica."""
    G, L, D, R = 2, 256, 8, 4
    q, k, v = random_qkv(np.random.default_rng(7), G, L, L, D, np.float32)
    options = dict(kv_gather_steps=1, num_chunks_q=8, num_chunks_kv=16, split=False)
    out, lse, session = run_cp(q, k, v, R, "zigzag", **options)
    cost = cp.explain(L, R, head_dim=D, groups=G, dtype="float32", **options)
    table = cost.plan.tables[0, 0]
    assert table.shape[1] < 8 * 16
    reps = session.profile.replicas
    assert [p.loop_iterations for p in reps] == [table.shape[1]] * R
    assert [p.matmul_flops for p in reps] == list(cost.flops)
    for p, m in zip(reps, pcp.replica_costs(cost.plan, False)):
        modelled = sum(c.ops for c in m.counts)
        assert abs(modelled - (p.ops_excluding_views - 5)) <= \
            pcp.OPS_TOLERANCE * p.ops_excluding_views
    ref, _ = pf.reference.attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    assert "run-time step tables" in cost.table() and "static schedule's steps" in cost.table()
    assert cost.seconds < cost.static_tables[0]  # modelled: fewer steps, the same work


def _plan(L, R, G=2, Gk=2, D=8, dtype="float32", **options):
    options.setdefault("steps", None)
    options.setdefault("num_chunks_q", None)
    options.setdefault("num_chunks_kv", None)
    options.setdefault("layout", "zigzag")
    options.setdefault("causal", True)
    options.setdefault("window", None)
    return pcp.Plan((G, L // R, D), (Gk, L // R, D), dtype, replicas=R, scale=None,
                    budget=pcp.DEFAULT_KV_BUDGET, **options)


def test_split_kinds_of_zigzag_with_two_rounds():
    """Zigzag, causal, two rounds: the early chunk never sees the late round on any replica
    (no call), the late chunk sees all of the early round on every replica (a plain call)."""
    plan = _plan(256, 4, steps=2, split=True, num_chunks_q=2, num_chunks_kv=4)
    kinds = {(c.part, c.step): c.kind for c in plan.calls}
    assert kinds == {(0, 0): "mixed", (1, 0): "full", (1, 1): "mixed"}
    assert not _plan(256, 4, steps=2, split=False, num_chunks_q=2, num_chunks_kv=4).split


@emulator_only
@pytest.mark.parametrize("R,layout,steps,split,causal,window,dtype", [
    (4, "zigzag", 2, True, True, None, np.float32), (4, "zigzag", 4, True, True, (20, -1),
                                                     np.float16),
    (2, "zigzag", 1, False, True, None, np.float32), (4, "contiguous", 2, False, True, None,
                                                      np.float16),
    (2, "zigzag", 2, True, False, (10, 10), np.float32),
    (4, "zigzag", 1, False, True, (24, -1), np.float32)])
def test_model_per_replica_against_the_emulator(R, layout, steps, split, causal, window, dtype):
    G, L, D = 2, 128, 8
    q, k, v = random_qkv(np.random.default_rng(4), G, L, L, D, dtype)
    options = dict(kv_gather_steps=steps, split=split, causal=causal, window=window)
    _, _, session = run_cp(q, k, v, R, layout, **options)
    cost = cp.explain(L, R, head_dim=D, groups=G, dtype=np.dtype(dtype).name, layout=layout,
                      **options)
    reps = session.profile.replicas
    assert [p.matmul_flops for p in reps] == list(cost.flops)
    assert len({p.loop_iterations for p in reps}) == 1
    assert reps[0].loop_iterations == cost.iterations
    model = pcp.replica_costs(cost.plan, False)
    io = 5  # the host loads of q, k, v and stores of out, lse
    for p, m in zip(reps, model):
        modelled = sum(c.ops for c in m.counts)
        assert abs(modelled - (p.ops_excluding_views - io)) <= \
            pcp.OPS_TOLERANCE * p.ops_excluding_views
    text = cost.table()
    assert "modelled" in text and "split" in text


def _run_stashed_grad(arrays, replicas, layout, **options):
    """The context-parallel backward alone (out and lse fed from the host): per replica its
    peak live bytes beyond the call's inputs and outputs."""
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph:
        streams, tensors = [], []
        for name, x in arrays.items():
            shape = (x.shape[0], x.shape[1] // replicas) + x.shape[2:]
            s = popxl.h2d_stream(shape, getattr(popxl, x.dtype.name), name=name)
            streams.append(s)
            tensors.append(ops.host_load(s))
        outs = []
        for t in cp.context_parallel_attention_grad(*tensors, layout=layout, **options):
            d = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(d, t)
            outs.append(d)
    feeds = {s: cp.shard(x, replicas, layout) for s, x in zip(streams, arrays.values())}
    with popxl.Session(ir, DEVICE) as session:
        session.run(feeds)
    io = sum(x.nbytes for x in arrays.values()) // replicas
    io += sum(arrays[n].nbytes for n in ("q", "k", "v")) // replicas  # the gradients
    return [p.peak_live_bytes - io for p in session.profile.replicas]


@emulator_only
@pytest.mark.parametrize("R,L,steps,split,dtype", [
    (2, 128, 1, False, np.float32), (4, 256, 2, True, np.float16), (4, 256, 4, True, np.float32),
    (2, 128, 2, False, np.float16)])
def test_memory_bound_per_replica(R, L, steps, split, dtype):
    G, D = 2, 16
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, G, L, L, D, dtype)
    options = dict(kv_gather_steps=steps, split=split, causal=True)
    _, _, session = run_cp(q, k, v, R, "zigzag", **options)
    io = (4 * q.nbytes + 4 * G * L) // R  # q, k, v in; out, lse out
    plan = cp.explain(L, R, head_dim=D, groups=G, dtype=np.dtype(dtype).name, **options).plan
    for p in session.profile.replicas:
        assert p.peak_live_bytes - io <= pcp.replica_bytes(plan, False)
    out = rng.standard_normal(q.shape).astype(dtype)
    lse = rng.standard_normal((G, L)).astype(np.float32)
    measured = _run_stashed_grad(dict(dout=out.copy(), q=q, k=k, v=v, out=out, lse=lse), R,
                                 "zigzag", **options)
    assert max(measured) <= pcp.replica_bytes(plan, True), (measured,
                                                           pcp.replica_bytes(plan, True))


def test_choice_is_the_least_modelled_time_within_the_budget():
    plan = _plan(4096, 4, G=4, Gk=4, D=64, dtype="float16", memory_budget=24 * 2 ** 20)
    choice = plan.choice
    fitting = [c for c in choice.candidates if c.fits]
    assert choice.chosen.fits and choice.chosen.seconds == min(c.seconds for c in fitting)
    assert choice.over_budget > 0  # the budget binds
    assert (plan.steps, plan.chunk_q, plan.chunk_kv, plan.split,
            bool(plan.tables)) == choice.chosen.setting
    larger = _plan(4096, 4, G=4, Gk=4, D=64, dtype="float16", memory_budget=2 ** 30)
    assert larger.choice.chosen.seconds <= choice.chosen.seconds


def test_split_wins_by_the_model_for_zigzag_rounds():
    """Modelled: zigzag with two rounds and the split is faster than without (the late round
    is not built for the early chunks, the early round runs plain for the late ones)."""
    cost = cp.explain(8192, 4, head_dim=64, groups=8, kv_gather_steps=2, split=True)
    assert cost.unsplit is not None and cost.seconds < cost.unsplit[0]
    assert "without the split" in cost.table()


@emulator_only
def test_explicit_budget_is_kept_on_the_emulator():
    G, L, D, R = 2, 256, 16, 4
    budget = 256 * 1024  # above the least (the flash calls' bound has a 64 KiB allowance)
    q, k, v = random_qkv(np.random.default_rng(6), G, L, L, D, np.float16)
    _, _, session = run_cp(q, k, v, R, "zigzag", memory_budget=budget)
    io = (4 * q.nbytes + 4 * G * L) // R
    assert max(p.peak_live_bytes for p in session.profile.replicas) - io <= budget


def test_budget_nothing_meets_is_a_value_error():
    with pytest.raises(ValueError, match=r"memory_budget=1,000 bytes: no context-parallel plan "
                                         r"of this call fits it .*expected a budget of at least"):
        _plan(256, 2, memory_budget=1000)
    with pytest.raises(ValueError, match="memory_budget=1,000 bytes"):
        _plan(256, 2, memory_budget=1000, steps=1, num_chunks_q=1, num_chunks_kv=1, split=False)


@emulator_only
@pytest.mark.parametrize("R,layout,steps,nkv", [(4, "zigzag", 1, 16), (2, "contiguous", 2, 8)])
def test_step_tables_with_softcap_and_alibi_equal_flash(R, layout, steps, nkv):
    """Score modifiers read each step's global positions from its offsets, so they are exact
    over the per-replica step tables too (every setting given: tables used)."""
    from test_context_parallel import _modifier_case, run_cp_modified, run_flash_modified
    rng = np.random.default_rng(R + steps)
    G, L, D = 4, 64, 8
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=2)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    options = dict(kv_gather_steps=steps, num_chunks_q=4, num_chunks_kv=nkv, split=False)
    assert cp.explain(L, R, head_dim=D, groups=G, kv_groups=2, dtype="float32", layout=layout,
                      **options).plan.tables
    shared, make = _modifier_case("softcap+alibi", rng, G, L)
    out, lse, grads, _ = run_cp_modified(q, k, v, dout, R, layout, shared, make, **options)
    f_out, f_lse, f_grads = run_flash_modified(q, k, v, dout, shared, make, causal=True)
    np.testing.assert_allclose(out, f_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(lse, f_lse, atol=2e-6, rtol=0)
    for name, g, f in zip(("dq", "dk", "dv"), grads, f_grads):
        np.testing.assert_allclose(g, f, atol=2e-6 * max(1.0, np.abs(f).max()), rtol=0,
                                   err_msg=name)


@emulator_only
def test_step_tables_with_dropout_match_the_reference_with_the_mask():
    """Dropout draws a block's mask from its offsets, so the per-replica step tables draw the
    masks the returned keep mask holds, and the backward regenerates them."""
    from test_context_parallel import check_rule, run_cp_dropout
    rng = np.random.default_rng(9)
    G, L, D, R = 4, 64, 8, 4
    q, k, v = random_qkv(rng, G, L, L, D, "float32", kv_groups=2)
    dout = rng.standard_normal(q.shape).astype("float32")
    options = dict(kv_gather_steps=1, num_chunks_q=4, num_chunks_kv=16, split=False)
    assert cp.explain(L, R, head_dim=D, groups=G, kv_groups=2, dtype="float32",
                      **options).plan.tables
    out, lse, grads, keep = run_cp_dropout(q, k, v, dout, R, "zigzag", 0.3, **options)
    check_rule(out, lse, grads, q, k, v, dout,
               dict(causal=True, scale=None, window=None, keep=keep, dropout=0.3), "float32", 1)
