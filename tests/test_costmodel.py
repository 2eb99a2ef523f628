"""The cost model of the automatic chunk choice (popxl_flash.plan.costmodel, pf.explain)."""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash.plan import costmodel, schedule, steps
from popxl_flash.graph import segments
from popxl_flash.api import functional
from popxl_flash.plan.config import AttentionConfig

from attention_utils import host_block_classes, random_qkv, run_flash, run_flash_grad, run_graph
from test_forward import emulator_only


def _auto(L, causal=True, G=2, D=64, dtype="float16", window=None):
    shape = (G, L, D)
    return AttentionConfig.from_shapes(shape, shape, shape, (dtype,) * 3, causal=causal,
                                       window=window)


@pytest.mark.parametrize("L, causal, chunk", [(2048, True, 128), (4096, True, 256),
                                              (1024, True, 64), (2048, False, 256)])
def test_automatic_choice(L, causal, chunk):
    """G = 2, D = 64, float16: the longest chunk within the 3.5% FLOP budget and the O(L) rule
    (overheads dominate the FLOP term at this size)."""
    cfg = _auto(L, causal)
    assert (cfg.chunk_q, cfg.chunk_kv) == (chunk, chunk)
    choice = pf.explain(L, L, head_dim=64, groups=2, causal=causal)
    assert choice.chosen.chunk_q == chunk and choice.chosen.eligible
    for c in choice.candidates:
        assert c.flop_ratio == pf.plan(L, L, c.chunk_q, c.chunk_kv,
                                       causal=causal).forward_flops(64, 2).ratio
        if c.eligible and c is not choice.chosen:
            assert c.seconds > choice.chosen.seconds
    assert "chosen: " in choice.table()


def test_causal_done_checks_by_the_model():
    """The automatic chunks meet the chunk-choice bounds: FLOP ratio <= 1.035 at L = 2048 and the
    forward/backward op estimates at L = 4096 within 0.75 x the old loop nest's counts."""
    assert _auto(2048).schedule.forward_flops(64, 2).ratio <= 1.035
    chosen = pf.explain(4096, 4096, head_dim=64, groups=2).chosen
    assert chosen.ops_forward <= 0.75 * 25_481 and chosen.ops_backward <= 0.75 * 36_102


def test_memory_rules():
    """A chunk as long as L would make flash as heavy as naive: the O(L) rule refuses it; a
    working set beyond the IPU's usable tile memory is flagged, and the smallest is chosen."""
    choice = pf.explain(512, 512, head_dim=64, groups=2, causal=False)
    whole = [c for c in choice.candidates if c.chunk_q == 512][0]
    assert not whole.linear_memory and not whole.eligible and choice.chosen.chunk_q < 512
    huge = pf.explain(65536, 65536, head_dim=128, groups=512)
    assert not any(c.fits for c in huge.candidates)
    assert huge.chosen.working_set_bytes == min(c.working_set_bytes for c in huge.candidates)
    assert "NOTHING FITS" in huge.reason and "NO" in huge.table()
    usable = costmodel.TILES * costmodel.TILE_MEMORY_BYTES * costmodel.USABLE_MEMORY_FRACTION
    assert huge.chosen.working_set_bytes > usable


def test_fixed_axis_and_validation():
    """A given chunk count fixes that axis; bad arguments name themselves."""
    choice = pf.explain(1000, 3000, head_dim=32, num_chunks_q=10)
    assert all(c.chunk_q == 100 for c in choice.candidates)
    with pytest.raises(ValueError, match="num_chunks_kv"):
        pf.explain(64, 64, head_dim=8, num_chunks_kv=0)
    with pytest.raises(TypeError, match="bfloat16"):
        pf.explain(64, 64, head_dim=8, dtype="bfloat16")


@emulator_only
@pytest.mark.parametrize("L, chunks, mask", [
    (96, (3, 6), dict(causal=True)),
    (130, (5, 4), dict(causal=False, window=(20, 7))),
    (64, (4, 4), dict(causal=False)),
])
def test_model_ops_match_the_emulator(L, chunks, mask):
    """The counted op model estimates the emulator's ops executed within 5% (forward and
    backward; padding ops are left out), and the iteration count is exact."""
    q, k, v = random_qkv(np.random.default_rng(0), 2, L, L, 16, "float16")
    options = dict(num_chunks_q=chunks[0], num_chunks_kv=chunks[1], **mask)
    _, _, fwd = run_flash(q, k, v, **options)
    _, both = run_flash_grad(q, q, k, v, **options)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, ("float16",) * 3, **options)
    model = costmodel.evaluate(L, L, cfg.chunk_q, cfg.chunk_kv, head_dim=16, groups=2,
                               dtype="float16", causal=mask["causal"], window=cfg.window)
    backward_ops = both.profile.ops_executed - fwd.profile.ops_executed
    assert abs(model.ops_forward - fwd.profile.ops_executed) <= 0.05 * fwd.profile.ops_executed
    assert abs(model.ops_backward - backward_ops) <= 0.05 * backward_ops
    assert model.iterations == fwd.profile.loop_iterations == steps.loop_steps(cfg.schedule)


@emulator_only
@pytest.mark.parametrize("L, G, Gk, chunks, mask", [
    (512, 1, 1, (4, 4), dict(causal=True)),
    (256, 4, 2, (2, 2), dict(causal=True)),
    (300, 2, 2, (3, 5), dict(causal=False, window=(48, 16))),
    (256, 2, 2, (2, 4), dict(causal=False)),
])
def test_model_bytes_copied_equal_the_emulator(L, G, Gk, chunks, mask):
    """The model's lowering copies follow the emulator's copy model (PopART's rules: operands
    and by-reference state aliased, the carried step counters and LoopOpx's control copies per
    loop and step) exactly, kind by kind, forward and backward."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((G, L, 64)).astype(np.float16)
    k, v = (rng.standard_normal((Gk, L, 64)).astype(np.float16) for _ in range(2))
    options = dict(num_chunks_q=chunks[0], num_chunks_kv=chunks[1], **mask)
    _, _, fwd = run_flash(q, k, v, **options)
    _, both = run_flash_grad(q, q, k, v, **options)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, ("float16",) * 3, **options)
    forward = fwd.profile.bytes_copied_by_kind
    backward = {kind: both.profile.bytes_copied_by_kind[kind] - n
                for kind, n in forward.items()}
    for pass_, measured in (("forward", forward), ("backward", backward)):
        model = costmodel.pass_copies(cfg.schedule, groups=G, kv_groups=Gk, head_dim=64,
                                      dtype="float16", backward=pass_ == "backward")
        assert model == measured, pass_
    model = costmodel.evaluate(L, L, cfg.chunk_q, cfg.chunk_kv, head_dim=64, groups=G,
                               kv_groups=Gk, dtype="float16", causal=mask["causal"],
                               window=cfg.window)
    assert model.bytes_copied_forward == fwd.profile.bytes_copied
    assert model.bytes_copied_backward == both.profile.bytes_copied - fwd.profile.bytes_copied


@emulator_only
@pytest.mark.parametrize("L, G, chunks, mask, lengths", [
    (256, 2, (4, 4), dict(causal=True), (100, 156)),
    (256, 2, (4, 4), dict(causal=False), (64, 64, 100, 20)),
    (384, 1, (6, 6), dict(causal=True), (128, 200, 40)),
    (256, 2, (2, 4), dict(causal=False, window=(30, 5)), (130, 100)),
])
def test_model_segment_copies_equal_the_emulator(L, G, chunks, mask, lengths):
    """With segment ids the steps run under conditionals: the model's branch copies (IfOpx:
    every input and output of the taken branch, at each level; skipped, runtime-full and masked
    blocks) equal the emulator's, kind by kind, given the blocks' runtime classes. The cases
    hold skipped, full and masked blocks, padding, and masked and unmasked step groups."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((G, L, 64)).astype(np.float16) for _ in range(3))
    ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    ids = np.concatenate([ids, np.full(L - len(ids), -1, np.int32)])[None]  # [1, L]
    options = dict(num_chunks_q=chunks[0], num_chunks_kv=chunks[1], **mask)
    seg = dict(q_segment_ids=ids, kv_segment_ids=ids)

    def forward(q, k, v, a, b):
        return pf.flash_attention(q, k, v, return_lse=True, q_segment_ids=a, kv_segment_ids=b,
                                  **options)

    def both(do, q, k, v, a, b):
        out, lse = forward(q, k, v, a, b)
        return pf.flash_attention_grad(do, q, k, v, out, lse, q_segment_ids=a,
                                       kv_segment_ids=b, **options)

    _, fwd = run_graph(forward, [q, k, v, ids, ids])
    _, run = run_graph(both, [q, q, k, v, ids, ids])
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, ("float16",) * 3, **options)
    cfg = cfg.with_segments(*(pf.popxl.TensorSpec(a.shape, pf.popxl.int32)
                              for a in seg.values()))
    classes = host_block_classes(ids[0], cfg.chunk_q, cfg.chunk_kv)
    assert {segments.RT_SKIP, segments.RT_MASKED} <= set(classes.ravel().tolist())
    forward_kinds = fwd.profile.bytes_copied_by_kind
    backward_kinds = {kind: run.profile.bytes_copied_by_kind[kind] - n
                      for kind, n in forward_kinds.items()}
    for backward, measured in ((False, forward_kinds), (True, backward_kinds)):
        model = costmodel.pass_copies(cfg.schedule, groups=G, head_dim=64, dtype="float16",
                                      backward=backward, segments=cfg.segments,
                                      classes=classes)
        assert measured["branch"] > 0 and model == measured, backward


@pytest.mark.parametrize("backward, positions, causal, window, two", [
    (False, False, True, (-1, -1), True),   # 3 wheres + equal against flag + conditional
    (True, False, True, (-1, -1), False),   # equal + where: masking is free
    (True, True, True, (-1, -1), True),     # + the causal band on positions: 3 more ops
    (True, True, False, (-1, -1), False),   # positions without a band
    (True, True, False, (8, -1), True),     # a window side: 4 more ops
])
def test_second_level_is_the_time_models_choice(backward, positions, causal, window, two):
    """The segment-id dispatch keeps a second level in unmasked groups exactly where masking
    a runtime-full block costs more modelled time (ops x OP_CYCLES) than the second level's
    IfOpx copies, and never in masked groups."""
    sched = schedule.plan(256, 256, 64, 64, causal=True)
    seg = segments.SegmentConfig(1, 1, positions)
    extra = costmodel.mask_ops(positions, causal, window, backward) - costmodel.SECOND_LEVEL_OPS
    for group in steps.step_groups(sched, "kv_major" if backward else "q_major"):
        chosen = costmodel.second_level(group, groups=2, head_dim=64, dtype="float16",
                                        backward=backward, segments=seg, causal=causal,
                                        window=window)
        assert chosen == (two and not group.masked)
        assert chosen == (not group.masked and extra > 0)


def test_model_copies_per_step_do_not_grow_with_length():
    """Without segment ids the loops copy only their step counters and LoopOpx's control
    values (PopART's rules), so bytes copied per loop step are the same at every L and chunk
    length: 2 x 4 counter bytes and 6 control bytes, plus 4 + 2 once per loop."""
    per_step = set()
    for L, chunk in ((1024, 128), (2048, 128), (4096, 128), (4096, 256)):
        c = costmodel.evaluate(L, L, chunk, chunk, head_dim=64, groups=2, dtype="float16",
                               causal=True, window=(-1, -1))
        loops = len(steps.step_groups(pf.plan(L, L, chunk, chunk), "q_major"))
        once = costmodel.COUNTER_BYTES + costmodel.LOOP_CONTROL_ONCE
        per_step.add((c.bytes_copied_forward - once * loops) / c.iterations)
    assert per_step == {2 * costmodel.COUNTER_BYTES + costmodel.LOOP_CONTROL_STEP} == {14}


@pytest.mark.parametrize("L", [2048, 4096])
def test_model_chooses_the_built_structure(L):
    """At the issue's sizes (causal, G = 2, D = 64, float16, automatic chunks) the model's
    choice among the loop structures is the one the library builds: grouped loops beat the
    nested dispatch (fewer ops, and no branch or carried-state copies under PopART's rules);
    the branch-free whole-block body would be slightly faster but wastes twice the matmul work
    (over the FLOP budget)."""
    choice = pf.explain(L, L, head_dim=64, groups=2)
    best, *others = choice.structures
    assert best.name == "grouped" and best.eligible
    named = {s.name: s for s in others}
    assert named["dispatch"].seconds > best.seconds and named["dispatch"].ops > best.ops
    assert named["dispatch"].bytes_copied > 1000 * best.bytes_copied
    flat = named["branch-free"]
    assert not flat.eligible and flat.flop_ratio > costmodel.MAX_FLOP_RATIO >= best.flop_ratio
    assert "structure: grouped" in choice.table()


@emulator_only
def test_model_positions_copies_equal_the_emulator():
    """With runtime positions (the varlen path) the causal band makes masking cost more than
    a second dispatch level, forward and backward (``costmodel.second_level``): the model's
    copies under that choice equal the emulator's, kind by kind. One sequence filling L = 256
    with 64-row chunks: blocks above the diagonal skip, the diagonal's are masked, the others
    runtime-full (the static schedule is planned without causal: one unmasked group)."""
    L, G, n = 256, 2, 4
    q, k, v = random_qkv(np.random.default_rng(4), G, L, L, 64, "float16")
    ids = np.zeros((1, L), np.int32)
    pos = (np.arange(L, dtype=np.int32) - L)[None]  # bottom-right positions
    options = dict(num_chunks_q=n, num_chunks_kv=n, causal=True)

    def forward(q, k, v, a, b, c, d):
        return functional.segmented_attention(q, k, v, a, b, c, d, **options)

    def both(do, q, k, v, a, b, c, d):
        out, lse = forward(q, k, v, a, b, c, d)
        return functional.segmented_attention_grad(do, q, k, v, out, lse, a, b, c, d,
                                                      **options)

    _, fwd = run_graph(forward, [q, k, v, ids, ids, pos, pos])
    _, run = run_graph(both, [q, q, k, v, ids, ids, pos, pos])
    spec = pf.popxl.TensorSpec(ids.shape, pf.popxl.int32)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, ("float16",) * 3, **options)
    cfg = cfg.with_segments(spec, spec, spec, spec)
    i, j = np.indices((n, n))
    classes = np.where(j > i, segments.RT_SKIP, np.where(j == i, segments.RT_MASKED,
                                                         segments.RT_FULL))
    forward_kinds = fwd.profile.bytes_copied_by_kind
    backward_kinds = {kind: run.profile.bytes_copied_by_kind[kind] - m
                      for kind, m in forward_kinds.items()}
    for backward, measured in ((False, forward_kinds), (True, backward_kinds)):
        model = costmodel.pass_copies(cfg.schedule, groups=G, head_dim=64, dtype="float16",
                                      backward=backward, segments=cfg.segments,
                                      classes=classes, causal=True)
        assert measured["branch"] > 0 and model == measured, backward
