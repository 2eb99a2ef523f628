"""Predicted run-profile counts of one attention pass (host side, numpy only).

:func:`pass_counts` predicts what the emulator's run profile measures for one forward pass
(``flash_attention``) or one stash-mode backward pass (``flash_attention_grad``) without
segment ids or score modifiers: supersteps (executed ops other than pure views), matmul FLOPs,
vector elements (output elements of the executed ops other than views, matmuls, subgraph ops
and host IO; an in-place dynamic update counts its update), bytes copied at subgraph
boundaries and loop iterations (the emulator's ``RunProfile`` fields of those names; the
caller's ``ops.call`` of the module graph is part of the pass, host transfers are not).

The counts come from the planner's schedule (:mod:`popxl_flash.plan.schedule`) and its step
groups (:mod:`popxl_flash.plan.steps`) and from coefficients counted on this version's graphs
(``popxl_flash/graph/``): per step of a group (by pass, dtype and whether the group is masked),
per loop and per pass. Vector elements are coefficients times the step's or the pass's shape
terms:

* per step of a ``rows x cols`` sub-block: ``grc = G*rows*cols``, ``rc = rows*cols`` (a
  gathered pattern), ``grd = G*rows*D``, ``gr = G*rows``, ``gkcd = Gk*cols*D``, ``one = 1``
  (loop counters and table entries);
* per pass: ``gld = G*Lq_pad*D``, ``gl = G*Lq_pad`` on padded lengths (state, operands),
  ``gLd = G*Lq*D``, ``gL = G*Lq`` on the true lengths (results), ``gkld = Gk*Lkv_pad*D``,
  ``gkLd = Gk*Lkv*D``; padding adds the pad rows and the concatenated tensor.

Bytes copied are :func:`popxl_flash.plan.costmodel.pass_copies`'s; matmul FLOPs and
iterations the schedule's. The tests (``tests/test_counts.py``) hold supersteps, FLOPs, bytes
and iterations equal to the emulator's and vector elements within 3% over drawn shapes and
chunkings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from popxl_flash.plan import costmodel as _costmodel
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan import steps as _steps


@dataclass(frozen=True)
class PassCounts:
    """Predicted run-profile counts of one pass (see the module docstring).

    Attributes:
        supersteps: executed ops other than pure views.
        matmul_flops: executed matmul FLOPs (2 per multiply-add).
        vector_elements: output elements of the executed compute ops other than matmuls.
        bytes_copied: lowering copies at call, branch and loop boundaries.
        iterations: loop iterations (repeat-body executions).
    """

    supersteps: int
    matmul_flops: int
    vector_elements: int
    bytes_copied: int
    iterations: int


#: Per step of a looped group: ``supersteps`` and the vector-element coefficients of the step
#: terms (module docstring), by pass and dtype, unmasked, the scale folded into k. Forward: the
#: step table lookup (``one``: q row, kv row), the q, ``[k; v]`` and ``acc | l | m`` slices,
#: ``s - m`` and ``exp`` and the cast of P (``grc``; no cast in float32), the statistics,
#: ``alpha * (acc | l) + (P V | rowsum)`` and the new state's concats, its write, the counter
#: increment. Backward: the lookup, the ``[do; q]``, ``lse | Dvec``, ``[k; v]``, dq and
#: ``[dv; dk]`` slices, ``s - lse``, ``exp``, ``dP - Dvec``, ``P * (.)``, the ``[P; dS]``
#: concat and cast (``grc``), the two accumulations and writes, the counter increment.
STEP = {
    (False, "float16"): dict(supersteps=20, grc=3, gr=14, grd=7, gkcd=2, one=3),
    (False, "float32"): dict(supersteps=19, grc=2, gr=14, grd=7, gkcd=2, one=3),
    (True, "float16"): dict(supersteps=21, grc=8, gr=2, grd=5, gkcd=8, one=3),
    (True, "float32"): dict(supersteps=20, grc=6, gr=2, grd=5, gkcd=8, one=3),
}
#: Per step of a group of one step, run inline: no lookup, no counter, static slices (views).
INLINE_STEP = {
    (False, "float16"): dict(supersteps=15, grc=3, gr=12, grd=5),
    (False, "float32"): dict(supersteps=14, grc=2, gr=12, grd=5),
    (True, "float16"): dict(supersteps=14, grc=8, grd=2, gkcd=4),
    (True, "float32"): dict(supersteps=13, grc=6, grd=2, gkcd=4),
}
#: Added per step where the scale does not fold into k (``blocks.scale_folds``): the
#: scores' multiplication.
UNFOLDED_STEP = dict(supersteps=1, grc=1)
#: Added per step of a masked group: the ``where`` selects (2 forward, 1 backward).
MASKED = {False: dict(supersteps=2, grc=2), True: dict(supersteps=1, grc=1)}
#: Added per step of a group with more than one distinct pattern: its id in the step table
#: and the pattern's gather (one pattern is a constant of the body).
GATHER = dict(supersteps=1, rc=1, one=1)
#: Per loop: the ``repeat`` op (a superstep; its outputs are no vector work).
LOOP = dict(supersteps=1)
#: Per looped pass, without padding, the scale folded, no empty rows: ``supersteps`` (the
#: module's call included) and the vector elements of the pass terms. Forward: ``k * scale``,
#: the ``[k; v]`` stack, the ``acc | l | m`` initialisation, ``out = acc / l``, its cast and
#: ``lse = m + log(l)``. Backward: ``Dvec = rowsum(do * out)`` (casts, product, sum), ``k *
#: scale``, the ``[do; q]``, ``lse | Dvec`` and ``[k; v]`` stacks, the dq and ``[dv; dk]``
#: initialisation, the scale of dk and the three casts.
FIXED = {
    (False, "float16"): dict(supersteps=9, gkLd=3, gl=4, gld=2, gL=2, gLd=2),
    (False, "float32"): dict(supersteps=8, gkLd=3, gl=4, gld=2, gL=2, gLd=1),
    (True, "float16"): dict(supersteps=15, gLd=6, gL=3, gkLd=5, gld=1, gkld=3),
    (True, "float32"): dict(supersteps=10, gLd=3, gL=3, gkLd=3, gld=1, gkld=3),
}
#: A pass of one block (a straight line), the scale folded, no empty rows: forward ``k *
#: scale``, the two matmuls, ``logsumexp``, ``softmax`` and the cast of P; backward Dvec, ``k
#: * scale``, the five matmuls, ``s - lse``, ``exp``, ``dP - Dvec``, ``P * (.)``, the casts of
#: P and dS, the scale of dk and the three casts. Terms: ``gLL = G*Lq*Lkv`` and the pass terms.
SINGLE = {
    (False, "float16"): dict(supersteps=7, gkLd=1, gLL=2, gL=1),
    (False, "float32"): dict(supersteps=6, gkLd=1, gLL=1, gL=1),
    (True, "float16"): dict(supersteps=21, gLd=4, gL=1, gkLd=4, gLL=6),
    (True, "float32"): dict(supersteps=14, gLd=1, gL=1, gkLd=2, gLL=4),
}
#: Added to a forward pass of one block with a partial mask (the one ``where``) and with
#: empty rows (the selects of out and lse by a constant).
SINGLE_MASKED = dict(supersteps=1, gLL=1)
SINGLE_EMPTY_ROWS = dict(supersteps=2, gL=1, gLd=1)
#: Added per pass where the schedule has empty rows (q rows that see no key): forward the
#: ``l > 0`` test and the selects of ``l`` and ``lse``; backward the safe lse.
EMPTY_ROWS = {False: dict(supersteps=3, gL=3), True: dict(supersteps=2, gL=2)}


def pass_flops(sched, head_dim, groups, backward=False, segments=False):
    """Executed matmul FLOPs of one pass: 2 block matmuls forward, 5 backward (stash mode),
    2 FLOPs per multiply-add, over :func:`popxl_flash.plan.steps.executed_cells` (the
    schedule's executed count, the whole block for a pass of one block, the columns each q
    chunk sees for row passes)."""
    cells = (_steps.row_pass_cells(sched) if _steps.row_passes(sched, segments)
             else _steps.executed_cells(sched, segments))
    return 2 * (5 if backward else 2) * head_dim * groups * cells


def _dot(weights, terms):
    return sum(weights.get(name, 0) * value for name, value in terms.items())


def _pad(groups, length, padded, width):
    """``(supersteps, elements)`` of padding ``[groups, length, width]`` to ``padded`` rows:
    the zero rows (``init``) and the ``concat``."""
    if padded == length:
        return 0, 0
    return 2, groups * (padded - length) * width + groups * padded * width


def pass_counts(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, kv_groups=None,
                dtype="float16", causal=True, window=None, backward=False,
                scale=None) -> PassCounts:
    """Predicted run-profile counts of one pass (see the module docstring).

    Args:
        Lq, Lkv: sequence lengths; chunk_q, chunk_kv: chunk lengths.
        head_dim, groups: D and G; kv_groups: Gk (``None``: G; grouped-query: a divisor of G).
        dtype: ``"float16"`` or ``"float32"``.
        causal, window: the mask (as :func:`popxl_flash.plan.schedule.plan`).
        backward: the stash-mode backward pass instead of the forward.
        scale: the softmax scale (``None``: ``1/sqrt(D)``); whether it folds into k (a power
            of two of magnitude at most 1) changes the counts.

    Returns:
        A :class:`PassCounts`.
    """
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=causal, window=window)
    G, D = groups, head_dim
    Gk = G if kv_groups is None else kv_groups
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    mantissa, _ = math.frexp(abs(scale))
    folds = mantissa == 0.5 and abs(scale) <= 1.0
    lq_pad, lkv_pad = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    rows = _steps.row_passes(sched)
    if rows:  # the backward's row steps run on the unpadded tensors
        lq_pad, lkv_pad = Lq, Lkv
    pass_terms = dict(gl=G * lq_pad, gld=G * lq_pad * D, gL=G * Lq, gLd=G * Lq * D,
                      gkld=Gk * lkv_pad * D, gkLd=Gk * Lkv * D, gLL=G * Lq * Lkv)
    supersteps = elements = 0

    def add(weights, terms, times=1):
        nonlocal supersteps, elements
        supersteps += times * weights.get("supersteps", 0)
        elements += times * _dot(weights, terms)

    if rows and not backward:
        return _row_pass_counts(sched, G, Gk, D, dtype, folds)
    single = _steps.single_block(sched)
    if sched.num_empty_rows:
        add(SINGLE_EMPTY_ROWS if single and not backward else EMPTY_ROWS[backward], pass_terms)
    if single:
        add(SINGLE[backward, dtype], pass_terms)
        if not folds:  # the scores' multiplication instead of k's (and dq's scale)
            add(dict(supersteps=0, gLL=1, gkLd=-1), pass_terms)
            if backward:
                add(dict(supersteps=1, gLd=1), pass_terms)
        if sched.kind[0, 0] == _schedule.PARTIAL:
            block = dict(grc=G * Lq * Lkv, gLL=G * Lq * Lkv)
            add(MASKED[True] if backward else SINGLE_MASKED, block)
        return _result(sched, supersteps, elements, D, G, Gk, dtype, backward)
    add(FIXED[backward, dtype], pass_terms)
    if not folds:  # no k * scale; the backward scales dq once
        add(dict(supersteps=-1, gkLd=-1), pass_terms)
        if backward:
            add(dict(supersteps=1, gld=1), pass_terms)
    if rows:
        _row_steps(sched, add, G, Gk, D, dtype, folds)
        return _result(sched, supersteps, elements, D, G, Gk, dtype, backward)
    for g in _steps.step_groups(sched, "kv_major" if backward else "q_major"):
        terms = dict(grc=G * g.rows * g.cols, rc=g.rows * g.cols, grd=G * g.rows * D,
                     gr=G * g.rows, gkcd=Gk * g.cols * D, one=1)
        inline = _steps.runs_inline(g)
        add((INLINE_STEP if inline else STEP)[backward, dtype], terms, g.steps)
        if not inline:
            add(LOOP, terms)
        if not folds:
            add(UNFOLDED_STEP, terms, g.steps)
        if g.masked:
            add(MASKED[backward], terms, g.steps)
            if g.num_patterns > 1:
                add(GATHER, terms, g.steps)
    pads = [(2 * Gk, Lkv, lkv_pad, D)]  # [k; v]
    pads += [(2 * G, Lq, lq_pad, D), (G, Lq, lq_pad, 2)] if backward else [(G, Lq, lq_pad, D)]
    for pad in pads:
        s, e = _pad(*pad)
        supersteps += s
        elements += e
    return _result(sched, supersteps, elements, D, G, Gk, dtype, backward)


def _row_steps(sched, add, G, Gk, D, dtype, folds):
    """The backward's row steps: one :data:`INLINE_STEP` per q chunk that sees a key, on its
    ``rows x cols`` (:data:`MASKED` with a pattern)."""
    for rp in _steps.row_pass_plan(sched):
        rows, cols = rp.rows[1] - rp.rows[0], rp.cols[1] - rp.cols[0]
        if not cols:
            continue
        terms = dict(grc=G * rows * cols, rc=rows * cols, grd=G * rows * D, gr=G * rows,
                     gkcd=Gk * cols * D, one=1)
        add(INLINE_STEP[True, dtype], terms)
        if not folds:
            add(UNFOLDED_STEP, terms)
        if rp.masked:
            add(MASKED[True], terms)


def _row_pass_counts(sched, G, Gk, D, dtype, folds):
    """A forward of row passes (:func:`popxl_flash.plan.steps.row_passes`): per pass with
    columns the one-block pass's ops on its ``rows x cols`` (:data:`SINGLE` less the call and
    ``k * scale``, :data:`SINGLE_MASKED` with a pattern, :data:`SINGLE_EMPTY_ROWS` where a
    row sees nothing, the scores' scale where it does not fold); then the call, ``k * scale``
    and the two concats. A pass whose rows see nothing is two constants."""
    single = SINGLE[False, dtype]
    per_pass = dict(single, supersteps=single["supersteps"] - 2, gkLd=0)
    supersteps, elements = 1 + 2, G * sched.Lq * (D + 1)  # the call; the concats
    if folds:  # k * scale
        supersteps, elements = supersteps + 1, elements + Gk * sched.Lkv * D
    for rp in _steps.row_pass_plan(sched):
        rows, cols = rp.rows[1] - rp.rows[0], rp.cols[1] - rp.cols[0]
        if not cols:
            continue
        terms = dict(gLL=G * rows * cols, gL=G * rows, gLd=G * rows * D)
        for weights, applies in ((per_pass, True), (SINGLE_MASKED, rp.masked),
                                 (SINGLE_EMPTY_ROWS, not rp.all_seen),
                                 (dict(supersteps=1, gLL=1), not folds)):
            if applies:
                supersteps += weights["supersteps"]
                elements += _dot(weights, terms)
    return PassCounts(supersteps=supersteps, matmul_flops=pass_flops(sched, D, G),
                      vector_elements=int(elements), bytes_copied=0, iterations=0)


def _result(sched, supersteps, elements, D, G, Gk, dtype, backward):
    copied = sum(_costmodel.pass_copies(sched, groups=G, head_dim=D, dtype=dtype,
                                        backward=backward, kv_groups=Gk).values())
    return PassCounts(supersteps=int(supersteps), matmul_flops=int(pass_flops(sched, D, G,
                                                                              backward)),
                      vector_elements=int(elements), bytes_copied=int(copied),
                      iterations=_steps.loop_steps(sched))
