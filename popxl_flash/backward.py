"""FlashAttention backward as a ``popxl.Module`` (FlashAttention-2 algorithm 2, stash mode).

PopART cannot differentiate ``ops.repeat``, so the gradient is written by hand. It recomputes
only the block probabilities from the stashed ``lse``; it never reruns the forward.

Graph structure::

    build(dout, q, k, v, out, lse)
      Dvec = rowsum(dout * out)                   [G, Lq]    float32, once
      pad everything to whole chunks
      repeat V x block_body                        # one step per visited block, kv-major
        i, j, branch = block_list[t]               # planner constants (pattern ids: in partials)
        q_i, do_i, lse_i, Dvec_i, dq_i = dynamic_slice(..., i); k_j, v_j = dynamic_slice(..., j)
        conditional(branch, ...)                   # (full|partial, whole|split, last) graphs
                                                   # last block of kv chunk j: fresh dk_j, dv_j
        dynamic_update_(dq, i, dq_i)               # by-ref accumulators, in place
        dynamic_update_(dk, j, dk_j), dynamic_update_(dv, j, dv_j)   # the last write wins

Per visited block (5 matmuls; statistics and accumulators float32)::

    P    = exp(scale * q_i k_j^T - lse_i)          (masked to 0 in partial blocks)
    dv_j += P^T do_i
    dS   = P * (do_i v_j^T - Dvec_i)
    dq_i += scale * dS k_j
    dk_j += scale * dS^T q_i
"""
from popxl_flash import blocks, score_mods, segments
from popxl_flash.backend import popxl
from popxl_flash.config import AttentionConfig

ops = popxl.ops
ByRef = popxl.TensorByRef


_mm = blocks.matmul_f32
_fold, _unfold = blocks.fold_heads, blocks.unfold_heads


def grad_block_update(cfg, dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j, visible=None,
                      extra=None):
    """One block of the backward.

    Args:
        cfg: the :class:`AttentionConfig`.
        dq_i: float32 ``[G, cq, D]``; dk_j, dv_j: float32 ``[Gk, ckv, D]`` accumulators.
        q_i, do_i: ``[G, cq, D]``; k_j, v_j: ``[Gk, ckv, D]`` in the input dtype (``Gk < G``:
            grouped-query attention; the matmuls fold q's groups, :func:`blocks.fold_heads`,
            so dk_j and dv_j sum over the q groups sharing a kv group inside the matmul).
        lse_i, dvec_i: float32 ``[G, cq, 1]``.
        visible: ``None`` (full block) or bool ``[1, cq, ckv]`` (partial block).
        extra: with score modifiers, the block's operands (:mod:`popxl_flash.score_mods`).

    Returns:
        Updated ``(dq_i, dk_j, dv_j)``.
    """
    f32 = blocks.float32()
    s = blocks.scores(cfg, q_i, k_j)  # [G, cq, ckv]
    if extra is not None:  # softcap, ALiBi, score_mod; chain: dS of the modified scores -> dS
        s, chain = score_mods.modify(cfg, s, extra, backward=True)
    if visible is None:
        p = ops.exp(s - lse_i)  # every row of a full block sees something: lse_i finite
    else:
        # Rows that see nothing have lse_i = -inf: subtract 0 there (s + inf would trap under
        # FP checks), and send masked cells to exp(MASKED_SCORE) = 0 exactly.
        seen = ops.greater(lse_i, blocks.scalar(blocks.MASKED_SCORE, f32))  # [G, cq, 1]
        lse_safe = ops.where(seen, lse_i, blocks.scalar(0.0, f32))
        x = ops.where(visible, s - lse_safe, blocks.scalar(blocks.MASKED_SCORE, f32))
        p = ops.exp(x)  # [G, cq, ckv]
    do_f = _fold(cfg, do_i)  # [Gk, r*cq, D]
    p_drop = p if extra is None else score_mods.drop(cfg, p, extra)  # dropout: P * keep / (1-p)
    p_t = _fold(cfg, blocks.to_input_dtype(cfg, p_drop)).transpose((0, 2, 1))  # [Gk, ckv, r*cq]
    dv_j = dv_j + _mm(p_t, do_f)  # [Gk, ckv, D]
    dp = _unfold(cfg, _mm(do_f, v_j.transpose((0, 2, 1))))  # [G, cq, ckv]
    if extra is None:
        ds = _fold(cfg, blocks.to_input_dtype(cfg, p * (dp - dvec_i)))  # [Gk, r*cq, ckv]
    else:  # dP = dP_dropped * keep / (1 - p); dS through the score modifiers
        ds = chain(p * (score_mods.drop(cfg, dp, extra) - dvec_i))
        ds = _fold(cfg, blocks.to_input_dtype(cfg, ds))
    dq_i = dq_i + _unfold(cfg, _mm(ds, k_j)) * cfg.scale  # [G, cq, D]
    dk_j = dk_j + _mm(ds.transpose((0, 2, 1)), _fold(cfg, q_i)) * cfg.scale  # [Gk, ckv, D]
    return dq_i, dk_j, dv_j


def _init_state(cfg):
    """Running ``dk_j, dv_j`` at a kv chunk's first block: zeros, float32 ``[Gk, ckv, D]``
    (two distinct tensors: one parent tensor may not feed two repeat inputs)."""
    shape = (cfg.kv_groups, cfg.chunk_kv, cfg.head_dim)
    return tuple(ops.init(shape, blocks.float32(), init_type="zero") for _ in range(2))


def _finish(cfg, dk_j, dv_j):
    """A kv chunk's results are its accumulated ``dk_j, dv_j``."""
    return dk_j, dv_j


def loop_spec(cfg, dtype):
    """The backward's :class:`blocks.LoopSpec` (kv-major block list, FlashAttention-2 step).

    Args:
        cfg: the :class:`AttentionConfig`.
        dtype: the popxl dtype of q, k, v.
    """
    G, Gk, D, cq, ckv = cfg.groups, cfg.kv_groups, cfg.head_dim, cfg.chunk_q, cfg.chunk_kv
    f32, spec = blocks.float32(), popxl.TensorSpec
    kv_acc = spec((Gk, ckv, D), f32)
    return blocks.LoopSpec(
        order="kv_major", update=grad_block_update,
        roles=("q", "kv", "kv", "q", "q", "q", "q", "kv", "kv"),
        block_specs=(spec((G, cq, D), f32), kv_acc, kv_acc),
        operand_specs=(spec((G, cq, D), dtype), spec((G, cq, D), dtype), spec((G, cq, 1), f32),
                       spec((G, cq, 1), f32), spec((Gk, ckv, D), dtype),
                       spec((Gk, ckv, D), dtype)),
        carried=(1, 2), init=_init_state, finish=_finish, finished_specs=(kv_acc, kv_acc))


def _block_body(cfg, step, t, dk_j, dv_j, q, do, lse, dvec, k, v, dq: ByRef, dk: ByRef,
                dv: ByRef, *seg):
    """Repeat body: one visited block of the kv-major block list.

    Carried: step ``t [1]`` and the running ``dk_j, dv_j [Gk, ckv, D]`` (float32; fresh after a
    kv chunk's last block). Invariant: padded ``q, do``, ``lse, dvec [G, Lq_pad, 1]``,
    ``k, v`` by value (read-only, so the lowering can alias them) and, by reference, the
    float32 accumulators ``dq [G, Lq_pad, D]``
    (chunk i read and written back every step) and ``dk, dv [Gk, Lkv_pad, D]`` (chunk j written
    every step: zeros until the kv chunk's last block writes the result). With segment ids,
    ``seg`` holds the padded ids (and positions) and the steps' runtime branches (read-only,
    by value).
    """
    cq, ckv = cfg.chunk_q, cfg.chunk_kv
    seg, extras = score_mods.split_loop_inputs(cfg, seg)
    *seg, branches = seg or (None,)
    i0, j0, branch = step.tables(branches).lookup(t)  # first rows of the chunks
    q_i, do_i, lse_i, dvec_i, dq_i = (blocks.rows(x, i0, cq) for x in (q, do, lse, dvec, dq))
    k_j, v_j = blocks.rows(k, j0, ckv), blocks.rows(v, j0, ckv)  # [Gk, ckv, D]
    seg_operands = segments.step_operands(cfg, seg, i0, j0) if seg else []
    if cfg.mods is not None:
        seg_operands += score_mods.step_operands(cfg, extras, i0, j0, seg_operands)
    dk_j, dv_j, dq_i, dk_done, dv_done = step.run(
        t, branch, (dq_i, dk_j, dv_j, q_i, do_i, lse_i, dvec_i, k_j, v_j, *seg_operands))
    blocks.write_rows_(dq, i0, dq_i)
    blocks.write_rows_(dk, j0, dk_done)
    blocks.write_rows_(dv, j0, dv_done)
    return t + 1, dk_j, dv_j


def _build_loop_graph(cfg, q, do, lse, dvec, k, v, seg=()):
    """Create the branch graphs and the repeat body over the kv-major block list (from specs).

    ``seg``: with segment ids, the padded ids (and positions) and the runtime branches.

    Returns:
        The body graph (inputs ``t, dk_j, dv_j, q, do, lse, dvec, k, v, dq, dk, dv``).
    """
    ir = popxl.gcg().ir
    G, D, f32 = cfg.groups, cfg.head_dim, blocks.float32()
    spec = loop_spec(cfg, q.dtype)
    step = blocks.BlockStep(spec, cfg)
    dq_spec = popxl.TensorSpec((G, cfg.padded_q_len, D), f32)
    dkv_spec = popxl.TensorSpec((cfg.kv_groups, cfg.padded_kv_len, D), f32)
    return ir.create_graph(_block_body, cfg, step, popxl.TensorSpec((1,), popxl.int32),
                           *spec.block_specs[1:], q.spec, do.spec, lse.spec, dvec.spec, k.spec,
                           v.spec, dq_spec, dkv_spec, dkv_spec, *(t.spec for t in seg))


class FlashAttentionGrad(popxl.Module):
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

    def __init__(self, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                 window=None, mods=None):
        self.options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window, mods=mods)

    def config(self, dout, q, k, v, out, lse, *inputs) -> AttentionConfig:
        """Validate all specs against the options."""
        segment_inputs, extras = score_mods.split_inputs(self.options["mods"], inputs)
        options = {n: o for n, o in self.options.items() if n != "mods"}
        cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape,
                                          (q.dtype.name, k.dtype.name, v.dtype.name),
                                          **options)
        automatic = (self.options["num_chunks_q"] is None, self.options["num_chunks_kv"] is None)
        cfg = cfg.with_segments(*segment_inputs, automatic)
        cfg = score_mods.check_extras(cfg, self.options["mods"], extras)
        for name, t in (("dout", dout), ("out", out)):
            cfg.check_like(name, t.shape, t.dtype.name, q.shape, cfg.dtype)
        cfg.check_like("lse", lse.shape, lse.dtype.name, (cfg.groups, cfg.q_len), "float32")
        return cfg

    def build(self, dout, q, k, v, out, lse, *inputs):
        segment_inputs, extras = score_mods.split_inputs(self.options["mods"], inputs)
        cfg = self.config(dout, q, k, v, out, lse, *inputs)
        f32 = blocks.float32()
        G, Lq, D = cfg.groups, cfg.q_len, cfg.head_dim
        with popxl.in_sequence():  # the loops write dq/dk/dv in place: read them after
            # Dvec = rowsum(dO * O)  [G, Lq, 1] float32, computed once
            dvec = ops.sum(blocks.to_float32(dout) * blocks.to_float32(out), axis=-1,
                           keepdims=True)
            padded = [blocks.pad_rows(t, cfg.padded_q_len)
                      for t in (q, dout, lse.reshape((G, Lq, 1)), dvec)]
            k_pad, v_pad = (blocks.pad_rows(t, cfg.padded_kv_len) for t in (k, v))
            Gk, Lq_pad, Lkv_pad = cfg.kv_groups, cfg.padded_q_len, cfg.padded_kv_len
            grads = [ops.init(shape, f32, init_type="zero")  # dq, dk, dv
                     for shape in ((G, Lq_pad, D), (Gk, Lkv_pad, D), (Gk, Lkv_pad, D))]
            steps = cfg.schedule.visited_blocks
            seg = []
            if cfg.segments is not None and steps:
                seg, classes = segments.prepare(cfg, *segment_inputs)
                seg.append(blocks.runtime_branches(cfg, "kv_major", classes))
            if cfg.mods is not None and steps:
                seg += score_mods.prepare(cfg, extras)
            if steps:
                body = _build_loop_graph(cfg, *padded, k_pad, v_pad, seg)
                ops.repeat(body, steps, blocks.counter(0), *_init_state(cfg), *padded, k_pad,
                           v_pad, *grads, *seg)
            return tuple(blocks.to_input_dtype(cfg, blocks.unpad_rows(t, n))
                         for t, n in zip(grads, (Lq, cfg.kv_len, cfg.kv_len)))
