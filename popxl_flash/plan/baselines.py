"""What a flash schedule is compared with: naive attention and the seed's chunk rule (numpy
only).

* **Naive attention** (:mod:`popxl_flash.checks.naive`: ``q k^T``, scale, mask, ``softmax``,
  ``P v``; its backward recomputes P): its counted work (:func:`naive_counts`, held to the
  emulator's profile by ``tests/test_memory_budget.py``) and memory
  (:func:`popxl_flash.plan.memory.naive_bytes`). Its forward returns no lse.
* **The seed's chunk rule** (the PopART op's demo: nanoGPT at L = 1024 with 4 x 4 chunks): chunks
  of :data:`SEED_CHUNK` rows on both axes (:func:`seed_chunks`).
"""
import math

#: The seed demo's chunk length (1024 rows in 4 chunks).
SEED_CHUNK = 256


def seed_chunks(Lq, Lkv):
    """``(chunk_q, chunk_kv)`` of the seed's rule: ``ceil(L / 256)`` balanced chunks."""
    return tuple(-(-L // math.ceil(L / SEED_CHUNK)) for L in (Lq, Lkv))


def naive_records(*, groups, q_len, kv_len, head_dim, masked):
    """The parts of naive attention's graph with their shape terms (the fitted family
    ``"naive"`` of :mod:`popxl_flash.plan.counts`).

    Returns:
        ``[(entry, {term: value})]``.
    """
    G, D = groups, head_dim
    terms = {"1": 1, "gLL": G * q_len * kv_len, "gLd": G * q_len * D, "gkLd": G * kv_len * D,
             "gL": G * q_len, "LL": q_len * kv_len}
    return [("naive", terms)] + ([("naive_masked", terms)] if masked else [])


def naive_counts(*, groups, q_len, kv_len, head_dim, dtype, masked, backward):
    """Modelled work of naive attention's forward (:mod:`popxl_flash.checks.naive`: ``q k^T``
    with an outplace transpose, as Graphcore's scripts write it, the scale, ``where`` (if
    masked), ``softmax``, the cast of P (float16), ``P v``), or of its hand-written backward
    given ``out`` (P recomputed, the four gradient matmuls, ``Dvec``, ``dS``, the scales and
    casts). The coefficients are fitted to the emulator's priced profile
    (``python -m popxl_flash.checks.fit_work``).

    Returns:
        :class:`~popxl_flash.plan.ipu_time.WorkCounts`.
    """
    from popxl_flash.plan import counts
    records = naive_records(groups=groups, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                            masked=masked)
    fitted = counts.price(records, counts.fit_key("naive", backward, dtype))
    scores = groups * q_len * kv_len
    return counts.work(fitted, dtype, (10 if backward else 4) * scores * head_dim)
