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

from popxl_flash.plan.schedule import FULL, LOWER, UPPER, key_cells


@dataclass(frozen=True, eq=False)
class StepGroup:
    """The steps of one loop: equal sub-block shape, masked or not.

    Attributes:
        rows, cols: the sub-block shape (q rows x kv columns).
        masked: whether a static pattern applies (``pattern_keys`` and ``pattern_id`` are set).
        q_row, kv_row: ``int32[V]``, first q row and first kv column of each step.
        q_chunk, kv_chunk: ``int32[V]``, the block each step belongs to (runtime segment
            classes are per block).
        pattern_id: ``int32[V]`` index into ``patterns`` (``None`` unless masked).
        pattern_keys: ``int64[P, 4]`` canonical keys of the group's distinct patterns
            (:attr:`popxl_flash.plan.schedule.BlockSchedule.pattern_keys`; ``rows' == 0``: a
            sub-block with nothing visible), in id order (``None`` unless masked).
    """

    rows: int
    cols: int
    masked: bool
    q_row: np.ndarray = field(repr=False)
    kv_row: np.ndarray = field(repr=False)
    q_chunk: np.ndarray = field(repr=False)
    kv_chunk: np.ndarray = field(repr=False)
    pattern_id: Optional[np.ndarray] = field(default=None, repr=False)
    pattern_keys: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def steps(self) -> int:
        """Loop iterations of the group."""
        return int(self.q_row.shape[0])

    @property
    def cells(self) -> int:
        """(query, key) cells the group's matmuls run on."""
        return self.steps * self.rows * self.cols

    @property
    def num_patterns(self) -> int:
        """P, the group's distinct patterns (0 unless masked), without building them."""
        return 0 if self.pattern_keys is None else int(self.pattern_keys.shape[0])

    @functools.cached_property
    def patterns(self) -> Optional[np.ndarray]:
        """``bool[P, rows, cols]`` distinct patterns, True = visible (``None`` unless masked);
        read-only, built from the keys on first access (the graph code's) and kept."""
        if self.pattern_keys is None:
            return None
        cells = np.stack([key_cells(self.rows, self.cols, k) for k in self.pattern_keys])
        cells.flags.writeable = False
        return cells


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


#: Sub-block codes: ``2 * split + k`` for the ``k``-th sub-block of a ``split`` block.
_SUB_CODES = 6


def _sub_table(chunk_q, chunk_kv):
    """``int64[6, 4]``: the ``(row0, row1, col0, col1)`` of each sub-block code (unused codes
    are zero)."""
    table = np.zeros((_SUB_CODES, 4), np.int64)
    for split in (0, LOWER, UPPER):
        for k, ((r0, r1), (c0, c1)) in enumerate(sub_blocks(chunk_q, chunk_kv, split)):
            table[2 * split + k] = (r0, r1, c0, c1)
    return table


def _sub_steps(split):
    """Every step of a block list, in order (a split block's two steps consecutive).

    Args:
        split: ``int8[V]`` of the block list.

    Returns:
        ``(block, code)``: ``int32[S]`` the block of each step and ``int8[S]`` its sub-block
        code (:func:`_sub_table`).
    """
    if not split.any():  # no split block: one step per block
        return np.arange(split.shape[0], dtype=np.int32), np.zeros(split.shape[0], np.int8)
    count = np.where(split == 0, 1, 2)
    block = np.repeat(np.arange(split.shape[0], dtype=np.int32), count)
    code = 2 * split[block]
    code[1:] += (block[1:] == block[:-1])  # the second sub-block of a split block
    return block, code


def _sub_keys(keys, ranges):
    """Canonical keys (the planner's, ``cpp/planner.cpp``) of sub-blocks of patterns.

    Args:
        keys: ``int64[S, 4]`` the block pattern of each step; ranges: ``int64[S, 4]`` its
            sub-block ``(row0, row1, col0, col1)``.

    Returns:
        ``int64[S, 4]``: the key of each step's sub-pattern in sub-block coordinates, ``(0, 0,
        0, -1)`` where it holds nothing (equal keys <=> equal contents).
    """
    r0, r1, c0, c1 = ranges.T
    rows = np.minimum(keys[:, 0] - r0, r1 - r0)
    cols = np.minimum(keys[:, 1] - c0, c1 - c0)
    lo = np.maximum(keys[:, 2] - (c0 - r0), 1 - rows)
    hi = np.minimum(keys[:, 3] - (c0 - r0), cols - 1)
    empty = (rows <= 0) | (cols <= 0) | (lo > hi)
    last_row = np.minimum(rows - 1, cols - 1 - lo)
    last_col = np.minimum(cols - 1, last_row + hi)
    out = np.stack([last_row + 1, last_col + 1, lo, hi], axis=1)
    out[:, 2] = np.maximum(lo, 1 - out[:, 0])
    out[:, 3] = np.minimum(hi, out[:, 1] - 1)
    out[empty] = (0, 0, 0, -1)
    return out


def _first_seen_ids(keys):
    """``(ids, distinct)``: ``int32[S]`` ids of ``int64[S, 4]`` keys in first-seen order and
    the distinct keys ``int64[P, 4]`` by id (one stable lexicographic sort)."""
    order = np.lexsort(keys.T[::-1])  # stable: equal keys keep their step order
    ordered = keys[order]
    new = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)]
    run = np.cumsum(new) - 1  # run of equal keys of each sorted step
    first = order[new]  # each run's first step
    rank = np.empty(first.shape[0], np.int64)
    rank[np.argsort(first)] = np.arange(first.shape[0])
    ids = np.empty(keys.shape[0], np.int32)
    ids[order] = rank[run]
    return ids, keys[np.sort(first)]


def _step_masks(schedule, blist, block, code, table):
    """Which steps are masked, and their sub-pattern keys (:func:`_sub_keys`).

    Returns:
        ``(masked, keys)``: ``bool[S]``, and ``int64[S, 4]`` (rows of unmasked steps unused;
        ``None`` when no step is masked).
    """
    partial = np.flatnonzero(blist.kind[block] != FULL)  # steps of partial blocks
    ranges = table[code[partial]]
    keys = _sub_keys(schedule.pattern_keys[blist.pattern_id[block[partial]]], ranges)
    rows, cols = ranges[:, 1] - ranges[:, 0], ranges[:, 3] - ranges[:, 2]
    all_visible = ((keys[:, 0] == rows) & (keys[:, 1] == cols) & (keys[:, 2] == 1 - rows)
                   & (keys[:, 3] == cols - 1))
    masked = np.zeros(block.shape[0], bool)
    masked[partial[~all_visible]] = True
    if not masked.any():
        return masked, None
    step_keys = np.zeros((block.shape[0], 4), np.int64)
    step_keys[partial] = keys
    return masked, step_keys


def _group_order(table):
    """``[((rows, cols), masked, codes)]`` of the possible groups in loop order (unmasked
    first, larger shapes first), ``codes`` the sub-block codes of that shape."""
    codes = {}
    for c in range(_SUB_CODES):
        r0, r1, c0, c1 = (int(v) for v in table[c])
        if r1 > r0:
            codes.setdefault((r1 - r0, c1 - c0), []).append(c)
    keys = sorted(((shape, m) for shape in codes for m in (False, True)),
                  key=lambda k: (k[1], -k[0][0] * k[0][1], k))
    return [(shape, m, codes[shape]) for shape, m in keys]


@functools.lru_cache(maxsize=256)
def _groups_cached(schedule, order):
    """Vectorised over the block list (O(blocks)); no pattern cells are built."""
    blist = schedule.block_list(order)
    table = _sub_table(schedule.chunk_q, schedule.chunk_kv)
    block, code = _sub_steps(blist.split)
    masked, keys = _step_masks(schedule, blist, block, code, table)
    groups = []
    for (rows, cols), m, codes in _group_order(table):
        steps = np.flatnonzero(np.isin(code, codes) & (masked == m))
        if not steps.size:
            continue
        q_chunk, kv_chunk = blist.q_chunk[block[steps]], blist.kv_chunk[block[steps]]
        arrays = [(q_chunk * schedule.chunk_q + table[code[steps], 0]).astype(np.int32),
                  (kv_chunk * schedule.chunk_kv + table[code[steps], 2]).astype(np.int32),
                  q_chunk, kv_chunk]
        pattern_id = pattern_keys = None
        if m:
            pattern_id, pattern_keys = _first_seen_ids(keys[steps])
            arrays += [pattern_id, pattern_keys]
        for a in arrays:
            a.setflags(write=False)
        groups.append(StepGroup(rows, cols, m, *arrays[:4], pattern_id=pattern_id,
                                pattern_keys=pattern_keys))
    return tuple(groups)


def step_groups(schedule, order="q_major"):
    """The loop groups of a pass (cached per schedule and order), in O(blocks) host time
    and memory: a masked group's distinct patterns are deduplicated by their canonical keys,
    and their cells (:attr:`StepGroup.patterns`) are built only when read.

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
        masked: whether some cell of ``rows x cols`` is invisible (``pattern`` is set).
        seen_rows: ``(s0, s1)``, the local rows that see a key (one contiguous run; ``s0 ==
            s1``: none).
        diagonals: ``(low, high)``: local cell ``(r, c)`` is visible iff ``low <= c - r <=
            high`` (within ``rows x cols``).
    """

    rows: tuple
    cols: tuple
    masked: bool
    seen_rows: tuple
    diagonals: tuple = field(repr=False)

    @property
    def all_seen(self) -> bool:
        """Whether every row sees a key (``seen`` is ``None``)."""
        return self.seen_rows == (0, self.rows[1] - self.rows[0])

    @functools.cached_property
    def pattern(self) -> Optional[np.ndarray]:
        """bool ``[r1 - r0, hi - lo]`` visibility, ``None`` where all is visible (built on
        first access, read-only)."""
        if not self.masked:
            return None
        shape = (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])
        cells = key_cells(*shape, shape + tuple(self.diagonals))
        cells.flags.writeable = False
        return cells

    @functools.cached_property
    def seen(self) -> Optional[np.ndarray]:
        """bool ``[r1 - r0]``, the rows that see a key, ``None`` where all do (built on first
        access, read-only)."""
        if self.all_seen:
            return None
        seen = np.zeros(self.rows[1] - self.rows[0], bool)
        seen[self.seen_rows[0]:self.seen_rows[1]] = True
        seen.flags.writeable = False
        return seen

    @property
    def pattern_nbytes(self) -> int:
        """Bytes of ``pattern`` (0 where it is ``None``), without building it."""
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0]) * self.masked

    @property
    def seen_nbytes(self) -> int:
        """Bytes of ``seen`` (0 where it is ``None``), without building it."""
        return 0 if self.all_seen else self.rows[1] - self.rows[0]


@functools.lru_cache(maxsize=256)
def row_pass_plan(schedule):
    """The row passes of a :func:`row_passes` schedule, in q order (cached per schedule, as
    :func:`step_groups`: the counts, the memory bound and the graph all read it). Closed form
    per q chunk (each row sees one contiguous band of keys, its ends non-decreasing with the
    row), so O(q chunks); the patterns are built only when read.

    Returns:
        tuple of :class:`RowPass`.
    """
    low, high = schedule.diagonal_band()
    shift = schedule.Lkv - schedule.Lq

    def first(i):  # first column row i sees
        return 0 if low is None else max(0, i + shift + low)

    def last(i):  # last column row i sees
        return schedule.Lkv - 1 if high is None else min(schedule.Lkv - 1, i + shift + high)

    passes = []
    for i in range(schedule.nq):
        r0 = i * schedule.chunk_q
        r1 = min(r0 + schedule.chunk_q, schedule.Lq)
        f = max(r0, schedule.empty_rows_before)  # the rows that see a key: [f, e)
        e = min(r1, schedule.empty_rows_from)
        if f >= e:
            passes.append(RowPass((r0, r1), (0, 0), False, (0, 0), (0, -1)))
            continue
        lo, hi = first(f), last(e - 1) + 1
        all_seen = (f, e) == (r0, r1)
        masked = not (all_seen and first(r1 - 1) == lo and last(r0) == hi - 1)
        offset = shift + r0 - lo  # local c - r = j - i - shift - offset
        rows, cols = r1 - r0, hi - lo
        diagonals = (-rows if low is None else low + offset,
                     cols if high is None else high + offset)
        passes.append(RowPass((r0, r1), (lo, hi), masked, (f - r0, e - r0), diagonals))
    return tuple(passes)


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


#: Most pieces a memory-lean pass (:func:`lean_pieces`) cuts its full-length float32 work into.
LEAN_PIECES = 8


def lean_pieces(num_chunks):
    """Chunk ranges ``[(c0, c1)]`` of the memory-lean passes' pieces: at most
    :data:`LEAN_PIECES` runs of ``ceil(num_chunks / LEAN_PIECES)`` whole chunks (the last may
    hold fewer). The lean forward normalises its output one q piece at a time; the lean
    backward accumulates dk and dv one kv piece at a time and writes them out before the next
    (FlashAttention-2's kv-major order), so a pass holds one piece of those float32 tensors,
    not all of them.

    Returns:
        ``[(first chunk, end chunk)]``.
    """
    per = -(-num_chunks // LEAN_PIECES)
    return [(c, min(c + per, num_chunks)) for c in range(0, num_chunks, per)]


def lean_piece_rows(num_chunks, chunk, length):
    """The rows ``[(r0, r1)]`` of :func:`lean_pieces` over an unpadded ``length``."""
    return [(c0 * chunk, min(c1 * chunk, length)) for c0, c1 in lean_pieces(num_chunks)]


def lean_step_ranges(group, num_chunks_kv):
    """Per kv piece (:func:`lean_pieces` of the kv chunks), the range ``(start, stop)`` of a
    kv-major group's steps in it: a kv-major group lists its steps by kv chunk, so a piece's
    steps are consecutive.

    Returns:
        ``[(start, stop)]``, one per piece.
    """
    bounds = [c0 for c0, _ in lean_pieces(num_chunks_kv)] + [num_chunks_kv]
    index = np.searchsorted(group.kv_chunk, bounds, side="left")
    return [(int(a), int(b)) for a, b in zip(index[:-1], index[1:])]


def lean_piece_offsets(group, num_chunks_kv, chunk_kv):
    """``int32[V]``: each step's first kv row within its kv piece's accumulator."""
    per = -(-num_chunks_kv // LEAN_PIECES)
    return (group.kv_row - (group.kv_chunk // per) * per * chunk_kv).astype(np.int32)
