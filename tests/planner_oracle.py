"""Pure-numpy oracle of the block planner (``popxl_flash.schedule.plan``).

Deliberately the dumb way round: build the dense visibility matrix of the padded grid, cut it
into blocks, classify each block by looking at all its elements, and deduplicate partial blocks
by their content (first seen in row-major block order gets the next id). Nothing here shares
logic with the C++ planner's closed-form diagonal-offset reasoning.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SKIP, FULL, PARTIAL = 0, 1, 2


@dataclass(frozen=True, eq=False)
class OraclePlan:
    """Same fields as ``BlockSchedule`` (minus the arguments), plus the dense matrix.

    Attributes:
        dense: bool[nq * chunk_q, nkv * chunk_kv], True = visible (padding False).
        nq, nkv: block grid.
        kind: int8[nq, nkv]; pattern_id: int32[nq, nkv]; patterns: bool[P, chunk_q, chunk_kv];
        visited_per_q: int32[nq]; empty_rows: int32[E];
        visible_elements, visited_blocks, full_blocks, partial_blocks: ints.
    """

    dense: np.ndarray
    nq: int
    nkv: int
    kind: np.ndarray
    pattern_id: np.ndarray
    patterns: np.ndarray
    visited_per_q: np.ndarray
    empty_rows: np.ndarray
    visible_elements: int
    visited_blocks: int
    full_blocks: int
    partial_blocks: int


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
    )
