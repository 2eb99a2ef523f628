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
import math
from dataclasses import dataclass

import numpy as np

from popxl_flash import provenance
from popxl_flash.backend import popxl
from popxl_flash.config import AttentionConfig, _check_int, check_bool, check_window
from popxl_flash.functional import (_GRAPH_CACHE_ATTR, _check_rank3, check_tensors,
                                    segmented_attention, segmented_attention_grad)

ops = popxl.ops

LAYOUTS = ("contiguous", "zigzag")

#: Longest automatic chunk (rows). Chunks divide the layout's pieces, so runtime skipping is
#: exact at block granularity and the zigzag layout's work is balanced.
CHUNK_TARGET = 128

#: Default budget of one round's gathered K/V: an eighth of one Mk2 IPU's In-Processor memory
#: (1472 tiles x 624 KiB), leaving the rest to the shards, the flash loop and the model.
DEFAULT_KV_BUDGET = 1472 * 624 * 1024 // 8


# -- host helpers ----------------------------------------------------------------------------
def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    return layout


def positions(length, replicas, layout="zigzag"):
    """Global row index of every replica's local rows.

    Args:
        length: sequence length L (divisible by R, by 2R for "zigzag").
        replicas: R. layout: "contiguous" or "zigzag".

    Returns:
        int32 ``[R, L / R]``: row ``r`` lists replica r's rows in local order.
    """
    _check_layout(layout)
    replicas = _check_int("replicas", replicas, low=1)
    length = _check_int("length", length, low=1)
    parts = replicas * (2 if layout == "zigzag" else 1)
    if length % parts:
        raise ValueError(f"the sequence length must be divisible by {parts} for layout "
                         f"{layout!r} with {replicas} replicas, got length={length}")
    rows = np.arange(length, dtype=np.int32).reshape(parts, length // parts)
    if layout == "contiguous":
        return rows
    return np.concatenate([rows[:replicas], rows[::-1][:replicas]], axis=1)


def shard(x, replicas, layout="zigzag", axis=1):
    """Lay a whole sequence out for the replicated host streams.

    Args:
        x: numpy array holding the sequence on ``axis`` (e.g. q ``[G, L, D]``, axis 1).
        replicas: R. layout: "contiguous" or "zigzag". axis: the sequence axis of ``x``.

    Returns:
        ``[R, *x.shape with L -> L / R]``: row r is replica r's shard (feed it to an h2d
        stream of the shard's shape).
    """
    x = np.asarray(x)
    axis = _axis(axis, x.ndim)
    table = positions(x.shape[axis], replicas, layout)
    return np.stack([np.take(x, rows, axis=axis) for rows in table])


def unshard(x, layout="zigzag", axis=1):
    """Inverse of :func:`shard`.

    Args:
        x: ``[R, ...]`` per-replica shards (e.g. a replicated d2h output).
        layout: the layout of the shards. axis: the sequence axis of one shard.

    Returns:
        The whole sequence, rows in order.
    """
    x = np.asarray(x)
    replicas = x.shape[0]
    axis = _axis(axis, x.ndim - 1)
    table = positions(x.shape[1 + axis] * replicas, replicas, layout)
    whole = np.concatenate(list(x), axis=axis)
    out = np.empty_like(whole)
    index = [slice(None)] * whole.ndim
    index[axis] = table.reshape(-1)
    out[tuple(index)] = whole
    return out


def _axis(axis, ndim):
    axis = _check_int("axis", axis, low=-ndim, high=ndim - 1)
    return axis + ndim if axis < 0 else axis


# -- planning --------------------------------------------------------------------------------
def _largest_divisor(n, limit):
    """Largest divisor of ``n`` that is at most ``limit``."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def choose_gather_steps(local_len, replicas, kv_groups, head_dim, itemsize,
                        budget=DEFAULT_KV_BUDGET):
    """Fewest K/V gather rounds whose gathered K and V fit ``budget`` bytes.

    Args:
        local_len: rows per replica (L / R). replicas: R. kv_groups: Gk. head_dim: D.
        itemsize: bytes per element. budget: bytes one round's gathered K and V may take.

    Returns:
        S, a divisor of ``local_len`` (``local_len`` if even single-row rounds exceed it).
    """
    for steps in range(1, local_len + 1):
        if local_len % steps == 0 and \
                2 * kv_groups * replicas * (local_len // steps) * head_dim * itemsize <= budget:
            return steps
    return local_len


class Plan:
    """The static facts of one context-parallel call (same on every replica).

    Attributes:
        replicas: R (the group size). layout, causal, scale, window: the options.
        local_len: rows per replica. steps: S gather rounds of ``piece = local_len / S``
            rows of each shard. num_chunks_q, num_chunks_kv: the flash call's chunk counts
            (over ``local_len`` q rows and ``R * piece`` gathered columns). table: int32
            ``[R, local_len]`` global positions (:func:`positions`).
    """

    def __init__(self, q_shape, kv_shape, dtype, *, replicas, layout, causal, scale, window,
                 steps, num_chunks_q, num_chunks_kv, budget):
        self.replicas, self.layout = replicas, _check_layout(layout)
        self.causal = check_bool("causal", causal)
        self.scale, self.window = scale, (None if window is None else check_window(window))
        self.q_shape, self.kv_shape, self.dtype = tuple(q_shape), tuple(kv_shape), dtype
        self.local_len = q_shape[1]
        self.table = positions(self.local_len * replicas, replicas, layout)
        self.itemsize = 2 if dtype == "float16" else 4
        budget = _check_int("kv_budget_bytes", budget, low=1)
        self.steps = (choose_gather_steps(self.local_len, replicas, kv_shape[0], kv_shape[2],
                                          self.itemsize, budget) if steps is None
                      else _check_int("kv_gather_steps", steps, low=1, high=self.local_len))
        if self.local_len % self.steps:
            raise ValueError(f"kv_gather_steps must divide the rows per replica "
                             f"({self.local_len}), got kv_gather_steps={self.steps}")
        self.piece = self.local_len // self.steps
        half = self.local_len // 2 if layout == "zigzag" else self.local_len
        self.num_chunks_q = num_chunks_q if num_chunks_q is not None else \
            self.local_len // _largest_divisor(half, CHUNK_TARGET)
        unit = math.gcd(self.piece, half)
        self.num_chunks_kv = num_chunks_kv if num_chunks_kv is not None else \
            replicas * self.piece // _largest_divisor(unit, CHUNK_TARGET)

    def flash_options(self):
        """Options of each round's flash call (positions carry causal and window)."""
        return dict(num_chunks_q=self.num_chunks_q, num_chunks_kv=self.num_chunks_kv,
                    causal=self.causal, scale=self.scale, window=self.window)

    def kv_positions(self, step):
        """int32 ``[1, R * piece]``: positions of round ``step``'s gathered columns."""
        cols = self.table[:, step * self.piece:(step + 1) * self.piece]
        return cols.reshape(1, -1)

    def key(self):
        """Hashable identity (graph cache key)."""
        return (self.replicas, self.layout, self.causal, self.scale, self.window, self.steps,
                self.num_chunks_q, self.num_chunks_kv, self.local_len)


# -- graph pieces ----------------------------------------------------------------------------
def replica_index(replicas, group=None):
    """The replica's rank in ``group`` as an int32 scalar tensor (``replicated_slice`` of
    ``arange(R)``: PopXL 3.4 has no replica-index op)."""
    return ops.collectives.replicated_slice(popxl.constant(np.arange(replicas, dtype=np.int32)),
                                            group=group)


def _q_positions(plan, group):
    """int32 ``[1, local_len]``: this replica's row of the position table."""
    idx = replica_index(plan.replicas, group).reshape((1,))
    return ops.dynamic_slice(popxl.constant(plan.table), idx, axes=[0], sizes=[1],
                             no_overlap=True)


def _gather_piece(t, plan, step, group):
    """Round ``step``'s rows of shard ``t [Gk, local_len, D]`` from every replica:
    ``[Gk, R * piece, D]`` in rank order."""
    piece = ops.slice(t, start=[step * plan.piece], stop=[(step + 1) * plan.piece], axis=[1])
    return ops.collectives.replicated_all_gather(piece, axis=1, group=group)


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


def _forward_rounds(q, k, v, plan, group):
    """``(out, lse)`` of one replica's rows over all rounds (out in q's dtype)."""
    q_ids, q_pos = _zeros_ids(plan.local_len), _q_positions(plan, group)
    acc = lse_acc = None
    for step in range(plan.steps):
        k_g, v_g = (_gather_piece(t, plan, step, group) for t in (k, v))
        kv_pos = popxl.constant(plan.kv_positions(step))
        out, lse = segmented_attention(q, k_g, v_g, q_ids, _zeros_ids(kv_pos.shape[1]), q_pos,
                                       kv_pos, **plan.flash_options())
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


def _backward_rounds(dout, q, k, v, out, lse, plan, group):
    """``(dq, dk, dv)`` of one replica (its rows of q, its shard of k and v)."""
    f32 = popxl.float32
    q_ids, q_pos = _zeros_ids(plan.local_len), _q_positions(plan, group)
    dq, dks, dvs = None, [], []
    for step in range(plan.steps):
        k_g, v_g = (_gather_piece(t, plan, step, group) for t in (k, v))
        kv_pos = popxl.constant(plan.kv_positions(step))
        dq_s, dk_s, dv_s = segmented_attention_grad(
            dout, q, k_g, v_g, out, lse, q_ids, _zeros_ids(kv_pos.shape[1]), q_pos, kv_pos,
            **plan.flash_options())
        dq_s = ops.cast(dq_s, f32)
        dq = dq_s if dq is None else dq + dq_s
        dks.append(_scatter_to_owners(ops.cast(dk_s, f32), plan, group))
        dvs.append(_scatter_to_owners(ops.cast(dv_s, f32), plan, group))
    dk = dks[0] if plan.steps == 1 else ops.concat(dks, axis=1)
    dv = dvs[0] if plan.steps == 1 else ops.concat(dvs, axis=1)
    return tuple(ops.cast(t, q.dtype) for t in (dq, dk, dv))


class ContextParallelAttention(popxl.Module):
    """Forward graph of one replica: ``build(q, k, v) -> (out, lse)`` (see the module
    docstring). Args: plan: :class:`Plan`. group: ReplicaGrouping or None."""

    def __init__(self, plan, group=None):
        self.plan, self.group = plan, group

    def build(self, q, k, v):
        return _forward_rounds(q, k, v, self.plan, self.group)


class ContextParallelAttentionGrad(popxl.Module):
    """Backward graph of one replica (stash mode): ``build(dout, q, k, v, out, lse) ->
    (dq, dk, dv)``."""

    def __init__(self, plan, group=None):
        self.plan, self.group = plan, group

    def build(self, dout, q, k, v, out, lse):
        return _backward_rounds(dout, q, k, v, out, lse, self.plan, self.group)


def _cached_graph(module, inputs, group):
    ir = popxl.gcg().ir
    cache = getattr(ir, _GRAPH_CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(ir, _GRAPH_CACHE_ATTR, cache)
    specs = tuple((tuple(t.shape), t.dtype.name) for t in inputs)
    groups = None if group is None else tuple(group.assignment)
    key = (type(module), module.plan.key(), groups, specs)
    if key not in cache:
        cache[key] = ir.create_graph(module, *inputs)
    return cache[key]


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


# -- cost per replica ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ContextParallelCost:
    """Exact per-replica figures of one context-parallel call (:func:`explain`).

    Attributes:
        plan: the :class:`Plan` (rounds ``steps``, ``piece``, chunk counts).
        chunk_q, chunk_kv: chunk lengths of each round's flash call.
        iterations: loop steps per replica and round (the static schedule: equal on all).
        blocks: per replica, the blocks its positions leave visible (all rounds).
        flops: per replica, the forward's executed matmul FLOPs (``4 G cq ckv D`` per
            visible block; the backward executes 2.5x that in stash mode).
        gathered_bytes: bytes each replica receives from the K/V all-gathers of one forward.
        scattered_bytes: bytes each replica receives from the backward's dk/dv
            reduce-scatters (float32), besides the backward's own all-gathers.
        kv_round_bytes: one round's gathered K and V (live while the round runs).
        shard_bytes: the replica's q, k, v and out shards.
    """
    plan: "Plan"
    chunk_q: int
    chunk_kv: int
    iterations: int
    blocks: tuple
    flops: tuple
    gathered_bytes: int
    scattered_bytes: int
    kv_round_bytes: int
    shard_bytes: int

    def table(self):
        """Returns: a text table, one row per replica."""
        p = self.plan
        lines = [f"R={p.replicas} layout={p.layout} rounds={p.steps} (piece {p.piece} rows) "
                 f"chunks q {p.num_chunks_q}x{self.chunk_q} kv {p.num_chunks_kv}x"
                 f"{self.chunk_kv}, {self.iterations} loop steps per round",
                 f"gathered K/V per round {self.kv_round_bytes / 2**20:.2f} MiB, shards "
                 f"{self.shard_bytes / 2**20:.2f} MiB",
                 "replica  blocks  fwd GFLOP  gathered MiB  scattered MiB"]
        for r, (b, f) in enumerate(zip(self.blocks, self.flops)):
            lines.append(f"{r:7d}  {b:6d}  {f / 1e9:9.3f}  {self.gathered_bytes / 2**20:12.2f}"
                         f"  {self.scattered_bytes / 2**20:13.2f}")
        return "\n".join(lines)


def _chunk_bounds(pos, chunk):
    """``(min, max)`` position of every chunk of a position row."""
    chunks = pos.reshape(-1, chunk)
    return chunks.min(axis=1), chunks.max(axis=1)


def _visible_blocks(plan, q_pos, kv_pos, chunk_q, chunk_kv):
    """Blocks of one round that runtime classification does not skip (one segment: the
    position tests of :func:`popxl_flash.segments.classify_blocks`)."""
    q_lo, q_hi = (a[:, None] for a in _chunk_bounds(q_pos, chunk_q))
    k_lo, k_hi = (a[None, :] for a in _chunk_bounds(kv_pos, chunk_kv))
    skip = np.zeros((q_lo.shape[0], k_lo.shape[1]), bool)
    left, right = plan.window if plan.window is not None else (-1, -1)
    if plan.causal:
        skip |= k_lo > q_hi
    if left >= 0:
        skip |= k_hi < q_lo - left
    if right >= 0:
        skip |= k_lo > q_hi + right
    return int((~skip).sum())


def explain(length, replicas, *, head_dim, groups=1, kv_groups=None, dtype="float16",
            causal=True, window=None, layout="zigzag", kv_gather_steps=None,
            kv_budget_bytes=DEFAULT_KV_BUDGET, num_chunks_q=None, num_chunks_kv=None):
    """Per-replica work, traffic and memory of :func:`context_parallel_attention`.

    Args:
        length: the whole sequence's length L. replicas: R (the group size).
        head_dim, groups, kv_groups, dtype: D, G, Gk (default G), "float16"/"float32".
        causal, window, layout, kv_gather_steps, kv_budget_bytes, num_chunks_q,
            num_chunks_kv: as :func:`context_parallel_attention`.

    Returns:
        :class:`ContextParallelCost` (``table()`` prints it).
    """
    replicas = _check_int("replicas", replicas, low=1)
    length = _check_int("length", length, low=1)
    if length % replicas:
        raise ValueError(f"length must be divisible by replicas={replicas}, got {length}")
    Gk = groups if kv_groups is None else kv_groups
    local = length // replicas
    plan = Plan((groups, local, head_dim), (Gk, local, head_dim), dtype, replicas=replicas,
                layout=layout, causal=causal, scale=None, window=window, steps=kv_gather_steps,
                num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                budget=kv_budget_bytes)
    chunk_q = -(-local // plan.num_chunks_q)
    chunk_kv = -(-replicas * plan.piece // plan.num_chunks_kv)
    if local % chunk_q or (replicas * plan.piece) % chunk_kv:
        raise ValueError("explain needs chunk counts that divide the lengths exactly")
    blocks = tuple(sum(_visible_blocks(plan, plan.table[r], plan.kv_positions(s)[0], chunk_q,
                                       chunk_kv) for s in range(plan.steps))
                   for r in range(replicas))
    piece_kv = Gk * plan.piece * head_dim
    return ContextParallelCost(
        plan=plan, chunk_q=chunk_q, chunk_kv=chunk_kv,
        iterations=plan.num_chunks_q * plan.num_chunks_kv, blocks=blocks,
        flops=tuple(4 * groups * chunk_q * chunk_kv * head_dim * b for b in blocks),
        gathered_bytes=plan.steps * 2 * (replicas - 1) * piece_kv * plan.itemsize,
        scattered_bytes=plan.steps * 2 * (replicas - 1) * piece_kv * 4,
        kv_round_bytes=2 * replicas * piece_kv * plan.itemsize,
        shard_bytes=(2 * groups + 2 * Gk) * local * head_dim * plan.itemsize)
