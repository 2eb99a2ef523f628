"""Static block schedule of a FlashAttention mask: the Python face of the compiled planner.

Each pass iterates the flat list of visited blocks (forward q-major, backward kv-major), in
one loop per group of same-shaped steps (:mod:`popxl_flash.plan.steps`). For every block (q chunk
``i``, kv chunk ``j``) the schedule says whether to skip it, run it unmasked (full) or run it
with one of a few deduplicated mask patterns (partial). It is computed on the host at
graph-build time by ``popxl_flash._planner`` (C++, ``cpp/planner.cpp``) and cached, so every layer
of a transformer that asks for the same shape gets the same :class:`BlockSchedule` object.

Visibility is bottom-right aligned (FlashAttention >= 2.1). With ``shift = Lkv - Lq``, query row
``i`` sees key column ``j`` iff all of

* ``causal``:               ``j <= i + shift``
* ``window=(left, right)``: ``i + shift - left <= j`` (if ``left >= 0``) and
  ``j <= i + shift + right`` (if ``right >= 0``); ``-1``/``None`` = unbounded on that side.

For example (1 = visible), causal with ``Lq=2, Lkv=5`` and with ``Lq=5, Lkv=2``::

    1 1 1 1 0        0 0
    1 1 1 1 1        0 0
                     0 0
                     1 0
                     1 1

The sequences are cut into ``nq = ceil(Lq / chunk_q)`` and ``nkv = ceil(Lkv / chunk_kv)`` chunks;
the last chunk may be a padded tail whose padding rows/columns are never visible (so a padded
block is never full).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

SKIP, FULL, PARTIAL = 0, 1, 2
"""Values of :attr:`BlockSchedule.kind`."""

WHOLE, LOWER, UPPER = 0, 1, 2
"""Values of :attr:`BlockSchedule.split`: how a visited block runs. With ``h = chunk_q // 2`` and
``w = chunk_kv // 2``: ``WHOLE`` = one ``chunk_q x chunk_kv`` block (every full block);
``LOWER`` = a partial block whose top-right quadrant (rows < h, cols >= w) is invisible, run as
the sub-blocks ``[0, h) x [0, w)`` and ``[h, chunk_q) x [0, chunk_kv)`` (a causal diagonal);
``UPPER`` = a partial block whose bottom-left quadrant is invisible, run as ``[0, h) x [0,
chunk_kv)`` and ``[h, chunk_q) x [w, chunk_kv)`` (a window's left edge)."""

ORDERS = ("q_major", "kv_major")
"""Block-list orders: ``q_major`` (forward: q chunk outer) and ``kv_major`` (backward)."""

UNBOUNDED = -1
"""Window side meaning "no bound on this side" (FlashAttention's spelling)."""

_INT32_MAX = np.iinfo(np.int32).max
_FLOAT32_BYTES = np.dtype(np.float32).itemsize

# Matmul FLOPs per (query row, key column, head-dim) element, 2 FLOPs (mul + add) per matmul:
_FORWARD_MATMULS = 2    # S = Q K^T, O += P V
_BACKWARD_MATMULS = 5   # S = Q K^T, dV += P^T dO, dP = dO V^T, dQ += dS K, dK += dS^T Q
_FLOPS_PER_MAC = 2

__all__ = [
    "SKIP",
    "FULL",
    "PARTIAL",
    "UNBOUNDED",
    "WHOLE",
    "LOWER",
    "UPPER",
    "BlockSchedule",
    "BlockList",
    "FlopCount",
    "MemoryEstimate",
    "key_cells",
    "normalise_window",
    "plan",
]


@dataclass(frozen=True)
class FlopCount:
    """Matmul FLOPs of one attention pass.

    Attributes:
        executed: FLOPs of the block matmuls actually run (every visited block, whole block).
        useful: FLOPs on visible (query, key) pairs only.
    """

    executed: int
    useful: int

    @property
    def ratio(self) -> float:
        """``executed / useful`` (>= 1; 1.0 means no wasted work, and when both are 0)."""
        if self.useful == 0:
            return 1.0
        return self.executed / self.useful


@dataclass(frozen=True)
class MemoryEstimate:
    """Analytic activation-byte estimate (see :meth:`BlockSchedule.memory_bytes`).

    Attributes:
        flash: bytes live in the blocked (flash) computation.
        naive: bytes live in naive attention that materialises the full score matrix.
    """

    flash: int
    naive: int

    @property
    def ratio(self) -> float:
        """``naive / flash``: how many times less memory the flash computation needs."""
        return self.naive / self.flash


@dataclass(frozen=True, eq=False)
class BlockSchedule:
    """The static block schedule of one (Lq, Lkv, chunk_q, chunk_kv, causal, window).

    Immutable and shared (``plan`` caches it): the numpy arrays are read-only. Equality is
    identity; compare fields explicitly if needed.

    Planning is O(blocks) in host time and memory: the planner returns per-block tables, the
    block lists and closed-form counts, and a canonical key per distinct pattern. The dense
    cells (:attr:`patterns`, :meth:`pattern`) and the rows that see nothing
    (:attr:`empty_rows`) are built on first access only (by the graph code, for the schedule
    it builds); the cost model reads :attr:`num_patterns`, :attr:`patterns_nbytes` and
    :attr:`num_empty_rows` instead.

    Attributes:
        Lq: query length (int).
        Lkv: key/value length (int).
        chunk_q: query rows per block (int, 1..Lq).
        chunk_kv: key columns per block (int, 1..Lkv).
        causal: bottom-right aligned causal mask (bool).
        window: ``(left, right)`` tuple of ints, ``-1`` = unbounded on that side;
            ``(-1, -1)`` = no window.
        nq: number of q chunks, ``ceil(Lq / chunk_q)`` (int).
        nkv: number of kv chunks, ``ceil(Lkv / chunk_kv)`` (int).
        kind: ``int8[nq, nkv]``; ``SKIP`` (0, nothing visible), ``FULL`` (1, every element
            visible, no padding) or ``PARTIAL`` (2, masked by a pattern).
        pattern_id: ``int32[nq, nkv]``; index into ``patterns`` for partial blocks, -1 elsewhere.
            Ids are given in first-seen row-major block order.
        pattern_keys: ``int64[P, 4]``; the canonical key ``(rows, cols, lo, hi)`` of each
            distinct pattern: it holds local cell ``(r, c)`` iff ``r < rows``, ``c < cols``
            and ``lo <= c - r <= hi`` (equal keys <=> equal contents; ``cpp/planner.cpp``).
        split: ``int8[nq, nkv]``; ``WHOLE``, ``LOWER`` or ``UPPER`` (how a partial block is cut
            into two sub-blocks to skip an invisible quadrant; ``WHOLE`` for full and skip blocks).
        visited_per_q: ``int32[nq]``; non-skip blocks in each q chunk row.
        empty_rows_before, empty_rows_from: the real query rows that see no key at all (their
            output is 0 and their lse -inf) are ``[0, empty_rows_before)`` and
            ``[empty_rows_from, Lq)`` (ints; every row sees one contiguous band of keys).
        visible_elements: number of visible (query, key) pairs (int).
        visited_blocks: number of non-skip blocks, ``full_blocks + partial_blocks`` (int).
        full_blocks: number of ``FULL`` blocks (int).
        partial_blocks: number of ``PARTIAL`` blocks (int).
        executed_elements: (query, key) cells the block matmuls run on: ``chunk_q * chunk_kv``
            per visited block, less the skipped quadrant of split blocks (int).
    """

    Lq: int
    Lkv: int
    chunk_q: int
    chunk_kv: int
    causal: bool
    window: tuple[int, int]
    nq: int
    nkv: int
    kind: np.ndarray = field(repr=False)
    pattern_id: np.ndarray = field(repr=False)
    pattern_keys: np.ndarray = field(repr=False)
    split: np.ndarray = field(repr=False)
    visited_per_q: np.ndarray = field(repr=False)
    empty_rows_before: int
    empty_rows_from: int
    visible_elements: int
    visited_blocks: int
    full_blocks: int
    partial_blocks: int
    executed_elements: int
    lists: dict = field(repr=False)

    @property
    def num_patterns(self) -> int:
        """P, the number of distinct partial-block patterns."""
        return int(self.pattern_keys.shape[0])

    @property
    def patterns_nbytes(self) -> int:
        """Bytes of :attr:`patterns` (``P * chunk_q * chunk_kv``), without building it."""
        return self.num_patterns * self.chunk_q * self.chunk_kv

    def pattern(self, pattern_id: int) -> np.ndarray:
        """One pattern, built from its key (O(chunk_q * chunk_kv); nothing cached).

        Args:
            pattern_id: an id of :attr:`pattern_id`, ``0 <= pattern_id < P``.

        Returns:
            ``bool[chunk_q, chunk_kv]``, True = visible; padding rows/columns are False.
        """
        if not 0 <= pattern_id < self.num_patterns:
            raise ValueError(f"pattern_id={pattern_id} is not in 0..{self.num_patterns - 1}")
        return key_cells(self.chunk_q, self.chunk_kv, self.pattern_keys[pattern_id])

    @functools.cached_property
    def patterns(self) -> np.ndarray:
        """``bool[P, chunk_q, chunk_kv]`` (read-only, built on first access and kept): the
        distinct (by content) masks of the partial blocks, True = visible; padding
        rows/columns are False. O(P * chunk_q * chunk_kv) bytes: the planning path reads
        :attr:`num_patterns` and :attr:`patterns_nbytes` instead."""
        cells = np.zeros((self.num_patterns, self.chunk_q, self.chunk_kv), dtype=bool)
        for p, key in enumerate(self.pattern_keys):
            cells[p] = key_cells(self.chunk_q, self.chunk_kv, key)
        cells.flags.writeable = False
        return cells

    @property
    def num_empty_rows(self) -> int:
        """E, the number of real query rows that see no key."""
        return self.empty_rows_before + (self.Lq - self.empty_rows_from)

    @functools.cached_property
    def empty_rows(self) -> np.ndarray:
        """``int32[E]``, ascending (read-only, built on first access): the real query rows
        (< Lq) that see no key at all; :attr:`num_empty_rows` counts them without building."""
        rows = np.r_[np.arange(self.empty_rows_before), np.arange(self.empty_rows_from, self.Lq)]
        rows = rows.astype(np.int32)
        rows.flags.writeable = False
        return rows

    def diagonal_band(self) -> tuple:
        """``(low, high)``: row ``i`` sees column ``j`` iff ``low <= j - i - (Lkv - Lq) <=
        high`` (and ``0 <= j < Lkv``); ``None`` = unbounded on that side."""
        left, right = self.window
        low = -left if left != UNBOUNDED else None
        highs = ([0] if self.causal else []) + ([right] if right != UNBOUNDED else [])
        return low, (min(highs) if highs else None)

    def forward_flops(self, head_dim: int, groups: int = 1) -> FlopCount:
        """Matmul FLOPs of the forward pass (QK^T and PV per visited block).

        Args:
            head_dim: D.
            groups: G = batch x heads.

        Returns:
            ``FlopCount(executed=4*D*executed_elements*G, useful=4*D*visible_elements*G)``.
        """
        per_element = _FLOPS_PER_MAC * _FORWARD_MATMULS * _positive_int("head_dim", head_dim)
        per_element *= _positive_int("groups", groups)
        return FlopCount(
            executed=per_element * self.executed_elements,
            useful=per_element * self.visible_elements,
        )

    def backward_flops(self, head_dim: int, groups: int = 1, mode: str = "stash") -> FlopCount:
        """Matmul FLOPs of the backward pass.

        Args:
            head_dim: D.
            groups: G = batch x heads.
            mode: ``"stash"`` (out and lse given: 5 block matmuls per visited block) or
                ``"recompute"`` (the forward is recomputed first, as in the seed op: 7).

        Returns:
            ``FlopCount``; executed = ``10*D*executed_elements*G`` in stash mode,
            plus the forward's executed FLOPs in recompute mode; useful =
            ``10*D*visible_elements*G`` in both modes.

        Raises:
            ValueError: ``mode`` is not ``"stash"`` or ``"recompute"``.
        """
        if mode not in ("stash", "recompute"):
            raise ValueError(f"mode={mode!r} is not supported; expected 'stash' or 'recompute'")
        per_element = _FLOPS_PER_MAC * _BACKWARD_MATMULS * _positive_int("head_dim", head_dim)
        per_element *= _positive_int("groups", groups)
        executed = per_element * self.executed_elements
        if mode == "recompute":
            executed += self.forward_flops(head_dim, groups).executed
        return FlopCount(executed=executed, useful=per_element * self.visible_elements)

    def memory_bytes(self, head_dim: int, groups: int = 1, itemsize: int = 4,
                     kv_groups: Optional[int] = None) -> MemoryEstimate:
        """Analytic estimate of the forward's activation bytes, flash vs naive.

        This is an estimate from tensor shapes, not a measurement; the emulator measures the
        real peak of live tensors.

        * naive: scores and probabilities ``float32[G, Lq, Lkv]`` each, plus q, out
          ``[G, Lq, D]`` and k, v ``[Gk, Lkv, D]`` at ``itemsize``.
        * flash: q, k, v, out as above; lse ``float32[G, Lq]``; the running state the loops
          update in place, ``acc float32[G, Lq, D]``, ``m`` and ``l float32[G, Lq]``; one
          score block and one probability block ``float32[G, chunk_q, chunk_kv]``; plus the
          loop bodies' tables (at most 12 bytes per loop step: q and kv offsets, a pattern id;
          a split block is two steps) and the pattern table.

        Args:
            head_dim: D.
            groups: G = batch x heads.
            itemsize: bytes per element of q, k, v and out (2 for float16, 4 for float32).
            kv_groups: Gk, the groups of k and v (``None``: G; grouped-query attention: a
                divisor of G).

        Returns:
            ``MemoryEstimate(flash, naive)`` in bytes.
        """
        d = _positive_int("head_dim", head_dim)
        g = _positive_int("groups", groups)
        item = _positive_int("itemsize", itemsize)
        gk = g if kv_groups is None else _positive_int("kv_groups", kv_groups)
        if g % gk:
            raise ValueError(f"kv_groups must divide groups={g}, got kv_groups={gk}")
        io_bytes = (g * 2 * self.Lq + gk * 2 * self.Lkv) * d * item  # q, out; k, v
        naive_scores = 2 * g * self.Lq * self.Lkv * _FLOAT32_BYTES  # scores + probabilities
        lse = g * self.Lq * _FLOAT32_BYTES
        accumulator = g * self.Lq * d * _FLOAT32_BYTES  # acc, full length
        running_stats = 2 * g * self.Lq * _FLOAT32_BYTES  # m, l
        block_scores = 2 * g * self.chunk_q * self.chunk_kv * _FLOAT32_BYTES  # scores + probs
        split = int((self.split[self.kind != SKIP] != WHOLE).sum())
        tables = 12 * (self.visited_blocks + split) + self.patterns_nbytes
        flash = io_bytes + lse + accumulator + running_stats + block_scores + tables
        return MemoryEstimate(flash=flash, naive=io_bytes + naive_scores)

    def block_list(self, order: str) -> "BlockList":
        """The visited blocks of one pass, in visiting order (from the planner).

        Args:
            order: ``"q_major"`` (the forward: all blocks of q chunk 0, then q chunk 1, ...;
                kv chunks ascending) or ``"kv_major"`` (the backward: kv chunk outer).

        Returns:
            The :class:`BlockList` (read-only arrays of length ``visited_blocks``).
        """
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not supported; expected one of {ORDERS}")
        return self.lists[order]


@dataclass(frozen=True, eq=False)
class BlockList:
    """The visited blocks of one pass in visiting order: one entry per visited block (a split
    block runs as two loop steps, in the loops of its sub-block shapes: :mod:`popxl_flash.plan.steps`).

    Outer chunks (q chunks for ``q_major``, kv chunks for ``kv_major``) follow each other in
    ascending order, and the visited blocks of one outer chunk are consecutive with their inner
    chunks ascending. Outer chunks with no visited block have no entry.

    Attributes:
        order: ``"q_major"`` or ``"kv_major"``.
        q_chunk, kv_chunk: ``int32[V]``, the block's chunk indices.
        kind: ``int8[V]``, ``FULL`` or ``PARTIAL`` (never ``SKIP``).
        pattern_id: ``int32[V]``, index into :attr:`BlockSchedule.patterns`, -1 unless partial.
        split: ``int8[V]``, ``WHOLE``, ``LOWER`` or ``UPPER``.
        first, last: ``bool[V]``, the first and the last step of its outer chunk.
    """

    order: str
    q_chunk: np.ndarray = field(repr=False)
    kv_chunk: np.ndarray = field(repr=False)
    kind: np.ndarray = field(repr=False)
    pattern_id: np.ndarray = field(repr=False)
    split: np.ndarray = field(repr=False)
    first: np.ndarray = field(repr=False)
    last: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    @property
    def outer(self) -> np.ndarray:
        """``int32[V]``: the outer chunk of each step."""
        return self.q_chunk if self.order == "q_major" else self.kv_chunk

    @property
    def inner(self) -> np.ndarray:
        """``int32[V]``: the inner chunk of each step."""
        return self.kv_chunk if self.order == "q_major" else self.q_chunk


def plan(
    Lq: int,
    Lkv: int,
    chunk_q: int,
    chunk_kv: int,
    *,
    causal: bool = True,
    window: Sequence[int | None] | None = None,
) -> BlockSchedule:
    """Plan (or fetch from the cache) the block schedule of an attention mask.

    Args:
        Lq: query length, int >= 1.
        Lkv: key/value length, int >= 1.
        chunk_q: query rows per block, int in 1..Lq.
        chunk_kv: key columns per block, int in 1..Lkv.
        causal: bottom-right aligned causal mask (bool).
        window: ``None`` or ``(left, right)``, each an int >= -1 or ``None``; ``-1``/``None``
            = unbounded on that side. Intersected with ``causal``.

    Returns:
        The cached, read-only :class:`BlockSchedule`.

    Raises:
        TypeError: an argument has the wrong type (e.g. a float or bool length).
        ValueError: an argument has a bad value (non-positive length, chunk longer than its
            sequence, window side < -1, window not of length 2, lengths or block count
            beyond int32).
    """
    Lq = _length("Lq", Lq)
    Lkv = _length("Lkv", Lkv)
    chunk_q = _chunk("chunk_q", chunk_q, "Lq", Lq)
    chunk_kv = _chunk("chunk_kv", chunk_kv, "Lkv", Lkv)
    num_blocks = -(-Lq // chunk_q) * -(-Lkv // chunk_kv)
    if num_blocks > _INT32_MAX:
        raise ValueError(
            f"chunk_q={chunk_q}, chunk_kv={chunk_kv} cut Lq={Lq}, Lkv={Lkv} into {num_blocks} "
            f"blocks; expected at most {_INT32_MAX} (int32 schedule tables): use longer chunks"
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal={causal!r} must be a bool")
    return _plan_cached(Lq, Lkv, chunk_q, chunk_kv, bool(causal), normalise_window(window))


# ---- internals -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def _plan_cached(Lq, Lkv, chunk_q, chunk_kv, causal, window):
    from popxl_flash import _planner  # compiled at install time (pip install .)

    # Sides beyond every diagonal of the matrix are equivalent to unbounded ones; clamp so the
    # value fits the planner's int64 arithmetic.
    reach = Lq + Lkv
    left, right = (min(side, reach) for side in window)
    raw = _planner.plan_blocks(Lq, Lkv, chunk_q, chunk_kv, causal, left, right)
    for name in ("kind", "pattern_id", "pattern_keys", "split", "visited_per_q"):
        raw[name].flags.writeable = False
    lists = {}
    for order in ORDERS:
        arrays = raw[order]
        for array in arrays.values():
            array.flags.writeable = False
        lists[order] = BlockList(order=order, **arrays)
    return BlockSchedule(
        Lq=Lq,
        Lkv=Lkv,
        chunk_q=chunk_q,
        chunk_kv=chunk_kv,
        causal=causal,
        window=window,
        nq=int(raw["nq"]),
        nkv=int(raw["nkv"]),
        kind=raw["kind"],
        pattern_id=raw["pattern_id"],
        pattern_keys=raw["pattern_keys"],
        split=raw["split"],
        visited_per_q=raw["visited_per_q"],
        empty_rows_before=int(raw["empty_rows_before"]),
        empty_rows_from=int(raw["empty_rows_from"]),
        visible_elements=int(raw["visible_elements"]),
        visited_blocks=int(raw["visited_blocks"]),
        full_blocks=int(raw["full_blocks"]),
        partial_blocks=int(raw["partial_blocks"]),
        executed_elements=int(raw["executed_elements"]),
        lists=lists,
    )


def key_cells(rows, cols, key):
    """The cells of a canonical pattern key (:attr:`BlockSchedule.pattern_keys`).

    Args:
        rows, cols: the shape to build (at least the key's ``rows`` and ``cols``).
        key: ``(rows', cols', lo, hi)``: cell ``(r, c)`` is visible iff ``r < rows'``,
            ``c < cols'`` and ``lo <= c - r <= hi``; ``rows' == 0`` = nothing visible.

    Returns:
        ``bool[rows, cols]``, True = visible (O(rows * cols) bytes, no wider temporaries).
    """
    key_rows, key_cols, lo, hi = (int(v) for v in key)
    lo, hi = max(lo, -key_rows), min(hi, key_cols)  # diagonals beyond the block: unbounded
    cells = np.zeros((rows, cols), dtype=bool)
    if key_rows > 0 and key_cols > 0 and lo <= hi:
        below = np.tri(key_rows, key_cols, hi, dtype=bool)  # c - r <= hi
        below &= ~np.tri(key_rows, key_cols, lo - 1, dtype=bool)  # and c - r >= lo
        cells[:key_rows, :key_cols] = below
    return cells


def _int(name, value):
    """``value`` as a Python int; Python and numpy integers only (bool rejected)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    return int(value)


def _positive_int(name, value):
    value = _int(name, value)
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


def _length(name, value):
    value = _positive_int(name, value)
    if value > _INT32_MAX:
        raise ValueError(f"{name}={value} must be <= {_INT32_MAX} (int32 schedule tables)")
    return value


def _chunk(name, value, length_name, length):
    value = _positive_int(name, value)
    if value > length:
        raise ValueError(f"{name}={value} must be <= {length_name}={length}")
    return value


def normalise_window(window):
    """Normalise ``window`` to ``(left, right)`` ints, ``UNBOUNDED`` (-1) for None/-1.

    Args:
        window: ``None`` or a sequence ``(left, right)`` of ints >= -1 or ``None``.

    Returns:
        ``(left, right)``.

    Raises:
        TypeError: not a sequence, or a side that is not an int/None.
        ValueError: not two entries, or a side < -1.
    """
    expected = "None or a (left, right) pair of ints >= -1 or None"
    if window is None:
        return (UNBOUNDED, UNBOUNDED)
    if isinstance(window, (str, bytes)) or not isinstance(window, Sequence):
        raise TypeError(f"window={window!r} must be {expected}")
    if len(window) != 2:
        raise ValueError(f"window={window!r} has {len(window)} entries; expected {expected}")
    sides = []
    for side in window:
        if side is None:
            sides.append(UNBOUNDED)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window={window!r} has a non-int side {side!r}; expected {expected}")
        if side < UNBOUNDED:
            raise ValueError(f"window={window!r} has a side {side} < -1; expected {expected}")
        sides.append(int(side))
    return tuple(sides)
