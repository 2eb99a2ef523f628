"""Predicted modelled work of one attention pass (host side, numpy only).

:func:`pass_counts` predicts what the emulator's run profile prices for one forward pass
(``flash_attention``) or one stash-mode backward pass (``flash_attention_grad``) without
segment ids or score modifiers, by PopART's lowering (:mod:`popxl_flash.lowering`): compute
sets, vector work by rate key, bytes copied (outplace views and ops' own copies, plus the
copies at subgraph boundaries), matmul FLOPs and loop iterations (the caller's ``ops.call`` of
the module graph is part of the pass, host transfers are not).

The structure comes from the planner's schedule (:mod:`popxl_flash.plan.schedule`) and its
step groups (:mod:`popxl_flash.plan.steps`): :func:`pass_records` lists the pass's parts
(*entries*: the fixed part, each step of a group, each loop, the masked steps' selects, the
one-block pass, each row pass, ...) with their shape terms. Each entry's work is linear in its
terms:

* per step of a ``rows x cols`` sub-block: ``grc = G*rows*cols``, ``rc = rows*cols`` (a
  gathered pattern), ``grd = G*rows*D``, ``gr = G*rows``, ``gkcd = Gk*cols*D``;
* per pass: ``gld = G*Lq_pad*D``, ``gl = G*Lq_pad`` on padded lengths (state, operands),
  ``gLd = G*Lq*D``, ``gL = G*Lq`` on the true lengths (results), ``gkld = Gk*Lkv_pad*D``,
  ``gkLd = Gk*Lkv*D``, ``gLL = G*Lq*Lkv``;
* ``1``: once per record.

The coefficients (per pass direction and dtype, entry, metric and term) are data
(``pass_work.json``), fitted to the emulator's priced profile of this version's graphs by
``python -m popxl_flash.checks.fit_work`` (least squares over drawn shapes, chunkings, masks,
grouped-query and scales; rerun it whenever the graph code changes). The tests
(``tests/test_counts.py``) hold the predictions equal to the emulator's priced profile over
other drawn shapes, and the FLOPs, boundary copies and iterations exactly.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

from popxl_flash import ipu_model as _ipu_model
from popxl_flash import lowering as _lowering
from popxl_flash.plan import costmodel as _costmodel
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan import steps as _steps

#: The fitted metrics: compute sets, vector work per rate key, bytes of views' and ops' copies,
#: and executed ops other than re-indexing ones (not priced: the op count that context
#: parallelism's model adds its own to; the emulator's ``ops_excluding_views``).
METRICS = ("compute_sets",) + _lowering.RATE_KEYS + ("copied", "ops")
#: Metrics that are per-part constants (never shape terms).
CONSTANT_METRICS = ("compute_sets", "ops")
#: The coefficients' file, beside this module.
WORK_FILE = os.path.join(os.path.dirname(__file__), "pass_work.json")


@dataclass(frozen=True)
class PassCounts:
    """Predicted modelled work of one pass (see the module docstring).

    Attributes:
        work: :class:`popxl_flash.ipu_model.WorkCounts` (compute sets, matmul FLOPs by dtype,
            vector work by rate key, bytes copied: views', ops' and boundary copies).
        iterations: loop iterations (repeat-body executions).
        ops: executed ops other than views, where a planner predicts them (packed passes;
            0 elsewhere).
        boundary_bytes: the copies at call, branch and loop boundaries (exact; included in
            ``work.bytes_copied``).
    """

    work: _ipu_model.WorkCounts
    iterations: int
    ops: int = 0
    boundary_bytes: int = 0

    @property
    def compute_sets(self):
        return self.work.compute_sets

    @property
    def matmul_flops(self):
        return sum(self.work.matmul_flops.values())

    @property
    def vector_elements(self):
        return self.work.vector_elements

    @property
    def bytes_copied(self):
        return self.work.bytes_copied


@functools.lru_cache(maxsize=None)
def coefficients():
    """The fitted coefficients: ``{fit key: {entry: {metric: {term: coef}}}}`` (keys
    :func:`fit_key`)."""
    with open(WORK_FILE) as f:
        return json.load(f)


def fit_key(family, backward, dtype, grouped=False):
    """The key of one fit: ``"flash.forward.float16.mha"``, ``"naive.backward.float32"``...
    (``grouped``: grouped-query flash passes, whose graphs fold q's groups)."""
    key = f"{family}.{'backward' if backward else 'forward'}.{dtype}"
    return key + (".gqa" if grouped else ".mha") if family == "flash" else key


def price(records, key):
    """The fitted work of ``records``.

    Args:
        records: ``[(entry, {term: value})]`` (:func:`pass_records`).
        key: the fit (:func:`fit_key`).
    Returns:
        ``{metric: value}`` over :data:`METRICS`.
    """
    table = coefficients()[key]
    out = dict.fromkeys(METRICS, 0.0)
    for entry, terms in records:
        coef = table.get(entry, {})
        for metric, weights in coef.items():
            out[metric] += sum(w * terms.get(t, 0) for t, w in weights.items())
    return out


def pass_flops(sched, head_dim, groups, backward=False, segments=False):
    """Executed matmul FLOPs of one pass: 2 block matmuls forward, 5 backward (stash mode),
    2 FLOPs per multiply-add, over :func:`popxl_flash.plan.steps.executed_cells` (the
    schedule's executed count, the whole block for a pass of one block, the columns each q
    chunk sees for row passes)."""
    cells = (_steps.row_pass_cells(sched) if _steps.row_passes(sched, segments)
             else _steps.executed_cells(sched, segments))
    return 2 * (5 if backward else 2) * head_dim * groups * cells


def _step_terms(G, Gk, D, rows, cols, times=1):
    return {"1": times, "grc": times * G * rows * cols, "rc": times * rows * cols,
            "grd": times * G * rows * D, "gr": times * G * rows, "gkcd": times * Gk * cols * D}


def folds_scale(scale, head_dim):
    """Whether the softmax scale folds into k (a power of two of magnitude at most 1;
    ``None``: ``1/sqrt(D)``)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    mantissa, _ = math.frexp(abs(scale))
    return mantissa == 0.5 and abs(scale) <= 1.0


def pass_records(sched, *, head_dim, groups, kv_groups=None, backward=False, scale=None,
                 lean=False):
    """The parts of one pass with their shape terms (see the module docstring).

    Args:
        sched: the pass's :class:`popxl_flash.plan.schedule.BlockSchedule`.
        head_dim, groups, kv_groups: D, G and Gk (``None``: G).
        backward: the stash-mode backward pass. scale: the softmax scale (``None``: 1/sqrt(D)).
        lean: the pass's memory-lean structure (looped passes only; see
            :class:`popxl_flash.plan.config.AttentionConfig`).

    Returns:
        ``[(entry, {term: value})]``.
    """
    G, D = groups, head_dim
    Gk = G if kv_groups is None else kv_groups
    Lq, Lkv = sched.Lq, sched.Lkv
    folds = folds_scale(scale, D)
    lq_pad, lkv_pad = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    rows = _steps.row_passes(sched)
    if rows:  # the backward's row steps run on the unpadded tensors
        lq_pad, lkv_pad = Lq, Lkv
    pass_terms = {"1": 1, "gl": G * lq_pad, "gld": G * lq_pad * D, "gL": G * Lq,
                  "gLd": G * Lq * D, "gkld": Gk * lkv_pad * D, "gkLd": Gk * Lkv * D}
    out = []
    if rows and not backward:
        return _row_pass_records(sched, G, Gk, D, folds)
    if _steps.single_block(sched):  # no padding: the true lengths' terms only
        block = {"1": 1, "gL": G * Lq, "gLd": G * Lq * D, "gkLd": Gk * Lkv * D,
                 "gLL": G * Lq * Lkv}
        out.append(("single", block))
        if sched.num_empty_rows:  # the seen-rows constant [1, Lq, 1] and its selects
            out.append(("single_empty_rows", {**block, "L": Lq}))
        if not folds:  # the scores scaled, not k
            out.append(("single_unfolded", block))
        if sched.kind[0, 0] == _schedule.PARTIAL:  # the pattern [1, Lq, Lkv] and its where
            out.append(("single_masked", {**block, "LL": Lq * Lkv}))
        return out
    if sched.num_empty_rows:
        out.append(("empty_rows", pass_terms))
    out.append(("fixed", pass_terms))
    if not folds:  # no k * scale; the backward scales dq once
        out.append(("fixed_unfolded", pass_terms))
    if rows:
        return out + _row_step_records(sched, G, Gk, D, folds)
    if lean:
        out += _lean_records(sched, G, Gk, D, folds, backward, pass_terms)
    for g in ([] if lean and backward else
              _steps.step_groups(sched, "kv_major" if backward else "q_major")):
        terms = _step_terms(G, Gk, D, g.rows, g.cols, g.steps)
        inline = _steps.runs_inline(g)
        out.append(("inline_step" if inline else "step", terms))
        if not inline:
            out.append(("loop", _step_terms(G, Gk, D, g.rows, g.cols)))
        if not folds:
            out.append(("unfolded_step", terms))
        if g.masked:
            out.append(("masked_step", terms))
            if g.num_patterns > 1:
                out.append(("gathered_pattern", terms))
    for entry, (groups_, length, padded) in (("pad_kv", (Gk, Lkv, lkv_pad)),
                                             ("pad_q", (G, Lq, lq_pad))):
        if padded > length:  # the zero rows and the concat ([k; v]; q or [do; q] and stats)
            out.append((entry, {"1": 1, "ar": groups_ * padded, "ard": groups_ * padded * D}))
    return out


def _lean_records(sched, G, Gk, D, folds, backward, pass_terms):
    """The memory-lean structure's parts: the pass-level change (``lean``; ``lean_folded``
    where it no longer scales k once), its pieces (:func:`popxl_flash.plan.steps.lean_pieces`:
    per q piece, and backward per kv piece with its accumulator's elements ``gkpd``), each
    step's k scaling where the scale folds (``lean_scale_step``) and, backward, the steps run
    per kv piece (:func:`_lean_step_records`)."""
    out = [("lean", pass_terms)]
    if folds:
        out.append(("lean_folded", pass_terms))
    q_pieces = {"1": len(_steps.lean_pieces(sched.nq))}
    out.append(("lean_piece_q", q_pieces))
    if q_pieces["1"] > 1:  # the pieces' results joined (concat_: views)
        out.append(("lean_join_q", {"1": 1}))
    if backward and not folds:  # each piece of dq scaled
        out.append(("lean_piece_q_unfolded", q_pieces))
    if sched.num_empty_rows and not backward:  # each piece's selects of the empty rows
        out += [("lean_empty_rows", {"1": 1}), ("lean_piece_empty_rows", q_pieces)]
    if backward:
        pieces = _steps.lean_pieces(sched.nkv)
        rows = (pieces[0][1] - pieces[0][0]) * sched.chunk_kv
        out.append(("lean_piece_kv", {"1": len(pieces), "gkpd": len(pieces) * Gk * rows * D}))
        if len(pieces) > 1:
            out.append(("lean_join_kv", {"1": 1}))
        out += _lean_step_records(sched, G, Gk, D, folds)
    elif folds:
        for g in _steps.step_groups(sched, "q_major"):
            out.append(("lean_scale_step", _step_terms(G, Gk, D, g.rows, g.cols, g.steps)))
    return out


def _lean_step_records(sched, G, Gk, D, folds):
    """The lean backward's steps: per step group and kv piece, one step inline or a loop of
    the group's body (its step table one column wider, ``lean_step``)."""
    out = []
    for g in _steps.step_groups(sched, "kv_major"):
        for start, stop in _steps.lean_step_ranges(g, sched.nkv):
            n = stop - start
            if not n:
                continue
            terms = _step_terms(G, Gk, D, g.rows, g.cols, n)
            out.append(("inline_step" if n == 1 else "step", terms))
            if n > 1:
                out.append(("loop", _step_terms(G, Gk, D, g.rows, g.cols)))
                out.append(("lean_step", terms))
            if folds:
                out.append(("lean_scale_step", terms))
            else:
                out.append(("unfolded_step", terms))
            if g.masked:
                out.append(("masked_step", terms))
                if n > 1 and g.num_patterns > 1:
                    out.append(("gathered_pattern", terms))
    return out


def _row_step_records(sched, G, Gk, D, folds):
    """The backward's row steps: one inline step per q chunk that sees a key, on its
    ``rows x cols`` (masked with a pattern)."""
    out = []
    for rp in _steps.row_pass_plan(sched):
        rows, cols = rp.rows[1] - rp.rows[0], rp.cols[1] - rp.cols[0]
        if not cols:
            continue
        terms = _step_terms(G, Gk, D, rows, cols)
        out.append(("inline_step", terms))
        if not folds:
            out.append(("unfolded_step", terms))
        if rp.masked:
            out.append(("masked_step", terms))
    return out


def _row_pass_records(sched, G, Gk, D, folds):
    """A forward of row passes (:func:`popxl_flash.plan.steps.row_passes`): per pass with
    columns the one-block pass's ops on its ``rows x cols`` (masked with a pattern, the empty
    rows' selects where a row sees nothing, the scores' scale where it does not fold); then
    the call, ``k * scale`` and the concats of the results. A pass whose rows see nothing is
    constants."""
    out = [("row_passes", {"1": 1, "gkLd": Gk * sched.Lkv * D})]  # the results' concats
    # are the sum of the passes' rows: their terms are the passes' own
    if not folds:
        out.append(("row_passes_unfolded", {"1": 1, "gkLd": Gk * sched.Lkv * D}))
    for rp in _steps.row_pass_plan(sched):
        rows, cols = rp.rows[1] - rp.rows[0], rp.cols[1] - rp.cols[0]
        if not cols:
            out.append(("row_pass_empty", {"1": 1, "gL": G * rows, "gLd": G * rows * D}))
            continue
        terms = {"1": 1, "gLL": G * rows * cols, "gL": G * rows, "gLd": G * rows * D,
                 "gkLd": Gk * cols * D}
        out.append(("row_pass", terms))
        for entry, applies in (("row_pass_masked", rp.masked),
                               ("row_pass_empty_rows", not rp.all_seen),
                               ("row_pass_unfolded", not folds)):
            if applies:
                out.append((entry, terms))
    return out


def pass_counts(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, kv_groups=None,
                dtype="float16", causal=True, window=None, backward=False,
                scale=None, lean=False) -> PassCounts:
    """Predicted modelled work of one pass (see the module docstring).

    Args:
        Lq, Lkv: sequence lengths; chunk_q, chunk_kv: chunk lengths.
        head_dim, groups: D and G; kv_groups: Gk (``None``: G; grouped-query: a divisor of G).
        dtype: ``"float16"`` or ``"float32"``.
        causal, window: the mask (as :func:`popxl_flash.plan.schedule.plan`).
        backward: the stash-mode backward pass instead of the forward.
        scale: the softmax scale (``None``: ``1/sqrt(D)``); whether it folds into k (a power
            of two of magnitude at most 1) changes the counts.
        lean: the memory-lean structure (looped passes only, :func:`pass_records`).

    Returns:
        A :class:`PassCounts`.
    """
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=causal, window=window)
    G, D = groups, head_dim
    Gk = G if kv_groups is None else kv_groups
    records = pass_records(sched, head_dim=D, groups=G, kv_groups=Gk, backward=backward,
                           scale=scale, lean=lean)
    fitted = price(records, fit_key("flash", backward, dtype, Gk < G))
    rows_fwd = _steps.row_passes(sched) and not backward
    boundary = 0 if rows_fwd else sum(_costmodel.pass_copies(
        sched, groups=G, head_dim=D, dtype=dtype, backward=backward, kv_groups=Gk,
        lean=lean and not _steps.single_block(sched)).values())
    return PassCounts(work=work(fitted, dtype, pass_flops(sched, D, G, backward), boundary),
                      iterations=0 if rows_fwd else _steps.loop_steps(sched),
                      boundary_bytes=boundary)


def work(fitted, dtype, flops, boundary_bytes=0):
    """:class:`popxl_flash.ipu_model.WorkCounts` of a fitted ``{metric: value}`` plus matmul
    FLOPs (``dtype``'s) and boundary copies."""
    return _ipu_model.WorkCounts(
        compute_sets=fitted["compute_sets"], matmul_flops={dtype: flops},
        vector_work={k: fitted[k] for k in _lowering.RATE_KEYS if fitted[k]},
        bytes_copied=fitted["copied"] + boundary_bytes, ops=round(fitted["ops"]))
