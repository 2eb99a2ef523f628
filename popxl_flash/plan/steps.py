"""Loop steps of a pass, grouped by shape: one ``repeat`` loop per group (host-side, numpy).

Every visited block of a :class:`~popxl_flash.plan.schedule.BlockSchedule` runs as one step, or as
two when the planner splits it to skip an invisible quadrant (``LOWER``/``UPPER``: two
sub-blocks). The running state lives in full-length tensors the loops update in place (the
forward's ``m, l, acc``; the backward's ``dq, dk, dv``), so a step needs no state carried from
the previous one and the steps can run in any order. Steps are therefore grouped by what their
loop body computes: the sub-block shape ``rows x cols`` and whether a static mask pattern
applies. A group is one loop with one body and no conditional: full blocks (and sub-blocks whose
pattern is all visible) run unmasked; the others gather their pattern from the group's table of
distinct patterns by a per-step id.

Nothing here touches PopXL: the modules turn a :class:`StepGroup` into tables and a loop body,
and the cost model counts the same groups.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from popxl_flash.plan.schedule import FULL, LOWER, SKIP, UPPER


@dataclass(frozen=True, eq=False)
class StepGroup:
    """The steps of one loop: equal sub-block shape, masked or not.

    Attributes:
        rows, cols: the sub-block shape (q rows x kv columns).
        masked: whether a static pattern applies (``patterns`` and ``pattern_id`` are set).
        q_row, kv_row: ``int32[V]``, first q row and first kv column of each step.
        q_chunk, kv_chunk: ``int32[V]``, the block each step belongs to (runtime segment
            classes are per block).
        pattern_id: ``int32[V]`` index into ``patterns`` (``None`` unless masked).
        patterns: ``bool[P, rows, cols]`` distinct patterns, True = visible (``None`` unless
            masked).
    """

    rows: int
    cols: int
    masked: bool
    q_row: np.ndarray = field(repr=False)
    kv_row: np.ndarray = field(repr=False)
    q_chunk: np.ndarray = field(repr=False)
    kv_chunk: np.ndarray = field(repr=False)
    pattern_id: Optional[np.ndarray] = field(default=None, repr=False)
    patterns: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def steps(self) -> int:
        """Loop iterations of the group."""
        return int(self.q_row.shape[0])

    @property
    def cells(self) -> int:
        """(query, key) cells the group's matmuls run on."""
        return self.steps * self.rows * self.cols


def sub_blocks(chunk_q, chunk_kv, split):
    """Static ``((row0, row1), (col0, col1))`` ranges of the sub-blocks of a block.

    ``LOWER`` (top-right quadrant invisible): ``[0, h) x [0, w)`` and ``[h, cq) x [0, ckv)``;
    ``UPPER`` (bottom-left quadrant invisible): ``[0, h) x [0, ckv)`` and
    ``[h, cq) x [w, ckv)``; ``WHOLE``: the block (``h = cq // 2``, ``w = ckv // 2``).
    """
    cq, ckv = chunk_q, chunk_kv
    h, w = cq // 2, ckv // 2
    if split == LOWER:
        return (((0, h), (0, w)), ((h, cq), (0, ckv)))
    if split == UPPER:
        return (((0, h), (0, ckv)), ((h, cq), (w, ckv)))
    return (((0, cq), (0, ckv)),)


@functools.lru_cache(maxsize=256)
def _groups_cached(schedule, order):
    blist = schedule.block_list(order)
    cq, ckv = schedule.chunk_q, schedule.chunk_kv
    items = {}  # (rows, cols, masked) -> lists
    for qc, kc, kind, pid, split in zip(blist.q_chunk, blist.kv_chunk, blist.kind,
                                        blist.pattern_id, blist.split):
        for (r0, r1), (c0, c1) in sub_blocks(cq, ckv, int(split)):
            pattern = None
            if kind != FULL:
                pattern = schedule.patterns[pid, r0:r1, c0:c1]
                if pattern.all():
                    pattern = None
            key = (r1 - r0, c1 - c0, pattern is not None)
            entry = items.setdefault(key, ([], [], [], [], [], {}))
            q_row, kv_row, q_chunk, kv_chunk, ids, distinct = entry
            q_row.append(int(qc) * cq + r0)
            kv_row.append(int(kc) * ckv + c0)
            q_chunk.append(int(qc))
            kv_chunk.append(int(kc))
            if pattern is not None:
                ids.append(distinct.setdefault(pattern.tobytes(), (len(distinct), pattern))[0])
    groups = []
    for (rows, cols, masked), (q_row, kv_row, q_chunk, kv_chunk, ids, distinct) in \
            sorted(items.items(), key=lambda kv: (kv[0][2], -kv[0][0] * kv[0][1], kv[0])):
        arrays = [np.asarray(a, np.int32) for a in (q_row, kv_row, q_chunk, kv_chunk)]
        patterns = pattern_id = None
        if masked:
            pattern_id = np.asarray(ids, np.int32)
            patterns = np.stack([p for _, p in sorted(distinct.values(), key=lambda e: e[0])])
        for a in arrays + [x for x in (pattern_id, patterns) if x is not None]:
            a.setflags(write=False)
        groups.append(StepGroup(rows, cols, masked, *arrays, pattern_id=pattern_id,
                                patterns=patterns))
    return tuple(groups)


def step_groups(schedule, order="q_major"):
    """The loop groups of a pass (cached per schedule and order).

    Args:
        schedule: a :class:`~popxl_flash.plan.schedule.BlockSchedule`.
        order: the block list whose step order each group keeps (``"q_major"`` forward,
            ``"kv_major"`` backward).

    Returns:
        A tuple of :class:`StepGroup`: unmasked groups first, larger shapes first. Their cells
        sum to the schedule's ``executed_elements``.
    """
    return _groups_cached(schedule, order)


def single_block(schedule, segments=False):
    """Whether a pass of ``schedule`` is one block (one chunk each way, visited) and, without
    segment ids, runs as a straight line: no loop, no running state, the whole block at once
    (a split block is not split)."""
    return (schedule.nq == 1 and schedule.nkv == 1 and schedule.visited_blocks == 1
            and not segments)


#: Most q chunks a pass with one kv chunk runs as straight-line row passes
#: (:func:`row_passes`); the graph grows with them, so more run as loops.
MAX_ROW_PASSES = 8


def row_passes(schedule, segments=False):
    """Whether the passes of ``schedule`` run as straight-line **row passes**: one kv chunk
    and 2 to :data:`MAX_ROW_PASSES` q chunks, without segment ids. Each q chunk then sees every
    key it sees in one block: the forward runs the one-block pass on its rows and the columns
    they see (:func:`row_pass_plan`), the backward one inline step on the same; no loop."""
    return schedule.nkv == 1 and 1 < schedule.nq <= MAX_ROW_PASSES and not segments


@dataclass(frozen=True, eq=False)
class RowPass:
    """One q chunk's straight-line pass (:func:`row_pass_plan`).

    Attributes:
        rows: ``(r0, r1)``, its real q rows.
        cols: ``(lo, hi)``, the kv columns any of its rows sees (``lo == hi``: none).
        pattern: bool ``[r1 - r0, hi - lo]`` visibility, ``None`` where all is visible.
        seen: bool ``[r1 - r0]``, the rows that see a key, ``None`` where all do.
    """

    rows: tuple
    cols: tuple
    pattern: Optional[np.ndarray]
    seen: Optional[np.ndarray]


@functools.lru_cache(maxsize=256)
def row_pass_plan(schedule):
    """The row passes of a :func:`row_passes` schedule, in q order (cached per schedule, as
    :func:`step_groups`: the counts, the memory bound and the graph all read it).

    Returns:
        tuple of :class:`RowPass`.
    """
    passes = []
    for i in range(schedule.nq):
        r0 = i * schedule.chunk_q
        r1 = min(r0 + schedule.chunk_q, schedule.Lq)
        visible = _block_visibility(schedule, i)[: r1 - r0, : schedule.Lkv]
        columns = np.flatnonzero(visible.any(axis=0))
        if not columns.size:
            passes.append(RowPass((r0, r1), (0, 0), None, np.zeros(r1 - r0, bool)))
            continue
        lo, hi = int(columns[0]), int(columns[-1]) + 1
        pattern = visible[:, lo:hi]
        seen = pattern.any(axis=1)
        passes.append(RowPass((r0, r1), (lo, hi), None if pattern.all() else pattern,
                              None if seen.all() else seen))
    return tuple(passes)


def _block_visibility(schedule, i):
    kind = schedule.kind[i, 0]
    shape = (schedule.chunk_q, schedule.chunk_kv)
    if kind == SKIP:
        return np.zeros(shape, bool)
    if kind == FULL:
        return np.ones(shape, bool)
    return schedule.patterns[schedule.pattern_id[i, 0]]


def row_pass_cells(schedule):
    """(query, key) cells the row passes' matmuls run on."""
    return sum((p.rows[1] - p.rows[0]) * (p.cols[1] - p.cols[0])
               for p in row_pass_plan(schedule))


def runs_inline(group, segments=False):
    """Whether ``group`` runs inline, without a loop: one step, no segment ids (whose steps
    dispatch on runtime tables in a loop body)."""
    return group.steps == 1 and not segments


def loop_steps(schedule, segments=False):
    """Loop iterations (repeat-body executions) of one pass: one per visited block, two per
    split block, less the steps that run without a loop (:func:`single_block`,
    :func:`row_passes`, :func:`runs_inline`)."""
    if single_block(schedule, segments) or row_passes(schedule, segments):
        return 0
    return sum(group.steps for group in step_groups(schedule)
               if not runs_inline(group, segments))


def executed_cells(schedule, segments=False):
    """(query, key) cells the block matmuls of one pass run on: the schedule's executed
    elements, or the whole block for a :func:`single_block` pass (it does not split)."""
    if single_block(schedule, segments):
        return schedule.chunk_q * schedule.chunk_kv
    return schedule.executed_elements


def loops(schedule, segments=False):
    """``repeat`` loops of one pass: one per step group that does not run inline."""
    if single_block(schedule, segments):
        return 0
    return sum(not runs_inline(group, segments) for group in step_groups(schedule))
