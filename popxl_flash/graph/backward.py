"""FlashAttention backward as a ``popxl.Module`` (FlashAttention-2 algorithm 2, stash mode).

PopART cannot differentiate ``ops.repeat``, so the gradient is written by hand. It recomputes
only the block probabilities from the stashed ``lse``; it never reruns the forward.

Graph structure::

    build(dout, q, k, v, out, lse)
      Dvec = rowsum(dout * out)                   [G, Lq, 1]  float32, once
      lse = where(lse > MASKED_SCORE, lse, 0)     once, where rows may see nothing
      k = k * scale where the scale folds (blocks.scale_folds), once
      one block (steps.single_block): grad_block on the whole tensors, then the results
      one kv chunk, 2..8 q chunks (steps.row_passes): the steps below inline, one per q chunk
        on the kv columns its rows see (blocks.row_steps), on the unpadded tensors
      else:
      stack and pad [do; q], lse | Dvec, [k; v] to whole chunks
      dq, [dv; dk] = 0                             float32 accumulators, full length
      in order:
        for each step group (steps.step_groups, kv-major step order; one step: inline):
          repeat V_g x group_body                  # no conditional (segment ids: one)
            i0, j0 = table[t]                      # one lookup; masked groups: the pattern
            qdo_i, stats_i, kv_j; dq_i, dkdv_j = slices
            dq_i, dkdv_j = grad_block_update(...)
            write dq_i, dkdv_j back in place       # by reference: aliased, not copied
        then: dk = scale * dk (and dq unless the scale folded), cast, drop padding rows
      lean (cfg.lean_backward, looped passes): Dvec per q piece, no k * scale copy, and
        [dv; dk] accumulated one kv piece at a time (graph/lean.py), each piece written out
        before the next; dq finished per q piece

Per visited block (5 matmuls; statistics and accumulators float32)::

    P             = exp(q_i k_j^T (* scale) - lse_i)   (masked to 0 in partial blocks)
    dS            = P * (do_i v_j^T - Dvec_i)
    [dv_j; dk_j] += [P; dS]^T [do_i; q_i]             (one batched matmul; dk's scale after)
    dq_i         += dS k_j                            (k scaled once, or scale after)
"""
from popxl_flash.graph import blocks, lean, score_mods
from popxl_flash.backend import popxl
from popxl_flash.graph.module import AttentionModule
from popxl_flash.plan import steps

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
        s = scores(cfg, q_i, k_j)
    arg = s - lse_i
    if visible is None:
        return ops.exp(arg)  # every row of a full block sees something: lse_i finite
    masked = blocks.scalar(blocks.MASKED_SCORE, blocks.float32())
    return ops.exp(ops.where(visible, arg, masked))


def scores(cfg, q_i, k_j):
    """``scale * q_i k_j^T`` float32 ``[G, rows, cols]`` (k_j times the scale where it folds,
    :func:`blocks.scale_folds`)."""
    return blocks.scores(cfg, q_i, k_j.transpose_((0, 2, 1)))


def grad_block(cfg, q_i, do_i, lse_i, dvec_i, k_j, v_t, qdo_i=None, extra=(), visible=None):
    """The gradient contributions of one block (dq and dk without the factor ``scale``:
    applied once after the loops).

    Args:
        cfg: the :class:`AttentionConfig`.
        q_i, do_i: ``[G, rows, D]``; k_j: ``[Gk, cols, D]``; v_t: ``v_j^T [Gk, D, cols]`` in the
            input dtype (``Gk < G``: grouped-query attention; the matmuls fold q's groups,
            :func:`blocks.fold_heads`, so dk_j and dv_j sum over the q groups sharing a kv
            group inside the matmul).
        lse_i, dvec_i: float32 ``[G, rows, 1]``.
        qdo_i: ``None``, or ``[do_i; q_i]`` stacked ``[2, G, rows, D]``: then dv and dk come
            from one batched matmul of ``[P; dS]`` (cast once) with it.
        extra: with score modifiers, the step's modifier operands
            (:func:`popxl_flash.graph.score_mods.step_operands`).
        visible: ``None`` (full block) or bool ``[1 or G, rows, cols]``.

    Returns:
        ``(dq_i, [dv_j; dk_j] [2, Gk, cols, D])`` with ``qdo_i``, else ``(dq_i, dk_j, dv_j)``;
        float32.
    """
    s = None
    if cfg.mods is not None:  # softcap, ALiBi, score_mod; chain: dS of the modified scores -> dS
        s, chain = score_mods.modify(cfg, scores(cfg, q_i, k_j), extra, backward=True)
    p = probabilities(cfg, q_i, k_j, lse_i, visible, s)  # [G, rows, cols]
    do_f = _fold(cfg, do_i)  # [Gk, r*rows, D]
    p_drop = p if cfg.mods is None else score_mods.drop(cfg, p, extra)  # P * keep / (1 - p)
    dp = _unfold(cfg, _mm(do_f, v_t))  # [G, rows, cols]
    if cfg.mods is None:
        ds = p * (dp - dvec_i)  # [G, rows, cols]
    else:  # dP = dP_dropped * keep / (1 - p); dS through the score modifiers
        ds = chain(p * (score_mods.drop(cfg, dp, extra) - dvec_i))
    if qdo_i is None:
        p_t = _fold(cfg, blocks.to_input_dtype(cfg, p_drop)).transpose_((0, 2, 1))
        ds_in = _fold(cfg, blocks.to_input_dtype(cfg, ds))  # [Gk, r*rows, cols]
        dv_j = _mm(p_t, do_f)  # [Gk, cols, D]
        dk_j = _mm(ds_in.transpose_((0, 2, 1)), _fold(cfg, q_i))  # [Gk, cols, D]
        return _unfold(cfg, _mm(ds_in, k_j)), dk_j, dv_j
    pds = blocks.to_input_dtype(cfg, blocks.stack([p_drop, ds]))  # [2, G, rows, cols]
    ds_in = _fold(cfg, blocks.part(pds, 1))
    dkdv = _mm(_fold4(cfg, pds).transpose_((0, 1, 3, 2)), _fold4(cfg, qdo_i))  # [dv; dk]
    return _unfold(cfg, _mm(ds_in, k_j)), dkdv


def _fold4(cfg, t):
    """:func:`blocks.fold_heads` of a stacked ``[2, G, rows, X]`` (a view, ``reshape_``)."""
    r = cfg.group_size
    if r == 1:
        return t
    n, _, rows, x = t.shape
    shape = (n, cfg.kv_groups, r * rows, x)
    return t.reshape_(shape)


def grad_block_update(cfg, dq_i, dkdv_j, qdo_i, stats_i, kv_j, *extra, visible=None):
    """One step of the backward loops: :func:`grad_block` on the step's slices, accumulated.

    Args:
        dq_i: float32 ``[G, rows, D]``; dkdv_j: float32 ``[dv_j; dk_j]`` ``[2, Gk, cols, D]``.
        qdo_i: ``[do_i; q_i]`` ``[2, G, rows, D]``; stats_i: float32 ``lse_i | Dvec_i``
            ``[G, rows, 2]``; kv_j: ``[k_j; v_j]`` ``[2, Gk, cols, D]`` (input dtype).
        extra, visible: as :func:`grad_block`.

    Returns:
        Updated ``(dq_i, dkdv_j)``.
    """
    k_j, v_j = blocks.part(kv_j, 0), blocks.part(kv_j, 1)
    if cfg.lean_backward:  # no scaled copy of the whole k: this step's slice, exactly
        k_j = blocks.scaled_k(cfg, k_j)
    dq, dkdv = grad_block(cfg, blocks.part(qdo_i, 1), blocks.part(qdo_i, 0),
                          blocks.columns(stats_i, 0, 1), blocks.columns(stats_i, 1, 2), k_j,
                          v_j.transpose_((0, 2, 1)), qdo_i, extra, visible)
    return dq_i + dq, dkdv_j + dkdv


def loop_spec(lean=False):
    """The backward's :class:`blocks.LoopSpec`: state ``dq`` (q rows) and ``[dv; dk]`` (kv
    rows on axis 2; lean: one kv piece's accumulator, rows within the piece, ``"kvp"``);
    operands ``[do; q]`` (q rows on axis 2), ``lse | Dvec`` (q rows), ``[k; v]`` (kv rows on
    axis 2)."""
    return blocks.LoopSpec(update=grad_block_update,
                           state_axes=(("q", 1), ("kvp" if lean else "kv", 2)),
                           operand_axes=(("q", 2), ("q", 1), ("kv", 2)), backward=True)


def row_statistic(cfg, dout, out, pieces=None):
    """``Dvec = rowsum(dout * out)`` float32 ``[G, Lq, 1]``; with ``pieces`` (``[(r0, r1)]``
    q rows), one piece's float32 casts live at a time, the results joined by a view.

    Args:
        dout, out: ``[G, Lq, D]`` in the input dtype.
    """
    def rowsum(do_p, o_p):  # [G, rows, 1]
        return ops.sum(blocks.to_float32(do_p) * blocks.to_float32(o_p), axis=-1,
                       keepdims=True)
    if pieces is None:
        return rowsum(dout, out)
    return blocks.join([rowsum(*(ops.slice_(t, start=[r0], stop=[r1], axis=[1])
                                 for t in (dout, out))) for r0, r1 in pieces], axis=1)


def _finish_dq(cfg, dq):
    """dq from its accumulator (lean): ``scale`` applied unless it folded, cast, one q piece
    at a time, joined by a view."""
    parts = []
    for r0, r1 in steps.lean_piece_rows(cfg.num_chunks_q, cfg.chunk_q, cfg.q_len):
        dq_p = ops.slice_(dq, start=[r0], stop=[r1], axis=[1])  # [G, rows, D] view
        if not blocks.scale_folds(cfg):
            dq_p = dq_p * cfg.scale
        parts.append(blocks.to_input_dtype(cfg, dq_p))
    return blocks.join(parts, axis=1)


def _flush_piece(cfg, acc, piece):
    """One kv piece's rows of dk and dv from its ``[dv; dk]`` accumulator: dk times the scale,
    both cast, padding rows dropped.

    Returns:
        ``(dk_piece, dv_piece)`` ``[Gk, rows, D]`` in the input dtype.
    """
    r0, r1 = steps.lean_piece_rows(cfg.num_chunks_kv, cfg.chunk_kv, cfg.kv_len)[piece]
    dv, dk = (blocks.unpad_rows(blocks.part(acc, n), r1 - r0) for n in (0, 1))
    dv = blocks.to_input_dtype(cfg, dv)
    if dv.dtype == blocks.float32():  # a copy, not a view that would keep the piece's
        dv = ops.identity(dv)  # whole accumulator live with the output
    return blocks.to_input_dtype(cfg, dk * cfg.scale), dv


def _run_lean(cfg, operands, extras):
    """The lean backward's loops (:mod:`popxl_flash.graph.lean`) and results.

    Args:
        operands: ``[do; q]``, ``lse | Dvec``, ``[k; v]`` (unscaled k), padded.
        extras: the prepared score-modifier tensors.

    Returns:
        dq, dk, dv.
    """
    G, Gk, D, f32 = cfg.groups, cfg.kv_groups, cfg.head_dim, blocks.float32()
    dq = ops.init((G, cfg.padded_q_len, D), f32, init_type="zero")
    acc_shape = (2, Gk, lean.piece_rows(cfg), D)
    spec = loop_spec(lean=True)
    loops = lean.PieceLoops(spec, cfg, operands, [dq, popxl.TensorSpec(acc_shape, f32)],
                            extras)
    dks, dvs = [], []
    with blocks.in_order():
        for piece in range(len(steps.lean_pieces(cfg.num_chunks_kv))):
            acc = ops.init(acc_shape, f32, init_type="zero")  # [dv; dk] of this piece
            loops.run_piece(piece, operands, [dq, acc], extras)
            dk, dv = _flush_piece(cfg, acc, piece)
            dks.append(dk)
            dvs.append(dv)
        with blocks.in_order(False):
            dq = _finish_dq(cfg, blocks.unpad_rows(dq, cfg.q_len))
    return dq, blocks.join(dks, axis=1), blocks.join(dvs, axis=1)


def _finish(cfg, dq, dk, dv):
    """The gradients from the accumulators: ``scale`` applied to dk once (and to dq, unless
    it folded into k, :func:`blocks.scale_folds`: then ``dS (scale k)`` is dq), cast to the
    input dtype, padding dropped."""
    if not blocks.scale_folds(cfg):
        dq = dq * cfg.scale
    dk = dk * cfg.scale
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
        cfg = self.lean_where_looped(cfg, "lean_backward")
        lean_pass = cfg.lean_backward
        pieces = (steps.lean_piece_rows(cfg.num_chunks_q, cfg.chunk_q, Lq) if lean_pass
                  else None)
        dvec = row_statistic(cfg, dout, out, pieces)  # [G, Lq, 1]
        lse = lse.reshape_((G, Lq, 1))
        if blocks.rows_may_see_nothing(cfg):
            seen = ops.greater(lse, blocks.scalar(blocks.MASKED_SCORE, f32))
            lse = ops.where(seen, lse, blocks.scalar(0.0, f32))  # -inf -> 0, once
        if not lean_pass:  # lean: each step scales its slice
            k = blocks.scaled_k(cfg, k)  # where the scale folds, once per call
        if self.single_block(cfg):
            return self.run_single(cfg, segment_inputs, extras, lambda seg, extra, visible:
                                   _finish(cfg, *grad_block(cfg, q, dout, lse, dvec, k,
                                                            v.transpose_((0, 2, 1)),
                                                            extra=extra, visible=visible)))
        rows = self.row_passes(cfg)
        if rows:  # straight-line row steps on the unpadded tensors
            Lq_pad, Lkv_pad = Lq, cfg.kv_len
        qdo = blocks.pad_rows(blocks.stack([dout, q]), Lq_pad, axis=2)  # [2, G, Lq_pad, D]
        stats = blocks.pad_rows(ops.concat([lse, dvec], axis=2), Lq_pad)  # [G, Lq_pad, 2]
        kv = blocks.pad_rows(blocks.stack([k, v]), Lkv_pad, axis=2)  # [2, Gk, Lkv_pad, D]
        if lean_pass:
            prepared = [] if cfg.mods is None else score_mods.prepare(cfg, extras)
            return _run_lean(cfg, (qdo, stats, kv), prepared)
        state = [ops.init((G, Lq_pad, D), f32, init_type="zero"),  # dq
                 ops.init((2, Gk, Lkv_pad, D), f32, init_type="zero")]  # [dv; dk]
        def finish(dq, dkdv):
            return _finish(cfg, dq, blocks.part(dkdv, 1), blocks.part(dkdv, 0))
        if rows:
            return self.run_rows(cfg, loop_spec(), (qdo, stats, kv), state, finish, extras)
        return self.run_pass(cfg, loop_spec(), "kv_major", (qdo, stats, kv), state,
                             segment_inputs, finish, extras)
