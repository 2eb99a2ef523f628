"""Cost model of the automatic chunk choice (``num_chunks_*=None``).

No IPU is available to time candidates, so the model prices **counted work as PopART lowers
the graph** (:mod:`popxl_flash.lowering`) with the IPU time model (:mod:`popxl_flash.ipu_model`:
350 cycles per compute set, matmul FLOPs, vector work at poplibs' rates per kind and dtype,
bytes copied):

* per pass, :func:`popxl_flash.plan.counts.pass_counts`: compute sets, matmul FLOPs, vector
  work, bytes copied and loop iterations, predicted from the planner's schedule and its step
  groups (coefficients fitted to the emulator's priced profile) and held to it by the tests;
* per pass, the bytes it holds beyond its inputs and outputs
  (:func:`popxl_flash.plan.memory.flash_bytes`, an upper bound of the emulator's peak);
* naive attention and the seed's chunk rule priced alike (:mod:`popxl_flash.plan.baselines`).

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

Choice (:func:`choose`): the least modelled forward + backward time among the candidate
chunkings (:func:`candidate_pairs`: one block up, balanced lengths, ``chunk_q != chunk_kv``)
whose passes fit ``memory_budget``, unless it is more than :data:`ROBUST_RATIO` off the best at
a corner of the constants' plausible box (:data:`popxl_flash.ipu_model.BOX`: they are not
calibrated): then the candidate whose worst ratio over the corners is least. When none fits,
the fastest within :data:`NOTHING_FITS_SLACK` of the least memory, flagged in the reason.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from typing import Optional

from popxl_flash.plan import baselines as _baselines
from popxl_flash.plan import ipu_time as _ipu_time
from popxl_flash.plan import memory as _memory
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan import steps as _steps
from popxl_flash.plan.segments import RT_FULL, RT_MASKED, RT_SKIP

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
class Baseline:
    """Counted work of a forward and a stash-mode backward pass, priced by the reference model
    (naive attention, :mod:`popxl_flash.checks.naive`, is one; :class:`Candidate` adds a
    chunking).

    Attributes:
        forward, backward: counted work per pass (``compute_sets``, ``matmul_flops``,
            ``vector_elements``, ``bytes_copied``: :class:`popxl_flash.plan.counts.PassCounts`
            or :class:`popxl_flash.plan.ipu_time.WorkCounts`, priced by PopART's lowering).
        time_forward, time_backward: their modelled time
            (:class:`popxl_flash.plan.ipu_time.ModelledTime`, by term).
        memory_forward, memory_backward: bytes each pass holds beyond its inputs and outputs
            (upper bounds of the emulator's: :mod:`popxl_flash.plan.memory`).
        fits: both within the budget of the choice.
    """

    forward: object
    backward: object
    time_forward: object
    time_backward: object
    memory_forward: int
    memory_backward: int
    fits: bool

    @property
    def seconds(self) -> float:
        """Modelled forward + backward time (s)."""
        return self.time_forward.seconds + self.time_backward.seconds

    @property
    def memory_bytes(self) -> int:
        """The larger pass's bytes beyond its inputs and outputs."""
        return max(self.memory_forward, self.memory_backward)


@dataclass(frozen=True)
class Candidate(Baseline):
    """One chunking (all counts for G, D, dtype of the request): :class:`Baseline`'s figures
    for a flash forward and backward with these chunks.

    Attributes:
        chunk_q, chunk_kv, num_chunks_q, num_chunks_kv: the chunking.
        flop_ratio: forward executed / useful matmul FLOPs (a one-block pass runs its block
            whole).
        lean_forward, lean_backward: whether that pass runs its memory-lean structure
            (:class:`popxl_flash.plan.config.AttentionConfig`; only looped passes have one).
    """

    chunk_q: int
    chunk_kv: int
    num_chunks_q: int
    num_chunks_kv: int
    flop_ratio: float
    lean_forward: bool = False
    lean_backward: bool = False

    @property
    def structure(self) -> str:
        """``"AxB"`` chunks, with ``" lean f"``, ``" lean b"`` or ``" lean f+b"`` where a pass
        runs its memory-lean structure."""
        leans = "+".join(p for p, on in (("f", self.lean_forward), ("b", self.lean_backward))
                         if on)
        return f"{self.chunk_q}x{self.chunk_kv}" + (f" lean {leans}" if leans else "")

    @property
    def compute_sets_forward(self) -> float:
        """Forward compute sets (PopART's lowering, :mod:`popxl_flash.lowering`)."""
        return self.forward.compute_sets

    @property
    def compute_sets_backward(self) -> float:
        """Backward compute sets."""
        return self.backward.compute_sets

    @property
    def forward_flops(self) -> int:
        return _flops(self.forward)

    @property
    def backward_flops(self) -> int:
        return _flops(self.backward)

    @property
    def iterations(self) -> int:
        """Loop iterations of the forward pass."""
        return self.forward.iterations


@dataclass(frozen=True)
class ChunkChoice:
    """The automatic choice and every candidate the model weighed.

    Attributes:
        chosen: the chosen :class:`Candidate`.
        candidates: all candidates, by chunk lengths.
        reason: why the chosen one won (str).
        budget: the ``memory_budget`` (bytes) the choice kept to.
        seed: the seed's chunk rule (256-row chunks) as a :class:`Candidate`.
        naive: naive attention as a :class:`Baseline`.
        label: how the times are labelled (:func:`popxl_flash.plan.ipu_time.label`).
        seed_name: what ``seed`` is, in :meth:`table` (packed calls price the earlier 64-row
            rule there, :mod:`popxl_flash.plan.packed`).
        worst_ratio: the chosen candidate's largest ratio to the best fitting candidate over
            the corners of the constants' box (:func:`popxl_flash.ipu_model.corners`; 1.0 when
            not computed).
        budget_backward: the backward's budget (bytes; ``budget`` is the forward's; equal for
            an explicit ``memory_budget``).
        default_budget: whether the budgets are the default (each pass's
            :func:`popxl_flash.plan.memory.default_budget`).
        trade: ``()`` or the memory-for-time trade :func:`popxl_flash.explain` adds: rows
            ``(label, budget bytes or None, ChunkChoice or None)``, ``None`` for naive
            attention's row (its budget its need).
    """

    chosen: Candidate
    candidates: tuple
    reason: str
    budget: int = 0
    seed: Optional[Candidate] = None
    naive: Optional[Baseline] = None
    label: str = ""
    seed_name: str = "seed's 256-row rule"
    worst_ratio: float = 1.0
    budget_backward: int = 0
    default_budget: bool = False
    trade: tuple = ()

    def table(self) -> str:
        """The candidates as a text table (the chosen one marked ``*``, the fastest few and
        the seed's rule), then the chosen, the seed's rule and naive attention side by side."""
        head = ("", "chunks", "flop ratio", "iters", "compute sets f+b", "MFLOP f+b",
                "Melements f+b", "bytes copied", "MiB f/b", "fits", "modelled us")
        shown = sorted(self.candidates, key=lambda c: c.seconds)[:12]
        for extra in (self.chosen, self.seed):
            if extra is not None and extra not in shown:
                shown.append(extra)
        rows = [head]
        for c in sorted(shown, key=lambda c: (c.chunk_q, c.chunk_kv)):
            mark = "*" if c is self.chosen else ("s" if c == self.seed else "")
            rows.append((mark, c.structure, f"{c.flop_ratio:.4f}",
                         str(c.forward.iterations),
                         f"{c.forward.compute_sets + c.backward.compute_sets:,.0f}",
                         f"{(_flops(c.forward) + _flops(c.backward)) / 1e6:,.1f}",
                         f"{(c.forward.vector_elements + c.backward.vector_elements) / 1e6:,.2f}",
                         f"{c.forward.bytes_copied + c.backward.bytes_copied:,.0f}",
                         f"{c.memory_forward / 2**20:.1f}/{c.memory_backward / 2**20:.1f}",
                         "yes" if c.fits else "NO", f"{c.seconds * 1e6:,.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        lines.append(f"chosen: {self.chosen.structure} ({self.reason}); "
                     + _budget_text(self))
        lines.append(_compare_line("flash (chosen)", self.chosen))
        lines.append(_terms_line(self.chosen))
        lines.append(f"{'':>20}  within {self.worst_ratio:.2f}x of the best candidate at every "
                     "corner of the constants' box (c_cs 250-600, vector rates x0.5-1.5, "
                     "float16 matmul 64-128, copies 2-8 B/tile-cycle)")
        if self.seed is not None:
            lines.append(_compare_line(self.seed_name, self.seed))
        if self.naive is not None:
            lines.append(_compare_line("naive attention", self.naive))
        lines.extend(_trade_lines(self.trade))
        lines.append(f"times are {self.label}")
        return "\n".join(lines)


def _terms_line(c):
    """The chosen candidate's modelled forward + backward time by term and its vector work by
    rate class (the lowering table's op kinds)."""
    t = c.time_forward + c.time_backward
    work = {}
    for counts in (c.forward, c.backward):
        for key, n in _ipu_time.work_of(counts).vector_work.items():
            cls = key.split(".")[0]
            work[cls] = work.get(cls, 0) + n
    classes = ", ".join(f"{k} {v / 1e6:,.2f}M" for k, v in sorted(work.items()))
    return f"{'':>20}  by term: {t.terms_text()}; vector elements by kind: {classes}"


def _flops(work):
    """Matmul FLOPs of a pass's counts (a dict by dtype in :class:`WorkCounts`)."""
    flops = work.matmul_flops
    return sum(flops.values()) if isinstance(flops, dict) else flops
def _budget_text(choice):
    """The budget line: an explicit ``memory_budget``, or the default's two passes."""
    b, bb = choice.budget, choice.budget_backward or choice.budget
    if not choice.default_budget:
        return f"memory_budget {b:,} bytes ({b / 2**20:.1f} MiB)"
    return (f"default memory budget (memory_budget=None): forward {b / 2**20:.1f} MiB, "
            f"backward {bb / 2**20:.1f} MiB (2 x the pass's own inputs and outputs + 4 MiB, at "
            "most 1/8 of naive attention's working set: temporaries O(L), as flash attention "
            "promises)")


def _trade_lines(trade):
    """:attr:`ChunkChoice.trade` as text: per budget the chosen chunks, the larger pass's
    modelled memory and the modelled time; naive attention's need last."""
    if not trade:
        return []
    lines = ["memory for time (pass memory_budget= to spend more; times modelled):"]
    for label, budget, choice in trade:
        if choice is None:
            lines.append(f"  {label:>24}: needs {budget / 2**20:,.1f} MiB")
            continue
        c = choice.chosen
        fits = "" if c.fits else " (nothing fits: least memory)"
        lines.append(f"  {label:>24}: chunks {c.structure}, "
                     f"{c.memory_bytes / 2**20:,.1f} MiB, {c.seconds * 1e6:,.1f} us{fits}")
    return lines


def _compare_line(name, c):
    """One line: forward, backward and total modelled time, memory, whether it fits."""
    return (f"{name:>20}: forward {c.time_forward.seconds * 1e6:,.1f} us, backward "
            f"{c.time_backward.seconds * 1e6:,.1f} us, total {c.seconds * 1e6:,.1f} us "
            f"(modelled); {c.memory_bytes / 2**20:,.1f} MiB "
            f"{'fits' if c.fits else 'does NOT fit'} the budget")


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
    extra ops (two compute sets, ~700 cycles) outweigh the ~228 KiB copy (~20 cycles): two levels; the
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
    c = _ipu_time.current()
    copy_cycles = (2 * state + operands) / (c.tiles * c.copy_bytes_per_tile_cycle)
    return extra_ops * c.compute_set_cycles > copy_cycles  # the mask ops are maps: 1 each


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
                classes=None, causal=False, window=(-1, -1), lean=False):
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
        lean: the memory-lean structure (no segment ids): a backward's groups run one loop
            per kv piece (:func:`popxl_flash.plan.steps.lean_step_ranges`).

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
    if _steps.single_block(sched, seg) or _steps.row_passes(sched, seg):
        return copies  # a straight line: no loop, no branch
    for group in _steps.step_groups(sched, "kv_major" if backward else "q_major"):
        if lean and backward:
            for start, stop in _steps.lean_step_ranges(group, sched.nkv):
                if stop - start > 1:
                    _loop_copies(stop - start, copies)
            continue
        if _steps.runs_inline(group, seg):
            continue  # one step, inline: no loop
        _loop_copies(group.steps, copies)
        if segments is not None:
            two = second_level(group, groups=G, head_dim=D, dtype=dtype, backward=backward,
                               segments=segments, kv_groups=Gk, causal=causal, window=window)
            copies["branch"] += _branch_copies(group, np.asarray(classes), G, Gk, D, item,
                                               backward, segments, two)
    return copies


def evaluate(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, dtype, causal, window,
             kv_groups=None, memory_budget=None, scale=None, mods=None, lean=None):
    """The model's figures for one chunking.

    Args:
        Lq, Lkv: sequence lengths; chunk_q, chunk_kv: chunk lengths.
        head_dim, groups: D and G.
        kv_groups: Gk, the groups of k and v (``None``: G; grouped-query attention: a divisor
            of G).
        dtype: ``"float16"`` or ``"float32"``.
        causal, window: the mask (as :func:`popxl_flash.plan.schedule.plan`).
        memory_budget: bytes (``None``: each pass's default,
            :func:`popxl_flash.plan.memory.default_budget`).
        scale, mods: the softmax scale (``None``: ``1 / sqrt(D)``) and the score modifiers
            (``None`` or a :class:`~popxl_flash.plan.score_mods.ScoreMods`), which the memory
            bound weighs (:func:`popxl_flash.plan.memory.flash_bytes`).
        lean: ``None``: a looped pass that misses its budget runs its memory-lean structure
            when that needs less (it is never faster: it scales each step's k slice and works
            in pieces); ``True``/``False``: looped passes always/never lean.

    Returns:
        A :class:`Candidate`.
    """
    kv_groups = groups if kv_groups is None else kv_groups
    budgets = _memory.pass_budgets(_memory.check_budget(memory_budget), groups=groups,
                                   kv_groups=kv_groups, q_len=Lq, kv_len=Lkv,
                                   head_dim=head_dim, dtype=dtype)
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=causal, window=window)
    args = dict(head_dim=head_dim, groups=groups, kv_groups=kv_groups, dtype=dtype,
                causal=causal, window=window)
    looped = not (_steps.single_block(sched) or _steps.row_passes(sched))
    bound = dict(scale=scale, mods=mods)
    passes = [_pass_figures(sched, Lq, Lkv, b, budget, looped and lean is not False,
                            bool(lean), args, bound) for b, budget in ((False, budgets[0]),
                                                                       (True, budgets[1]))]
    (fwd, mem_f, lean_f), (bwd, mem_b, lean_b) = passes
    return Candidate(chunk_q=chunk_q, chunk_kv=chunk_kv, num_chunks_q=sched.nq,
                     num_chunks_kv=sched.nkv, flop_ratio=_flop_ratio(sched, fwd, head_dim, groups),
                     forward=fwd, backward=bwd, time_forward=_ipu_time.time(fwd, dtype),
                     time_backward=_ipu_time.time(bwd, dtype), memory_forward=mem_f,
                     memory_backward=mem_b, fits=_fits((mem_f, mem_b), budgets),
                     lean_forward=lean_f, lean_backward=lean_b)


def _pass_figures(sched, Lq, Lkv, backward, budget, may_lean, must_lean, args, bound):
    """``(counts, memory bytes, lean)`` of one pass: its usual structure, or the memory-lean
    one where ``must_lean``, or where ``may_lean`` and the usual one misses ``budget`` and the
    lean one needs less. ``bound``: the memory bound's ``scale`` and ``mods``."""
    from popxl_flash.plan import counts as _counts

    def figures(lean):
        c = _counts.pass_counts(Lq, Lkv, sched.chunk_q, sched.chunk_kv, backward=backward,
                                lean=lean, **args)
        m = _memory.flash_bytes(sched, groups=args["groups"], kv_groups=args["kv_groups"],
                                head_dim=args["head_dim"], dtype=args["dtype"],
                                backward=backward, steps=c.iterations, lean=lean, **bound)
        return c, m, lean
    if may_lean and must_lean:
        return figures(True)
    usual = figures(False)
    if not may_lean or usual[1] <= budget:
        return usual
    lean = figures(True)
    return lean if lean[1] < usual[1] else usual


def _fits(mem, budgets):
    """Whether each pass's bytes are within its budget (forward, backward)."""
    return all(m <= b for m, b in zip(mem, budgets))


def _flop_ratio(sched, fwd, head_dim, groups):
    """Executed (as the pass runs them: a one-block pass runs its whole block) over useful
    forward matmul FLOPs."""
    useful = sched.forward_flops(head_dim, groups).useful
    return fwd.matmul_flops / useful if useful else 1.0


def naive(Lq, Lkv, *, head_dim, groups, dtype, causal, window, memory_budget=None):
    """Naive attention priced by the same model (:class:`Baseline`)."""
    budgets = _memory.pass_budgets(_memory.check_budget(memory_budget), groups=groups,
                                   kv_groups=groups, q_len=Lq, kv_len=Lkv, head_dim=head_dim,
                                   dtype=dtype)
    masked = causal or tuple(window) != (-1, -1)
    args = dict(groups=groups, q_len=Lq, kv_len=Lkv, head_dim=head_dim, dtype=dtype)
    fwd, bwd = (_baselines.naive_counts(masked=masked, backward=b, **args) for b in (False, True))
    mem = [_memory.naive_bytes(masked=masked, backward=b, **args) for b in (False, True)]
    return Baseline(forward=fwd, backward=bwd, time_forward=_ipu_time.time(fwd, dtype),
                    time_backward=_ipu_time.time(bwd, dtype), memory_forward=mem[0],
                    memory_backward=mem[1], fits=_fits(mem, budgets))


#: Chunk counts tried on an axis besides those of :data:`CANDIDATE_CHUNK_LENGTHS`: one block
#: up to eight, balanced (``ceil(L / n)`` rows; lengths need not be powers of two).
CANDIDATE_COUNTS = (1, 2, 3, 4, 5, 6, 8)
#: Chunk lengths tried on an axis (balanced over the sequence as counts ``ceil(L / c)``).
CANDIDATE_CHUNK_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Largest number of blocks a candidate may have (each visited block costs its compute sets, so
#: finer chunkings only win where memory binds, and the planner's tables grow with them).
MAX_CANDIDATE_BLOCKS = 2048
#: Largest ratio between the two axes' chunk lengths tried (but for a pair where one axis is
#: one chunk: the row passes of one kv chunk, one q chunk's kv loop).
MAX_CHUNK_ASPECT = 4


#: When no chunking fits the budget: the fastest within this factor of the least memory (the
#: resident state dominates there, so the finest chunking would cost many compute sets for
#: little memory).
NOTHING_FITS_SLACK = 1.25


def _axis_lengths(length, fixed):
    """Chunk lengths tried on one axis (``fixed``: only that one)."""
    if fixed is not None:
        return (fixed,)
    counts = set(CANDIDATE_COUNTS) | {-(-length // c) for c in CANDIDATE_CHUNK_LENGTHS}
    return tuple(sorted({-(-length // n) for n in counts if n <= length}))


def candidate_pairs(Lq, Lkv, chunk_q=None, chunk_kv=None):
    """The ``(chunk_q, chunk_kv)`` pairs :func:`choose` weighs: every pair of the axes'
    lengths (:func:`_axis_lengths`) with at most :data:`MAX_CANDIDATE_BLOCKS` blocks."""
    pairs = [(cq, ckv) for cq in _axis_lengths(Lq, chunk_q) for ckv in _axis_lengths(Lkv, chunk_kv)
             if -(-Lq // cq) * -(-Lkv // ckv) <= MAX_CANDIDATE_BLOCKS
             and (chunk_q or chunk_kv or max(cq, ckv) <= MAX_CHUNK_ASPECT * min(cq, ckv)
                  or cq == Lq or ckv == Lkv)]
    if not pairs:  # fixed lengths that make many blocks: the finest allowed on the free axis
        cq = chunk_q or Lq
        ckv = chunk_kv or Lkv
        pairs = [(cq, ckv)]
    return pairs


@functools.lru_cache(maxsize=1024)
def choose(Lq, Lkv, *, head_dim, groups, dtype, causal=True, window=None, chunk_q=None,
           chunk_kv=None, kv_groups=None, memory_budget=None, scale=None, mods=None,
           lean=None):
    """Choose chunk lengths: the least modelled forward + backward time within the budget.

    Cached (the arguments are hashable and the result immutable): the functional API validates
    a call's configuration more than once, and every layer of a model asks the same question.

    Args:
        Lq, Lkv, head_dim, groups, dtype, causal, window: the attention call.
        kv_groups: Gk of k and v (``None``: G), as :func:`evaluate`.
        chunk_q, chunk_kv: a fixed chunk length for that axis, or ``None`` to choose it.
        memory_budget: bytes each pass may hold beyond its inputs and outputs (``None``: the
            default, each pass's :func:`popxl_flash.plan.memory.default_budget`, O(L)).
        scale, mods: as :func:`evaluate` (the memory bound weighs them).
        lean: the memory-lean structures, as :func:`evaluate` (``None``: where a chunking
            needs them to meet the budget; with both chunk lengths fixed and no explicit
            budget, never, as such a call builds).

    Returns:
        A :class:`ChunkChoice`. When no candidate fits, ``chosen`` is the one needing the
        least memory (:func:`fallback`) and ``reason`` says so (with an explicit budget the
        entry points then raise ``ValueError``; the default never refuses).
    """
    explicit = _memory.check_budget(memory_budget)
    if chunk_q is not None and chunk_kv is not None and explicit is None and lean is None:
        lean = False  # as a call with both chunk counts and no budget builds (from_shapes)
    window = (-1, -1) if window is None else tuple(window)
    Gk = groups if kv_groups is None else kv_groups
    budgets = _memory.pass_budgets(explicit, groups=groups, kv_groups=Gk, q_len=Lq,
                                   kv_len=Lkv, head_dim=head_dim, dtype=dtype)
    args = dict(head_dim=head_dim, groups=groups, dtype=dtype, causal=causal, window=window,
                kv_groups=kv_groups, memory_budget=explicit, scale=scale, mods=mods,
                lean=lean)
    pairs = candidate_pairs(Lq, Lkv, chunk_q, chunk_kv)

    def bound(pair):
        return _memory.flash_lower_bound(groups=groups, kv_groups=Gk, q_len=Lq, kv_len=Lkv,
                                         chunk_q=pair[0], chunk_kv=pair[1], head_dim=head_dim)
    # Candidates that cannot fit are not planned; if none planned fits, also the few needing
    # the least by the lower bound and the few finest (the least memory is a fine looped
    # chunking: the bound counts one kv chunk's row passes as nothing, though their blocks
    # span every column).
    kept = [pair for pair in pairs if bound(pair) <= max(budgets)]
    candidates = tuple(evaluate(Lq, Lkv, cq, ckv, **args) for cq, ckv in kept)
    if not any(c.fits for c in candidates):
        finest = sorted(pairs, key=lambda p: (max(p), p[0] * p[1], p))[:4]
        more = (set(sorted(pairs, key=bound)[:4]) | set(finest)) - set(kept)
        candidates += tuple(evaluate(Lq, Lkv, cq, ckv, **args) for cq, ckv in sorted(more))
    chosen, reason, worst = _pick(candidates, budgets, explicit is not None)
    seed_q, seed_kv = _baselines.seed_chunks(Lq, Lkv)
    seed = evaluate(Lq, Lkv, chunk_q or seed_q, chunk_kv or seed_kv, **{**args, "lean": False})
    base = naive(Lq, Lkv, head_dim=head_dim, groups=groups, dtype=dtype, causal=causal,
                 window=window, memory_budget=explicit)
    return ChunkChoice(chosen=chosen, candidates=candidates, reason=reason, budget=budgets[0],
                       seed=seed, naive=base, label=_ipu_time.label(),
                       budget_backward=budgets[1], default_budget=explicit is None,
                       worst_ratio=worst)


def _pick(candidates, budgets, explicit):
    """``(chosen, reason, worst ratio)``: among the candidates that fit ``budgets`` (forward,
    backward) the least modelled time, near-best over the constants' box (:func:`_robust`),
    else :func:`fallback` (worst ratio 1.0: not computed)."""
    fitting = [c for c in candidates if c.fits]
    if fitting:
        within = "memory_budget" if explicit else "the default memory budget"
        chosen, worst, reason = _robust(fitting, within)
        return chosen, reason, worst[id(chosen)]
    return (*fallback(candidates, budgets, explicit), 1.0)


def fallback(candidates, budgets, explicit):
    """The choice when no candidate fits: the fastest within :data:`NOTHING_FITS_SLACK` of
    the least memory with an explicit budget (the entry points raise ``ValueError`` then),
    the least memory itself with the default (which never refuses: it keeps as close to its
    O(L) promise as any chunking can).

    Returns:
        ``(chosen, reason)``.
    """
    least = min(c.memory_bytes for c in candidates)
    if not explicit:
        chosen = min(candidates, key=lambda c: (c.memory_bytes, c.seconds))
        return chosen, (f"no chunking meets the default memory budget (forward "
                        f"{budgets[0]:,}, backward {budgets[1]:,} bytes): the least memory, "
                        f"{least:,} bytes")
    near = [c for c in candidates if c.memory_bytes <= NOTHING_FITS_SLACK * least]
    chosen = min(near, key=lambda c: (c.seconds, c.memory_bytes))
    return chosen, (f"NOTHING FITS memory_budget={budgets[0]:,} bytes (the least any chunking "
                    f"needs is {least:,}): the least modelled time within "
                    f"{NOTHING_FITS_SLACK}x of that")


#: Where the central choice is more than this factor off the best at some corner of the
#: constants' box (:data:`popxl_flash.ipu_model.BOX`), the choice is the candidate whose worst
#: ratio over the corners is least.
ROBUST_RATIO = 1.3


def corner_seconds(candidate, corners):
    """Modelled forward + backward seconds of ``candidate`` at each corner's constants."""
    works = (_ipu_time.work_of(candidate.forward), _ipu_time.work_of(candidate.backward))
    return [sum(_ipu_time.time(w, constants=c).seconds for w in works) for _, c in corners]


def _robust(fitting, within="memory_budget"):
    """The choice among fitting candidates: the least modelled time at the current constants,
    unless it is more than :data:`ROBUST_RATIO` off the best at a corner of the box; then the
    candidate whose worst ratio to each corner's best is least.

    Returns:
        ``(chosen, {id(candidate): worst ratio}, reason)``.
    """
    central = min(fitting, key=lambda c: (c.seconds, c.memory_bytes))
    corners = _ipu_time.corners()
    times = {id(c): corner_seconds(c, corners) for c in fitting}
    best = [min(t[k] for t in times.values()) for k in range(len(corners))]
    worst = {key: max(a / b for a, b in zip(t, best)) for key, t in times.items()}
    if worst[id(central)] <= ROBUST_RATIO:
        return central, worst, (f"least modelled forward + backward time within {within} "
                                f"(within {worst[id(central)]:.2f}x of the best at every corner "
                                "of the constants' box)")
    robust = min(fitting, key=lambda c: (worst[id(c)], c.seconds))
    return robust, worst, (f"least worst ratio over the constants' box ({worst[id(robust)]:.2f}x;"
                           f" the fastest at the reference constants was "
                           f"{central.chunk_q}x{central.chunk_kv}, {worst[id(central)]:.2f}x off "
                           f"at a corner) within {within}")
