"""Context parallelism, static side: layouts and positions, the host helpers that lay a
sequence out for replicated streams, the per-call plan (gather rounds, parts, chunking) chosen
by modelled IPU time within ``memory_budget``, and the per-replica cost (:func:`explain`).
Everything here is numpy on the host.

**Parts.** The graph is SPMD: every replica runs the same ops with the same static loop trip
counts, so a replica's own causal pattern can only act through run-time data (the positions
table row its replica index selects; the flash calls' run-time block classes skip what a
replica's positions hide, at the price of a loop step and a branch dispatch per skipped
block). What *is* identical across replicas can be static: with the split (``split=True``)
each replica's rows are cut into the layout's parts (zigzag: its two chunks; contiguous: one)
and every (part, round) pair is classified over **all** replicas at once: no pair visible on
any replica (not built: no call, no steps), every pair visible on every replica (a plain
flash call without a mask: no segment ids, no conditionals), or mixed (a call with run-time
positions, as without the split). Zigzag with two rounds is the case that gains: the late
round is invisible to every replica's early chunk (not built) and the early round is fully
visible to every replica's late chunk (plain). Whether to split, the rounds and the chunk
lengths are the least modelled forward + backward time within ``memory_budget``
(:func:`_choose`); score modifiers and dropout keep one part.

**Per-replica step tables.** A positions call's blocks that one replica skips at run time still
cost it a loop step. With tables (:meth:`Plan.step_table`) each replica loops over its own
list of the blocks it runs, an int32 ``[V, 3]`` run-time input its replica index picks from a
constant ``[R, V, 3]``, padded to the longest list with blocks it skips (SPMD: one trip
count). Every round ends at a collective, so a round still takes its slowest replica; the
choice weighs tables on and off by modelled time (given every setting, they are used wherever
they drop a step). Score modifiers and dropout work over them unchanged: a step's positions and
its dropout mask come from its offsets, which the table gives.
"""
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from popxl_flash.plan import counts as _counts
from popxl_flash.plan import ipu_time as _ipu_time
from popxl_flash.plan import memory as _memory
from popxl_flash.plan import packed as _packed
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan import steps as _steps
from popxl_flash.plan.config import _check_int, check_bool, check_window
from popxl_flash.plan.segments import SegmentConfig

LAYOUTS = ("contiguous", "zigzag")

#: Longest chunk (rows) the automatic choice tries. Chunks divide the layout's pieces, so
#: runtime skipping is exact at block granularity and the zigzag layout's work is balanced.
CHUNK_TARGET = 1024
#: Chunk lengths tried per axis: the largest divisors of the piece up to :data:`CHUNK_TARGET`.
CHUNK_CANDIDATES = 4
#: Gather rounds tried (divisors of the rows per replica within the K/V budget): the fewest.
STEP_CANDIDATES = 4

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


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_gather_steps(local_len, replicas, kv_groups, head_dim, itemsize,
                        budget=DEFAULT_KV_BUDGET):
    """Fewest K/V gather rounds whose gathered K and V fit ``budget`` bytes.

    Args:
        local_len: rows per replica (L / R). replicas: R. kv_groups: Gk. head_dim: D.
        itemsize: bytes per element. budget: bytes one round's gathered K and V may take.

    Returns:
        S, a divisor of ``local_len`` (``local_len`` if even single-row rounds exceed it).
    """
    for steps in _gather_step_options(local_len, replicas, kv_groups, head_dim, itemsize,
                                      budget):
        return steps
    return local_len


def _gather_step_options(local_len, replicas, kv_groups, head_dim, itemsize, budget):
    """Every S dividing ``local_len`` whose round's gathered K and V fit ``budget``, fewest
    first."""
    return [s for s in _divisors(local_len)
            if 2 * kv_groups * replicas * (local_len // s) * head_dim * itemsize <= budget]


def _runs(pos):
    """``[(lo, hi)]``: the maximal runs of consecutive positions of a position row."""
    pos = np.asarray(pos)
    breaks = np.nonzero(np.diff(pos) != 1)[0] + 1
    return [(int(p[0]), int(p[-1])) for p in np.split(pos, breaks)]


def _pair_kind(q_runs, kv_runs, causal, window):
    """``"skip"`` (no (query, key) pair visible), ``"full"`` (every pair visible) or
    ``"mixed"`` for runs of query and key positions under causal / window (global
    positions)."""
    left, right = window
    all_seen, none_seen = True, True
    for (a, b), (c, d) in itertools.product(q_runs, kv_runs):
        full = (not causal or d <= a) and (left < 0 or c >= b - left) and \
            (right < 0 or d <= a + right)
        empty = (causal and c > b) or (left >= 0 and d < a - left) or \
            (right >= 0 and c > b + right)
        all_seen &= full
        none_seen &= empty
    return "skip" if none_seen else ("full" if all_seen else "mixed")


@dataclass(frozen=True)
class Call:
    """One flash call of a replica's pass: q rows ``rows`` (a part) against round ``step``'s
    gathered K/V; ``kind`` ``"full"`` (every pair visible on every replica: a plain flash call
    without mask) or ``"mixed"`` (run-time positions)."""
    part: int
    rows: tuple
    step: int
    kind: str


#: Choices already made, by every argument of the plan (a layer's forward and backward, and
#: every layer of a model, ask the same question).
_CHOICES = {}
_CHOICES_MAX = 256


class Plan:
    """The static facts of one context-parallel call (same on every replica).

    Attributes:
        replicas: R (the group size). layout, causal, scale, window: the options.
        local_len: rows per replica. steps: S gather rounds of ``piece = local_len / S``
            rows of each shard. chunk_q, chunk_kv: the flash calls' chunk lengths;
            num_chunks_q, num_chunks_kv: their counts over ``local_len`` q rows and
            ``R * piece`` gathered columns. split: whether the rows are cut into the layout's
            parts (module docstring); parts: their ``(start, stop)`` local rows; calls: the
            :class:`Call` list (pairs no replica sees are left out). table: int32
            ``[R, local_len]`` global positions (:func:`positions`). mods: ``None`` or the
            :class:`~popxl_flash.plan.score_mods.ScoreMods` of the call (softcap, ALiBi,
            score_mod), passed to every call. memory_budgets: the bytes per replica the
            choice kept to, forward and backward (an explicit ``memory_budget`` both, else
            each pass's :func:`popxl_flash.plan.memory.default_budget` of the replica's own
            inputs and outputs); memory_budget: the forward's.
            choice: the :class:`ContextParallelChoice` when anything was chosen automatically
            (else ``None``).
    """

    def __init__(self, q_shape, kv_shape, dtype, *, replicas, layout, causal, scale, window,
                 steps, num_chunks_q, num_chunks_kv, budget, mods=None, memory_budget=None,
                 split=None):
        self.replicas, self.layout = replicas, _check_layout(layout)
        self.mods = mods
        self.causal = check_bool("causal", causal)
        self.scale, self.window = scale, (None if window is None else check_window(window))
        self.q_shape, self.kv_shape, self.dtype = tuple(q_shape), tuple(kv_shape), dtype
        self.local_len = q_shape[1]
        self.table = positions(self.local_len * replicas, replicas, layout)
        self.itemsize = 2 if dtype == "float16" else 4
        self.kv_budget = _check_int("kv_budget_bytes", budget, low=1)
        explicit_budget = self.explicit_budget = memory_budget is not None
        self.memory_budgets = _memory.pass_budgets(
            _memory.check_budget(memory_budget), groups=q_shape[0], kv_groups=kv_shape[0],
            q_len=q_shape[1], kv_len=q_shape[1], head_dim=q_shape[2], dtype=dtype)
        self.memory_budget = self.memory_budgets[0]
        if steps is not None:
            steps = _check_int("kv_gather_steps", steps, low=1, high=self.local_len)
            if self.local_len % steps:
                raise ValueError(f"kv_gather_steps must divide the rows per replica "
                                 f"({self.local_len}), got kv_gather_steps={steps}")
        if split is not None:
            split = check_bool("split", split)
        if num_chunks_q is not None:
            num_chunks_q = _check_int("num_chunks_q", num_chunks_q, low=1, high=self.local_len)
        if num_chunks_kv is not None:
            cols = replicas * (self.local_len // (steps or 1))
            num_chunks_kv = _check_int("num_chunks_kv", num_chunks_kv, low=1, high=cols)
        self.half = self.local_len // 2 if layout == "zigzag" else self.local_len
        self.choice = None
        if steps is None or num_chunks_q is None or num_chunks_kv is None or split is None:
            key = (self.q_shape, self.kv_shape, dtype, replicas, layout, self.causal, scale,
                   self.window, steps, num_chunks_q, num_chunks_kv, self.kv_budget,
                   self.memory_budget, split, mods)
            if key not in _CHOICES:
                if len(_CHOICES) >= _CHOICES_MAX:
                    _CHOICES.pop(next(iter(_CHOICES)))
                _CHOICES[key] = _choose(self, steps, num_chunks_q, num_chunks_kv, split)
            self.choice = _CHOICES[key]
            steps, cq, ckv, split, tables = self.choice.chosen.setting
        else:
            cq = -(-self.local_len // num_chunks_q)
            ckv = -(-replicas * (self.local_len // steps) // num_chunks_kv)
            tables = True
        self._configure(steps, cq, ckv, split, tables)
        if explicit_budget:
            need = (self.choice.chosen.memory_bytes if self.choice is not None
                    else max(replica_bytes(self, b) for b in (False, True)))
            if need > self.memory_budget:  # explicit: both passes' budgets are this one
                raise ValueError(
                    f"memory_budget={self.memory_budget:,} bytes: no context-parallel plan of "
                    f"this call fits it (the least memory per replica, rounds {self.steps}, "
                    f"chunks {self.chunk_q} x {self.chunk_kv}, needs {need:,} bytes beyond "
                    "the call's inputs and outputs); expected a budget of at least that: "
                    "raise memory_budget, or use more replicas or kv_gather_steps")

    def _configure(self, steps, chunk_q, chunk_kv, split, tables=False):
        """Set the rounds, chunk lengths, parts and calls (and with ``tables`` each positions
        call's per-replica step tables where they drop steps: :meth:`step_table`)."""
        self.steps = steps
        self.piece = self.local_len // steps
        cols = self.replicas * self.piece
        self.chunk_q, self.chunk_kv = min(chunk_q, self.local_len), min(chunk_kv, cols)
        self.num_chunks_q = -(-self.local_len // self.chunk_q)
        self.num_chunks_kv = -(-cols // self.chunk_kv)
        self.split = bool(split) and self.mods is None and self.layout == "zigzag"
        if self.split:
            self.parts = ((0, self.half), (self.half, self.local_len))
        else:
            self.parts = ((0, self.local_len),)
        window = self.window or (-1, -1)
        calls = []
        for p, rows in enumerate(self.parts):
            for step in range(steps):
                kind = "mixed"
                if self.split:
                    kinds = {_pair_kind(_runs(self.table[r, rows[0]:rows[1]]),
                                        _runs(self.kv_positions(step)[0]), self.causal, window)
                             for r in range(self.replicas)}
                    kind = kinds.pop() if len(kinds) == 1 else "mixed"
                if kind != "skip":
                    calls.append(Call(p, rows, step, kind))
        if not calls:  # nothing visible anywhere: keep one call (rows that see nothing)
            calls = [Call(0, self.parts[0], 0, "mixed")]
        self.calls = tuple(calls)
        self.tables = {}
        if tables:
            for call in self.calls:
                table = self._replica_table(call) if call.kind == "mixed" else None
                if table is not None:
                    self.tables[call.part, call.step] = table

    def _replica_table(self, call):
        """int32 ``[R, V, 3]``: per replica the blocks of ``call`` its positions run (in
        q-major order), padded with blocks it skips to the longest list, rows ``(first q row,
        first kv column, q_chunk * nkv + kv_chunk)``; ``None`` when that drops no step or the
        chunks do not divide the call (the run-time table needs whole unmasked blocks)."""
        rows = call.rows[1] - call.rows[0]
        cols = self.replicas * self.piece
        cq, ckv = min(self.chunk_q, rows), self.chunk_kv
        if rows % cq or cols % ckv:
            return None
        nq, nkv = rows // cq, cols // ckv
        lists = []
        for r in range(self.replicas):
            cls = self.call_classes(call, r).reshape(-1)
            run, skip = np.nonzero(cls != _packed.RT_SKIP)[0], np.nonzero(cls == _packed.RT_SKIP)[0]
            lists.append((run, skip))
        longest = max(len(run) for run, _ in lists)
        if longest == nq * nkv:
            return None
        table = np.zeros((self.replicas, max(longest, 1), 3), np.int32)
        for r, (run, skip) in enumerate(lists):
            blocks = np.concatenate([run, skip[:max(longest, 1) - len(run)]])
            table[r] = np.stack([blocks // nkv * cq, blocks % nkv * ckv, blocks], axis=1)
        return table

    def call_classes(self, call, replica):
        """int ``[nq, nkv]``: the run-time block classes of a positions call on ``replica``
        (the device's rule on the host, :func:`popxl_flash.plan.packed.classify_stats`)."""
        rows = call.rows[1] - call.rows[0]
        cq, ckv = min(self.chunk_q, rows), self.chunk_kv
        q_stats = _stats(self.table[replica, call.rows[0]:call.rows[1]].tobytes(), cq)
        kv_stats = _stats(self.kv_positions(call.step)[0].tobytes(), ckv)
        return _packed.classify_stats(q_stats, kv_stats, positions=True, causal=self.causal,
                                      window=self.window or (-1, -1))

    def step_table(self, call):
        """``None``, or the int32 ``[R, V, 3]`` per-replica step tables of a positions call
        (each replica picks its row by its replica index)."""
        return self.tables.get((call.part, call.step))

    def flash_options(self):
        """Options of a flash call over all ``local_len`` rows with run-time positions (the
        calls of a plan without the split; positions carry causal and window)."""
        return dict(num_chunks_q=self.num_chunks_q, num_chunks_kv=self.num_chunks_kv,
                    causal=self.causal, scale=self.scale, window=self.window)

    def call_options(self, call):
        """Options of one :class:`Call`'s flash call: its rows' chunk count; a ``"full"``
        call has no mask."""
        rows = call.rows[1] - call.rows[0]
        full = call.kind == "full"
        return dict(num_chunks_q=-(-rows // min(self.chunk_q, rows)),
                    num_chunks_kv=self.num_chunks_kv, causal=False if full else self.causal,
                    scale=self.scale, window=None if full else self.window)

    def kv_positions(self, step):
        """int32 ``[1, R * piece]``: positions of round ``step``'s gathered columns."""
        cols = self.table[:, step * self.piece:(step + 1) * self.piece]
        return cols.reshape(1, -1)

    def result_key(self):
        """What the result depends on (a stashed ``out``/``lse`` must come from a forward
        with the same): the mask, layout and modifiers (not the rounds or chunks: dropout's
        keep mask is a function of the seed and global positions alone)."""
        return (self.replicas, self.layout, self.causal, self.scale, self.window, self.mods)

    def key(self):
        """Hashable identity (graph cache key)."""
        return (self.replicas, self.layout, self.causal, self.scale, self.window, self.steps,
                self.num_chunks_q, self.num_chunks_kv, self.chunk_q, self.chunk_kv,
                self.split, tuple(sorted(self.tables)), self.local_len, self.mods)


# -- modelled time and memory per replica --------------------------------------------------------
#: Ops of the context-parallel graph around its flash calls (a fit on this version's graphs,
#: priced at :data:`popxl_flash.plan.ipu_time.CS_PER_OP` compute sets each, an estimate; the
#: flash calls are priced by :func:`popxl_flash.plan.counts.pass_counts` and
#: :func:`popxl_flash.plan.packed.pass_counts`): per pass, per round (the K and V slices and
#: all-gathers; the backward's reduce-scatters), per flash call, per merge of two results (the
#: lse weights and the 8 row slices' updates), per part (their concat). The tests hold a
#: replica's modelled op count within :data:`OPS_TOLERANCE` of the emulator's.
CP_OPS = {False: dict(fixed=0, round=2, call=0, merge=50, part=0),
          True: dict(fixed=0, round=0, call=0, merge=0, part=0)}
#: How close :func:`replica_costs`' op counts are to the emulator's (tests).
OPS_TOLERANCE = 0.10


@dataclass(frozen=True)
class ReplicaCost:
    """Modelled work of one replica's pass, per round (:func:`replica_costs`).

    Attributes:
        counts: per round, :class:`popxl_flash.plan.ipu_time.WorkCounts` of its flash calls
            and the graph around them.
        steps: per round, the loop steps of its flash calls; running: the steps whose block
            runs on this replica (the rest are skipped at run time).
    """
    counts: tuple
    steps: tuple
    running: tuple


def _call_counts(plan, call, replica, backward):
    """``(PassCounts, running steps)`` of one replica's flash call."""
    G, Gk, D = plan.q_shape[0], plan.kv_shape[0], plan.q_shape[2]
    rows = call.rows[1] - call.rows[0]
    cols = plan.replicas * plan.piece
    cq, ckv = min(plan.chunk_q, rows), plan.chunk_kv
    dims = (G, Gk, D, plan.dtype, plan.scale, backward)
    if call.kind == "full":
        c = _full_counts(rows, cols, cq, ckv, dims)
        return c, c.iterations
    classes = plan.call_classes(call, replica)
    table = plan.step_table(call)
    blocks = None if table is None else table[replica, :, 2].tobytes()
    c = _mixed_counts(rows, cols, cq, ckv, dims, plan.causal, plan.window or (-1, -1),
                      classes.tobytes(), classes.shape, blocks)
    return c, int((classes != _packed.RT_SKIP).sum())


@functools.lru_cache(maxsize=4096)
def _stats(pos_bytes, chunk):
    """Chunk statistics of one row of positions (ids all 0), cached by its bytes."""
    pos = np.frombuffer(pos_bytes, np.int32)
    return _packed.chunk_stats(np.zeros(pos.shape[0], np.int64), pos, chunk)


@functools.lru_cache(maxsize=1024)
def _full_counts(rows, cols, cq, ckv, dims):
    G, Gk, D, dtype, scale, backward = dims
    return _counts.pass_counts(rows, cols, cq, ckv, head_dim=D, groups=G, kv_groups=Gk,
                               dtype=dtype, causal=False, window=None, backward=backward,
                               scale=scale)


@functools.lru_cache(maxsize=8192)
def _mixed_counts(rows, cols, cq, ckv, dims, causal, window, class_bytes, shape, blocks=None):
    """A positions call's counts (``blocks``: the bytes of a replica's run-time step table's
    block indices, or ``None`` for the static schedule's steps)."""
    G, Gk, D, dtype, scale, backward = dims
    classes = np.frombuffer(class_bytes, np.int32).reshape(shape)
    sched = _schedule.plan(rows, cols, cq, ckv, causal=False, window=(-1, -1))
    groups, seg = None, SegmentConfig(1, 1, True)
    if blocks is not None:
        index = np.frombuffer(blocks, np.int32)
        nkv = shape[1]
        q_chunk, kv_chunk = index // nkv, index % nkv
        groups = [_steps.StepGroup(cq, ckv, False, q_chunk * cq, kv_chunk * ckv, q_chunk,
                                   kv_chunk)]
        seg = SegmentConfig(1, 1, True, len(index))
    return _packed.pass_counts(sched, classes, groups=G, head_dim=D, dtype=dtype,
                               backward=backward, segments=seg, kv_groups=Gk, causal=causal,
                               window=window, scale=scale, step_groups=groups)


def replica_costs(plan, backward=False):
    """Per replica, its :class:`ReplicaCost` (modelled counts per round)."""
    ops = CP_OPS[backward]
    G, D = plan.q_shape[0], plan.q_shape[2]
    out = []
    for r in range(plan.replicas):
        per_round, steps, running = [], [], []
        for step in range(plan.steps):
            total = _ipu_time.from_ops(ops["round"] + (ops["fixed"] if step == 0 else 0), 0,
                                       0, dtype=plan.dtype)
            n_steps = n_run = 0
            for call in plan.calls:
                if call.step != step:
                    continue
                c, run = _call_counts(plan, call, r, backward)
                rows = call.rows[1] - call.rows[0]
                merges = int(not backward and _merged_before(plan, call))
                table = int(plan.step_table(call) is not None)  # its row's dynamic_slice
                total = total + _ipu_time.work_of(c) + _ipu_time.from_ops(
                    ops["call"] + table + merges * ops["merge"], 0,
                    merges * 12 * G * rows * D, dtype=plan.dtype)
                n_steps += c.iterations
                n_run += run
            per_round.append(total)
            steps.append(n_steps)
            running.append(n_run)
        per_round[-1] = per_round[-1] + _ipu_time.from_ops(ops["part"] * len(plan.parts), 0, 0,
                                                           dtype=plan.dtype)
        out.append(ReplicaCost(tuple(per_round), tuple(steps), tuple(running)))
    return tuple(out)


def _merged_before(plan, call):
    """Whether ``call``'s result is merged into an earlier call's of its part."""
    return any(c.part == call.part and c.step < call.step for c in plan.calls)


def modelled_time(plan, backward=False):
    """Modelled time of one pass (:class:`popxl_flash.plan.ipu_time.ModelledTime`): per round
    the slowest replica (the rounds' collectives synchronise them), summed over rounds. The
    all-gathers' and reduce-scatters' link time is not in the model (their ops count as compute
    sets, their inputs as copies)."""
    costs = replica_costs(plan, backward)
    total = None
    for step in range(plan.steps):
        times = [_ipu_time.time(c.counts[step], plan.dtype) for c in costs]
        slowest = max(times, key=lambda t: t.cycles)
        total = slowest if total is None else total + slowest
    return total


def replica_bytes(plan, backward=False):
    """Upper bound of the bytes one replica holds beyond the context-parallel call's own inputs
    and outputs: the largest of its phases (held to the emulator within 1.2x + 1 MiB by
    ``tests/test_context_parallel_plan.py``), plus the constants (the position table, the
    rounds' kv positions and zero ids, the step tables) and
    :data:`popxl_flash.plan.memory.FIXED_BYTES`:

    * a round's gather: what the rounds hold so far, the K and V pieces, their all-gathers and
      the gather wrapper's transposed copies (at most twice one round's gathered K/V);
    * a round's flash call: what the rounds hold, the gathered K/V, the call's bound
      (:func:`popxl_flash.plan.memory.flash_bytes`, or :func:`popxl_flash.plan.packed.
      pass_bytes` for a positions call, with its run-time step table) and its outputs;
    * the forward's merge (the round's out and lse, the weights, one row slice's float32
      products) or the backward's float32 casts of a call's gradients and the reduce-scatter's
      by-owner copies;
    * the end: the float32 accumulators, the parts' or rounds' results and their concats.

    What the rounds hold: the forward's float32 accumulator and lse (merged rounds or parts);
    the backward's float32 dq (per part with the split), the round's dk/dv sums over its calls
    (split) and the owners' dk/dv of the rounds so far.
    """
    G, Gk, D = plan.q_shape[0], plan.kv_shape[0], plan.q_shape[2]
    b, f32 = plan.itemsize, 4
    local, cols = plan.local_len, plan.replicas * plan.piece
    gathered = 2 * Gk * cols * D * b
    work = 0
    for call in plan.calls:
        rows = call.rows[1] - call.rows[0]
        cq, ckv = min(plan.chunk_q, rows), plan.chunk_kv
        sched = _schedule.plan(rows, cols, cq, ckv, causal=False, window=(-1, -1))
        args = dict(groups=G, kv_groups=Gk, head_dim=D, dtype=plan.dtype, backward=backward,
                    scale=plan.scale)
        if call.kind == "mixed":
            table = plan.step_table(call)
            seg = SegmentConfig(1, 1, True, 0 if table is None else table.shape[1])
            w = _packed.pass_bytes(sched, segments=seg, mods=plan.mods, **args)
            w += 4 * (rows + 3 * (0 if table is None else table.shape[1]))  # its rows' positions
        else:
            w = _memory.flash_bytes(sched, steps=sched.visited_blocks, mods=plan.mods, **args)
        if backward:
            w += (G * rows * D + 2 * Gk * cols * D) * b  # its dq, dk, dv
        else:
            w += G * rows * D * b + f32 * G * rows  # its out and lse
        work = max(work, w)
    rows_f32 = f32 * G * local * D
    owner = 2 * Gk * plan.piece * D * f32  # a round's dk and dv on their owner
    if backward:
        held = rows_f32 * (2 if plan.split else 1) + (plan.steps - 1) * owner
        if plan.split:
            held += 2 * Gk * cols * D * f32
        after = (G * local + 2 * Gk * cols) * D * b + rows_f32 + 3 * Gk * cols * D * f32
        end = rows_f32 * (2 if plan.split else 1) + 2 * plan.steps * owner
    else:
        merging = plan.steps > 1 or plan.split
        held = f32 * G * local * (D + 1) * merging
        after = (G * local * D * b + f32 * G * local + 8 * f32 * G * local
                 + 3 * rows_f32 // _MERGE_SLICES) * merging
        end = held + (G * local * D * b + f32 * G * local) * (len(plan.parts) > 1)
    peak = max(held + GATHER_COPIES * gathered, held + gathered + work, held + after, end)
    constants = 4 * plan.table.size + sum(t.nbytes for t in plan.tables.values()) \
        + 4 * plan.steps * 2 * cols + 4 * local
    return int(peak + constants + _memory.FIXED_BYTES)


#: The merge works in this many row slices (``context_parallel_graphs.MERGE_SLICES``).
_MERGE_SLICES = 8
#: A round's gather holds at most this many times its gathered K/V (the pieces, the
#: all-gathers' results and the gather wrapper's transposed copies).
GATHER_COPIES = 2


# -- the choice ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpCandidate:
    """One setting priced: ``setting = (steps, chunk_q, chunk_kv, split, tables)``; modelled forward
    and backward time (:class:`popxl_flash.plan.ipu_time.ModelledTime`), the larger pass's
    bytes per replica beyond the call's inputs and outputs, whether they fit the budget."""
    setting: tuple
    time_forward: object
    time_backward: object
    memory_bytes: int
    fits: bool

    @property
    def seconds(self):
        return self.time_forward.seconds + self.time_backward.seconds


@dataclass(frozen=True)
class ContextParallelChoice:
    """The automatic choice of a context-parallel call: ``candidates`` the settings timed
    (those within the budget; when none is, those near the least memory), ``over_budget`` how
    many settings the memory model put over the budget."""
    chosen: CpCandidate
    candidates: tuple
    reason: str
    budget: int
    label: str
    over_budget: int = 0

    def table(self):
        """The fastest candidates as text (``*`` the chosen one), times modelled."""
        lines = ["   rounds  chunks q x kv  split  tables  MiB/replica  fits  modelled us f+b"]
        shown = sorted(self.candidates, key=lambda c: c.seconds)[:10]
        if self.chosen not in shown:
            shown.append(self.chosen)
        for c in shown:
            s, cq, ckv, split, tables = c.setting
            mark = "*" if c is self.chosen else " "
            lines.append(f"{mark}  {s:6d}  {cq:6d} x {ckv:<6d}  {'yes' if split else 'no':>5}"
                         f"  {'yes' if tables else 'no':>6}"
                         f"  {c.memory_bytes / 2**20:11.2f}  {'yes' if c.fits else 'NO':>4}"
                         f"  {c.seconds * 1e6:15,.1f}")
        lines.append(f"chosen: {self.reason}; memory_budget {self.budget:,} bytes "
                     f"({self.over_budget} settings over it, not timed)")
        lines.append(f"times are {self.label}")
        return "\n".join(lines)


#: When nothing fits the budget: the fastest setting within this factor of the least memory.
_NOTHING_FITS_SLACK = 1.25


def _chunk_options(length, fixed):
    """Chunk lengths tried: the fixed one, or the largest divisors of ``length`` up to
    :data:`CHUNK_TARGET`."""
    if fixed is not None:
        return [fixed]
    divs = [d for d in _divisors(length) if d <= CHUNK_TARGET]
    return divs[-CHUNK_CANDIDATES:]


def _choose(plan, steps, num_chunks_q, num_chunks_kv, split):
    """The least modelled forward + backward time within ``plan.memory_budget`` over the
    settings the fixed arguments leave open."""
    Gk, D = plan.kv_shape[0], plan.kv_shape[2]
    if steps is not None:
        step_options = [steps]
    else:
        step_options = _gather_step_options(plan.local_len, plan.replicas, Gk, D,
                                            plan.itemsize, plan.kv_budget)[:STEP_CANDIDATES]
        step_options = step_options or [plan.local_len]
    splits = [split] if split is not None else (
        [False, True] if plan.mods is None and plan.layout == "zigzag" else [False])
    settings = []
    for s in step_options:
        piece = plan.local_len // s
        unit = math.gcd(piece, plan.half)
        cqs = _chunk_options(plan.half, None if num_chunks_q is None
                             else -(-plan.local_len // num_chunks_q))
        ckvs = _chunk_options(unit, None if num_chunks_kv is None
                              else -(-plan.replicas * piece // num_chunks_kv))
        for cq, ckv, sp in itertools.product(cqs, ckvs, splits):
            plan._configure(s, cq, ckv, sp)
            settings.append(((s, cq, ckv, sp), tuple(replica_bytes(plan, b)
                                                     for b in (False, True))))
    # Time only what can be chosen: the settings that fit, else those near the least memory.
    fit = [x for x in settings if _fits(x[1], plan.memory_budgets)]
    settings = [(x, max(m)) for x, m in settings]
    fit = [(x, max(m)) for x, m in fit]
    least = min(m for _, m in settings)
    timed = fit or [x for x in settings if x[1] <= _NOTHING_FITS_SLACK * least]
    candidates = []
    for setting, mem in timed:
        for tables in (False, True):
            plan._configure(*setting, tables)
            if tables and not plan.tables:
                continue  # no positions call where tables drop a step: as without
            extra = sum(t.nbytes for t in plan.tables.values())
            mem_t = mem + extra
            fits = _fits([replica_bytes(plan, b) + extra for b in (False, True)],
                         plan.memory_budgets) if fit else False
            candidates.append(CpCandidate(setting + (tables,), modelled_time(plan, False),
                                          modelled_time(plan, True), mem_t, fits))
    chosen = min(candidates, key=lambda c: (c.seconds, c.memory_bytes))
    if fit:
        reason = "least modelled forward + backward time within memory_budget"
    elif not plan.explicit_budget:  # the default never refuses: the least memory
        chosen = min(candidates, key=lambda c: (c.memory_bytes, c.seconds))
        reason = (f"no setting meets the default memory budget (forward "
                  f"{plan.memory_budgets[0]:,}, backward {plan.memory_budgets[1]:,} bytes per "
                  f"replica): the least memory, {chosen.memory_bytes:,} bytes")
    else:
        reason = (f"NOTHING FITS memory_budget={plan.memory_budget:,} bytes (the least any "
                  f"setting needs is {least:,} per replica): the least modelled time within "
                  f"{_NOTHING_FITS_SLACK}x of that")
    return ContextParallelChoice(chosen, tuple(candidates), reason, plan.memory_budget,
                                 _ipu_time.label(), len(settings) - len(fit))


def _fits(mem, budgets):
    """Whether the forward's and the backward's bytes are within their budgets."""
    return all(m <= b for m, b in zip(mem, budgets))


# -- cost per replica ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ContextParallelCost:
    """Per-replica figures of one context-parallel call (:func:`explain`).

    Attributes:
        plan: the :class:`Plan` (rounds ``steps``, ``piece``, chunks, ``split``, ``calls``).
        chunk_q, chunk_kv: chunk lengths of the flash calls.
        iterations: loop steps per replica (all rounds and calls: equal on every replica,
            the graph is SPMD).
        blocks: per replica, the blocks that run (all rounds; the other steps are skipped at
            run time by the replica's positions).
        flops: per replica, the forward's executed matmul FLOPs (exact: the emulator's).
        gathered_bytes: bytes each replica receives from the K/V all-gathers of one forward.
        scattered_bytes: bytes each replica receives from the backward's dk/dv
            reduce-scatters (float32), besides the backward's own all-gathers.
        kv_round_bytes: one round's gathered K and V (live while the round runs).
        shard_bytes: the replica's q, k, v and out shards.
        time_forward, time_backward: modelled time of each pass
            (:func:`modelled_time`: per round the slowest replica).
        replica_seconds: per replica, its modelled forward + backward time were it alone.
        memory_bytes: per replica, the larger pass's bytes beyond the call's inputs and
            outputs (:func:`replica_bytes`, upper bounds).
        unsplit: the same call without the split (one part), priced alike, when the plan
            splits (else ``None``): ``(modelled seconds, memory bytes)``.
        skipped_steps: per replica, the loop steps its positions skip at run time (forward;
            with run-time step tables only their padding).
        static_tables: when the plan uses run-time step tables, the same plan with the
            static schedule's steps instead: ``(modelled seconds, memory bytes)``.
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
    time_forward: object = None
    time_backward: object = None
    replica_seconds: tuple = ()
    memory_bytes: int = 0
    unsplit: tuple = None
    skipped_steps: tuple = ()
    static_tables: tuple = None

    @property
    def seconds(self):
        """Modelled forward + backward time (s)."""
        return self.time_forward.seconds + self.time_backward.seconds

    def table(self):
        """Returns: a text table, one row per replica, then the modelled times."""
        p = self.plan
        kinds = ", ".join(f"part {c.part} round {c.step}: {c.kind}" for c in p.calls)
        lines = [f"R={p.replicas} layout={p.layout} rounds={p.steps} (piece {p.piece} rows) "
                 f"chunks q {p.num_chunks_q}x{self.chunk_q} kv {p.num_chunks_kv}x"
                 f"{self.chunk_kv}, split {'yes' if p.split else 'no'} ({kinds}); "
                 f"{self.iterations} loop steps per replica",
                 f"gathered K/V per round {self.kv_round_bytes / 2**20:.2f} MiB, shards "
                 f"{self.shard_bytes / 2**20:.2f} MiB, at most "
                 f"{self.memory_bytes / 2**20:.2f} MiB per replica beyond them "
                 f"(memory_budget {p.memory_budget / 2**20:.1f} MiB)",
                 "replica  blocks run  fwd GFLOP  gathered MiB  scattered MiB  modelled us f+b"]
        for r, (b, f) in enumerate(zip(self.blocks, self.flops)):
            lines.append(f"{r:7d}  {b:10d}  {f / 1e9:9.3f}  {self.gathered_bytes / 2**20:12.2f}"
                         f"  {self.scattered_bytes / 2**20:13.2f}"
                         f"  {self.replica_seconds[r] * 1e6:15,.1f}")
        lines.append(f"modelled time (per round the slowest replica): forward "
                     f"{self.time_forward.seconds * 1e6:,.1f} us, backward "
                     f"{self.time_backward.seconds * 1e6:,.1f} us, total "
                     f"{self.seconds * 1e6:,.1f} us")
        if self.unsplit is not None:
            lines.append(f"without the split (one part, every pair a positions call): "
                         f"{self.unsplit[0] * 1e6:,.1f} us modelled, "
                         f"{self.unsplit[1] / 2**20:.2f} MiB per replica")
        lines.append(f"run-time step tables (each replica's own blocks, picked by its replica "
                     f"index): {'yes' if p.tables else 'no'}; steps skipped at run time per "
                     f"replica: {list(self.skipped_steps)}")
        if self.static_tables is not None:
            lines.append(f"with the static schedule's steps instead: "
                         f"{self.static_tables[0] * 1e6:,.1f} us modelled")
        if p.choice is not None:
            lines.append(p.choice.table())
        else:
            lines.append(f"times are {_ipu_time.label()}")
        return "\n".join(lines)


def explain(length, replicas, *, head_dim, groups=1, kv_groups=None, dtype="float16",
            causal=True, window=None, layout="zigzag", kv_gather_steps=None,
            kv_budget_bytes=DEFAULT_KV_BUDGET, num_chunks_q=None, num_chunks_kv=None,
            memory_budget=None, split=None):
    """Per-replica work, traffic, memory and modelled time of
    :func:`context_parallel_attention`.

    Args:
        length: the whole sequence's length L. replicas: R (the group size).
        head_dim, groups, kv_groups, dtype: D, G, Gk (default G), "float16"/"float32".
        causal, window, layout, kv_gather_steps, kv_budget_bytes, num_chunks_q,
            num_chunks_kv, memory_budget, split: as :func:`context_parallel_attention`.

    Returns:
        :class:`ContextParallelCost` (``table()`` prints it, with the modelled times and,
        when anything was chosen automatically, the candidates weighed).
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
                budget=kv_budget_bytes, memory_budget=memory_budget, split=split)
    return cost(plan)


def cost(plan):
    """The :class:`ContextParallelCost` of a :class:`Plan`."""
    Gk, D = plan.kv_shape[0], plan.kv_shape[2]
    forward = replica_costs(plan, False)
    backward = replica_costs(plan, True)
    flops = tuple(sum(sum(c.matmul_flops.values()) for c in rc.counts) for rc in forward)
    blocks = tuple(sum(rc.running) for rc in forward)
    seconds = tuple(sum(_ipu_time.time(c, plan.dtype).seconds for c in f.counts + b.counts)
                    for f, b in zip(forward, backward))
    saved = (plan.steps, plan.chunk_q, plan.chunk_kv, plan.split, bool(plan.tables))

    def priced(split, tables):
        plan._configure(plan.steps, plan.chunk_q, plan.chunk_kv, split, tables)
        result = (modelled_time(plan, False).seconds + modelled_time(plan, True).seconds,
                  max(replica_bytes(plan, b) for b in (False, True)))
        plan._configure(*saved)
        return result
    unsplit = priced(False, saved[4]) if plan.split else None
    static = priced(plan.split, False) if plan.tables else None
    piece_kv = Gk * plan.piece * D
    skipped = tuple(sum(rc.steps) - sum(rc.running) for rc in forward)
    return ContextParallelCost(
        plan=plan, chunk_q=plan.chunk_q, chunk_kv=plan.chunk_kv,
        iterations=sum(forward[0].steps), blocks=blocks, flops=flops,
        gathered_bytes=plan.steps * 2 * (plan.replicas - 1) * piece_kv * plan.itemsize,
        scattered_bytes=plan.steps * 2 * (plan.replicas - 1) * piece_kv * 4,
        kv_round_bytes=2 * plan.replicas * piece_kv * plan.itemsize,
        shard_bytes=(2 * plan.q_shape[0] + 2 * Gk) * plan.local_len * D * plan.itemsize,
        time_forward=modelled_time(plan, False), time_backward=modelled_time(plan, True),
        replica_seconds=seconds,
        memory_bytes=max(replica_bytes(plan, b) for b in (False, True)), unsplit=unsplit,
        skipped_steps=skipped, static_tables=static)
