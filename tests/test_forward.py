"""Forward: flash_attention against the float64 reference, on whatever backend is selected."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import popxl_flash as pf
from popxl_flash import popxl
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.plan.schedule import SKIP, WHOLE
from popxl_flash.plan import counts, steps
from popxl_flash.plan.steps import loop_steps
from popxl_flash.checks.tolerance import probability_rounding_floor
from popxl_flash.checks.naive import naive_attention as naive_attention_graph

from attention_utils import (EPS32, FLASH_ATTN_SEQLENS, FP_CHECKS, assert_within_rule,
                             naive_attention, random_qkv, run_flash, run_graph, suite_case,
                             suite_parametrize)

ops = popxl.ops
emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator",
                                   reason="profile counts are an emulator feature")

#: Bound on nq * nkv drawn by the properties: keeps an example's loop count (and the emulator's
#: run time) small while each chunk count alone still ranges over all of 1..L.
MAX_BLOCKS = 256


@st.composite
def attention_cases(draw, max_len=300, max_dim=80):
    """Shapes, chunk counts and options over the whole documented space.

    ``kv_groups`` is a divisor of G: multi-head (Gk = G, where shrinking leads), grouped-query
    and multi-query (Gk = 1) attention.
    """
    G = draw(st.integers(1, 4))
    Gk = draw(st.sampled_from([d for d in range(G, 0, -1) if G % d == 0]))
    Lq = draw(st.integers(1, max_len))
    Lkv = draw(st.integers(1, max_len))
    D = draw(st.integers(1, max_dim))
    nq = draw(st.integers(1, Lq))
    nkv = draw(st.integers(1, max(1, min(Lkv, MAX_BLOCKS // nq))))
    # narrow windows (a few keys) are where blocks turn partial or skip: mix them in
    side = st.one_of(st.none(), st.integers(-1, 8), st.integers(-1, max(Lq, Lkv)))
    window = draw(st.one_of(st.none(), st.tuples(side, side)))
    return dict(
        shape=(G, Lq, Lkv, D),
        kv_groups=Gk,
        options=dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=draw(st.booleans()),
                     scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))), window=window),
        dtype=draw(st.sampled_from(["float32", "float16"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_forward(case):
    """Run one case and hold out and lse to the tolerance rule; return the session."""
    G, Lq, Lkv, D = case["shape"]
    opts, dtype = case["options"], case["dtype"]
    q, k, v = random_qkv(np.random.default_rng(case["seed"]), G, Lq, Lkv, D, dtype,
                         case["kv_groups"])
    out, lse, session = run_flash(q, k, v, **opts)
    cfg = check_forward_outputs(out, lse, q, k, v, opts, dtype)
    return session, cfg


def check_forward_outputs(out, lse, q, k, v, opts, dtype):
    """Hold a forward's out and lse to the tolerance rule (2x a naive same-precision
    attention's error against float64, plus the floors); return the config."""
    G, Lq, D = q.shape
    ref_out, ref_lse = pf.reference.attention(q, k, v, causal=opts["causal"],
                                              scale=opts["scale"], window=opts["window"])
    naive_out, _ = naive_attention(q, k, v, causal=opts["causal"], scale=opts["scale"],
                                   window=opts["window"])
    assert out.dtype == np.dtype(dtype) and out.shape == (G, Lq, D)
    assert lse.dtype == np.float32 and lse.shape == (G, Lq)
    assert np.isfinite(out).all(), "out must be finite for finite inputs"
    # Rows that see nothing: exactly 0 output and -inf lse, like the reference.
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert not np.isnan(lse).any()
    assert (out[empty] == 0).all()
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3, **opts)
    steps = cfg.num_chunks_kv + cfg.chunk_kv + D
    rounded_p = probability_rounding_floor(q, k, v, causal=opts["causal"], scale=opts["scale"],
                                           window=opts["window"])
    assert_within_rule("out", out, naive_out, ref_out, factor=2, dtype=dtype,
                       accum_steps=steps, magnitude=float(np.abs(v).max()), parity=rounded_p)
    # lse is float32 whatever the input dtype (the seed kept it in float16): its baseline is a
    # naive attention in float32 on the same (float16-valued) inputs, whose products are exact.
    _, naive32_lse = naive_attention(*(a.astype(np.float32) for a in (q, k, v)),
                                     causal=opts["causal"], scale=opts["scale"],
                                     window=opts["window"])
    assert_within_rule("lse", lse, naive32_lse, ref_lse, factor=2, dtype="float32",
                       accum_steps=steps, magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))
    return cfg


@given(attention_cases())
def test_forward_matches_reference(case):
    check_forward(case)


@pytest.mark.parametrize("seed", [1, 147, 189, 246, 270, 304])
def test_tiny_float16_case_within_the_rule(seed):
    """G = 1, Lq = 1, Lkv = 9, D = 1, float16, scale 0.05, one chunk each: one output entry of
    nine nearly equal probabilities. Flash rounds them to float16 before the P V matmul, as the
    naive attention does; the naive error is then a single sample that can be ten times below
    its typical size (seed 1: flash 1.1e-4, naive 1.2e-5, the 2x bound 5.4e-5). The rule takes
    the larger of 2x naive and the probability-rounding bound (1.98e-4 here;
    popxl_flash.checks.tolerance), which these seeds of a 400-seed scan needed."""
    check_forward(dict(shape=(1, 1, 9, 1), kv_groups=1, dtype="float16", seed=seed,
                       options=dict(num_chunks_q=1, num_chunks_kv=1, causal=False, scale=0.05,
                                    window=None)))


@given(attention_cases(max_len=64, max_dim=16), st.data())
def test_result_independent_of_chunking(case, data):
    """The same float32 inputs with two different chunkings agree to accumulation error."""
    G, Lq, Lkv, D = case["shape"]
    opts = case["options"]
    q, k, v = random_qkv(np.random.default_rng(case["seed"]), G, Lq, Lkv, D, "float32",
                         case["kv_groups"])
    other = dict(opts, num_chunks_q=data.draw(st.integers(1, Lq)),
                 num_chunks_kv=data.draw(st.integers(1, Lkv)))
    out_a, lse_a, _ = run_flash(q, k, v, **opts)
    out_b, lse_b, _ = run_flash(q, k, v, **other)
    np.testing.assert_array_equal(np.isneginf(lse_a), np.isneginf(lse_b))
    # Each result is within 4 * (n + c + D) * eps32 * max|v| of the exact one (see
    # attention_utils); with n + c <= Lkv + 1 for any chunking, their difference is within twice.
    tol = 8 * (Lkv + 1 + D) * np.finfo(np.float32).eps * float(np.abs(v).max())
    np.testing.assert_allclose(out_a, out_b, rtol=0, atol=tol)


@pytest.mark.parametrize("L", [256, 1024])
def test_seed_cases_packed(L):
    """The seed op's own test shapes: qkv [3, 4, L, 128], chunks (16, 16) vs (1, 1), scale 1."""
    rng = np.random.default_rng(L)
    # The seed's callers pre-scale q; with scale=1 keep scores O(1) by scaling the inputs.
    qkv = (rng.standard_normal((3, 4, L, 128)) / 128 ** 0.25).astype(np.float32)
    results = {}
    for chunks in [(16, 16), (1, 1)]:
        nq, nkv = chunks
        (out,), _ = run_graph(lambda t, nq=nq, nkv=nkv: (pf.flash_attention_qkv_packed(
            t, num_chunks_q=nq, num_chunks_kv=nkv, scale=1.0),), [qkv], fp_checks=FP_CHECKS)
        results[chunks] = out
    ref, _ = pf.reference.attention(qkv[0], qkv[1], qkv[2], causal=True, scale=1.0)
    naive, _ = naive_attention(qkv[0], qkv[1], qkv[2], causal=True, scale=1.0, window=None)
    for chunks, out in results.items():
        assert_within_rule(f"out{chunks}", out, naive, ref, factor=2, dtype="float32",
                           accum_steps=chunks[1] + L // chunks[1] + 128,
                           magnitude=float(np.abs(qkv[2]).max()))


def test_bottom_right_alignment_and_empty_rows():
    """Lq > Lkv causal: the first Lq - Lkv rows see nothing -> out 0, lse -inf, no NaN."""
    q, k, v = random_qkv(np.random.default_rng(0), 2, 7, 3, 4, "float32")
    out, lse, _ = run_flash(q, k, v, num_chunks_q=3, num_chunks_kv=2)
    assert np.isneginf(lse[:, :4]).all() and np.isfinite(lse[:, 4:]).all()
    assert (out[:, :4] == 0).all()
    ref, ref_lse = pf.reference.attention(q, k, v)
    # float32, at most 3 keys and D = 4: 4 * (n + c + D) * eps32 * max|.| (attention_utils)
    tol = 4 * (2 + 2 + 4) * EPS32 * max(np.abs(v).max(), np.abs(ref_lse[:, 4:]).max())
    np.testing.assert_allclose(out, ref, atol=tol)
    np.testing.assert_allclose(lse[:, 4:], ref_lse[:, 4:], atol=tol)
    # Row 4 sees only key 0 (bottom-right alignment): its output is exactly v[:, 0] (p = 1).
    np.testing.assert_array_equal(out[:, 4], v[:, 0])


def test_window_without_causal():
    """A two-sided window, non-causal, Lq < Lkv."""
    q, k, v = random_qkv(np.random.default_rng(1), 1, 9, 20, 8, "float32")
    out, lse, _ = run_flash(q, k, v, num_chunks_q=2, num_chunks_kv=3, causal=False,
                            window=(2, 1))
    ref, ref_lse = pf.reference.attention(q, k, v, causal=False, window=(2, 1))
    # float32, 3 kv chunks of 7, D = 8: 4 * (n + c + D) * eps32 * max|.| (attention_utils)
    tol = 4 * (3 + 7 + 8) * EPS32 * max(np.abs(v).max(), np.abs(ref_lse).max())
    np.testing.assert_allclose(out, ref, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, atol=tol)


@emulator_only
@given(attention_cases(max_len=96, max_dim=16))
def test_executed_flops_and_iterations_equal_planner_count(case):
    """No hidden work: the profile's matmul FLOPs are exactly the planner's executed count for G
    q groups (so no block marked skip runs a matmul, a split block skips its invisible quadrant,
    and grouped-query attention, Gk < G, executes exactly the FLOPs of multi-head attention on
    the same q; a pass of one block runs it whole, unsplit), and the steps are exactly one per
    visited block and one more per split block (its second sub-block): loop iterations, and
    one inline step per group of one step (no loop); none for a pass of one block, a
    straight line, or for row passes (one kv chunk), whose matmuls run on the columns each q
    chunk sees. No skip iterations, whatever the mask."""
    session, cfg = check_forward(case)
    schedule = cfg.schedule
    flops = counts.pass_flops(schedule, cfg.head_dim, cfg.groups)
    assert session.profile.matmul_flops == flops
    if steps.row_passes(schedule):
        assert session.profile.loop_iterations == loop_steps(schedule) == 0
        assert flops == 4 * cfg.head_dim * cfg.groups * steps.row_pass_cells(schedule)
        assert steps.row_pass_cells(schedule) <= schedule.chunk_q * schedule.nq * cfg.kv_len
        return
    split = int((schedule.split[schedule.kind != SKIP] != WHOLE).sum())
    assert session.profile.loop_iterations == loop_steps(schedule)
    if steps.single_block(schedule):
        assert loop_steps(schedule) == 0
        assert flops == 4 * cfg.head_dim * cfg.groups * cfg.q_len * cfg.kv_len
    else:
        inline = sum(steps.runs_inline(g) for g in steps.step_groups(schedule))
        assert loop_steps(schedule) + inline == schedule.visited_blocks + split
        assert flops == schedule.forward_flops(cfg.head_dim, cfg.groups).executed
    assert len(schedule.block_list("q_major")) == schedule.visited_blocks


@emulator_only
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_peak_memory_far_below_naive(dtype):
    """L = 2048, D = 64, 16 x 16 chunks of 128: peak live bytes at least 10x below a naive PopXL
    attention (the automatic choice spends memory on fewer supersteps, up to its budget).

    Naive holds two float32 [L, L] score/probability matrices (32 MiB) plus the [L, L] mask and
    q, k, v. Flash's peak is in the loop phase: q, k, v (loop-invariant, live for the whole
    loop), the float32 state (m, l, acc [L, D]) and O(chunk^2) blocks. The pass runs several
    loops (one per step group) over the same q, k, v and state; under PopART's AliasZeroCopy
    (the emulator's copy model) every loop shares them with the parent, so they are held once
    (measured: 20.4x float16, 14.4x float32; a model that copied them into each loop held them
    twice while a loop that is not their last reader ran: float32 8.6x).
    """
    q, k, v = random_qkv(np.random.default_rng(2), 1, 2048, 2048, 64, dtype)
    _, _, flash_session = run_flash(q, k, v, num_chunks_q=16, num_chunks_kv=16)
    (naive_out,), naive_session = run_graph(
        lambda q, k, v: (naive_attention_graph(q, k, v),), [q, k, v])
    flash_peak = flash_session.profile.peak_live_bytes
    naive_peak = naive_session.profile.peak_live_bytes
    assert naive_peak >= 10 * flash_peak, (flash_peak, naive_peak)


@emulator_only
def test_graph_size_independent_of_length_and_chunks():
    """Loops, not unrolling: the IR's op count does not grow with L or the chunk counts. It
    depends only on which step groups the pass holds (sub-block shape, masked or not: one loop
    body each): equal for the same structure, and bounded whatever the shape."""
    from popxl_flash.emulator import count_ops

    def op_count(L, nq, nkv, **mask):
        ir = popxl.Ir()
        with ir.main_graph:
            q = popxl.variable(np.zeros((2, L, 8), np.float32))
            pf.flash_attention(q, q, q, num_chunks_q=nq, num_chunks_kv=nkv, **mask)
        return count_ops(ir)

    same = {op_count(L, L // 16, L // 16) for L in (64, 256, 1024)}
    assert len(same) == 1, same
    window = {op_count(L, L // 8, L // 8, window=(20, 3)) for L in (256, 1024)}
    assert len(window) == 1, window
    odd = [op_count(L, nq, nkv) for L, nq, nkv in [(40, 3, 3), (300, 7, 11), (999, 20, 17)]]
    assert max(odd) <= 2 * max(same | window), (odd, same, window)


@emulator_only
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False, window=(20, 3)),
                                  dict(causal=False)])
def test_loop_bodies_are_branch_free_and_hold_their_tables_once(mask):
    """Without segment ids no graph holds a conditional: one loop per step group, the state
    updated in place. Each masked loop body holds its group's pattern table as its only bool
    constant, with no pattern twice, and the forward's and the backward's bodies hold the same
    patterns (their step orders differ)."""
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.variable(np.zeros((2, 300, 8), np.float16))
        out, lse = pf.flash_attention(q, q, q, num_chunks_q=5, num_chunks_kv=6,
                                      return_lse=True, **mask)
        pf.flash_attention_grad(q, q, q, q, out, lse, num_chunks_q=5, num_chunks_kv=6, **mask)
    kinds = {op.kind for g in ir._graphs for op in g._ops}
    assert "conditional" not in kinds and "repeat" in kinds
    patterns = {"fwd": set(), "bwd": set()}
    for caller in ir._graphs:
        side = "bwd" if caller.name.startswith("FlashAttentionGrad") else "fwd"
        for op in caller._ops:
            if op.kind != "repeat":
                continue
            masks = [c for c in op.attrs["graph"].constants if c.dtype == popxl.bool]
            assert len(masks) <= 1
            for table in masks:
                rows = {p.tobytes() for p in table._data}
                assert len(rows) == len(table._data)  # deduplicated
                patterns[side] |= {(table._data.shape[1:], r) for r in rows}
    assert patterns["fwd"] == patterns["bwd"]
    assert bool(patterns["fwd"]) == (mask["causal"] or "window" in mask)


@emulator_only
def test_chunking_flop_ratio_at_2048():
    """Causal L = 2048, G = 2, D = 64 with 16 x 16 chunks: executed / useful FLOPs <= 1.035, and
    the profile counts exactly the planner's executed FLOPs. 16 x 16 chunks of 128: 120 full
    blocks of 128^2 cells and 16 diagonal blocks split into a 64 x 64 and a 64 x 128 sub-block,
    2,162,688 cells for 2048 * 2049 / 2 = 2,098,176 visible ones (ratio 1.0307; whole diagonal
    blocks would give 2176 / 2049 = 1.062)."""
    q, k, v = random_qkv(np.random.default_rng(3), 2, 2048, 2048, 64, "float16")
    _, _, session = run_flash(q, k, v, num_chunks_q=16, num_chunks_kv=16)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, ("float16",) * 3,
                                      num_chunks_q=16, num_chunks_kv=16)
    flops = cfg.schedule.forward_flops(64, 2)
    assert (cfg.num_chunks_q, cfg.num_chunks_kv) == (16, 16)
    assert flops.ratio <= 1.035
    assert flops.executed * 2_098_176 == flops.useful * 2_162_688
    assert session.profile.matmul_flops == flops.executed
    assert cfg.schedule.visited_blocks == 136  # + 16 second sub-blocks of the diagonal
    assert session.profile.loop_iterations == loop_steps(cfg.schedule) == 152


@suite_parametrize(FLASH_ATTN_SEQLENS)
def test_flash_attn_suite_seqlens(Lq, Lkv, dtype, mask):
    """FlashAttention's sequence-length pairs with automatic chunking, under the 2x rule."""
    check_forward(suite_case(Lq, Lkv, dtype, mask, seed=Lq * Lkv))


@emulator_only
def test_window_work_grows_linearly_with_length():
    """The inner loop runs only over the kv chunks a q chunk visits: with a fixed window,
    doubling L doubles the executed ops (the causal loop nest would quadruple them)."""
    def ops_executed(L, **mask):
        q, k, v = random_qkv(np.random.default_rng(4), 1, L, L, 8, "float32")
        _, _, run = run_flash(q, k, v, num_chunks_q=L // 32, num_chunks_kv=L // 32, **mask)
        return run.profile.ops_executed

    window = dict(causal=True, window=(64, None))
    # T = 3 iterations per q chunk at every L: ops = a + nq * b + (work of the visited blocks),
    # and the visited blocks per q chunk are 3 except the first two chunks: the doubling ratio
    # is 2 + O(1/nq) (measured 2.02). The full causal nest runs nq^2 / 2 iterations: ~4x.
    assert ops_executed(1024, **window) < 2.1 * ops_executed(512, **window)
    assert ops_executed(1024) > 3.5 * ops_executed(512)


@pytest.mark.parametrize("scale", [1e4, 1e30, -1e30])
def test_extreme_scale_is_exact_argmax(scale):
    """|scale| so large the softmax is one-hot (score gaps x scale >> 100): out is exactly the
    v row of the arg-max score and lse the max score, as long as scores stay finite in float32.

    float32 products of O(1) inputs have relative error ~1e-7, so the arg-max agrees with the
    float64 reference unless two scores are within 1e-7 of each other (not the case for this
    seed); lse ~ |scale| is then exact to float32 rounding (relative 2^-23 per operation).
    """
    q, k, v = random_qkv(np.random.default_rng(8), 1, 6, 9, 4, "float32")
    for causal in (True, False):
        out, lse, _ = run_flash(q, k, v, num_chunks_q=2, num_chunks_kv=4, causal=causal,
                                scale=scale)
        ref, ref_lse = pf.reference.attention(q, k, v, causal=causal, scale=scale)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        np.testing.assert_array_equal(out, ref.astype(np.float32))
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_module_graph_created_once_called_twice():
    """The documented module pattern: one graph from ``ir.create_graph(FlashAttention(...))``,
    called with ``ops.call`` for two layers' inputs."""
    rng = np.random.default_rng(9)
    a = random_qkv(rng, 2, 20, 20, 8, "float32")
    b = random_qkv(rng, 2, 20, 20, 8, "float32")

    def build(*ts):
        graph = popxl.gcg().ir.create_graph(pf.FlashAttention(num_chunks_q=3, window=(4, None)),
                                            *ts[:3])
        return [*ops.call(graph, *ts[:3]), *ops.call(graph, *ts[3:])]
    (out_a, lse_a, out_b, lse_b), _ = run_graph(build, [*a, *b], fp_checks=FP_CHECKS)
    for (q, k, v), out, lse in ((a, out_a, lse_a), (b, out_b, lse_b)):
        ref, ref_lse = pf.reference.attention(q, k, v, window=(4, None))
        # float32, one kv chunk of 20, D = 8: 4 * (n + c + D) * eps32 * max|.| (attention_utils)
        tol = 4 * (1 + 20 + 8) * EPS32 * max(np.abs(v).max(), np.abs(ref_lse).max())
        np.testing.assert_allclose(out, ref, atol=tol)
        np.testing.assert_allclose(lse, ref_lse, atol=tol)
