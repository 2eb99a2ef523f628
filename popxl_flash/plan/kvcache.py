"""KV cache, host side: the decode structure choice and its cost model (no graph code).

:func:`flash_attn_with_kvcache <popxl_flash.api.kvcache.flash_attn_with_kvcache>` runs its cache
as ``S = num_splits`` parts of chunks of ``c`` cache rows (split-KV, flash-decoding; ``S = 1``:
one kv loop). This module chooses ``S`` and ``c`` when the caller does not:
:func:`decode_choice` weighs the candidates (chunks :data:`DECODE_CHUNKS` times splits
:data:`DECODE_SPLITS`) by :func:`evaluate`'s figures (exact executed FLOPs per fill, ops from
:data:`OPS_DECODE` and :data:`OPS_MODS`, lowering copies from
:func:`popxl_flash.plan.costmodel.pass_copies`) and :func:`explain` reports them; :func:`_structure`
turns a call's options into its structure. Everything here is numpy on the host (see
``docs/design.md``, "KV cache"); :mod:`popxl_flash.api.kvcache` re-exports the public names.
"""
import math
from dataclasses import dataclass

import numpy as np

from popxl_flash.plan import costmodel
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan.config import _check_int
from popxl_flash.plan.segments import RT_FULL, RT_MASKED, RT_SKIP, SegmentConfig

#: Chunk lengths the automatic decode choice tries (rows of the cache per chunk).
DECODE_CHUNKS = (16, 32, 64, 128, 256)
#: Split counts the automatic decode choice tries.
DECODE_SPLITS = (1, 2, 4, 8)
#: Largest skipping granule (``chunk x splits`` cache rows) the automatic choice accepts: the
#: executed work of a step exceeds the filled rows by less than one granule.
MAX_GRANULE = 256
#: Largest ``Lq`` treated as a decode shape (one q chunk; larger ``Lq`` is a prefill: q chunks
#: of at most :data:`PREFILL_CHUNK_Q` rows, no split).
MAX_DECODE_Q = 16
PREFILL_CHUNK_Q = 64
#: Cache fills the automatic choice averages its modelled time over.
MODEL_FILLS = (0.1, 0.5, 1.0)
#: Ops executed by one call, fitted on the emulator to this version's graphs (B in {1, 2}, 8
#: and 16 steps, 1 split or 4, fills of 100 to 4095 rows: within 1%; held to the emulator's
#: profile by ``tests/test_kvcache.py``): ``fixed + per_row * B + per_step * steps +
#: per_executed * executed steps (+ combine with splits)``. A skipped step costs its table
#: lookup, slices, the conditional and the state's pass-through (one state tensor).
OPS_DECODE = dict(fixed=157, per_row=8, per_step=17, per_executed=24.5, combine=21)
#: Ops the score modifiers add to a call, measured on the emulator (exact over three fills, one
#: loop and split-KV): softcap per executed step; ALiBi per executed step and per call (the
#: slopes laid out per group and negated: 4, +1 to repeat ``[Hq]`` slopes over ``B > 1``, +1
#: with splits; the model counts ``[Hq]``). Skipped steps run none of them.
OPS_MODS = dict(softcap=3, alibi=5, alibi_fixed=4)


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


# -- structure choice ------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeCandidate:
    """One structure of a call: ``splits`` parts, chunks of ``chunk_kv`` cache rows.

    Attributes:
        splits, chunk_kv, chunk_q: the structure.
        steps: loop iterations (all run; skipped ones run no matmul).
        granule: cache rows per step (``splits x chunk_kv``).
        flops: executed matmul FLOPs at each fill of :data:`MODEL_FILLS` (exact for rows of
            that length).
        ops: modelled ops executed at each fill.
        bytes_copied: modelled lowering copies of one call (mean over the fills).
        seconds: modelled time averaged over the fills.
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


@dataclass(frozen=True)
class DecodeChoice:
    """The automatic structure and the candidates weighed (:func:`decode_choice`)."""
    chosen: DecodeCandidate
    candidates: tuple
    reason: str

    def table(self):
        """The candidates as a text table (the chosen one marked ``*``)."""
        fills = "/".join(f"{int(f * 100)}%" for f in MODEL_FILLS)
        head = ("", "splits", "chunk", "granule", "steps", f"MFLOP {fills}", f"ops {fills}",
                "model us")
        rows = [head]
        for c in self.candidates:
            rows.append(("*" if c is self.chosen else "", str(c.splits), str(c.chunk_kv),
                         str(c.granule), str(c.steps),
                         "/".join(f"{f / 1e6:.2f}" for f in c.flops),
                         "/".join(str(o) for o in c.ops), f"{c.seconds * 1e6:.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        return "\n".join(lines + [f"chosen: num_splits={self.chosen.splits}, chunk "
                                  f"{self.chosen.chunk_kv} ({self.reason})"])


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


def evaluate(dims, splits, chunk_kv, dtype="float16", lengths=None, softcap=False,
             alibi=False):
    """The model's figures of one structure (see :class:`DecodeCandidate`).

    Args:
        dims: the call's :class:`Dims`; splits, chunk_kv: the structure; dtype: its name.
        lengths: the longest row's ``cache_seqlens + Lnew`` at which to count (``None``: the
            fills :data:`MODEL_FILLS` of the cache).
        softcap, alibi: whether the call caps scores / adds ALiBi (ops :data:`OPS_MODS`).

    FLOPs are exact for a step whose longest row holds that many rows: the executed
    steps are those with a row below that length, each ``4 x G' x cq x c x D`` FLOPs over the
    ``G' = B x Hq x splits`` groups. Ops follow :data:`OPS_DECODE`; the copies are
    :func:`popxl_flash.plan.costmodel.pass_copies` of the forward's segment-id loop (PopART's rules,
    as the emulator models them; exact without softcap and ALiBi, whose per-step operands the
    branches also copy) over the runtime block classes of a causal call whose
    rows all hold that many rows (:func:`_decode_classes`): every step copies its counter and
    LoopOpx's control values and the taken branch's inputs and outputs, the state rows for a
    skipped step, and for an executed one the state rows, the block's operands and segment
    operands at two branch levels (averaged over the fills, like the time).
    """
    G = dims.batch * dims.q_heads * splits
    Gk = dims.batch * dims.kv_heads * splits
    D, Lc = dims.head_dim, dims.cache_len
    cq = dims.q_len if dims.q_len <= MAX_DECODE_Q else _balanced(dims.q_len, PREFILL_CHUNK_Q)
    nq = -(-dims.q_len // cq)
    granule = splits * chunk_kv
    steps = -(-Lc // granule) * nq
    flops, op_counts, seconds = [], [], 0.0
    sched = _schedule.plan(dims.q_len, -(-Lc // granule) * chunk_kv, cq, chunk_kv,
                           causal=False, window=(-1, -1))  # positions decide: no static mask
    seg = SegmentConfig(q_groups=G, kv_groups=Gk, positions=True)
    copied_mean = 0.0
    if lengths is None:
        lengths = [max(1, math.ceil(fill * Lc)) for fill in MODEL_FILLS]
    mod_fixed, mod_step = _mod_ops(dims, splits, softcap, alibi)
    for rows in lengths:
        executed = -(-rows // granule) * nq
        f = 4 * G * cq * chunk_kv * D * executed
        o = round(OPS_DECODE["fixed"] + OPS_DECODE["per_row"] * dims.batch
                  + OPS_DECODE["per_step"] * steps + OPS_DECODE["per_executed"] * executed
                  + (OPS_DECODE["combine"] if splits > 1 else 0)
                  + mod_fixed + mod_step * executed)
        flops.append(f)
        op_counts.append(o)
        classes = _decode_classes(rows, dims.q_len, cq, sched.nkv, granule)
        copied = sum(costmodel.pass_copies(sched, groups=G, kv_groups=Gk, head_dim=D,
                                           dtype=dtype, backward=False, segments=seg,
                                           classes=classes).values())
        copied_mean += copied / len(lengths)
        seconds += costmodel._seconds(f, o, copied, dtype) / len(lengths)
    return DecodeCandidate(splits=splits, chunk_kv=chunk_kv, chunk_q=cq, steps=steps,
                           granule=granule, flops=tuple(flops), ops=tuple(op_counts),
                           bytes_copied=round(copied_mean), seconds=seconds)


def decode_choice(batch, q_len, cache_len, *, q_heads, kv_heads, head_dim, dtype="float16",
                  num_splits=None, chunk_kv=None, softcap=False, alibi=False):
    """Compare one long kv loop against split-KV for a cache call and choose.

    Candidates: chunks :data:`DECODE_CHUNKS` (balanced over each part, capped at its length)
    times splits :data:`DECODE_SPLITS` (prefill, ``Lq >`` :data:`MAX_DECODE_Q`: no split).
    Those whose granule ``splits x chunk`` is at most :data:`MAX_GRANULE` rows (a step's
    executed work then follows the fill within one granule) are preferred; among them the least
    modelled time averaged over the fills :data:`MODEL_FILLS` wins (ties: fewer splits, then
    the shorter chunk).

    Args:
        batch, q_len, cache_len, q_heads, kv_heads, head_dim: the call's sizes.
        dtype: ``"float16"`` or ``"float32"``.
        num_splits, chunk_kv: fix that part of the structure (``None``: choose).
        softcap, alibi: the call's score modifiers (counted in the ops, :data:`OPS_MODS`).

    Returns:
        :class:`DecodeChoice`.
    """
    dims = Dims(batch, q_len, cache_len, q_len, q_heads, kv_heads, head_dim)
    if num_splits is not None:
        split_options = (num_splits,)
    else:
        split_options = DECODE_SPLITS if q_len <= MAX_DECODE_Q else (1,)
    candidates = []
    for s in split_options:
        part = -(-cache_len // s)
        chunks = (chunk_kv,) if chunk_kv is not None else sorted(
            {_balanced(part, c) for c in DECODE_CHUNKS})
        candidates.extend(evaluate(dims, s, c, dtype, softcap=softcap, alibi=alibi)
                          for c in chunks)
    granular = [c for c in candidates if c.granule <= MAX_GRANULE] or candidates
    chosen = min(granular, key=lambda c: (round(c.seconds, 12), c.splits, c.chunk_kv))
    fixed = [name for name, value in (("num_splits", num_splits), ("chunk", chunk_kv))
             if value is not None]
    reason = f"least modelled time over fills {MODEL_FILLS}"
    if len(granular) < len(candidates) or chosen.granule <= MAX_GRANULE:
        reason += f" with granule <= {MAX_GRANULE} rows"
    if fixed:
        reason += f"; {' and '.join(fixed)} fixed by the caller"
    return DecodeChoice(chosen=chosen, candidates=tuple(candidates), reason=reason)


def explain(batch, q_len, cache_len, *, q_heads, kv_heads=None, head_dim, dtype="float16",
            num_splits=None, softcap=0.0, alibi=False):
    """The decode structure choice of a :func:`flash_attn_with_kvcache` call (a
    :class:`DecodeChoice`; ``.table()`` prints the candidates with FLOPs and ops per fill;
    ``softcap > 0`` and ``alibi=True`` count the score modifiers' ops)."""
    return decode_choice(batch, q_len, cache_len, q_heads=q_heads,
                         kv_heads=q_heads if kv_heads is None else kv_heads,
                         head_dim=head_dim, dtype=dtype, num_splits=num_splits,
                         softcap=bool(softcap), alibi=bool(alibi))


def _structure(dims, dtype, num_splits, num_chunks_q, num_chunks_kv, mods=None):
    """``(splits, chunk_q, num_chunks_q, chunk_kv, num_chunks_kv_per_part)`` of a call."""
    if num_splits is not None:
        num_splits = _check_int("num_splits", num_splits, low=0, high=dims.cache_len)
        num_splits = None if num_splits == 0 else num_splits  # flash-attn: 0 = automatic
    chunk_kv = None
    if num_chunks_kv is not None:
        n = _check_int("num_chunks_kv", num_chunks_kv, low=1, high=dims.cache_len)
        chunk_kv = -(-dims.cache_len // n)
    choice = decode_choice(dims.batch, dims.q_len, dims.cache_len, q_heads=dims.q_heads,
                           kv_heads=dims.kv_heads, head_dim=dims.head_dim, dtype=dtype,
                           num_splits=num_splits, chunk_kv=chunk_kv,
                           softcap=mods is not None and mods.softcap > 0,
                           alibi=mods is not None and mods.alibi).chosen
    splits = choice.splits
    chunk_kv = min(choice.chunk_kv, -(-dims.cache_len // splits))
    per_part = -(-dims.cache_len // (splits * chunk_kv))
    if num_chunks_q is not None:
        nq = _check_int("num_chunks_q", num_chunks_q, low=1, high=dims.q_len)
        chunk_q = -(-dims.q_len // nq)
    else:
        chunk_q = choice.chunk_q
    return splits, chunk_q, -(-dims.q_len // chunk_q), chunk_kv, per_part
