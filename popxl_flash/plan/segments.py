"""Segment ids on the host side: the static facts of a call's segment inputs
(:class:`SegmentConfig`, part of the configuration) and the constants the graph code
(:mod:`popxl_flash.graph.segments`) and the cost model share. Numpy only."""
from dataclasses import dataclass

#: Columns of the per-chunk statistics table (:func:`chunk_stats`), int32:
#: ``SEG_MIN``/``SEG_MAX``: smallest/largest non-negative id in the chunk (``BIG``/``-1`` if the
#: chunk is all padding); ``PAD``: 1 if the chunk holds a padding row, else 0;
#: ``POS_LO``: the smallest position among rows with id ``SEG_MIN``; ``POS_HI``: the largest
#: position among rows with id ``SEG_MAX`` (so ``(SEG_MIN, POS_LO)`` and ``(SEG_MAX, POS_HI)``
#: bound the chunk's (id, position) pairs in lexicographic order).
STATS = ("SEG_MIN", "SEG_MAX", "PAD", "POS_LO", "POS_HI")
SEG_MIN, SEG_MAX, PAD, POS_LO, POS_HI = range(len(STATS))

#: Runtime block classes (:func:`classify_blocks`): no visible pair; every pair visible; mixed.
RT_SKIP, RT_FULL, RT_MASKED = 0, 1, 2

#: Stand-in for "larger than every id and position" (ids and positions are < 2**30).
BIG = 2 ** 30

#: Largest accepted sequence length with segments (positions and ids stay below ``BIG``).
MAX_LEN = BIG - 1


@dataclass(frozen=True)
class SegmentConfig:
    """Static facts about the segment inputs of one attention call.

    Attributes:
        q_groups: rows of ``q_segment_ids`` (``G`` or 1).
        kv_groups: rows of ``kv_segment_ids`` (``Gk`` or 1).
        positions: causal/window compare runtime positions (``q_positions``,
            ``kv_positions``) instead of row and column indices.
        table_steps: 0, or the steps of a run-time step table (an internal input of context
            parallelism: each replica's own list of the blocks it runs, int32 ``[V, 3]``
            rows ``(first q row, first kv column, block index q_chunk * nkv + kv_chunk)``,
            padded with blocks it skips); the pass then loops ``V`` times over it instead of
            the static schedule's blocks.
    """
    q_groups: int
    kv_groups: int
    positions: bool = False
    table_steps: int = 0
