"""The memory-lean structures (FlashAttention-2's floor, issue 32): right, and less memory.

A looped pass's lean structure (``AttentionConfig.lean_forward`` / ``lean_backward``) scales
each step's k slice instead of a copy of the whole k, works on full-length float32 tensors a
piece at a time, and in the backward accumulates dk and dv one kv piece at a time
(``popxl_flash/graph/lean.py``). The forward is the same arithmetic on the same values in the
same order (the k scale is an exact power of two where it folds), so its results equal the usual
structure's; the backward sums dq per kv piece rather than per step group (the same float32
terms in another order), so its gradients are held to the backward's 3x rule. One-block passes
and row passes have no lean structure: the flag must change nothing there (a lean flag once
scaled k twice in the backward's row steps, which the rule catches).

Memory: at FlashAttention-2's floor budgets (issue 32: 1.25 x 4 G L (D + 2) + 2 MiB forward,
1.25 x 4 G L (D + 1) + 2 MiB backward) the automatic choice builds and stays within them.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash.api.functional import modifier_inputs
from popxl_flash.backend import popxl
from popxl_flash.checks.harness import run_graph
from popxl_flash.checks.tolerance import gradient_accum_steps
from popxl_flash.plan import costmodel, memory, steps
from attention_utils import assert_grads_within_rule, run_flash, run_flash_grad
from test_forward import check_forward_outputs, emulator_only

pytestmark = emulator_only

MiB = 2 ** 20


def _call(module, *inputs):
    graph = popxl.gcg().ir.create_graph(module, *inputs)
    return list(popxl.ops.call(graph, *inputs))


def _run(G, Gk, Lq, Lkv, D, dtype, options, lean, mods=None):
    """(forward outputs, backward outputs, forward profile, backward profile) with the modules
    given ``lean``; ``mods``: keyword arguments of the score modifiers (softcap, alibi,
    dropout)."""
    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((G, Lq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((Gk, Lkv, D)).astype(dtype) for _ in range(2))
    extra_arrays = []
    mods = dict(mods or {})
    if mods.pop("alibi", False):
        extra_arrays.append(rng.uniform(0.1, 1.0, G).astype(np.float32))
    if mods.get("dropout"):
        extra_arrays.append(np.array([7, 11], np.uint32))

    def modifiers(extra):
        it = iter(extra)
        named = dict(mods)
        if len(extra_arrays) and extra_arrays[0].dtype == np.float32:
            named["alibi_slopes"] = next(it)
        if mods.get("dropout"):
            named["seed"] = next(it)
        return modifier_inputs(**named)

    def forward(q, k, v, *extra):
        m, extras = modifiers(extra)
        return _call(pf.FlashAttention(**options, mods=m, lean=lean), q, k, v, *extras)

    def backward(do, q, k, v, *extra):
        m, extras = modifiers(extra)
        out, lse = forward(q, k, v, *extra)
        return _call(pf.FlashAttentionGrad(**options, mods=m, lean=lean), do, q, k, v, out, lse,
                     *extras)

    fwd = run_graph(forward, [q, k, v, *extra_arrays])
    bwd = run_graph(backward, [do, q, k, v, *extra_arrays])
    return fwd.outputs, bwd.outputs, fwd.profile, bwd.profile


calls = st.tuples(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2)]), st.integers(1, 90),
                  st.integers(1, 90), st.sampled_from([4, 8, 16]), st.integers(1, 12),
                  st.integers(1, 12), st.sampled_from(["float16", "float32"]), st.booleans(),
                  st.sampled_from([None, 0.5, 0.3]))


def _assert_lean_within_rule(lean, case):
    """The lean structure's out and lse by the forward's 2x rule, dq, dk and dv by the
    backward's 3x rule (against float64; the same rules as the usual structure's tests)."""
    G, Gk, Lq, Lkv, D, dtype, options = case
    rng = np.random.default_rng(1)  # _run's inputs
    q, do = (rng.standard_normal((G, Lq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((Gk, Lkv, D)).astype(dtype) for _ in range(2))
    opts = dict(options, window=None)
    cfg = check_forward_outputs(*lean[0], q, k, v, opts, dtype)
    assert_grads_within_rule(lean[1], do, q, k, v, dtype=dtype,
                             steps=gradient_accum_steps(cfg), causal=opts["causal"],
                             scale=opts["scale"], window=None)


@settings(deadline=None)
@given(calls)
def test_lean_within_the_rules(args):
    """Every structure (one block, row passes, loops), both passes, grouped-query too: the
    rules, and the forward equal to the usual structure's (same steps, same order)."""
    (G, Gk), Lq, Lkv, D, nq, nkv, dtype, causal, scale = args
    options = dict(num_chunks_q=min(nq, Lq), num_chunks_kv=min(nkv, Lkv), causal=causal,
                   scale=scale)
    case = (G, Gk, Lq, Lkv, D, dtype, options)
    lean = _run(*case, lean=True)
    _assert_lean_within_rule(lean, case)
    for a, b in zip(_run(*case, lean=False)[0], lean[0]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mods", [dict(softcap=5.0), dict(alibi=True), dict(dropout=0.25)],
                         ids=["softcap", "alibi", "dropout"])
def test_lean_equals_usual_with_modifiers(mods):
    """With score modifiers and dropout: the forward equal to the usual structure's; the
    gradients the same float32 terms summed in another order (dq: per kv piece, not per step
    group; dk, dv: the matmul operands' layouts differ), so within a few float32 ulps of the
    largest gradient per accumulated chunk (5 q chunks, 4 kv chunks here)."""
    options = dict(num_chunks_q=5, num_chunks_kv=4, causal=True)
    usual = _run(2, 1, 70, 50, 8, "float32", options, lean=False, mods=mods)
    lean = _run(2, 1, 70, 50, 8, "float32", options, lean=True, mods=mods)
    for a, b in zip(usual[0], lean[0]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(usual[1], lean[1]):
        assert np.max(np.abs(a - b)) <= 2 * 5 * np.finfo(np.float32).eps * np.abs(a).max()


def _measure(G, Gk, Lq, Lkv, D, dtype, options, backward, lean):
    """The emulator's bytes beyond one pass's inputs and outputs (as
    ``test_memory_budget._flash_extra``), the modules given ``lean``."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((G, Lq, D)).astype(dtype)
    k, v = (rng.standard_normal((Gk, Lkv, D)).astype(dtype) for _ in range(2))
    if not backward:
        arrays = [q, k, v]
        result = run_graph(lambda *t: _call(pf.FlashAttention(**options, lean=lean), *t),
                           arrays)
    else:
        lse = rng.standard_normal((G, Lq)).astype(np.float32)
        arrays = [q.copy(), q, k, v, q.copy(), lse]
        result = run_graph(lambda *t: _call(pf.FlashAttentionGrad(**options, lean=lean), *t),
                           arrays)
    io = sum(a.nbytes for a in arrays) + sum(o.nbytes for o in result.outputs)
    return result.profile.peak_live_bytes - io


def test_lean_backward_holds_one_kv_piece():
    """The lean backward's float32 state is dq and one kv piece's ``[dv; dk]``: at 16 kv
    chunks (8 pieces of 2) it holds at least 7/8 of the usual full-length ``[dv; dk]`` less."""
    G, L, D = 1, 1024, 64
    options = dict(num_chunks_q=16, num_chunks_kv=16, causal=True)
    usual = _measure(G, G, L, L, D, "float16", options, True, lean=False)
    lean = _measure(G, G, L, L, D, "float16", options, True, lean=True)
    dkdv = 2 * G * L * D * 4
    assert lean <= usual - 7 * dkdv // 8, (usual, lean)


def _extra(G, L, D, backward, budget):
    """The emulator's bytes beyond inputs and outputs of the automatic choice at ``budget``."""
    from test_memory_budget import _flash_extra
    return _flash_extra(G, G, L, L, D, None, None, "float16", True, backward,
                        memory_budget=budget)[0]


@pytest.mark.parametrize("G, L, D", [(1, 16384, 64), (2, 2048, 256)])
def test_floor_budgets_are_met(G, L, D):
    """Issue 32's FlashAttention-2 floor: the automatic choice at 1.25 x its float32 state + 2
    MiB builds (lean structures) and stays within it on the emulator, forward and backward."""
    for backward, state in ((False, 4 * G * L * (D + 2)), (True, 4 * G * L * (D + 1))):
        budget = int(1.25 * state + 2 * MiB)
        choice = costmodel.choose(L, L, head_dim=D, groups=G, dtype="float16", causal=True,
                                  memory_budget=budget)
        assert choice.chosen.fits, choice.table()
        assert _extra(G, L, D, backward, budget) <= budget


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2)]), st.integers(20, 600),
       st.integers(20, 600), st.sampled_from([16, 32, 64]), st.integers(2, 10),
       st.integers(2, 10), st.sampled_from(["float16", "float32"]), st.booleans(),
       st.booleans())
def test_lean_bound_holds(groups, Lq, Lkv, D, nq, nkv, dtype, causal, backward):
    """The lean structures' memory bound is never below the emulator's measure."""
    G, Gk = groups
    cfg = pf.AttentionConfig.from_shapes((G, Lq, D), (Gk, Lkv, D), (Gk, Lkv, D), (dtype,) * 3,
                                         num_chunks_q=nq, num_chunks_kv=nkv, causal=causal,
                                         lean=True)
    options = dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=causal)
    measured = _measure(G, Gk, Lq, Lkv, D, dtype, options, backward, lean=True)
    bound = memory.flash_bytes(cfg.schedule, groups=G, kv_groups=Gk, head_dim=D, dtype=dtype,
                               backward=backward, steps=steps.loop_steps(cfg.schedule),
                               lean=not (steps.single_block(cfg.schedule)
                                         or steps.row_passes(cfg.schedule)))
    assert measured <= bound, (measured, bound)


def test_lean_option_is_checked():
    with pytest.raises(TypeError, match="lean"):
        pf.AttentionConfig.from_shapes((1, 8, 4), (1, 8, 4), (1, 8, 4), ("float32",) * 3,
                                       lean="yes")


def test_floor_budget_results_within_the_rules():
    """At FlashAttention-2's floor budgets (G = 2, L = 2048, D = 256, the floor shape small
    enough for a float64 reference here) the calls are right by the 2x / 3x rules: out and lse
    at the forward's floor, dq, dk, dv at the backward's (each pass built as its budget
    chooses). The 16K floor shape's lean structures are the same code, held to the rules on
    the drawn shapes above."""
    G, L, D = 2, 2048, 256
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((G, L, D)).astype("float16") for _ in range(4))
    fwd_budget = int(1.25 * 4 * G * L * (D + 2) + 2 * MiB)
    bwd_budget = int(1.25 * 4 * G * L * (D + 1) + 2 * MiB)
    opts = dict(causal=True, scale=None, window=None)
    out, lse, _ = run_flash(q, k, v, memory_budget=fwd_budget, **opts)
    cfg = check_forward_outputs(out, lse, q, k, v, opts, "float16")
    grads, _ = run_flash_grad(do, q, k, v, memory_budget=bwd_budget, **opts)
    cfg = pf.AttentionConfig.from_shapes(q.shape, k.shape, v.shape, ("float16",) * 3,
                                         causal=True, memory_budget=bwd_budget)
    assert cfg.lean_backward  # the floor needs the lean backward here
    assert_grads_within_rule(grads, do, q, k, v, dtype="float16",
                             steps=gradient_accum_steps(cfg), **opts)


def test_a_call_nothing_fits_takes_a_lean_fine_chunking():
    """L = 131072, G = 8, D = 128: the float32 state alone exceeds the default budget (a
    quarter of an IPU), so the default takes the least memory, which is a lean looped
    chunking within 2.5x of the float32 state each pass needs (forward acc | l | m, backward
    dq), not one kv chunk's row passes over 131072 columns."""
    G, L, D = 8, 131072, 128
    choice = pf.explain(L, L, head_dim=D, groups=G)
    chosen = choice.chosen
    assert not chosen.fits and chosen.num_chunks_kv > 1
    assert chosen.memory_forward <= 2.5 * 4 * G * L * (D + 2)
    assert chosen.memory_backward <= 2.5 * 4 * G * L * D
