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
   (:func:`popxl_flash.api.functional.segmented_attention`): causal is ``kv_pos <= q_pos``, the
   window ``q_pos - left <= kv_pos <= q_pos + right``. The static block schedule is the same on
   every replica (equal trip counts); blocks a replica's positions make invisible are skipped
   at run time (no matmul). With the plan's split, per part of the rows only the calls some
   replica needs are built, and with per-replica step tables each replica loops only over the
   blocks it runs (:mod:`popxl_flash.plan.context_parallel`);
4. rounds combine by their logsumexp, as flash's online softmax does.

The rounds, chunks and split are chosen by modelled IPU time within ``memory_budget``
(:func:`popxl_flash.plan.context_parallel.explain` prints the figures).

Score modifiers (``softcap``, ``alibi_slopes``, ``score_mod``) act on each round's blocks
with the global positions, so ALiBi's ``-slope * |i - j|`` and a ``score_mod``'s ``q_idx``,
``kv_idx`` are those of the whole sequence (``Lq = Lkv = L``): the result is single-replica
flash attention's. So is dropout's: its keep mask is a hash of (seed, g, global row, global
column) (:mod:`popxl_flash.graph.score_mods`, keyed by the positions), single-replica flash's
mask whatever the replicas, rounds or chunks of forward and backward.

The backward (:func:`context_parallel_attention_grad`) gathers K/V the same way, computes the
local dq and every gathered column's dk/dv, and sums those back to their owners with
``replicated_reduce_scatter`` (per round), in float32.

Layouts (``shard``/``unshard`` lay a host sequence out and back):

* ``"contiguous"``: replica r holds rows ``[r L/R, (r+1) L/R)``;
* ``"zigzag"``: the sequence is cut into ``2R`` chunks and replica r holds chunks ``r`` and
  ``2R-1-r``, which balances causal work (every replica sees ``2R-1`` full chunk pairs and two
  diagonal ones).
"""

import inspect
import weakref

import numpy as np

from popxl_flash.api import functional, provenance

from popxl_flash.graph import score_mods
from popxl_flash.backend import popxl
from popxl_flash.plan.config import AttentionConfig, check_bool
from popxl_flash.api.context_parallel_graphs import (ContextParallelAttention,
                                                 ContextParallelAttentionGrad, _q_positions,
                                                 replica_index, round_mods)
from popxl_flash.plan.context_parallel import (CHUNK_TARGET, DEFAULT_KV_BUDGET, LAYOUTS,
                                               ContextParallelCost, Plan, _check_layout,
                                               choose_gather_steps, explain, positions, shard,
                                               unshard)
from popxl_flash.graph.forward import FlashAttention
from popxl_flash.api.flash_attn_interface import user_inputs
from popxl_flash.api.functional import _check_rank3, check_tensors, keyword_hints

ops = popxl.ops

__all__ = ["context_parallel_attention", "context_parallel_attention_grad", "shard", "unshard",
           "positions", "explain", "choose_gather_steps", "replica_index", "LAYOUTS",
           "CHUNK_TARGET", "DEFAULT_KV_BUDGET", "Plan", "ContextParallelCost",
           "ContextParallelAttention", "ContextParallelAttentionGrad"]


def _cached_graph(module, inputs, group):
    """The graph of ``module`` for ``inputs``' specs, once per Ir, plan and grouping
    (:func:`popxl_flash.api.functional._cached_graph`)."""
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


def _plan(q, k, v, options, modifiers, backward=False):
    """Validate the tensors, options and score modifiers (everything, before any scope opens:
    PopXL's ``name_scope`` is not exception-safe) and return ``(Plan, group, extras)``
    (``extras``: the modifier inputs the graphs take after their tensors)."""
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
    mods, extras = functional.modifier_inputs(**modifiers)
    group = options.pop("group")
    replicas = _group_size(group)
    layout = _check_layout(options.pop("layout"))
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout 'zigzag' needs an even number of rows per replica (two "
                         f"chunks each), got q shape {tuple(q.shape)}")
    plan = Plan(q.shape, k.shape, q.dtype.name, replicas=replicas, layout=layout, mods=mods,
                **options)
    functional.prebuild_score_mod(_round_config(q, k, plan, extras), backward=backward)
    return plan, group, extras


def _round_config(q, k, plan, extras):
    """The validated :class:`AttentionConfig` of one round's flash call (gathered K/V, the
    positions as segment inputs, the modifier inputs)."""
    spec = popxl.TensorSpec
    cols = plan.replicas * plan.piece
    kv = spec((k.shape[0], cols, k.shape[2]), k.dtype)
    q_ids, kv_ids = (spec((1, n), popxl.int32) for n in (plan.local_len, cols))
    module = FlashAttention(**plan.flash_options(), mods=round_mods(plan.mods))
    return module.config(q, kv, kv, q_ids, kv_ids, q_ids, kv_ids, *extras)


#: Why a ``flash_attention`` keyword is not taken here (any other one not in the signature
#: gets a generic message: :func:`_unsupported_hints`).
UNSUPPORTED_REASONS = {
    "q_segment_ids": "context parallelism splits one sequence across replicas; packed "
                     "sequences (segment ids) are not supported with context parallelism",
    "kv_segment_ids": "context parallelism splits one sequence across replicas; packed "
                      "sequences (segment ids) are not supported with context parallelism",
}


def _unsupported_hints(fn, flash_fn):
    """``{keyword: hint}``: the core API's hints and every keyword of ``flash_fn`` that ``fn``
    does not take (:func:`popxl_flash.api.functional.keyword_hints`)."""
    taken = set(inspect.signature(fn).parameters)
    hints = dict(functional.CORE_KEYWORD_HINTS)
    for name in inspect.signature(flash_fn).parameters:
        if name not in taken:
            hints[name] = UNSUPPORTED_REASONS.get(
                name, f"{flash_fn.__name__}'s {name}= is not supported with context "
                      "parallelism")
    return hints


def context_parallel_attention(q, k, v, *, causal=True, layout="zigzag", group=None,
                               kv_gather_steps=None, kv_budget_bytes=DEFAULT_KV_BUDGET,
                               num_chunks_q=None, num_chunks_kv=None, scale=None, window=None,
                               return_lse=False, softcap=0.0, alibi_slopes=None,
                               score_mod=None, score_mod_inputs=(), dropout=0.0, seed=None,
                               return_dropout_mask=False, memory_budget=None, split=None):
    """Attention over a sequence split across replicas; call in a replicated graph.

    Args:
        q: ``[G, L/R, D]`` this replica's rows (float16 or float32), laid out by ``layout``
            (:func:`shard`). k, v: ``[Gk, L/R, D]`` the same rows of k and v (``G % Gk == 0``:
            grouped-query attention).
        causal: causal mask over the whole sequence's positions. Default True.
        layout: "zigzag" (default; balanced causal work) or "contiguous".
        group: ``None`` (all replicas) or a ``popxl.ReplicaGrouping``: each group is one
            sequence (context-parallel degree R = group size).
        kv_gather_steps: S rounds gathering ``1/S`` of each shard (S divides ``L/R``); ``None``:
            chosen with the chunks (below) among the fewest rounds whose gathered K and V fit
            ``kv_budget_bytes``.
        kv_budget_bytes: the most one round's gathered K and V may take (a cap on the rounds
            tried).
        num_chunks_q, num_chunks_kv: the flash calls' chunk counts over the ``L/R`` q rows and
            the ``L / S`` gathered columns; ``None``: chosen, with ``kv_gather_steps`` and
            ``split`` where those are ``None``, as the least modelled forward + backward IPU
            time within ``memory_budget`` (:func:`popxl_flash.plan.context_parallel.explain`
            prints the candidates); the chunks tried divide the layout's pieces.
        memory_budget: bytes one replica may hold live beyond the call's own inputs and
            outputs (``None``: the default, per pass twice the replica's own inputs' and
            outputs' bytes plus 4 MiB, :func:`popxl_flash.plan.memory.default_budget`): one round's gathered K/V, the
            largest flash call's working set, the merge's or the gradients' float32
            accumulators (:func:`popxl_flash.plan.context_parallel.replica_bytes`). An
            explicit budget no plan meets raises ``ValueError``.
        split: cut each replica's rows into the layout's parts and build per (part, round)
            only what some replica sees (zigzag: see :mod:`popxl_flash.plan.context_parallel`);
            ``None``: by modelled time; score modifiers and dropout keep one part. The
            per-replica step tables are chosen with the rest (used wherever they drop a step
            when every setting is given).
        scale, window: as :func:`popxl_flash.flash_attention` (window on global positions).
        return_lse: also return the logsumexp.
        softcap, alibi_slopes, score_mod, score_mod_inputs: as
            :func:`popxl_flash.flash_attention` on the whole sequence (``Lq = Lkv = L``):
            ALiBi adds ``-slope[g] * |i - j|`` and ``score_mod`` gets ``q_idx``/``kv_idx``
            int32 ``[1, cq, 1]``/``[1, 1, ckv]`` holding global positions ``i``, ``j`` in the
            whole sequence (not local rows). ``alibi_slopes`` and ``score_mod_inputs`` are the
            same tensors on every replica.
        dropout, seed: as :func:`popxl_flash.flash_attention` (``seed`` the same uint32
            ``[2]`` tensor on every replica). The keep mask is single-replica
            :func:`popxl_flash.flash_attention`'s with this seed: a hash of (seed, g, global
            row, global column) alone, so a backward with any ``kv_gather_steps`` or chunks
            differentiates it.
        return_dropout_mask: also return this replica's keep mask, bool ``[G, L/R, L]`` (its
            rows; columns in whole-sequence order; the rows of flash_attention's mask at
            this replica's positions): O(L^2 / R), for tests at small sizes.

    Returns:
        out ``[G, L/R, D]`` (this replica's rows), and with ``return_lse`` lse float32
        ``[G, L/R]``; with ``return_dropout_mask``, the mask last.

    Raises:
        TypeError: a ``flash_attention`` keyword context parallelism does not support
            (segment ids), naming it.
    """
    return_lse = check_bool("return_lse", return_lse)
    return_mask = check_bool("return_dropout_mask", return_dropout_mask)
    modifiers = dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
                     score_mod_inputs=score_mod_inputs, dropout=dropout, seed=seed)
    plan, group, extras = _plan(q, k, v, dict(
        causal=causal, layout=layout, group=group, steps=kv_gather_steps,
        budget=kv_budget_bytes, num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
        scale=scale, window=window, memory_budget=memory_budget, split=split), modifiers)
    functional._check_mask_request(return_mask, plan.mods)
    module = ContextParallelAttention(plan, group)
    inputs = (q, k, v, *extras)
    with popxl.name_scope("context_parallel_attention"):
        graph = _cached_graph(module, inputs, group)
        out, lse = ops.call(graph, *inputs)
    _record(graph, plan, group, _round_config(q, k, plan, extras))
    _record_outputs(plan, user_inputs(modifiers), out, lse)
    result = (out, lse) if return_lse else (out,)
    if return_mask:
        with popxl.name_scope("context_parallel_attention_dropout_mask"):
            result += (_dropout_mask(q, k, plan, group, extras),)
    return result if len(result) > 1 else out


def _dropout_mask(q, k, plan, group, extras):
    """This replica's keep mask, bool ``[G, L/R, L]`` (columns in whole-sequence order): the
    keep hash at its rows' global positions and every column
    (:func:`popxl_flash.graph.score_mods.keep_at`), as the rounds' flash calls compute it."""
    rank = replica_index(plan.replicas, group)
    rows = _q_positions(plan, group, rank)
    cols = np.arange(plan.table.size)
    seed = extras[int(plan.mods.alibi)]  # order: slopes, seed, score_mod inputs
    return score_mods.keep_at(q.shape[0], seed, plan.mods.dropout, rows, cols)


#: Per Ir: the plan of the context-parallel forward that returned a tensor (by tensor id).
_OUTPUTS = weakref.WeakKeyDictionary()


def _record_outputs(plan, inputs, *tensors):
    """Record the forward's plan and run-time modifier inputs ``{name: tensor}`` for the
    tensors it returned."""
    known = _OUTPUTS.setdefault(tensors[0].ir, {})
    known.update({t.id: (plan, provenance.tensor_ids(inputs)) for t in tensors})


def _check_stash(plan, inputs, **stash):
    """Refuse an ``out``/``lse`` that a forward with another result key returned (other
    mask, layout or modifiers), or with other run-time modifier
    tensors than ``inputs`` (``{name: tensor}``: the slopes, seed and score_mod inputs, by
    identity). Only the very tensors :func:`context_parallel_attention` returned are known."""
    for name, t in stash.items():
        fwd, fwd_inputs = _OUTPUTS.get(t.ir, {}).get(t.id, (None, None))
        if fwd is None:
            continue
        if fwd.result_key() != plan.result_key():
            raise ValueError(
                f"{name} was produced by context_parallel_attention with other options than "
                "this context_parallel_attention_grad call; pass the forward's causal, layout, "
                "group, scale, window and score modifiers")
        record = provenance.ForwardRecord({}, None, api="context_parallel_attention",
                                          inputs=fwd_inputs)
        functional.check_stash_inputs(name, record, "context_parallel_attention_grad",
                                       provenance.tensor_ids(inputs))


def _record(graph, plan, group, round_config):
    """Record the forward graph for :func:`popxl_flash.api.autodiff` (its backward module). With
    score modifiers the record also holds a round's configuration (its ``mods``): autodiff
    then knows the inputs after q, k, v (slopes, score_mod inputs) take no gradient."""
    def grad():
        return ContextParallelAttentionGrad(plan, group)
    provenance.record_graph(graph, grad, None if plan.mods is None else round_config)


def context_parallel_attention_grad(dout, q, k, v, out=None, lse=None, *, causal=True,
                                    layout="zigzag", group=None, kv_gather_steps=None,
                                    kv_budget_bytes=DEFAULT_KV_BUDGET, num_chunks_q=None,
                                    num_chunks_kv=None, scale=None, window=None, softcap=0.0,
                                    alibi_slopes=None, score_mod=None, score_mod_inputs=(),
                                    dropout=0.0, seed=None, memory_budget=None, split=None):
    """Gradients of :func:`context_parallel_attention` on this replica's rows and shard.

    Stash mode (``out`` and ``lse`` from the forward with ``return_lse=True``) or recompute
    mode (both ``None``: the forward runs first). A stash the forward returned in this Ir is
    checked: other options or other run-time tensors (``alibi_slopes``, ``seed``,
    ``score_mod_inputs``, by identity) than the forward's raise ``ValueError`` naming the
    argument; for an ``out``/``lse`` from elsewhere (another op, a graph boundary, the host)
    that cannot be known. Every round's dk/dv of the gathered columns
    is summed back to the replica owning them with ``replicated_reduce_scatter``.

    Args:
        dout: ``[G, L/R, D]``, q's dtype. q, k, v: the forward's inputs.
        out, lse: the forward's outputs, or both ``None``.
        causal, layout, group, scale, window: the forward's (they change the result).
        softcap, alibi_slopes, score_mod, score_mod_inputs, dropout, seed: the forward's
            score modifiers (no gradient flows to the slopes or the score_mod inputs).
        kv_gather_steps, kv_budget_bytes, num_chunks_q, num_chunks_kv, memory_budget, split: as
            :func:`context_parallel_attention` (the backward's plan is chosen for forward and
            backward together, so equal arguments give the forward's); they may differ from
            the forward's, also with dropout (the result does not depend on them beyond
            rounding).

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v.
    """
    check_tensors(dout=dout)
    if (out is None) != (lse is None):
        raise ValueError("out and lse must be given together (stash mode) or both be None "
                         f"(recompute mode), got out={out!r}, lse={lse!r}")
    modifiers = dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
                     score_mod_inputs=score_mod_inputs, dropout=dropout, seed=seed)
    options = dict(causal=causal, layout=layout, group=group, kv_gather_steps=kv_gather_steps,
                   kv_budget_bytes=kv_budget_bytes, num_chunks_q=num_chunks_q,
                   num_chunks_kv=num_chunks_kv, scale=scale, window=window,
                   memory_budget=memory_budget, split=split)
    plan, group, extras = _plan(q, k, v, dict(
        causal=causal, layout=layout, group=group, steps=kv_gather_steps,
        budget=kv_budget_bytes, num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
        scale=scale, window=window, memory_budget=memory_budget, split=split), modifiers,
        backward=True)
    if tuple(dout.shape) != tuple(q.shape) or dout.dtype != q.dtype:
        raise ValueError(f"dout must have q's shape {tuple(q.shape)} and dtype {q.dtype.name}, "
                         f"got {tuple(dout.shape)} {dout.dtype.name}")
    if out is None:
        out, lse = context_parallel_attention(q, k, v, return_lse=True, **options, **modifiers)
    check_tensors(out=out, lse=lse)
    _check_stash(plan, user_inputs(modifiers), out=out, lse=lse)
    module = ContextParallelAttentionGrad(plan, group)
    inputs = (dout, q, k, v, out, lse, *extras)
    with popxl.name_scope("context_parallel_attention_grad"):
        return ops.call(_cached_graph(module, inputs, group), *inputs)


context_parallel_attention = keyword_hints(_unsupported_hints(
    context_parallel_attention, functional.flash_attention))(context_parallel_attention)
context_parallel_attention_grad = keyword_hints(_unsupported_hints(
    context_parallel_attention_grad, functional.flash_attention_grad))(
        context_parallel_attention_grad)
