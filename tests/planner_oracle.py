"""Pure-numpy oracle of the block planner (``popxl_flash.plan.schedule.plan``).

Deliberately the dumb way round: build the dense visibility matrix of the padded grid, cut it
into blocks, classify each block by looking at all its elements, and deduplicate partial blocks
by their content (first seen in row-major block order gets the next id). Nothing here shares
logic with the C++ planner's closed-form diagonal-offset reasoning.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SKIP, FULL, PARTIAL = 0, 1, 2
WHOLE, LOWER, UPPER = 0, 1, 2


@dataclass(frozen=True, eq=False)
class OraclePlan:
    """Same fields as ``BlockSchedule`` (minus the arguments), plus the dense matrix.

    Attributes:
        dense: bool[nq * chunk_q, nkv * chunk_kv], True = visible (padding False).
        nq, nkv: block grid.
        kind: int8[nq, nkv]; pattern_id: int32[nq, nkv]; patterns: bool[P, chunk_q, chunk_kv];
        visited_per_q: int32[nq]; empty_rows: int32[E];
        split: int8[nq, nkv]; visible_elements, visited_blocks, full_blocks, partial_blocks,
        executed_elements: ints; lists: {"q_major"/"kv_major": dict of the flat block list}.
    """

    dense: np.ndarray
    nq: int
    nkv: int
    kind: np.ndarray
    pattern_id: np.ndarray
    patterns: np.ndarray
    split: np.ndarray
    visited_per_q: np.ndarray
    empty_rows: np.ndarray
    visible_elements: int
    visited_blocks: int
    full_blocks: int
    partial_blocks: int
    executed_elements: int
    lists: dict


def dense_visibility(Lq, Lkv, chunk_q, chunk_kv, causal=True, window=None):
    """bool[nq * chunk_q, nkv * chunk_kv]: row i sees column j (bottom-right aligned)."""
    nq, nkv = -(-Lq // chunk_q), -(-Lkv // chunk_kv)
    i = np.arange(nq * chunk_q)[:, None]
    j = np.arange(nkv * chunk_kv)[None, :]
    diagonal = i + (Lkv - Lq)  # the key column aligned with query row i
    visible = (i < Lq) & (j < Lkv)
    if causal:
        visible &= j <= diagonal
    left, right = (-1, -1) if window is None else (
        -1 if side is None else side for side in window
    )
    if left >= 0:
        visible &= diagonal - left <= j
    if right >= 0:
        visible &= j <= diagonal + right
    return visible


def oracle_plan(Lq, Lkv, chunk_q, chunk_kv, causal=True, window=None):
    """Plan by brute force over the dense matrix; see the module docstring."""
    dense = dense_visibility(Lq, Lkv, chunk_q, chunk_kv, causal, window)
    nq, nkv = dense.shape[0] // chunk_q, dense.shape[1] // chunk_kv
    blocks = dense.reshape(nq, chunk_q, nkv, chunk_kv).transpose(0, 2, 1, 3)  # [nq, nkv, cq, ckv]
    any_visible = blocks.any(axis=(2, 3))
    all_visible = blocks.all(axis=(2, 3))  # padding is invisible, so padded blocks are never all
    kind = np.where(all_visible, FULL, np.where(any_visible, PARTIAL, SKIP)).astype(np.int8)

    pattern_id = np.full((nq, nkv), -1, dtype=np.int32)
    ids = {}
    patterns = []
    for bi, bj in np.argwhere(kind == PARTIAL):  # argwhere is row-major
        content = blocks[bi, bj]
        key = content.tobytes()
        if key not in ids:
            ids[key] = len(patterns)
            patterns.append(content.copy())
        pattern_id[bi, bj] = ids[key]
    patterns = (
        np.stack(patterns) if patterns else np.zeros((0, chunk_q, chunk_kv), dtype=bool)
    )

    split, cells = _splits(blocks, kind, chunk_q, chunk_kv)
    row_counts = dense[:Lq].sum(axis=1)
    return OraclePlan(
        dense=dense,
        nq=nq,
        nkv=nkv,
        kind=kind,
        pattern_id=pattern_id,
        patterns=patterns,
        visited_per_q=(kind != SKIP).sum(axis=1).astype(np.int32),
        empty_rows=np.flatnonzero(row_counts == 0).astype(np.int32),
        visible_elements=int(row_counts.sum()),
        visited_blocks=int((kind != SKIP).sum()),
        full_blocks=int((kind == FULL).sum()),
        partial_blocks=int((kind == PARTIAL).sum()),
        executed_elements=int(cells[kind != SKIP].sum()),
        split=split,
        lists={order: _block_list(kind, pattern_id, split, order)
               for order in ("q_major", "kv_major")},
    )


def _splits(blocks, kind, chunk_q, chunk_kv):
    """Split code and executed cells per block, by looking at each quadrant's contents."""
    h, w = chunk_q // 2, chunk_kv // 2
    split = np.zeros(kind.shape, dtype=np.int8)
    cells = np.full(kind.shape, chunk_q * chunk_kv, dtype=np.int64)
    if h == 0 or w == 0:
        return split, cells
    for bi, bj in np.argwhere(kind == PARTIAL):
        content = blocks[bi, bj]
        if not content[:h, w:].any():
            split[bi, bj], cells[bi, bj] = LOWER, h * w + (chunk_q - h) * chunk_kv
        elif not content[h:, :w].any():
            split[bi, bj], cells[bi, bj] = UPPER, h * chunk_kv + (chunk_q - h) * (chunk_kv - w)
    return split, cells


def _block_list(kind, pattern_id, split, order):
    """The visited blocks in loop order, with first/last flags of their outer chunk."""
    grid = kind if order == "q_major" else kind.T
    entries = [(o, x) for o in range(grid.shape[0]) for x in range(grid.shape[1])
               if grid[o, x] != SKIP]
    outer = np.array([o for o, _ in entries], dtype=np.int64)
    ij = [(o, x) if order == "q_major" else (x, o) for o, x in entries]
    q_chunk = np.array([i for i, _ in ij], dtype=np.int32)
    kv_chunk = np.array([j for _, j in ij], dtype=np.int32)
    change = np.ones(len(entries) + 1, dtype=bool)
    change[1:-1] = outer[1:] != outer[:-1]
    return dict(
        q_chunk=q_chunk,
        kv_chunk=kv_chunk,
        kind=kind[q_chunk, kv_chunk].astype(np.int8),
        pattern_id=pattern_id[q_chunk, kv_chunk].astype(np.int32),
        split=split[q_chunk, kv_chunk].astype(np.int8),
        first=change[:-1].copy(),
        last=change[1:].copy(),
    )


# ---- eager step groups and row passes (the dense way, from the schedule's patterns) ---------


def eager_step_groups(schedule, order):
    """Step groups (``popxl_flash.plan.steps.step_groups``) by slicing every step's sub-block
    out of the dense block pattern and deduplicating the slices by their bytes: per-element
    work for every step, with no use of the planner's pattern keys.

    Returns:
        list of dicts (rows, cols, masked, q_row, kv_row, q_chunk, kv_chunk, pattern_id,
        patterns) in the planner's group order: unmasked first, larger shapes first.
    """
    blist = schedule.block_list(order)
    cq, ckv = schedule.chunk_q, schedule.chunk_kv
    h, w = cq // 2, ckv // 2
    subs = {WHOLE: [((0, cq), (0, ckv))], LOWER: [((0, h), (0, w)), ((h, cq), (0, ckv))],
            UPPER: [((0, h), (0, ckv)), ((h, cq), (w, ckv))]}
    items = {}
    for qc, kc, kind, pid, split in zip(blist.q_chunk, blist.kv_chunk, blist.kind,
                                        blist.pattern_id, blist.split):
        for (r0, r1), (c0, c1) in subs[int(split)]:
            pattern = None
            if kind != FULL:
                pattern = schedule.patterns[pid, r0:r1, c0:c1]
                if pattern.all():
                    pattern = None
            entry = items.setdefault((r1 - r0, c1 - c0, pattern is not None),
                                     dict(q_row=[], kv_row=[], q_chunk=[], kv_chunk=[], ids=[],
                                          distinct={}))
            entry["q_row"].append(int(qc) * cq + r0)
            entry["kv_row"].append(int(kc) * ckv + c0)
            entry["q_chunk"].append(int(qc))
            entry["kv_chunk"].append(int(kc))
            if pattern is not None:
                distinct = entry["distinct"]
                entry["ids"].append(distinct.setdefault(pattern.tobytes(),
                                                        (len(distinct), pattern))[0])
    groups = []
    for (rows, cols, masked), e in sorted(items.items(),
                                          key=lambda kv: (kv[0][2], -kv[0][0] * kv[0][1], kv[0])):
        group = dict(rows=rows, cols=cols, masked=masked, pattern_id=None, patterns=None)
        for name in ("q_row", "kv_row", "q_chunk", "kv_chunk"):
            group[name] = np.asarray(e[name], np.int32)
        if masked:
            group["pattern_id"] = np.asarray(e["ids"], np.int32)
            group["patterns"] = np.stack([p for _, p in sorted(e["distinct"].values(),
                                                                key=lambda x: x[0])])
        groups.append(group)
    return groups


def eager_row_passes(Lq, Lkv, chunk_q, causal=True, window=None):
    """Row passes (``popxl_flash.plan.steps.row_pass_plan``, one kv chunk) from the dense
    visibility: per q chunk its rows, the columns any row sees, the pattern on them (``None``
    if all visible) and the rows that see a key (``None`` if all do).

    Returns:
        list of dicts (rows, cols, pattern, seen).
    """
    dense = dense_visibility(Lq, Lkv, chunk_q, Lkv, causal, window)
    passes = []
    for r0 in range(0, Lq, chunk_q):
        r1 = min(r0 + chunk_q, Lq)
        visible = dense[r0:r1, :Lkv]
        columns = np.flatnonzero(visible.any(axis=0))
        if not columns.size:
            passes.append(dict(rows=(r0, r1), cols=(0, 0), pattern=None,
                               seen=np.zeros(r1 - r0, bool)))
            continue
        lo, hi = int(columns[0]), int(columns[-1]) + 1
        pattern = visible[:, lo:hi]
        seen = pattern.any(axis=1)
        passes.append(dict(rows=(r0, r1), cols=(lo, hi),
                           pattern=None if pattern.all() else pattern,
                           seen=None if seen.all() else seen))
    return passes
