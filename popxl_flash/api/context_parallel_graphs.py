"""Context parallelism, graph side: the PopXL graph code each replica runs.

``ContextParallelAttention`` (forward: replica index, K/V gathered per round, one flash call
with runtime positions per round, rounds merged by lse; with the plan's split, per part of the
rows the calls its rounds need: plain where every replica sees every pair, with positions
where it depends on the replica, none where no replica sees any) and
``ContextParallelAttentionGrad`` (backward: per round the flash backward on the gathered K/V,
dk/dv reduce-scattered to their owners). See :mod:`popxl_flash.api.context_parallel` for the
method.
"""
from dataclasses import replace

import numpy as np

from popxl_flash.backend import popxl
from popxl_flash.api.functional import (flash_attention, flash_attention_grad,
                                        segmented_attention, segmented_attention_grad)

ops = popxl.ops


def replica_index(replicas, group=None):
    """The replica's rank in ``group`` as an int32 scalar tensor (``replicated_slice`` of
    ``arange(R)``: PopXL 3.4 has no replica-index op)."""
    return ops.collectives.replicated_slice(popxl.constant(np.arange(replicas, dtype=np.int32)),
                                            group=group)


def _q_positions(plan, group, rank=None):
    """int32 ``[1, local_len]``: this replica's row of the position table."""
    rank = replica_index(plan.replicas, group) if rank is None else rank
    return _replica_row(plan.table, rank)


def _replica_row(table, rank):
    """Row ``rank`` of a per-replica constant ``table [R, ...]`` (one ``dynamic_slice``)."""
    row = ops.dynamic_slice(popxl.constant(table), rank.reshape((1,)), axes=[0], sizes=[1],
                            no_overlap=True)
    return row if row.shape[0] == 1 and len(table.shape) == 2 else row.reshape(table.shape[1:])


def _step_table(plan, part, step, rank):
    """This replica's run-time step table of the positions call of ``(part, step)``
    (:meth:`popxl_flash.plan.context_parallel.Plan.step_table`), or ``None``."""
    table = plan.tables.get((part, step))
    return None if table is None else _replica_row(table, rank)


def _gather_piece(t, plan, step, group):
    """Round ``step``'s rows of shard ``t [Gk, local_len, D]`` from every replica:
    ``[Gk, R * piece, D]`` in rank order."""
    piece = ops.slice(t, start=[step * plan.piece], stop=[(step + 1) * plan.piece], axis=[1])
    return ops.collectives.replicated_all_gather(piece, axis=1, group=group)


def round_mods(mods):
    """The score modifiers of the rounds' flash calls: ``mods`` with dropout's keep mask keyed
    by the calls' positions (``dropout_positions``), the global ones, so every replica, round
    and block computes single-replica flash's mask (:mod:`popxl_flash.graph.score_mods`)."""
    if mods is None or mods.dropout == 0:
        return mods
    return replace(mods, dropout_positions=True)


def _zeros_ids(length):
    return popxl.constant(np.zeros((1, length), np.int32))


#: Row slices the merge of two rounds' outputs works in (its float32 temporaries are 1/M of
#: the accumulator; the accumulator is updated in place).
MERGE_SLICES = 8


def _merge_weights(lse_a, lse_b):
    """Weights of two partial results over disjoint key sets, from their logsumexps.

    Args:
        lse_a, lse_b: float32 ``[G, L]`` (``-inf`` where a part sees nothing).

    Returns:
        ``(w_a, w_b, lse)``: weights ``[G, L, 1]`` (summing to 1 where a key is seen, 0
        elsewhere) and the merged lse. No infinity enters arithmetic (floating-point checks
        stay quiet).
    """
    big = popxl.constant(np.float32(-1e30))
    zero, one = popxl.constant(np.float32(0)), popxl.constant(np.float32(1))
    seen_a = ops.logical_not(ops.isinf(lse_a))
    seen_b = ops.logical_not(ops.isinf(lse_b))
    a = ops.where(seen_a, lse_a, big)
    b = ops.where(seen_b, lse_b, big)
    m = ops.maximum(a, b)
    e_a = ops.where(seen_a, ops.exp(a - m), zero)
    e_b = ops.where(seen_b, ops.exp(b - m), zero)
    seen = ops.logical_or(seen_a, seen_b)
    total = ops.where(seen, e_a + e_b, one)
    lse = ops.where(seen, m + ops.log(total), popxl.constant(np.float32(-np.inf)))
    shape = tuple(lse.shape) + (1,)
    return (e_a / total).reshape(shape), (e_b / total).reshape(shape), lse


def _merge(acc, lse_acc, out, lse):
    """Fold a round's ``(out, lse)`` into the float32 accumulator ``acc [G, L, D]`` in place,
    ``MERGE_SLICES`` row slices at a time.

    Returns:
        ``(acc, lse)``: the updated accumulator (an alias of ``acc``) and the merged lse.
    """
    w_a, w_b, lse = _merge_weights(lse_acc, lse)
    rows = acc.shape[1]
    step = -(-rows // min(MERGE_SLICES, rows))
    for start in range(0, rows, step):
        stop = min(rows, start + step)

        def part(t):
            return ops.slice(t, start=[start], stop=[stop], axis=[1])
        piece = part(acc) * part(w_a) + ops.cast(part(out), popxl.float32) * part(w_b)
        acc = ops.dynamic_update_(acc, popxl.constant(np.array([start], np.int32)), piece,
                                  axes=[1], sizes=[stop - start], no_overlap=True)
    return acc, lse


def _rows(t, rows):
    """Local rows ``rows = (start, stop)`` of ``t`` (axis 1): a view."""
    return ops.slice(t, start=[rows[0]], stop=[rows[1]], axis=[1])


def _call_forward(call, q, k_g, v_g, q_pos, kv_pos, plan, rank):
    """``(out, lse)`` of one :class:`~popxl_flash.plan.context_parallel.Call` of a split plan:
    a plain flash call (``"full"``: every pair visible on every replica) or one with run-time
    positions (``"mixed"``)."""
    q_p = _rows(q, call.rows)
    options = plan.call_options(call)
    if call.kind == "full":
        return flash_attention(q_p, k_g, v_g, return_lse=True, **options)
    n = call.rows[1] - call.rows[0]
    return segmented_attention(q_p, k_g, v_g, _zeros_ids(n), _zeros_ids(kv_pos.shape[1]),
                               _rows(q_pos, call.rows), kv_pos,
                               step_table=_step_table(plan, call.part, call.step, rank),
                               **options)


def _fold(acc, out, lse):
    """Fold a call's ``(out, lse)`` into a part's accumulated ``(acc, lse)`` (``None``: the
    first; float32 accumulation from the second on)."""
    if acc is None:
        return out, lse
    acc_t, lse_acc = acc
    if acc_t.dtype != popxl.float32:
        acc_t = ops.cast(acc_t, popxl.float32)
    return _merge(acc_t, lse_acc, out, lse)


def _split_forward(q, k, v, plan, group):
    """``(out, lse)`` of a split plan: per part the calls of its rounds merged by lse, the
    parts concatenated in local row order (pairs no replica sees have no call)."""
    rank = replica_index(plan.replicas, group)
    q_pos = _q_positions(plan, group, rank)
    results = [None] * len(plan.parts)
    for step in range(plan.steps):
        calls = [c for c in plan.calls if c.step == step]
        if not calls:
            continue
        k_g, v_g = (_gather_piece(t, plan, step, group) for t in (k, v))
        kv_pos = popxl.constant(plan.kv_positions(step))
        for call in calls:
            out, lse = _call_forward(call, q, k_g, v_g, q_pos, kv_pos, plan, rank)
            results[call.part] = _fold(results[call.part], out, lse)
    outs, lses = [], []
    for p, rows in enumerate(plan.parts):
        if results[p] is None:  # no replica sees anything from these rows
            n = rows[1] - rows[0]
            outs.append(ops.init((q.shape[0], n, q.shape[2]), q.dtype, init_type="zero"))
            lses.append(popxl.constant(np.full((q.shape[0], n), -np.inf, np.float32)))
            continue
        out, lse = results[p]
        outs.append(out if out.dtype == q.dtype else ops.cast(out, q.dtype))
        lses.append(lse)
    return ops.concat(outs, axis=1), ops.concat(lses, axis=1)


def _forward_rounds(q, k, v, plan, group, extras=()):
    """``(out, lse)`` of one replica's rows over all rounds (out in q's dtype); ``extras``:
    the score-modifier inputs (:func:`popxl_flash.api.functional.modifier_inputs`)."""
    if plan.split:
        return _split_forward(q, k, v, plan, group)
    rank = replica_index(plan.replicas, group)
    q_ids, q_pos = _zeros_ids(plan.local_len), _q_positions(plan, group, rank)
    acc = lse_acc = None
    for step in range(plan.steps):
        k_g, v_g = (_gather_piece(t, plan, step, group) for t in (k, v))
        kv_pos = popxl.constant(plan.kv_positions(step))
        out, lse = segmented_attention(q, k_g, v_g, q_ids, _zeros_ids(kv_pos.shape[1]), q_pos,
                                       kv_pos, mods=round_mods(plan.mods), extras=extras,
                                       step_table=_step_table(plan, 0, step, rank),
                                       **plan.flash_options())
        if plan.steps == 1:
            return out, lse
        if acc is None:
            acc, lse_acc = (out if out.dtype == popxl.float32 else
                            ops.cast(out, popxl.float32)), lse
        else:
            acc, lse_acc = _merge(acc, lse_acc, out, lse)
    return (acc if q.dtype == popxl.float32 else ops.cast(acc, q.dtype)), lse_acc


def _scatter_to_owners(grad, plan, group):
    """Sum ``grad [Gk, R * piece, D]`` (float32) over replicas; return the caller's own
    columns ``[Gk, piece, D]`` (replicated_reduce_scatter over the replica-major layout)."""
    Gk, _, D = grad.shape
    by_owner = grad.reshape((Gk, plan.replicas, plan.piece, D)).transpose((1, 0, 2, 3))
    mine = ops.collectives.replicated_reduce_scatter(by_owner, op="add", group=group)
    return mine.reshape((Gk, plan.piece, D))


def _split_backward(dout, q, k, v, out, lse, plan, group):
    """``(dq, dk, dv)`` of a split plan: per call the flash backward of its part's rows with
    the final ``out``/``lse`` rows, dq summed per part over rounds, dk/dv per round summed over
    parts and reduce-scattered to their owners."""
    f32 = popxl.float32
    rank = replica_index(plan.replicas, group)
    q_pos = _q_positions(plan, group, rank)
    dqs = [None] * len(plan.parts)
    dks, dvs = [], []
    Gk, D = k.shape[0], k.shape[2]
    for step in range(plan.steps):
        calls = [c for c in plan.calls if c.step == step]
        if not calls:  # no replica's rows see these columns
            zero = ops.init((Gk, plan.piece, D), f32, init_type="zero")
            dks.append(zero)
            dvs.append(ops.init((Gk, plan.piece, D), f32, init_type="zero"))
            continue
        k_g, v_g = (_gather_piece(t, plan, step, group) for t in (k, v))
        kv_pos = popxl.constant(plan.kv_positions(step))
        dk_s = dv_s = None
        for call in calls:
            parts = [_rows(t, call.rows) for t in (dout, q)]
            stash = [_rows(t, call.rows) for t in (out, lse)]
            options = plan.call_options(call)
            if call.kind == "full":
                dq_c, dk_c, dv_c = flash_attention_grad(parts[0], parts[1], k_g, v_g, *stash,
                                                        **options)
            else:
                n = call.rows[1] - call.rows[0]
                dq_c, dk_c, dv_c = segmented_attention_grad(
                    parts[0], parts[1], k_g, v_g, *stash, _zeros_ids(n),
                    _zeros_ids(kv_pos.shape[1]), _rows(q_pos, call.rows), kv_pos,
                    step_table=_step_table(plan, call.part, call.step, rank), **options)
            dq_c, dk_c, dv_c = (ops.cast(t, f32) for t in (dq_c, dk_c, dv_c))
            dqs[call.part] = dq_c if dqs[call.part] is None else dqs[call.part] + dq_c
            dk_s = dk_c if dk_s is None else dk_s + dk_c
            dv_s = dv_c if dv_s is None else dv_s + dv_c
        dks.append(_scatter_to_owners(dk_s, plan, group))
        dvs.append(_scatter_to_owners(dv_s, plan, group))
    parts = []
    for p, rows in enumerate(plan.parts):
        parts.append(dqs[p] if dqs[p] is not None else ops.init(
            (q.shape[0], rows[1] - rows[0], q.shape[2]), f32, init_type="zero"))
    dq = ops.concat(parts, axis=1)
    dk = dks[0] if plan.steps == 1 else ops.concat(dks, axis=1)
    dv = dvs[0] if plan.steps == 1 else ops.concat(dvs, axis=1)
    return tuple(ops.cast(t, q.dtype) for t in (dq, dk, dv))


def _backward_rounds(dout, q, k, v, out, lse, plan, group, extras=()):
    """``(dq, dk, dv)`` of one replica (its rows of q, its shard of k and v)."""
    if plan.split:
        return _split_backward(dout, q, k, v, out, lse, plan, group)
    f32 = popxl.float32
    rank = replica_index(plan.replicas, group)
    q_ids, q_pos = _zeros_ids(plan.local_len), _q_positions(plan, group, rank)
    dq, dks, dvs = None, [], []
    for step in range(plan.steps):
        k_g, v_g = (_gather_piece(t, plan, step, group) for t in (k, v))
        kv_pos = popxl.constant(plan.kv_positions(step))
        dq_s, dk_s, dv_s = segmented_attention_grad(
            dout, q, k_g, v_g, out, lse, q_ids, _zeros_ids(kv_pos.shape[1]), q_pos, kv_pos,
            mods=round_mods(plan.mods), extras=extras,
            step_table=_step_table(plan, 0, step, rank), **plan.flash_options())
        dq_s = ops.cast(dq_s, f32)
        dq = dq_s if dq is None else dq + dq_s
        dks.append(_scatter_to_owners(ops.cast(dk_s, f32), plan, group))
        dvs.append(_scatter_to_owners(ops.cast(dv_s, f32), plan, group))
    dk = dks[0] if plan.steps == 1 else ops.concat(dks, axis=1)
    dv = dvs[0] if plan.steps == 1 else ops.concat(dvs, axis=1)
    return tuple(ops.cast(t, q.dtype) for t in (dq, dk, dv))


class ContextParallelAttention(popxl.Module):
    """Forward graph of one replica: ``build(q, k, v, *extras) -> (out, lse)`` (see the module
    docstring; ``extras``: the score-modifier inputs of ``plan.mods``, as
    :class:`popxl_flash.FlashAttention` takes them). Args: plan: :class:`Plan`. group:
    ReplicaGrouping or None."""

    def __init__(self, plan, group=None):
        self.plan, self.group = plan, group

    def build(self, q, k, v, *extras):
        return _forward_rounds(q, k, v, self.plan, self.group, extras)


class ContextParallelAttentionGrad(popxl.Module):
    """Backward graph of one replica (stash mode): ``build(dout, q, k, v, out, lse, *extras)
    -> (dq, dk, dv)``."""

    def __init__(self, plan, group=None):
        self.plan, self.group = plan, group

    def build(self, dout, q, k, v, out, lse, *extras):
        return _backward_rounds(dout, q, k, v, out, lse, self.plan, self.group, extras)
