"""PopXL graph helpers shared by the forward and backward modules, and their loops.

A pass runs one ``repeat`` loop per :class:`~popxl_flash.plan.steps.StepGroup` (steps of one
sub-block shape, masked or not): the body looks its step's offsets up in one int32 table (one
``dynamic_slice``: q row, kv row and, where a group has several distinct patterns, the pattern
id), slices the block's operands and its part of the running state, applies the pass's block
update and writes the state back in place. A group of one step runs inline, with static
offsets (no loop, no table). The state tensors enter every loop by reference and nothing else
reads them while a loop runs, so the lowering can alias them (PopART's AliasZeroCopy): a step
copies only its loop counter. There is no conditional unless segment ids are given (then: skip
the block, or run it, with a second level for runtime-full blocks where the cost model keeps
one; see :func:`_dispatch`). A pass of one block needs none of this: the modules build it as
a straight line (:meth:`popxl_flash.graph.module.AttentionModule.run_pass`). Everything here
is graph code: it runs inside the graph context of the module being built and uses only the
documented PopXL API.
"""
import contextlib
from dataclasses import dataclass
from typing import Callable, Tuple

import numpy as np

from popxl_flash.plan import costmodel, steps

from popxl_flash.graph import score_mods, segments
from popxl_flash.backend import popxl

ops = popxl.ops

#: Score given to masked elements when taking the running max, and the exponent of masked
#: probabilities (``exp`` of it is exactly 0): the lowest float32, so every finite score of a
#: visible element ranks above it. Finite on purpose: no ``exp(-inf + inf) = NaN``.
MASKED_SCORE = float(np.finfo(np.float32).min)
#: The initial running max ``m_i`` of the forward loops: half the lowest float32, so that
#: ``exp(m_old - m_new)`` is one ``sub`` and one ``exp`` without overflow (``m_old - m_new >=
#: MASKED_SCORE`` while the scores stay below ``2^127``): 0, or 1 while a row has seen nothing.
INITIAL_MAX = MASKED_SCORE / 2

#: dtype of the loop counters and table entries.
INDEX_DTYPE = np.int32


def float32():
    """The backend's float32 dtype (statistics and accumulators are always float32)."""
    return popxl.float32


def counter(value=0):
    """A loop counter constant ``[1]`` int32 in the current graph."""
    return popxl.constant(np.array([value], dtype=INDEX_DTYPE))


def pad_rows(t, padded_len, axis=1):
    """Pad ``axis`` of ``t`` (axis 1 of ``[G, L, D]``) with zeros to ``padded_len`` (no-op if
    equal)."""
    length = t.shape[axis]
    if padded_len == length:
        return t
    shape = list(t.shape)
    shape[axis] = padded_len - length
    zeros = ops.init(tuple(shape), t.dtype, init_type="zero")
    return ops.concat([t, zeros], axis=axis)


def unpad_rows(t, length, axis=1):
    """Keep the first ``length`` entries of ``axis`` of ``t`` (no-op if already that long; a
    static ``slice_``: a view)."""
    if t.shape[axis] == length:
        return t
    return ops.slice_(t, start=[0], stop=[length], axis=[axis])


def stack(ts):
    """``[X, ...]`` tensors of one shape stacked on a new axis 0 (one ``concat_`` of
    ``reshape_`` views: a view, no copy; PopART's ConcatInplace output aliases every input):
    operands (and state) that every step slices at the same rows, so that one slice serves
    them all. Read-only: the stack is never modified in place."""
    return ops.concat_([t.reshape_((1,) + tuple(t.shape)) for t in ts], axis=0)


def part(t, n):
    """Entry ``n`` of axis 0 of a :func:`stack` (``slice_`` and ``reshape_``: views)."""
    return ops.slice_(t, start=[n], stop=[n + 1], axis=[0]).reshape_(tuple(t.shape[1:]))


def columns(t, start, stop):
    """``t[..., start:stop]`` (a static ``slice_`` of the last axis: a view)."""
    return ops.slice_(t, start=[start], stop=[stop], axis=[t.rank - 1])


def entry(table, t):
    """``table[t]`` as int32 ``[1]`` for a step counter ``t [1]``."""
    return ops.dynamic_slice(table, t, axes=[0], sizes=[1], no_overlap=True)


def rows_may_see_nothing(cfg):
    """Whether some q row may see no key: the schedule's empty rows, or anything decided at
    run time (segment ids; a score modifier may mask scores to -inf). Otherwise every row's
    ``l >= 1`` and its lse is finite, and the passes select nothing for empty rows."""
    return bool(cfg.schedule.empty_rows.size) or cfg.segments is not None \
        or cfg.mods is not None


def seen_rows(cfg):
    """``None`` where every q row sees a key in the schedule, else the bool ``[1, Lq, 1]``
    constant of the rows that do (the schedule's ``empty_rows`` see none)."""
    empty = cfg.schedule.empty_rows
    if not empty.size:
        return None
    seen = np.ones((1, cfg.q_len, 1), bool)
    seen[0, empty, 0] = False
    return popxl.constant(seen)


def scale_folds(cfg):
    """Whether the softmax scale folds into k once per call (``k * scale``, so the block
    matmul gives the scaled scores and no step multiplies them): when that product is exact,
    a power of two of magnitude at most 1 (``1/sqrt(D)`` for D = 1, 4, 16, 64, 256; the sign
    is exact too). Other scales multiply each block's scores in float32."""
    mantissa, _ = np.frexp(abs(cfg.scale))
    return mantissa == 0.5 and abs(cfg.scale) <= 1.0


def scaled_k(cfg, k):
    """``k * scale`` in k's dtype where the scale folds (:func:`scale_folds`), else ``k``."""
    return k * cfg.scale if scale_folds(cfg) else k


def scaled_scores(cfg, s):
    """Block scores ``q_i k_j^T`` (float32) times the scale unless it was folded into k."""
    return s if scale_folds(cfg) else s * cfg.scale


@contextlib.contextmanager
def in_order(mode=True):
    """``popxl.in_sequence(mode)`` for the ops created inside, restored on an exception too.

    PopXL's ``in_sequence`` sets a flag of the global context and resets it after its
    ``yield`` without ``try``/``finally``: an exception inside would leave every later op of the
    program chained. Leaving this block always resumes PopXL's context manager normally. Only
    ops that must keep their order go inside: the loops that update the state in place, then,
    in a nested ``in_order(False)``, the ops that read the state after them (ordered after the
    loops, free among themselves).
    """
    context = popxl.in_sequence(mode)
    context.__enter__()
    try:
        yield mode
    finally:
        context.__exit__(None, None, None)


@dataclass(frozen=True)
class LoopSpec:
    """What one pass's loop step computes.

    Attributes:
        update: ``update(cfg, *state_slices, *operand_slices, *modifier_operands,
            visible=None) -> new state slices``, the per-block math
            (``online_softmax_update``, ``grad_block_update``; the modifier operands only with
            score modifiers, :mod:`popxl_flash.graph.score_mods`).
        state_axes: per state tensor (by reference, updated in place), ``(side, axis)``: the
            axis that runs over q rows (``"q"``) or kv rows (``"kv"``).
        operand_axes: per read-only operand, ``(side, axis)``: the axis sliced to the step's
            q rows or kv rows (2 for a stacked operand such as ``[k; v] [2, Gk, Lkv, D]``).
        backward: the backward pass (the cost model's dispatch choice weighs it).
    """

    update: Callable
    state_axes: Tuple[Tuple[str, int], ...]
    operand_axes: Tuple[Tuple[str, int], ...]
    backward: bool = False


def _table(values):
    """An int32 ``[V]`` (or ``[P, ...]``) constant of the current graph."""
    return popxl.constant(np.ascontiguousarray(values, dtype=INDEX_DTYPE))


def _slice(t, offset, axis, length):
    return ops.dynamic_slice(t, offset, axes=[axis], sizes=[length], no_overlap=True)


def _gathers_pattern(group):
    """Whether the steps of ``group`` look their pattern up (a masked group with more than one
    distinct pattern; one pattern is a constant of the body)."""
    return group.masked and group.patterns.shape[0] > 1


def _step_table(group):
    """int32 ``[V, 2 to 4]``: per step its first q row, first kv row, (where the group
    gathers its pattern) its pattern id and (a lean backward's group,
    :class:`popxl_flash.graph.lean.PieceGroup`) its first kv row within its kv piece; one
    ``dynamic_slice`` reads a step's row."""
    columns_ = [group.q_row, group.kv_row]
    if _gathers_pattern(group):
        columns_.append(group.pattern_id)
    if getattr(group, "kv_piece_row", None) is not None:
        columns_.append(group.kv_piece_row)
    return np.stack(columns_, axis=1)


def _step_entries(group, t, table=None):
    """The step's ``{"q": q offset, "kv": kv offset, "pattern": pattern id or None, "kvp":
    kv offset within its piece (lean groups)}``, int32 ``[1]`` each: one lookup of the step
    table's row ``t`` (the entries are views of it). ``table``: a run-time step table
    (:class:`popxl_flash.plan.segments.SegmentConfig`), whose third column, the block index,
    is read once per pass instead (:meth:`PassLoops.step_classes`)."""
    names = ["q", "kv"]
    if table is None:
        if _gathers_pattern(group):
            names.append("pattern")
        if getattr(group, "kv_piece_row", None) is not None:
            names.append("kvp")
        table = _table(_step_table(group))
    row = ops.dynamic_slice(table, t, axes=[0], sizes=[1], no_overlap=True)
    row = row.reshape_((row.shape[1],))
    entries = {n: ops.slice_(row, start=[c], stop=[c + 1], axis=[0])
               for c, n in enumerate(names)}
    entries.setdefault("pattern", None)
    return entries


def _pattern(group, pattern_id):
    """The step's static pattern, bool ``[1, rows, cols]`` (``None`` for unmasked groups): the
    group's one pattern (a constant), else one gather from its table of distinct patterns."""
    if not group.masked:
        return None
    patterns = popxl.constant(np.ascontiguousarray(group.patterns))  # [P, rows, cols]
    if pattern_id is None:
        return patterns
    return ops.dynamic_slice(patterns, pattern_id, axes=[0], sizes=[1], no_overlap=True)


def _masked_step(spec, cfg, n_state, n_seg, has_pattern, *inputs):
    """Branch of a segment-id step that runs: the block under its runtime mask (ANDed with the
    static pattern). Inputs: state slices, operand slices, segment operands, then the pattern.

    Returns:
        The new state slices.
    """
    n_in = len(inputs) - n_seg - int(has_pattern)
    seg_operands = inputs[n_in:n_in + n_seg]
    visible = segments.block_mask(cfg, seg_operands)
    if has_pattern:
        visible = ops.logical_and(inputs[-1], visible)
    return spec.update(cfg, *inputs[:n_in], visible=visible)


def _skipped_step(*state):
    """Branch of a segment-id step whose chunks share no segment: the state passes through."""
    return [ops.identity(x) for x in state]


def group_body(spec, cfg, group, state_specs, seg_specs, extra_specs, t, *operands):
    """Repeat body: one step of ``group``. Inputs: the step counter ``t [1]`` (carried), the
    read-only operands (by value: the lowering aliases them), the state tensors by reference
    (created here, :func:`popxl.graph_input`), then with segment ids the padded ids (and
    positions) and the group's runtime block classes, then with score modifiers their
    loop-invariant tensors (by value; :mod:`popxl_flash.graph.score_mods`), which each step turns
    into operands the update takes after its own. With segment ids the "segment" inputs end
    with the group's bool ``[V_g]`` runs table, then (two dispatch levels,
    :func:`second_level`) its runtime-full table.

    Returns:
        ``t + 1``.
    """
    state = [popxl.graph_input(shape, dtype, f"state{n}", by_ref=True)
             for n, (shape, dtype) in enumerate(state_specs)]
    seg = [popxl.graph_input(shape, dtype, f"segment{n}")
           for n, (shape, dtype) in enumerate(seg_specs)]
    extras = [popxl.graph_input(shape, dtype, f"modifier{n}")
              for n, (shape, dtype) in enumerate(extra_specs)]
    tables, step_table = [], None
    if seg:
        n_tables = 2 if second_level(spec, cfg, group) else 1
        seg, tables = seg[:-n_tables], [entry(x, t) for x in seg[-n_tables:]]
        if cfg.segments.table_steps:
            seg, step_table = seg[:-1], seg[-1]
    entries = _step_entries(group, t, step_table)
    block_step(spec, cfg, group, operands, state, entries["q"], entries["kv"],
               _pattern(group, entries["pattern"]), seg, tables, extras, entries.get("kvp"))
    return t + 1


def _cut(t, offset, axis, length):
    """``length`` entries of ``axis`` from ``offset``: a static ``slice_`` (a view) for an int
    offset, else a ``dynamic_slice`` at the int32 ``[1]`` tensor."""
    if isinstance(offset, int):
        return ops.slice_(t, start=[offset], stop=[offset + length], axis=[axis])
    return _slice(t, offset, axis, length)


def block_step(spec, cfg, group, operands, state, q_offset, kv_offset, visible, seg=(),
               tables=(), extras=(), kv_piece_offset=None):
    """One step of ``group``: the block's operand and state slices, its update, the state
    written back in place.

    Args:
        operands, state: the pass's operands and state tensors (in a loop body: its inputs).
        q_offset, kv_offset: the step's first q row and kv row, int32 ``[1]`` tensors (a
            loop step) or ints (a group of one step, run inline: static slices).
        visible: the step's static pattern or ``None``.
        seg, tables: with segment ids, the loop's segment tensors and the step's class
            entries (tensor offsets only).
        extras: with score modifiers, their prepared tensors.
        kv_piece_offset: the step's first kv row within its kv piece (state side ``"kvp"``:
            a lean backward's per-piece accumulator), int32 ``[1]`` or int.
    """
    lengths = {"q": group.rows, "kv": group.cols, "kvp": group.cols}
    offsets = {"q": q_offset, "kv": kv_offset, "kvp": kv_piece_offset}
    operand_slices = [_cut(x, offsets[side], axis, lengths[side])
                      for x, (side, axis) in zip(operands, spec.operand_axes)]
    state_slices = [_cut(x, offsets[side], axis, lengths[side])
                    for x, (side, axis) in zip(state, spec.state_axes)]
    if isinstance(q_offset, int):
        offsets = {"q": counter(q_offset), "kv": counter(kv_offset),
                   "kvp": None if kv_piece_offset is None else counter(kv_piece_offset)}
    seg_operands = []
    if seg:
        seg_operands = segments.step_operands(cfg, seg, offsets["q"], offsets["kv"],
                                              (group.rows, group.cols))
    if cfg.mods is not None:  # ALiBi, score_mod, dropout: operands after the update's own
        operand_slices += score_mods.step_operands(cfg, extras, offsets["q"], offsets["kv"],
                                                   (group.rows, group.cols), seg_operands)
    if not tables:
        new = spec.update(cfg, *state_slices, *operand_slices, visible=visible)
    else:
        new = _dispatch(spec, cfg, tables[0], tables[1] if len(tables) == 2 else None,
                        state_slices, [*operand_slices, *seg_operands], len(seg_operands),
                        visible)
    for x, (side, axis), value in zip(state, spec.state_axes, new):
        ops.dynamic_update_(x, offsets[side], value, axes=[axis], sizes=[value.shape[axis]],
                            no_overlap=True)


@dataclass(frozen=True)
class _RowStep:
    """The sub-block shape :func:`block_step` reads from a group: one row pass's."""
    rows: int
    cols: int


def row_steps(spec, cfg, operands, state, extras=()):
    """The steps of row passes (:func:`popxl_flash.plan.steps.row_passes`) inline, in q order:
    :func:`block_step` per q chunk on its rows and the kv columns they see (static offsets and
    a constant pattern), the state written back in place; chunks whose rows see nothing run
    nothing. Call inside :func:`in_order`.

    Args:
        spec: the pass's :class:`LoopSpec`; operands, state: the unpadded operands and state.
        extras: with score modifiers, their prepared tensors.
    """
    for rp in steps.row_pass_plan(cfg.schedule):
        (r0, r1), (lo, hi) = rp.rows, rp.cols
        if lo == hi:
            continue
        visible = None if rp.pattern is None else popxl.constant(rp.pattern[None])
        block_step(spec, cfg, _RowStep(r1 - r0, hi - lo), operands, state, r0, lo, visible,
                   extras=extras)


def _unmasked_step(spec, cfg, *inputs):
    """Branch of a segment-id step whose block is visible throughout at run time (class
    ``RT_FULL``) in a group without a static pattern: the unmasked update. Inputs: state
    slices, operand slices."""
    return spec.update(cfg, *inputs, visible=None)


def _run_step(spec, cfg, n_seg, *inputs):
    """Branch of a segment-id step of an unmasked group that runs, with two dispatch levels
    (:func:`popxl_flash.plan.costmodel.second_level`): the unmasked update if the block's runtime
    class is ``RT_FULL``, else the masked one. Inputs: state slices, operand slices, segment
    operands, then the step's bool ``[1]`` runtime-full flag."""
    *inputs, is_full = inputs
    ir = popxl.gcg().ir
    plain = inputs[:len(inputs) - n_seg]
    full = ir.create_graph(_unmasked_step, spec, cfg, *[x.spec for x in plain])
    n_state = len(spec.state_axes)
    masked = ir.create_graph(_masked_step, spec, cfg, n_state, n_seg, False,
                             *[x.spec for x in inputs])
    return ops.conditional(is_full, full, masked, then_inputs=plain, else_inputs=inputs)


def _dispatch(spec, cfg, runs, is_full, state_slices, operands, n_seg, visible):
    """The block runs if its bool ``[1]`` flag ``runs`` is set (runtime class not
    ``RT_SKIP``; one conditional; each branch receives only what it reads: the skip branch
    the state slices). The running branch takes the masked update (the static ``visible``
    pattern, if any, ANDed with the runtime mask), unless ``is_full`` is given (an unmasked
    group where the cost model keeps a second level, :func:`popxl_flash.plan.costmodel.
    second_level`): then it dispatches again, to the unmasked update for an ``RT_FULL``
    block."""
    ir = popxl.gcg().ir
    skip = ir.create_graph(_skipped_step, *[x.spec for x in state_slices])
    if is_full is not None:
        inputs = [*state_slices, *operands, is_full]
        run = ir.create_graph(_run_step, spec, cfg, n_seg, *[x.spec for x in inputs])
    else:
        inputs = [*state_slices, *operands] + ([visible] if visible is not None else [])
        run = ir.create_graph(_masked_step, spec, cfg, len(state_slices), n_seg,
                              visible is not None, *[x.spec for x in inputs])
    return ops.conditional(runs, run, skip, then_inputs=inputs, else_inputs=state_slices)


def second_level(spec, cfg, group):
    """Whether segment-id steps of ``group`` dispatch twice (the cost model's choice,
    :func:`popxl_flash.plan.costmodel.second_level`)."""
    return costmodel.second_level(group, groups=cfg.groups, head_dim=cfg.head_dim,
                                  dtype=cfg.dtype, backward=spec.backward,
                                  segments=cfg.segments, kv_groups=cfg.kv_groups,
                                  causal=cfg.causal, window=cfg.window)


class _RuntimeGroup:
    """The one step group of a pass driven by a run-time step table: the static group's
    body (its shape, unmasked) run ``steps`` times over the table's rows."""

    def __init__(self, group, steps):
        self.group, self.steps = group, steps
        self.rows, self.cols, self.masked = group.rows, group.cols, False
        self.patterns = self.pattern_id = None
        self.runtime = True


def _runtime(group):
    return getattr(group, "runtime", False)


def _runtime_groups(cfg, groups):
    """With a run-time step table (:class:`popxl_flash.plan.segments.SegmentConfig`), the
    static schedule's one group as a :class:`_RuntimeGroup`; else ``groups``."""
    if cfg.segments is None or not cfg.segments.table_steps:
        return groups
    if len(groups) != 1 or groups[0].masked or groups[0].rows != cfg.chunk_q \
            or groups[0].cols != cfg.chunk_kv:
        raise ValueError("a run-time step table needs a static schedule of whole unmasked "
                         "blocks (positions carry the mask; chunks dividing the lengths)")
    return [_RuntimeGroup(groups[0], cfg.segments.table_steps)]


class PassLoops:
    """The loop bodies of one pass: one graph per :class:`~popxl_flash.plan.steps.StepGroup`
    of more than one step (a group of one step runs inline, :func:`inline`).

    Create them before the ops that need ordering (graph creation must not run inside
    :func:`in_order`, which would chain the bodies' ops too), then :meth:`run` them inside it.

    Args:
        spec: the :class:`LoopSpec`.
        cfg: the :class:`AttentionConfig`.
        order: ``"q_major"`` or ``"kv_major"``: the step order within each group.
        operands: the read-only operand tensors (specs used).
        state: the state tensors (specs used).
        seg: with segment ids, the padded ids (and positions) (specs used).
        extras: with score modifiers, their prepared loop-invariant tensors (specs used).
    """

    def __init__(self, spec, cfg, order, operands, state, seg=(), extras=()):
        self.cfg, self.spec = cfg, spec
        self.groups = _runtime_groups(cfg, steps.step_groups(cfg.schedule, order))
        self.step_table = seg[-1] if cfg.segments is not None and cfg.segments.table_steps \
            else None
        ir = popxl.gcg().ir
        # (shape, dtype) pairs, not specs: create_graph would make graph inputs of specs
        state_specs = tuple((t.shape, t.dtype) for t in state)
        seg_specs = tuple((t.shape, t.dtype) for t in seg)
        extra_specs = tuple((t.shape, t.dtype) for t in extras)
        self.graphs = []
        for group in self.groups:
            if inline(group, seg_specs):
                self.graphs.append(None)
                continue
            extra = ()
            if seg_specs:
                n_tables = 2 if second_level(spec, cfg, group) else 1
                extra = seg_specs + (((group.steps,), popxl.bool),) * n_tables
            self.graphs.append(ir.create_graph(
                group_body, spec, cfg, group, state_specs, extra, extra_specs,
                popxl.TensorSpec((1,), popxl.int32), *[t.spec for t in operands]))

    def step_classes(self, classes):
        """Per group, its steps' bool ``[V_g]`` tables: the block runs (runtime class not
        ``RT_SKIP``), then with two dispatch levels (:func:`second_level`) the block is
        ``RT_FULL`` (one gather per group and a comparison or two, outside the loops);
        ``[None, ...]`` without segment ids."""
        if classes is None:
            return [None] * len(self.groups)
        out = []
        for g in self.groups:
            if _runtime(g):  # the table's third column: each step's block index
                index = ops.slice(self.step_table, start=[2], stop=[3], axis=[1])
                nq, nkv = classes.shape
                cls = ops.gather(classes.reshape((nq * nkv,)), index.reshape((g.steps,)))
            else:
                cls = segments.step_classes(classes, g.q_chunk, g.kv_chunk)  # int32 [V_g]
            tables = [ops.greater(cls, popxl.constant(np.array(segments.RT_SKIP, INDEX_DTYPE)))]
            if second_level(self.spec, self.cfg, g):
                tables.append(ops.equal(cls, popxl.constant(np.array(segments.RT_FULL,
                                                                     INDEX_DTYPE))))
            out.append(tables)
        return out

    def run(self, operands, state, seg=(), step_classes=None, extras=()):
        """One ``repeat`` per group, updating ``state`` in place (call inside
        :func:`in_order`)."""
        step_classes = step_classes or [None] * len(self.groups)
        for group, graph, tables in zip(self.groups, self.graphs, step_classes):
            if graph is None:  # one step: inline, static offsets
                block_step(self.spec, self.cfg, group, operands, state, int(group.q_row[0]),
                           int(group.kv_row[0]), _pattern(group, None), extras=extras)
                continue
            extra = list(seg) + list(tables or [])
            ops.repeat(graph, group.steps, counter(0), *operands, *state, *extra, *extras)


def inline(group, seg=()):
    """Whether ``group`` runs inline, without a loop (:func:`popxl_flash.plan.steps.
    runs_inline`: one step and no segment ids)."""
    return steps.runs_inline(group, bool(seg))


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
    shape = (cfg.kv_groups, r * rows, x)
    return t.reshape_(shape)


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


def scores(cfg, q_i, k_t):
    """``scale * q_i k_j^T`` in float32 (grouped-query: one matmul per kv group over the folded
    rows of its q groups, :func:`fold_heads`; the scale folded into k once per call where that
    is exact, :func:`scale_folds`, else multiplied here). The place for score modifications.

    Args:
        q_i: ``[G, rows, D]``; k_t: ``k_j^T [Gk, D, cols]`` (input dtype; a view of the step's
            ``k_j``).

    Returns:
        float32 ``[G, rows, cols]``.
    """
    s = matmul_f32(fold_heads(cfg, q_i), k_t)  # [Gk, r*rows, cols]
    return scaled_scores(cfg, unfold_heads(cfg, s))


def to_input_dtype(cfg, t):
    """Cast a float32 tensor to the attention's input dtype (no op for float32)."""
    return t if cfg.dtype == "float32" else ops.cast(t, getattr(popxl, cfg.dtype))


def to_float32(t):
    """Cast an input-dtype tensor to float32 (no op when it already is)."""
    return t if t.dtype == popxl.float32 else ops.cast(t, popxl.float32)


def scalar(value, dtype):
    """A rank-0 constant of ``dtype`` in the current graph."""
    return popxl.constant(value, dtype=dtype)


def join(pieces, axis):
    """Pieces of one result joined on ``axis``: one ``concat_`` (a view of the pieces, no
    copy; PopART's ConcatInplace), or the piece itself when there is one."""
    return pieces[0] if len(pieces) == 1 else ops.concat_(pieces, axis=axis)
