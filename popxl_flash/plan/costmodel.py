"""Cost model of the automatic chunk choice (``num_chunks_*=None``) and of the loop structure.

No IPU is available to time candidates, so the model combines **exact counts** from the planner
with **stated IPU facts** and a few **overhead parameters**:

* exact, from :class:`popxl_flash.plan.schedule.BlockSchedule` and :mod:`popxl_flash.plan.steps`:
  executed matmul FLOPs (forward and stash backward) and loop iterations (one ``repeat`` step
  per visited block, two per split block; one loop per step group);
* counted on this version's graphs: ops executed per step of an unmasked and of a masked group,
  per loop and per pass (``OPS_*``; the tests hold the estimate to the emulator's profile);
* bytes copied at call, branch and loop boundaries under PopART's lowering rules (below) and
  the working set (resident tensors + one step's temporaries);
* IPU (GC200, Mk2) facts: :data:`TILES`, :data:`TILE_MEMORY_BYTES`, :data:`CLOCK_HZ`, matmul
  FLOPs per tile-cycle; and assumed overheads :data:`OP_CYCLES`, :data:`ITERATION_CYCLES`,
  :data:`COPY_BYTES_PER_TILE_CYCLE` (parameters, not measurements).

Copies (:func:`pass_copies`; PopART sdk-release-3.4, the rules of the emulator's copy model
``popxl_flash/emulator/copies.py``, and the tests hold the two equal kind by kind;
``aliasZeroCopy`` is on in every PopXL ``Ir``): a loop's read-only inputs (q, k, v and the
other operands, the segment ids) and its by-reference state (``m, l, acc``; ``dq, dk, dv``,
updated by ``dynamic_update_`` and read by nothing else while the loop runs) are aliased, not
copied (``AliasZeroCopy::checkSubgraphInputCompatible``); the carried step counter is copied
into its clone and back every iteration and its initial value once, and LoopOpx copies its
iterator and condition (6 bytes per iteration, 2 per loop: ``loop_control``); with segment
ids, the taken branch of each conditional level copies all its inputs and outputs
(``IfOpx``): the state slices for a skipped block; the state slices, the block's operands and
segment operands (and the pattern or the runtime-full flag) for a running one, again at the
second level of an unmasked group where :func:`second_level` keeps one. Per-step copies
therefore do not grow with L: 14 bytes without segment ids.

Modelled time of one pass::

    t = executed_flops / (TILES * flops_per_tile_cycle * CLOCK_HZ)
      + (ops * OP_CYCLES + iterations * ITERATION_CYCLES) / CLOCK_HZ
      + bytes_copied / (TILES * COPY_BYTES_PER_TILE_CYCLE * CLOCK_HZ)

Choice: candidates are the target chunk lengths :data:`CANDIDATE_CHUNKS`, each balanced over
the sequence (``n = ceil(L / target)`` chunks of ``ceil(L / n)``, so a tail pads little). A
candidate is **eligible** if (1) its working set fits the usable tile memory
(``TILES * TILE_MEMORY_BYTES * USABLE_MEMORY_FRACTION``), (2) one step's temporaries are at most
the resident tensors (memory stays O(L): a chunk as long as L would make flash as heavy as
naive attention), and (3) its forward executed/useful FLOP ratio is at most
:data:`MAX_FLOP_RATIO`. The eligible candidate with the least modelled forward + backward time
wins. If none is eligible (windows, short causal sequences: no chunking wastes under 3.5%), the
least modelled time among those meeting (1), (2) and :data:`FALLBACK_FLOP_RATIO` wins, else the
least FLOP ratio among those meeting (1) and (2), then (1); if none fits, the smallest working
set (the report flags it).

With G = 2, D = 64 the per-op overhead dominates the FLOP term, so the model prefers the longest
chunk the FLOP budget and the O(L) rule allow: causal L = 2048 gets 128 (ratio 1.031; 256 would
waste 6.2%), L = 4096 gets 256.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan import steps as _steps
from popxl_flash.plan.segments import RT_FULL, RT_MASKED, RT_SKIP

#: Tiles of one IPU (GC200 / Mk2: 1472 tiles, 900 MB In-Processor-Memory, 250 TFLOP/s float16
#: and 62.5 TFLOP/s float32 peak; Graphcore's IPU-M2000 / Colossus Mk2 announcement, 2020).
TILES = 1472
#: SRAM per tile (GC200: 624 KiB; Graphcore's IPU datasheet).
TILE_MEMORY_BYTES = 624 * 1024
#: Clock of the GC200 (1.33 GHz; Graphcore's IPU-M2000 datasheet).
CLOCK_HZ = 1.33e9
#: Peak matmul FLOPs per tile-cycle (float32 accumulation): GC200 peak 250 TFLOP/s float16 and
#: 62.5 TFLOP/s float32, divided by tiles and clock (~128 and ~32).
FLOPS_PER_TILE_CYCLE = {"float16": 128, "float32": 32}
#: Assumed cycles of one executed op: each op is at least one bulk-synchronous superstep
#: (compute set, chip-wide sync, exchange); about 0.75 us at 1.33 GHz, the "few microseconds or
#: less" order of a Poplar program step. A parameter, not a measurement.
OP_CYCLES = 1000
#: Assumed extra cycles per loop iteration (counter, loop control). A parameter.
ITERATION_CYCLES = 200
#: Assumed bytes a tile copies per cycle in a lowering copy (64-bit load + store; the GC200's
#: 47.5 TB/s memory bandwidth is ~24 B per tile-cycle, shared by the load and the store, and
#: exchange is 8 TB/s chip-wide). A parameter.
COPY_BYTES_PER_TILE_CYCLE = 8
#: Fraction of tile memory assumed usable for tensors (the rest: code, exchange buffers,
#: Poplar temporaries). A parameter.
USABLE_MEMORY_FRACTION = 0.5
#: Wasted-work budget: largest forward executed/useful FLOP ratio the choice accepts.
MAX_FLOP_RATIO = 1.035
#: Second-tier budget, for masks no candidate meets the first for (windows, short causal
#: sequences): the fastest chunking within it wins, else the least wasteful.
FALLBACK_FLOP_RATIO = 1.25
#: Chunk lengths tried (square blocks; capped at the sequence lengths).
CANDIDATE_CHUNKS = (64, 128, 256, 512)

#: Ops executed per pass (views included), counted on this version's graphs (the emulator's
#: profile): ``fixed + per_loop * loops + per_step * steps + per_masked * steps of masked
#: groups + per_gather * steps of groups with several patterns``, a group of one step
#: running inline for ``per_inline`` (+ ``per_masked``) instead. ``per_step``: the step table
#: lookup (its entries are views), the operand and state slices, the block update, the state
#: writes and the counter increment; ``per_masked``: the ``where`` selects; ``per_gather``:
#: the pattern id's view and the pattern gather. float32 has no casts (one fewer per step). A
#: pass of one block (``steps.single_block``) is a straight line these weights do not
#: describe; :func:`popxl_flash.plan.counts.pass_counts` counts it (and supersteps, views
#: left out).
OPS_FORWARD = {"float16": dict(fixed=15, per_loop=1, per_step=30, per_masked=2, per_gather=2,
                               per_inline=25),
               "float32": dict(fixed=14, per_loop=1, per_step=29, per_masked=2, per_gather=2,
                               per_inline=24)}
OPS_BACKWARD = {"float16": dict(fixed=24, per_loop=1, per_step=41, per_masked=1, per_gather=2,
                                per_inline=36),
                "float32": dict(fixed=19, per_loop=1, per_step=40, per_masked=1, per_gather=2,
                                per_inline=35)}

#: Bytes of the carried step counter (int32 [1]): every iteration, body output -> clone ->
#: body input (``LoopOpx``); once per repeat, its initial value into the clone.
COUNTER_BYTES = 4
#: ``LoopOpx``'s own copies (``willow/src/popx/op/loopx.cpp``): every iteration the int32
#: iterator into the body and the bool condition (the wrapper's body output 0) into its clone
#: and back; once per repeat ``true`` into the condition's clone and ``false`` into the exit
#: flag. Bytes once per repeat and per iteration.
LOOP_CONTROL_ONCE, LOOP_CONTROL_STEP = 2 * 1, 4 + 2 * 1
#: Boundary kinds of :func:`pass_copies` (those of the emulator's ``bytes_copied_by_kind``).
COPY_KINDS = ("call", "branch", "loop_carried", "loop_in_out", "loop_control")

_F32 = _I32 = 4


@dataclass(frozen=True)
class Candidate:
    """The model's figures for one chunking (all counts for G, D, dtype of the request).

    Attributes:
        chunk_q, chunk_kv, num_chunks_q, num_chunks_kv: the chunking.
        flop_ratio: forward executed / useful matmul FLOPs (exact).
        forward_flops, backward_flops: executed matmul FLOPs, backward in stash mode (exact).
        iterations: loop iterations per pass: visited blocks plus split blocks' second
            sub-blocks (exact).
        ops_forward, ops_backward: ops executed per pass (counted model).
        bytes_copied_forward, bytes_copied_backward: lowering copies per pass under PopART's
            rules (:func:`pass_copies`, without segment ids: the step counters and loop
            control; equal to the emulator's).
        working_set_bytes: resident tensors + one step's temporaries, larger pass (model).
        step_bytes: one step's temporaries (model; the part that grows with the chunk).
        fits: working set within the usable tile memory.
        linear_memory: ``step_bytes`` at most the resident tensors' bytes, so memory stays
            O(L) (what flash attention is for).
        eligible: fits, linear_memory and ``flop_ratio <= MAX_FLOP_RATIO``.
        seconds: modelled forward + backward time on one IPU.
    """

    chunk_q: int
    chunk_kv: int
    num_chunks_q: int
    num_chunks_kv: int
    flop_ratio: float
    forward_flops: int
    backward_flops: int
    iterations: int
    ops_forward: int
    ops_backward: int
    bytes_copied_forward: int
    bytes_copied_backward: int
    working_set_bytes: int
    step_bytes: int
    fits: bool
    linear_memory: bool
    eligible: bool
    seconds: float


@dataclass(frozen=True)
class ChunkChoice:
    """The automatic choice and every candidate the model weighed.

    Attributes:
        chosen: the chosen :class:`Candidate`.
        candidates: all candidates, ascending chunk length.
        reason: why the chosen one won (str).
        structures: the loop structures weighed at the chosen chunking
            (:func:`structures`), the model's choice first.
    """

    chosen: Candidate
    candidates: tuple
    reason: str
    structures: tuple = ()

    def table(self) -> str:
        """The candidates as a text table (the chosen one marked ``*``)."""
        head = ("", "chunks", "flop ratio", "iters", "ops fwd", "ops bwd", "bytes copied",
                "step MiB", "work set MiB", "fits", "O(L)", "model ms")
        rows = [head]
        for c in self.candidates:
            rows.append(("*" if c is self.chosen else "", f"{c.chunk_q}x{c.chunk_kv}",
                         f"{c.flop_ratio:.4f}", str(c.iterations), str(c.ops_forward),
                         str(c.ops_backward),
                         f"{c.bytes_copied_forward + c.bytes_copied_backward:,}",
                         f"{c.step_bytes / 2**20:.2f}", f"{c.working_set_bytes / 2**20:.1f}",
                         "yes" if c.fits else "NO", "yes" if c.linear_memory else "no",
                         f"{c.seconds * 1e3:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        lines.append(f"chosen: {self.chosen.chunk_q}x{self.chosen.chunk_kv} ({self.reason})")
        for n, st in enumerate(self.structures):
            lines.append(f"{'structure' if n == 0 else '  against'}: {st.name:<11} ops "
                         f"{st.ops}  bytes copied {st.bytes_copied:,}  flop ratio "
                         f"{st.flop_ratio:.4f}  model ms {st.seconds * 1e3:.3f}"
                         + ("" if st.eligible else "  (over the FLOP budget)"))
        return "\n".join(lines)


def _ops(weights, groups):
    """Ops executed by one pass of :func:`popxl_flash.plan.steps.step_groups` ``groups``
    (without segment ids: a group of one step runs inline)."""
    total = weights["fixed"]
    for g in groups:
        if _steps.runs_inline(g):
            total += weights["per_inline"] + weights["per_masked"] * g.masked
            continue
        gathers = g.masked and g.patterns.shape[0] > 1
        total += weights["per_loop"] + g.steps * (weights["per_step"]
                                                  + weights["per_masked"] * g.masked
                                                  + weights["per_gather"] * gathers)
    return int(total)


def _loop_copies(steps, copies):
    """Add one ``repeat`` of ``steps`` iterations to ``copies`` (by kind): the carried counter
    (its initial value into the clone once; body output -> clone -> body input every
    iteration; the loop's counter output is read by nobody: no copy out) and LoopOpx's control
    copies. Its operands, state (by reference) and segment inputs are aliased (AliasZeroCopy:
    read-only, or modified with nobody else reading them while the loop runs)."""
    copies["loop_in_out"] += COUNTER_BYTES
    copies["loop_carried"] += 2 * COUNTER_BYTES * steps
    copies["loop_control"] += LOOP_CONTROL_ONCE + LOOP_CONTROL_STEP * steps


def _step_bytes(group, G, Gk, D, item, backward, seg):
    """``(state, operands, segment operands)`` bytes of one step's slices of ``group``: what a
    conditional of a segment-id step receives (``IfOpx`` copies them in; the new state out).

    Forward: state ``m_i, l_i, acc_i`` float32 ``[G, rows, 1|1|D]``; operands ``q_i [G, rows,
    D]``, ``k_j^T [Gk, D, cols]``, ``v_j [Gk, cols, D]``. Backward: state ``dq_i [G, rows,
    D]``, ``dk_j, dv_j [Gk, cols, D]`` float32; operands ``q_i, do_i`` (input dtype), ``lse_i,
    Dvec_i`` (float32 ``[G, rows, 1]``), ``k_j, v_j^T``. Segment operands: the int32 ids (and
    positions) of the step's q rows (``q_groups`` rows) and kv columns (1 or G rows)."""
    r, c = group.rows, group.cols
    if backward:
        state = (G * r * D + 2 * Gk * c * D) * _F32
        operands = 2 * G * r * D * item + 2 * G * r * _F32 + 2 * Gk * c * D * item
    else:
        state = G * r * (2 + D) * _F32
        operands = G * r * D * item + 2 * Gk * c * D * item
    kv_rows = 1 if seg.kv_groups == 1 else G
    ids = (seg.q_groups * r + kv_rows * c) * _I32
    return state, operands, ids * (2 if seg.positions else 1)


#: Ops a segment-id step spends on its runtime mask (``segments.block_mask``): the ids'
#: ``equal``; with positions, per band term ``greater``, ``logical_not``, ``logical_and``
#: (causal), and one more for a window side's offset.
MASK_OPS_IDS, MASK_OPS_CAUSAL, MASK_OPS_WINDOW_SIDE = 1, 3, 4
#: ``where`` selects the masked update adds (``online_softmax_update``: the max, the exp's
#: argument and the probabilities; ``probabilities`` in the backward: the exp's argument).
MASKED_WHERE_OPS = {"forward": 3, "backward": 1}
#: Ops of the second dispatch level of an unmasked group: the step's runtime-full flag (one
#: ``dynamic_slice`` of the group's table) and the conditional.
SECOND_LEVEL_OPS = 2


def mask_ops(positions, causal, window, backward):
    """Ops a running segment-id step spends on masking (mask and ``where`` selects)."""
    ops = MASK_OPS_IDS + MASKED_WHERE_OPS["backward" if backward else "forward"]
    if positions:
        ops += MASK_OPS_CAUSAL * bool(causal)
        ops += MASK_OPS_WINDOW_SIDE * sum(side >= 0 for side in window)
    return ops


def second_level(group, *, groups, head_dim, dtype, backward, segments, kv_groups=None,
                 causal=False, window=(-1, -1)):
    """Whether a segment-id step of ``group`` dispatches a running block again on its runtime
    class (``RT_FULL``: the unmasked update; else masked), or always runs the masked update
    (one conditional level).

    The model prices a runtime-full block (the common case of long packed sequences and of a
    decoding cache) both ways: one level spends :func:`mask_ops` on an all-visible mask; two
    levels spend :data:`SECOND_LEVEL_OPS` and ``IfOpx``'s copies of the second level (the
    state slices in and out, the operands in). Masked groups always take one level (their
    pattern is ANDed anyway). With G = 2, D = 64, float16, 128-row chunks the forward's two
    extra ops (~2,000 cycles) outweigh the ~228 KiB copy (~20 cycles): two levels; the
    backward without positions masks for free (one ``equal``, one ``where``): one level.

    Returns:
        bool.
    """
    if group.masked:
        return False
    extra_ops = mask_ops(segments.positions, causal, window, backward) - SECOND_LEVEL_OPS
    if extra_ops <= 0:
        return False
    G, D, item = groups, head_dim, 2 if dtype == "float16" else 4
    Gk = G if kv_groups is None else kv_groups
    state, operands, _ = _step_bytes(group, G, Gk, D, item, backward, segments)
    copy_cycles = (2 * state + operands) / (TILES * COPY_BYTES_PER_TILE_CYCLE)
    return extra_ops * OP_CYCLES > copy_cycles


def _branch_copies(group, classes, G, Gk, D, item, backward, seg, two_levels):
    """``IfOpx`` copies of a segment-id group's steps (every input and output of the taken
    branch, at every nesting level; ``blocks._dispatch``): a skipped block (``RT_SKIP``) the
    state slices in and out; a running block its state, operands and segment operands (and the
    pattern of a masked group) in and the state out; with ``two_levels`` (:func:`second_level`)
    the run branch also takes the step's bool runtime-full flag and then at the second level
    the unmasked update (state and operands in, state out) for an ``RT_FULL`` block or the
    masked one (with the segment operands) for the others."""
    state, operands, ids = _step_bytes(group, G, Gk, D, item, backward, seg)
    cls = classes[group.q_chunk, group.kv_chunk]  # [V] runtime class of each step's block
    skipped = int((cls == RT_SKIP).sum())
    full = int((cls == RT_FULL).sum())
    running = group.steps - skipped
    total = skipped * 2 * state
    if group.masked:
        return total + running * (2 * state + operands + ids + group.rows * group.cols)
    if not two_levels:
        return total + running * (2 * state + operands + ids)
    total += running * (2 * state + operands + ids + 1)
    return total + full * (2 * state + operands) + (running - full) * (2 * state + operands
                                                                         + ids)


def pass_copies(sched, *, groups, head_dim, dtype, backward, kv_groups=None, segments=None,
                classes=None, causal=False, window=(-1, -1)):
    """Lowering copies of one pass by boundary kind, under PopART's rules as the emulator
    models them (``popxl_flash/emulator/copies.py``; the tests hold the two equal).

    Args:
        sched: the :class:`~popxl_flash.plan.schedule.BlockSchedule`; groups, head_dim, kv_groups:
            G, D, Gk (``None``: G); dtype: ``"float16"`` or ``"float32"``.
        backward: the stash backward (kv-major steps) instead of the forward.
        segments: ``None``, or the :class:`~popxl_flash.plan.segments.SegmentConfig` of segment ids
            (the steps then run under a conditional).
        classes: with segments, int ``[nq, nkv]`` runtime block classes (``RT_SKIP``,
            ``RT_FULL``, ``RT_MASKED``); ``None``: every block ``RT_MASKED``.
        causal, window: the call's mask, with positions (what :func:`second_level` weighs).

    Score modifiers (:mod:`popxl_flash.graph.score_mods`) are not counted: without segment ids their
    loop-invariant inputs are aliased like the operands (no change), but with segment ids the
    branches also receive each step's modifier operands (ALiBi positions and slopes, dropout's
    keep scale, score_mod inputs), which this count leaves out.

    Returns:
        ``{kind: bytes}`` over :data:`COPY_KINDS`.
    """
    G, D, item = groups, head_dim, 2 if dtype == "float16" else 4
    Gk = G if kv_groups is None else kv_groups
    copies = dict.fromkeys(COPY_KINDS, 0)
    if segments is not None and classes is None:
        classes = np.full((sched.nq, sched.nkv), RT_MASKED)
    seg = segments is not None
    if _steps.single_block(sched, seg):
        return copies  # a straight line: no loop, no branch
    for group in _steps.step_groups(sched, "kv_major" if backward else "q_major"):
        if _steps.runs_inline(group, seg):
            continue  # one step, inline: no loop
        _loop_copies(group.steps, copies)
        if segments is not None:
            two = second_level(group, groups=G, head_dim=D, dtype=dtype, backward=backward,
                               segments=segments, kv_groups=Gk, causal=causal, window=window)
            copies["branch"] += _branch_copies(group, np.asarray(classes), G, Gk, D, item,
                                               backward, segments, two)
    return copies


def _working_set(sched, G, Gk, D, item):
    """``(resident, step)`` bytes of the backward pass (the larger): the resident tensors
    (padded q, do, out, k, v; lse, Dvec; float32 dq, dk, dv; k, v, dk, dv of Gk groups) and
    one step's temporaries (~5 float32 ``[cq, ckv]`` blocks and 4 float32 ``[cq, D]`` rows)."""
    lq, lkv = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    resident = (G * (3 * lq * D * item + 2 * lq * _F32 + lq * D * _F32)
                + Gk * (2 * lkv * D * item + 2 * lkv * D * _F32))
    step = 5 * sched.chunk_q * sched.chunk_kv * _F32 + 4 * sched.chunk_q * D * _F32
    return resident, G * step


def _seconds(flops, ops, iterations, copied, dtype):
    compute = flops / (TILES * FLOPS_PER_TILE_CYCLE[dtype] * CLOCK_HZ)
    overhead = (ops * OP_CYCLES + iterations * ITERATION_CYCLES) / CLOCK_HZ
    return compute + overhead + copied / (TILES * COPY_BYTES_PER_TILE_CYCLE * CLOCK_HZ)


def evaluate(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, dtype, causal, window,
             kv_groups=None):
    """The model's figures for one chunking.

    Args:
        Lq, Lkv: sequence lengths; chunk_q, chunk_kv: chunk lengths.
        head_dim, groups: D and G.
        kv_groups: Gk, the groups of k and v (``None``: G; grouped-query attention: a divisor
            of G). It changes only the modelled bytes; FLOPs and ops are those of G.
        dtype: ``"float16"`` or ``"float32"``.
        causal, window: the mask (as :func:`popxl_flash.plan.schedule.plan`).

    Returns:
        A :class:`Candidate`.
    """
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=causal, window=window)
    item = 2 if dtype == "float16" else 4
    fwd = sched.forward_flops(head_dim, groups)
    bwd = sched.backward_flops(head_dim, groups)
    fwd_groups = _steps.step_groups(sched, "q_major")
    bwd_groups = _steps.step_groups(sched, "kv_major")
    ops_f = _ops(OPS_FORWARD[dtype], fwd_groups)
    ops_b = _ops(OPS_BACKWARD[dtype], bwd_groups)
    kv_groups = groups if kv_groups is None else kv_groups
    copied_f, copied_b = (sum(pass_copies(sched, groups=groups, head_dim=head_dim, dtype=dtype,
                                          backward=b).values()) for b in (False, True))
    resident, step = _working_set(sched, groups, kv_groups, head_dim, item)
    working = resident + step
    fits = working <= TILES * TILE_MEMORY_BYTES * USABLE_MEMORY_FRACTION
    linear = step <= resident
    iters = _steps.loop_steps(sched)
    seconds = (_seconds(fwd.executed, ops_f, iters, copied_f, dtype)
               + _seconds(bwd.executed, ops_b, iters, copied_b, dtype))
    return Candidate(chunk_q=chunk_q, chunk_kv=chunk_kv, num_chunks_q=sched.nq,
                     num_chunks_kv=sched.nkv, flop_ratio=fwd.ratio, forward_flops=fwd.executed,
                     backward_flops=bwd.executed, iterations=iters, ops_forward=ops_f,
                     ops_backward=ops_b, bytes_copied_forward=copied_f,
                     bytes_copied_backward=copied_b, working_set_bytes=working,
                     step_bytes=step, fits=fits, linear_memory=linear,
                     eligible=fits and linear and fwd.ratio <= MAX_FLOP_RATIO, seconds=seconds)


def _balanced(length, target):
    """The chunk length of ``ceil(length / target)`` equal chunks (at most ``target``; the
    padding of the tail is less than one chunk per chunk count)."""
    count = -(-length // target)
    return -(-length // count)


@functools.lru_cache(maxsize=1024)
def choose(Lq, Lkv, *, head_dim, groups, dtype, causal=True, window=None, chunk_q=None,
           chunk_kv=None, kv_groups=None):
    """Choose chunk lengths by the model (see the module docstring).

    Cached (the arguments are hashable and the result immutable): the functional API validates
    a call's configuration more than once, and every layer of a model asks the same question.

    Args:
        Lq, Lkv, head_dim, groups, dtype, causal, window: the attention call.
        kv_groups: Gk of k and v (``None``: G), as :func:`evaluate`.
        chunk_q, chunk_kv: a fixed chunk length for that axis, or ``None`` to choose it.

    Returns:
        A :class:`ChunkChoice`.
    """
    pairs = []
    for c in CANDIDATE_CHUNKS:
        pair = (chunk_q or _balanced(Lq, c), chunk_kv or _balanced(Lkv, c))
        if pair not in pairs:
            pairs.append(pair)
    candidates = tuple(evaluate(Lq, Lkv, cq, ckv, head_dim=head_dim, groups=groups,
                                dtype=dtype, causal=causal, window=window, kv_groups=kv_groups)
                       for cq, ckv in pairs)
    eligible = [c for c in candidates if c.eligible]
    linear = [c for c in candidates if c.fits and c.linear_memory]
    fitting = [c for c in candidates if c.fits]
    if eligible:
        chosen = min(eligible, key=lambda c: c.seconds)
        reason = (f"least modelled time with FLOP ratio <= {MAX_FLOP_RATIO}, step temporaries "
                  "<= resident tensors, fitting memory")
    elif any(c.flop_ratio <= FALLBACK_FLOP_RATIO for c in linear):
        chosen = min((c for c in linear if c.flop_ratio <= FALLBACK_FLOP_RATIO),
                     key=lambda c: c.seconds)
        reason = (f"no chunking within FLOP ratio {MAX_FLOP_RATIO}: least modelled time within "
                  f"{FALLBACK_FLOP_RATIO} with step temporaries <= resident tensors")
    elif linear:
        chosen = min(linear, key=lambda c: (c.flop_ratio, c.seconds))
        reason = (f"no chunking within FLOP ratio {FALLBACK_FLOP_RATIO}: least wasted work with "
                  "step temporaries <= resident tensors")
    elif fitting:
        chosen = min(fitting, key=lambda c: (c.flop_ratio, c.seconds))
        reason = f"no chunking within FLOP ratio {MAX_FLOP_RATIO}: least wasted work that fits"
    else:
        chosen = min(candidates, key=lambda c: c.working_set_bytes)
        reason = "NOTHING FITS the usable tile memory: smallest working set"
    weighed = structures(Lq, Lkv, chosen.chunk_q, chosen.chunk_kv, head_dim=head_dim,
                         groups=groups, dtype=dtype, causal=causal, window=window,
                         kv_groups=kv_groups)
    return ChunkChoice(chosen=chosen, candidates=candidates, reason=reason, structures=weighed)


#: Ops per pass of the nested-conditional dispatch (one loop, carried state, conditionals
#: nested by step kind), fitted on the emulator to those graphs:
#: ``fixed + per_step * V + per_partial * partial + per_split * split + per_last * last``.
OPS_DISPATCH_FORWARD = dict(fixed=13, per_step=30.7, per_partial=9.7, per_split=42.6,
                            per_last=7.8)
OPS_DISPATCH_BACKWARD = dict(fixed=6, per_step=39.4, per_partial=8.6, per_split=47.5,
                             per_last=3.2)


@dataclass(frozen=True)
class Structure:
    """The model's figures for one loop structure at one chunking (forward + stash backward).

    Attributes:
        name: ``"grouped"`` (built: one branch-free loop per step group, state in place),
            ``"dispatch"`` (one loop, carried state, conditionals nested by step kind, the
            structure of the nested-conditional dispatch) or ``"branch-free"`` (one loop, every block whole under
            a gathered mask, all visible for full blocks; no sub-blocks).
        ops: ops executed, forward + backward.
        bytes_copied: lowering copies under PopART's rules, forward + backward.
        flops: executed matmul FLOPs, forward + backward.
        flop_ratio: forward executed / useful FLOPs.
        seconds: modelled time (:func:`_seconds` of each pass, summed).
        eligible: ``flop_ratio`` within :data:`MAX_FLOP_RATIO`, or at most the built
            structure's (the wasted-work policy of the chunk choice applies to structures too).
    """

    name: str
    ops: int
    bytes_copied: int
    flops: int
    flop_ratio: float
    seconds: float
    eligible: bool


def _rank_keys(blist):
    """Step kinds ``(kind, split, last)`` of a block list, most frequent first, and the
    conditional nesting level each runs at (two kinds: one level; n kinds: the i-th at level
    ``min(i + 1, n - 1)``)."""
    keys = list(zip(blist.kind.tolist(), blist.split.tolist(), blist.last.tolist()))
    counts = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    ranked = sorted(counts, key=lambda key: (-counts[key], key))
    n = len(ranked)
    level = {key: (0 if n == 1 else min(i + 1, n - 1)) for i, key in enumerate(ranked)}
    return keys, level


def _dispatch_copies(sched, G, Gk, D, item, backward):
    """PopART-rule copies of the dispatch structure (the rules of :func:`pass_copies`): per
    step, the carried values into LoopOpx's clones and back, LoopOpx's control copies, and the
    taken branch's inputs and outputs at every nesting level (``IfOpx`` never aliases); once,
    the carried initial values; the by-reference results are aliased (nothing else reads them
    while the loop runs)."""
    cq, ckv = sched.chunk_q, sched.chunk_kv
    if backward:
        carried = Gk * 2 * ckv * D * _F32 + COUNTER_BYTES  # dk_j, dv_j, t
        inputs = (carried - COUNTER_BYTES + G * (cq * D * _F32 + 2 * cq * D * item
                                                 + 2 * cq * _F32) + Gk * 2 * ckv * D * item)
        outputs = carried - COUNTER_BYTES + G * cq * D * _F32 + Gk * 2 * ckv * D * _F32
        blist = sched.block_list("kv_major")
    else:
        carried = G * (2 * cq + cq * D) * _F32 + COUNTER_BYTES  # m_i, l_i, acc, t
        inputs = carried - COUNTER_BYTES + G * cq * D * item + Gk * 2 * ckv * D * item
        outputs = carried - COUNTER_BYTES + G * (cq * D * item + cq * _F32)
        blist = sched.block_list("q_major")
    keys, level = _rank_keys(blist)
    branch = sum(level[key] for key in keys) * (inputs + outputs)
    return (2 * carried * len(keys) + branch + carried + LOOP_CONTROL_ONCE
            + LOOP_CONTROL_STEP * len(keys))


def _dispatch_ops(weights, blist):
    partial = int((blist.kind == _schedule.PARTIAL).sum())
    split = int((blist.split != _schedule.WHOLE).sum())
    return round(weights["fixed"] + weights["per_step"] * len(blist)
                 + weights["per_partial"] * partial + weights["per_split"] * split
                 + weights["per_last"] * int(blist.last.sum()))


def structures(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, dtype, causal, window,
               kv_groups=None):
    """The model's estimate of the loop structures it weighs, for one chunking.

    The library builds ``"grouped"``. A structure is eligible if it wastes no more matmul work
    than the policy allows (:data:`MAX_FLOP_RATIO`, or the built structure's ratio when that is
    higher); the least modelled time among the eligible ones is the model's choice. The test
    suite holds the choice to ``"grouped"`` at the issue's sizes, so constants that made another
    structure win would show. (With G = 2, D = 64 the branch-free body is ~1.5% faster on the
    model: splitting a diagonal block saves FLOPs that cost less than its second step's ops;
    it wastes 6.2% of the matmul work at 16 chunks, against 3.1% split.)

    Args:
        as :func:`evaluate`.

    Returns:
        A tuple of :class:`Structure`: eligible ones first, each part by modelled time.
    """
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=causal, window=window)
    G, D, item = groups, head_dim, 2 if dtype == "float16" else 4
    Gk = groups if kv_groups is None else kv_groups
    flops = sched.forward_flops(D, G)
    fwd, bwd = flops.executed, sched.backward_flops(D, G).executed
    V = sched.visited_blocks
    budget = max(MAX_FLOP_RATIO, flops.ratio)
    useful = max(flops.useful, 1)
    out = []
    grouped = evaluate(Lq, Lkv, chunk_q, chunk_kv, head_dim=D, groups=G, dtype=dtype,
                       causal=causal, window=window, kv_groups=kv_groups)
    out.append(Structure("grouped", grouped.ops_forward + grouped.ops_backward,
                         grouped.bytes_copied_forward + grouped.bytes_copied_backward,
                         fwd + bwd, flops.ratio, grouped.seconds, True))
    ops_f = _dispatch_ops(OPS_DISPATCH_FORWARD, sched.block_list("q_major"))
    ops_b = _dispatch_ops(OPS_DISPATCH_BACKWARD, sched.block_list("kv_major"))
    copied_f = _dispatch_copies(sched, G, Gk, D, item, backward=False)
    copied_b = _dispatch_copies(sched, G, Gk, D, item, backward=True)
    out.append(Structure("dispatch", ops_f + ops_b, copied_f + copied_b, fwd + bwd,
                         flops.ratio, _seconds(fwd, ops_f, V, copied_f, dtype)
                         + _seconds(bwd, ops_b, V, copied_b, dtype), True))
    whole = V * chunk_q * chunk_kv * G * D * 2  # multiply-adds x 2 per matmul cell
    flat_f, flat_b = 2 * whole, 5 * whole
    weights_f, weights_b = OPS_FORWARD[dtype], OPS_BACKWARD[dtype]
    ops_f = weights_f["fixed"] + weights_f["per_loop"] + V * (weights_f["per_step"]
                                                              + weights_f["per_masked"])
    ops_b = weights_b["fixed"] + weights_b["per_loop"] + V * (weights_b["per_step"]
                                                              + weights_b["per_masked"])
    loop = dict.fromkeys(COPY_KINDS, 0)
    _loop_copies(V, loop)  # one loop of V whole-block steps
    copied = sum(loop.values())
    ratio = flat_f / useful if flops.useful else 1.0
    out.append(Structure("branch-free", ops_f + ops_b, 2 * copied, flat_f + flat_b, ratio,
                         _seconds(flat_f, ops_f, V, copied, dtype)
                         + _seconds(flat_b, ops_b, V, copied, dtype), ratio <= budget))
    return tuple(sorted(out, key=lambda s: (not s.eligible, s.seconds)))
