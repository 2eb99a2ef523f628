"""FlashAttention forward as a ``popxl.Module``: the seed's algorithm as PopXL graph code.

Graph structure (all static; the op count does not grow with L or the chunk counts)::

    build(q, k, v)                      # module graph
      pad q, k, v to whole chunks
      repeat nq x q_body                # outer loop: query chunks i
        q_i = dynamic_slice(q, i)
        repeat T x kv_body              # inner loop: the kv chunks q chunk i visits
          kind, pattern_id, j = tables[i, t]       # planner constants; T = max visits per i
          k_j, v_j = dynamic_slice(k, j), dynamic_slice(v, j)
          conditional(kind == FULL, full_block, passthrough)      # online-softmax update
          conditional(kind == PARTIAL, partial_block, passthrough) # same, with the mask pattern
                                                # a SKIP block takes both passthroughs: no work
        out_i = acc / l_i ; lse_i = m_i + log(l_i)
        dynamic_update_(out, i, out_i), dynamic_update_(lse, i, lse_i)  # by-ref, in place
      drop padding rows

Online softmax (FlashAttention algorithm 1, per block), statistics in float32::

    s     = scale * q_i k_j^T                  [G, cq, ckv]
    m_new = max(m_i, rowmax(s))                [G, cq, 1]
    p     = exp(s - m_new)                     [G, cq, ckv]
    alpha = exp(m_i - m_new)
    l_i   = alpha * l_i + rowsum(p)
    acc   = alpha * acc + p v_j                [G, cq, D]
"""
import numpy as np

from popxl_flash import blocks
from popxl_flash.backend import popxl
from popxl_flash.config import AttentionConfig

ops = popxl.ops
ByRef = popxl.TensorByRef


def online_softmax_update(cfg, m_i, l_i, acc, q_i, k_j, v_j, visible=None):
    """One block of the online softmax.

    Args:
        cfg: the :class:`AttentionConfig`.
        m_i, l_i: running max and sum, float32 ``[G, cq, 1]``.
        acc: output accumulator, float32 ``[G, cq, D]``.
        q_i: ``[G, cq, D]``; k_j, v_j: ``[G, ckv, D]`` in the input dtype.
        visible: ``None`` (full block) or bool ``[1, cq, ckv]`` mask pattern (partial block).

    Returns:
        Updated ``(m_i, l_i, acc)``.
    """
    f32 = blocks.float32()
    s = blocks.scores(cfg, q_i, k_j)  # [G, cq, ckv]
    s_max = s
    if visible is not None:
        s_max = ops.where(visible, s, blocks.scalar(blocks.MASKED_SCORE, f32))
    m_new = ops.maximum(m_i, ops.max(s_max, axis=-1, keepdims=True))  # [G, cq, 1]
    if visible is not None:
        # Masked cells enter the exp as m_new (exp(0), zeroed below): never MASKED_SCORE -
        # m_new, which overflows for scores beyond 2^103 and would trap under FP checks.
        s = ops.where(visible, s, m_new)
    p = ops.exp(s - m_new)  # [G, cq, ckv], <= 1
    if visible is not None:
        p = ops.where(visible, p, blocks.scalar(0.0, f32))
    # A row that has seen nothing yet (l_i == 0) has m_i == MASKED_SCORE: its alpha multiplies
    # zeros, so take exp(0) there instead of exp(MASKED_SCORE - m_new), which can overflow.
    seen = ops.greater(l_i, blocks.scalar(0.0, f32))  # [G, cq, 1]
    alpha = ops.exp(ops.where(seen, m_i, m_new) - m_new)  # [G, cq, 1]
    l_new = alpha * l_i + ops.sum(p, axis=-1, keepdims=True)
    p_in = blocks.to_input_dtype(cfg, p)
    pv = ops.matmul(p_in, v_j, output_type=f32, partials_type=f32)  # [G, cq, D]
    return m_new, l_new, alpha * acc + pv


def _kv_body(cfg, block_graphs, t, m_i, l_i, acc, i, q_i, k: ByRef, v: ByRef):
    """Inner repeat body over the key/value chunks q chunk ``i`` visits.

    Carried: iteration ``t [1]``, ``m_i``, ``l_i``, ``acc``. Invariant: ``i [1]``, ``q_i``,
    padded k, v (by reference: read-only, so the loop does not copy them).
    """
    tables = blocks.BlockTables(cfg.schedule.inner_loop("kv"))
    full, partial, pattern_id, j = tables.lookup(i, t)  # j: the kv chunk of iteration t
    k_j = blocks.chunk(k, j, cfg.chunk_kv)  # [G, ckv, D]
    v_j = blocks.chunk(v, j, cfg.chunk_kv)
    m_i, l_i, acc = block_graphs.step(full, partial, pattern_id, state=(m_i, l_i, acc),
                                      operands=(q_i, k_j, v_j))
    return t + 1, m_i, l_i, acc


def _finalise(cfg, m_i, l_i, acc):
    """``out_i = acc / l_i`` (0 where the row saw nothing) and ``lse_i = m_i + log(l_i)``.

    Returns:
        out_i ``[G, cq, D]`` in the input dtype and lse_i float32 ``[G, cq]`` (-inf where
        nothing was seen).
    """
    f32 = blocks.float32()
    seen = ops.greater(l_i, blocks.scalar(0.0, f32))  # [G, cq, 1]
    l_safe = ops.where(seen, l_i, blocks.scalar(1.0, f32))  # no x/0, no log(0)
    out_i = blocks.to_input_dtype(cfg, acc / l_safe)
    lse_i = ops.where(seen, m_i + ops.log(l_safe), blocks.scalar(-np.inf, f32))
    G, cq, _ = l_i.shape
    return out_i, lse_i.reshape((G, cq))


def _q_body(cfg, kv_graph, i, q: ByRef, k: ByRef, v: ByRef, out: ByRef, lse: ByRef):
    """Outer repeat body over query chunks.

    Carried: ``i [1]``. Invariant, by reference: padded q, k, v (read-only) and the results
    ``out [G, Lq_pad, D]``, ``lse [G, Lq_pad]``, whose chunk ``i`` is written in place.
    """
    G, D, cq = cfg.groups, cfg.head_dim, cfg.chunk_q
    f32 = blocks.float32()
    q_i = blocks.chunk(q, i, cq)  # [G, cq, D]
    m_i = popxl.constant(np.full((G, cq, 1), blocks.MASKED_SCORE, np.float32))
    l_i = ops.init((G, cq, 1), f32, init_type="zero")
    acc = ops.init((G, cq, D), f32, init_type="zero")
    trips = cfg.schedule.inner_loop("kv").trip_count
    _, m_i, l_i, acc = ops.repeat(kv_graph, trips, blocks.counter(0), m_i, l_i, acc, i, q_i, k, v)
    out_i, lse_i = _finalise(cfg, m_i, l_i, acc)
    blocks.update_chunk_(out, i, out_i, cq)
    blocks.update_chunk_(lse, i, lse_i, cq)
    return i + 1


class FlashAttention(popxl.Module):
    """FlashAttention forward: ``build(q, k, v) -> (out, lse)``.

    Args (constructor): ``num_chunks_q``, ``num_chunks_kv``, ``causal``, ``scale``, ``window`` as
    :func:`popxl_flash.flash_attention`.

    ``build`` args:
        q: ``[G, Lq, D]``; k, v: ``[G, Lkv, D]``; float16 or float32.

    Returns:
        out ``[G, Lq, D]`` in q's dtype and lse float32 ``[G, Lq]``.
    """

    def __init__(self, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                 window=None):
        self.options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window)

    def config(self, q, k, v) -> AttentionConfig:
        """Validate the inputs' specs against the options."""
        return AttentionConfig.from_shapes(q.shape, k.shape, v.shape,
                                           (q.dtype.name, k.dtype.name, v.dtype.name),
                                           **self.options)

    def build(self, q, k, v):
        cfg = self.config(q, k, v)
        G, D, f32 = cfg.groups, cfg.head_dim, blocks.float32()
        with popxl.in_sequence():  # the q loop writes out/lse in place: read them after it
            q_pad = blocks.pad_rows(q, cfg.padded_q_len)
            k_pad = blocks.pad_rows(k, cfg.padded_kv_len)
            v_pad = blocks.pad_rows(v, cfg.padded_kv_len)
            out = ops.init((G, cfg.padded_q_len, D), q.dtype, init_type="zero")
            lse = ops.init((G, cfg.padded_q_len), f32, init_type="zero")
            q_graph = build_q_loop_graph(cfg, q_pad, k_pad, v_pad)
            ops.repeat(q_graph, cfg.num_chunks_q, blocks.counter(0), q_pad, k_pad, v_pad, out,
                       lse)
            return blocks.unpad_rows(out, cfg.q_len), blocks.unpad_rows(lse, cfg.q_len)


def build_q_loop_graph(cfg, q_pad, k_pad, v_pad):
    """Create the block-branch graphs, the kv-loop graph and the q-loop graph.

    Args:
        cfg: the :class:`AttentionConfig`.
        q_pad, k_pad, v_pad: padded inputs (only their specs are used).

    Returns:
        The q-loop body graph (inputs ``i, q, k, v, out, lse``).
    """
    ir = popxl.gcg().ir
    G, D, cq, ckv = cfg.groups, cfg.head_dim, cfg.chunk_q, cfg.chunk_kv
    f32, dt, spec = blocks.float32(), q_pad.dtype, popxl.TensorSpec
    state = [spec((G, cq, 1), f32), spec((G, cq, 1), f32), spec((G, cq, D), f32)]
    operands = [spec((G, cq, D), dt), spec((G, ckv, D), dt), spec((G, ckv, D), dt)]
    block_graphs = blocks.BlockGraphs(cfg, online_softmax_update, state, operands)
    counter = spec((1,), popxl.int32)
    kv_graph = ir.create_graph(_kv_body, cfg, block_graphs, counter, *state, counter,
                               operands[0], k_pad.spec, v_pad.spec)
    return ir.create_graph(_q_body, cfg, kv_graph, counter, q_pad.spec, k_pad.spec, v_pad.spec,
                           spec((G, cfg.padded_q_len, D), dt), spec((G, cfg.padded_q_len), f32))
