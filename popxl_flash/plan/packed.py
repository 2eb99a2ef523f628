"""Packed sequences (segment ids, varlen; context parallelism's rounds): the automatic chunk
choice by modelled IPU time within ``memory_budget`` (host side, numpy only).

With segment ids every step of a pass runs under a conditional on its block's run-time class
(:mod:`popxl_flash.graph.segments`): a skipped block passes the state through (no matmul, a
dozen supersteps), a running block pays the update plus the dispatch and, where its run-time
class is masked, the mask. The cost of a packed pass therefore depends on the packing, which
is a run-time fact. The choice prices every candidate chunking against a **stated packing
assumption** (:class:`Packing`):

* ``flash_attention`` with segment ids (no sequence length known): **one sequence over the
  whole row** (ids all 0, no padding): every block the static schedule visits runs, the most
  any packing runs (a skipped block costs less than a running one);
* ``flash_attn_varlen_func``: **sequences of ``max_seqlen_q`` / ``max_seqlen_k`` packed back
  to back** from row 0 (the last one cut at ``total``), causal and window aligned bottom-right
  per sequence, as the call's positions give them: the blocks such rows visit;
* context parallelism: the rounds' exact positions (every replica's row of the layout's
  position table against the round's gathered columns; :mod:`popxl_flash.plan.context_parallel`).

For an assumed packing the block classes are computed on the host exactly as the device
computes them (:func:`classify`, the rule of :func:`popxl_flash.graph.segments.classify_blocks`),
and :func:`pass_counts` prices the pass: matmul FLOPs of the running blocks (exact), bytes
copied at the boundaries (:func:`popxl_flash.plan.costmodel.pass_copies` given the classes,
exact), executed ops (a fit on this version's graphs: per skipped, running and masked step, per
loop and per pass; ``tests/test_packed_choice.py`` holds it within :data:`OPS_TOLERANCE` of
the emulator), priced at :data:`popxl_flash.plan.ipu_time.CS_PER_OP` compute sets each (an
estimate until the packed dispatch is fitted to PopART's lowering like the plain passes), and
vector work and the views' and ops' copies (the plain pass's fitted parts on the running
steps; an estimate, within 0.5x-2.6x of the emulator's at the shapes the tests draw). Memory is :func:`pass_bytes`,
the packed pass's graph walked op by op with the emulator's liveness (an upper bound within
1.2x + 1 MiB of the emulator's peak, ``tests/test_packed_memory.py``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from popxl_flash.plan import costmodel as _costmodel
from popxl_flash.plan import counts as _counts
from popxl_flash.plan import ipu_time as _ipu_time
from popxl_flash.plan import memory as _memory
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan import steps as _steps
from popxl_flash.plan.segments import MAX_LEN, RT_FULL, RT_MASKED, RT_SKIP, SegmentConfig

#: The fitted superstep model holds the emulator's count within this fraction (tests).
OPS_TOLERANCE = 0.05

_BIG = 2 ** 30


# -- packings --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packing:
    """A stated packing assumption a packed pass is priced against.

    Attributes:
        kind: ``"one_sequence"`` (one sequence over the whole row: every visited block runs)
            or ``"max_seqlen"`` (sequences of ``seqlen_q`` / ``seqlen_kv`` rows back to back).
        seqlen_q, seqlen_kv: the sequence lengths of ``"max_seqlen"``.
    """

    kind: str = "one_sequence"
    seqlen_q: int = 0
    seqlen_kv: int = 0

    def describe(self) -> str:
        if self.kind == "one_sequence":
            return "assumed packing: one sequence over the whole row (every visited block runs)"
        return (f"assumed packing: sequences of max_seqlen {self.seqlen_q} (q) / "
                f"{self.seqlen_kv} (kv) rows back to back")

    def rows(self, q_len, kv_len, positions):
        """Host ids and positions of the assumed packing: ``(q_ids, kv_ids, q_pos, kv_pos)``,
        int ``[L]`` arrays (positions ``None`` without them): bottom-right positions
        ``r - end(r)`` as :func:`popxl_flash.graph.segments.varlen_segments` gives them."""
        if self.kind == "one_sequence":
            q_ids, kv_ids = np.zeros(q_len, np.int64), np.zeros(kv_len, np.int64)
            ends_q, ends_kv = np.full(q_len, q_len), np.full(kv_len, kv_len)
        else:
            q_ids = np.arange(q_len) // self.seqlen_q
            kv_ids = np.arange(kv_len) // self.seqlen_kv
            ends_q = np.minimum((q_ids + 1) * self.seqlen_q, q_len)
            ends_kv = np.minimum((kv_ids + 1) * self.seqlen_kv, kv_len)
        if not positions:
            return q_ids, kv_ids, None, None
        return q_ids, kv_ids, np.arange(q_len) - ends_q, np.arange(kv_len) - ends_kv


ONE_SEQUENCE = Packing()


def max_seqlen(seqlen_q, seqlen_kv) -> Packing:
    """The varlen assumption: sequences of ``max_seqlen_q`` / ``max_seqlen_k`` back to back."""
    return Packing("max_seqlen", int(seqlen_q), int(seqlen_kv))


# -- host classification ---------------------------------------------------------------------
def chunk_stats(ids, positions, chunk):
    """Per-chunk ``(seg_min, seg_max, has_padding, pos_lo, pos_hi)`` of one row of ids (and
    positions), padded with -1 (0) to whole chunks: :func:`popxl_flash.graph.segments.
    chunk_stats` on the host."""
    ids = np.asarray(ids, np.int64)
    n = -(-ids.shape[0] // chunk)
    pad = n * chunk - ids.shape[0]
    ids = np.concatenate([ids, np.full(pad, -1)]).reshape(n, chunk)
    real = ids > -1
    seg_min = np.where(real, ids, _BIG).min(1)
    seg_max = np.where(real, ids, -1).max(1)
    has_pad = (~real).any(1)
    if positions is None:
        zero = np.zeros(n, np.int64)
        return seg_min, seg_max, has_pad, zero, zero
    pos = np.concatenate([np.asarray(positions, np.int64), np.zeros(pad, np.int64)])
    pos = pos.reshape(n, chunk)
    at_min = real & (ids == seg_min[:, None])
    at_max = real & (ids == seg_max[:, None])
    return (seg_min, seg_max, has_pad, np.where(at_min, pos, _BIG).min(1),
            np.where(at_max, pos, -_BIG).max(1))


def _lex_less(a_seg, a_pos, b_seg, b_pos):
    return (b_seg > a_seg) | ((a_seg == b_seg) & (b_pos > a_pos))


def classify(q_ids, kv_ids, q_pos, kv_pos, chunk_q, chunk_kv, *, causal=False,
             window=(-1, -1)):
    """Run-time class of every block (``RT_SKIP``, ``RT_FULL``, ``RT_MASKED``), int
    ``[nq, nkv]``: :func:`popxl_flash.graph.segments.classify_blocks` on the host (causal and
    window apply only with positions, as on the device)."""
    return classify_stats(chunk_stats(q_ids, q_pos, chunk_q), chunk_stats(kv_ids, kv_pos, chunk_kv),
                          positions=q_pos is not None, causal=causal, window=window)


def classify_stats(q_stats, kv_stats, *, positions, causal=False, window=(-1, -1)):
    """:func:`classify` from the chunks' statistics (:func:`chunk_stats`)."""
    qs0, qs1, q_pad, qp0, qp1 = (a[:, None] for a in q_stats)
    ks0, ks1, k_pad, kp0, kp1 = (a[None, :] for a in kv_stats)
    skip = (ks0 > qs1) | (qs0 > ks1)
    full = (qs0 == qs1) & (ks0 == ks1) & (qs0 == ks0) & ~q_pad & ~k_pad
    if positions:
        left, right = (min(side, MAX_LEN) for side in window)
        if causal:
            skip = skip | _lex_less(qs1, qp1, ks0, kp0)
            full = full & (kp1 <= qp0)
        if left >= 0:
            skip = skip | _lex_less(ks1, kp1, qs0, qp0 - left)
            full = full & (qp1 - left <= kp0)
        if right >= 0:
            skip = skip | _lex_less(qs1, qp1 + right, ks0, kp0)
            full = full & (kp1 <= qp0 + right)
    full = full & ~skip
    return np.where(skip, RT_SKIP, np.where(full, RT_FULL, RT_MASKED)).astype(np.int32)


# -- counts of a packed pass -----------------------------------------------------------------
#: Supersteps of a segment-id step, counted on this version's graphs (``blocks._dispatch``).
#: Every step: the step-table lookup, the operand, state and segment-id slices, the run flag's
#: lookup, the conditional, the state writes and the counter (``skip``: the skipped branch's
#: identities; ``run``: the update, float32 casts left out). Added: ``float16`` per running
#: step (the cast of P); per running step where the scale does not fold; 2 per step with
#: positions (their slices); 1 per step of a group that gathers its pattern; 2 per step of a
#: two-level group (the runtime-full flag's lookup and the second conditional; a skipped step
#: only the lookup); :func:`popxl_flash.plan.costmodel.mask_ops` per step whose update is
#: masked (``+1``: the static pattern's ``logical_and`` in a masked group); 1 per runtime-full
#: step at the second level.
SEG_STEP = {False: dict(skip=11, run=22), True: dict(skip=15, run=24)}
#: Supersteps per packed pass (a fit on this version's graphs, see :data:`OPS_TOLERANCE`):
#: the module's call, segment preparation (padding, chunk statistics, the block classes),
#: the state's initialisation and the results; per group its loop, class gather and flag
#: compare (``group``), the runtime-full compare (``two``); positions, their causal and
#: window terms, padded tails, dtype and a scale that does not fold.
SEG_FIXED = {
    False: dict(one=64, group=3, two=1, positions=15, float16=1, unfolded=-1, pad_q=3,
                pad_kv=3, causal_positions=9, left_positions=12, right_positions=10),
    True: dict(one=69, group=3, two=0, positions=16, float16=5, unfolded=0, pad_q=5,
               pad_kv=3, causal_positions=9, left_positions=11, right_positions=11),
}




def pass_counts(sched, classes, *, groups, head_dim, dtype, backward, segments,
                kv_groups=None, causal=False, window=(-1, -1), scale=None, step_groups=None):
    """Modelled run-profile counts of one packed (segment-id) pass for given block classes.

    Args:
        sched: the static :class:`~popxl_flash.plan.schedule.BlockSchedule` (planned without
            causal/window when positions carry them, :attr:`AttentionConfig.static_mask`).
        classes: int ``[nq, nkv]`` run-time classes (:func:`classify`).
        groups, head_dim, kv_groups, dtype: G, D, Gk (``None``: G), the input dtype name.
        backward: the stash backward instead of the forward.
        segments: the call's :class:`~popxl_flash.plan.segments.SegmentConfig`.
        causal, window, scale: the call's options (causal and window act through positions
            when ``segments.positions``).
        step_groups: the pass's :class:`~popxl_flash.plan.steps.StepGroup` list (``None``:
            the static schedule's; context parallelism's run-time step tables give one group
            of a replica's own blocks).

    Returns:
        :class:`popxl_flash.plan.counts.PassCounts`: FLOPs, boundary copies and iterations
        exact; ``ops`` (executed ops other than views) a fit (:data:`SEG_STEP`,
        :data:`SEG_FIXED`), priced at :data:`popxl_flash.plan.ipu_time.CS_PER_OP` compute
        sets each (an estimate until the packed dispatch is fitted to the lowering table);
        vector work the plain pass's fitted parts plus an estimate of the segment work.
    """
    G, D = groups, head_dim
    Gk = G if kv_groups is None else kv_groups
    window = tuple(window)
    classes = np.asarray(classes)
    pos = bool(segments.positions)
    folds = _counts.folds_scale(scale, D)
    f16 = dtype == "float16"
    mops = _costmodel.mask_ops(pos, causal, window, backward)
    fixed = SEG_FIXED[backward]
    lq_pad, lkv_pad = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    supersteps = (fixed["one"] + pos * fixed["positions"] + f16 * fixed["float16"]
                  + (not folds) * fixed["unfolded"] + (lq_pad > sched.Lq) * fixed["pad_q"]
                  + (lkv_pad > sched.Lkv) * fixed["pad_kv"])
    if pos:
        supersteps += (bool(causal) * fixed["causal_positions"]
                       + (window[0] >= 0) * fixed["left_positions"]
                       + (window[1] >= 0) * fixed["right_positions"])
    base = SEG_STEP[backward]
    pass_terms = {"1": 1, "gl": G * lq_pad, "gld": G * lq_pad * D, "gL": G * sched.Lq,
                  "gLd": G * sched.Lq * D, "gkld": Gk * lkv_pad * D, "gkLd": Gk * sched.Lkv * D}
    records = [("fixed", pass_terms)]  # the plain pass's parts, priced by its fit
    cells = iterations = 0
    if step_groups is None:
        step_groups = _steps.step_groups(sched, "kv_major" if backward else "q_major")
    item = 2 if f16 else 4
    copies = dict.fromkeys(_costmodel.COPY_KINDS, 0)
    for g in step_groups:
        two = _costmodel.second_level(g, groups=G, head_dim=D, dtype=dtype, backward=backward,
                                      segments=segments, kv_groups=Gk, causal=causal,
                                      window=window)
        _costmodel._loop_copies(g.steps, copies)
        copies["branch"] += _costmodel._branch_copies(g, classes, G, Gk, D, item, backward,
                                                      segments, two)
        cls = classes[g.q_chunk, g.kv_chunk]
        skipped, full = int((cls == RT_SKIP).sum()), int((cls == RT_FULL).sum())
        running = g.steps - skipped
        gathers = bool(g.masked and g.num_patterns > 1)
        supersteps += fixed["group"] + two * fixed["two"]
        supersteps += g.steps * (2 * pos + gathers) + skipped * (base["skip"] + two)
        run = base["run"] + f16 + (not folds) + 2 * two
        masked_steps = running if (g.masked or not two) else running - full
        supersteps += running * run + masked_steps * (mops + g.masked)
        supersteps += (running - masked_steps)  # runtime-full at the second level
        iterations += g.steps
        cells += running * g.rows * g.cols
        if running:
            records.append(("step", _counts._step_terms(G, Gk, D, g.rows, g.cols, running)))
        if masked_steps:
            records.append(("masked_step",
                            _counts._step_terms(G, Gk, D, g.rows, g.cols, masked_steps)))
    flops = 2 * (5 if backward else 2) * D * G * cells
    fitted = _counts.price(records, _counts.fit_key("flash", backward, dtype, Gk < G))
    work = _counts.work(fitted, dtype, flops, sum(copies.values()))
    # compute sets: the op count at the flash steps' mean per op (the packed dispatch is not
    # fitted to the lowering table yet: an estimate); vector work: the plain parts' fit on the
    # running steps (the dispatch's own elementwise work is small beside them)
    work = _ipu_time.WorkCounts(compute_sets=supersteps * _ipu_time.CS_PER_OP,
                                matmul_flops=work.matmul_flops, vector_work=work.vector_work,
                                bytes_copied=work.bytes_copied, ops=int(supersteps))
    return _counts.PassCounts(work=work, iterations=int(iterations), ops=int(supersteps),
                              boundary_bytes=sum(copies.values()))


# -- memory ----------------------------------------------------------------------------------
#: Small tensors of a packed pass the walk leaves out (scalars, counters, step and class
#: table entries, the chunk statistics and the block classes' ``[nq, nkv]`` temporaries of a
#: few chunks): a fixed allowance, as :data:`popxl_flash.plan.memory.LOOP_FIXED_BYTES`.
SEG_FIXED_BYTES = 65536


@dataclass(frozen=True)
class _Step:
    """A step group as the packed walk sees it: every running step is masked at run time (its
    static pattern, if any, ANDed with the segment mask)."""
    rows: int
    cols: int
    patterned: bool
    gathers: bool


def pass_bytes(sched, *, groups, head_dim, dtype, backward, segments, kv_groups=None,
               scale=None, mods=None):
    """Upper bound of one packed (segment-id) pass's live bytes beyond its inputs and outputs:
    the emulator's liveness walked op by op over the pass's graph (the forward's or the
    backward's looped structure, :mod:`popxl_flash.graph.segments` and ``blocks._dispatch``),
    as :func:`popxl_flash.plan.memory.flash_bytes` walks a plain pass (its ``_Live``).

    A packed pass always loops (one block too), every step in a loop body; the segment
    preparation pads the ids (and positions) to whole chunks, classifies the blocks and keeps
    the loop's id tensors (``[Gs, L, 1]`` / ``[Gs, 1, L]`` int32 copies; positions views of
    the inputs unless padded or repeated for grouped-query kv rows) and each group's bool
    flag tables through the loops. A step slices its operands, state rows and segment
    operands (copies), then the conditional copies them into the taken branch (``IfOpx``:
    for that moment both are live; the body's slices are then released, their last use) and
    again at a second level; the running branch builds the bool mask ``[Gs, rows, cols]``
    and runs the masked update; the new state rows come out and are written back in place.
    Plus the constants (patterns, step and class-index tables) and :data:`SEG_FIXED_BYTES`;
    score modifiers and dropout add :func:`popxl_flash.plan.memory.flash_bytes`' fitted
    blocks.

    Args:
        sched: the static :class:`~popxl_flash.plan.schedule.BlockSchedule`.
        groups, head_dim, kv_groups, dtype, scale: the call (``kv_groups`` ``None``: G).
        backward: the stash-mode backward (else the forward).
        segments: the call's :class:`~popxl_flash.plan.segments.SegmentConfig` (with
            ``table_steps``, context parallelism's run-time step table: one group of whole
            blocks looped that many times).
        mods: ``None`` or the call's :class:`~popxl_flash.plan.score_mods.ScoreMods`.

    Returns:
        int bytes.
    """
    G, D = groups, head_dim
    Gk = G if kv_groups is None else kv_groups
    item = 2 if dtype == "float16" else 4
    folds = _memory._scale_folds(D, scale)
    order = "kv_major" if backward else "q_major"
    groups_ = _steps.step_groups(sched, order)
    if segments.table_steps:
        g0 = groups_[0]
        groups_ = [_steps.StepGroup(g0.rows, g0.cols, False, g0.q_row[:1], g0.kv_row[:1],
                                    g0.q_chunk[:1], g0.kv_chunk[:1])]
        steps_ = [segments.table_steps]
    else:
        steps_ = [g.steps for g in groups_]
    walk = [_Step(g.rows, g.cols, bool(g.masked), bool(g.masked and g.num_patterns > 1))
            for g in groups_]
    sim = _memory._Live()
    lq, lkv = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    seg = _SegWalk(sched, G, Gk, segments, steps_, groups_, backward, dtype, D, scale)
    if backward:
        _packed_backward(sim, sched, G, Gk, D, item, folds, lq, lkv, walk, seg)
        outputs = (G * sched.Lq + 2 * Gk * sched.Lkv) * D * item
    else:
        _packed_forward(sim, sched, G, Gk, D, item, folds, lq, lkv, walk, seg)
        outputs = G * sched.Lq * (D * item + _F32)
    constants = sched.patterns_nbytes + seg.constants
    extra = _memory._mod_bytes(sched, G, backward, mods, False, False)
    return int(sim.peak - outputs + constants + extra + SEG_FIXED_BYTES)


_F32 = _I32 = 4


class _SegWalk:
    """The segment parts of a packed pass for the walk: what the preparation holds and peaks
    at, what a step slices."""

    def __init__(self, sched, G, Gk, segments, steps_, groups_, backward, dtype, D, scale):
        self.G, self.Gk, self.cfg = G, Gk, segments
        lq, lkv = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
        self.q_rows = segments.q_groups
        self.kv_rows = 1 if segments.kv_groups == 1 else G
        self.mask_rows = max(self.q_rows, self.kv_rows)
        pos = bool(segments.positions)
        # held through the loops: the loop ids (``where`` copies), positions where padded or
        # repeated (else views of the inputs), the flag tables (two with a second level)
        q_pos = lq > sched.Lq
        kv_pos = lkv > sched.Lkv or self.kv_rows != segments.kv_groups
        self.held = _I32 * (self.q_rows * lq * (1 + (pos and q_pos))
                            + self.kv_rows * lkv * (1 + (pos and kv_pos)))
        tables = 0
        for g, n in zip(groups_, steps_):
            two = _costmodel.second_level(g, groups=G, head_dim=D, dtype=dtype,
                                          backward=backward, segments=segments, kv_groups=Gk,
                                          window=(-1, -1), causal=False)
            tables += n * (1 + bool(two))
        self.held += tables
        # the preparation's peak beyond what it keeps: the padded (and repeated) ids and
        # positions, then chunk statistics' temporaries of a padded row (a few int32 and bool
        # copies), the classes' [nq, nkv] temporaries
        sides = (self.q_rows * lq, self.kv_rows * lkv)
        self.prep = _I32 * (1 + pos) * sum(sides) + 3 * _I32 * max(sides) \
            + 6 * _I32 * sched.nq * sched.nkv
        # constants: the class-index tables (int32 per step of a group), the padding tails
        self.constants = (_I32 + _memory.TABLE_BYTES_PER_STEP) * sum(steps_) + _I32 * (1 + pos) * (
            self.q_rows * (lq - sched.Lq) + segments.kv_groups * (lkv - sched.Lkv))
        self.pos = pos

    def slices(self, g):
        """Bytes of a step's segment operands (ids, positions: int32)."""
        return _I32 * (self.q_rows * g.rows + self.kv_rows * g.cols) * (1 + self.pos)

    def mask(self, b, g):
        """The running branch's ``block_mask`` (and the static pattern ANDed): held as
        ``pat`` (bool ``[Gs, rows, cols]``), the segment operands freed."""
        M = self.mask_rows * g.rows * g.cols
        b.op(M, "eq")
        if self.pos:  # a band term: greater, logical_not, logical_and
            b.op(M, "gt")
            b.op(M, "ng", ("gt",))
            b.op(M, "eq", ("eq", "ng", "seg_i"))
        else:
            b.free("seg_i")
        if g.patterned:
            b.op(M, "eq", ("eq", "spat"))
        b.held["pat"] = b.held.pop("eq")


def _prepare(sim, seg):
    """Segment preparation (``segments.prepare``, ``PassLoops.step_classes``)."""
    sim.op(seg.prep, "prep")
    sim.op(seg.held, "segs", ("prep",))


def _enter(b, g, slices):
    """A step's conditional entry: the branch's copies of the slices while the body's are
    still live (then released: the branch holds the copies under the same names)."""
    b.op(slices, "copy")
    b.free("copy")


def _packed_forward(sim, sched, G, Gk, D, item, folds, lq, lkv, walk, seg):
    """``FlashAttention.build`` with segment ids (looped, never lean), op by op."""
    Lq, Lkv = sched.Lq, sched.Lkv
    Q, R = G * Lq * D * item, G * Lq * _F32
    if folds:
        sim.op(Gk * Lkv * D * item, "ks")
    _memory._pad(sim, Q, G * lq * D * item, "q")
    _memory._pad(sim, 2 * Gk * Lkv * D * item, 2 * Gk * lkv * D * item, "kv")
    state = G * lq * (D + 2) * _F32
    sim.op(state, "init")
    sim.op(state, "state", ("init",))
    _prepare(sim, seg)
    for g in walk:
        b = sim
        r, c = g.rows, g.cols
        if g.gathers:
            b.op(r * c, "spat")
        b.op(G * r * D * item, "q_i")
        b.op(2 * Gk * c * D * item, "kv_j")
        b.op(G * r * (D + 2) * _F32, "st_i")
        b.op(seg.slices(g), "seg_i")
        _enter(b, g, G * r * D * item + 2 * Gk * c * D * item + G * r * (D + 2) * _F32
               + seg.slices(g) + (r * c if g.patterned else 0))
        seg.mask(b, g)
        _memory.softmax_block_walk(b, G, r, c, D, item, folds, True)
        b.free("add", "m_new", "spat")  # the branch returns
        b.op(G * r * (D + 2) * _F32, "new")  # its output, written back in place
        b.free("new")
    sim.free("q", "kv", "segs")
    sim.op(G * Lq, "seen")  # rows may see nothing: greater(l, 0), where(seen, l, 1)
    sim.op(R, "l")
    sim.op(G * Lq * D * _F32, "out", ("l",))
    if item == 2:
        sim.op(Q, "out", ("out",))
    sim.op(R, "lg")
    sim.op(R, "lse", ("lg", "state"))
    sim.op(R, "lse", ("lse", "seen"))


def _packed_backward(sim, sched, G, Gk, D, item, folds, lq, lkv, walk, seg):
    """``FlashAttentionGrad.build`` with segment ids (looped, never lean), op by op."""
    Lq, Lkv = sched.Lq, sched.Lkv
    R = G * Lq * _F32
    P32 = G * Lq * D * _F32
    if item == 2:
        sim.op(P32, "c1")
        sim.op(P32, "c2")
    sim.op(P32, "mu", ("c1", "c2"))
    sim.op(R, "dvec", ("mu",))
    sim.op(G * Lq, "g")  # rows may see nothing: where(lse > MASKED_SCORE, lse, 0)
    sim.op(R, "lse", ("g",))
    if folds:
        sim.op(Gk * Lkv * D * item, "ks")
    _memory._pad(sim, 2 * G * Lq * D * item, 2 * G * lq * D * item, "qdo")
    sim.op(2 * R, "stats", ("lse", "dvec"))
    _memory._pad(sim, 2 * R, 2 * G * lq * _F32, "stats", ("stats",))
    _memory._pad(sim, 2 * Gk * Lkv * D * item, 2 * Gk * lkv * D * item, "kv")
    sim.op(G * lq * D * _F32, "dq")
    sim.op(2 * Gk * lkv * D * _F32, "dkdv")
    _prepare(sim, seg)
    for g in walk:
        b = sim
        r, c = g.rows, g.cols
        if g.gathers:
            b.op(r * c, "spat")
        slices = [(2 * G * r * D * item, "qdo_i"), (2 * G * r * _F32, "stats_i"),
                  (2 * Gk * c * D * item, "kv_j"), (G * r * D * _F32, "dq_i"),
                  (2 * Gk * c * D * _F32, "dkdv_j"), (seg.slices(g), "seg_i")]
        for nbytes, name in slices:
            b.op(nbytes, name)
        _enter(b, g, sum(n for n, _ in slices) + (r * c if g.patterned else 0))
        seg.mask(b, g)
        _memory._grad_block(b, G, Gk, r, c, D, item, folds, True, True, {
            "arg": ("pat",), "sub": ("stats_i",), "dkdv": ("qdo_i",), "dq": ("kv_j",),
            "dq+": ("dq_i",), "dkdv+": ("dkdv_j",)})
        b.free("spat")
        b.op((G * r * D + 2 * Gk * c * D) * _F32, "new")  # the branch's outputs
        b.free("new")
    sim.free("qdo", "stats", "kv", "segs")
    _memory._finish(sim, G, Gk, Lq, Lkv, D, item, folds, ("dkdv",), (lq, lkv))


def segment_bytes(sched, *, groups, head_dim, dtype, backward, segments, kv_groups=None,
                  scale=None):
    """What a packed pass's bound (:func:`pass_bytes`) adds to the plain pass's
    (:func:`popxl_flash.plan.memory.flash_bytes`) at the same schedule: the segment parts,
    and the looped structure where the plain pass would run one block or row passes (may be
    negative where the plain bound's structure holds more)."""
    Gk = groups if kv_groups is None else kv_groups
    args = dict(groups=groups, kv_groups=Gk, head_dim=head_dim, dtype=dtype,
                backward=backward, scale=scale)
    plain = _memory.flash_bytes(sched, steps=_steps.loop_steps(sched), **args)
    return pass_bytes(sched, segments=segments, **args) - plain


# -- the choice ------------------------------------------------------------------------------
def _static_mask(causal, window, segments):
    if segments.positions:
        return False, (-1, -1)
    return causal, tuple(window)


def evaluate(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, dtype, causal, window, segments,
             packing=ONE_SEQUENCE, kv_groups=None, scale=None, memory_budget=None,
             classes=None):
    """The model's figures for one chunking of a packed call (a
    :class:`popxl_flash.plan.costmodel.Candidate`), priced against ``packing`` (or the given
    run-time ``classes``, int ``[nq, nkv]``)."""
    Gk = groups if kv_groups is None else kv_groups
    budgets = _memory.pass_budgets(_memory.check_budget(memory_budget), groups=groups,
                                   kv_groups=Gk, q_len=Lq, kv_len=Lkv, head_dim=head_dim,
                                   dtype=dtype)
    window = tuple(window)
    s_causal, s_window = _static_mask(causal, window, segments)
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=s_causal, window=s_window)
    if classes is None:
        q_ids, kv_ids, q_pos, kv_pos = packing.rows(Lq, Lkv, segments.positions)
        classes = classify(q_ids, kv_ids, q_pos, kv_pos, sched.chunk_q, sched.chunk_kv,
                           causal=causal, window=window)
    args = dict(groups=groups, head_dim=head_dim, dtype=dtype, segments=segments,
                kv_groups=Gk, causal=causal, window=window, scale=scale)
    fwd, bwd = (pass_counts(sched, classes, backward=b, **args) for b in (False, True))
    mem = [pass_bytes(sched, groups=groups, head_dim=head_dim, dtype=dtype, backward=b,
                      segments=segments, kv_groups=Gk, scale=scale)
           for b in (False, True)]
    useful = sched.forward_flops(head_dim, groups).useful
    return _costmodel.Candidate(
        chunk_q=chunk_q, chunk_kv=chunk_kv, num_chunks_q=sched.nq, num_chunks_kv=sched.nkv,
        flop_ratio=fwd.matmul_flops / useful if useful else 1.0, forward=fwd, backward=bwd,
        time_forward=_ipu_time.time(fwd, dtype), time_backward=_ipu_time.time(bwd, dtype),
        memory_forward=mem[0], memory_backward=mem[1], fits=_costmodel._fits(mem, budgets))


#: The earlier rule's longest automatic chunk with segment ids (64 rows, a FLOP rule that
#: ignored supersteps), priced beside the choice.
EARLIER_CHUNK_LEN = 64


@functools.lru_cache(maxsize=512)
def choose(Lq, Lkv, *, head_dim, groups, dtype, causal, window, segments, packing=ONE_SEQUENCE,
           chunk_q=None, chunk_kv=None, kv_groups=None, scale=None, memory_budget=None):
    """Chunk lengths of a packed call: the least modelled forward + backward time within
    ``memory_budget`` against the stated ``packing`` (module docstring).

    Args:
        Lq, Lkv, head_dim, groups, dtype, causal, window, kv_groups, scale: the call.
        segments: its :class:`~popxl_flash.plan.segments.SegmentConfig`.
        packing: the :class:`Packing` assumption priced.
        chunk_q, chunk_kv: a fixed chunk length for that axis, or ``None`` to choose it.
        memory_budget: bytes (``None``: each pass's default,
            :func:`popxl_flash.plan.memory.default_budget`).

    Returns:
        :class:`popxl_flash.plan.costmodel.ChunkChoice` (``seed``: the earlier 64-row rule;
        ``naive``: ``None``). When nothing fits, ``chosen`` is the fastest within
        :data:`popxl_flash.plan.costmodel.NOTHING_FITS_SLACK` of the least memory and
        ``chosen.fits`` is false (the entry points raise ``ValueError`` for an explicit
        budget).
    """
    explicit = _memory.check_budget(memory_budget)
    window = (-1, -1) if window is None else tuple(window)
    Gk = groups if kv_groups is None else kv_groups
    budgets = _memory.pass_budgets(explicit, groups=groups, kv_groups=Gk, q_len=Lq,
                                   kv_len=Lkv, head_dim=head_dim, dtype=dtype)
    args = dict(head_dim=head_dim, groups=groups, dtype=dtype, causal=causal, window=window,
                segments=segments, packing=packing, kv_groups=Gk, scale=scale,
                memory_budget=explicit)
    pairs = _costmodel.candidate_pairs(Lq, Lkv, chunk_q, chunk_kv)

    def bound(pair):
        return _memory.flash_lower_bound(groups=groups, kv_groups=Gk, q_len=Lq, kv_len=Lkv,
                                         chunk_q=pair[0], chunk_kv=pair[1], head_dim=head_dim)
    kept = [pair for pair in pairs if bound(pair) <= max(budgets)] or sorted(pairs, key=bound)[:4]
    candidates = tuple(evaluate(Lq, Lkv, cq, ckv, **args) for cq, ckv in kept)
    chosen, reason, worst = _costmodel._pick(candidates, budgets, explicit is not None)
    reason = f"{reason}; {packing.describe()}"
    earlier = evaluate(Lq, Lkv, chunk_q or min(Lq, EARLIER_CHUNK_LEN),
                       chunk_kv or min(Lkv, EARLIER_CHUNK_LEN), **args)
    return _costmodel.ChunkChoice(chosen=chosen, candidates=candidates, reason=reason,
                                  budget=budgets[0], seed=earlier, naive=None,
                                  label=_ipu_time.label(), seed_name="earlier 64-row rule",
                                  budget_backward=budgets[1], default_budget=explicit is None,
                                  worst_ratio=worst)
