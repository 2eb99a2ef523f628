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


#: Per step of a group: ``supersteps`` and the vector-element coefficients of the step terms
#: (module docstring), by pass and dtype, unmasked. Forward: counter lookups (2 ``one``), the
#: q, k^T, v slices (``grd``, 2 ``gkcd``), the m, l, acc slices and writes (4 ``gr``, 2
#: ``grd``), the score scale, ``s - m``, ``exp`` and the cast of P (``grc``; no cast in
#: float32), the statistics (8 ``gr``), ``alpha * acc + P V`` (2 ``grd``), the counter
#: increment. Backward: counter lookups, the q, do, lse, Dvec, k, v^T, dq, dk, dv slices and
#: the three writes, the scale, ``s - lse``, ``exp``, the casts of P and dS (``grc``), ``dP -
#: Dvec``, ``P * (.)``, the three accumulations, the counter increment.
STEP = {
    (False, "float16"): dict(supersteps=28, grc=4, gr=12, grd=5, gkcd=2, one=3),
    (False, "float32"): dict(supersteps=27, grc=3, gr=12, grd=5, gkcd=2, one=3),
    (True, "float16"): dict(supersteps=30, grc=7, gr=2, grd=5, gkcd=8, one=3),
    (True, "float32"): dict(supersteps=28, grc=5, gr=2, grd=5, gkcd=8, one=3),
}
#: Added per step of a masked group: the pattern lookup and gather (``one``, ``rc``) and the
#: ``where`` selects (3 forward, 1 backward).
MASKED = {False: dict(supersteps=5, grc=3, rc=1, one=1),
          True: dict(supersteps=3, grc=1, rc=1, one=1)}
#: Per loop: the ``repeat`` op (a superstep; its outputs are no vector work).
LOOP = dict(supersteps=1)
#: Per pass, without padding: ``supersteps`` (the module's call included) and the vector
#: elements of the pass terms. Forward: the m, l, acc initialisation (3 ``gl``, ``gld``) and
#: the finalisation (``out = acc / l``, its cast, ``lse = m + log(l)`` and the selects of rows
#: that saw nothing). Backward: ``Dvec = rowsum(do * out)`` (casts, product, sum), the safe
#: lse (2 ``gL``), the dq, dk, dv initialisation, the scale of dq and dk and the three casts.
FIXED = {
    (False, "float16"): dict(supersteps=12, gl=3, gld=1, gL=5, gLd=2),
    (False, "float32"): dict(supersteps=11, gl=3, gld=1, gL=5, gLd=1),
    (True, "float16"): dict(supersteps=15, gLd=4, gL=3, gld=2, gkld=3, gkLd=2),
    (True, "float32"): dict(supersteps=10, gLd=1, gL=3, gld=2, gkld=3),
}


def _dot(weights, terms):
    return sum(weights.get(name, 0) * value for name, value in terms.items())


def _pad(groups, length, padded, width):
    """``(supersteps, elements)`` of padding ``[groups, length, width]`` to ``padded`` rows:
    the zero rows (``init``) and the ``concat``."""
    if padded == length:
        return 0, 0
    return 2, groups * (padded - length) * width + groups * padded * width


def pass_counts(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, kv_groups=None,
                dtype="float16", causal=True, window=None, backward=False) -> PassCounts:
    """Predicted run-profile counts of one pass (see the module docstring).

    Args:
        Lq, Lkv: sequence lengths; chunk_q, chunk_kv: chunk lengths.
        head_dim, groups: D and G; kv_groups: Gk (``None``: G; grouped-query: a divisor of G).
        dtype: ``"float16"`` or ``"float32"``.
        causal, window: the mask (as :func:`popxl_flash.plan.schedule.plan`).
        backward: the stash-mode backward pass instead of the forward.

    Returns:
        A :class:`PassCounts`.
    """
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=causal, window=window)
    G, D = groups, head_dim
    Gk = G if kv_groups is None else kv_groups
    lq_pad, lkv_pad = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    groups_ = _steps.step_groups(sched, "kv_major" if backward else "q_major")
    step, masked = STEP[backward, dtype], MASKED[backward]
    supersteps = 0
    elements = 0
    for g in groups_:
        terms = dict(grc=G * g.rows * g.cols, rc=g.rows * g.cols, grd=G * g.rows * D,
                     gr=G * g.rows, gkcd=Gk * g.cols * D, one=1)
        per_step = step["supersteps"] + (masked["supersteps"] if g.masked else 0)
        per_elements = _dot(step, terms) + (_dot(masked, terms) if g.masked else 0)
        supersteps += g.steps * per_step + LOOP["supersteps"]
        elements += g.steps * per_elements
    fixed = FIXED[backward, dtype]
    supersteps += fixed["supersteps"]
    elements += _dot(fixed, dict(gl=G * lq_pad, gld=G * lq_pad * D, gL=G * Lq, gLd=G * Lq * D,
                                 gkld=Gk * lkv_pad * D, gkLd=Gk * Lkv * D))
    pads = [(Gk, Lkv, lkv_pad, D)] * 2  # k, v
    pads += [(G, Lq, lq_pad, D)] * (2 if backward else 1)  # q (and do)
    pads += [(G, Lq, lq_pad, 1)] * (2 if backward else 0)  # lse, Dvec
    for pad in pads:
        s, e = _pad(*pad)
        supersteps += s
        elements += e
    flops = (sched.backward_flops if backward else sched.forward_flops)(D, G).executed
    copied = sum(_costmodel.pass_copies(sched, groups=G, head_dim=D, dtype=dtype,
                                        backward=backward, kv_groups=Gk).values())
    return PassCounts(supersteps=int(supersteps), matmul_flops=int(flops),
                      vector_elements=int(elements), bytes_copied=int(copied),
                      iterations=_steps.loop_steps(sched))
