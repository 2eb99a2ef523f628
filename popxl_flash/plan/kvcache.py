"""KV cache, host side: the decode structure choice and its cost model (no graph code).

:func:`flash_attn_with_kvcache <popxl_flash.api.kvcache.flash_attn_with_kvcache>` runs one of
three structures (:data:`STRUCTURES`): the straight-line pass over the whole cache
(:mod:`popxl_flash.graph.decode`, calls with one q chunk), one kv loop of chunks of ``c`` cache
rows, or ``S = num_splits`` parts of such chunks (split-KV, flash-decoding). This module chooses
when the caller does not: :func:`decode_choice` weighs the candidates (the straight-line pass,
chunks :data:`DECODE_CHUNKS` times splits :data:`DECODE_SPLITS`) by :func:`evaluate`'s figures
priced by the reference model (:mod:`popxl_flash.plan.ipu_time`): the straight-line pass's exact
counts (:func:`straight_counts`), a loop's exact executed FLOPs per fill, op counts from
:data:`OPS_DECODE` and :data:`OPS_MODS`, vector elements from :data:`VEC_DECODE`, lowering copies
from :func:`popxl_flash.plan.costmodel.pass_copies`; the least modelled time among the
candidates whose modelled memory fits ``memory_budget`` wins. :func:`explain` reports them;
:func:`_structure` turns a call's options into its structure. Everything here is numpy on the
host (see ``docs/design.md``, "KV cache"); :mod:`popxl_flash.api.kvcache` re-exports the public
names.
"""
import math
from dataclasses import dataclass

import numpy as np

from popxl_flash.plan import costmodel
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan.config import _check_int
from popxl_flash.plan.segments import MAX_LEN, RT_FULL, RT_MASKED, RT_SKIP, SegmentConfig

#: Chunk lengths the automatic decode choice tries (rows of the cache per chunk).
DECODE_CHUNKS = (16, 32, 64, 128, 256)
#: Split counts the automatic decode choice tries.
DECODE_SPLITS = (1, 2, 4, 8)
#: Largest ``Lq`` treated as a decode shape (one q chunk; larger ``Lq`` is a prefill: q chunks
#: of at most :data:`PREFILL_CHUNK_Q` rows, no split).
MAX_DECODE_Q = 16
PREFILL_CHUNK_Q = 64
#: Cache fills the automatic choice averages its modelled time over.
MODEL_FILLS = (0.1, 0.5, 1.0)
#: Supersteps (executed ops other than pure views) of one call with a kv loop, fitted on the
#: emulator to this version's graphs (least squares over B in {1, 2}, caches of 1024 and 4096
#: rows, 16 or 32 steps, 1, 2 or 4 splits, three fills: within 2%; held within 5% of the
#: emulator's profile by ``tests/test_kvcache.py``): ``fixed + per_row * B + per_step * steps + per_executed *
#: executed steps (+ combine with splits)``; the run-time guard and the write included.
OPS_DECODE = dict(fixed=103, per_row=3, per_step=13.15, per_executed=14.7, combine=18)
#: Vector elements of one call with a kv loop, fitted like :data:`OPS_DECODE` (within 1.5%):
#: per executed step ``block`` times its scores ``G' cq c`` plus ``rows`` times its rows
#: ``G' cq D``; per step ``step`` times ``G' cq`` (the statistics, the classification); per
#: call ``cache`` times the regrouped cache rows and their ids and positions ``Gk' P (D + 2)``.
VEC_DECODE = dict(block=2.24, rows=4.46, step=225, cache=5.43)
#: Supersteps the score modifiers add to a call with a kv loop, measured on the emulator (exact
#: over three fills, one loop and split-KV): softcap per executed step; ALiBi per executed step
#: and per call (the negated slopes: 1, +1 to repeat ``[Hq]`` slopes over ``B > 1``, +1 with
#: splits; the model counts ``[Hq]``). Skipped steps run none of them.
OPS_MODS = dict(softcap=3, alibi=5, alibi_fixed=1)
#: The memory bounds (:func:`straight_bytes`, :func:`_loop_bytes`) walk the graphs op by op;
#: what they leave out is bounded by this many float32 copies of the call's q and new rows (the
#: guard, the write, rotary, the few-row tensors) ...
DECODE_ROW_FACTOR = 4
#: ... and a kv loop's step holds this many float32 score blocks of temporaries (the scores,
#: their masked and exponentiated successors, the bool masks), by ``(softcap, alibi)``; measured
#: on the emulator (``tests/test_kvcache_memory.py``).
DECODE_BLOCKS = {(False, False): 2, (True, False): 2.5, (False, True): 3.5, (True, True): 4}


@dataclass(frozen=True)
class Dims:
    """The sizes of one call: batch, q length, cache length, new rows, heads, head dim."""
    batch: int
    q_len: int
    cache_len: int
    new_len: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def group_size(self):
        """r = Hq // Hkv."""
        return self.q_heads // self.kv_heads

    def default_budget(self, dtype):
        """The default ``memory_budget`` of a decode call, as every pass's
        (:func:`popxl_flash.plan.memory.default_budget`): twice its own inputs' and outputs'
        bytes (q, the k and v caches, the new k and v rows, out and its float32 lse) plus
        :data:`popxl_flash.plan.memory.DEFAULT_FIXED_BYTES`."""
        from popxl_flash.plan import memory
        item = 2 if dtype == "float16" else 4
        q = self.batch * self.q_len * self.q_heads * self.head_dim
        kv = self.batch * (self.cache_len + self.new_len) * self.kv_heads * self.head_dim
        io = (2 * q + 2 * kv) * item + 4 * self.batch * self.q_len * self.q_heads
        return int(memory.DEFAULT_IO_FACTOR * io + memory.DEFAULT_FIXED_BYTES)


#: How :func:`check_dims` names the sizes of a ``flash_attn_with_kvcache`` call (its tensors'
#: dims); :func:`explain` names them by its arguments.
CALL_NAMES = dict(batch="B", q_len="Lq", cache_len="Lcache", new_len="Lnew", q_heads="Hq",
                  kv_heads="Hkv", head_dim="D")


def check_dims(dims, names=None):
    """The sizes of a cache call, checked alike for :func:`flash_attn_with_kvcache
    <popxl_flash.api.kvcache.flash_attn_with_kvcache>` (its tensors' dims) and :func:`explain`
    (its arguments).

    Args:
        dims: :class:`Dims`.
        names: ``{field: name in messages}`` (default :data:`CALL_NAMES`).

    Returns:
        ``dims``.

    Raises:
        ValueError: a size below 1 (``new_len`` below 0), ``q_heads`` not a multiple of
            ``kv_heads``, more new rows than the cache holds, a cache over ``MAX_LEN`` rows.
    """
    n = dict(CALL_NAMES, **(names or {}))
    for field in ("batch", "q_len", "cache_len", "q_heads", "kv_heads", "head_dim"):
        _check_int(n[field], getattr(dims, field), low=1)
    _check_int(n["new_len"], dims.new_len, low=0)
    if dims.q_heads % dims.kv_heads:
        raise ValueError(f"q's head count {n['q_heads']}={dims.q_heads} must be a multiple of "
                         f"the caches' {n['kv_heads']}={dims.kv_heads} (grouped-query "
                         "attention)")
    if dims.new_len > dims.cache_len:
        raise ValueError(f"k has {n['new_len']}={dims.new_len} new rows, more than the cache "
                         f"holds ({n['cache_len']}={dims.cache_len})")
    if dims.cache_len > MAX_LEN:
        raise ValueError(f"k_cache supports up to {MAX_LEN} rows, got "
                         f"{n['cache_len']}={dims.cache_len}")
    return dims


def check_structure_options(dims, num_splits=None, num_chunks_q=None, num_chunks_kv=None):
    """A call's ``num_splits``, ``num_chunks_q``, ``num_chunks_kv``, checked (shared by the
    call and :func:`explain`).

    Returns:
        ``(num_splits, chunk_kv, num_chunks_q)``: ``None`` where the choice is automatic
        (``num_splits`` 0 or ``None``), ``chunk_kv`` the cache rows per chunk of a fixed
        ``num_chunks_kv``.
    """
    if num_splits is not None:
        num_splits = _check_int("num_splits", num_splits, low=0, high=dims.cache_len)
        num_splits = None if num_splits == 0 else num_splits  # flash-attn: 0 = automatic
    chunk_kv = None
    if num_chunks_kv is not None:
        n = _check_int("num_chunks_kv", num_chunks_kv, low=1, high=dims.cache_len)
        chunk_kv = -(-dims.cache_len // n)
    if num_chunks_q is not None:
        num_chunks_q = _check_int("num_chunks_q", num_chunks_q, low=1, high=dims.q_len)
    return num_splits, chunk_kv, num_chunks_q


# -- structure choice ------------------------------------------------------------------------
#: The structures of a call: one straight-line pass over the whole cache (no loop), one kv loop
#: with chunks, split-KV (the loop over ``splits`` parts).
STRUCTURES = ("straight", "loop", "split")


@dataclass(frozen=True)
class DecodeCandidate:
    """One structure of a call.

    Attributes:
        structure: ``"straight"`` (one pass over the whole cache: ``splits = 1``, ``chunk_kv =
            Lcache``, no loop), ``"loop"`` (one kv loop) or ``"split"`` (split-KV).
        splits, chunk_kv, chunk_q: the structure.
        steps: loop iterations (all run; skipped ones run no matmul; 0 for straight).
        granule: cache rows per step (``splits x chunk_kv``).
        flops: executed matmul FLOPs at each fill of :data:`MODEL_FILLS` (exact for rows of
            that length).
        ops: modelled executed ops (other than views) at each fill.
        vector_elements: modelled vector elements at each fill.
        bytes_copied: modelled lowering copies of one call (mean over the fills).
        memory_bytes: modelled bytes live beyond the call's inputs and outputs (an upper bound).
        seconds: modelled time (:func:`popxl_flash.plan.ipu_time.time`) averaged over the fills.
        fits: ``memory_bytes`` within the budget.
    """
    splits: int
    chunk_kv: int
    chunk_q: int
    steps: int
    granule: int
    flops: tuple
    ops: tuple
    bytes_copied: int
    seconds: float
    structure: str = "loop"
    vector_elements: tuple = ()
    memory_bytes: int = 0
    fits: bool = True

    @property
    def straight(self):
        return self.structure == "straight"


@dataclass(frozen=True)
class DecodeChoice:
    """The automatic structure and the candidates weighed (:func:`decode_choice`)."""
    chosen: DecodeCandidate
    candidates: tuple
    reason: str
    memory_budget: int = 0

    def table(self):
        """The candidates as a text table (the chosen one marked ``*``)."""
        fills = "/".join(f"{int(f * 100)}%" for f in MODEL_FILLS)
        head = ("", "structure", "splits", "chunk", "steps", f"MFLOP {fills}",
                f"ops {fills}", "MiB", "fits", "modelled us")
        rows = [head]
        for c in self.candidates:
            rows.append(("*" if c is self.chosen else "", c.structure, str(c.splits),
                         str(c.chunk_kv), str(c.steps),
                         "/".join(f"{f / 1e6:.2f}" for f in c.flops),
                         "/".join(str(o) for o in c.ops), f"{c.memory_bytes / 2 ** 20:.2f}",
                         "yes" if c.fits else "NO", f"{c.seconds * 1e6:.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        return "\n".join(lines + [f"chosen: {self.chosen.structure}, num_splits="
                                  f"{self.chosen.splits}, chunk {self.chosen.chunk_kv} "
                                  f"({self.reason})"])


def _balanced(length, target):
    count = -(-length // target)
    return -(-length // count)


def _decode_classes(length, q_len, chunk_q, nkv, granule):
    """Runtime block classes (:func:`popxl_flash.graph.segments.classify_blocks`) of a causal call
    whose batch rows all hold ``length`` rows (``cache_seqlens + Lnew``): a step's kv chunk
    covers cache rows ``[m g, (m + 1) g)`` over its parts (granule ``g``), the q chunk ``i``
    positions ``length - Lq + [i cq, (i + 1) cq)``. Skip: no valid row, or every row after the
    chunk's last query; full: every row valid and at or before its first query, no q padding.

    Returns:
        int ``[nq, nkv]``.
    """
    nq = -(-q_len // chunk_q)
    classes = np.full((nq, nkv), RT_MASKED)
    for i in range(nq):
        q_first = length - q_len + i * chunk_q
        q_last = length - q_len + min((i + 1) * chunk_q, q_len) - 1
        q_pad = (i + 1) * chunk_q > q_len
        for m in range(nkv):
            lo, hi = m * granule, (m + 1) * granule
            if lo >= length or lo > q_last:
                classes[i, m] = RT_SKIP
            elif not q_pad and hi <= length and hi - 1 <= q_first:
                classes[i, m] = RT_FULL
    return classes


def _mod_ops(dims, splits, softcap, alibi):
    """``(per call, per executed step)`` ops of the score modifiers (:data:`OPS_MODS`)."""
    fixed = per_step = 0
    if softcap:
        per_step += OPS_MODS["softcap"]
    if alibi:
        per_step += OPS_MODS["alibi"]
        fixed += OPS_MODS["alibi_fixed"] + int(dims.batch > 1) + int(splits > 1)
    return fixed, per_step


def _window(window):
    return tuple(None if w is None or w < 0 else int(w) for w in window)


def _empties_possible(q_len, new_len, causal, window):
    """Whether a row of an in-range call can see no key (:func:`popxl_flash.graph.decode`)."""
    if new_len == 0:
        return True
    right = _window(window)[1]
    if causal:
        right = 0 if right is None else min(right, 0)
    return right is not None and new_len - q_len + right < 0


def straight_counts(dims, dtype="float16", *, causal=False, window=(-1, -1), softcap=False,
                    alibi=False, return_lse=False, runtime_lengths=True, scale=None):
    """Counted work of the straight-line pass (:mod:`popxl_flash.graph.decode`) of one call:
    the guard, the write of the new rows, the pass; rotary and host transfers excluded.

    Args:
        dims: the call's :class:`Dims`; dtype: its name.
        causal, window: the mask; softcap (the cap, or a bool), alibi: the score modifiers.
        return_lse: whether the call returns the logsumexp.
        scale: the softmax scale (``None``: ``1/sqrt(D)``); with an int ``cache_seqlens`` it
            decides whether the scale folds into q (float32, or a power of two).
        runtime_lengths: ``cache_seqlens`` is a tensor (else an int: a constant mask, counted
            as if some rows were masked).

    Returns:
        :class:`popxl_flash.plan.ipu_time.WorkCounts` (``ops`` exact on this version's graphs,
        held to the emulator's profile by ``tests/test_decode.py``; compute sets and vector
        work from them by :func:`popxl_flash.plan.ipu_time.from_ops`, an estimate).
    """
    from popxl_flash.plan.ipu_time import from_ops
    B, Lq, Lc, Ln = dims.batch, dims.q_len, dims.cache_len, dims.new_len
    Hq, Hkv, D = dims.q_heads, dims.kv_heads, dims.head_dim
    half = dtype == "float16"
    S = B * Hq * Lq * Lc  # score elements
    M = B * Lq * Lc  # mask elements
    R = B * Hq * Lq  # rows
    steps = vec = 0

    def op(elements, count=1):
        nonlocal steps, vec
        steps += count
        vec += elements * count

    if runtime_lengths:
        op(B, 5)  # guard: two comparisons, or, two selects (read lengths, write lengths)
        op(B, 2)  # the per-row scale: select, sqrt
        on_q = not half  # float32: on q; float16: on the float32 scores, no cast
    else:
        factor = (1.0 / math.sqrt(D) if scale is None else scale)
        if softcap:
            factor = factor / (softcap if not isinstance(softcap, bool) else 3.0)
        on_q = not half or math.frexp(factor)[0] == 0.5  # graph.decode.folds_exactly
    op(B * Lq * Hq * D if on_q else S)  # the scale
    if Ln:
        update = B * Ln * Hkv * D
        if runtime_lengths:
            steps += 3 * B  # per batch row: the index concat, an update per cache
            vec += 2 * B + 2 * update
        else:
            op(update, 2)
    left, right = _window(window)
    if runtime_lengths:
        op(M)  # lengths > lo
        if left is not None:
            op(M, 2)  # lengths <= hi, and
    if softcap:
        op(S, 2)  # tanh, * cap
    if alibi:
        if runtime_lengths:
            op(M, 3)  # q_pos - j, cast, abs
        op(S, 2)  # slope * distance, subtract
    op(S)  # where (an int cache_seqlens whose mask is all true has none: not modelled)
    op(S)  # softmax
    if half:
        op(S)  # cast of p
    if return_lse:
        op(R)  # logsumexp
    if _empties_possible(Lq, Ln, causal, window):
        op(R * D)  # out of rows that see nothing
        if return_lse:
            op(R)
    steps += 2  # the matmuls
    flops = 4 * B * Hq * Lq * Lc * D
    return from_ops(steps, flops, vec, dtype=dtype)


def flops_of(work):
    """Matmul FLOPs of a :class:`WorkCounts` (summed over dtypes)."""
    return sum(work.matmul_flops.values())


def straight_bytes(dims, dtype="float16", alibi=False, *, softcap=False, causal=False,
                   window=(-1, -1), return_lse=False, runtime_lengths=True, scale=None):
    """Upper bound of the straight-line pass's live bytes beyond its inputs and outputs
    (caches included: they are the caller's variables, live throughout): its graph
    (:func:`popxl_flash.graph.decode.straight_pass`) walked op by op with the emulator's
    liveness (:class:`popxl_flash.plan.memory._Live`), plus its constants (the int32 mask and
    ALiBi tables) and :data:`DECODE_ROW_FACTOR` q-sized float32 tensors and
    :data:`popxl_flash.plan.memory.FIXED_BYTES` for the guard, the write, rotary and the
    few-row tensors the walk leaves out."""
    from popxl_flash.plan import memory
    B, Lq, Lc, Hq = dims.batch, dims.q_len, dims.cache_len, dims.q_heads
    half = dtype == "float16"
    S4 = 4 * B * Hq * Lq * Lc  # a float32 score tensor [B, Hkv, r, Lq, Lc]
    M = B * Lq * Lc  # a bool mask [B, 1, 1, Lq, Lc]
    T = Lq * Lc  # a static table [Lq, Lc]
    left, right = _window(window)
    empties = _empties_possible(Lq, dims.new_len, causal, window)
    sim = memory._Live()
    factor = 1.0 / math.sqrt(dims.head_dim) if scale is None else scale
    if softcap:
        factor = factor / (softcap if not isinstance(softcap, bool) else 3.0)
    post = half and (runtime_lengths or math.frexp(factor)[0] != 0.5)
    sim.op(S4, "s")  # q k^T, float32
    if post:
        sim.op(S4, "s", ("s",))  # * scale (float16 q: on the scores)
    if softcap:
        sim.op(S4, "s", ("s",))  # tanh
        sim.op(S4, "s", ("s",))  # * cap
    constants = 0
    if alibi:
        if runtime_lengths:
            constants += 4 * T  # the relative positions
            sim.op(4 * M, "dist")  # lengths + rel (int32)
            sim.op(4 * M, "dist", ("dist",))  # cast
            sim.op(4 * M, "dist", ("dist",))  # abs
        else:
            constants += 4 * T  # the distance, a constant
        sim.op(S4, "bias", ("dist",))  # slope * distance
        sim.op(S4, "s", ("s", "bias"))  # s - bias
    if runtime_lengths:
        constants += 4 * T * (2 if left is not None else 1)  # lo (and hi + 1)
        sim.op(M, "first")  # lengths > lo
        if left is not None:
            sim.op(M, "upper")
            sim.op(M, "valid", ("upper",) if empties else ("upper", "first"))
        else:
            sim.held["valid"] = 0
    else:
        constants += T  # the mask, a constant
    sim.op(S4, "sm", ("s", "valid"))  # where(valid, s, MIN)
    sim.op(S4, "p", () if return_lse else ("sm",))  # softmax
    if half:
        sim.op(S4 // 2, "p", ("p",))  # cast
    sim.free("p")  # p v: out (an output)
    sim.free("sm", "first")  # logsumexp, the rows that see nothing
    rows = B * Hq * Lq * dims.head_dim
    allowance = DECODE_ROW_FACTOR * 4 * (rows + B * dims.new_len * dims.kv_heads * dims.head_dim)
    return int(sim.peak + constants + allowance + memory.FIXED_BYTES)


def _loop_bytes(dims, dtype, splits, chunk_kv, chunk_q, padded, *, layouts=("BSHD", "BSHD"),
                scale=None, softcap=False, alibi=False):
    """Upper bound of a kv loop's (one loop or split-KV) live bytes beyond its inputs and
    outputs (caches included): the call's graph (:mod:`popxl_flash.api.kvcache`: the segment
    ids and positions, the caches' regrouping or views; the core's segment-id forward,
    ``graph/forward.py`` with ``graph/segments.py``: the scaled k, the state, the kv ids
    repeated over grouped-query groups and classified, a step's dynamic slices and the
    conditional's copies of them, the block) walked op by op with the emulator's liveness
    (:class:`popxl_flash.plan.memory._Live`), plus the constants, :data:`DECODE_ROW_FACTOR`
    float32 copies of the q-row tensors (the combine, the q groups) and
    :data:`popxl_flash.plan.memory.LOOP_FIXED_BYTES`.

    Args:
        padded: the cache rows after padding to whole granules (``splits`` parts).
        layouts: the k and v caches' layouts (one loop over ``"BHSD"``/``"BHDS"`` caches reads
            them through views; ``"BSHD"``, split-KV and padding regroup them).
        softcap, alibi: the score modifiers (more block temporaries per step).
    """
    from popxl_flash.plan import memory
    item = 2 if dtype == "float16" else 4
    B, Hkv, D, Lq = dims.batch, dims.kv_heads, dims.head_dim, dims.q_len
    G = B * dims.q_heads * splits
    Gk = B * Hkv * splits
    P = padded // splits
    C = Gk * P * D * item  # one regrouped cache
    nq = -(-Lq // chunk_q)
    lq = nq * chunk_q
    sim = memory._Live()
    Q = dims.batch * dims.q_heads * Lq * D  # q's and out's elements
    rows = Q + dims.batch * dims.new_len * Hkv * D
    sim.op(DECODE_ROW_FACTOR * 4 * rows, "pre")  # the guard, rotary, the write
    sim.free("pre")
    # _segments: kv ids and positions [Gk', P] (their reshapes are views), q's positions; q's
    # groups (a transpose and a reshape: copies)
    sim.op(4 * G * Lq, "qpos")
    sim.op(item * G * Lq * D, "qg")
    sim.op(B * padded, "valid")
    sim.op(4 * Gk * P, "ids", ("valid",))
    sim.op(4 * Gk * P, "pos")
    for n, layout in enumerate(layouts):  # _cache_groups
        name, src = f"cache{n}", ()
        if padded > dims.cache_len:  # zeros, concat
            sim.op(C * (padded - dims.cache_len) // padded, "zeros")
            sim.op(C, name, ("zeros",))
            src = (name,)
        if layout == "BSHD" or splits > 1:
            sim.op(C, name, src)  # the transpose (a copy; its reshapes are views)
    # the core (graph/forward.py, segment ids): k * scale where it folds, q padded, the state
    if memory._scale_folds(D, scale):
        sim.op(C, "ks")
    if lq > Lq:
        sim.op(G * lq * D * item, "qpad")
    state = G * lq * (D + 2) * 4
    sim.op(state, "init")
    sim.op(state, "state", ("init",))
    # segments.prepare: kv ids and positions repeated over the q groups of a kv group, their
    # chunk statistics, the loop's copies of them
    Gs = G if (Gk not in (1, G)) else Gk
    I = 4 * Gs * P
    for t in ("ids", "pos"):
        if Gs != Gk:
            sim.op(4 * Gk * P, "e")  # reshape (a copy)
            sim.op(I, "e2", ("e",))  # concat
            sim.op(I, f"x{t}", ("e2",))  # reshape (a copy)
        else:
            sim.held[f"x{t}"] = 0
    sim.op(I, "cid")  # chunk_stats: ids reshape (a copy)
    sim.op(Gs * P, "real")
    sim.op(I, "w")
    sim.op(I, "w", ("w",))
    sim.op(Gs * P, "nreal")
    sim.op(I, "cast", ("nreal", "w"))
    sim.free("cast")
    sim.op(I, "cpos")  # positions reshape (a copy)
    sim.op(Gs * P, "eq")
    sim.op(Gs * P, "amin", ("eq",))
    sim.op(Gs * P, "eq")
    sim.op(Gs * P, "amax", ("eq",))
    sim.op(I, "w", ("amin",))
    sim.op(I, "w", ("w", "amax", "real", "cid"))
    sim.free("w", "cpos")
    sim.op(Gs * P, "g")  # loop_tensors: greater, where, reshape (a copy)
    sim.op(I, "lid", ("g", "xids"))
    sim.op(I, "lid", ("lid",))
    sim.op(I, "lpos", ("xpos",))
    # a step (repeat body): dynamic slices (copies), the conditional's copies of them, the block
    c, cq = chunk_kv, chunk_q
    slices = 2 * Gk * c * D * item + G * cq * (D + 2) * 4 + G * cq * D * item \
        + 2 * 4 * (Gs * c + G * cq)
    extra = 4 * (Gs * c + G * cq) if (softcap or alibi) else 0  # the modifiers' per-step operands
    sim.op(slices + extra, "slices")
    sim.op(extra, "prep")  # (the run branch's, before its nested conditional)
    sim.op(slices + extra, "branch", ("slices",))  # IfOpx copies the taken branch's inputs
    sim.free("prep")
    block = G * cq * c
    sim.op(int(DECODE_BLOCKS[softcap, alibi] * 4 * block), "block")  # the step's temporaries
    sim.free("block", "branch")
    # the finish (out = acc / l, cast), then the call's own: split-KV's combine in float32,
    # out's reshape and transpose (copies)
    sim.free("lid", "lpos", "xids", "xpos", "ks", "qpad")
    sim.op(4 * G * lq * D, "o32")
    sim.op(item * G * Lq * D, "o", ("o32", "state"))
    sim.free("ids", "pos", "qpos", "qg")
    if splits > 1:
        sim.op(item * G * Lq * D, "o", ("o",))  # reshape (a copy)
        sim.op(4 * G * Lq * D, "o32")  # cast
        sim.op(4 * G * Lq * D, "wo", ("o", "o32"))  # w * out
        sim.op(4 * Q, "acc", ("wo",))  # sum over the parts
        sim.op(4 * Q, "o", ("acc",))  # / total
        sim.op(item * Q, "o", ("o",))  # cast
    sim.op(item * Q, "o2", ("o",))  # reshape (a copy)
    sim.op(item * Q, "o", ("o2",))  # transpose
    allowance = 4 * 5 * G * lq  # the lse and its combine
    constants = 4 * padded + 4 * G * Lq + memory.TABLE_BYTES_PER_STEP * nq * (P // c)
    return int(sim.peak + constants + allowance + memory.LOOP_FIXED_BYTES)


def evaluate(dims, splits, chunk_kv, dtype="float16", lengths=None, softcap=False,
             alibi=False, *, straight=False, causal=False, window=(-1, -1), return_lse=False,
             runtime_lengths=True, memory_budget=None, layouts=("BSHD", "BSHD"), scale=None):
    """The model's figures of one structure (see :class:`DecodeCandidate`).

    Args:
        dims: the call's :class:`Dims`; splits, chunk_kv: the structure; dtype: its name.
        lengths: the longest row's ``cache_seqlens + Lnew`` at which to count (``None``: the
            fills :data:`MODEL_FILLS` of the cache).
        softcap, alibi: whether the call caps scores / adds ALiBi.
        straight: the straight-line pass (``splits``, ``chunk_kv`` ignored): its work does not
            depend on the fill (:func:`straight_counts`).
        causal, window, return_lse, runtime_lengths: the call's mask and options (counted by
            the straight-line pass).
        memory_budget: bytes (``None``: the default, :meth:`Dims.default_budget`).
        layouts: the k and v caches' layouts; scale: the softmax scale (``None``: ``1 /
            sqrt(D)``): both change the memory bound (views, the scaled k).

    A kv loop: FLOPs are exact for a step whose longest row holds that many rows: the executed
    steps are those with a row below that length, each ``4 x G' x cq x c x D`` FLOPs over the
    ``G' = B x Hq x splits`` groups. Supersteps follow :data:`OPS_DECODE` and
    :data:`OPS_MODS`, vector elements :data:`VEC_DECODE`; the copies are
    :func:`popxl_flash.plan.costmodel.pass_copies` of the forward's segment-id loop (PopART's
    rules, as the emulator models them; exact without softcap and ALiBi, whose per-step
    operands the branches also copy) over the runtime block classes of a causal call whose
    rows all hold that many rows (:func:`_decode_classes`).
    """
    from popxl_flash.plan import ipu_time, memory
    budget = memory.check_budget(memory_budget)
    if budget is None:
        budget = dims.default_budget(dtype)
    D, Lc = dims.head_dim, dims.cache_len
    cq = dims.q_len if dims.q_len <= MAX_DECODE_Q else _balanced(dims.q_len, PREFILL_CHUNK_Q)
    if lengths is None:
        lengths = [max(1, math.ceil(fill * Lc)) for fill in MODEL_FILLS]
    if straight:
        w = straight_counts(dims, dtype, causal=causal, window=window, softcap=softcap,
                            alibi=alibi, return_lse=return_lse,
                            runtime_lengths=runtime_lengths)
        mem = straight_bytes(dims, dtype, alibi, softcap=softcap, causal=causal,
                             window=window, return_lse=return_lse,
                             runtime_lengths=runtime_lengths, scale=scale)
        n = len(lengths)
        return DecodeCandidate(
            splits=1, chunk_kv=Lc, chunk_q=dims.q_len, steps=0, granule=Lc,
            flops=(flops_of(w),) * n, ops=(w.ops,) * n, bytes_copied=0,
            seconds=ipu_time.time(w, dtype).seconds, structure="straight",
            vector_elements=(w.vector_elements,) * n, memory_bytes=mem, fits=mem <= budget)
    G = dims.batch * dims.q_heads * splits
    Gk = dims.batch * dims.kv_heads * splits
    nq = -(-dims.q_len // cq)
    granule = splits * chunk_kv
    per_part = -(-Lc // granule)
    steps = per_part * nq
    flops, op_counts, vectors, seconds = [], [], [], 0.0
    sched = _schedule.plan(dims.q_len, per_part * chunk_kv, cq, chunk_kv,
                           causal=False, window=(-1, -1))  # positions decide: no static mask
    seg = SegmentConfig(q_groups=G, kv_groups=Gk, positions=True)
    copied_mean = 0.0
    mod_fixed, mod_step = _mod_ops(dims, splits, softcap, alibi)
    for rows in lengths:
        executed = -(-rows // granule) * nq
        f = 4 * G * cq * chunk_kv * D * executed
        o = round(OPS_DECODE["fixed"] + OPS_DECODE["per_row"] * dims.batch
                  + OPS_DECODE["per_step"] * steps + OPS_DECODE["per_executed"] * executed
                  + (OPS_DECODE["combine"] if splits > 1 else 0)
                  + mod_fixed + mod_step * executed)
        vec = round(executed * (VEC_DECODE["block"] * G * cq * chunk_kv
                                + VEC_DECODE["rows"] * G * cq * D)
                    + VEC_DECODE["step"] * steps * G * cq
                    + VEC_DECODE["cache"] * Gk * per_part * chunk_kv * (D + 2))
        flops.append(f)
        op_counts.append(o)
        vectors.append(vec)
        classes = _decode_classes(rows, dims.q_len, cq, sched.nkv, granule)
        copied = sum(costmodel.pass_copies(sched, groups=G, kv_groups=Gk, head_dim=D,
                                           dtype=dtype, backward=False, segments=seg,
                                           classes=classes).values())
        copied_mean += copied / len(lengths)
        seconds += ipu_time.time(ipu_time.from_ops(o, f, vec, copied, dtype)).seconds \
            / len(lengths)
    mem = _loop_bytes(dims, dtype, splits, chunk_kv, cq, per_part * granule, layouts=layouts,
                      scale=scale, softcap=bool(softcap), alibi=bool(alibi))
    return DecodeCandidate(splits=splits, chunk_kv=chunk_kv, chunk_q=cq, steps=steps,
                           granule=granule, flops=tuple(flops), ops=tuple(op_counts),
                           bytes_copied=round(copied_mean), seconds=seconds,
                           structure="split" if splits > 1 else "loop",
                           vector_elements=tuple(vectors), memory_bytes=mem,
                           fits=mem <= budget)


def decode_choice(batch, q_len, cache_len, *, q_heads, kv_heads, head_dim, dtype="float16",
                  num_splits=None, chunk_kv=None, softcap=False, alibi=False, new_len=None,
                  causal=False, window=(-1, -1), return_lse=False, runtime_lengths=True,
                  max_splits=None, memory_budget=None, layouts=("BSHD", "BSHD"), scale=None):
    """Choose the structure of a cache call: the straight-line pass, one kv loop with chunks,
    or split-KV, by least modelled time within ``memory_budget``.

    Candidates: the straight-line pass (one q chunk, ``Lq <=`` :data:`MAX_DECODE_Q`, ``Lq <=
    Lcache``, and neither ``num_splits`` nor ``chunk_kv`` fixed), and chunks
    :data:`DECODE_CHUNKS` (balanced over each part, capped at its length) times splits
    :data:`DECODE_SPLITS` (prefill, ``Lq >`` :data:`MAX_DECODE_Q`: no split; ``max_splits``
    bounds them). Among those whose modelled memory fits the budget, the least modelled time
    (:func:`popxl_flash.plan.ipu_time.time` of the counted ops (priced as compute sets), FLOPs, vector elements
    and copies, averaged over the fills :data:`MODEL_FILLS`) wins (ties: the straight-line pass,
    fewer splits, the shorter chunk). When none fits: with an explicit ``memory_budget``
    ``ValueError``; with the default, the candidate of least memory.

    Args:
        batch, q_len, cache_len, q_heads, kv_heads, head_dim: the call's sizes.
        dtype: ``"float16"`` or ``"float32"``.
        num_splits, chunk_kv: fix that part of the structure (``None``: choose; either one
            excludes the straight-line pass).
        softcap, alibi: the call's score modifiers.
        new_len: ``Lnew`` (``None``: ``q_len``).
        causal, window, return_lse, runtime_lengths: the call's mask and options.
        max_splits: largest split count tried (``None``: all of :data:`DECODE_SPLITS`).
        memory_budget: bytes beyond inputs and outputs (``None``: the default,
            :meth:`Dims.default_budget`, O(L)).
        layouts, scale: the caches' layouts and the softmax scale (for the memory bounds).

    Returns:
        :class:`DecodeChoice`.
    """
    from popxl_flash.plan import memory
    explicit = memory_budget is not None
    budget = memory.check_budget(memory_budget)
    new_len = q_len if new_len is None else new_len
    dims = Dims(batch, q_len, cache_len, new_len, q_heads, kv_heads, head_dim)
    if budget is None:
        budget = dims.default_budget(dtype)
    common = dict(causal=causal, window=window, return_lse=return_lse,
                  runtime_lengths=runtime_lengths, memory_budget=budget, layouts=layouts,
                  scale=scale)
    if num_splits is not None:
        split_options = (num_splits,)
    else:
        split_options = DECODE_SPLITS if q_len <= MAX_DECODE_Q else (1,)
        if max_splits is not None:
            split_options = tuple(s for s in split_options if s <= max_splits)
    candidates = []
    if num_splits is None and chunk_kv is None and q_len <= min(MAX_DECODE_Q, cache_len):
        candidates.append(evaluate(dims, 1, cache_len, dtype, softcap=softcap, alibi=alibi,
                                   straight=True, **common))
    for s in split_options:
        part = -(-cache_len // s)
        chunks = (chunk_kv,) if chunk_kv is not None else sorted(
            {_balanced(part, c) for c in DECODE_CHUNKS})
        candidates.extend(evaluate(dims, s, c, dtype, softcap=softcap, alibi=alibi, **common)
                          for c in chunks)
    fitting = [c for c in candidates if c.fits]
    fixed = [name for name, value in (("num_splits", num_splits), ("chunk", chunk_kv))
             if value is not None]
    if fitting:
        chosen = min(fitting, key=lambda c: (round(c.seconds, 12), not c.straight, c.splits,
                                             c.chunk_kv))
        reason = (f"least modelled time over fills {MODEL_FILLS} within memory_budget="
                  f"{budget:,} bytes")
    elif explicit:
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise ValueError(f"no decode structure fits memory_budget={budget:,} bytes: the "
                         f"least modelled memory is {least.memory_bytes:,} bytes ({least.structure}, "
                         f"num_splits={least.splits}, chunk {least.chunk_kv}); raise "
                         "memory_budget or shorten the cache")
    else:
        chosen = min(candidates, key=lambda c: (c.memory_bytes, c.seconds))
        reason = "least modelled memory: no structure fits the default memory_budget"
    if fixed:
        reason += f"; {' and '.join(fixed)} fixed by the caller"
    return DecodeChoice(chosen=chosen, candidates=tuple(candidates), reason=reason,
                        memory_budget=budget)


#: How :func:`explain` names the sizes in messages (its arguments).
EXPLAIN_NAMES = {field: field for field in CALL_NAMES}


def explain(batch, q_len, cache_len, *, q_heads, kv_heads=None, head_dim, dtype="float16",
            num_splits=None, softcap=0.0, alibi=False, new_len=None, causal=False,
            window=(-1, -1), return_lse=False, memory_budget=None):
    """The structure choice of a :func:`flash_attn_with_kvcache` call with a run-time
    ``cache_seqlens`` (a :class:`DecodeChoice`; ``.table()`` prints the candidates with FLOPs,
    ops and memory; ``softcap > 0`` and ``alibi=True`` count the score modifiers;
    ``memory_budget`` as the call's).

    Validated as the call: the sizes by :func:`check_dims`, ``num_splits`` by
    :func:`check_structure_options`, the options by the call's own checks; a setting the call
    refuses raises the same ``ValueError``/``TypeError`` here, naming this function's argument.

    Args:
        batch, q_len, cache_len: B, Lq, Lcache (``>= 1``). q_heads, kv_heads: Hq and Hkv
            (``None``: Hq), Hkv dividing Hq. head_dim: D. new_len: Lnew, the new rows
            (``None``: ``q_len``; ``0 <= new_len <= cache_len``).
        dtype: ``"float16"``/``"float32"`` or the NumPy or PopXL dtype.
        num_splits, softcap, causal, window (the call's ``window_size``), return_lse,
        memory_budget: as the call's. alibi: whether the call has ALiBi slopes (a bool).

    Returns:
        :class:`DecodeChoice`.
    """
    from popxl_flash.plan.config import check_bool, check_dtype_name, check_window
    from popxl_flash.plan.score_mods import options as mod_options
    dims = check_dims(Dims(batch, q_len, cache_len, q_len if new_len is None else new_len,
                           q_heads, q_heads if kv_heads is None else kv_heads, head_dim),
                      EXPLAIN_NAMES)
    num_splits, _, _ = check_structure_options(dims, num_splits)
    mods = mod_options(softcap, check_bool("alibi", alibi))
    return decode_choice(dims.batch, dims.q_len, dims.cache_len, q_heads=dims.q_heads,
                         kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                         dtype=check_dtype_name(dtype), num_splits=num_splits,
                         softcap=mods is not None and mods.softcap > 0,
                         alibi=mods is not None and mods.alibi, new_len=dims.new_len,
                         causal=check_bool("causal", causal),
                         window=check_window(window, name="window"),
                         return_lse=check_bool("return_lse", return_lse),
                         memory_budget=memory_budget)


def _structure(dims, dtype, num_splits, num_chunks_q, num_chunks_kv, mods=None, *,
               causal=False, window=(-1, -1), return_lse=False, runtime_lengths=True,
               max_splits=None, memory_budget=None, layouts=("BSHD", "BSHD"), scale=None):
    """``(straight, splits, chunk_q, num_chunks_q, chunk_kv, num_chunks_kv_per_part)`` of a
    call."""
    num_splits, chunk_kv, nq_fixed = check_structure_options(dims, num_splits, num_chunks_q,
                                                             num_chunks_kv)
    choice = decode_choice(dims.batch, dims.q_len, dims.cache_len, q_heads=dims.q_heads,
                           kv_heads=dims.kv_heads, head_dim=dims.head_dim, dtype=dtype,
                           num_splits=num_splits, chunk_kv=chunk_kv,
                           softcap=mods is not None and mods.softcap > 0,
                           alibi=mods is not None and mods.alibi, new_len=dims.new_len,
                           causal=causal, window=window, return_lse=return_lse,
                           runtime_lengths=runtime_lengths, max_splits=max_splits,
                           memory_budget=memory_budget, layouts=layouts, scale=scale)
    chosen = choice.chosen
    if chosen.straight and nq_fixed not in (None, 1):
        loops = [c for c in choice.candidates if not c.straight and c.fits] or \
            [c for c in choice.candidates if not c.straight]
        chosen = min(loops, key=lambda c: (round(c.seconds, 12), c.splits, c.chunk_kv))
    if chosen.straight:
        return True, 1, dims.q_len, 1, dims.cache_len, 1
    splits = chosen.splits
    chunk_kv = min(chosen.chunk_kv, -(-dims.cache_len // splits))
    per_part = -(-dims.cache_len // (splits * chunk_kv))
    if nq_fixed is not None:
        chunk_q = -(-dims.q_len // nq_fixed)
    else:
        chunk_q = chosen.chunk_q
    return False, splits, chunk_q, -(-dims.q_len // chunk_q), chunk_kv, per_part
