"""FlashAttention backward as a ``popxl.Module`` (FlashAttention-2 algorithm 2, stash mode).

PopART cannot differentiate ``ops.repeat``, so the gradient is written by hand. It recomputes
only the block probabilities from the stashed ``lse``; it never reruns the forward.

Graph structure::

    build(dout, q, k, v, out, lse)
      Dvec = rowsum(dout * out)                   [G, Lq, 1]  float32, once
      lse_safe = where(lse > MASKED_SCORE, lse, 0)             once (rows that see nothing)
      pad everything to whole chunks; v_t = v^T [Gk, D, Lkv_pad]
      dq, dk, dv = 0                               float32 accumulators, full length
      in order:
        for each step group (steps.step_groups, kv-major step order):
          repeat V_g x group_body                  # no conditional (segment ids: one)
            i0, j0 = q_row[t], kv_row[t]           # masked groups: pattern[id[t]]
            q_i, do_i, lse_i, Dvec_i, k_j, v_t_j; dq_i, dk_j, dv_j = slices
            dq_i, dk_j, dv_j = grad_block_update(...)
            write dq_i, dk_j, dv_j back in place   # by reference: aliased, not copied
        then: dq = scale * dq, dk = scale * dk (once), cast, drop padding rows

Per visited block (5 matmuls; statistics and accumulators float32)::

    P    = exp(scale * q_i k_j^T - lse_i)          (masked to 0 in partial blocks)
    dv_j += P^T do_i
    dS   = P * (do_i v_j^T - Dvec_i)
    dq_i += dS k_j                                 (times scale once, after the loops)
    dk_j += dS^T q_i                               (times scale once, after the loops)
"""
from popxl_flash.graph import blocks, score_mods
from popxl_flash.backend import popxl
from popxl_flash.graph.module import AttentionModule

ops = popxl.ops

_mm = blocks.matmul_f32
_fold, _unfold = blocks.fold_heads, blocks.unfold_heads


def probabilities(cfg, q_i, k_j, lse_i, visible=None, s=None):
    """The block's softmax probabilities recomputed from the stashed lse.

    Args:
        q_i: ``[G, rows, D]``; k_j: ``[Gk, cols, D]``; lse_i: float32 ``[G, rows, 1]`` (0 for
            rows that see nothing, so no ``s + inf``); visible: ``None`` or bool mask
            ``[1 or G, rows, cols]``; s: the (modified) scores if already computed.

    Returns:
        float32 ``P [G, rows, cols]``, exactly 0 on masked cells (``exp(MASKED_SCORE)``).
    """
    if s is None:
        s = blocks.scores(cfg, q_i, k_j.transpose((0, 2, 1)))  # [G, rows, cols]
    if visible is None:
        return ops.exp(s - lse_i)  # every row of a full block sees something: lse_i finite
    masked = blocks.scalar(blocks.MASKED_SCORE, blocks.float32())
    return ops.exp(ops.where(visible, s - lse_i, masked))


def grad_block_update(cfg, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_t, *extra,
                      visible=None):
    """One block of the backward (dq and dk without the factor ``scale``: applied once after
    the loops).

    Args:
        cfg: the :class:`AttentionConfig`.
        dq_i: float32 ``[G, rows, D]``; dk_j, dv_j: float32 ``[Gk, cols, D]`` accumulators.
        q_i, do_i: ``[G, rows, D]``; k_j: ``[Gk, cols, D]``; v_t: ``v_j^T [Gk, D, cols]`` in the
            input dtype (``Gk < G``: grouped-query attention; the matmuls fold q's groups,
            :func:`blocks.fold_heads`, so dk_j and dv_j sum over the q groups sharing a kv
            group inside the matmul).
        lse_i, dvec_i: float32 ``[G, rows, 1]``.
        extra: with score modifiers, the step's modifier operands
            (:func:`popxl_flash.graph.score_mods.step_operands`).
        visible: ``None`` (full block) or bool ``[1 or G, rows, cols]``.

    Returns:
        Updated ``(dq_i, dk_j, dv_j)``.
    """
    s = None
    if cfg.mods is not None:  # softcap, ALiBi, score_mod; chain: dS of the modified scores -> dS
        s = blocks.scores(cfg, q_i, k_j.transpose((0, 2, 1)))  # [G, rows, cols]
        s, chain = score_mods.modify(cfg, s, extra, backward=True)
    p = probabilities(cfg, q_i, k_j, lse_i, visible, s)  # [G, rows, cols]
    do_f = _fold(cfg, do_i)  # [Gk, r*rows, D]
    p_drop = p if cfg.mods is None else score_mods.drop(cfg, p, extra)  # P * keep / (1 - p)
    p_t = _fold(cfg, blocks.to_input_dtype(cfg, p_drop)).transpose((0, 2, 1))  # [Gk, cols, r*rows]
    dv_j = dv_j + _mm(p_t, do_f)  # [Gk, cols, D]
    dp = _unfold(cfg, _mm(do_f, v_t))  # [G, rows, cols]
    if cfg.mods is None:
        ds = _fold(cfg, blocks.to_input_dtype(cfg, p * (dp - dvec_i)))  # [Gk, r*rows, cols]
    else:  # dP = dP_dropped * keep / (1 - p); dS through the score modifiers
        ds = chain(p * (score_mods.drop(cfg, dp, extra) - dvec_i))
        ds = _fold(cfg, blocks.to_input_dtype(cfg, ds))
    dq_i = dq_i + _unfold(cfg, _mm(ds, k_j))  # [G, rows, D]
    dk_j = dk_j + _mm(ds.transpose((0, 2, 1)), _fold(cfg, q_i))  # [Gk, cols, D]
    return dq_i, dk_j, dv_j


def loop_spec():
    """The backward's :class:`blocks.LoopSpec`: state ``dq`` (q rows), ``dk, dv`` (kv rows);
    operands ``q, do, lse, Dvec`` (q rows), ``k`` (kv rows), ``v^T`` (kv rows on axis 2)."""
    return blocks.LoopSpec(update=grad_block_update, state_sides=("q", "kv", "kv"),
                           operand_axes=(("q", 1),) * 4 + (("kv", 1), ("kv", 2)),
                           backward=True)


def _finish(cfg, dq, dk, dv):
    """The gradients from the accumulators: ``scale`` applied to dq and dk once, cast to the
    input dtype, padding dropped."""
    dq, dk = dq * cfg.scale, dk * cfg.scale
    return tuple(blocks.to_input_dtype(cfg, blocks.unpad_rows(t, n))
                 for t, n in zip((dq, dk, dv), (cfg.q_len, cfg.kv_len, cfg.kv_len)))


class FlashAttentionGrad(AttentionModule):
    """FlashAttention backward: ``build(dout, q, k, v, out, lse) -> (dq, dk, dv)``.

    Args (constructor): ``num_chunks_q``, ``num_chunks_kv``, ``causal``, ``scale``, ``window``;
    they must equal the forward's.

    ``build`` args:
        dout, q, out: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]`` with ``G % Gk == 0`` (one float
            dtype; ``Gk < G``: grouped-query attention, dk and dv summed over the q groups
            sharing each kv group);
        lse: float32 ``[G, Lq]`` from :class:`popxl_flash.FlashAttention`.
        q_segment_ids, kv_segment_ids, q_positions, kv_positions: optional, the forward's.
        then the forward's score-modifier inputs (alibi slopes, seed, score_mod inputs).

    Returns:
        dq, dk, dv with the shapes and dtype of q, k, v.
    """

    def config(self, dout, q, k, v, out, lse, *inputs):
        """Validate all specs against the options (an :class:`AttentionConfig`)."""
        cfg = self.attention_config(q, k, v, *score_mods.split_inputs(self.options["mods"],
                                                                       inputs))
        for name, t in (("dout", dout), ("out", out)):
            cfg.check_like(name, t.shape, t.dtype.name, q.shape, cfg.dtype)
        cfg.check_like("lse", lse.shape, lse.dtype.name, (cfg.groups, cfg.q_len), "float32")
        return cfg

    def build(self, dout, q, k, v, out, lse, *inputs):
        segment_inputs, extras = score_mods.split_inputs(self.options["mods"], inputs)
        cfg = self.config(dout, q, k, v, out, lse, *inputs)
        f32 = blocks.float32()
        G, Lq, D = cfg.groups, cfg.q_len, cfg.head_dim
        Gk, Lq_pad, Lkv_pad = cfg.kv_groups, cfg.padded_q_len, cfg.padded_kv_len
        dvec = ops.sum(blocks.to_float32(dout) * blocks.to_float32(out), axis=-1,
                       keepdims=True)  # [G, Lq, 1]
        lse = lse.reshape((G, Lq, 1))
        seen = ops.greater(lse, blocks.scalar(blocks.MASKED_SCORE, f32))
        lse_safe = ops.where(seen, lse, blocks.scalar(0.0, f32))  # -inf -> 0, once
        operands = [blocks.pad_rows(t, Lq_pad) for t in (q, dout, lse_safe, dvec)]
        operands.append(blocks.pad_rows(k, Lkv_pad))
        operands.append(blocks.pad_rows(v, Lkv_pad).transpose_((0, 2, 1)))  # [Gk, D, Lkv_pad] view
        state = [ops.init(shape, f32, init_type="zero")  # dq, dk, dv
                 for shape in ((G, Lq_pad, D), (Gk, Lkv_pad, D), (Gk, Lkv_pad, D))]
        return self.run_pass(cfg, loop_spec(), "kv_major", operands, state, segment_inputs,
                             lambda *acc: _finish(cfg, *acc), extras)
