"""Context parallelism: one long sequence split across IPU replicas.

Each replica of a replicated ``popxl.Ir`` holds ``L / R`` rows of q, k and v (``R`` replicas
in the group). :func:`context_parallel_attention` gives every replica its rows of the
attention output over the *whole* sequence:

1. the replica's index comes from ``replicated_slice(constant(arange(R)))`` (PopXL 3.4 has
   no replica-index op), and selects the global positions of its rows (a constant table);
2. K/V reach every replica by ``replicated_all_gather``: whole (``kv_gather_steps=1``) or in
   ``S`` rounds of ``1/S`` of each shard, so only ``1/S`` of the gathered K/V is live at a
   time;
3. each round is a flash attention call with runtime positions
   (:func:`popxl_flash.functional.segmented_attention`): causal is ``kv_pos <= q_pos``, the
   window ``q_pos - left <= kv_pos <= q_pos + right``. The static block schedule is the same on
   every replica (equal trip counts); blocks a replica's positions make invisible are skipped
   at run time (no matmul);
4. rounds combine by their logsumexp, as flash's online softmax does.

The backward (:func:`context_parallel_attention_grad`) gathers K/V the same way, computes the
local dq and every gathered column's dk/dv, and sums those back to their owners with
``replicated_reduce_scatter`` (per round), in float32.

Layouts (``shard``/``unshard`` lay a host sequence out and back):

* ``"contiguous"``: replica r holds rows ``[r L/R, (r+1) L/R)``;
* ``"zigzag"``: the sequence is cut into ``2R`` chunks and replica r holds chunks ``r`` and
  ``2R-1-r``, which balances causal work (every replica sees ``2R-1`` full chunk pairs and two
  diagonal ones).
"""

from popxl_flash import functional, provenance
from popxl_flash.backend import popxl
from popxl_flash.config import AttentionConfig, check_bool
from popxl_flash.context_parallel_graphs import (ContextParallelAttention,
                                                 ContextParallelAttentionGrad, replica_index)
from popxl_flash.context_parallel_plan import (CHUNK_TARGET, DEFAULT_KV_BUDGET, LAYOUTS,
                                               ContextParallelCost, Plan, _check_layout,
                                               choose_gather_steps, explain, positions, shard,
                                               unshard)
from popxl_flash.functional import _check_rank3, check_tensors

ops = popxl.ops

__all__ = ["context_parallel_attention", "context_parallel_attention_grad", "shard", "unshard",
           "positions", "explain", "choose_gather_steps", "replica_index", "LAYOUTS",
           "CHUNK_TARGET", "DEFAULT_KV_BUDGET", "Plan", "ContextParallelCost",
           "ContextParallelAttention", "ContextParallelAttentionGrad"]


def _cached_graph(module, inputs, group):
    """The graph of ``module`` for ``inputs``' specs, once per Ir, plan and grouping
    (:func:`popxl_flash.functional._cached_graph`)."""
    groups = None if group is None else tuple(group.assignment)
    return functional._cached_graph(module, inputs, config=(module.plan.key(), groups))


# -- functional API ---------------------------------------------------------------------------
def _group_size(group):
    ir = popxl.gcg().ir
    if group is None:
        return ir.replication_factor
    size = getattr(group, "group_size", None)
    if size is None:
        raise TypeError(f"group must be None or a popxl.ReplicaGrouping "
                        f"(ir.replica_grouping(...)), got {type(group).__name__}")
    return int(size)


def _plan(q, k, v, options):
    """Validate the tensors and options (everything, before any scope opens: PopXL's
    ``name_scope`` is not exception-safe) and return ``(Plan, group)``."""
    check_tensors(q=q, k=k, v=v)
    _check_rank3(q=q, k=k, v=v)
    options = dict(options)
    flash = dict(causal=options["causal"], scale=options["scale"], window=options["window"])
    AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (q.dtype.name, k.dtype.name,
                                                            v.dtype.name),
                                num_chunks_q=1, num_chunks_kv=1, **flash)
    if q.shape[1] != k.shape[1]:
        raise ValueError("context parallelism splits one sequence: q and k must hold the same "
                         f"rows per replica, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    group = options.pop("group")
    replicas = _group_size(group)
    layout = _check_layout(options.pop("layout"))
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout 'zigzag' needs an even number of rows per replica (two "
                         f"chunks each), got q shape {tuple(q.shape)}")
    plan = Plan(q.shape, k.shape, q.dtype.name, replicas=replicas, layout=layout, **options)
    gathered = (k.shape[0], replicas * plan.piece, k.shape[2])
    AttentionConfig.from_shapes(q.shape, gathered, gathered, (q.dtype.name,) * 3,
                                num_chunks_q=plan.num_chunks_q,
                                num_chunks_kv=plan.num_chunks_kv, **flash)
    return plan, group


def context_parallel_attention(q, k, v, *, causal=True, layout="zigzag", group=None,
                               kv_gather_steps=None, kv_budget_bytes=DEFAULT_KV_BUDGET,
                               num_chunks_q=None, num_chunks_kv=None, scale=None, window=None,
                               return_lse=False):
    """Attention over a sequence split across replicas; call in a replicated graph.

    Args:
        q: ``[G, L/R, D]`` this replica's rows (float16 or float32), laid out by ``layout``
            (:func:`shard`). k, v: ``[Gk, L/R, D]`` the same rows of k and v (``G % Gk == 0``:
            grouped-query attention).
        causal: causal mask over the whole sequence's positions. Default True.
        layout: "zigzag" (default; balanced causal work) or "contiguous".
        group: ``None`` (all replicas) or a ``popxl.ReplicaGrouping``: each group is one
            sequence (context-parallel degree R = group size).
        kv_gather_steps: S rounds gathering ``1/S`` of each shard (S divides ``L/R``); ``None``
            picks the fewest rounds whose gathered K and V fit ``kv_budget_bytes``.
        kv_budget_bytes: the budget of one round's gathered K and V.
        num_chunks_q, num_chunks_kv: each round's flash chunk counts over the ``L/R`` q rows and
            the ``L / S`` gathered columns; ``None``: chunks of at most 128 rows that
            divide the layout's pieces.
        scale, window: as :func:`popxl_flash.flash_attention` (window on global positions).
        return_lse: also return the logsumexp.

    Returns:
        out ``[G, L/R, D]`` (this replica's rows), and with ``return_lse`` lse float32
        ``[G, L/R]``.
    """
    return_lse = check_bool("return_lse", return_lse)
    plan, group = _plan(q, k, v, dict(
        causal=causal, layout=layout, group=group, steps=kv_gather_steps,
        budget=kv_budget_bytes, num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
        scale=scale, window=window))
    module = ContextParallelAttention(plan, group)
    with popxl.name_scope("context_parallel_attention"):
        graph = _cached_graph(module, (q, k, v), group)
        out, lse = ops.call(graph, q, k, v)
    provenance.record_graph(graph, lambda: ContextParallelAttentionGrad(plan, group))
    return (out, lse) if return_lse else out


def context_parallel_attention_grad(dout, q, k, v, out=None, lse=None, *, causal=True,
                                    layout="zigzag", group=None, kv_gather_steps=None,
                                    kv_budget_bytes=DEFAULT_KV_BUDGET, num_chunks_q=None,
                                    num_chunks_kv=None, scale=None, window=None):
    """Gradients of :func:`context_parallel_attention` on this replica's rows and shard.

    Stash mode (``out`` and ``lse`` from the forward with ``return_lse=True``) or recompute
    mode (both ``None``: the forward runs first). Every round's dk/dv of the gathered columns
    is summed back to the replica owning them with ``replicated_reduce_scatter``.

    Args:
        dout: ``[G, L/R, D]``, q's dtype. q, k, v: the forward's inputs.
        out, lse: the forward's outputs, or both ``None``.
        causal, layout, group, scale, window: the forward's (they change the result).
        kv_gather_steps, kv_budget_bytes, num_chunks_q, num_chunks_kv: as
            :func:`context_parallel_attention`; they may differ from the forward's (the result
            does not depend on them beyond rounding).

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v.
    """
    check_tensors(dout=dout)
    if (out is None) != (lse is None):
        raise ValueError("out and lse must be given together (stash mode) or both be None "
                         f"(recompute mode), got out={out!r}, lse={lse!r}")
    options = dict(causal=causal, layout=layout, group=group, kv_gather_steps=kv_gather_steps,
                   kv_budget_bytes=kv_budget_bytes, num_chunks_q=num_chunks_q,
                   num_chunks_kv=num_chunks_kv, scale=scale, window=window)
    plan, group = _plan(q, k, v, dict(
        causal=causal, layout=layout, group=group, steps=kv_gather_steps,
        budget=kv_budget_bytes, num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
        scale=scale, window=window))
    if tuple(dout.shape) != tuple(q.shape) or dout.dtype != q.dtype:
        raise ValueError(f"dout must have q's shape {tuple(q.shape)} and dtype {q.dtype.name}, "
                         f"got {tuple(dout.shape)} {dout.dtype.name}")
    if out is None:
        out, lse = context_parallel_attention(q, k, v, return_lse=True, **options)
    check_tensors(out=out, lse=lse)
    module = ContextParallelAttentionGrad(plan, group)
    inputs = (dout, q, k, v, out, lse)
    with popxl.name_scope("context_parallel_attention_grad"):
        return ops.call(_cached_graph(module, inputs, group), *inputs)
