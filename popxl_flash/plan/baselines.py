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

from popxl_flash.plan.ipu_time import WorkCounts

#: The seed demo's chunk length (1024 rows in 4 chunks).
SEED_CHUNK = 256


def seed_chunks(Lq, Lkv):
    """``(chunk_q, chunk_kv)`` of the seed's rule: ``ceil(L / 256)`` balanced chunks."""
    return tuple(-(-L // math.ceil(L / SEED_CHUNK)) for L in (Lq, Lkv))


def naive_counts(*, groups, q_len, kv_len, head_dim, dtype, masked, backward):
    """Counted work of naive attention's forward, or of its hand-written backward given ``out``.

    Forward ops: matmul, scale, ``where`` (if masked), softmax, cast of P (float16), matmul.
    Backward: the forward's P (4 or 3 score-sized ops, the cast), the matmuls ``dV = P^T dO``,
    ``dP = dO V^T``, ``dQ = dS K``, ``dK = dS^T Q``, ``Dvec = rowsum(dO * O)`` (with casts to
    float32), ``dS = P * (dP - Dvec)`` and its cast, the two scale products and the casts of
    dq, dk, dv (float16).

    Returns:
        :class:`~popxl_flash.plan.ipu_time.WorkCounts`.
    """
    half = dtype == "float16"
    scores = groups * q_len * kv_len
    rows = groups * q_len * head_dim
    kv_rows = groups * kv_len * head_dim
    p_ops = 2 + masked + half  # scale, (where), softmax, (cast)
    if not backward:
        return WorkCounts(supersteps=2 + p_ops, matmul_flops=4 * scores * head_dim,
                          vector_elements=p_ops * scores)
    score_ops = p_ops + 2 + half  # sub, mul, (cast dS)
    vector = (score_ops * scores + (1 + 2 * half) * rows + groups * q_len  # Dvec sum
              + rows + kv_rows  # the two scale products
              + half * (rows + 2 * kv_rows))  # casts of dq, dk, dv
    supersteps = 5 + score_ops + (1 + 2 * half) + 1 + 2 + 3 * half
    return WorkCounts(supersteps=supersteps, matmul_flops=10 * scores * head_dim,
                      vector_elements=int(vector))
