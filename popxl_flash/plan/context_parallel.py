"""Context parallelism, static side: layouts and positions, the host helpers that lay a
sequence out for replicated streams, the per-call plan (gather rounds, chunking), and the
per-replica cost (:func:`explain`). Everything here is numpy on the host.
"""
import math
from dataclasses import dataclass

import numpy as np

from popxl_flash.plan.config import _check_int, check_bool, check_window

LAYOUTS = ("contiguous", "zigzag")

#: Longest automatic chunk (rows). Chunks divide the layout's pieces, so runtime skipping is
#: exact at block granularity and the zigzag layout's work is balanced.
CHUNK_TARGET = 128

#: Default budget of one round's gathered K/V: an eighth of one Mk2 IPU's In-Processor memory
#: (1472 tiles x 624 KiB), leaving the rest to the shards, the flash loop and the model.
DEFAULT_KV_BUDGET = 1472 * 624 * 1024 // 8


# -- host helpers ----------------------------------------------------------------------------
def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    return layout


def positions(length, replicas, layout="zigzag"):
    """Global row index of every replica's local rows.

    Args:
        length: sequence length L (divisible by R, by 2R for "zigzag").
        replicas: R. layout: "contiguous" or "zigzag".

    Returns:
        int32 ``[R, L / R]``: row ``r`` lists replica r's rows in local order.
    """
    _check_layout(layout)
    replicas = _check_int("replicas", replicas, low=1)
    length = _check_int("length", length, low=1)
    parts = replicas * (2 if layout == "zigzag" else 1)
    if length % parts:
        raise ValueError(f"the sequence length must be divisible by {parts} for layout "
                         f"{layout!r} with {replicas} replicas, got length={length}")
    rows = np.arange(length, dtype=np.int32).reshape(parts, length // parts)
    if layout == "contiguous":
        return rows
    return np.concatenate([rows[:replicas], rows[::-1][:replicas]], axis=1)


def shard(x, replicas, layout="zigzag", axis=1):
    """Lay a whole sequence out for the replicated host streams.

    Args:
        x: numpy array holding the sequence on ``axis`` (e.g. q ``[G, L, D]``, axis 1).
        replicas: R. layout: "contiguous" or "zigzag". axis: the sequence axis of ``x``.

    Returns:
        ``[R, *x.shape with L -> L / R]``: row r is replica r's shard (feed it to an h2d
        stream of the shard's shape).
    """
    x = np.asarray(x)
    axis = _axis(axis, x.ndim)
    table = positions(x.shape[axis], replicas, layout)
    return np.stack([np.take(x, rows, axis=axis) for rows in table])


def unshard(x, layout="zigzag", axis=1):
    """Inverse of :func:`shard`.

    Args:
        x: ``[R, ...]`` per-replica shards (e.g. a replicated d2h output).
        layout: the layout of the shards. axis: the sequence axis of one shard.

    Returns:
        The whole sequence, rows in order.
    """
    x = np.asarray(x)
    replicas = x.shape[0]
    axis = _axis(axis, x.ndim - 1)
    table = positions(x.shape[1 + axis] * replicas, replicas, layout)
    whole = np.concatenate(list(x), axis=axis)
    out = np.empty_like(whole)
    index = [slice(None)] * whole.ndim
    index[axis] = table.reshape(-1)
    out[tuple(index)] = whole
    return out


def _axis(axis, ndim):
    axis = _check_int("axis", axis, low=-ndim, high=ndim - 1)
    return axis + ndim if axis < 0 else axis


# -- planning --------------------------------------------------------------------------------
def _largest_divisor(n, limit):
    """Largest divisor of ``n`` that is at most ``limit``."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def choose_gather_steps(local_len, replicas, kv_groups, head_dim, itemsize,
                        budget=DEFAULT_KV_BUDGET):
    """Fewest K/V gather rounds whose gathered K and V fit ``budget`` bytes.

    Args:
        local_len: rows per replica (L / R). replicas: R. kv_groups: Gk. head_dim: D.
        itemsize: bytes per element. budget: bytes one round's gathered K and V may take.

    Returns:
        S, a divisor of ``local_len`` (``local_len`` if even single-row rounds exceed it).
    """
    for steps in range(1, local_len + 1):
        if local_len % steps == 0 and \
                2 * kv_groups * replicas * (local_len // steps) * head_dim * itemsize <= budget:
            return steps
    return local_len


class Plan:
    """The static facts of one context-parallel call (same on every replica).

    Attributes:
        replicas: R (the group size). layout, causal, scale, window: the options.
        local_len: rows per replica. steps: S gather rounds of ``piece = local_len / S``
            rows of each shard. num_chunks_q, num_chunks_kv: the flash call's chunk counts
            (over ``local_len`` q rows and ``R * piece`` gathered columns). table: int32
            ``[R, local_len]`` global positions (:func:`positions`). mods: ``None`` or the
            :class:`~popxl_flash.plan.score_mods.ScoreMods` of the call (softcap, ALiBi,
            score_mod), passed to every round.
    """

    def __init__(self, q_shape, kv_shape, dtype, *, replicas, layout, causal, scale, window,
                 steps, num_chunks_q, num_chunks_kv, budget, mods=None):
        self.replicas, self.layout = replicas, _check_layout(layout)
        self.mods = mods
        self.causal = check_bool("causal", causal)
        self.scale, self.window = scale, (None if window is None else check_window(window))
        self.q_shape, self.kv_shape, self.dtype = tuple(q_shape), tuple(kv_shape), dtype
        self.local_len = q_shape[1]
        self.table = positions(self.local_len * replicas, replicas, layout)
        self.itemsize = 2 if dtype == "float16" else 4
        budget = _check_int("kv_budget_bytes", budget, low=1)
        self.steps = (choose_gather_steps(self.local_len, replicas, kv_shape[0], kv_shape[2],
                                          self.itemsize, budget) if steps is None
                      else _check_int("kv_gather_steps", steps, low=1, high=self.local_len))
        if self.local_len % self.steps:
            raise ValueError(f"kv_gather_steps must divide the rows per replica "
                             f"({self.local_len}), got kv_gather_steps={self.steps}")
        self.piece = self.local_len // self.steps
        half = self.local_len // 2 if layout == "zigzag" else self.local_len
        self.num_chunks_q = num_chunks_q if num_chunks_q is not None else \
            self.local_len // _largest_divisor(half, CHUNK_TARGET)
        unit = math.gcd(self.piece, half)
        self.num_chunks_kv = num_chunks_kv if num_chunks_kv is not None else \
            replicas * self.piece // _largest_divisor(unit, CHUNK_TARGET)

    def flash_options(self):
        """Options of each round's flash call (positions carry causal and window)."""
        return dict(num_chunks_q=self.num_chunks_q, num_chunks_kv=self.num_chunks_kv,
                    causal=self.causal, scale=self.scale, window=self.window)

    def kv_positions(self, step):
        """int32 ``[1, R * piece]``: positions of round ``step``'s gathered columns."""
        cols = self.table[:, step * self.piece:(step + 1) * self.piece]
        return cols.reshape(1, -1)

    def result_key(self):
        """What the result depends on (a stashed ``out``/``lse`` must come from a forward
        with the same): the mask, layout and modifiers; with dropout also the rounds and
        chunk counts (the keep masks are drawn per round and block)."""
        key = (self.replicas, self.layout, self.causal, self.scale, self.window, self.mods)
        if self.mods is not None and self.mods.dropout > 0:
            key += (self.steps, self.num_chunks_q, self.num_chunks_kv)
        return key

    def key(self):
        """Hashable identity (graph cache key)."""
        return (self.replicas, self.layout, self.causal, self.scale, self.window, self.steps,
                self.num_chunks_q, self.num_chunks_kv, self.local_len, self.mods)


# -- cost per replica ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ContextParallelCost:
    """Exact per-replica figures of one context-parallel call (:func:`explain`).

    Attributes:
        plan: the :class:`Plan` (rounds ``steps``, ``piece``, chunk counts).
        chunk_q, chunk_kv: chunk lengths of each round's flash call.
        iterations: loop steps per replica and round (the static schedule: equal on all).
        blocks: per replica, the blocks its positions leave visible (all rounds).
        flops: per replica, the forward's executed matmul FLOPs (``4 G cq ckv D`` per
            visible block; the backward executes 2.5x that in stash mode).
        gathered_bytes: bytes each replica receives from the K/V all-gathers of one forward.
        scattered_bytes: bytes each replica receives from the backward's dk/dv
            reduce-scatters (float32), besides the backward's own all-gathers.
        kv_round_bytes: one round's gathered K and V (live while the round runs).
        shard_bytes: the replica's q, k, v and out shards.
    """
    plan: "Plan"
    chunk_q: int
    chunk_kv: int
    iterations: int
    blocks: tuple
    flops: tuple
    gathered_bytes: int
    scattered_bytes: int
    kv_round_bytes: int
    shard_bytes: int

    def table(self):
        """Returns: a text table, one row per replica."""
        p = self.plan
        lines = [f"R={p.replicas} layout={p.layout} rounds={p.steps} (piece {p.piece} rows) "
                 f"chunks q {p.num_chunks_q}x{self.chunk_q} kv {p.num_chunks_kv}x"
                 f"{self.chunk_kv}, {self.iterations} loop steps per round",
                 f"gathered K/V per round {self.kv_round_bytes / 2**20:.2f} MiB, shards "
                 f"{self.shard_bytes / 2**20:.2f} MiB",
                 "replica  blocks  fwd GFLOP  gathered MiB  scattered MiB"]
        for r, (b, f) in enumerate(zip(self.blocks, self.flops)):
            lines.append(f"{r:7d}  {b:6d}  {f / 1e9:9.3f}  {self.gathered_bytes / 2**20:12.2f}"
                         f"  {self.scattered_bytes / 2**20:13.2f}")
        return "\n".join(lines)


def _chunk_bounds(pos, chunk):
    """``(min, max)`` position of every chunk of a position row."""
    chunks = pos.reshape(-1, chunk)
    return chunks.min(axis=1), chunks.max(axis=1)


def _visible_blocks(plan, q_pos, kv_pos, chunk_q, chunk_kv):
    """Blocks of one round that runtime classification does not skip (one segment: the
    position tests of :func:`popxl_flash.graph.segments.classify_blocks`)."""
    q_lo, q_hi = (a[:, None] for a in _chunk_bounds(q_pos, chunk_q))
    k_lo, k_hi = (a[None, :] for a in _chunk_bounds(kv_pos, chunk_kv))
    skip = np.zeros((q_lo.shape[0], k_lo.shape[1]), bool)
    left, right = plan.window if plan.window is not None else (-1, -1)
    if plan.causal:
        skip |= k_lo > q_hi
    if left >= 0:
        skip |= k_hi < q_lo - left
    if right >= 0:
        skip |= k_lo > q_hi + right
    return int((~skip).sum())


def explain(length, replicas, *, head_dim, groups=1, kv_groups=None, dtype="float16",
            causal=True, window=None, layout="zigzag", kv_gather_steps=None,
            kv_budget_bytes=DEFAULT_KV_BUDGET, num_chunks_q=None, num_chunks_kv=None):
    """Per-replica work, traffic and memory of :func:`context_parallel_attention`.

    Args:
        length: the whole sequence's length L. replicas: R (the group size).
        head_dim, groups, kv_groups, dtype: D, G, Gk (default G), "float16"/"float32".
        causal, window, layout, kv_gather_steps, kv_budget_bytes, num_chunks_q,
            num_chunks_kv: as :func:`context_parallel_attention`.

    Returns:
        :class:`ContextParallelCost` (``table()`` prints it).
    """
    replicas = _check_int("replicas", replicas, low=1)
    length = _check_int("length", length, low=1)
    if length % replicas:
        raise ValueError(f"length must be divisible by replicas={replicas}, got {length}")
    Gk = groups if kv_groups is None else kv_groups
    local = length // replicas
    plan = Plan((groups, local, head_dim), (Gk, local, head_dim), dtype, replicas=replicas,
                layout=layout, causal=causal, scale=None, window=window, steps=kv_gather_steps,
                num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                budget=kv_budget_bytes)
    chunk_q = -(-local // plan.num_chunks_q)
    chunk_kv = -(-replicas * plan.piece // plan.num_chunks_kv)
    if local % chunk_q or (replicas * plan.piece) % chunk_kv:
        raise ValueError("explain needs chunk counts that divide the lengths exactly")
    blocks = tuple(sum(_visible_blocks(plan, plan.table[r], plan.kv_positions(s)[0], chunk_q,
                                       chunk_kv) for s in range(plan.steps))
                   for r in range(replicas))
    piece_kv = Gk * plan.piece * head_dim
    return ContextParallelCost(
        plan=plan, chunk_q=chunk_q, chunk_kv=chunk_kv,
        iterations=plan.num_chunks_q * plan.num_chunks_kv, blocks=blocks,
        flops=tuple(4 * groups * chunk_q * chunk_kv * head_dim * b for b in blocks),
        gathered_bytes=plan.steps * 2 * (replicas - 1) * piece_kv * plan.itemsize,
        scattered_bytes=plan.steps * 2 * (replicas - 1) * piece_kv * 4,
        kv_round_bytes=2 * replicas * piece_kv * plan.itemsize,
        shard_bytes=(2 * groups + 2 * Gk) * local * head_dim * plan.itemsize)
