"""The straight-line decode pass of :func:`popxl_flash.api.kvcache.flash_attn_with_kvcache`: one
pass over the whole cache, no loop, no segment ids, no conditional.

For a call with one q chunk (``Lq <=`` :data:`popxl_flash.plan.kvcache.MAX_DECODE_Q`) the
whole score matrix ``[B, Hkv, r, Lq, Lcache]`` is small (a decode step has a handful of query
rows), so the cache is read once, in its own layout, through views (``transpose_``: no copy of a
cache), and the run-time lengths become the mask directly::

    q'   = q * scale                       (scale folded into q when that is exact)
    s    = q' k^T                          float32 [B, Hkv, r, Lq, Lc], one batched matmul
    s    = s * scale                       (else: float16 q and a scale that would round)
    s    = cap * tanh(s)                   (softcap: 1/cap folded into the scale too)
    s    = s - slope * |q_pos - j|         (ALiBi)
    s    = where(valid, s, MIN)            valid[b, i, j] = seqlens[b] > lo[i, j] (and <= hi)
    p    = softmax(s); out = cast(p) v     [B, Hkv, r * Lq, D], q's dtype
    lse  = logsumexp(s)                    (only when returned)

``lo``/``hi`` are int32 constants of the static sizes: with ``n_b = seqlens[b] + Lnew`` and the
query position ``q_pos = n_b - Lq + i`` (bottom-right aligned), ``j < n_b`` and causal ``j <=
q_pos + right`` (right 0 for causal) are ``seqlens[b] > max(j - Lnew, j - Lnew + Lq - 1 - i -
right)``; a left window ``j >= q_pos - left`` is ``seqlens[b] <= j - Lnew + Lq - i + left``.
A row sees a key iff column 0 passes the first comparison (``n_b >= 1`` and ``q_pos + right >=
0``), so the rows that see nothing (out 0, lse ``-inf``, as flash-attn) are selected by a slice
of the mask, only when the static sizes allow such rows. With an int ``cache_seqlens`` the mask
is a constant.

The out-of-range guard: the batch rows whose run-time length was out of range (``bad``) read the
whole cache (so they see keys) and get a NaN scale ``sqrt(-1)`` (the per-row scale vector
``sqrt(where(bad, -1, scale^2))``: on q in float32, on the float32 scores in float16, which needs
no cast), so their scores, out and lse are NaN; with floating-point checks on, the run stops at that ``sqrt`` (in the name scope
``cache_seqlens_out_of_range``).

:func:`popxl_flash.plan.kvcache.straight_counts` counts this pass's ops, FLOPs and output
elements (held to the emulator's profile by ``tests/test_decode.py``).
"""
import math

import numpy as np

from popxl_flash.backend import popxl

ops = popxl.ops

#: The masked score (float32's lowest finite value: ``exp`` of it minus any row max is 0, no
#: infinity enters an arithmetic op).
MASKED_SCORE = float(np.finfo(np.float32).min)

#: Permutations taking each cache layout to ``[B, Hkv, D, Lc]`` (k^T) and ``[B, Hkv, Lc, D]``.
_K_T = {"BSHD": (0, 2, 3, 1), "BHSD": (0, 1, 3, 2), "BHDS": None}
_V = {"BSHD": (0, 2, 1, 3), "BHSD": None}


def _i32(values):
    return popxl.constant(np.ascontiguousarray(values, dtype=np.int32))


def bounds(q_len, cache_len, new_len, causal, window):
    """The static mask tables (numpy int64).

    Args:
        window: ``(left, right)``, ``-1`` or ``None`` for an unbounded side.

    Returns:
        ``(lo [Lq, Lc], hi [Lq, Lc] or None)``: row ``i`` of batch row ``b`` sees cache row
        ``j`` iff ``seqlens[b] > lo[i, j]`` and (``hi`` given) ``seqlens[b] <= hi[i, j]``.
    """
    left, right = (None if w is None or w < 0 else int(w) for w in window)
    if causal:
        right = 0 if right is None else min(right, 0)
    i = np.arange(q_len)[:, None]
    j = np.arange(cache_len)[None, :]
    lo = np.broadcast_to(j - new_len, (q_len, cache_len))
    if right is not None:
        lo = np.maximum(lo, j - new_len + q_len - 1 - i - right)
    hi = None if left is None else j - new_len + q_len - i + left
    return np.ascontiguousarray(lo), hi


def empties_possible(q_len, new_len, causal, window):
    """Whether some row of an in-range call can see no key (``n_b = 0``, or ``q_pos + right <
    0`` at the shortest length ``n_b = Lnew``)."""
    if new_len == 0:
        return True
    right = None if window[1] is None or window[1] < 0 else int(window[1])
    if causal:
        right = 0 if right is None else min(right, 0)
    return right is not None and new_len - q_len + right < 0


def folds_exactly(float32, factor):
    """Whether ``q * factor`` in q's dtype is as good as scaling the float32 scores: float32,
    or a power of two (float16: an exact product)."""
    return float32 or math.frexp(factor)[0] == 0.5


def _view(t, perm):
    return t if perm is None else t.transpose_(perm)


def straight_pass(q, k_cache, v_cache, seqlens, *, new_len, k_layout, v_layout, scale,
                  causal, window, softcap=0.0, slopes=None, bad=None, return_lse=True):
    """Attention of ``q`` over the whole cache with the run-time lengths as the mask.

    Args:
        q: ``[B, Lq, Hq, D]`` (rotated already, if rotary).
        k_cache, v_cache: the caches in their layouts, after the write.
        seqlens: int32 ``[B]`` tensor (in range: the guard's read lengths) or an int: the rows
            already in the cache before the ``new_len`` new ones.
        new_len: ``Lnew``.
        k_layout, v_layout: ``"BSHD"``/``"BHSD"``/``"BHDS"`` and ``"BSHD"``/``"BHSD"``.
        scale: the softmax scale; causal, window: the mask (window sides ``None`` or ``< 0``
            unbounded).
        softcap: ``> 0`` caps the scores; slopes: ``None`` or float32 ``[Hq]``/``[B, Hq]``
            ALiBi slopes.
        bad: ``None`` or bool ``[B]``: rows whose run-time length was out of range (NaN).
        return_lse: also compute the logsumexp.

    Returns:
        ``(out [B, Lq, Hq, D] in q's dtype, lse float32 [B, Hq, Lq] or None)``.
    """
    B, Lq, Hq, D = q.shape
    kT = _view(k_cache, _K_T[k_layout])  # [B, Hkv, D, Lc]
    v = _view(v_cache, _V[v_layout])  # [B, Hkv, Lc, D]
    Hkv, Lc = kT.shape[1], kT.shape[3]
    r = Hq // Hkv
    f32 = popxl.float32
    factor = scale / softcap if softcap > 0 else scale
    post = None  # a float32 scale of the scores, where folding into q would round
    if bad is not None:
        with popxl.name_scope("cache_seqlens_out_of_range"):  # what a trap's message names
            sv = ops.sqrt(ops.where(bad, popxl.constant(np.float32(-1.0)),
                                    popxl.constant(np.float32(factor * factor))))  # [B]
        if q.dtype == f32:
            q = q * sv.reshape_((B, 1, 1, 1))
        else:
            post = sv.reshape_((B, 1, 1, 1, 1))
    elif folds_exactly(q.dtype == f32, factor):
        q = q * factor
    else:
        post = float(factor)
    qg = q.transpose_((0, 2, 1, 3)).reshape_((B, Hkv, r * Lq, D))  # views
    s = ops.matmul(qg, kT, output_type=f32).reshape_((B, Hkv, r, Lq, Lc))
    if post is not None:
        s = s * post
    if softcap > 0:
        s = ops.tanh(s) * float(softcap)
    lo, hi = bounds(Lq, Lc, new_len, causal, window)
    tensor = isinstance(seqlens, popxl.Tensor)
    if tensor:
        lens = seqlens.reshape_((B, 1, 1, 1, 1))
    if slopes is not None:
        rows = 1 if len(slopes.shape) == 1 else B
        sl = slopes.reshape_((rows, Hkv, r, 1, 1))
        # q_pos - j = seqlens + Lnew - Lq + i - j
        rel = np.arange(Lq)[:, None] - np.arange(Lc)[None, :] + new_len - Lq
        if tensor:
            dist = ops.abs(ops.cast(lens + _i32(rel.reshape(1, 1, 1, Lq, Lc)), f32))
        else:
            dist = popxl.constant(np.abs(rel + seqlens).astype(np.float32).reshape(
                1, 1, 1, Lq, Lc))
        s = s - sl * dist
    seen = None
    if tensor:
        first = ops.greater(lens, _i32(lo.reshape(1, 1, 1, Lq, Lc)))  # [B, 1, 1, Lq, Lc]
        valid = first
        if hi is not None:
            valid = ops.logical_and(first, ops.greater(_i32(hi.reshape(1, 1, 1, Lq, Lc) + 1),
                                                        lens))
        if empties_possible(Lq, new_len, causal, window):
            seen = ops.slice_(first, start=[0], stop=[1], axis=[4])  # [B, 1, 1, Lq, 1]
    else:
        valid_np = seqlens > lo if hi is None else (seqlens > lo) & (seqlens <= hi)
        seen_np = (seqlens > lo[:, :1]).reshape(1, 1, 1, Lq, 1)
        valid = None if valid_np.all() else popxl.constant(valid_np.reshape(1, 1, 1, Lq, Lc))
        seen = None if seen_np.all() else popxl.constant(seen_np)
    if valid is not None:
        s = ops.where(valid, s, popxl.constant(MASKED_SCORE, dtype=f32))
    p = ops.softmax(s, axis=-1)
    pv = p if q.dtype == f32 else ops.cast(p, q.dtype)
    out = ops.matmul(pv.reshape_((B, Hkv, r * Lq, Lc)), v).reshape_((B, Hkv, r, Lq, D))
    lse = None
    if return_lse:
        lse = ops.logsumexp(s, axis=-1, keepdims=True)  # [B, Hkv, r, Lq, 1]
    if seen is not None:
        out = ops.where(seen, out, popxl.constant(0.0, dtype=out.dtype))
        if lse is not None:
            lse = ops.where(seen, lse, popxl.constant(float("-inf"), dtype=f32))
    out = out.reshape_((B, Hq, Lq, D)).transpose_((0, 2, 1, 3))
    if lse is not None:
        lse = lse.reshape_((B, Hq, Lq))
    return out, lse
