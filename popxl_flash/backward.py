"""FlashAttention backward as a ``popxl.Module`` (FlashAttention-2 algorithm 2, stash mode).

PopART cannot differentiate ``ops.repeat``, so the gradient is written by hand. It recomputes
only the block probabilities from the stashed ``lse``; it never reruns the forward.

Graph structure::

    build(dout, q, k, v, out, lse)
      Dvec = rowsum(dout * out)                   [G, Lq]    float32, once
      pad everything to whole chunks
      repeat nkv x kv_body                         # outer loop: key/value chunks j
        k_j, v_j = dynamic_slice(k, j), dynamic_slice(v, j)
        repeat T x q_body                          # inner loop: the q chunks that visit j
          kind, pattern_id, i = tables[j, t]       # planner constants; T = max visits per j
          conditional(kind == FULL, full_block, passthrough)
          conditional(kind == PARTIAL, partial_block, passthrough)   # SKIP: no work
          dynamic_update_(dq, i, dq_i)             # by-ref accumulator, in place
        dynamic_update_(dk, j, dk_j), dynamic_update_(dv, j, dv_j)

Per visited block (5 matmuls; statistics and accumulators float32)::

    P    = exp(scale * q_i k_j^T - lse_i)          (masked to 0 in partial blocks)
    dv_j += P^T do_i
    dS   = P * (do_i v_j^T - Dvec_i)
    dq_i += scale * dS k_j
    dk_j += scale * dS^T q_i
"""
from popxl_flash import blocks
from popxl_flash.backend import popxl
from popxl_flash.config import AttentionConfig

ops = popxl.ops
ByRef = popxl.TensorByRef


def _mm(a, b):
    """float32-accumulated matmul of two input-dtype tensors."""
    f32 = blocks.float32()
    return ops.matmul(a, b, output_type=f32, partials_type=f32)


def grad_block_update(cfg, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j, visible=None):
    """One block of the backward.

    Args:
        cfg: the :class:`AttentionConfig`.
        dq_i: float32 ``[G, cq, D]``; dk_j, dv_j: float32 ``[G, ckv, D]`` accumulators.
        q_i, do_i: ``[G, cq, D]``; k_j, v_j: ``[G, ckv, D]`` in the input dtype.
        lse_i, dvec_i: float32 ``[G, cq, 1]``.
        visible: ``None`` (full block) or bool ``[1, cq, ckv]`` (partial block).

    Returns:
        Updated ``(dq_i, dk_j, dv_j)``.
    """
    f32 = blocks.float32()
    s = blocks.scores(cfg, q_i, k_j)  # [G, cq, ckv]
    if visible is None:
        p = ops.exp(s - lse_i)  # every row of a full block sees something: lse_i finite
    else:
        # Rows that see nothing have lse_i = -inf: subtract 0 there (s + inf would trap under
        # FP checks), and send masked cells to exp(MASKED_SCORE) = 0 exactly.
        seen = ops.greater(lse_i, blocks.scalar(blocks.MASKED_SCORE, f32))  # [G, cq, 1]
        lse_safe = ops.where(seen, lse_i, blocks.scalar(0.0, f32))
        x = ops.where(visible, s - lse_safe, blocks.scalar(blocks.MASKED_SCORE, f32))
        p = ops.exp(x)  # [G, cq, ckv]
    dv_j = dv_j + _mm(blocks.to_input_dtype(cfg, p).transpose((0, 2, 1)), do_i)  # [G, ckv, D]
    dp = _mm(do_i, v_j.transpose((0, 2, 1)))  # [G, cq, ckv]
    ds = blocks.to_input_dtype(cfg, p * (dp - dvec_i))  # [G, cq, ckv]
    dq_i = dq_i + _mm(ds, k_j) * cfg.scale  # [G, cq, D]
    dk_j = dk_j + _mm(ds.transpose((0, 2, 1)), q_i) * cfg.scale  # [G, ckv, D]
    return dq_i, dk_j, dv_j


def _q_body(cfg, block_graphs, t, dk_j, dv_j, j, k_j, v_j, q: ByRef, do: ByRef, lse: ByRef,
            dvec: ByRef, dq: ByRef):
    """Inner repeat body over the query chunks kv chunk ``j`` is visited by.

    Carried: iteration ``t [1]``, ``dk_j, dv_j [G, ckv, D]`` (float32). Invariant: ``j [1]``,
    ``k_j, v_j`` and, by reference, padded ``q, do``, ``lse, dvec [G, Lq_pad, 1]`` (read-only)
    and the float32 accumulator ``dq [G, Lq_pad, D]`` whose chunk ``i`` is updated in place.
    """
    cq = cfg.chunk_q
    # The chunk slices and the dq write-back run every iteration, skip blocks included: branch
    # graphs cannot take the full tensors by reference, and copying them in would cost more.
    tables = blocks.BlockTables(cfg.schedule.inner_loop("q"))
    full, partial, pattern_id, i = tables.lookup(j, t)  # i: the q chunk of iteration t
    q_i, do_i = blocks.chunk(q, i, cq), blocks.chunk(do, i, cq)  # [G, cq, D]
    lse_i, dvec_i = blocks.chunk(lse, i, cq), blocks.chunk(dvec, i, cq)  # [G, cq, 1]
    dq_i, dk_j, dv_j = block_graphs.step(full, partial, pattern_id,
                                         state=(blocks.chunk(dq, i, cq), dk_j, dv_j),
                                         operands=(q_i, do_i, lse_i, dvec_i, k_j, v_j))
    blocks.update_chunk_(dq, i, dq_i, cq)
    return t + 1, dk_j, dv_j


def _kv_body(cfg, q_graph, j, k: ByRef, v: ByRef, q: ByRef, do: ByRef, lse: ByRef, dvec: ByRef,
             dq: ByRef, dk: ByRef, dv: ByRef):
    """Outer repeat body over key/value chunks.

    Carried: ``j [1]``. Invariant, by reference: padded ``k, v, q, do, lse, dvec`` (read-only)
    and the float32 accumulators ``dq [G, Lq_pad, D]``, ``dk, dv [G, Lkv_pad, D]`` (chunk ``j``
    of dk, dv written in place).
    """
    ckv, f32 = cfg.chunk_kv, blocks.float32()
    k_j, v_j = blocks.chunk(k, j, ckv), blocks.chunk(v, j, ckv)  # [G, ckv, D]
    # One tensor per carried input: PopXL names repeat inputs after their parent tensor, so
    # one tensor given twice is an IR error.
    dk_0, dv_0 = (ops.init((cfg.groups, ckv, cfg.head_dim), f32, init_type="zero")
                  for _ in range(2))
    trips = cfg.schedule.inner_loop("q").trip_count
    _, dk_j, dv_j = ops.repeat(q_graph, trips, blocks.counter(0), dk_0, dv_0, j, k_j, v_j, q,
                               do, lse, dvec, dq)
    blocks.update_chunk_(dk, j, dk_j, ckv)
    blocks.update_chunk_(dv, j, dv_j, ckv)
    return j + 1


def _build_loop_graphs(cfg, k, v, q, do, lse, dvec):
    """Create the branch graphs, the q-loop graph and the kv-loop graph (from specs).

    Returns:
        The kv-loop body graph (inputs ``j, k, v, q, do, lse, dvec, dq, dk, dv``).
    """
    ir = popxl.gcg().ir
    G, D, cq, ckv = cfg.groups, cfg.head_dim, cfg.chunk_q, cfg.chunk_kv
    f32, dt, spec = blocks.float32(), q.dtype, popxl.TensorSpec
    state = [spec((G, cq, D), f32), spec((G, ckv, D), f32), spec((G, ckv, D), f32)]
    operands = [spec((G, cq, D), dt), spec((G, cq, D), dt), spec((G, cq, 1), f32),
                spec((G, cq, 1), f32), spec((G, ckv, D), dt), spec((G, ckv, D), dt)]
    block_graphs = blocks.BlockGraphs(cfg, grad_block_update, state, operands)
    counter = spec((1,), popxl.int32)
    dq_spec = spec((G, cfg.padded_q_len, D), f32)
    q_graph = ir.create_graph(_q_body, cfg, block_graphs, counter, state[1], state[2], counter,
                              operands[4], operands[5], q.spec, do.spec, lse.spec, dvec.spec,
                              dq_spec)
    dkv_spec = spec((G, cfg.padded_kv_len, D), f32)
    return ir.create_graph(_kv_body, cfg, q_graph, counter, k.spec, v.spec, q.spec, do.spec,
                           lse.spec, dvec.spec, dq_spec, dkv_spec, dkv_spec)


class FlashAttentionGrad(popxl.Module):
    """FlashAttention backward: ``build(dout, q, k, v, out, lse) -> (dq, dk, dv)``.

    Args (constructor): ``num_chunks_q``, ``num_chunks_kv``, ``causal``, ``scale``, ``window``;
    they must equal the forward's.

    ``build`` args:
        dout, q, out: ``[G, Lq, D]``; k, v: ``[G, Lkv, D]`` (one float dtype);
        lse: float32 ``[G, Lq]`` from :class:`popxl_flash.FlashAttention`.

    Returns:
        dq, dk, dv with the shapes and dtype of q, k, v.
    """

    def __init__(self, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                 window=None):
        self.options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window)

    def config(self, dout, q, k, v, out, lse) -> AttentionConfig:
        """Validate all six specs against the options."""
        cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape,
                                          (q.dtype.name, k.dtype.name, v.dtype.name),
                                          **self.options)
        for name, t in (("dout", dout), ("out", out)):
            cfg.check_like(name, t.shape, t.dtype.name, q.shape, cfg.dtype)
        cfg.check_like("lse", lse.shape, lse.dtype.name, (cfg.groups, cfg.q_len), "float32")
        return cfg

    def build(self, dout, q, k, v, out, lse):
        cfg = self.config(dout, q, k, v, out, lse)
        f32 = blocks.float32()
        G, Lq, D = cfg.groups, cfg.q_len, cfg.head_dim
        with popxl.in_sequence():  # the loops write dq/dk/dv in place: read them after
            # Dvec = rowsum(dO * O)  [G, Lq, 1] float32, computed once
            dvec = ops.sum(blocks.to_float32(dout) * blocks.to_float32(out), axis=-1,
                           keepdims=True)
            padded = [blocks.pad_rows(t, cfg.padded_q_len)
                      for t in (q, dout, lse.reshape((G, Lq, 1)), dvec)]
            k_pad, v_pad = (blocks.pad_rows(t, cfg.padded_kv_len) for t in (k, v))
            grads = [ops.init((G, n, D), f32, init_type="zero")
                     for n in (cfg.padded_q_len, cfg.padded_kv_len, cfg.padded_kv_len)]
            kv_graph = _build_loop_graphs(cfg, k_pad, v_pad, *padded)
            ops.repeat(kv_graph, cfg.num_chunks_kv, blocks.counter(0), k_pad, v_pad, *padded,
                       *grads)
            return tuple(blocks.to_input_dtype(cfg, blocks.unpad_rows(t, n))
                         for t, n in zip(grads, (Lq, cfg.kv_len, cfg.kv_len)))
