"""FlashAttention forward as a ``popxl.Module``: the seed's algorithm as PopXL graph code.

Graph structure (all static; the op count does not grow with L or the chunk counts)::

    build(q, k, v)                      # module graph
      pad q, k, v to whole chunks
      repeat V x block_body             # one step per visited block, q-major (planner's list)
        i, j, branch = block_list[t]    # planner constants (pattern ids: in partial branches)
        q_i, k_j, v_j = dynamic_slice(q, i), dynamic_slice(k, j), dynamic_slice(v, j)
        conditional(branch, ...)        # one branch graph per (full|partial, whole|split, last)
          online-softmax update (split blocks: two sub-blocks, skipping an invisible quadrant)
          at q chunk i's last block: out_i = acc / l_i, lse_i = m_i + log(l_i); fresh state
        dynamic_update_(out, i, out_i), dynamic_update_(lse, i, lse_i)  # by-ref; last one wins
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

from popxl_flash import blocks, score_mods, segments
from popxl_flash.backend import popxl
from popxl_flash.config import AttentionConfig

ops = popxl.ops
ByRef = popxl.TensorByRef


def online_softmax_update(cfg, m_i, l_i, acc, q_i, k_j, v_j, visible=None, extra=None):
    """One block of the online softmax.

    Args:
        cfg: the :class:`AttentionConfig`.
        m_i, l_i: running max and sum, float32 ``[G, cq, 1]``.
        acc: output accumulator, float32 ``[G, cq, D]``.
        q_i: ``[G, cq, D]``; k_j, v_j: ``[Gk, ckv, D]`` in the input dtype (``Gk < G``:
            grouped-query attention; the matmuls fold q's groups, :func:`blocks.fold_heads`).
        visible: ``None`` (full block) or bool ``[1, cq, ckv]`` mask pattern (partial block).
        extra: with score modifiers, the block's operands (:mod:`popxl_flash.score_mods`).

    Returns:
        Updated ``(m_i, l_i, acc)``.
    """
    f32 = blocks.float32()
    s = blocks.scores(cfg, q_i, k_j)  # [G, cq, ckv]
    if extra is not None:  # softcap, ALiBi, score_mod
        s = score_mods.modify(cfg, s, extra)
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
    if extra is not None:  # dropout: P V with P * keep / (1 - p); l_i keeps the full P
        p = score_mods.drop(cfg, p, extra)
    p_in = blocks.fold_heads(cfg, blocks.to_input_dtype(cfg, p))  # [Gk, r*cq, ckv]
    pv = blocks.unfold_heads(cfg, blocks.matmul_f32(p_in, v_j))  # [G, cq, D]
    return m_new, l_new, alpha * acc + pv


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


def _init_state(cfg):
    """Running state at a q chunk's first block: ``m_i = MASKED_SCORE``, ``l_i = 0``,
    ``acc = 0`` (float32 ``[G, cq, 1]``, ``[G, cq, 1]``, ``[G, cq, D]``)."""
    G, cq, f32 = cfg.groups, cfg.chunk_q, blocks.float32()
    m_i = popxl.constant(np.full((G, cq, 1), blocks.MASKED_SCORE, np.float32))
    l_i = ops.init((G, cq, 1), f32, init_type="zero")
    acc = ops.init((G, cq, cfg.head_dim), f32, init_type="zero")
    return m_i, l_i, acc


def loop_spec(cfg, dtype):
    """The forward's :class:`blocks.LoopSpec` (q-major block list, online softmax).

    Args:
        cfg: the :class:`AttentionConfig`.
        dtype: the popxl dtype of q, k, v.
    """
    G, Gk, D, cq, ckv = cfg.groups, cfg.kv_groups, cfg.head_dim, cfg.chunk_q, cfg.chunk_kv
    f32, spec = blocks.float32(), popxl.TensorSpec
    return blocks.LoopSpec(
        order="q_major", update=online_softmax_update, roles=("q",) * 4 + ("kv",) * 2,
        block_specs=(spec((G, cq, 1), f32), spec((G, cq, 1), f32), spec((G, cq, D), f32)),
        operand_specs=(spec((G, cq, D), dtype), spec((Gk, ckv, D), dtype),
                       spec((Gk, ckv, D), dtype)),
        carried=(0, 1, 2), init=_init_state, finish=_finalise,
        finished_specs=(spec((G, cq, D), dtype), spec((G, cq), f32)))


def _block_body(cfg, step, t, m_i, l_i, acc, q, k, v, out: ByRef, lse: ByRef, *seg):
    """Repeat body: one visited block of the q-major block list.

    Carried: step ``t [1]`` and the running state ``m_i, l_i [G, cq, 1]``, ``acc [G, cq, D]``
    (float32; fresh after a q chunk's last block). Invariant: padded q, k, v by value
    (read-only, so the lowering can alias them) and, by reference, the results
    ``out [G, Lq_pad, D]``, ``lse [G, Lq_pad]``. Every step writes
    its q chunk of out and lse (zeros until the chunk's last block writes the result: the
    chunk's blocks are consecutive, so the last write wins). With segment ids, ``seg`` holds
    the padded ids (and positions) and the steps' runtime branches (read-only, by value);
    with score modifiers, their loop-invariant tensors follow (:mod:`popxl_flash.score_mods`).
    """
    seg, extras = score_mods.split_loop_inputs(cfg, seg)
    *seg, branches = seg or (None,)
    i0, j0, branch = step.tables(branches).lookup(t)  # first rows of the chunks
    q_i = blocks.rows(q, i0, cfg.chunk_q)  # [G, cq, D]
    k_j, v_j = blocks.rows(k, j0, cfg.chunk_kv), blocks.rows(v, j0, cfg.chunk_kv)
    seg_operands = segments.step_operands(cfg, seg, i0, j0) if seg else []
    if cfg.mods is not None:
        seg_operands += score_mods.step_operands(cfg, extras, i0, j0, seg_operands)
    m_i, l_i, acc, out_i, lse_i = step.run(t, branch, (m_i, l_i, acc, q_i, k_j, v_j,
                                                       *seg_operands))
    blocks.write_rows_(out, i0, out_i)
    blocks.write_rows_(lse, i0, lse_i)
    return t + 1, m_i, l_i, acc


class FlashAttention(popxl.Module):
    """FlashAttention forward: ``build(q, k, v) -> (out, lse)``.

    Args (constructor): ``num_chunks_q``, ``num_chunks_kv``, ``causal``, ``scale``, ``window`` as
    :func:`popxl_flash.flash_attention`.

    ``build`` args:
        q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]`` with ``G % Gk == 0`` (``Gk < G``:
            grouped-query attention, q group ``g`` reading kv group ``g // (G // Gk)``); float16
            or float32.
        q_segment_ids, kv_segment_ids: optional int32 ``[G or 1, Lq]``, ``[Gk or 1, Lkv]``
            (packed sequences, -1 = padding; see :mod:`popxl_flash.segments`).
        q_positions, kv_positions: optional int32, the ids' shapes (the varlen API's
            bottom-right positions: causal and window compare them).
        then, with ``mods`` (a :class:`popxl_flash.score_mods.ScoreMods`): ``alibi_slopes``
            float32 ``[G]`` (if ``mods.alibi``), ``seed`` uint32 ``[2]`` (if dropout), the
            score_mod inputs (positional, after the segment inputs given).

    Returns:
        out ``[G, Lq, D]`` in q's dtype and lse float32 ``[G, Lq]``.
    """

    def __init__(self, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                 window=None, mods=None):
        self.options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window, mods=mods)

    def config(self, q, k, v, *inputs) -> AttentionConfig:
        """Validate the inputs' specs against the options."""
        segment_inputs, extras = score_mods.split_inputs(self.options["mods"], inputs)
        options = {n: o for n, o in self.options.items() if n != "mods"}
        cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape,
                                          (q.dtype.name, k.dtype.name, v.dtype.name),
                                          **options)
        automatic = (self.options["num_chunks_q"] is None, self.options["num_chunks_kv"] is None)
        cfg = cfg.with_segments(*segment_inputs, automatic)
        return score_mods.check_extras(cfg, self.options["mods"], extras)

    def build(self, q, k, v, *inputs):
        segment_inputs, extras = score_mods.split_inputs(self.options["mods"], inputs)
        cfg = self.config(q, k, v, *inputs)
        G, D, f32 = cfg.groups, cfg.head_dim, blocks.float32()
        with popxl.in_sequence():  # the q loop writes out/lse in place: read them after it
            q_pad = blocks.pad_rows(q, cfg.padded_q_len)
            k_pad = blocks.pad_rows(k, cfg.padded_kv_len)
            v_pad = blocks.pad_rows(v, cfg.padded_kv_len)
            out = ops.init((G, cfg.padded_q_len, D), q.dtype, init_type="zero")
            lse = ops.init((G, cfg.padded_q_len), f32, init_type="zero")
            if (cfg.schedule.visited_per_q == 0).any():  # chunks no step writes: lse -inf
                lse = blocks.fill(lse, float("-inf"))
            steps = cfg.schedule.visited_blocks
            seg = []
            if cfg.segments is not None and steps:
                seg, classes = segments.prepare(cfg, *segment_inputs)
                seg.append(blocks.runtime_branches(cfg, "q_major", classes))
            if cfg.mods is not None and steps:
                seg += score_mods.prepare(cfg, extras)
            if steps:
                body = build_loop_graph(cfg, q_pad, k_pad, v_pad, seg)
                ops.repeat(body, steps, blocks.counter(0), *_init_state(cfg), q_pad, k_pad,
                           v_pad, out, lse, *seg)
            return blocks.unpad_rows(out, cfg.q_len), blocks.unpad_rows(lse, cfg.q_len)


def build_loop_graph(cfg, q_pad, k_pad, v_pad, seg=()):
    """Create the branch graphs and the repeat body over the q-major block list.

    Args:
        cfg: the :class:`AttentionConfig`.
        q_pad, k_pad, v_pad: padded inputs (only their specs are used).
        seg: with segment ids, the padded ids (and positions) and the runtime branches
            (specs used).

    Returns:
        The body graph (inputs ``t, m_i, l_i, acc, q, k, v, out, lse``).
    """
    ir = popxl.gcg().ir
    G, D, f32 = cfg.groups, cfg.head_dim, blocks.float32()
    spec = loop_spec(cfg, q_pad.dtype)
    step = blocks.BlockStep(spec, cfg)
    return ir.create_graph(_block_body, cfg, step, popxl.TensorSpec((1,), popxl.int32),
                           *spec.block_specs, q_pad.spec, k_pad.spec, v_pad.spec,
                           popxl.TensorSpec((G, cfg.padded_q_len, D), q_pad.dtype),
                           popxl.TensorSpec((G, cfg.padded_q_len), f32),
                           *(t.spec for t in seg))
