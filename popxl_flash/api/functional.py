"""Functional API: call inside a PopXL graph context; returns tensors of the current graph.

Each function validates its arguments (raising ``TypeError``/``ValueError`` that name the
argument), builds the module's graph with ``ir.create_graph`` and calls it with ``ops.call``.

One graph per configuration: the graphs are cached per ``popxl.Ir``, keyed by the module, its
validated :class:`~popxl_flash.plan.config.AttentionConfig` and the input specs, so a model that
calls :func:`flash_attention` once per layer on equal specs builds the forward graphs once.
Each call and its outputs are created under ``popxl.name_scope("flash_attention")`` (or the
function's name), so tensor ids and profiles read ``flash_attention/...``.

Causal alignment is bottom-right (FlashAttention >= 2.1). With ``Lq = 2, Lkv = 5``::

    1 1 1 1 0
    1 1 1 1 1

and with ``Lq = 5, Lkv = 2`` (the first three rows see nothing: output 0, lse -inf)::

    0 0
    0 0
    0 0
    1 0
    1 1
"""
import functools

from popxl_flash.api import provenance

from popxl_flash.graph import score_mods
from popxl_flash.backend import popxl
from popxl_flash.graph.backward import FlashAttentionGrad
from popxl_flash.plan.config import AttentionConfig, check_bool
from popxl_flash.graph.forward import FlashAttention

ops = popxl.ops

#: Attribute of a ``popxl.Ir`` that holds this library's graphs, keyed by configuration.
_GRAPH_CACHE_ATTR = "_popxl_flash_graphs"

#: Keywords of flash-attn / PyTorch SDPA that the ``[G, L, D]`` API spells differently.
CORE_KEYWORD_HINTS = {
    "softmax_scale": "this API calls it scale= (pf.flash_attn_func takes flash-attn's names "
                     "and [B, L, H, D] tensors)",
    "window_size": "this API calls it window= (pf.flash_attn_func takes flash-attn's names "
                   "and [B, L, H, D] tensors)",
    "is_causal": "this API calls it causal= (PyTorch SDPA's is_causal)",
    "attn_mask": "mask tensors are not supported; use causal=, window= and q_segment_ids=/"
                 "kv_segment_ids= (packed sequences, key padding)",
    "cu_seqlens_q": "this API takes q_segment_ids=/kv_segment_ids= (pf.flash_attn_varlen_func "
                    "takes flash-attn's cu_seqlens and [total, H, D] tensors)",
    "key_padding_mask": "pass kv_segment_ids= with -1 on padding keys (and q_segment_ids= "
                        "with 0 elsewhere)",
    "dropout_p": "this API calls it dropout= (with seed=, a uint32 [2] tensor)",
    "return_attn_probs": "this API returns the dropout keep mask with return_dropout_mask=True",
}


def keyword_hints(hints):
    """Decorator: a keyword argument named in ``hints`` raises ``TypeError`` with its hint.

    Args:
        hints: ``{keyword: hint}`` for keywords the decorated function does not take but users
            coming from another attention API are likely to pass.

    Returns:
        The decorator (the wrapped function keeps its signature and docstring).
    """
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for name in kwargs:
                if name in hints:
                    raise TypeError(f"{fn.__name__}() got an unexpected keyword argument "
                                    f"{name!r}: {hints[name]}")
            return fn(*args, **kwargs)
        return wrapper
    return decorate


def check_tensors(**tensors):
    """Each value must be a ``popxl.Tensor`` of the current graph.

    Raises:
        TypeError: a value is not a ``popxl.Tensor``.
        ValueError: a tensor belongs to another ``popxl.Ir`` or to another graph of this Ir
            (PopXL has no implicit capture: pass it into the subgraph as an input).
    """
    graph = popxl.gcg()
    for name, t in tensors.items():
        if not isinstance(t, popxl.Tensor):
            shape = getattr(t, "shape", None)
            raise TypeError(f"{name} must be a popxl.Tensor, got {type(t).__name__}"
                            + (f" of shape {tuple(shape)}" if shape is not None else ""))
        if t.ir != graph.ir:
            raise ValueError(f"{name} ({t.id}) belongs to another popxl.Ir than the current "
                             f"graph {graph.name!r}; build all tensors of a model in one Ir")
        if t not in graph:
            raise ValueError(f"{name} ({t.id}) is not a tensor of the current graph "
                             f"{graph.name!r}; PopXL subgraphs cannot capture parent tensors, "
                             "so pass it in as an input of the graph you are building")


def _check_rank3(**tensors):
    """Point rank-4 ``[B, L, H, D]`` tensors at :func:`popxl_flash.flash_attn_func`."""
    for name, t in tensors.items():
        if len(t.shape) == 4:
            raise ValueError(f"{name} must have rank 3 [G, L, D] (G = batch x heads), got shape "
                             f"{tuple(t.shape)}; for [B, L, H, D] tensors use "
                             "pf.flash_attn_func, or reshape to [B*H, L, D]")


def _cached_graph(module, inputs, config=None):
    """The graph of ``module`` for ``inputs``' specs: created once per Ir and configuration.

    The key is the module class, its validated :class:`AttentionConfig` (which holds every
    option the graph depends on) and the inputs' shapes and dtypes, so equal calls anywhere in
    one Ir share one graph. The cache is an attribute of the ``popxl.Ir``: it lives and dies
    with the Ir.

    Args:
        module: a ``FlashAttention`` or ``FlashAttentionGrad``.
        inputs: the tensors its ``build`` takes.
        config: what else the graph depends on, hashable; default ``module.config(*inputs)``
            (other attention modules, such as context parallelism's, pass their own).

    Returns:
        The ``popxl.Graph``.
    """
    ir = popxl.gcg().ir
    cache = getattr(ir, _GRAPH_CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(ir, _GRAPH_CACHE_ATTR, cache)
    specs = tuple((tuple(t.shape), t.dtype.name) for t in inputs)
    key = (type(module), module.config(*inputs) if config is None else config, specs)
    if key not in cache:
        cache[key] = ir.create_graph(module, *inputs)
    return cache[key]


def _call_module(scope, module, *inputs):
    """Call ``module``'s (cached) graph on ``inputs`` under ``popxl.name_scope(scope)``.

    Validate before calling: PopXL's ``name_scope`` is not exception-safe (an error inside
    leaves the scope pushed).
    """
    with popxl.name_scope(scope):
        return ops.call(_cached_graph(module, inputs), *inputs)


def _segment_inputs(q_segment_ids, kv_segment_ids, q_positions=None, kv_positions=None):
    """Check the segment tensors that are given.

    Returns:
        The module's extra inputs: ``()`` without segment ids, else the ids (and positions;
        ``None`` where absent, so the module's validation names what is missing).
    """
    named = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                 q_positions=q_positions, kv_positions=kv_positions)
    check_tensors(**{name: t for name, t in named.items() if t is not None})
    if all(t is None for t in named.values()):
        return ()
    return tuple(named.values()) if q_positions is not None else tuple(named.values())[:2]


@keyword_hints(CORE_KEYWORD_HINTS)
def flash_attention(q, k, v, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                    window=None, return_lse=False, q_segment_ids=None, kv_segment_ids=None,
                    softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_inputs=(),
                    dropout=0.0, seed=None, return_dropout_mask=False, memory_budget=None):
    """Exact attention with O(L) memory: ``softmax(scale * q k^T + mask) v``.

    Args:
        q: ``[G, Lq, D]`` float16 or float32 (G = batch x heads).
        k, v: ``[Gk, Lkv, D]``, same dtype as q, with ``G % Gk == 0``: ``Gk = G`` is
            multi-head attention, ``Gk < G`` grouped-query attention (q group ``g`` reads kv
            group ``g // (G // Gk)``; k and v are never repeated per q group).
        num_chunks_q, num_chunks_kv: chunk counts in ``[1, L]``; ``None`` picks
            the cost model's choice (:func:`popxl_flash.explain`). Lengths need not be
            divisible (the tail chunk is padded).
        memory_budget: bytes the call may hold live beyond its own inputs and outputs; the
            automatic chunk choice is the least modelled IPU time within it (``None``: per
            pass twice its own inputs' and outputs' bytes plus 4 MiB, at most 1/8 of naive
            attention's working set, O(L), :func:`popxl_flash.plan.memory.default_budget`;
            a pass may run its memory-lean structure to meet it; the least-memory chunking
            when nothing meets that; see :func:`popxl_flash.explain`). An explicit budget no
            chunking meets raises ``ValueError``.
        causal: bottom-right aligned causal mask (row i sees j <= i + Lkv - Lq). Default
            True, as the PopART op; :func:`popxl_flash.flash_attn_func` defaults to False.
        scale: softmax scale; ``None`` means ``1/sqrt(D)``. ``1.0`` matches the PopART op.
        window: ``None`` or ``(left, right)`` local window around the diagonal; ``None`` or
            ``-1`` for an unbounded side. Intersected with ``causal``.
        return_lse: also return the logsumexp.
        q_segment_ids, kv_segment_ids: ``None`` (default) or int32 tensors ``[G or 1, Lq]`` and
            ``[Gk or 1, Lkv]`` given at run time (packed sequences, key padding): query row i
            sees key j only if ``q_segment_ids[i] == kv_segment_ids[j] >= 0`` and the static
            mask allows it; a negative id is padding (sees nothing, seen by nothing). Blocks
            whose chunks share no segment are skipped at run time (no matmul).
        softcap: ``> 0``: scores become ``softcap * tanh(s / softcap)`` (Gemma 2); 0 = off.
        alibi_slopes: ``None`` or float32 ``[G]`` runtime tensor: scores get
            ``-slope[g] * |i + Lkv - Lq - j|`` (ALiBi, FlashAttention-2's form).
        score_mod: ``None`` or ``score_mod(score, g, q_idx, kv_idx, *score_mod_inputs)``
            building PopXL ops on one block (see ``docs/user-guide.md``); elementwise in
            ``score``; its gradient comes from ``popxl.transforms.autodiff``.
        score_mod_inputs: tensors passed to ``score_mod`` (by value, no gradient).
        dropout: probability in ``[0, 1)`` of dropping an attention probability (kept ones
            are scaled by ``1 / (1 - dropout)``); needs ``seed``.
        seed: uint32 ``[2]`` tensor (PopXL's random seed) when ``dropout > 0``. Element
            ``(g, i, j)`` is dropped by a hash of (seed, g, i, j) alone (not of the chunks,
            the budget or the pass), so any backward given this seed differentiates this
            mask; see ``docs/user-guide.md``.
        return_dropout_mask: also return the keep mask, bool ``[G, Lq, Lkv]`` (the one
            the passes and any backward with this seed use): O(Lq Lkv) memory and ops, for
            tests at small sizes.

    Returns:
        out ``[G, Lq, D]`` in q's dtype; with ``return_lse``, ``(out, lse)`` where lse is
        float32 ``[G, Lq]`` (``-inf`` for rows that see no key; their out is 0); with
        ``return_dropout_mask``, the mask last.
    """
    check_tensors(q=q, k=k, v=v)
    _check_rank3(q=q, k=k, v=v)
    return_lse = check_bool("return_lse", return_lse)
    return_mask = check_bool("return_dropout_mask", return_dropout_mask)
    segments = _segment_inputs(q_segment_ids, kv_segment_ids)
    mods, extras = modifier_inputs(softcap=softcap, alibi_slopes=alibi_slopes,
                                   score_mod=score_mod, score_mod_inputs=score_mod_inputs,
                                   dropout=dropout, seed=seed)
    _check_mask_request(return_mask, mods)
    out, lse = _forward(q, k, v, segments, dict(num_chunks_q=num_chunks_q,
                                                num_chunks_kv=num_chunks_kv, causal=causal,
                                                scale=scale, window=window, mods=mods,
                                                memory_budget=memory_budget), extras)
    result = (out, lse) if return_lse else (out,)
    if return_mask:
        result += (dropout_mask(q, k, v, segments, mods, extras, num_chunks_q=num_chunks_q,
                                num_chunks_kv=num_chunks_kv, causal=causal, scale=scale,
                                window=window, seed=seed, memory_budget=memory_budget),)
    return result if len(result) > 1 else out


def prebuild_score_mod(cfg, backward=False):
    """Build a ``score_mod``'s graphs now (:func:`popxl_flash.graph.score_mods.prebuild`),
    turning any failure while its function is traced into a ``ValueError`` that says how
    tensors reach it (``score_mod_inputs``), the original error chained."""
    score_mod_traced(score_mods.prebuild, cfg, backward)


def score_mod_traced(build, *args, **kwargs):
    """``build(*args, **kwargs)``, which traces a ``score_mod``: its own errors are re-raised
    as ``ValueError`` naming ``score_mod_inputs`` (the library's checks of the result, whose
    messages begin "score_mod ", pass unchanged)."""
    try:
        return build(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - whatever the user's function raised
        if isinstance(err, (TypeError, ValueError)) and str(err).startswith("score_mod "):
            raise
        raise ValueError(
            f"score_mod failed while its graph was traced: {type(err).__name__}: "
            f"{str(err).rstrip('.')}. A "
            "score_mod runs in its own PopXL subgraph and sees only its arguments (score, g, "
            "q_idx, kv_idx, *score_mod_inputs): pass every tensor it uses through "
            "score_mod_inputs=(t, ...) and take it as an extra parameter, instead of capturing "
            "it from an enclosing scope (PopXL subgraphs cannot capture parent tensors)") \
            from err


def score_mod_input_tuple(score_mod_inputs, kinds=None, what="popxl.Tensor"):
    """``score_mod_inputs`` as a tuple (one tensor alone becomes a 1-tuple).

    Args:
        score_mod_inputs: a tuple or list (or one item) of ``kinds``.
        kinds: the accepted item types (default ``popxl.Tensor``; each item is checked by the
            caller, e.g. :func:`check_tensors`). what: their name in the message.

    Returns:
        The tuple.
    """
    kinds = (popxl.Tensor,) if kinds is None else kinds
    if isinstance(score_mod_inputs, kinds):
        score_mod_inputs = (score_mod_inputs,)
    if not isinstance(score_mod_inputs, (tuple, list)):
        raise TypeError(f"score_mod_inputs must be a tuple of {what}, got "
                        f"{type(score_mod_inputs).__name__}")
    return tuple(score_mod_inputs)


def modifier_inputs(*, softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_inputs=(),
                    dropout=0.0, seed=None, dropout_name="dropout"):
    """Validate the score-modifier and dropout arguments.

    Returns:
        ``(mods, extras)``: the :class:`~popxl_flash.graph.score_mods.ScoreMods` (``None`` when all
        are off) and the module's extra inputs (slopes, seed, score_mod inputs).
    """
    inputs = score_mod_input_tuple(score_mod_inputs)
    named = {f"score_mod_inputs[{n}]": t for n, t in enumerate(inputs)}
    named.update({n: t for n, t in (("alibi_slopes", alibi_slopes), ("seed", seed))
                  if t is not None})
    check_tensors(**named)
    if seed is not None and (tuple(seed.shape) != (2,) or seed.dtype.name != "uint32"):
        raise ValueError(f"seed must be a uint32 [2] tensor (PopXL's random seed), got "
                         f"{tuple(seed.shape)} {seed.dtype.name}")
    try:
        mods = score_mods.options(softcap, alibi_slopes is not None, score_mod, len(inputs),
                                  dropout)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("dropout=", f"{dropout_name}=")
                        .replace("dropout must", f"{dropout_name} must")) from None
    if mods is not None and mods.dropout > 0 and seed is None:
        raise ValueError(f"{dropout_name}={mods.dropout} needs seed=, a uint32 [2] tensor "
                         "(PopXL's random seed), got seed=None")
    extras = ([alibi_slopes] if alibi_slopes is not None else []) + \
        ([seed] if mods is not None and mods.dropout > 0 else []) + list(inputs)
    return mods, tuple(extras)


def _check_mask_request(return_mask, mods, name="return_dropout_mask", dropout="dropout"):
    if return_mask and (mods is None or mods.dropout == 0):
        raise ValueError(f"{name}=True needs {dropout} > 0 (the keep mask of dropout)")


def dropout_mask(q, k, v, segments, mods, extras, *, seed, **options):
    """The dropout keep mask of a call, bool ``[G, Lq, Lkv]`` (O(L^2): small sizes only)."""
    cfg = FlashAttention(**options, mods=mods).config(q, k, v, *segments, *extras)
    with popxl.name_scope("flash_attention_dropout_mask"):
        return score_mods.dropout_mask(cfg, seed)


def _forward(q, k, v, segments, options, extras=()):
    """Validate and call the forward module: ``(out, lse)``, recorded for autodiff and grad."""
    module = FlashAttention(**options)
    cfg = module.config(q, k, v, *segments, *extras)  # validate before any graph is created
    prebuild_score_mod(cfg)  # a score_mod's errors too
    inputs = (q, k, v, *segments, *extras)
    with popxl.name_scope("flash_attention"):
        graph = _cached_graph(module, inputs)
        out, lse = ops.call(graph, *inputs)
    provenance.record_forward(graph, module.options, cfg, (out, lse),
                              runtime_inputs(segments, options.get("mods"), extras))
    return out, lse


#: The segment inputs of the modules, in order.
SEGMENT_NAMES = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")


def runtime_inputs(segments, mods, extras):
    """``{argument name: tensor}`` of a core call's run-time inputs: its segment ids and
    positions, ALiBi slopes, dropout seed and ``score_mod_inputs[i]`` (what a stash-mode
    backward must be given again, :func:`check_stash_options`)."""
    named = {name: t for name, t in zip(SEGMENT_NAMES, segments) if t is not None}
    if mods is not None:
        unpacked = score_mods.unpack_names(mods, extras)
        named.update({n: unpacked[n] for n in ("alibi_slopes", "seed") if n in unpacked})
        named.update({f"score_mod_inputs[{i}]": t for i, t in enumerate(unpacked["inputs"])})
    return named


def segmented_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                        mods=None, extras=(), step_table=None, **options):
    """Forward with segment ids and runtime positions (the varlen API's core call).

    Causal and window compare ``q_positions``/``kv_positions`` (int32, shaped like the ids)
    instead of row and column indices; see :mod:`popxl_flash.graph.segments`.

    Args:
        q, k, v: as :func:`flash_attention`; q_segment_ids, kv_segment_ids: int32
            ``[G or 1, L]``; q_positions, kv_positions: int32, the ids' shapes.
        mods, extras: from :func:`modifier_inputs`.
        step_table: ``None`` or a run-time step table, int32 ``[V, 3]`` (context
            parallelism's per-replica block list: :class:`popxl_flash.plan.segments.
            SegmentConfig`); needs positions and explicit chunk counts.
        options: ``num_chunks_q``, ``num_chunks_kv``, ``causal``, ``scale``, ``window``.

    Returns:
        ``(out, lse)``.
    """
    check_tensors(q=q, k=k, v=v)
    segments = _segment_inputs(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    if step_table is not None:
        segments += (step_table,)
    return _forward(q, k, v, segments, dict(options, mods=mods), extras)


def _unpack(qkv, options, segments=(None, None)):
    """Validate a packed ``qkv [3, G, L, D]`` and return ``(q, k, v)`` views of it."""
    check_tensors(qkv=qkv)
    _segment_inputs(*segments)
    cfg = AttentionConfig.from_packed_shape(qkv.shape, qkv.dtype.name, **options)
    cfg.with_segments(*segments)
    with popxl.name_scope("flash_attention_qkv_packed"):
        return qkv[0], qkv[1], qkv[2]


@keyword_hints(CORE_KEYWORD_HINTS)
def flash_attention_qkv_packed(qkv, *, num_chunks_q=None, num_chunks_kv=None, causal=True,
                               scale=None, window=None, return_lse=False, q_segment_ids=None,
                               kv_segment_ids=None, return_dropout_mask=False,
                               memory_budget=None, **modifiers):
    """:func:`flash_attention` on a packed ``qkv [3, G, L, D]`` (the PopART op's layout).

    Args:
        qkv: ``[3, G, L, D]`` float16 or float32; ``qkv[0]``, ``qkv[1]``, ``qkv[2]`` are q, k, v.
        num_chunks_q, num_chunks_kv, causal, scale, window, return_lse, q_segment_ids,
            kv_segment_ids, return_dropout_mask, memory_budget: as :func:`flash_attention`.
        modifiers: ``softcap``, ``alibi_slopes``, ``score_mod``, ``score_mod_inputs``,
            ``dropout``, ``seed``, as :func:`flash_attention`.

    Returns:
        out ``[G, L, D]`` (and lse float32 ``[G, L]`` with ``return_lse``).
    """
    _check_modifier_names("flash_attention_qkv_packed", modifiers)
    options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal,
                   scale=scale, window=window, memory_budget=memory_budget)
    segments = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    modifier_inputs(**modifiers)
    result = flash_attention(*_unpack(qkv, options, tuple(segments.values())),
                             return_lse=True, return_dropout_mask=return_dropout_mask,
                             **options, **segments, **modifiers)
    for t in result[:2]:
        provenance.record_alias(t, t, api="flash_attention_qkv_packed")
    if return_lse:
        return result
    return (result[0],) + tuple(result[2:]) if return_dropout_mask else result[0]


#: The score-modifier keywords of the core functions.
MODIFIER_NAMES = ("softcap", "alibi_slopes", "score_mod", "score_mod_inputs", "dropout", "seed")


def _check_modifier_names(fn, modifiers):
    for name in modifiers:
        if name not in MODIFIER_NAMES:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")


@keyword_hints(CORE_KEYWORD_HINTS)
def flash_attention_grad(dout, q, k, v, out=None, lse=None, *, num_chunks_q=None,
                         num_chunks_kv=None, causal=True, scale=None, window=None,
                         q_segment_ids=None, kv_segment_ids=None, softcap=0.0,
                         alibi_slopes=None, score_mod=None, score_mod_inputs=(), dropout=0.0,
                         seed=None, memory_budget=None):
    """Gradients of :func:`flash_attention` with respect to q, k and v.

    Stash mode (``out`` and ``lse`` given, from ``flash_attention(..., return_lse=True)``)
    recomputes only the block probabilities: 5 block matmuls per visited block. Recompute mode
    (both ``None``) first reruns the forward, like the PopART op.

    A stashed ``out``/``lse`` that a forward call returned in this Ir is checked against this
    call: other options, or other run-time tensors (``alibi_slopes``, ``seed``,
    ``score_mod_inputs``, segment ids: compared by identity) than the forward's raise
    ``ValueError`` naming the argument. That provenance cannot be known for an ``out``/``lse``
    that went through another op, crossed a graph boundary or came from the host: then keeping
    options and tensors equal is the caller's job (``pf.autodiff`` always does).

    Args:
        dout: ``[G, Lq, D]`` gradient of the output, q's dtype.
        q, k, v: the forward's inputs (q ``[G, Lq, D]``, k and v ``[Gk, Lkv, D]``).
        out, lse: the forward's outputs, or both ``None``.
        num_chunks_q, num_chunks_kv, causal, scale, window, q_segment_ids, kv_segment_ids,
            softcap, alibi_slopes, score_mod, score_mod_inputs, dropout, seed: the forward's
            options, segment ids and score modifiers (the chunk counts may differ, also with
            dropout: its keep mask is a function of (seed, g, row, column) alone).
        memory_budget: as :func:`flash_attention` (give the forward's: the automatic choice
            is made for forward and backward together, so equal budgets give equal chunks).

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v (grouped-query: dk and dv
        ``[Gk, Lkv, D]``, each summed over the ``G // Gk`` q groups that share it); 0 for
        padding rows and for keys no query sees.
    """
    return _grad("flash_attention_grad", dout, q, k, v, out, lse, num_chunks_q=num_chunks_q,
                 num_chunks_kv=num_chunks_kv, causal=causal, scale=scale, window=window,
                 q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softcap=softcap,
                 alibi_slopes=alibi_slopes, score_mod=score_mod,
                 score_mod_inputs=score_mod_inputs, dropout=dropout, seed=seed,
                 memory_budget=memory_budget)


def _grad(who, dout, q, k, v, out, lse, *, q_segment_ids=None, kv_segment_ids=None,
          softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_inputs=(), dropout=0.0,
          seed=None, **options):
    """:func:`flash_attention_grad` on behalf of the public function ``who`` (messages)."""
    check_tensors(dout=dout, q=q, k=k, v=v)
    _check_rank3(dout=dout, q=q, k=k, v=v)
    segments = _segment_inputs(q_segment_ids, kv_segment_ids)
    mods, extras = modifier_inputs(softcap=softcap, alibi_slopes=alibi_slopes,
                                   score_mod=score_mod, score_mod_inputs=score_mod_inputs,
                                   dropout=dropout, seed=seed)
    return _backward(dout, q, k, v, out, lse, segments, dict(options, mods=mods), extras, who)


def _backward(dout, q, k, v, out, lse, segments, options, extras=(), who="flash_attention_grad",
              check_inputs=True):
    """Validate and call the backward module (running the forward first in recompute mode)."""
    if (out is None) != (lse is None):
        raise ValueError("out and lse must be given together (stash mode) or both be None "
                         f"(recompute mode), got out={out!r}, lse={lse!r}")
    module = FlashAttentionGrad(**options)
    if out is None:
        cfg = FlashAttention(**options).config(q, k, v, *segments, *extras)
        cfg.check_like("dout", dout.shape, dout.dtype.name, q.shape, cfg.dtype)
        out, lse = _forward(q, k, v, segments, options, extras)
    check_tensors(out=out, lse=lse)
    cfg = module.config(dout, q, k, v, out, lse, *segments, *extras)
    inputs = runtime_inputs(segments, options.get("mods"), extras) if check_inputs else None
    check_stash_options(cfg, who, inputs=inputs, out=out, lse=lse)
    prebuild_score_mod(cfg, backward=True)
    return _call_module("flash_attention_grad", module, dout, q, k, v, out, lse, *segments,
                        *extras)


def segmented_attention_grad(dout, q, k, v, out, lse, q_segment_ids, kv_segment_ids,
                             q_positions, kv_positions, mods=None, extras=(), step_table=None,
                             **options):
    """Gradients of :func:`segmented_attention` (stash mode, or recompute with out/lse None).

    An internal entry point (context parallelism's rounds, tests): the options of a stashed
    ``out``/``lse`` are checked, its run-time tensors are not (callers rebuild equal segment
    ids and positions from the same offsets; the public ``_grad`` functions check them).

    Returns:
        ``(dq, dk, dv)``.
    """
    check_tensors(dout=dout, q=q, k=k, v=v)
    segments = _segment_inputs(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    if step_table is not None:  # a per-replica block list, as segmented_attention's
        segments += (step_table,)
    return _backward(dout, q, k, v, out, lse, segments, dict(options, mods=mods), extras,
                     check_inputs=False)


def check_stash_options(cfg, who="flash_attention_grad",
                        names="causal, scale, window and score modifiers", inputs=None,
                        renames=None, **stash):
    """Refuse an ``out``/``lse`` that a forward call with other causal, scale or window options,
    other score modifiers, or other run-time tensors (ALiBi slopes, dropout seed,
    ``score_mod_inputs``, segment ids and positions) returned: its gradients would be silently
    wrong; or a pair from two calls.

    Only the very tensors a forward returned in this Ir are known (see
    :mod:`popxl_flash.api.provenance`); chunk counts may differ, they do not change the result
    (dropout's keep mask included). Run-time tensors are compared by identity: the backward
    must be given the forward's very tensors.

    Args:
        cfg: the backward's :class:`AttentionConfig`. who, names: the calling function and its
            option names (for the message). inputs: ``{argument name: tensor}``, the
            backward's run-time inputs by ``who``'s names (``None``: not checked). renames:
            ``{core option name: who's name}`` for the messages (e.g. ``scale`` ->
            ``softmax_scale``). stash: ``out=``, ``lse=`` tensors.
    """
    wanted = provenance.attention_options(cfg)
    records = {name: provenance.output_record(t) for name, t in stash.items()}
    for name, rec in records.items():
        if rec is None:
            continue
        if rec.attention_options() != wanted:
            raise ValueError(f"{name} was produced by {rec.api} with options "
                             f"{describe_options(rec.attention_options(), renames)}, but {who} "
                             f"was given {describe_options(wanted, renames)}; pass the "
                             f"forward's {names}")
        if (rec.config.segments is None) != (cfg.segments is None):
            given = "without" if cfg.segments is None else "with"
            raise ValueError(f"{name} was produced by {rec.api} "
                             f"{'without' if given == 'with' else 'with'} segment ids, but "
                             f"{who} was called {given} them; pass the "
                             "forward's q_segment_ids and kv_segment_ids")
        if inputs is not None:
            check_stash_inputs(name, rec, who, provenance.tensor_ids(inputs))
    calls = {rec.call for rec in records.values() if rec is not None}
    if len(calls) > 1:
        api = next(rec.api for rec in records.values() if rec is not None)
        raise ValueError(f"out and lse come from two different {api} calls; pass the "
                         "pair one call returned")


def check_stash_inputs(name, rec, who, given):
    """The run-time tensors of the backward must be the forward's (by tensor id)."""
    for arg in list(rec.inputs) + [a for a in given if a not in rec.inputs]:
        before, now = rec.inputs.get(arg), given.get(arg)
        if before == now:
            continue
        if now is None:
            raise ValueError(f"{name} was computed by {rec.api} with {arg}={before}, but {who} "
                             f"was given no {arg}; pass the forward's {arg}")
        if before is None:
            raise ValueError(f"{name} was computed by {rec.api} without {arg}, but {who} was "
                             f"given {arg}={now}; pass the forward's run-time tensors")
        raise ValueError(f"{arg}={now} is not the tensor {name} was computed with: {rec.api} "
                         f"was given {arg}={before}; pass {who} the forward's {arg} (a "
                         "different tensor, even with equal values, gives wrong gradients "
                         "when its values differ)")


def describe_options(options, renames=None):
    """The options of :func:`popxl_flash.api.provenance.attention_options` as a string in the
    caller's names (``renames``: ``{core name: caller's name}``, e.g. ``scale`` ->
    ``softmax_scale``, ``dropout`` -> ``dropout_p``)."""
    renames = renames or {}

    def n(key):
        return renames.get(key, key)
    parts = [f"{n(k)}={options[k]!r}" for k in ("causal", "scale", "window")]
    mods = options.get("mods")
    if mods is not None:
        if mods.softcap:
            parts.append(f"{n('softcap')}={mods.softcap!r}")
        if mods.alibi:
            parts.append(f"{n('alibi_slopes')}=<tensor>")
        if mods.score_mod is not None:
            parts.append(f"{n('score_mod')}={getattr(mods.score_mod, '__name__', mods.score_mod)}"
                         f" with {mods.num_mod_inputs} {n('score_mod_inputs')}")
        if mods.dropout:
            parts.append(f"{n('dropout')}={mods.dropout!r}")
    return "(" + ", ".join(parts) + ")"


@keyword_hints(CORE_KEYWORD_HINTS)
def flash_attention_qkv_packed_grad(dout, qkv, out=None, lse=None, *, num_chunks_q=None,
                                    num_chunks_kv=None, causal=True, scale=None, window=None,
                                    q_segment_ids=None, kv_segment_ids=None,
                                    memory_budget=None, **modifiers):
    """Gradient of :func:`flash_attention_qkv_packed` with respect to the packed ``qkv``.

    Args:
        dout: ``[G, L, D]``; qkv: ``[3, G, L, D]``; out, lse: stash (see
            :func:`flash_attention_grad`) or both ``None``.
        num_chunks_q, num_chunks_kv, causal, scale, window, q_segment_ids, kv_segment_ids,
            memory_budget: the forward's options and segment ids.
        modifiers: the forward's score modifiers (:func:`flash_attention_qkv_packed`).

    Returns:
        dqkv ``[3, G, L, D]`` in qkv's dtype.

    The stash checks are :func:`flash_attention_grad`'s (options and run-time tensors of the
    forward that returned ``out``/``lse``, when that is known).
    """
    _check_modifier_names("flash_attention_qkv_packed_grad", modifiers)
    options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal,
                   scale=scale, window=window, memory_budget=memory_budget)
    segments = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    modifier_inputs(**modifiers)
    q, k, v = _unpack(qkv, options, tuple(segments.values()))
    grads = _grad("flash_attention_qkv_packed_grad", dout, q, k, v, out, lse, **options,
                  **segments, **modifiers)
    with popxl.name_scope("flash_attention_qkv_packed_grad"):
        return ops.concat([g.reshape((1,) + tuple(g.shape)) for g in grads], axis=0)
