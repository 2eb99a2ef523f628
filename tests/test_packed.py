"""Packed sequences: segment ids and flash_attn_varlen_func against each sequence run alone.

Forward under the 2x rule, gradients under the 3x rule (:mod:`popxl_flash.checks.tolerance`), padding
rows exact (out 0, lse -inf, gradient 0, never NaN, floating-point traps on), and executed
matmul FLOPs on the emulator's profile against the block-granular per-sequence work.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from attention_utils import FP_CHECKS, assert_grads_within_rule, assert_within_rule, run_graph
from packings import Packing, packings
from popxl_flash.graph import segments
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.api.functional import segmented_attention_grad
from popxl_flash.checks.tolerance import (gradient_accum_steps, naive_attention,
                                   probability_rounding_floor)

#: Masks of the core API with segment ids (static causal/window on indices).
CORE_MASKS = [dict(causal=True, window=None), dict(causal=False, window=None),
              dict(causal=True, window=(24, None)), dict(causal=False, window=(7, 3))]
#: Masks of the varlen API (per-sequence bottom-right alignment).
VARLEN_MASKS = [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(20, -1)),
                dict(causal=False, window_size=(5, 9))]

SEGMENT_KEYS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")

emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator run profile")


def packed_inputs(rng, packing, G, D, dtype):
    """q ``[G, total_q, D]``, k/v ``[G, total_k, D]`` standard normal in ``dtype``."""
    q = rng.standard_normal((G, packing.total_q, D)).astype(dtype)
    k = rng.standard_normal((G, packing.total_k, D)).astype(dtype)
    v = rng.standard_normal((G, packing.total_k, D)).astype(dtype)
    return q, k, v


def host_segments(packing):
    """The reference's segment keywords of a packing (ids and bottom-right positions)."""
    cu_q, cu_k = packing.cu_seqlens()
    qi, qp = pf.reference.varlen_segments(cu_q, packing.total_q)
    ki, kp = pf.reference.varlen_segments(cu_k, packing.total_k)
    return dict(q_segment_ids=qi, kv_segment_ids=ki, q_positions=qp, kv_positions=kp)


def check_forward(out, lse, q, k, v, ref, mask, dtype, cfg):
    """2x rule on out and lse; rows that see nothing exactly 0 / -inf."""
    ref_out, ref_lse = ref
    naive_out, _ = naive_attention(q, k, v, **mask)
    steps = cfg.num_chunks_kv + cfg.chunk_kv + q.shape[-1]
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    assert_within_rule("out", out, naive_out, ref_out, factor=2, dtype=dtype,
                       accum_steps=steps, magnitude=float(np.abs(v).max()),
                       parity=probability_rounding_floor(q, k, v, **mask))
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (out[empty] == 0).all() and not np.isnan(out).any()
    _, naive32_lse = naive_attention(*(a.astype(np.float32) for a in (q, k, v)), **mask)
    assert_within_rule("lse", lse, naive32_lse, ref_lse, factor=2, dtype="float32",
                       accum_steps=steps, magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))


def check_grads(grads, dout, q, k, v, refs, mask, dtype, cfg):
    """3x rule on dq, dk, dv; padding and unseen rows exactly 0, nothing NaN."""
    segs = {n: mask[n] for n in SEGMENT_KEYS if n in mask}
    visible = pf.reference.mask(q.shape[1], k.shape[1], causal=mask["causal"],
                                window=mask["window"], groups=q.shape[0], **segs)
    visible = np.broadcast_to(visible, (q.shape[0],) + visible.shape[-2:])  # [G, Lq, Lkv]
    seen_kv = visible.any(-2).reshape(k.shape[0], -1, k.shape[1]).any(1)  # [Gk, Lkv]
    unseen = (~visible.any(-1), ~seen_kv, ~seen_kv)  # rows of dq, dk, dv
    for name, g, zero in zip(("dq", "dk", "dv"), grads, unseen):
        assert np.isfinite(g).all(), f"{name} must be finite"
        assert (g[np.broadcast_to(zero, g.shape[:2])] == 0).all(), f"{name}: padding not 0"
    assert_grads_within_rule(grads, dout, q, k, v, dtype=dtype, steps=gradient_accum_steps(cfg),
                             refs=refs, **mask)


def core_case(packing, mask, chunks, dtype, seed, G=2, D=8):
    """flash_attention with segment ids (equal packing) vs each sequence alone."""
    rng = np.random.default_rng(seed)
    q, k, v = packed_inputs(rng, packing, G, D, dtype)
    qi, ki = packing.segment_ids()
    dout = rng.standard_normal(q.shape).astype(dtype)
    opts = dict(num_chunks_q=chunks[0], num_chunks_kv=chunks[1], **mask)
    segs = dict(q_segment_ids=qi, kv_segment_ids=ki)

    def build(do, q, k, v, qi, ki):
        ids = dict(q_segment_ids=qi, kv_segment_ids=ki)
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **opts, **ids)
        return [out, lse, *pf.flash_attention_grad(do, q, k, v, out, lse, **opts, **ids)]
    (out, lse, *grads), run = run_graph(build, [dout, q, k, v, qi, ki], fp_checks=FP_CHECKS)
    cu_q, cu_k = packing.cu_seqlens()
    ref = pf.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=mask["causal"],
                                        window=mask["window"])
    refs = pf.reference.attention_varlen_grad(dout, q, k, v, cu_q, cu_k, causal=mask["causal"],
                                              window=mask["window"])
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3, **opts)
    named = dict(scale=None, **mask, **segs)
    check_forward(out, lse, q, k, v, ref, named, dtype, cfg)
    check_grads(grads, dout, q, k, v, refs, named, dtype, cfg)
    return run, cfg


@settings(max_examples=30)
@given(packing=packings(max_total=400, equal=True), mask=st.sampled_from(CORE_MASKS),
       nq=st.integers(1, 12), nkv=st.integers(1, 12), dtype=st.sampled_from(["float16", "float32"]),
       seed=st.integers(0, 2 ** 16))
def test_segment_ids_equal_each_sequence_alone(packing, mask, nq, nkv, dtype, seed):
    """Equal q/kv packing with segment ids: causal = per-sequence causal, windows per sequence
    (aligned on the shared diagonal), padding exact."""
    core_case(packing, mask, (min(nq, packing.total_q), min(nkv, packing.total_k)), dtype, seed)


def varlen_case(packing, mask, chunks, dtype, seed, H=2, D=8, max_seqlen=None):
    """flash_attn_varlen_func vs each sequence alone; returns the run and config."""
    rng = np.random.default_rng(seed)
    q, k, v = packed_inputs(rng, packing, H, D, dtype)  # [H, total, D]
    dout = rng.standard_normal(q.shape).astype(dtype)
    cu_q, cu_k = packing.cu_seqlens()
    to_thd = (lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)))
    opts = dict(num_chunks_q=chunks[0], num_chunks_kv=chunks[1], **mask)
    max_q = max_seqlen or max(max(packing.q_lens), 1)
    max_k = max_seqlen or max(max(packing.kv_lens), 1)

    def build(do, q, k, v, cu_q, cu_k):
        out, lse = pf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                             **opts)
        return [out, lse, *varlen_grads(do, q, k, v, out, lse, cu_q, cu_k, opts)]
    (out, lse, *grads), run = run_graph(build, [to_thd(dout), to_thd(q), to_thd(k), to_thd(v),
                                                cu_q, cu_k], fp_checks=FP_CHECKS)
    assert out.shape == (packing.total_q, H, D) and lse.shape == (H, packing.total_q)
    causal, window = mask.get("causal", False), mask.get("window_size")
    ref = pf.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3,
                                      num_chunks_q=chunks[0], num_chunks_kv=chunks[1])
    named = dict(causal=causal, scale=None, window=window, **host_segments(packing))
    check_forward(out.transpose(1, 0, 2), lse, q, k, v, ref, named, dtype, cfg)
    refs = pf.reference.attention_varlen_grad(dout, q, k, v, cu_q, cu_k, causal=causal,
                                              window=window)
    check_grads(grads, dout, q, k, v, refs, named, dtype, cfg)
    return run, cfg


def varlen_grads(do, q, k, v, out, lse, cu_q, cu_k, opts):
    """Gradients of the varlen call in ``[H, total, D]``, through the segmented backward."""
    qi, qp = segments.varlen_segments(cu_q, q.shape[0])
    ki, kp = segments.varlen_segments(cu_k, k.shape[0])
    options = dict(num_chunks_q=opts["num_chunks_q"], num_chunks_kv=opts["num_chunks_kv"],
                   causal=opts.get("causal", False), window=opts.get("window_size"))
    groups = [t.transpose((1, 0, 2)) for t in (do, q, k, v, out)]
    return segmented_attention_grad(*groups, lse, qi, ki, qp, kp, **options)


@settings(max_examples=30)
@given(packing=packings(max_total=400), mask=st.sampled_from(VARLEN_MASKS),
       nq=st.integers(1, 12), nkv=st.integers(1, 12), dtype=st.sampled_from(["float16", "float32"]),
       seed=st.integers(0, 2 ** 16))
def test_varlen_equals_each_sequence_alone(packing, mask, nq, nkv, dtype, seed):
    """q and kv packings equal or different: causal/window bottom-right per sequence."""
    varlen_case(packing, mask, (min(nq, packing.total_q), min(nkv, packing.total_k)), dtype,
                seed)


def test_two_sequences_aligned_to_chunks_run_only_diagonal_blocks():
    """A block between two sequences runs no matmul: two sequences of 16 in chunks of 16,
    non-causal, execute exactly the 2 diagonal blocks in the forward (5 per block backward)."""
    if pf.BACKEND != "emulator":
        pytest.skip("emulator run profile")
    run, cfg = core_case(Packing((16, 16), (16, 16)), dict(causal=False, window=None), (2, 2),
                         "float32", 0, G=1, D=8)
    block = 2 * 16 * 16 * 8  # 2 FLOPs per multiply-add, one [16, 16, 8] matmul
    assert run.profile.matmul_flops == (2 + 5) * 2 * block


def blocks_with_visible(visible, chunk_q, chunk_kv):
    """Blocks of the chunk grid holding a visible pair: the block-granular per-sequence work."""
    Lq, Lkv = visible.shape
    nq, nkv = -(-Lq // chunk_q), -(-Lkv // chunk_kv)
    grid = np.zeros((nq * chunk_q, nkv * chunk_kv), bool)
    grid[:Lq, :Lkv] = visible
    return int(grid.reshape(nq, chunk_q, nkv, chunk_kv).any(axis=(1, 3)).sum())


@emulator_only
@settings(max_examples=20)
@given(packing=packings(max_total=900), chunk=st.sampled_from([16, 32, 64]),
       causal=st.booleans(), equal_api=st.booleans())
def test_executed_flops_track_block_granular_per_sequence_work(packing, chunk, causal,
                                                               equal_api):
    """Executed forward matmul FLOPs (the emulator's profile) are at most 1.5x the work of the
    blocks holding a visible pair (the block-granular per-sequence work; at least the visible
    pairs' own FLOPs): blocks between sequences or above a sequence's diagonal run no matmul.
    Core API with segment ids on equal packings, varlen otherwise."""
    G, D = 1, 4
    rng = np.random.default_rng(0)
    q, k, v = packed_inputs(rng, packing, G, D, "float32")
    nq, nkv = (-(-n // chunk) for n in (packing.total_q, packing.total_k))
    opts = dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=causal)
    if equal_api and packing.q_lens == packing.kv_lens and packing.q_pad == packing.kv_pad:
        qi, ki = packing.segment_ids()
        (out,), run = run_graph(lambda q, k, v, a, b: [pf.flash_attention(
            q, k, v, q_segment_ids=a, kv_segment_ids=b, **opts)], [q, k, v, qi, ki])
        segs = dict(q_segment_ids=qi, kv_segment_ids=ki)
    else:
        cu_q, cu_k = packing.cu_seqlens()
        to_thd = (lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)))
        (out,), run = run_graph(lambda q, k, v, a, b: [pf.flash_attn_varlen_func(
            q, k, v, a, b, 200, 200, **opts)], [to_thd(q), to_thd(k), to_thd(v), cu_q, cu_k])
        segs = host_segments(packing)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, ("float32",) * 3,
                                      num_chunks_q=nq, num_chunks_kv=nkv)
    visible = pf.reference.mask(packing.total_q, packing.total_k, causal=causal, **segs)[0]
    needed = blocks_with_visible(visible, cfg.chunk_q, cfg.chunk_kv)
    per_element = 4 * D * G  # QK^T and PV, 2 FLOPs per multiply-add
    block_work = per_element * cfg.chunk_q * cfg.chunk_kv * needed
    useful = per_element * int(visible.sum())
    # Diagonal blocks may run as two sub-blocks (the planner's split), so executed FLOPs can
    # fall below whole-block work, never below the visible pairs'.
    assert useful <= run.profile.matmul_flops <= 1.5 * block_work, (
        run.profile.matmul_flops, block_work)


@pytest.mark.parametrize("kv_rows", ["shared", "per_kv_group"])
def test_segment_ids_with_grouped_query_attention(kv_rows):
    """G = 4 q groups over Gk = 2 kv groups: kv ids of one row or of one row per kv group
    (here each kv group packs differently), against the reference (2x / 3x rules)."""
    G, Gk, D, dtype = 4, 2, 8, "float32"
    rng = np.random.default_rng(11)
    L = 40
    q = rng.standard_normal((G, L, D)).astype(dtype)
    k, v = (rng.standard_normal((Gk, L, D)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    packs = [Packing((9, 20, 7), (9, 20, 7), q_pad=4, kv_pad=4),
             Packing((30, 6), (30, 6), q_pad=4, kv_pad=4)]
    if kv_rows == "shared":
        qi, ki = packs[0].segment_ids()
    else:  # q group g reads kv group g // 2: its q ids follow that kv group's packing
        ids = [p.segment_ids()[0] for p in packs]
        qi, ki = np.concatenate([ids[0], ids[0], ids[1], ids[1]]), np.concatenate(ids)
    opts = dict(num_chunks_q=3, num_chunks_kv=4, causal=True, window=None)

    def build(do, q, k, v, qi, ki):
        ids = dict(q_segment_ids=qi, kv_segment_ids=ki)
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **opts, **ids)
        return [out, lse, *pf.flash_attention_grad(do, q, k, v, out, lse, **opts, **ids)]
    (out, lse, *grads), _ = run_graph(build, [dout, q, k, v, qi, ki], fp_checks=FP_CHECKS)
    named = dict(causal=True, scale=None, window=None, q_segment_ids=qi, kv_segment_ids=ki)
    ref = pf.reference.attention(q, k, v, **named)
    refs = pf.reference.attention_grad(dout, q, k, v, **named)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3, num_chunks_q=3,
                                      num_chunks_kv=4)
    check_forward(out, lse, q, k, v, ref, named, dtype, cfg)
    check_grads(grads, dout, q, k, v, refs, named, dtype, cfg)


@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False, window_size=(4, 2))])
def test_varlen_differentiable_through_pf_autodiff(mask):
    """A layer calling flash_attn_varlen_func, differentiated by pf.autodiff: the segment ids
    and positions are integer forward inputs of the flash graph without a gradient; q, k, v
    gradients equal each sequence's alone (3x rule), padding gets 0."""
    packing = Packing((7, 12, 3), (9, 5, 3), q_pad=2, kv_pad=3, empty=1)
    H, D, dtype = 2, 4, "float32"
    rng = np.random.default_rng(5)
    q, k, v = packed_inputs(rng, packing, H, D, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    cu_q, cu_k = packing.cu_seqlens()
    to_thd = (lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)))
    opts = dict(num_chunks_q=4, num_chunks_kv=3, **mask)

    def layer(q, k, v, cu_q, cu_k):
        return pf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, **opts)

    def build(q, k, v, cu_q, cu_k, dy):
        graph = pf.popxl.gcg().ir.create_graph(layer, q, k, v, cu_q, cu_k)
        info = pf.autodiff(graph)  # grads_required: the float inputs q, k, v
        call = pf.popxl.ops.call_with_info(graph, q, k, v, cu_q, cu_k)
        return pf.popxl.ops.call(info.graph, dy, inputs_dict=info.inputs_dict(call))
    grads, _ = run_graph(build, [to_thd(q), to_thd(k), to_thd(v), cu_q, cu_k, to_thd(dout)],
                         fp_checks=FP_CHECKS)
    causal, window = mask.get("causal", False), mask.get("window_size")
    refs = pf.reference.attention_varlen_grad(dout, q, k, v, cu_q, cu_k, causal=causal,
                                              window=window)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3,
                                      num_chunks_q=4, num_chunks_kv=3)
    named = dict(causal=causal, scale=None, window=window, **host_segments(packing))
    check_grads([g.transpose(1, 0, 2) for g in grads], dout, q, k, v, refs, named, dtype, cfg)


def test_varlen_grouped_query_attention():
    """flash_attn_varlen_func with Hq = 4 q heads over Hkv = 2 k/v heads, different q/kv
    packings, causal: each sequence alone (2x rule)."""
    packing = Packing((11, 5, 14), (8, 9, 14), q_pad=3, kv_pad=2)
    Hq, Hkv, D, dtype = 4, 2, 8, "float16"
    rng = np.random.default_rng(2)
    q = rng.standard_normal((Hq, packing.total_q, D)).astype(dtype)
    k, v = (rng.standard_normal((Hkv, packing.total_k, D)).astype(dtype) for _ in range(2))
    cu_q, cu_k = packing.cu_seqlens()
    to_thd = (lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)))
    (out, lse), _ = run_graph(lambda q, k, v, a, b: pf.flash_attn_varlen_func(
        q, k, v, a, b, 14, 14, causal=True, return_lse=True, num_chunks_q=4, num_chunks_kv=3),
        [to_thd(q), to_thd(k), to_thd(v), cu_q, cu_k], fp_checks=FP_CHECKS)
    ref = pf.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3, num_chunks_q=4,
                                      num_chunks_kv=3)
    named = dict(causal=True, scale=None, window=None, **host_segments(packing))
    check_forward(out.transpose(1, 0, 2), lse, q, k, v, ref, named, dtype, cfg)


def test_recompute_and_packed_qkv_forms_take_segment_ids():
    """Recompute mode reruns the same segmented forward (gradients bit-identical to stash
    mode), and the packed qkv forms equal the unpacked ones bit for bit."""
    packing = Packing((6, 10, 3), (6, 10, 3), q_pad=5, kv_pad=5)
    G, D, dtype = 2, 8, "float32"
    rng = np.random.default_rng(4)
    q, k, v = packed_inputs(rng, packing, G, D, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    qi, ki = packing.segment_ids()
    opts = dict(num_chunks_q=3, num_chunks_kv=4, causal=True)

    def build(do, q, k, v, qi, ki):
        ids = dict(q_segment_ids=qi, kv_segment_ids=ki)
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **opts, **ids)
        stash = pf.flash_attention_grad(do, q, k, v, out, lse, **opts, **ids)
        recompute = pf.flash_attention_grad(do, q, k, v, **opts, **ids)
        qkv = pf.popxl.ops.concat([t.reshape((1,) + t.shape) for t in (q, k, v)], axis=0)
        packed_out = pf.flash_attention_qkv_packed(qkv, **opts, **ids)
        dqkv = pf.flash_attention_qkv_packed_grad(do, qkv, **opts, **ids)
        return [out, *stash, *recompute, packed_out, dqkv]
    (out, *grads, packed_out, dqkv), _ = run_graph(build, [dout, q, k, v, qi, ki],
                                                   fp_checks=FP_CHECKS)
    for a, b in zip(grads[:3], grads[3:]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(packed_out, out)
    np.testing.assert_array_equal(dqkv, np.stack(grads[:3]))


@settings(max_examples=10)
@given(cu=st.lists(st.integers(0, 24), min_size=2, max_size=6), side=st.sampled_from(
    ["q", "k", "both"]), causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_decreasing_offsets_make_every_row_padding(cu, side, causal, seed):
    """Offsets that decrease anywhere (in cu_seqlens_q, cu_seqlens_k or both) describe no
    packing: the device makes every row padding (out 0, lse -inf, gradients 0, no NaN, traps
    on), and the reference says the same; non-decreasing offsets are unaffected (they run the
    sequences, checked against the reference under the rules)."""
    total, H, D = 24, 2, 8
    cu = np.array(cu, np.int32)
    good = np.sort(cu)
    cu_q, cu_k = {"q": (cu, good), "k": (good, cu), "both": (cu, cu)}[side]
    rng = np.random.default_rng(seed)
    q, k, v = packed_inputs(rng, Packing((total,), (total,)), H, D, "float32")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    to_thd = (lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)))
    opts = dict(num_chunks_q=3, num_chunks_kv=2, causal=causal)

    def build(do, q, k, v, cu_q, cu_k):
        out, lse = pf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, total, total,
                                             return_lse=True, **opts)
        return [out, lse, *varlen_grads(do, q, k, v, out, lse, cu_q, cu_k, opts)]
    (out, lse, *grads), _ = run_graph(build, [to_thd(dout), to_thd(q), to_thd(k), to_thd(v),
                                              cu_q, cu_k], fp_checks=FP_CHECKS)
    ref_out, ref_lse = pf.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    refs = pf.reference.attention_varlen_grad(dout, q, k, v, cu_q, cu_k, causal=causal)
    packing_ok = pf.reference.is_packing(cu_q) and pf.reference.is_packing(cu_k)
    assert packing_ok == bool(np.all(np.diff(cu) >= 0))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    if not packing_ok:
        assert np.isneginf(lse).all() and (out == 0).all() and not np.isnan(lse).any()
        assert all((g == 0).all() for g in grads)
        assert (ref_out == 0).all() and all((r == 0).all() for r in refs)
        for cu_s in (cu_q, cu_k):
            ids, pos = pf.reference.varlen_segments(cu_s, total)
            assert (ids == -1).all() if not pf.reference.is_packing(cu_s) else True
    else:
        np.testing.assert_allclose(out.transpose(1, 0, 2), ref_out, atol=1e-5)
        for g, r in zip(grads, refs):
            np.testing.assert_allclose(g, r, atol=1e-4)
