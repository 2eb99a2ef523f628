"""PopXL graph helpers shared by the forward and backward modules.

They look a loop step up in the planner's block list, slice the block's chunks, fetch its mask
pattern and dispatch the step to the branch graph of its kind (full or partial, whole or split
into two sub-blocks, last step of its outer chunk or not). Everything here is graph
code: it runs inside the graph context of the module being built and uses only the documented
PopXL API.
"""
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Tuple

import numpy as np

from popxl_flash import score_mods, segments
from popxl_flash.backend import popxl
from popxl_flash.schedule import FULL, LOWER, PARTIAL, SKIP, UPPER, WHOLE

ops = popxl.ops

#: Score given to masked elements when taking the running max, and the initial running max
#: ``m_i``: the lowest float32, so every finite score of a visible element ranks above it.
#: Finite on purpose: ``exp(m_old - m_new)`` is 1 or 0, never ``exp(-inf + inf) = NaN``, while a
#: row has seen nothing, and masked probabilities are then zeroed with ``where`` rather than
#: relying on it.
MASKED_SCORE = float(np.finfo(np.float32).min)

#: dtype of the loop counters and table entries.
INDEX_DTYPE = np.int32


def float32():
    """The backend's float32 dtype (statistics and accumulators are always float32)."""
    return popxl.float32


def counter(value=0):
    """A loop counter constant ``[1]`` int32 in the current graph."""
    return popxl.constant(np.array([value], dtype=INDEX_DTYPE))


def fill(t, value):
    """``t`` with every element replaced by the constant ``value`` (a ``where`` select, so a
    constant ``-inf`` never enters arithmetic)."""
    true = popxl.constant(np.array(True))
    return ops.where(true, popxl.constant(value, dtype=t.dtype), t)


def pad_rows(t, padded_len):
    """Pad axis 1 of ``t [G, L, D]`` with zeros to ``[G, padded_len, D]`` (no-op if equal)."""
    G, L, D = t.shape
    if padded_len == L:
        return t
    zeros = ops.init((G, padded_len - L, D), t.dtype, init_type="zero")
    return ops.concat([t, zeros], axis=1)


def unpad_rows(t, length):
    """Keep the first ``length`` entries of axis 1 of ``t`` (no-op if already that long)."""
    if t.shape[1] == length:
        return t
    return ops.slice(t, start=[0], stop=[length], axis=[1])


class StepTables:
    """A block list's per-step entries as int32 ``[V]`` constants of the loop body.

    Create inside the loop body (the constants belong to that graph, so they are not copied
    through loop boundaries). Each lookup is one ``dynamic_slice`` by the step counter.

    Args:
        cfg: the :class:`AttentionConfig`.
        block_list: the schedule's :class:`popxl_flash.schedule.BlockList` of this loop.
        branch_ids: ``int[V]`` branch of each step (see :class:`BlockStep`), or ``None`` when
            the loop has a single branch.
    """

    def __init__(self, cfg, block_list, branch_ids, branch_table=None):
        self.q_offset = _table(block_list.q_chunk.astype(np.int64) * cfg.chunk_q)
        self.kv_offset = _table(block_list.kv_chunk.astype(np.int64) * cfg.chunk_kv)
        self.branch = branch_table
        if branch_table is None and branch_ids is not None:
            self.branch = _table(branch_ids)

    def lookup(self, t):
        """Entries of step ``t`` (int32 ``[1]``).

        Returns:
            ``(q_offset, kv_offset, branch)``: int32 ``[1]`` each (first row of the q and kv
            chunks; the branch is ``None`` when the loop has a single branch).
        """
        return tuple(None if table is None else entry(table, t)
                     for table in (self.q_offset, self.kv_offset, self.branch))


def _table(values):
    """An int32 ``[V]`` constant of the current graph."""
    return popxl.constant(np.ascontiguousarray(values, dtype=INDEX_DTYPE))


def entry(table, t):
    """``table[t]`` as int32 ``[1]`` for a step counter ``t [1]``."""
    return ops.dynamic_slice(table, t, axes=[0], sizes=[1], no_overlap=True)


def rows(t, offset, length):
    """``t[:, offset : offset + length]`` for an int32 ``[1]`` row offset (axis 1)."""
    return ops.dynamic_slice(t, offset, axes=[1], sizes=[length], no_overlap=True)


def write_rows_(t, offset, value):
    """Write ``value`` into ``t[:, offset : offset + value.shape[1]]`` in place; returns the alias.

    Only for the library's own accumulators (``out``, ``lse``, ``dq``, ``dk``, ``dv``), which
    enter the loop by reference and are read after it under ``in_sequence``.
    """
    return ops.dynamic_update_(t, offset, value, axes=[1], sizes=[value.shape[1]],
                               no_overlap=True)


def pattern_table(cfg):
    """The schedule's ``patterns [P, cq, ckv]``; with segment ids one more, all visible, at
    index ``P`` (the static pattern of a statically full block that runs masked)."""
    patterns = cfg.schedule.patterns
    if cfg.segments is not None:
        patterns = np.concatenate([patterns, np.ones((1, cfg.chunk_q, cfg.chunk_kv), bool)])
    return np.ascontiguousarray(patterns)


def pattern_ids(cfg, order):
    """Per-step pattern ids of a block list (``int32[V]``); with segment ids, statically full
    steps get the all-visible pattern ``P``."""
    blist = cfg.schedule.block_list(order)
    if cfg.segments is None:
        return blist.pattern_id
    return np.where(blist.kind == PARTIAL, blist.pattern_id, cfg.schedule.num_patterns)


def block_mask(cfg, pattern_id):
    """The visibility pattern of a partial block, from a pattern table made a constant here.

    Args:
        cfg: the config (its schedule's pattern table, :func:`pattern_table`, becomes a
            constant).
        pattern_id: int32 ``[1]``.

    Returns:
        bool ``[1, cq, ckv]`` (True = visible), broadcasting over groups.
    """
    patterns = popxl.constant(pattern_table(cfg))  # [P(+1), cq, ckv]
    return ops.dynamic_slice(patterns, pattern_id, axes=[0], sizes=[1], no_overlap=True)


@dataclass(frozen=True)
class LoopSpec:
    """What one loop nest's block step computes; see :class:`BlockStep`.

    Attributes:
        order: ``"q_major"`` (forward) or ``"kv_major"`` (backward).
        update: ``update(cfg, *block_tensors, *operands, visible=None) -> block_tensors``, the
            per-block math (``online_softmax_update`` or ``grad_block_update``).
        roles: ``"q"`` or ``"kv"`` per block tensor then per operand: whether axis 1 of that
            tensor runs over the block's q rows or its kv rows (how sub-blocks slice it).
        block_specs, operand_specs: ``TensorSpec`` of the block tensors and the operands.
        carried: indices of the block tensors carried from step to step (the running state of
            the outer chunk); the others are written back every step.
        init: ``init(cfg) -> carried tensors``, the running state at an outer chunk's start.
        finish: ``finish(cfg, *carried) -> finished tensors``, the outer chunk's results.
        finished_specs: ``TensorSpec`` of the finished tensors.
    """

    order: str
    update: Callable
    roles: Tuple[str, ...]
    block_specs: tuple
    operand_specs: tuple
    carried: Tuple[int, ...]
    init: Callable
    finish: Callable
    finished_specs: tuple


def _sub_blocks(cfg, split):
    """Static ``(rows, cols)`` ranges of the sub-blocks of a block of ``split`` kind."""
    cq, ckv = cfg.chunk_q, cfg.chunk_kv
    h, w = cq // 2, ckv // 2
    if split == LOWER:
        return [((0, h), (0, w)), ((h, cq), (0, ckv))]
    if split == UPPER:
        return [((0, h), (0, ckv)), ((h, cq), (w, ckv))]
    return [((0, cq), (0, ckv))]


def _part(t, span, axis_len, axis=1):
    """``t`` sliced to ``span`` on ``axis`` (no op for the whole axis)."""
    start, stop = span
    if (start, stop) == (0, axis_len):
        return t
    return ops.slice(t, start=[start], stop=[stop], axis=[axis])


def _put(t, new, span, axis_len):
    """``t`` with rows ``span`` of axis 1 replaced by ``new`` (no op for the whole axis)."""
    start, stop = span
    if (start, stop) == (0, axis_len):
        return new
    pieces = [_part(t, (0, start), axis_len)] if start > 0 else []
    pieces.append(new)
    if stop < axis_len:
        pieces.append(_part(t, (stop, axis_len), axis_len))
    return ops.concat(pieces, axis=1)


def run_block(spec, cfg, split, tensors, visible):
    """Apply ``spec.update`` to one block, as one block or as two sub-blocks.

    Args:
        spec: the :class:`LoopSpec`.
        cfg: the :class:`AttentionConfig`.
        split: ``WHOLE``, ``LOWER`` or ``UPPER`` (static).
        tensors: block tensors then operands (``[G, cq or ckv, ...]`` by role); with segment
            ids the last operands are the step's segment operands
            (:func:`popxl_flash.segments.step_operands`), which only build the mask.
        visible: bool ``[1, cq, ckv]`` mask or ``None`` (full block); with segment ids it is
            ANDed with the block's runtime mask.

    Returns:
        The updated block tensors (list).
    """
    n = len(spec.block_specs)
    n_seg = len(segments.operand_specs(cfg)) if cfg.segments is not None else 0
    lengths = {"q": cfg.chunk_q, "kv": cfg.chunk_kv}
    block, operands = list(tensors[:n]), list(tensors[n:])
    operands, extra = score_mods.split_operands(cfg, operands)
    for row_span, col_span in _sub_blocks(cfg, split):
        spans = {"q": row_span, "kv": col_span}
        parts = [_part(t, spans[r], lengths[r]) for t, r in zip(block + operands, spec.roles)]
        parts, seg_parts = parts[:len(parts) - n_seg], parts[len(parts) - n_seg:]
        mask = visible
        if mask is not None:
            mask = _part(_part(mask, row_span, cfg.chunk_q), col_span, cfg.chunk_kv, axis=2)
            if n_seg:  # the runtime mask of the segment ids (masked branches only)
                mask = ops.logical_and(mask, segments.block_mask(cfg, seg_parts))
        new = spec.update(cfg, *parts, visible=mask, **score_mods.sub_block(cfg, extra,
                                                                          row_span, col_span))
        block = [_put(t, u, spans[r], lengths[r]) for t, u, r in zip(block, new, spec.roles)]
    return block


def _zeros(specs):
    return [ops.init(s.shape, s.dtype, init_type="zero") for s in specs]


def _branch(spec, cfg, key, *inputs):
    """One block step of a fixed ``key = (kind, split, last)`` (``kind`` ``SKIP`` only with
    segment ids: the block tensors pass through, the outer chunk's bookkeeping still runs).

    Args:
        inputs: block tensors, operands, then the step counter ``t [1]`` when the loop has
            partial blocks (a partial branch looks its pattern id up itself, so full steps
            skip that lookup).

    Returns:
        ``(*carried, *written, *finished)``: the running state for the next step (fresh at an
        outer chunk's last step), the non-carried block tensors, and the finished results
        (zeros except at the last step).
    """
    kind, split, last = key
    n = len(spec.block_specs) + len(spec.operand_specs)
    visible = None
    if kind == PARTIAL:
        ids = _table(pattern_ids(cfg, spec.order))  # [V]
        visible = block_mask(cfg, entry(ids, inputs[n]))
    if kind == SKIP:  # segment ids: nothing visible at run time, no matmul
        block = list(inputs[:len(spec.block_specs)])
    else:
        block = run_block(spec, cfg, split, inputs[:n], visible)
    carried = [block[i] for i in spec.carried]
    written = [t for i, t in enumerate(block) if i not in spec.carried]
    if last:
        finished = list(spec.finish(cfg, *carried))
        carried = list(spec.init(cfg))
    else:
        finished = _zeros(spec.finished_specs)
    return (*carried, *written, *finished)


def _dispatch(graphs, ids, *inputs):
    """Nested conditional over branch graphs: ``graphs[0]`` if ``branch == ids[0]``, else the
    rest (the last input is the branch id)."""
    *inputs, branch = inputs
    return _select(graphs, ids, inputs, branch)


def _select(graphs, ids, inputs, branch):
    """``conditional(branch == ids[0], graphs[0], <the rest>)`` for two or more graphs."""
    then_graph, else_graph = graphs[0], graphs[1]
    else_inputs = list(inputs)
    if len(graphs) > 2:  # the else branch dispatches among the rest
        else_graph = popxl.gcg().ir.create_graph(_dispatch, graphs[1:], ids[1:],
                                                 *[t.spec for t in inputs], branch.spec)
        else_inputs.append(branch)
    cond = ops.equal(branch, popxl.constant(np.array([ids[0]], dtype=INDEX_DTYPE)))
    return ops.conditional(cond, then_graph, else_graph, then_inputs=list(inputs),
                           else_inputs=else_inputs)


def _rank(keys):
    """Distinct branch keys, most frequent first (ties by key), and each key's branch index.

    Args:
        keys: iterable of ``(kind, split, last)`` keys, one per use.

    Returns:
        ``(ranked keys, {key: index})``.
    """
    counts = Counter(keys)
    ranked = sorted(counts, key=lambda key: (-counts[key], key))
    return ranked, {key: b for b, key in enumerate(ranked)}


class BlockStep:
    """The branch graphs of one loop nest: one per distinct ``(kind, split, last)`` among its
    steps, most frequent first.

    One branch runs inline in the loop body (no conditional at all); two are one
    ``ops.conditional``; more nest conditionals, the rarer branches deeper. Every branch graph
    has ops, takes no by-reference input and returns tensors of the same specs.

    Args:
        spec: the :class:`LoopSpec`.
        cfg: the :class:`AttentionConfig`.
    """

    def __init__(self, spec, cfg):
        if cfg.segments is not None:
            spec = with_segment_operands(spec, cfg)
        if cfg.mods is not None:
            spec = score_mods.with_operands(spec, cfg)
        self.spec, self.cfg = spec, cfg
        blist = cfg.schedule.block_list(spec.order)
        if cfg.segments is None:
            keys = [(int(k), int(s), bool(f))
                    for k, s, f in zip(blist.kind, blist.split, blist.last)]
            self.keys, index = _rank(keys)
            self.branch_ids = np.array([index[key] for key in keys], dtype=INDEX_DTYPE)
            self.has_partial = bool((blist.kind == PARTIAL).any())
        else:
            self.keys, self.candidates = segment_branches(cfg, spec.order)
            self.branch_ids = self.candidates[0]
            self.has_partial = True
        self.graphs = []
        if len(self.keys) > 1:
            ir = popxl.gcg().ir
            specs = [*spec.block_specs, *spec.operand_specs]
            if self.has_partial:
                specs.append(popxl.TensorSpec((1,), popxl.int32))  # the step counter
            self.graphs = [ir.create_graph(_branch, spec, cfg, key, *specs) for key in self.keys]

    def tables(self, branch_table=None):
        """The block list as :class:`StepTables` constants of the current (loop body) graph.

        Args:
            branch_table: with segment ids, the int32 ``[V]`` runtime branch of every step
                (:func:`runtime_branches`, an input of the loop body).
        """
        blist = self.cfg.schedule.block_list(self.spec.order)
        return StepTables(self.cfg, blist, self.branch_ids if self.graphs else None,
                          branch_table)

    def run(self, t, branch, tensors):
        """One step: dispatch to the step's branch.

        Args:
            t: the step counter, int32 ``[1]``.
            branch: from :meth:`StepTables.lookup`.
            tensors: block tensors then operands.

        Returns:
            ``(*carried, *written, *finished)`` as the branch returns them (a tuple).
        """
        inputs = list(tensors) + ([t] if self.has_partial else [])
        if not self.graphs:
            return _branch(self.spec, self.cfg, self.keys[0], *inputs)
        return tuple(_select(self.graphs, list(range(len(self.keys))), inputs, branch))


def with_segment_operands(spec, cfg):
    """``spec`` with the segment operands (:func:`popxl_flash.segments.operand_specs`) after
    its own operands."""
    seg_specs = tuple(segments.operand_specs(cfg))
    roles = segments.OPERAND_ROLES[:len(seg_specs)]
    return replace(spec, roles=spec.roles + roles, operand_specs=spec.operand_specs + seg_specs)


def segment_branches(cfg, order):
    """The branch keys of a block list with segment ids, and each step's candidates.

    At run time a step is skipped (``SKIP``: its chunks share no segment, or the positional
    band misses it), runs unmasked (``FULL``: statically full and inside one segment) or runs
    masked (``PARTIAL``: its static pattern, all-visible for a statically full block, and the
    runtime mask). The split and the outer chunk's ``last`` flag stay static.

    Returns:
        ``(keys, candidates)``: the branch keys, most frequent static candidate first, and
        int32 ``[3, V]`` branch indices of each step if skipped, full, masked (a statically
        partial step has its masked branch in the full row).
    """
    blist = cfg.schedule.block_list(order)
    steps = list(zip(blist.kind, blist.split, blist.last))
    rows = []
    for kind, split, last in steps:
        masked = (PARTIAL, int(split), bool(last))
        full = (FULL, WHOLE, bool(last)) if kind == FULL else masked
        rows.append([(SKIP, WHOLE, bool(last)), full, masked])
    keys, index = _rank(key for row in rows for key in row)
    candidates = np.array([[index[key] for key in row] for row in rows], INDEX_DTYPE).T
    return keys, np.ascontiguousarray(candidates)


def runtime_branches(cfg, order, classes):
    """Each step's branch from the runtime block classes, once per call (outside the loop).

    Args:
        cfg: the config (with segment ids); order: the block list's order.
        classes: int32 ``[nq, nkv]`` from :func:`popxl_flash.segments.classify_blocks`.

    Returns:
        int32 ``[V]``: the branch index of every step (see :func:`segment_branches`).
    """
    blist = cfg.schedule.block_list(order)
    _, candidates = segment_branches(cfg, order)
    cls = segments.step_classes(classes, blist.q_chunk, blist.kv_chunk)  # [V]
    skip, full, masked = (popxl.constant(c) for c in candidates)

    def is_(value):
        return ops.equal(cls, popxl.constant(np.array(value, dtype=INDEX_DTYPE)))
    return ops.where(is_(segments.RT_SKIP), skip,
                     ops.where(is_(segments.RT_FULL), full, masked))


def fold_heads(cfg, t):
    """Grouped-query attention: ``[G, rows, X] -> [Gk, r * rows, X]``, the r = G // Gk q
    groups that share a kv group stacked as the row blocks of one matrix, so that one matmul
    per kv group serves them all (a view, ``reshape_``: no copy; no op at all for multi-head
    attention, r = 1).

    q groups share kv groups consecutively (q group ``g`` reads kv group ``g // r``), so this
    is a row-major reshape: row ``h * rows + c`` of kv group ``gk`` is row ``c`` of q group
    ``gk * r + h``.
    """
    r = cfg.group_size
    if r == 1:
        return t
    _, rows, x = t.shape
    return t.reshape_((cfg.kv_groups, r * rows, x))


def unfold_heads(cfg, t):
    """Inverse of :func:`fold_heads`: ``[Gk, r * rows, X] -> [G, rows, X]`` (a view)."""
    r = cfg.group_size
    if r == 1:
        return t
    _, rows, x = t.shape
    return t.reshape_((cfg.groups, rows // r, x))


def matmul_f32(a, b):
    """float32-accumulated matmul of two input-dtype tensors."""
    f32 = float32()
    return ops.matmul(a, b, output_type=f32, partials_type=f32)


def scores(cfg, q_i, k_j):
    """``scale * q_i k_j^T`` in float32 (grouped-query: one matmul per kv group over the folded
    rows of its q groups, :func:`fold_heads`).

    Args:
        q_i: ``[G, cq, D]``; k_j: ``[Gk, ckv, D]`` (input dtype).

    Returns:
        float32 ``[G, cq, ckv]``.
    """
    s = matmul_f32(fold_heads(cfg, q_i), k_j.transpose((0, 2, 1)))  # [Gk, r*cq, ckv]
    return unfold_heads(cfg, s) * cfg.scale


def to_input_dtype(cfg, t):
    """Cast a float32 tensor to the attention's input dtype (no op for float32)."""
    return t if cfg.dtype == "float32" else ops.cast(t, getattr(popxl, cfg.dtype))


def to_float32(t):
    """Cast an input-dtype tensor to float32 (no op when it already is)."""
    return t if t.dtype == popxl.float32 else ops.cast(t, popxl.float32)


def scalar(value, dtype):
    """A rank-0 constant of ``dtype`` in the current graph."""
    return popxl.constant(value, dtype=dtype)
