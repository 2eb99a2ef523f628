"""FlashAttention forward as a ``popxl.Module``: the seed's algorithm as PopXL graph code.

Graph structure (all static; the loops' op count does not grow with L or the chunk counts, and
row passes are at most steps.MAX_ROW_PASSES)::

    build(q, k, v)                          # module graph
      k = k * scale where the scale folds (blocks.scale_folds), once
      one block (steps.single_block): single_pass, a straight line on the whole tensors:
        m = max(s), P = exp(s - m), l = sum(P)    # naive attention, softmax written out
        out = (P v) / l, lse = m + log(l)
      one kv chunk, 2..8 q chunks (steps.row_passes): single_pass per q chunk on the columns
        its rows see, in order; out, lse = concat   # no loop, no state
      else:
      pad q and [k; v] (stacked once) to whole chunks
      state = acc | l | m = 0 | 0 | INITIAL_MAX     # [G, Lq_pad, D + 2], float32
      in order:
        for each step group (steps.step_groups: sub-block shape, masked or not):
          repeat V_g x group_body           # no conditional (segment ids: one, see blocks)
            i0, j0 = table[t]               # one lookup; masked groups: the pattern
            q_i, kv_j, state_i = slices
            state_i = online_softmax_update(...)
            write state_i back in place     # by reference: aliased, not copied
          (a group of one step: the same step inline, static offsets, no loop)
        then (unordered among themselves): out = acc / l, lse = m + log(l)   # once
      drop padding rows
    lean (cfg.lean_forward, looped passes; docs/design.md "Memory-lean structures"): no
      k * scale copy (each step scales its k slice), the state's m column set in place, and
      out, lse normalised per q piece (steps.lean_pieces), joined by views

The state lives in one full-length tensor instead of being carried from step to step, so steps
need no "first"/"last" bookkeeping and run in any order: full blocks, diagonal sub-blocks and
other masked blocks are separate loops, each with one body.

Online softmax (FlashAttention algorithm 1, per block), statistics in float32::

    s       = q_i k_j^T (k scaled once; else * scale)   [G, rows, cols]
    m_new   = max(m_i, rowmax(s))                       [G, rows, 1]
    p       = exp(s - m_new)                            [G, rows, cols]
    alpha   = exp(m_i - m_new)                          (m_i >= INITIAL_MAX: no overflow)
    acc | l = alpha * (acc | l) + (p v_j | rowsum(p))   [G, rows, D + 1]
"""
import numpy as np

from popxl_flash.graph import blocks, score_mods
from popxl_flash.backend import popxl
from popxl_flash.graph.module import AttentionModule
from popxl_flash.plan import steps

ops = popxl.ops


def softmax_block(cfg, m_i, acc_l, q_i, k_t, v_j, extra=(), visible=None):
    """One block of the online softmax.

    Args:
        cfg: the :class:`AttentionConfig`.
        m_i: running max float32 ``[G, rows, 1]`` (:data:`blocks.INITIAL_MAX` before the
            row's first block).
        acc_l: output accumulator and running sum, float32 ``[G, rows, D + 1]`` (``acc | l``).
        q_i: ``[G, rows, D]``; k_t: ``k_j^T [Gk, D, cols]`` (times the scale where it folds,
            :func:`blocks.scale_folds`); v_j: ``[Gk, cols, D]``, in the input dtype (``Gk <
            G``: grouped-query attention; the matmuls fold q's groups,
            :func:`blocks.fold_heads`).
        extra: with score modifiers, the step's modifier operands
            (:func:`popxl_flash.graph.score_mods.step_operands`).
        visible: ``None`` (full block) or bool ``[1 or G, rows, cols]`` mask.

    Returns:
        ``(m_new, acc_l_new)``.
    """
    f32 = blocks.float32()
    s = blocks.scores(cfg, q_i, k_t)  # [G, rows, cols]
    if cfg.mods is not None:  # softcap, ALiBi, score_mod
        s = score_mods.modify(cfg, s, extra)
    masked = blocks.scalar(blocks.MASKED_SCORE, f32)
    s_max = s if visible is None else ops.where(visible, s, blocks.scalar(blocks.INITIAL_MAX,
                                                                          f32))
    m_new = ops.maximum(m_i, ops.max(s_max, axis=-1, keepdims=True))  # [G, rows, 1]
    s = s - m_new  # finite: m_new >= INITIAL_MAX
    if visible is not None:  # masked cells: exp(MASKED_SCORE) = 0
        s = ops.where(visible, s, masked)
    p = ops.exp(s)  # [G, rows, cols], <= 1
    rowsum = ops.sum(p, axis=-1, keepdims=True)
    if cfg.mods is not None:  # dropout: P V with P * keep / (1 - p); l keeps the full P
        p = score_mods.drop(cfg, p, extra)
    p_in = blocks.fold_heads(cfg, blocks.to_input_dtype(cfg, p))  # [Gk, r*rows, cols]
    pv = blocks.unfold_heads(cfg, blocks.matmul_f32(p_in, v_j))  # [G, rows, D]
    # A row that has seen nothing yet has m_i == INITIAL_MAX: alpha is 0 (or 1 when m_new is
    # INITIAL_MAX too), and then multiplies zeros.
    alpha = ops.exp(m_i - m_new)  # [G, rows, 1]
    return m_new, alpha * acc_l + ops.concat_([pv, rowsum], axis=2)


def single_pass(cfg, q, k_t, v, extra=(), visible=None, seen=None):
    """The pass of one block as a straight line: ``m = max(s)``, ``P = exp(s - m)``, ``l =
    sum(P)``, ``out = (P v) / l``, ``lse = m + log(l)``, written out rather than as
    ``ops.softmax`` and ``ops.logsumexp``: by PopART's lowering that is 9 compute sets and 4.5
    passes of vector work over the scores (2 + 1 + 1 + 2 compute sets; max, sub and sum at the
    arithmetic rate, exp transcendental) against 15 compute sets, 8 passes and a copy of the
    scores for the two ops (``popxl_flash/lowering.py``); the normalisation runs on ``[G, Lq,
    D]``, not on the scores.

    Args:
        cfg: the :class:`AttentionConfig`.
        q: ``[G, Lq, D]``; k_t: ``k^T [Gk, D, Lkv]`` (times the scale where it folds); v:
            ``[Gk, Lkv, D]``, in the input dtype.
        extra: with score modifiers, the block's modifier operands.
        visible: ``None`` (full block) or bool ``[1, Lq, Lkv]`` mask; masked scores enter as
            :data:`blocks.INITIAL_MAX` (``exp`` of it minus the row max is 0, and it is finite:
            no infinity in the arithmetic).
        seen: ``None`` (every row sees a key) or bool ``[1, Lq, 1]`` constant: rows that see
            nothing get ``out = 0`` and ``lse = -inf``.

    Returns:
        out ``[G, Lq, D]`` in the input dtype and lse float32 ``[G, Lq]``.
    """
    f32 = blocks.float32()
    s = blocks.scores(cfg, q, k_t)  # [G, Lq, Lkv]
    if cfg.mods is not None:  # softcap, ALiBi, score_mod
        s = score_mods.modify(cfg, s, extra)
    if visible is not None:
        s = ops.where(visible, s, blocks.scalar(blocks.INITIAL_MAX, f32))
    m = ops.max(s, axis=-1, keepdims=True)  # [G, Lq, 1], finite
    p = ops.exp(s - m)  # [G, Lq, Lkv], <= 1, at least one 1 per row
    l = ops.sum(p, axis=-1, keepdims=True)  # [G, Lq, 1], >= 1
    if cfg.mods is not None:  # dropout: P V with P * keep / (1 - p); l keeps the full P
        p = score_mods.drop(cfg, p, extra)
    p_in = blocks.fold_heads(cfg, blocks.to_input_dtype(cfg, p))  # [Gk, r*Lq, Lkv]
    pv = blocks.unfold_heads(cfg, blocks.matmul_f32(p_in, v))  # [G, Lq, D]
    out = blocks.to_input_dtype(cfg, pv / l)
    lse = (m + ops.log(l)).reshape_((cfg.groups, q.shape[1]))  # [G, Lq]
    if seen is not None:
        out = ops.where(seen, out, blocks.scalar(0.0, out.dtype))
        lse = ops.where(seen.reshape_((1, seen.shape[1])), lse, blocks.scalar(-np.inf, f32))
    return out, lse


def row_passes(cfg, q, k, v, prepared=()):
    """A forward pass of one kv chunk and a few q chunks (:func:`steps.row_passes`) as
    straight-line row passes: :func:`single_pass` per q chunk on its rows and the kv columns
    they see (static slices: views), in order, then one concat of each result.

    Args:
        cfg: the config; q: ``[G, Lq, D]``; k (scaled where the scale folds), v: ``[Gk, Lkv,
            D]``; prepared: the prepared score-modifier extras (:func:`score_mods.prepare`).

    Returns:
        out ``[G, Lq, D]`` in the input dtype and lse float32 ``[G, Lq]``.
    """
    outs, lses = [], []
    for rp in steps.row_pass_plan(cfg.schedule):
        (r0, r1), (lo, hi) = rp.rows, rp.cols
        if lo == hi:  # the chunk's rows see nothing: out 0, lse -inf
            outs.append(popxl.constant(np.zeros((cfg.groups, r1 - r0, cfg.head_dim),
                                                np.dtype(cfg.dtype)), dtype=q.dtype))
            lses.append(popxl.constant(np.full((cfg.groups, r1 - r0), -np.inf, np.float32)))
            continue
        q_i = ops.slice_(q, start=[r0], stop=[r1], axis=[1])  # [G, rows, D] view
        k_j, v_j = (ops.slice_(t, start=[lo], stop=[hi], axis=[1]) for t in (k, v))
        extra = ()
        if cfg.mods is not None:
            extra = score_mods.step_operands(cfg, prepared, blocks.counter(r0),
                                             blocks.counter(lo), (r1 - r0, hi - lo))
        visible = None if rp.pattern is None else popxl.constant(rp.pattern[None])
        seen = None if rp.seen is None else popxl.constant(rp.seen.reshape(1, -1, 1))
        out, lse = single_pass(cfg, q_i, k_j.transpose_((0, 2, 1)), v_j, extra, visible, seen)
        outs.append(out)
        lses.append(lse)
    return ops.concat(outs, axis=1), ops.concat(lses, axis=1)


def online_softmax_update(cfg, state_i, q_i, kv_j, *extra, visible=None):
    """One step of the forward loops: :func:`softmax_block` on the step's slices.

    Args:
        state_i: float32 ``[G, rows, D + 2]``, ``acc | l | m`` of the step's q rows.
        q_i: ``[G, rows, D]``; kv_j: ``[k_j; v_j]`` ``[2, Gk, cols, D]`` (input dtype).
        extra, visible: as :func:`softmax_block`.

    Returns:
        The new ``(state_i,)``.
    """
    D = cfg.head_dim
    k_j = blocks.part(kv_j, 0)
    if cfg.lean_forward:  # no scaled copy of the whole k: this step's slice, exactly
        k_j = blocks.scaled_k(cfg, k_j)
    k_t = k_j.transpose_((0, 2, 1))  # [Gk, D, cols] view
    m_new, acc_l = softmax_block(cfg, blocks.columns(state_i, D + 1, D + 2),
                                 blocks.columns(state_i, 0, D + 1), q_i, k_t,
                                 blocks.part(kv_j, 1), extra, visible)
    return (ops.concat_([acc_l, m_new], axis=2),)


def finalise(cfg, m, l, acc):
    """``out = acc / l`` (0 where the row saw nothing) and ``lse = m + log(l)``, once
    after the loops, unpadded.

    Args:
        m, l: float32 ``[G, Lq_pad, 1]``; acc: float32 ``[G, Lq_pad, D]``.

    Returns:
        out ``[G, Lq, D]`` in the input dtype and lse float32 ``[G, Lq]`` (-inf where nothing
        was seen).
    """
    m, l, acc = (blocks.unpad_rows(t, cfg.q_len) for t in (m, l, acc))
    return normalise(cfg, m, l, acc)


def normalise(cfg, m, l, acc):
    """:func:`finalise` on rows already unpadded (all rows, or one piece of them).

    Args:
        m, l: float32 ``[G, rows, 1]``; acc: float32 ``[G, rows, D]``.

    Returns:
        out ``[G, rows, D]`` in the input dtype and lse float32 ``[G, rows]``.
    """
    f32 = blocks.float32()
    seen = None
    if blocks.rows_may_see_nothing(cfg):  # else every row has l >= 1
        seen = ops.greater(l, blocks.scalar(0.0, f32))  # [G, Lq, 1]
        l = ops.where(seen, l, blocks.scalar(1.0, f32))  # no x/0, no log(0)
    out = blocks.to_input_dtype(cfg, acc / l)
    lse = m + ops.log(l)
    if seen is not None:
        lse = ops.where(seen, lse, blocks.scalar(-np.inf, f32))
    return out, lse.reshape_((cfg.groups, acc.shape[1]))


def _finish_state(cfg, state):
    """:func:`finalise` on the loops' ``acc | l | m`` state (views of it); the lean
    structure normalises one q piece at a time (:func:`popxl_flash.plan.steps.lean_pieces`:
    one piece's float32 ``acc / l`` live, not the whole), its results joined by views."""
    D = cfg.head_dim
    if not cfg.lean_forward:
        return finalise(cfg, blocks.columns(state, D + 1, D + 2),
                        blocks.columns(state, D, D + 1), blocks.columns(state, 0, D))
    outs, lses = [], []
    for r0, r1 in steps.lean_piece_rows(cfg.num_chunks_q, cfg.chunk_q, cfg.q_len):
        rows = ops.slice_(state, start=[r0], stop=[r1], axis=[1])  # [G, rows, D + 2] view
        out, lse = normalise(cfg, blocks.columns(rows, D + 1, D + 2),
                             blocks.columns(rows, D, D + 1), blocks.columns(rows, 0, D))
        outs.append(out)
        lses.append(lse)
    return blocks.join(outs, axis=1), blocks.join(lses, axis=1)


def initial_state(cfg):
    """``acc | l | m = 0 | 0 | INITIAL_MAX``, float32 ``[G, Lq_pad, D + 2]``: a ``where`` of
    zeros and the masked score, or (lean) zeros with the masked score added in place to the
    m column (one full-length tensor live, not two)."""
    G, D, Lq_pad, f32 = cfg.groups, cfg.head_dim, cfg.padded_q_len, blocks.float32()
    zeros = ops.init((G, Lq_pad, D + 2), f32, init_type="zero")
    if cfg.lean_forward:
        m_column = np.zeros((1, 1, D + 2), np.float32)
        m_column[..., D + 1] = blocks.INITIAL_MAX
        return ops.add_(zeros, popxl.constant(m_column))
    is_m = popxl.constant(np.arange(D + 2) == D + 1)
    return ops.where(is_m, blocks.scalar(blocks.INITIAL_MAX, f32), zeros)


def loop_spec():
    """The forward's :class:`blocks.LoopSpec`: state ``acc | l | m`` over q rows; operands
    ``q`` (q rows) and ``[k; v]`` (kv rows on axis 2)."""
    return blocks.LoopSpec(update=online_softmax_update, state_axes=(("q", 1),),
                           operand_axes=(("q", 1), ("kv", 2)))


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
        cfg = self.lean_where_looped(cfg, "lean_forward")
        if not cfg.lean_forward:  # lean: each step scales its slice
            k = blocks.scaled_k(cfg, k)  # where the scale folds, once per call
        if self.single_block(cfg):
            return self.run_single(cfg, segment_inputs, extras, lambda seg, extra, visible:
                                   single_pass(cfg, q, k.transpose_((0, 2, 1)), v, extra,
                                               visible, blocks.seen_rows(cfg)))
        if self.row_passes(cfg):
            prepared = [] if cfg.mods is None else score_mods.prepare(cfg, extras)
            with blocks.in_order():  # one chunk's scores at a time
                return row_passes(cfg, q, k, v, prepared)
        q_pad = blocks.pad_rows(q, cfg.padded_q_len)
        kv = blocks.pad_rows(blocks.stack([k, v]), cfg.padded_kv_len, axis=2)  # [2, Gk, L, D]
        state = initial_state(cfg)  # acc | l | m, float32 [G, Lq_pad, D + 2]
        return self.run_pass(cfg, loop_spec(), "q_major", (q_pad, kv), (state,),
                             segment_inputs, lambda state: _finish_state(cfg, state), extras)
