"""Runtime segment masks: packed sequences and key padding, as PopXL graph code.

Segment ids arrive with the data (int32 ``[G or 1, L]`` tensors given at run time), so the static
planner cannot see them. This module turns them into what the block step needs:

* :func:`varlen_segments`: flash-attn's ``cu_seqlens [num_seqs + 1]`` -> segment ids and
  bottom-right positions (distance to the end of the sequence, ``-1`` for its last row), with
  ordinary broadcast comparisons and reductions (``O(L * num_seqs)`` elements, once per call);
* :func:`chunk_stats`: per chunk, computed once before the loops, the few numbers that classify
  a block at run time (:data:`STATS`);
* :func:`classify_blocks`: from the chunks' statistics, once per call and vectorised over all
  blocks, whether a block shares no segment (``skip``: no matmul), lies inside one segment
  with its whole positional band visible (``full``: unmasked update) or neither (masked); the
  loop reads one int32 entry per step (:func:`step_classes`, gathered once per call);
* :func:`runtime_mask`: for every other visited block, the bool mask ``[G or 1, cq, ckv]``
  (segment equality, not padding, positional band); in the loop :func:`block_mask` computes it
  from the ids :func:`loop_tensors` shaped once per call (distinct q and kv padding ids: one
  ``equal``, no reshape per step).

Semantics (see ``docs/user-guide.md``): query row ``i`` sees key ``j`` iff
``q_ids[i] == kv_ids[j] >= 0`` and the static mask (causal, window on indices) allows ``(i, j)``.
With positions (the varlen API), causal and window compare positions instead:
``kv_pos <= q_pos`` (causal), ``q_pos - left <= kv_pos <= q_pos + right`` (window); the static
schedule is then planned without causal/window, and runtime skipping does that work.

Every classification is conservative: a block is skipped only when no pair in it can be
visible, and runs unmasked only when every pair is; anything else runs masked, so correctness
never depends on the ids being sorted. For packed rows (ids non-decreasing, positions increasing
within a sequence) the tests are exact at block granularity up to chunks straddling sequences.
"""
import numpy as np

from popxl_flash.backend import popxl

ops = popxl.ops

from popxl_flash.plan.segments import (BIG, MAX_LEN, PAD, POS_HI, POS_LO, RT_FULL,  # noqa: F401
                                     RT_MASKED, RT_SKIP, SEG_MAX, SEG_MIN, STATS,
                                     SegmentConfig)


def _i32(value):
    """A rank-0 int32 constant in the current graph."""
    return popxl.constant(np.array(value, dtype=np.int32))


def _not_greater(a, b):
    """``a <= b`` (PopXL has no ``less_equal``)."""
    return ops.logical_not(ops.greater(a, b))


def varlen_segments(cu_seqlens, total):
    """Segment ids and bottom-right positions of a varlen packing, on the device.

    Sequence ``s`` holds rows ``cu_seqlens[s] <= r < cu_seqlens[s + 1]``; rows outside every
    sequence (after ``cu_seqlens[-1]``, or before ``cu_seqlens[0]``) are padding. Repeating the
    last offset gives empty sequences (the way to pass fewer sequences than the static bound).
    Offsets that decrease anywhere (``cu_seqlens[s + 1] < cu_seqlens[s]``) describe no packing:
    then every row is padding (checked on the device, no host round trip), so the call gives
    out 0, lse ``-inf`` and zero gradients everywhere instead of attending across sequences.

    Args:
        cu_seqlens: int32 ``[num_seqs + 1]`` (non-decreasing, or every row is padding).
        total: the number of rows, ``total_q`` or ``total_k`` (int).

    Returns:
        ``(segment_ids, positions)``, int32 ``[1, total]`` each: ids in ``[0, num_seqs)`` or -1
        for padding, positions ``r - cu_seqlens[s + 1]`` (0 on padding).
    """
    n = cu_seqlens.shape[0]
    rows = popxl.constant(np.arange(total, dtype=np.int32).reshape(total, 1))  # [total, 1]
    cu = cu_seqlens.reshape((1, n))  # [1, S+1]
    started = _not_greater(cu, rows)  # [total, S+1]: cu[s] <= r
    seg = ops.sum(ops.cast(started, popxl.int32), axis=-1, keepdims=True) - _i32(1)  # [total, 1]
    last = ops.slice(cu, start=[n - 1], stop=[n], axis=[1])  # [1, 1]
    real = ops.logical_and(ops.greater(seg, _i32(-1)), ops.greater(last, rows))
    real = ops.logical_and(real, _non_decreasing(cu))
    end = ops.min(ops.where(started, _i32(BIG), cu), axis=-1, keepdims=True)  # next offset > r
    seg = ops.where(real, seg, _i32(-1))
    pos = ops.where(real, rows - end, _i32(0))
    return seg.reshape((1, total)), pos.reshape((1, total))


def _non_decreasing(cu):
    """``[1, 1]`` bool: ``cu [1, n]`` (n >= 2) never decreases (``cu[s] <= cu[s + 1]``)."""
    n = cu.shape[1]
    head = ops.slice(cu, start=[0], stop=[n - 1], axis=[1])  # cu[s]      [1, n-1]
    tail = ops.slice(cu, start=[1], stop=[n], axis=[1])  # cu[s + 1]  [1, n-1]
    drops = ops.cast(ops.greater(head, tail), popxl.int32)
    return ops.logical_not(ops.greater(ops.max(drops, axis=[1], keepdims=True), _i32(0)))


def pad_ids(ids, padded_len, fill):
    """Pad ``ids [Gs, L]`` along axis 1 with ``fill`` to ``[Gs, padded_len]`` (no-op if equal)."""
    Gs, L = ids.shape
    if padded_len == L:
        return ids
    tail = popxl.constant(np.full((Gs, padded_len - L), fill, dtype=np.int32))
    return ops.concat([ids, tail], axis=1)


def chunk_stats(ids, positions, chunk_len):
    """Per-chunk statistics (:data:`STATS`) of padded segment ids, computed once per call.

    Args:
        ids: int32 ``[Gs, L_pad]`` (``L_pad`` a multiple of ``chunk_len``; -1 = padding).
        positions: int32 ``[Gs, L_pad]`` or ``None`` (then the position columns are 0).
        chunk_len: rows per chunk.

    Returns:
        int32 ``[n_chunks, 5]``; reductions run over groups and rows of each chunk, so the
        statistics bound every group at once.
    """
    Gs, L = ids.shape
    n = L // chunk_len
    ids = ids.reshape((Gs, n, chunk_len))
    real = ops.greater(ids, _i32(-1))
    seg_min = ops.min(ops.where(real, ids, _i32(BIG)), axis=[0, 2], keepdims=True)  # [1, n, 1]
    seg_max = ops.max(ops.where(real, ids, _i32(-1)), axis=[0, 2], keepdims=True)
    pad = ops.max(ops.cast(ops.logical_not(real), popxl.int32), axis=[0, 2], keepdims=True)
    if positions is None:
        zero = ops.init((1, n, 1), popxl.int32, init_type="zero")
        pos_lo, pos_hi = zero, ops.identity(zero)
    else:
        pos = positions.reshape((Gs, n, chunk_len))
        at_min = ops.logical_and(real, ops.equal(ids, seg_min))
        at_max = ops.logical_and(real, ops.equal(ids, seg_max))
        pos_lo = ops.min(ops.where(at_min, pos, _i32(BIG)), axis=[0, 2], keepdims=True)
        pos_hi = ops.max(ops.where(at_max, pos, _i32(-BIG)), axis=[0, 2], keepdims=True)
    stats = ops.concat([seg_min, seg_max, pad, pos_lo, pos_hi], axis=2)  # [1, n, 5]
    return stats.reshape((n, len(STATS)))


def _columns(stats, axis):
    """The :data:`STATS` columns of ``stats [n, 5]`` as int32 tensors shaped ``[n, 1]``
    (``axis=0``) or ``[1, n]`` (``axis=1``)."""
    n = stats.shape[0]
    shape = (n, 1) if axis == 0 else (1, n)
    return [ops.slice(stats, start=[c], stop=[c + 1], axis=[1]).reshape(shape)
            for c in range(len(STATS))]


def _lex_less(a_seg, a_pos, b_seg, b_pos):
    """``(a_seg, a_pos) < (b_seg, b_pos)`` lexicographically (elementwise, broadcast)."""
    return ops.logical_or(ops.greater(b_seg, a_seg),
                          ops.logical_and(ops.equal(a_seg, b_seg), ops.greater(b_pos, a_pos)))


def classify_blocks(q_stats, kv_stats, *, positions, causal, window):
    """Runtime class of every block from the chunks' statistics, once per call.

    ``skip``: no (query, key) pair can be visible: the chunks' id ranges are disjoint (or one is
    all padding), or, with positions, the causal/window band misses every lexicographic
    (id, position) pair. ``full``: both chunks lie in one segment without padding and, with
    positions, the band covers every pair (without positions the static schedule decides).

    Args:
        q_stats: int32 ``[nq, 5]``; kv_stats: int32 ``[nkv, 5]`` (:func:`chunk_stats`).
        positions: whether causal/window compare positions.
        causal, window: the mask options (used only with positions).

    Returns:
        int32 ``[nq, nkv]``: :data:`RT_SKIP`, :data:`RT_FULL` or :data:`RT_MASKED`.
    """
    qs0, qs1, q_pad, qp0, qp1 = _columns(q_stats, 0)  # [nq, 1]
    ks0, ks1, k_pad, kp0, kp1 = _columns(kv_stats, 1)  # [1, nkv]
    skip = ops.logical_or(ops.greater(ks0, qs1), ops.greater(qs0, ks1))  # [nq, nkv]
    one = ops.logical_and(ops.equal(qs0, qs1), ops.equal(ks0, ks1))
    one = ops.logical_and(one, ops.equal(qs0, ks0))
    full = ops.logical_and(one, ops.equal(q_pad + k_pad, _i32(0)))
    if positions:
        left, right = (min(side, MAX_LEN) for side in window)
        if causal:  # visible needs (s, kpos) <= (s, qpos): skip if min kv > max q
            skip = ops.logical_or(skip, _lex_less(qs1, qp1, ks0, kp0))
            full = ops.logical_and(full, _not_greater(kp1, qp0))
        if left >= 0:  # visible needs kpos >= qpos - left
            skip = ops.logical_or(skip, _lex_less(ks1, kp1, qs0, qp0 - _i32(left)))
            full = ops.logical_and(full, _not_greater(qp1 - _i32(left), kp0))
        if right >= 0:  # visible needs kpos <= qpos + right
            skip = ops.logical_or(skip, _lex_less(qs1, qp1 + _i32(right), ks0, kp0))
            full = ops.logical_and(full, _not_greater(kp1, qp0 + _i32(right)))
    full = ops.logical_and(full, ops.logical_not(skip))
    masked = ops.logical_not(ops.logical_or(skip, full))
    return ops.cast(full, popxl.int32) * _i32(RT_FULL) + ops.cast(masked, popxl.int32) * \
        _i32(RT_MASKED)


def runtime_mask(q_ids, kv_ids, q_pos=None, kv_pos=None, *, causal=False, window=(-1, -1)):
    """Visibility of a block from its chunks' ids (and positions).

    Args:
        q_ids: int32 ``[Gs, cq]``; kv_ids: int32 ``[Gsk, ckv]`` (``Gs``, ``Gsk`` in {G, 1}).
        q_pos, kv_pos: int32 positions of the same shapes, or ``None`` (no positional band).
        causal, window: the band on positions (ignored without positions).

    Returns:
        bool ``[max(Gs, Gsk), cq, ckv]``: ``q_id == kv_id >= 0`` and the band.
    """
    Gs, cq = q_ids.shape
    Gsk, ckv = kv_ids.shape
    qi = q_ids.reshape((Gs, cq, 1))
    ki = kv_ids.reshape((Gsk, 1, ckv))
    visible = ops.logical_and(ops.equal(qi, ki), ops.greater(qi, _i32(-1)))
    if q_pos is None:
        return visible
    return _band(visible, q_pos.reshape((Gs, cq, 1)), kv_pos.reshape((Gsk, 1, ckv)), causal,
                 window)


def _band(visible, qp, kp, causal, window):
    """``visible`` and the positional band, on broadcast positions ``qp [Gs, cq, 1]``,
    ``kp [Gsk, 1, ckv]``."""
    left, right = (min(side, MAX_LEN) for side in window)
    if causal:
        visible = ops.logical_and(visible, _not_greater(kp, qp))
    if left >= 0:
        visible = ops.logical_and(visible, _not_greater(qp - _i32(left), kp))
    if right >= 0:
        visible = ops.logical_and(visible, _not_greater(kp, qp + _i32(right)))
    return visible


#: Padding id of the loop's q ids and kv ids (:func:`loop_tensors`): distinct, so that one
#: ``equal`` is the whole id test (``q_id == kv_id >= 0``) in the loop.
Q_PAD, KV_PAD = -1, -2


def loop_tensors(ids, positions, side):
    """The segment inputs as the loop slices them, shaped for the block mask once per call:
    every negative id set to the side's padding id (:data:`Q_PAD`, :data:`KV_PAD`), q rows on
    axis 1 and kv rows on axis 2 (so a step's slices broadcast without a reshape).

    Args:
        ids: padded int32 ``[Gs, L]``; positions: the same shape, or ``None``.
        side: ``"q"`` or ``"kv"``.

    Returns:
        ``[ids]`` (then positions): ``[Gs, L, 1]`` for q, ``[Gs, 1, L]`` for kv.
    """
    Gs, L = ids.shape
    shape = (Gs, L, 1) if side == "q" else (Gs, 1, L)
    pad = Q_PAD if side == "q" else KV_PAD
    out = [ops.where(ops.greater(ids, _i32(-1)), ids, _i32(pad)).reshape(shape)]
    if positions is not None:
        out.append(positions.reshape(shape))
    return out


def prepare(cfg, q_ids, kv_ids, q_pos=None, kv_pos=None, step_table=None):
    """Pad the segment inputs to whole chunks and classify every block, once per call.

    Args:
        cfg: the :class:`~popxl_flash.plan.config.AttentionConfig` (with ``segments`` set).
        q_ids: int32 ``[G or 1, Lq]``; kv_ids: int32 ``[Gk or 1, Lkv]``; q_pos, kv_pos:
            positions of the same shapes, or ``None``.

    Returns:
        ``(tensors, classes)`` (kv ids of ``Gk`` rows repeated to ``G``, :func:`kv_rows`):
        the padded ``[q_ids, kv_ids]`` (:data:`Q_PAD`, :data:`KV_PAD` on padding), plus
        ``[q_pos, kv_pos]`` with positions, shaped by :func:`loop_tensors`, which the loop
        reads (read-only inputs), then the run-time ``step_table`` when given (context
        parallelism's per-replica block list, :class:`popxl_flash.plan.segments.SegmentConfig`);
        and the int32 ``[nq, nkv]`` block classes of :func:`classify_blocks`.
    """
    q_ids = pad_ids(q_ids, cfg.padded_q_len, -1)
    kv_ids = expand_kv_rows(cfg, pad_ids(kv_ids, cfg.padded_kv_len, -1))
    if q_pos is not None:
        q_pos = pad_ids(q_pos, cfg.padded_q_len, 0)
        kv_pos = expand_kv_rows(cfg, pad_ids(kv_pos, cfg.padded_kv_len, 0))
    classes = classify_blocks(chunk_stats(q_ids, q_pos, cfg.chunk_q),
                              chunk_stats(kv_ids, kv_pos, cfg.chunk_kv),
                              positions=cfg.segments.positions, causal=cfg.causal,
                              window=cfg.window)
    (q_ids, *q_pos), (kv_ids, *kv_pos) = (loop_tensors(q_ids, q_pos, "q"),
                                          loop_tensors(kv_ids, kv_pos, "kv"))
    tables = [] if step_table is None else [step_table]
    return [q_ids, kv_ids, *q_pos, *kv_pos, *tables], classes


def kv_rows(cfg):
    """Rows of the kv ids inside the loop: 1, or G (per-kv-group ids of grouped-query
    attention are repeated for the q groups that read each kv group, :func:`expand_kv_rows`)."""
    return 1 if cfg.segments.kv_groups == 1 else cfg.groups


def expand_kv_rows(cfg, ids):
    """``[Gk, L]`` kv ids (or positions) of grouped-query attention -> ``[G, L]``, row ``g``
    being kv group ``g // (G // Gk)`` (no op for 1 or G rows)."""
    rows, length = ids.shape
    if rows in (1, cfg.groups):
        return ids
    r = cfg.groups // rows
    ids3 = ids.reshape((rows, 1, length))
    return ops.concat([ids3] * r, axis=1).reshape((cfg.groups, length))


def step_classes(classes, q_chunk, kv_chunk):
    """The runtime class of every step of a block list, once per call.

    Args:
        classes: int32 ``[nq, nkv]`` from :func:`classify_blocks`.
        q_chunk, kv_chunk: the block list's ``int[V]`` chunk indices (static).

    Returns:
        int32 ``[V]``.
    """
    nq, nkv = classes.shape
    flat = classes.reshape((nq * nkv,))
    index = (np.asarray(q_chunk, np.int64) * nkv + np.asarray(kv_chunk, np.int64))
    return ops.gather(flat, popxl.constant(index.astype(np.int32)))


def step_operands(cfg, tensors, q_offset, kv_offset, lengths=None):
    """The segment operands of one step: the chunks of the loop's ids (and positions).

    Args:
        cfg: the config; tensors: the loop tensors of :func:`prepare`.
        q_offset, kv_offset: int32 ``[1]`` first rows of the step's q and kv rows.
        lengths: ``(rows, cols)`` of the step (``None``: whole chunks).

    Returns:
        ``[q_ids_i [Gs, rows, 1], kv_ids_j [Gsk, 1, cols]]`` (then the positions' slices).
    """
    lengths = lengths or (cfg.chunk_q, cfg.chunk_kv)
    return [ops.dynamic_slice(t, offset, axes=[1 + n % 2], sizes=[lengths[n % 2]],
                              no_overlap=True)
            for n, (t, offset) in enumerate(zip(tensors, (q_offset, kv_offset) * 2))]


def block_mask(cfg, operands):
    """Visibility of a (sub-)block from its segment operands (:func:`step_operands`): one
    ``equal`` of the ids (their padding ids differ), then the positional band.

    Returns:
        bool ``[max(Gs, Gsk), rows, cols]``, as :func:`runtime_mask`.
    """
    q_ids, kv_ids, *pos = operands
    visible = ops.equal(q_ids, kv_ids)
    if not pos:
        return visible
    return _band(visible, *pos, cfg.causal, cfg.window)
