"""flash-attn's interface: :func:`flash_attn_func` on ``[B, L, H, D]`` tensors.

The names, defaults and layouts are those of ``flash_attn.flash_attn_func`` (flash-attn 2):
``softmax_scale``, ``causal=False``, ``window_size=(-1, -1)``; q ``[B, Lq, Hq, D]``, k and v
``[B, Lkv, Hkv, D]``; out ``[B, Lq, Hq, D]`` and the logsumexp ``[B, Hq, Lq]`` float32. The
layout changes are ordinary PopXL ``transpose``/``reshape`` ops around
:func:`popxl_flash.flash_attention`, which works on ``[G, L, D]`` with ``G = B x H``::

    q [B, Lq, Hq, D] --transpose--> [B, Hq, Lq, D] --reshape--> [B*Hq, Lq, D]
    out [B*Hq, Lq, D] --reshape--> [B, Hq, Lq, D] --transpose--> [B, Lq, Hq, D]
    lse [B*Hq, Lq] --reshape--> [B, Hq, Lq]

With ``layout="BHLD"`` (PyTorch SDPA's ``[B, H, L, D]``) only the reshapes remain.

Heads flatten batch-major (``g = b * H + h``), so grouped-query and multi-query attention
(``Hkv < Hq``) need nothing here: the core takes ``k``/``v`` with ``B * Hkv`` groups, and q group
``b * Hq + h`` reads kv group ``(b * Hq + h) // (Hq // Hkv) = b * Hkv + h // (Hq // Hkv)``:
q head ``h`` reads kv head ``h // (Hq // Hkv)`` of its own batch entry, flash-attn's convention.
"""
from collections import namedtuple
from dataclasses import replace

from popxl_flash.api import provenance

from popxl_flash.backend import popxl
from popxl_flash.plan.config import AttentionConfig, check_bool, check_scale, check_window
from popxl_flash.api.functional import (check_stash_options, check_tensors, flash_attention,
                                    flash_attention_grad, keyword_hints, modifier_inputs,
                                    prebuild_score_mod)

ops = popxl.ops

#: Accepted ``layout`` values: flash-attn's ``[B, L, H, D]`` and PyTorch SDPA's ``[B, H, L, D]``.
LAYOUTS = ("BLHD", "BHLD")

#: Keywords of the ``[G, L, D]`` API, PyTorch SDPA or flash-attn that are spelt differently (or
#: unsupported) here.
KEYWORD_HINTS = {
    "scale": "flash_attn_func calls it softmax_scale= (scale= is pf.flash_attention's name)",
    "window": "flash_attn_func calls it window_size= (window= is pf.flash_attention's name)",
    "is_causal": "flash_attn_func calls it causal= (PyTorch SDPA's is_causal)",
    "attn_mask": "mask tensors are not supported; use causal= and window_size=",
    "dropout": "flash_attn_func calls it dropout_p= (dropout= is pf.flash_attention's name)",
    "return_dropout_mask": "flash_attn_func calls it return_attn_probs= (it returns the "
                           "dropout keep mask)",
}

#: The sizes of one call, in flash-attn's names.
Dims = namedtuple("Dims", "batch q_len kv_len q_heads kv_heads head_dim")


def _blhd(shape, layout):
    """``(B, L, H, D)`` of a rank-4 shape in ``layout``."""
    b, x, y, d = shape
    return (b, x, y, d) if layout == "BLHD" else (b, y, x, d)


def check_kv_heads(k, v, Hq, Hkv):
    """v must have k's shape, and the q head count must be a multiple of the k/v one.

    Args:
        k, v: tensors. Hq, Hkv: head counts of q and of k/v.
    """
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got v shape "
                         f"{tuple(v.shape)}")
    if Hq % Hkv:
        raise ValueError(f"q's head count Hq={Hq} must be a multiple of k/v's Hkv={Hkv} "
                         "(grouped-query attention)")


def core_options(dims, qkv, *, num_chunks_q, num_chunks_kv, causal, softmax_scale, window_size,
                 return_lse, memory_budget=None):
    """flash-attn's option names turned into the core API's options, and the whole call
    validated as the core will see it (``[B·H, L, D]`` groups), before any graph or scope is
    opened.

    Args:
        dims: the call's :class:`Dims`. qkv: the tensors (for their dtypes).
        num_chunks_q, num_chunks_kv, causal, softmax_scale, window_size, return_lse: the
            caller's options (flash-attn names).

    Returns:
        ``(options, return_lse)``: keyword arguments of :func:`popxl_flash.flash_attention` and
        the checked ``return_lse``.
    """
    options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                   memory_budget=memory_budget, causal=check_bool("causal", causal),
                   scale=check_scale(softmax_scale, dims.head_dim, name="softmax_scale"),
                   window=check_window(window_size, name="window_size"))
    return_lse = check_bool("return_lse", return_lse)
    G, Gk = dims.batch * dims.q_heads, dims.batch * dims.kv_heads
    kv_shape = (Gk, dims.kv_len, dims.head_dim)
    AttentionConfig.from_shapes((G, dims.q_len, dims.head_dim), kv_shape, kv_shape,
                                tuple(t.dtype.name for t in qkv), **options)
    return options, return_lse


def _check_shapes(q, k, v, layout):
    """Validate ranks and sizes of q, k, v in ``layout``.

    Returns:
        :class:`Dims`.
    """
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    order = "[B, L, H, D]" if layout == "BLHD" else "[B, H, L, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        shape = tuple(t.shape)
        if len(shape) != 4:
            hint = "; for [G, L, D] tensors use pf.flash_attention" if len(shape) == 3 else ""
            raise ValueError(f"{name} must have rank 4 {order} (layout={layout!r}), got shape "
                             f"{shape}{hint}")
        if min(shape) < 1:
            raise ValueError(f"{name} must have non-empty dims {order}, got shape {shape}")
    B, Lq, Hq, D = _blhd(q.shape, layout)
    Bk, Lkv, Hkv, Dk = _blhd(k.shape, layout)
    if (Bk, Dk) != (B, D):
        raise ValueError(f"k must have q's batch B={B} and head dim D={D} ({order}), got k "
                         f"shape {tuple(k.shape)}")
    check_kv_heads(k, v, Hq, Hkv)
    return Dims(B, Lq, Lkv, Hq, Hkv, D)


def _to_groups(t, layout):
    """``[B, L, H, D]`` (or ``[B, H, L, D]``) -> ``[B*H, L, D]``."""
    B, L, H, D = _blhd(t.shape, layout)
    if layout == "BLHD":
        t = t.transpose((0, 2, 1, 3))  # [B, H, L, D]
    return t.reshape((B * H, L, D))


def _from_groups(t, batch, heads, layout):
    """``[B*H, L, D]`` -> ``[B, L, H, D]`` (or ``[B, H, L, D]``)."""
    _, L, D = t.shape
    t = t.reshape((batch, heads, L, D))
    return t.transpose((0, 2, 1, 3)) if layout == "BLHD" else t


@keyword_hints(KEYWORD_HINTS)
def flash_attn_func(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    return_attn_probs=False, return_lse=False, layout="BLHD",
                    num_chunks_q=None, num_chunks_kv=None, seed=None, score_mod=None,
                    score_mod_inputs=(), deterministic=False, memory_budget=None):
    """flash-attn's ``flash_attn_func`` on PopXL tensors: exact attention, O(L) memory.

    The options are keyword-only (flash-attn's fourth positional parameter is ``dropout_p``,
    which does not exist here, so positional options could silently mean something else).

    Args:
        q: ``[B, Lq, Hq, D]`` float16 or float32 (``[B, Hq, Lq, D]`` with ``layout="BHLD"``).
        k, v: ``[B, Lkv, Hkv, D]`` (``[B, Hkv, Lkv, D]``), q's dtype. ``Hkv`` divides ``Hq``:
            ``Hkv < Hq`` is grouped-query attention (``Hkv = 1``: multi-query), q head ``h``
            reading k/v head ``h // (Hq // Hkv)``; k and v are never repeated per q head.
        softmax_scale: ``None`` for ``1/sqrt(D)``, or a finite real number.
        causal: bottom-right aligned causal mask (flash-attn >= 2.1): query ``i`` sees key
            ``j <= i + Lkv - Lq``. Default ``False``, as in flash-attn.
        window_size: ``(left, right)`` local window around the bottom-right diagonal; ``-1``
            (or ``None``) for an unbounded side; intersected with ``causal``.
        return_lse: also return the logsumexp (flash-attn's ``softmax_lse``).
        layout: ``"BLHD"`` (flash-attn, default) or ``"BHLD"`` (PyTorch SDPA) for q, k, v and
            out.
        num_chunks_q, num_chunks_kv: chunk counts, as :func:`popxl_flash.flash_attention`.
        memory_budget: bytes, as :func:`popxl_flash.flash_attention`.
        dropout_p: dropout probability on the attention probabilities, in ``[0, 1)``; needs
            ``seed``, a uint32 ``[2]`` tensor (PopXL's random seed). Element ``(b, h, i, j)``
            is dropped by a hash of (seed, ``b * Hq + h``, i, j) alone, whatever the chunks.
        softcap: ``> 0``: scores become ``softcap * tanh(s / softcap)``.
        alibi_slopes: ``None`` or float32 ``[Hq]`` or ``[B, Hq]`` runtime tensor: scores get
            ``-slope * |i + Lkv - Lq - j|``.
        return_attn_probs: also return the dropout keep mask, bool ``[B, Hq, Lq, Lkv]``, the
            one any backward with this seed uses (needs ``dropout_p > 0``; O(Lq Lkv): tests
            at small sizes). flash-attn returns its ``S_dmask`` there.
        score_mod, score_mod_inputs: as :func:`popxl_flash.flash_attention` (``g`` is the
            ``b * Hq + h`` group index).
        deterministic: accepted for flash-attn compatibility (a bool); the forward and the
            backward are always deterministic here (static loops, fixed reduction order).

    Returns:
        out ``[B, Lq, Hq, D]`` (``[B, Hq, Lq, D]``) in q's dtype; with ``return_lse``,
        ``(out, lse)`` with lse float32 ``[B, Hq, Lq]`` (``-inf`` where a row sees no key);
        with ``return_attn_probs``, ``(out, lse, keep_mask)``.
    """
    check_tensors(q=q, k=k, v=v)
    check_bool("deterministic", deterministic)  # always deterministic
    dims = _check_shapes(q, k, v, layout)
    options, return_lse = core_options(
        dims, (q, k, v), num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, return_lse=return_lse,
        memory_budget=memory_budget)
    return_probs = check_bool("return_attn_probs", return_attn_probs)
    modifiers = modifier_options(dims, (q, k, v), options, softcap=softcap,
                                 alibi_slopes=alibi_slopes,
                                 score_mod=score_mod, score_mod_inputs=score_mod_inputs,
                                 dropout_p=dropout_p, seed=seed,
                                 return_attn_probs=return_probs)
    modifiers_in = modifiers
    with popxl.name_scope("flash_attn_func"):
        groups = [_to_groups(t, layout) for t in (q, k, v)]  # [B*H, L, D]
        modifiers = group_slopes(modifiers, dims)
        result = flash_attention(*groups, return_lse=True, return_dropout_mask=return_probs,
                                 **options, **modifiers)
        out, lse = result[0], result[1]
        out_l = _from_groups(out, dims.batch, dims.q_heads, layout)
        lse_l = lse.reshape((dims.batch, dims.q_heads, dims.q_len))  # [B, Hq, Lq]
        if return_probs:  # [B*H, Lq, Lkv] -> [B, H, Lq, Lkv]
            mask = result[2].reshape((dims.batch, dims.q_heads, dims.q_len, dims.kv_len))
    named = user_inputs(modifiers_in)
    provenance.record_alias(out_l, out, api="flash_attn_func", inputs=named)
    provenance.record_alias(lse_l, lse, api="flash_attn_func", inputs=named)
    if return_probs:
        return out_l, lse_l, mask
    return (out_l, lse_l) if return_lse else out_l


#: The core options' names in flash-attn's functions (for messages).
FLASH_ATTN_NAMES = {"scale": "softmax_scale", "window": "window_size", "dropout": "dropout_p"}


def user_inputs(modifiers):
    """``{argument name: tensor}`` of a flash-attn call's run-time modifier inputs, the tensors
    the user passed (``alibi_slopes`` before its layout change), by flash-attn's names."""
    named = {n: modifiers.get(n) for n in ("alibi_slopes", "seed")}
    if modifiers.get("dropout") in (None, 0, 0.0):
        named.pop("seed")
    named.update({f"score_mod_inputs[{i}]": t
                  for i, t in enumerate(mods_inputs(modifiers.get("score_mod_inputs", ())))})
    return {n: t for n, t in named.items() if t is not None}


def check_alibi_slopes(alibi_slopes, dims, varlen=False):
    """Raise unless ``alibi_slopes`` is ``None`` or a float32 tensor ``[Hq]`` or ``[B, Hq]``
    of the current graph (flash-attn's layouts; ``dims``: the call's :class:`Dims`; with
    ``varlen``, packed sequences with no batch axis: ``[Hq]`` or ``[1, Hq]``)."""
    if alibi_slopes is None:
        return
    check_tensors(alibi_slopes=alibi_slopes)
    shape = tuple(alibi_slopes.shape)
    if shape not in ((dims.q_heads,), (dims.batch, dims.q_heads)) or \
            alibi_slopes.dtype.name != "float32":
        want = f"[B={dims.batch}, Hq={dims.q_heads}]" if not varlen else \
            f"[1, Hq={dims.q_heads}] (packed sequences have no batch axis: one slope per " \
            "head, shared by every sequence)"
        raise ValueError(f"alibi_slopes must be float32 [Hq={dims.q_heads}] or {want}, got "
                         f"{shape} {alibi_slopes.dtype.name}")


def modifier_options(dims, qkv, options, *, softcap, alibi_slopes, score_mod, score_mod_inputs,
                     dropout_p, seed, return_attn_probs, backward=False, varlen=False):
    """flash-attn's score-modifier and dropout options -> the core's keywords, validated
    (before any graph or scope is opened; a ``score_mod``'s graphs are built here, so its
    errors come before the scope too).

    Args:
        dims: the call's :class:`Dims`; qkv: the tensors; options: the core options
            (:func:`core_options`); backward: also build the score_mod's gradient graph;
            varlen: packed sequences (the slopes' messages name no batch); the rest:
            flash-attn's names.

    Returns:
        Keyword arguments of :func:`popxl_flash.flash_attention` (``alibi_slopes`` still
        ``[H]`` or ``[B, H]``: :func:`group_slopes` reshapes it inside the scope).
    """
    check_alibi_slopes(alibi_slopes, dims, varlen=varlen)
    mods, _ = modifier_inputs(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
                              score_mod_inputs=score_mod_inputs, dropout=dropout_p, seed=seed,
                              dropout_name="dropout_p")
    if return_attn_probs and (mods is None or mods.dropout == 0):
        raise ValueError("return_attn_probs=True needs dropout_p > 0 (it returns the dropout "
                         "keep mask; the probabilities are never materialised)")
    modifiers = dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
                     score_mod_inputs=score_mod_inputs, dropout=dropout_p, seed=seed)
    if mods is not None and mods.score_mod is not None:
        prebuild_score_mod(grouped_config(dims, qkv, options, modifiers), backward)
    return modifiers


def grouped_config(dims, qkv, options, modifiers):
    """The core's :class:`AttentionConfig` of a flash-attn call (``[B·H, L, D]`` groups), with
    its score modifiers."""
    G, Gk = dims.batch * dims.q_heads, dims.batch * dims.kv_heads
    kv_shape = (Gk, dims.kv_len, dims.head_dim)
    cfg = AttentionConfig.from_shapes((G, dims.q_len, dims.head_dim), kv_shape, kv_shape,
                                      tuple(t.dtype.name for t in qkv), **options)
    mods, _ = modifier_inputs(**modifiers)
    if mods is None:
        return cfg
    specs = tuple((tuple(t.shape), t.dtype.name)
                  for t in mods_inputs(modifiers["score_mod_inputs"]))
    return replace(cfg, mods=replace(mods, mod_input_specs=specs))


def mods_inputs(score_mod_inputs):
    """``score_mod_inputs`` as a tuple (one tensor alone is accepted)."""
    return (score_mod_inputs,) if isinstance(score_mod_inputs, popxl.Tensor) else \
        tuple(score_mod_inputs)


def group_slopes(modifiers, dims):
    """``alibi_slopes`` ``[H]`` or ``[B, H]`` -> the core's float32 ``[G]`` (``G = B * H``,
    batch-major; ``[H]`` is repeated for every batch entry)."""
    slopes = modifiers.get("alibi_slopes")
    if slopes is None:
        return modifiers
    if len(slopes.shape) == 1 and dims.batch > 1:
        slopes = ops.concat([slopes.reshape((1, dims.q_heads))] * dims.batch, axis=0)
    return dict(modifiers, alibi_slopes=slopes.reshape((dims.batch * dims.q_heads,)))


@keyword_hints(KEYWORD_HINTS)
def flash_attn_func_grad(dout, q, k, v, out=None, lse=None, *, dropout_p=0.0, softmax_scale=None,
                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         layout="BLHD", num_chunks_q=None, num_chunks_kv=None, seed=None,
                         score_mod=None, score_mod_inputs=(), deterministic=False,
                         memory_budget=None):
    """Hand-written backward of :func:`flash_attn_func`: gradients of q, k and v.

    The counterpart of :func:`popxl_flash.flash_attention_grad` in flash-attn's names, defaults
    and layouts: ``causal`` defaults to ``False`` here, as in :func:`flash_attn_func` (the
    ``[G, L, D]`` functions default to ``True``), so a forward and backward written with the
    same keywords always match. Stash mode (``out`` and ``lse`` from
    ``flash_attn_func(..., return_lse=True)``) or recompute mode (both ``None``); an
    ``out``/``lse`` pair that ``flash_attn_func`` returned with other ``causal``,
    ``softmax_scale`` or ``window_size``, other score modifiers, or other run-time tensors
    (``alibi_slopes``, ``seed``, ``score_mod_inputs``, by identity: the very tensors given to
    the forward) is refused (``ValueError`` naming the argument). For an ``out``/``lse`` that
    went through another op, crossed a graph boundary or came from the host this cannot be
    known, and keeping them equal is the caller's job.

    Args:
        dout: gradient of out, q's shape and dtype (``[B, Lq, Hq, D]``, ``[B, Hq, Lq, D]`` with
            ``layout="BHLD"``).
        q, k, v: the forward's inputs, as :func:`flash_attn_func`.
        out, lse: the forward's ``out`` (layout of q) and ``lse`` (float32 ``[B, Hq, Lq]``),
            or both ``None``.
        softmax_scale, causal, window_size, layout, num_chunks_q, num_chunks_kv: the
            forward's options (chunk counts may differ: they do not change the result, dropout's
            keep mask included).
        dropout_p, seed, softcap, alibi_slopes, score_mod, score_mod_inputs: the forward's
            score modifiers and dropout, as :func:`flash_attn_func`.
        memory_budget: the forward's, as :func:`popxl_flash.flash_attention_grad`.
        deterministic: accepted (a bool); always deterministic.

    Returns:
        ``(dq, dk, dv)`` in the layout, shapes and dtype of q, k, v (grouped-query: dk and dv
        summed over the q heads that share a k/v head).
    """
    check_tensors(dout=dout, q=q, k=k, v=v)
    check_bool("deterministic", deterministic)  # always deterministic
    dims = _check_shapes(q, k, v, layout)
    if tuple(dout.shape) != tuple(q.shape) or dout.dtype != q.dtype:
        raise ValueError(f"dout must have q's shape {tuple(q.shape)} and dtype {q.dtype.name}, "
                         f"got {tuple(dout.shape)} {dout.dtype.name}")
    options, _ = core_options(
        dims, (q, k, v), num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, return_lse=False,
        memory_budget=memory_budget)
    modifiers = modifier_options(dims, (q, k, v), options, softcap=softcap,
                                 alibi_slopes=alibi_slopes, score_mod=score_mod,
                                 score_mod_inputs=score_mod_inputs, dropout_p=dropout_p,
                                 seed=seed, return_attn_probs=False, backward=True)
    stash = _check_stash(out, lse, dims, q, layout, options, modifiers)
    with popxl.name_scope("flash_attn_func_grad"):
        groups = [_to_groups(t, layout) for t in (dout, q, k, v)]  # [B*H, L, D]
        if stash:
            stash = (_to_groups(out, layout),
                     lse.reshape((dims.batch * dims.q_heads, dims.q_len)))  # [B*Hq, Lq]
        grads = flash_attention_grad(*groups, *(stash or (None, None)), **options,
                                     **group_slopes(modifiers, dims))
        heads = (dims.q_heads, dims.kv_heads, dims.kv_heads)
        return tuple(_from_groups(g, dims.batch, h, layout) for g, h in zip(grads, heads))


def _check_stash(out, lse, dims, q, layout, options, modifiers):
    """Validate a stash pair of :func:`flash_attn_func_grad`; returns whether one is given."""
    if (out is None) != (lse is None):
        raise ValueError("out and lse must be given together (stash mode) or both be None "
                         f"(recompute mode), got out={out!r}, lse={lse!r}")
    if out is None:
        return False
    check_tensors(out=out, lse=lse)
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype.name} "
                         f"(layout={layout!r}), got {tuple(out.shape)} {out.dtype.name}")
    want = (dims.batch, dims.q_heads, dims.q_len)
    if tuple(lse.shape) != want or lse.dtype.name != "float32":
        raise ValueError(f"lse must be float32 [B, Hq, Lq] = {want}, got {tuple(lse.shape)} "
                         f"{lse.dtype.name}")
    cfg = grouped_config(dims, (q, q, q), options, modifiers)
    check_stash_options(cfg, "flash_attn_func_grad", "causal, softmax_scale, window_size and "
                        "score modifiers",
                        inputs=user_inputs(modifiers), renames=FLASH_ATTN_NAMES,
                        out=out, lse=lse)
    return True
