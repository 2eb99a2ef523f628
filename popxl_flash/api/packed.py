"""flash-attn's packed entry points: q, k, v stacked in one tensor (``qkv``) or k and v (``kv``).

Thin layers over :func:`~popxl_flash.flash_attn_func` and
:func:`~popxl_flash.flash_attn_varlen_func` with flash-attn 2's names and layouts::

    flash_attn_qkvpacked_func(qkv [B, L, 3, H, D])                       -> out [B, L, H, D]
    flash_attn_kvpacked_func(q [B, Lq, Hq, D], kv [B, Lkv, 2, Hkv, D])    -> out [B, Lq, Hq, D]
    flash_attn_varlen_qkvpacked_func(qkv [total, 3, H, D], cu_seqlens, max_seqlen)
    flash_attn_varlen_kvpacked_func(q [total_q, Hq, D], kv [total_k, 2, Hkv, D],
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

The unpacking is one ``ops.slice`` and ``reshape`` per tensor (differentiable: the gradient of
a packed input is the three (or two) gradients stacked back). Every option is the unpacked
function's, keyword-only; ``deterministic`` is accepted (flash-attn's name: the library is
always deterministic).
"""
from popxl_flash.backend import popxl
from popxl_flash.api.flash_attn_interface import KEYWORD_HINTS, flash_attn_func
from popxl_flash.api.functional import check_tensors, keyword_hints
from popxl_flash.api.varlen import VARLEN_KEYWORD_HINTS, flash_attn_varlen_func

ops = popxl.ops

__all__ = ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "unpack"]


def unpack(name, packed, count, axis, meaning):
    """``count`` tensors out of ``packed``'s axis ``axis`` of size ``count`` (the stacking axis),
    validated first, then sliced inside a name scope (PopXL's scopes do not survive an
    exception).

    Args:
        name: the argument's name (for errors). meaning: its layout, e.g. ``"[B, L, 3, H, D]"``.

    Returns:
        A list of ``count`` tensors with that axis removed.
    """
    check_tensors(**{name: packed})
    shape = tuple(packed.shape)
    rank = meaning.count(",") + 1
    if len(shape) != rank or shape[axis] != count or min(shape) < 1:
        raise ValueError(f"{name} must have shape {meaning} with non-empty dims (axis {axis} of "
                         f"size {count}), got shape {shape}")
    rest = shape[:axis] + shape[axis + 1:]
    with popxl.name_scope(f"unpack_{name}"):
        return [ops.slice(packed, start=[i], stop=[i + 1], axis=[axis]).reshape(rest)
                for i in range(count)]


@keyword_hints(KEYWORD_HINTS)
def flash_attn_qkvpacked_func(qkv, **options):
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv [B, L, 3, H, D]`` (q, k, v stacked on
    axis 2) -> out ``[B, L, H, D]``.

    Args:
        qkv: float16 or float32 ``[B, L, 3, H, D]``.
        **options: keyword-only options of :func:`~popxl_flash.flash_attn_func`
            (``dropout_p``, ``softmax_scale``, ``causal``, ``window_size``, ``softcap``,
            ``alibi_slopes``, ``deterministic``, ``return_attn_probs``, ``return_lse``, ``seed``,
            chunk counts, ``score_mod``); not ``layout`` (the packed layout is flash-attn's).

    Returns:
        As :func:`~popxl_flash.flash_attn_func`.
    """
    _no_layout("flash_attn_qkvpacked_func", options)
    q, k, v = unpack("qkv", qkv, 3, 2, "[B, L, 3, H, D]")
    return flash_attn_func(q, k, v, **options)


@keyword_hints(KEYWORD_HINTS)
def flash_attn_kvpacked_func(q, kv, **options):
    """flash-attn's ``flash_attn_kvpacked_func``: ``q [B, Lq, Hq, D]``,
    ``kv [B, Lkv, 2, Hkv, D]`` (k, v stacked on axis 2; ``Hkv`` divides ``Hq``) -> out
    ``[B, Lq, Hq, D]``.

    Args:
        q, kv: float16 or float32, one dtype.
        **options: as :func:`flash_attn_qkvpacked_func`.

    Returns:
        As :func:`~popxl_flash.flash_attn_func`.
    """
    _no_layout("flash_attn_kvpacked_func", options)
    k, v = unpack("kv", kv, 2, 2, "[B, Lkv, 2, Hkv, D]")
    return flash_attn_func(q, k, v, **options)


@keyword_hints(VARLEN_KEYWORD_HINTS)
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **options):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: packed sequences with q, k, v stacked,
    ``qkv [total, 3, H, D]``, one ``cu_seqlens`` (int32 ``[num_seqs + 1]``, run time) and
    ``max_seqlen`` for q and k -> out ``[total, H, D]``.

    Args:
        **options: keyword-only options of :func:`~popxl_flash.flash_attn_varlen_func`.

    Returns:
        As :func:`~popxl_flash.flash_attn_varlen_func`.
    """
    q, k, v = unpack("qkv", qkv, 3, 1, "[total, 3, H, D]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  **options)


@keyword_hints(VARLEN_KEYWORD_HINTS)
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, **options):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: ``q [total_q, Hq, D]``,
    ``kv [total_k, 2, Hkv, D]`` -> out ``[total_q, Hq, D]``.

    Args:
        **options: keyword-only options of :func:`~popxl_flash.flash_attn_varlen_func`.

    Returns:
        As :func:`~popxl_flash.flash_attn_varlen_func`.
    """
    k, v = unpack("kv", kv, 2, 1, "[total_k, 2, Hkv, D]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, **options)


def _no_layout(fn, options):
    if "layout" in options:
        raise TypeError(f"{fn}() got an unexpected keyword argument 'layout': the packed "
                        "tensors are flash-attn's [B, L, n, H, D]; unpack them and call "
                        "pf.flash_attn_func(..., layout=...)")
