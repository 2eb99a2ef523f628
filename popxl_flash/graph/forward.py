"""FlashAttention forward as a ``popxl.Module``: the seed's algorithm as PopXL graph code.

Graph structure (all static; the op count does not grow with L or the chunk counts)::

    build(q, k, v)                          # module graph
      pad q, k, v to whole chunks; k_t = k^T [Gk, D, Lkv_pad]
      m = MASKED_SCORE, l = 0, acc = 0      # running state [G, Lq_pad, 1|1|D], float32
      in order:
        for each step group (steps.step_groups: sub-block shape, masked or not):
          repeat V_g x group_body           # no conditional (segment ids: one, see blocks)
            i0, j0 = q_row[t], kv_row[t]    # body constants; masked groups: pattern[id[t]]
            q_i, k_t_j, v_j = slices; m_i, l_i, acc_i = slices of the state
            m_i, l_i, acc_i = online_softmax_update(...)
            write m_i, l_i, acc_i back in place    # by reference: aliased, not copied
        then (unordered among themselves): out = acc / l, lse = m + log(l)   # once
      drop padding rows

The state lives in full-length tensors instead of being carried from step to step, so steps
need no "first"/"last" bookkeeping and run in any order: full blocks, diagonal sub-blocks and
other masked blocks are separate loops, each with one body.

Online softmax (FlashAttention algorithm 1, per block), statistics in float32::

    s     = scale * q_i k_j^T                  [G, rows, cols]
    m_new = max(m_i, rowmax(s))                [G, rows, 1]
    p     = exp(s - m_new)                     [G, rows, cols]
    alpha = exp(m_i - m_new)                   (blocks.exp_diff: no overflow)
    l_i   = alpha * l_i + rowsum(p)
    acc   = alpha * acc + p v_j                [G, rows, D]
"""
import numpy as np

from popxl_flash.graph import blocks, score_mods
from popxl_flash.backend import popxl
from popxl_flash.graph.module import AttentionModule

ops = popxl.ops


def online_softmax_update(cfg, m_i, l_i, acc, q_i, k_t, v_j, *extra, visible=None):
    """One block of the online softmax.

    Args:
        cfg: the :class:`AttentionConfig`.
        m_i, l_i: running max and sum, float32 ``[G, rows, 1]`` (``MASKED_SCORE`` and 0 before
            the row's first block).
        acc: output accumulator, float32 ``[G, rows, D]``.
        q_i: ``[G, rows, D]``; k_t: ``k_j^T [Gk, D, cols]``; v_j: ``[Gk, cols, D]``, in the
            input dtype (``Gk < G``: grouped-query attention; the matmuls fold q's groups,
            :func:`blocks.fold_heads`).
        extra: with score modifiers, the step's modifier operands
            (:func:`popxl_flash.graph.score_mods.step_operands`).
        visible: ``None`` (full block) or bool ``[1 or G, rows, cols]`` mask.

    Returns:
        Updated ``(m_i, l_i, acc)``.
    """
    f32 = blocks.float32()
    s = blocks.scores(cfg, q_i, k_t)  # [G, rows, cols]
    if cfg.mods is not None:  # softcap, ALiBi, score_mod
        s = score_mods.modify(cfg, s, extra)
    s_max = s
    if visible is not None:
        s_max = ops.where(visible, s, blocks.scalar(blocks.MASKED_SCORE, f32))
    m_new = ops.maximum(m_i, ops.max(s_max, axis=-1, keepdims=True))  # [G, rows, 1]
    if visible is not None:
        # Masked cells enter the exp as m_new (exp(0), zeroed below): never MASKED_SCORE -
        # m_new, which overflows for scores beyond 2^103 and would trap under FP checks.
        s = ops.where(visible, s, m_new)
    p = ops.exp(s - m_new)  # [G, rows, cols], <= 1
    if visible is not None:
        p = ops.where(visible, p, blocks.scalar(0.0, f32))
    # A row that has seen nothing yet has m_i == MASKED_SCORE: exp_diff gives 0 (or 1 when
    # m_new is MASKED_SCORE too), and alpha then multiplies zeros.
    alpha = blocks.exp_diff(m_i, m_new)  # [G, rows, 1]
    l_new = alpha * l_i + ops.sum(p, axis=-1, keepdims=True)
    if cfg.mods is not None:  # dropout: P V with P * keep / (1 - p); l_i keeps the full P
        p = score_mods.drop(cfg, p, extra)
    p_in = blocks.fold_heads(cfg, blocks.to_input_dtype(cfg, p))  # [Gk, r*rows, cols]
    pv = blocks.unfold_heads(cfg, blocks.matmul_f32(p_in, v_j))  # [G, rows, D]
    return m_new, l_new, alpha * acc + pv


def finalise(cfg, m, l, acc):
    """``out = acc / l`` (0 where the row saw nothing) and ``lse = m + log(l)``, once after the
    loops, unpadded.

    Args:
        m, l: float32 ``[G, Lq_pad, 1]``; acc: float32 ``[G, Lq_pad, D]``.

    Returns:
        out ``[G, Lq, D]`` in the input dtype and lse float32 ``[G, Lq]`` (-inf where nothing
        was seen).
    """
    f32 = blocks.float32()
    m, l, acc = (blocks.unpad_rows(t, cfg.q_len) for t in (m, l, acc))
    seen = ops.greater(l, blocks.scalar(0.0, f32))  # [G, Lq, 1]
    l_safe = ops.where(seen, l, blocks.scalar(1.0, f32))  # no x/0, no log(0)
    out = blocks.to_input_dtype(cfg, acc / l_safe)
    lse = ops.where(seen, m + ops.log(l_safe), blocks.scalar(-np.inf, f32))
    return out, lse.reshape((cfg.groups, cfg.q_len))


def loop_spec():
    """The forward's :class:`blocks.LoopSpec`: state ``m, l, acc`` over q rows; operands
    ``q`` (q rows), ``k^T`` (kv rows on axis 2), ``v`` (kv rows)."""
    return blocks.LoopSpec(update=online_softmax_update, state_sides=("q", "q", "q"),
                           operand_axes=(("q", 1), ("kv", 2), ("kv", 1)))


class FlashAttention(AttentionModule):
    """FlashAttention forward: ``build(q, k, v) -> (out, lse)``.

    Args (constructor): ``num_chunks_q``, ``num_chunks_kv``, ``causal``, ``scale``, ``window`` as
    :func:`popxl_flash.flash_attention`.

    ``build`` args:
        q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]`` with ``G % Gk == 0`` (``Gk < G``:
            grouped-query attention, q group ``g`` reading kv group ``g // (G // Gk)``); float16
            or float32.
        q_segment_ids, kv_segment_ids: optional int32 ``[G or 1, Lq]``, ``[Gk or 1, Lkv]``
            (packed sequences, -1 = padding; see :mod:`popxl_flash.graph.segments`).
        q_positions, kv_positions: optional int32, the ids' shapes (the varlen API's
            bottom-right positions: causal and window compare them).
        then, with ``mods`` (:func:`popxl_flash.graph.score_mods.options`): ``alibi_slopes``
            float32 ``[G]`` (if ``mods.alibi``), ``seed`` uint32 ``[2]`` (if dropout), the
            score_mod inputs (positional, after the segment inputs given).

    Returns:
        out ``[G, Lq, D]`` in q's dtype and lse float32 ``[G, Lq]``.
    """

    def config(self, q, k, v, *inputs):
        """Validate the inputs' specs against the options (an :class:`AttentionConfig`)."""
        return self.attention_config(q, k, v, *score_mods.split_inputs(self.options["mods"],
                                                                        inputs))

    def build(self, q, k, v, *inputs):
        segment_inputs, extras = score_mods.split_inputs(self.options["mods"], inputs)
        cfg = self.config(q, k, v, *inputs)
        G, D, Lq_pad, f32 = cfg.groups, cfg.head_dim, cfg.padded_q_len, blocks.float32()
        q_pad = blocks.pad_rows(q, Lq_pad)
        k_t = blocks.pad_rows(k, cfg.padded_kv_len).transpose_((0, 2, 1))  # [Gk, D, Lkv_pad] view
        v_pad = blocks.pad_rows(v, cfg.padded_kv_len)
        m = blocks.fill(ops.init((G, Lq_pad, 1), f32, init_type="zero"), blocks.MASKED_SCORE)
        l = ops.init((G, Lq_pad, 1), f32, init_type="zero")
        acc = ops.init((G, Lq_pad, D), f32, init_type="zero")
        return self.run_pass(cfg, loop_spec(), "q_major", (q_pad, k_t, v_pad), (m, l, acc),
                             segment_inputs, lambda *state: finalise(cfg, *state), extras)
