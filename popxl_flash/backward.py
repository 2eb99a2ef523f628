"""FlashAttention backward as a ``popxl.Module`` (FlashAttention-2 algorithm 2, stash mode).

PopART cannot differentiate ``ops.repeat``, so the gradient is written by hand. It recomputes
only the block probabilities from the stashed ``lse``; it never reruns the forward.

Graph structure::

    build(dout, q, k, v, out, lse)
      Dvec = rowsum(dout * out)                   [G, Lq]    float32, once
      pad everything to whole chunks
      repeat nkv x kv_body                         # outer loop: key/value chunks j
        k_j, v_j = dynamic_slice(k, j), dynamic_slice(v, j)
        repeat nq x q_body                         # inner loop: query chunks i
          conditional(kind != SKIP,
            conditional(kind == PARTIAL, partial_block, full_block),
            skip_block)
          dq = dynamic_update(dq, i, dq_i)
        dk, dv = dynamic_update(dk, j, dk_j), dynamic_update(dv, j, dv_j)

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
    p = ops.exp(blocks.scores(cfg, q_i, k_j) - lse_i)  # [G, cq, ckv]
    if visible is not None:
        p = ops.where(visible, p, blocks.scalar(0.0, f32))
    dv_j = dv_j + _mm(blocks.to_input_dtype(cfg, p).transpose((0, 2, 1)), do_i)  # [G, ckv, D]
    dp = _mm(do_i, v_j.transpose((0, 2, 1)))  # [G, cq, ckv]
    ds = blocks.to_input_dtype(cfg, p * (dp - dvec_i))  # [G, cq, ckv]
    dq_i = dq_i + _mm(ds, k_j) * cfg.scale  # [G, cq, D]
    dk_j = dk_j + _mm(ds.transpose((0, 2, 1)), q_i) * cfg.scale  # [G, ckv, D]
    return dq_i, dk_j, dv_j


def _full_block(cfg, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j):
    """Branch graph body: a fully visible block."""
    return grad_block_update(cfg, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j)


def _partial_block(cfg, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j, pattern_id):
    """Branch graph body: a block masked by its deduplicated pattern."""
    visible = blocks.block_mask(cfg.schedule, pattern_id)
    return grad_block_update(cfg, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j, visible)


def _skip_block(dq_i, dk_j, dv_j):
    """Branch graph body: nothing visible, no work."""
    return dq_i, dk_j, dv_j


def _visit_block(graphs, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j, partial,
                 pattern_id):
    """Branch graph body: a visited block, full or partial."""
    args = [dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j]
    if graphs["partial"] is None:
        return ops.call(graphs["full"], *args)
    return ops.conditional(partial, graphs["partial"], graphs["full"],
                           then_inputs=args + [pattern_id], else_inputs=args)


def _q_body(cfg, graphs, i, dq, dk_j, dv_j, j, k_j, v_j, q, do, lse, dvec):
    """Inner repeat body over query chunks.

    Carried: ``i [1]``, ``dq [G, Lq_pad, D]``, ``dk_j, dv_j [G, ckv, D]`` (float32).
    Invariant: ``j [1]``, ``k_j, v_j``, padded ``q, do`` and ``lse, dvec [G, Lq_pad, 1]``.
    """
    cq = cfg.chunk_q
    visit, partial, pattern_id = blocks.BlockTables(cfg.schedule).lookup(i, j)
    q_i, do_i = blocks.chunk(q, i, cq), blocks.chunk(do, i, cq)  # [G, cq, D]
    lse_i, dvec_i = blocks.chunk(lse, i, cq), blocks.chunk(dvec, i, cq)  # [G, cq, 1]
    dq_i = blocks.chunk(dq, i, cq)
    dq_i, dk_j, dv_j = ops.conditional(
        visit, graphs["visit"], graphs["skip"],
        then_inputs=[dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j, partial, pattern_id],
        else_inputs=[dq_i, dk_j, dv_j])
    return i + 1, blocks.update_chunk(dq, i, dq_i, cq), dk_j, dv_j


def _kv_body(cfg, q_graph, j, dq, dk, dv, k, v, q, do, lse, dvec):
    """Outer repeat body over key/value chunks.

    Carried: ``j [1]``, ``dq [G, Lq_pad, D]``, ``dk, dv [G, Lkv_pad, D]`` (float32).
    Invariant: padded ``k, v, q, do, lse, dvec``.
    """
    ckv, f32 = cfg.chunk_kv, blocks.float32()
    k_j, v_j = blocks.chunk(k, j, ckv), blocks.chunk(v, j, ckv)  # [G, ckv, D]
    zeros = ops.init((cfg.groups, ckv, cfg.head_dim), f32, init_type="zero")
    _, dq, dk_j, dv_j = ops.repeat(q_graph, cfg.num_chunks_q, blocks.counter(0), dq, zeros,
                                   zeros, j, k_j, v_j, q, do, lse, dvec)
    dk = blocks.update_chunk(dk, j, dk_j, ckv)
    dv = blocks.update_chunk(dv, j, dv_j, ckv)
    return j + 1, dq, dk, dv


def _build_loop_graphs(cfg, k, v, q, do, lse, dvec):
    """Create the branch graphs, the q-loop graph and the kv-loop graph (from specs).

    Returns:
        The kv-loop body graph (inputs ``j, dq, dk, dv, k, v, q, do, lse, dvec``).
    """
    ir = popxl.gcg().ir
    G, D, cq, ckv = cfg.groups, cfg.head_dim, cfg.chunk_q, cfg.chunk_kv
    f32, dt, spec = blocks.float32(), q.dtype, popxl.TensorSpec
    accs = [spec((G, cq, D), f32), spec((G, ckv, D), f32), spec((G, ckv, D), f32)]
    block_in = accs + [spec((G, cq, D), dt), spec((G, cq, D), dt), spec((G, cq, 1), f32),
                       spec((G, cq, 1), f32), spec((G, ckv, D), dt), spec((G, ckv, D), dt)]
    counter = spec((1,), popxl.int32)
    graphs = {"skip": ir.create_graph(_skip_block, *accs),
              "full": ir.create_graph(_full_block, cfg, *block_in), "partial": None}
    if cfg.schedule.partial_blocks:
        graphs["partial"] = ir.create_graph(_partial_block, cfg, *block_in, counter)
    graphs["visit"] = ir.create_graph(_visit_block, graphs, *block_in,
                                      spec((), popxl.bool), counter)
    dq_spec = spec((G, cfg.padded_q_len, D), f32)
    q_graph = ir.create_graph(_q_body, cfg, graphs, counter, dq_spec, accs[1], accs[2], counter,
                              spec((G, ckv, D), dt), spec((G, ckv, D), dt),
                              q.spec, do.spec, lse.spec, dvec.spec)
    dkv_spec = spec((G, cfg.padded_kv_len, D), f32)
    return ir.create_graph(_kv_body, cfg, q_graph, counter, dq_spec, dkv_spec, dkv_spec,
                           k.spec, v.spec, q.spec, do.spec, lse.spec, dvec.spec)


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
        G, Lq = cfg.groups, cfg.q_len
        # Dvec = rowsum(dO * O)  [G, Lq, 1] float32, computed once
        dvec = ops.sum(blocks.to_float32(dout) * blocks.to_float32(out), axis=-1, keepdims=True)
        padded = [blocks.pad_rows(t, cfg.padded_q_len)
                  for t in (q, dout, lse.reshape((G, Lq, 1)), dvec)]
        k_pad, v_pad = (blocks.pad_rows(t, cfg.padded_kv_len) for t in (k, v))
        kv_graph = _build_loop_graphs(cfg, k_pad, v_pad, *padded)
        D = cfg.head_dim
        dq = ops.init((G, cfg.padded_q_len, D), f32, init_type="zero")
        dk = ops.init((G, cfg.padded_kv_len, D), f32, init_type="zero")
        dv = ops.init((G, cfg.padded_kv_len, D), f32, init_type="zero")
        _, dq, dk, dv = ops.repeat(kv_graph, cfg.num_chunks_kv, blocks.counter(0), dq, dk, dv,
                                   k_pad, v_pad, *padded)
        return tuple(blocks.to_input_dtype(cfg, blocks.unpad_rows(t, n))
                     for t, n in ((dq, Lq), (dk, cfg.kv_len), (dv, cfg.kv_len)))
