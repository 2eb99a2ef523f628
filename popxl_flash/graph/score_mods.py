"""Score modifiers and attention dropout, as PopXL graph code: softcap, ALiBi, a user
``score_mod`` and dropout on the probabilities (FlashAttention-2's semantics).

Per block, in float32 and in this order (``s = scale * q_i k_j^T`` from :func:`blocks.scores`)::

    softcap:   s = softcap * tanh(s / softcap)               (softcap > 0)
    ALiBi:     s = s - slope[g] * |q_idx + off - kv_idx|     (off = Lkv - Lq; with varlen
                                                              positions, off = 0)
    score_mod: s = score_mod(s, g, q_idx, kv_idx, *inputs)
    (mask, online softmax: lse is the logsumexp of these modified, masked scores)
    dropout:   P V becomes (P * keep / (1 - p)) V            (keep: a per-block random mask)

``q_idx``/``kv_idx`` are the positions the causal mask compares: absolute row and column
indices, or, with the varlen API's positions, the per-sequence bottom-right positions
(``i - seqlen_q`` and ``j - seqlen_k``: their difference is FlashAttention's
``i + seqlen_k - seqlen_q - j``).

The block updates touch this only at two points: :func:`modify` on the scores (forward and
backward; the backward also gets the chain rule back), :func:`drop` on the probabilities. The
loop-invariant tensors (ALiBi slopes, the dropout seed, ``score_mod_inputs``) enter the modules
after the segment inputs ("extras": :func:`split_inputs`), are prepared once per call
(:func:`prepare`), enter each loop body after its segment inputs, and each step turns them into
operands the update takes after its own (:func:`step_operands`).

Dropout keep masks: the step whose (sub-)block starts at row ``i0``, column ``j0`` draws
``random_uniform(seed_ij, [G, rows, cols])`` and keeps ``u > p``, with
``seed_ij = base + [0, i0 * Lkv_pad + j0]`` (uint32, wrapping) and ``base`` the first seed of
``ops.split_random_seed(seed, 1)``. The seed depends on the step's (sub-)block, not on the loop
step, so the backward (kv-major, with the same sub-blocks: :mod:`popxl_flash.plan.steps`)
regenerates exactly the forward's (q-major) mask; on the IPU this relies on poprand giving
equal values for an equal seed and shape (``RandomUniformOpx`` maps a fresh output linearly).
Masks are tied to the chunk sizes: the backward must use the forward's (checked for stashed
outputs). Distinct steps get distinct seeds while ``Lq_pad * Lkv_pad < 2**32``.
"""
from dataclasses import dataclass, replace

import numpy as np

from popxl_flash.backend import popxl

ops = popxl.ops


from popxl_flash.plan.score_mods import ScoreMods, options  # noqa: F401


def split_inputs(mods, inputs):
    """Split a module's inputs after ``q, k, v`` into segment inputs and extras.

    Returns:
        ``(segment_inputs, extras)``: the segment slots ``(q_segment_ids, kv_segment_ids,
        q_positions, kv_positions, step_table)`` (``None`` where absent; the step table is
        context parallelism's, :class:`popxl_flash.plan.segments.SegmentConfig`) and the last
        ``mods.num_inputs`` tensors.
    """
    n = 0 if mods is None else mods.num_inputs
    if len(inputs) < n or len(inputs) - n > 5:
        raise ValueError(f"expected up to 4 segment inputs (and context parallelism's step "
                         f"table) then {n} score-modifier inputs (alibi slopes, seed, "
                         f"score_mod_inputs), got {len(inputs)} inputs after q, k, v")
    seg = tuple(inputs[:len(inputs) - n])
    return seg + (None,) * (5 - len(seg)), tuple(inputs[len(inputs) - n:])


def check_extras(cfg, mods, extras):
    """Validate the extras' specs; return ``cfg`` with ``mods`` set (unchanged when None)."""
    if mods is None:
        return cfg
    named = unpack_names(mods, extras)
    slopes, seed = named.get("alibi_slopes"), named.get("seed")
    if slopes is not None and (tuple(slopes.shape) != (cfg.groups,)
                               or slopes.dtype.name != "float32"):
        raise ValueError(f"alibi_slopes must be float32 [G={cfg.groups}], got "
                         f"{tuple(slopes.shape)} {slopes.dtype.name}")
    if seed is not None and (tuple(seed.shape) != (2,) or seed.dtype.name != "uint32"):
        raise ValueError(f"seed must be a uint32 [2] tensor (PopXL's random seed), got "
                         f"{tuple(seed.shape)} {seed.dtype.name}")
    specs = tuple((tuple(t.shape), t.dtype.name) for t in named["inputs"])
    return replace(cfg, mods=replace(mods, mod_input_specs=specs))


def unpack_names(mods, extras):
    """``{"alibi_slopes": t, "seed": t, "inputs": (...)}`` from the extras tuple."""
    extras, named = list(extras), {}
    if mods.alibi:
        named["alibi_slopes"] = extras.pop(0)
    if mods.dropout > 0:
        named["seed"] = extras.pop(0)
    named["inputs"] = tuple(extras)
    return named


def prepare(cfg, extras):
    """The loop-invariant tensors of the extras, once per call (outside the loop).

    Returns:
        list: ``-slopes [G, 1, 1]`` (ALiBi), the base seed uint32 ``[2]`` (dropout), the
        score_mod inputs.
    """
    named = unpack_names(cfg.mods, extras)
    out = []
    if cfg.mods.alibi:
        out.append(ops.negate(named["alibi_slopes"]).reshape((cfg.groups, 1, 1)))
    if cfg.mods.dropout > 0:
        out.append(ops.split_random_seed(named["seed"], 1)[0])
    return out + list(named["inputs"])


def _i32(value):
    return popxl.constant(np.array(value, dtype=np.int32))


def block_seed(cfg, base, i0, j0):
    """uint32 ``[2]`` seed of the step whose (sub-)block starts at row ``i0``, column ``j0``
    (int32 ``[1]``): ``base + [0, i0 * Lkv_pad + j0]`` (wrapping)."""
    u32 = popxl.uint32
    word = ops.cast(i0, u32) * popxl.constant(np.array([cfg.padded_kv_len], np.uint32)) + \
        ops.cast(j0, u32)  # [1]
    return base + ops.concat([popxl.constant(np.zeros(1, np.uint32)), word], axis=0)


def keep_scale(cfg, seed, shape):
    """``keep / (1 - p)``, float32 ``[G, rows, cols]`` (``shape = (rows, cols)``), from a
    step's seed: ``random_uniform(seed) > p``."""
    u = ops.random_uniform(seed, (cfg.groups, *shape))
    p = cfg.mods.dropout
    keep = ops.greater(u, popxl.constant(np.float32(p)))
    return ops.where(keep, popxl.constant(np.float32(1.0 / (1.0 - p))),
                     popxl.constant(np.float32(0.0)))


def _position_rows(cfg):
    """Rows of the position operands: 1, or those of the varlen positions."""
    if cfg.segments is None or not cfg.segments.positions:
        return 1
    from popxl_flash.graph import segments
    return max(cfg.segments.q_groups, segments.kv_rows(cfg))


def step_operands(cfg, prepared, i0, j0, shape, seg_operands=()):
    """One step's modifier operands, from the prepared extras (:func:`prepare`).

    Args:
        prepared: the loop's prepared extras (loop-invariant inputs of the body).
        i0, j0: int32 ``[1]`` first row and column of the step's (sub-)block.
        shape: ``(rows, cols)`` of the step.
        seg_operands: the step's segment operands (varlen positions at 2 and 3, if any).

    Returns:
        list, in this order: ``q_idx [R, rows, 1]``, ``kv_idx [R, 1, cols]`` int32 (ALiBi,
        score_mod), ``-slopes [G, 1, 1]`` (ALiBi), ``keep / (1 - p) [G, rows, cols]``
        (dropout), the score_mod inputs.
    """
    mods, prepared, out = cfg.mods, list(prepared), []
    if mods.positions:
        out += _positions(cfg, i0, j0, shape, seg_operands)
    if mods.alibi:
        out.append(prepared.pop(0))
    if mods.dropout > 0:
        out.append(keep_scale(cfg, block_seed(cfg, prepared.pop(0), i0, j0), shape))
    return out + prepared


def _positions(cfg, i0, j0, shape, seg_operands):
    if len(seg_operands) == 4:  # varlen positions: what causal compares
        rows = _position_rows(cfg)
        return [_rows(seg_operands[2], rows), _rows(seg_operands[3], rows)]
    q = popxl.constant(np.arange(shape[0], dtype=np.int32).reshape(1, shape[0], 1))
    kv = popxl.constant(np.arange(shape[1], dtype=np.int32).reshape(1, 1, shape[1]))
    return [q + i0, kv + j0]


def _rows(t, rows):
    """``t [1 or rows, ...]`` broadcast to ``rows`` rows."""
    if t.shape[0] == rows:
        return t
    return ops.concat([t] * rows, axis=0)


def _mod_input_specs(cfg):
    return [popxl.TensorSpec(s, getattr(popxl, d)) for s, d in cfg.mods.mod_input_specs]


def _unpack_block(cfg, extra):
    extra, named = list(extra), {}
    if cfg.mods.positions:
        named["q_idx"] = extra.pop(0)  # [R, rows, 1]
        named["kv_idx"] = extra.pop(0)  # [R, 1, cols]
    if cfg.mods.alibi:
        named["neg_slopes"] = extra.pop(0)
    if cfg.mods.dropout > 0:
        named["keep"] = extra.pop(0)
    named["inputs"] = tuple(extra)
    return named


def modify(cfg, s, extra, backward=False):
    """The modified scores of one (sub-)block.

    Args:
        cfg: the config (``cfg.mods`` set). s: float32 ``[G, cq, ckv]`` (``scale * q k^T``).
        extra: the step's modifier operands (:func:`step_operands`).
        backward: also return the chain rule.

    Returns:
        ``s`` modified; with ``backward``, ``(s, chain)`` where ``chain(ds)`` maps the
        gradient of the modified scores to that of ``scale * q k^T``.
    """
    mods, x = cfg.mods, _unpack_block(cfg, extra)
    tanh = None
    if mods.softcap > 0:
        tanh = ops.tanh(s * (1.0 / mods.softcap))
        s = tanh * mods.softcap
    if mods.alibi:
        rel = x["q_idx"] - x["kv_idx"]  # [R, cq, ckv] int32
        offset = 0 if _varlen(cfg) else cfg.kv_len - cfg.q_len
        if offset:
            rel = rel + _i32(offset)
        s = s + x["neg_slopes"] * ops.abs(ops.cast(rel, popxl.float32))
    mod_grad = None
    if mods.score_mod is not None:
        s, mod_grad = _call_score_mod(cfg, s, x, backward)
    if not backward:
        return s

    def chain(ds):
        if mod_grad is not None:
            ds = mod_grad(ds)
        if tanh is not None:
            ds = ds * (popxl.constant(np.float32(1.0)) - tanh * tanh)
        return ds
    return s, chain


def _varlen(cfg):
    return cfg.segments is not None and cfg.segments.positions


def drop(cfg, p, extra):
    """``p * keep / (1 - p_drop)`` with dropout, else ``p`` (no op)."""
    if cfg.mods is None or cfg.mods.dropout == 0:
        return p
    return p * _unpack_block(cfg, extra)["keep"]


# -- score_mod graphs ---------------------------------------------------------------------------
_GRAPHS_ATTR = "_popxl_flash_score_mod_graphs"


def _score_mod_body(fn, groups, score, q_idx, kv_idx, *inputs):
    g = popxl.constant(np.arange(groups, dtype=np.int32).reshape(groups, 1, 1))
    out = fn(score, g, q_idx, kv_idx, *inputs)
    if not isinstance(out, popxl.Tensor):
        raise TypeError(f"score_mod must return a popxl.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(score.shape) or out.dtype != popxl.float32:
        raise ValueError(f"score_mod must be elementwise in score: return float32 "
                         f"{tuple(score.shape)} (score's shape), got {tuple(out.shape)} "
                         f"{out.dtype.name}")
    return out


def score_mod_graphs(cfg, score_spec, q_spec, kv_spec, input_specs, backward=False):
    """The score_mod graph for one block shape and, with ``backward``, its gradient
    (``popxl.transforms.autodiff`` with respect to ``score``), created once per Ir, score_mod
    and shapes (the gradient on first use: a forward-only score_mod need not be differentiable).

    Returns:
        ``(graph, grad_info or None)``.
    """
    ir = popxl.gcg().ir
    cache = getattr(ir, _GRAPHS_ATTR, None)
    if cache is None:
        cache = {}
        setattr(ir, _GRAPHS_ATTR, cache)
    key = (cfg.mods.score_mod, cfg.groups, tuple(score_spec.shape), tuple(q_spec.shape),
           tuple(kv_spec.shape), tuple((tuple(s.shape), s.dtype.name) for s in input_specs))
    if key not in cache:
        cache[key] = (ir.create_graph(_score_mod_body, cfg.mods.score_mod, cfg.groups,
                                      score_spec, q_spec, kv_spec, *input_specs), None)
    graph, grad = cache[key]
    if backward and grad is None:
        try:
            grad = popxl.transforms.autodiff(graph, grads_provided=graph.outputs[:1],
                                             grads_required=graph.inputs[:1])
        except Exception as err:  # noqa: BLE001 - autodiff's own error types differ by SDK
            raise ValueError(f"score_mod has no gradient with respect to score ({err}); it "
                             "must be a differentiable, elementwise function of score") from err
        cache[key] = (graph, grad)
    return cache[key]


def prebuild(cfg, backward=False):
    """Build (and so validate) the score_mod graph of a whole block (with ``backward``, its
    gradient too) now, before the caller opens a name scope or a graph (PopXL's
    ``name_scope`` is not exception-safe)."""
    if cfg.mods is None or cfg.mods.score_mod is None:
        return
    spec, rows = popxl.TensorSpec, _position_rows(cfg)
    score_mod_graphs(cfg, spec((cfg.groups, cfg.chunk_q, cfg.chunk_kv), popxl.float32),
                     spec((rows, cfg.chunk_q, 1), popxl.int32),
                     spec((rows, 1, cfg.chunk_kv), popxl.int32), _mod_input_specs(cfg), backward)


def _call_score_mod(cfg, s, x, backward):
    inputs = x["inputs"]
    graph, grad = score_mod_graphs(cfg, s.spec, x["q_idx"].spec, x["kv_idx"].spec,
                                   [t.spec for t in inputs], backward)
    info = ops.call_with_info(graph, s, x["q_idx"], x["kv_idx"], *inputs)
    out = info.outputs[0]
    if not backward:
        return out, None

    def mod_grad(ds):
        return ops.call(grad.graph, ds, inputs_dict=grad.inputs_dict(info))[0]
    return out, mod_grad


# -- the returned dropout mask ------------------------------------------------------------------
def dropout_mask(cfg, seed):
    """The keep mask of every step, assembled: bool ``[G, Lq, Lkv]`` (O(L^2): tests and small
    sizes only). Built in the current graph from the user's seed, step by step as the loops
    draw it (:mod:`popxl_flash.plan.steps`: the forward's sub-blocks, or the whole block of a
    pass of one block; the backward's are the same);
    cells no step covers are never visible and read True.
    """
    from popxl_flash.plan import steps
    base = ops.split_random_seed(seed, 1)[0]
    mask = popxl.constant(np.ones((cfg.groups, cfg.padded_q_len, cfg.padded_kv_len),
                                  np.float32))
    blocks = [(group.rows, group.cols, r0, c0)
              for group in steps.step_groups(cfg.schedule, "q_major")
              for r0, c0 in zip(group.q_row, group.kv_row)]
    if steps.single_block(cfg.schedule, cfg.segments is not None):  # one draw, whole block
        blocks = [(cfg.q_len, cfg.kv_len, 0, 0)]
    for rows, cols, r0, c0 in blocks:
        i0, j0 = (popxl.constant(np.array([x], np.int32)) for x in (r0, c0))
        keep = keep_scale(cfg, block_seed(cfg, base, i0, j0), (rows, cols))
        at = popxl.constant(np.array([r0, c0], np.int32))
        mask = ops.dynamic_update(mask, at, keep, axes=[1, 2], sizes=[rows, cols],
                                  no_overlap=True)
    mask = ops.greater(mask, popxl.constant(np.float32(0.0)))
    if (cfg.padded_q_len, cfg.padded_kv_len) != (cfg.q_len, cfg.kv_len):
        mask = ops.slice(mask, start=[0, 0], stop=[cfg.q_len, cfg.kv_len], axis=[1, 2])
    return mask


# -- cost report (pf.explain) -------------------------------------------------------------------
@dataclass(frozen=True)
class ScoreModCost:
    """What a ``score_mod`` adds to one attention call (:func:`cost`).

    Attributes:
        ops: ops of its graph on one block (forward; the backward runs them again).
        grad_ops: ops of its gradient graph (``popxl.transforms.autodiff``), backward only.
        steps: block steps per pass, looped or inline (each calls it once; a pass of one
            block: 1).
        cells: (query, key) cells per group the steps run on (``executed_elements``).
        forward_flops, backward_flops: ``ops (+ grad_ops) * G * cells``, counting one FLOP per
            op and score element: an upper bound (ops on the broadcast index tensors touch
            fewer elements).
    """
    ops: int
    grad_ops: int
    steps: int
    cells: int
    forward_flops: int
    backward_flops: int

    def line(self):
        """One line for :meth:`ChunkChoice.table`."""
        return (f"score_mod: {self.ops} ops/step forward, +{self.grad_ops} gradient ops/step "
                f"backward; <= {self.forward_flops:,} FLOPs forward, <= "
                f"{self.backward_flops:,} backward ({self.steps} steps, {self.cells:,} cells "
                "per group)")


def cost(score_mod, *, groups, chunk_q, chunk_kv, steps, cells, input_specs=()):
    """Build ``score_mod``'s graph and gradient in a scratch ``popxl.Ir`` and count their ops.

    Args:
        score_mod: the function. groups, chunk_q, chunk_kv: the block shape.
        steps: loop steps per pass; cells: (query, key) cells per group they run on.
        input_specs: ``popxl.TensorSpec`` of its inputs.

    Returns:
        :class:`ScoreModCost`.
    """
    ir = popxl.Ir()
    with ir.main_graph:
        spec, i32 = popxl.TensorSpec, popxl.int32
        graph = ir.create_graph(_score_mod_body, score_mod, groups,
                                spec((groups, chunk_q, chunk_kv), popxl.float32),
                                spec((1, chunk_q, 1), i32), spec((1, 1, chunk_kv), i32),
                                *input_specs)
        grad = popxl.transforms.autodiff(graph, grads_provided=graph.outputs[:1],
                                         grads_required=graph.inputs[:1])
    ops_f, ops_b = (len(g._pb_graph.getOps()) for g in (graph, grad.graph))
    elements = groups * cells
    return ScoreModCost(ops_f, ops_b, steps, cells, ops_f * elements,
                        (ops_f + ops_b) * elements)


def _choice_class():
    from popxl_flash.plan.costmodel import ChunkChoice

    @dataclass(frozen=True)
    class ChoiceWithScoreMod(ChunkChoice):
        """A :class:`~popxl_flash.plan.costmodel.ChunkChoice` with the cost of a ``score_mod``."""
        score_mod: ScoreModCost = None

        def table(self):
            return super().table() + "\n" + self.score_mod.line()
    return ChoiceWithScoreMod


ChoiceWithScoreMod = _choice_class()


def with_score_mod_cost(choice, mod_cost):
    """``choice`` (a :class:`~popxl_flash.plan.costmodel.ChunkChoice`) with ``.score_mod`` set."""
    from dataclasses import fields
    values = {f.name: getattr(choice, f.name) for f in fields(choice)}
    return ChoiceWithScoreMod(**values, score_mod=mod_cost)
