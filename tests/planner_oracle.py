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
