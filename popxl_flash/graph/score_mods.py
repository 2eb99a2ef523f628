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

Dropout keep masks are a function of (seed, g, row, column) alone, FlashAttention's contract
(its Philox takes the element's position as the counter): element ``(g, r, c)`` is kept iff
``y >= round(p * 2**32)`` with, in uint32 arithmetic wrapping modulo 2**32,

    A = R(R(r * HASH_ROW + s0) + s1 + g * HASH_GROUP)     (per row and group)
    B = R(R(c * HASH_COL + s0) + s1)                      (per column)
    y = (A + B)(2 (A + B) + 1)                            (per element)

``s0, s1`` the words of the user's seed and ``R(x)`` = ``x (2x + 1)`` rotated by 16 bits
(:func:`_hash_round`; PopXL 3.4 has no bitwise ops, so the rotation is ``y / 2**16 +
y * 2**16``). Each call computes ``[A; 2A + 1]`` for every (padded) row and ``[B; 2B]`` for
every column once (:func:`prepare`: ~20 small ops, rows and columns in one tensor); a step
slices its rows and columns (two ``dynamic_slice``, none when the step spans the call) and
runs 3 ops on its block (one add on both halves, one mul, one compare) and the ``where`` that
makes ``keep / (1 - p)``. Every
structure (one-block pass, row passes, loops, the kv-major backward, any chunks) computes the
same bits for an element, and :func:`dropout_mask` returns them. ``r`` and ``c`` are the rows'
and columns' indices in the call's tensors (with segment ids and varlen: in the packed rows);
with ``mods.dropout_positions`` (context parallelism) they are the call's position inputs, the
global positions, hashed once per call the same way.
"""
from dataclasses import dataclass, replace

import numpy as np

from popxl_flash.backend import popxl

ops = popxl.ops


from popxl_flash.plan.score_mods import (HASH_COL, HASH_GROUP, HASH_ROW,  # noqa: F401
                                         ScoreMods, keep_threshold, options)


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


def prepare(cfg, extras, segment_inputs=()):
    """The loop-invariant tensors of the extras, once per call (outside the loop).

    Args:
        cfg: the config. extras: the module's score-modifier inputs. segment_inputs: the
            module's segment inputs (read with ``mods.dropout_positions`` only).

    Returns:
        list: ``-slopes [G, 1, 1]`` (ALiBi); with dropout the hash halves of every (padded)
        row and column (:func:`hash_keys`, uint32 ``[2, G, Lq_pad, 1]`` and ``[2, 1, 1,
        Lkv_pad]``: of the indices, or with ``mods.dropout_positions`` of the positions);
        the score_mod inputs.
    """
    named = unpack_names(cfg.mods, extras)
    out = []
    if cfg.mods.alibi:
        out.append(ops.negate(named["alibi_slopes"]).reshape((cfg.groups, 1, 1)))
    if cfg.mods.dropout > 0:
        if cfg.mods.dropout_positions:
            out += list(_position_keys(cfg, named["seed"], segment_inputs))
        else:
            out += list(_index_keys(cfg, named["seed"]))
    return out + list(named["inputs"])


def _i32(value):
    return popxl.constant(np.array(value, dtype=np.int32))


# -- the dropout keep mask: a hash of (seed, g, row, column) ------------------------------------
def _u32(value):
    return popxl.constant(np.array(value, dtype=np.uint32))


def _hash_round(x):
    """One mixing round on uint32 (wrapping): ``y = x (2x + 1)`` (RC6's quadratic, a bijection
    of the 32-bit integers), then ``y`` rotated by 16 bits as ``y / 2**16 + y * 2**16`` (the two
    halves do not overlap, so ``+`` is the bitwise or PopXL lacks). 6 elementwise ops.

    Args:
        x: uint32 tensor. Returns: uint32, ``x``'s shape.
    """
    y = x * (x * _u32(2) + _u32(1))
    return y / _u32(1 << 16) + y * _u32(1 << 16)


def _seed_words(seed):
    """The user's uint32 ``[2]`` seed as two ``[1]`` tensors."""
    return (ops.slice(seed, start=[i], stop=[i + 1], axis=[0]) for i in (0, 1))


def _scaled_keys(rows, cols):
    """uint32 ``[1, 1, n + m]``: ``rows * HASH_ROW`` then ``cols * HASH_COL`` (wrapping).

    Args:
        rows, cols: host integer arrays (a constant, no op) or int32/uint32 tensors of ``n``
            and ``m`` elements (context parallelism's positions: a cast, a mul each, a concat).
    """
    parts = [_scaled(x, k) for x, k in ((rows, HASH_ROW), (cols, HASH_COL))]
    if not any(isinstance(x, popxl.Tensor) for x in parts):
        return _u32(np.concatenate(parts, axis=2))
    return ops.concat([x if isinstance(x, popxl.Tensor) else _u32(x) for x in parts], axis=2)


def _scaled(x, k):
    """``x * k`` modulo 2**32 as ``[1, 1, n]``: a host array for a host ``x``, else a tensor."""
    if not isinstance(x, popxl.Tensor):
        return (np.asarray(x, np.uint64).reshape(1, 1, -1) * k % 2 ** 32).astype(np.uint32)
    x = x if x.dtype == popxl.uint32 else ops.cast(x, popxl.uint32)
    return x.reshape((1, 1, _count(x))) * _u32(k)


def hash_keys(groups, seed, rows, cols):
    """The row and column halves of the keep-mask hash (:func:`keep_from_keys`), all rows and
    columns in one tensor ``[G, 1, n + m]`` (one op per hash step for both)::

        A[g, r] = R(R(r * HASH_ROW + s0) + s1 + g * HASH_GROUP)
        B[c]    = R(R(c * HASH_COL + s0) + s1)

    ``R`` = :func:`_hash_round`, ``s0, s1`` the seed's words (~20 ops).

    Args:
        groups: G. seed: the user's uint32 ``[2]`` seed.
        rows, cols: the global row and column indices, ``n`` and ``m`` of them (host arrays
            or int32/uint32 tensors, :func:`_scaled_keys`).

    Returns:
        ``(a, b)``: uint32 ``[2, G, n, 1]`` = ``[A; 2A + 1]`` and ``[2, 1, 1, m]`` =
        ``[B; 2B]`` (one tensor each, so a step slices each once).
    """
    keys = _scaled_keys(rows, cols)
    n, total = _count(rows), keys.shape[2]
    s0, s1 = _seed_words(seed)
    group_terms = np.zeros((groups, 1, total), np.uint64)
    group_terms[:, :, :n] = (np.arange(groups, dtype=np.uint64) * HASH_GROUP % 2 ** 32)[:, None,
                                                                                      None]
    z = _hash_round(_hash_round(keys + s0) + s1 + _u32(group_terms))  # [G, 1, n + m]
    odd = np.zeros((1, 1, total), np.uint32)
    odd[..., :n] = 1
    h = z * _u32(2) + _u32(odd)  # 2A + 1 on the rows, 2B on the columns
    both = ops.concat([t.reshape((1, groups, 1, total)) for t in (z, h)], axis=0)
    a = ops.slice(both, start=[0], stop=[n], axis=[3]).reshape((2, groups, n, 1))
    b = ops.slice(both, start=[0, n], stop=[1, total], axis=[1, 3])
    return a, b


def _count(x):
    return int(np.prod(x.shape)) if isinstance(x, popxl.Tensor) else int(np.size(x))


def threshold(p):
    """``T - 1`` as a uint32 constant (:func:`popxl_flash.plan.score_mods.keep_threshold`): a
    hash ``y`` keeps its element iff ``y > T - 1``, with probability ``1 - p`` to 2**-32."""
    return _u32(keep_threshold(p) - 1)


def keep_from_keys(a, b, p):
    """The keep mask from the hash halves of a block's rows and columns.

    ``x = A + B`` and ``y = x (2x + 1) = (A + B)(2A + 1 + 2B)`` (uint32, wrapping; one add on
    both halves at once, one mul), kept iff ``y >= round(p * 2**32)``: 3 ops on the block,
    whatever its position.

    Args:
        a: uint32 ``[2, G, rows, 1]``; b: uint32 ``[2, 1, 1, cols]`` (:func:`hash_keys`,
            sliced to the block). p: the dropout probability.

    Returns:
        bool ``[G, rows, cols]``.
    """
    x = a + b  # [2, G, rows, cols]
    halves = [ops.slice(x, start=[i], stop=[i + 1], axis=[0]) for i in (0, 1)]
    y = halves[0] * halves[1]
    keep = ops.greater(y, threshold(p))
    return keep.reshape(tuple(keep.shape[1:]))


def keep_scale(cfg, a, b):
    """``keep / (1 - p)``, float32 ``[G, rows, cols]``, from the block's hash halves
    (:func:`keep_from_keys`)."""
    p = cfg.mods.dropout
    return ops.where(keep_from_keys(a, b, p), popxl.constant(np.float32(1.0 / (1.0 - p))),
                     popxl.constant(np.float32(0.0)))


def _index_keys(cfg, seed):
    """:func:`hash_keys` of every (padded) row and column index, once per call (host
    constants for the scaled indices)."""
    return hash_keys(cfg.groups, seed, np.arange(cfg.padded_q_len),
                     np.arange(cfg.padded_kv_len))


def _cut(t, offset, axis, size):
    """``t``'s ``size`` entries from ``offset`` (int32 ``[1]``) on ``axis``; ``t`` itself when
    it has exactly ``size``."""
    if t.shape[axis] == size:
        return t
    return ops.dynamic_slice(t, offset, axes=[axis], sizes=[size], no_overlap=True)


def _position_keys(cfg, seed, segment_inputs):
    """:func:`hash_keys` of the call's positions (``mods.dropout_positions``), once per call:
    ``q_positions``/``kv_positions`` (int32 ``[1, L]``) padded with zeros to the padded
    lengths (padding is never visible)."""
    keys = []
    for t, length in ((segment_inputs[2], cfg.padded_q_len),
                      (segment_inputs[3], cfg.padded_kv_len)):
        if t is None or t.shape[0] != 1:
            raise ValueError("dropout keyed by positions needs q_positions and kv_positions "
                             f"of one row, [1, L]; got {None if t is None else tuple(t.shape)}")
        pad = length - t.shape[1]
        keys.append(t if pad == 0 else ops.concat(
            [t, popxl.constant(np.zeros((1, pad), np.int32))], axis=1))
    return hash_keys(cfg.groups, seed, *keys)


def _step_keep(cfg, prepared, i0, j0, shape):
    """A step's ``keep / (1 - p)``: the call's prepared hash halves (consumed from
    ``prepared``) sliced at ``(i0, j0)``."""
    a, b = prepared.pop(0), prepared.pop(0)
    return keep_scale(cfg, _cut(a, i0, 2, shape[0]), _cut(b, j0, 3, shape[1]))


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
        out.append(_step_keep(cfg, prepared, i0, j0, shape))
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
    """The keep mask of a call, bool ``[G, Lq, Lkv]`` (O(L^2): tests and small sizes only): the
    hash of every (g, row, column) (:func:`keep_from_keys`), the very values every step of
    every pass computes for its block, whatever the chunks."""
    return keep_at(cfg.groups, seed, cfg.mods.dropout, np.arange(cfg.q_len),
                   np.arange(cfg.kv_len))


def keep_at(groups, seed, p, rows, cols):
    """The keep mask at given global indices, bool ``[G, n, m]``.

    Args:
        groups: G. seed: the user's uint32 ``[2]`` seed. p: the dropout probability.
        rows, cols: ``n`` and ``m`` global indices, host arrays or int32 tensors (context
            parallelism: a replica's positions).
    """
    return keep_from_keys(*hash_keys(groups, seed, rows, cols), p)


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
