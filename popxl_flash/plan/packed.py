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
steps; an estimate, within 0.5x-2.6x of the emulator's at the shapes the tests draw). Memory is the plain
pass's upper bound (:func:`popxl_flash.plan.memory.flash_bytes`) plus :func:`segment_bytes`.
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
def segment_bytes(sched, *, groups, head_dim, dtype, backward, segments, kv_groups=None):
    """Bytes a packed pass holds beyond :func:`popxl_flash.plan.memory.flash_bytes`: the
    largest step's branch copies (``IfOpx`` copies every input and output of the taken
    branch, at two levels: state slices in and out, operand and segment slices in), the loop's
    id (and position) tensors and their padded copies, the block classes and the per-group
    flag tables (an upper bound of the emulator's; ``tests/test_packed_choice.py``)."""
    G, D = groups, head_dim
    Gk = G if kv_groups is None else kv_groups
    item = 2 if dtype == "float16" else 4
    branch = 0
    for g in _steps.step_groups(sched, "kv_major" if backward else "q_major"):
        state, operands, ids = _costmodel._step_bytes(g, G, Gk, D, item, backward, segments)
        branch = max(branch, 2 * (2 * state + operands + ids))
    kv_rows = 1 if segments.kv_groups == 1 else G
    lq_pad, lkv_pad = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    loop_ids = 2 * 4 * (segments.q_groups * lq_pad + kv_rows * lkv_pad) * (
        2 if segments.positions else 1)
    tables = 16 * sched.nq * sched.nkv + 6 * _steps.loop_steps(sched, True)
    return int(_memory.MARGIN * (branch + loop_ids + tables))


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
    mem = [_memory.flash_bytes(sched, groups=groups, kv_groups=Gk, head_dim=head_dim,
                               dtype=dtype, backward=b, steps=c.iterations, scale=scale)
           + segment_bytes(sched, groups=groups, head_dim=head_dim, dtype=dtype, backward=b,
                           segments=segments, kv_groups=Gk)
           for b, c in ((False, fwd), (True, bwd))]
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
