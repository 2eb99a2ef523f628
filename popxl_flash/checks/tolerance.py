"""The FlashAttention tolerance rule, shared by the test suite and the hardware self-check.

For an output ``x`` with float64 reference ``ref``::

    max|x - ref| <= factor * max|naive - ref| + floor

where ``naive`` is a plain attention in the SAME precision as the inputs (float16 inputs give
float16 scores and probabilities; float32 gives float32), ``factor`` is 2 for the forward and 3 for
the backward (FlashAttention's own test rule), and ``floor`` is the sum of small terms:

* the rounding error of representing ``ref`` in the input dtype
  (``2 * max|fl(ref + 0.3) - 0.3 - ref|``, the floor FlashAttention's tests use): below that no
  implementation in that dtype can go, and the naive error can be 0 by luck on tiny problems;
* the float32 accumulation error of the chunked algorithm: each of the ``n`` chunk steps
  rescales and adds into a float32 accumulator (about 4 roundings per step, relative to the
  accumulator's magnitude), and each block matmul sums ``c + D`` products, so the error is at
  most ``4 * (n + c + D) * eps32 * magnitude``. For float32 inputs this term is what makes the
  bound meaningful: a naive float32 attention sums in one pass and can be far more accurate
  than any chunked order when there are hundreds of chunks. For float16 it is negligible next
  to the float16 naive error;
* for the backward, the error of reading ``out`` rounded to the input dtype (see
  :func:`grad_bounds`).

For a float16 forward's ``out``, ``factor * max|naive - ref|`` is replaced by the larger
of it and the bound of rounding the block probabilities to the input dtype before the ``P V``
matmul (:func:`probability_rounding_floor`; ``parity`` of :func:`rule_bound`; the backward's
gradients likewise with the rounding of ``P`` and ``dS``, :func:`gradient_rounding_parity`). FlashAttention
rounds them by design (the matmul runs on input-dtype operands) and the naive attention does
too, so on large problems the naive error, a maximum over many entries with that rounding in
each, is the larger. On tiny ones (one output entry, ``D = 1``, a few keys) the naive error is
a single sample that can be ten times below its typical size by luck, and the 2x rule alone
then fails an implementation at parity with it (``G = 1, Lq = 1, Lkv = 9, D = 1``, scale 0.05:
6 random inputs of 400). Taking the larger, not the sum, leaves the bound of every problem
where the naive error covers the rounding unchanged.

Flash keeps scores, statistics and accumulators in float32 even for float16 inputs, so it is
usually far inside the bound. Everything here is numpy on the host.
"""
import numpy as np

from popxl_flash.checks import reference

EPS32 = float(np.finfo(np.float32).eps)


def _groups(segments, q):
    """``segments`` with ``groups=G`` (kv ids of grouped-query attention repeat per q group)."""
    return dict(segments, groups=q.shape[0]) if segments else segments


def naive_attention(q, k, v, *, causal, scale, window, **segments):
    """Plain attention in the inputs' precision (float16 scores and probabilities for float16).

    Matmuls accumulate in float32 and round to the input dtype, as a float16 IPU matmul does.
    Grouped-query k, v are repeated to one group per q group (exact in any dtype).

    Args:
        q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]`` (``G % Gk == 0``) numpy arrays of one dtype.
        causal, scale, window: as :func:`popxl_flash.flash_attention`.
        segments: segment ids and positions, as :func:`popxl_flash.checks.reference.mask`.

        Score modifiers (``reference.MODIFIERS``) are applied to the rounded scores and the
        result rounded again; dropout scales the rounded probabilities.

    Returns:
        ``(out [G, Lq, D], lse [G, Lq])`` in the input dtype.
    """
    segments, mods = reference._split_modifiers(dict(segments))
    k, v = reference.repeat_kv(q, k, v)
    dt = q.dtype
    D = q.shape[-1]
    scale = dt.type(1.0 / np.sqrt(D) if scale is None else scale)
    visible = reference.mask(q.shape[1], k.shape[1], causal=causal, window=window,
                             **_groups(segments, q))
    s = (q.astype(np.float32) @ k.astype(np.float32).transpose(0, 2, 1)).astype(dt) * scale
    s = _modified(s, segments, mods)[0]
    s = np.where(visible, s, dt.type(-np.inf))
    with np.errstate(invalid="ignore", divide="ignore"):
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, dt.type(0))
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True, dtype=dt)
        lse = (m + np.log(l))[..., 0]
        p = p / np.where(l > 0, l, dt.type(1))
    p = reference._dropped(p, mods).astype(dt)
    out = (p.astype(np.float32) @ v.astype(np.float32)).astype(dt)
    return out, lse


def _modified(s, segments, mods):
    """Scores of one dtype after the score modifiers (computed in float64, rounded back), and
    the rounded derivative."""
    if not mods:
        return s, None
    s_mod, grad = reference.modify_scores(s.astype(np.float64), segments, **mods)
    return s_mod.astype(s.dtype), grad.astype(s.dtype)


def naive_attention_grad(dout, q, k, v, *, causal, scale, window, **segments):
    """Plain backward in the inputs' precision (float16 P and dS for float16 inputs).

    Grouped-query k, v are repeated per q group; the copies' gradients are summed in float32 and
    rounded once, as one matmul that contracts over the sharing groups' rows would.

    Args:
        dout: ``[G, Lq, D]``; q, k, v, causal, scale, window, segments: as
            :func:`naive_attention`.

    Returns:
        ``(dq, dk, dv)`` in the input dtype, with the shapes of q, k, v.
    """
    kv_groups = k.shape[0]
    k, v = reference.repeat_kv(q, k, v)
    dt = q.dtype
    f32 = np.float32
    scale = dt.type(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    out, lse = naive_attention(q, k, v, causal=causal, scale=scale, window=window, **segments)
    segments, mods = reference._split_modifiers(dict(segments))
    visible = reference.mask(q.shape[1], k.shape[1], causal=causal, window=window,
                             **_groups(segments, q))
    s = (q.astype(f32) @ k.astype(f32).transpose(0, 2, 1)).astype(dt) * scale
    s, dmod = _modified(s, segments, mods)
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.where(visible, np.exp(s - lse[..., None]), dt.type(0)).astype(dt)
    p = np.where(np.isfinite(lse)[..., None], p, dt.type(0))

    def mm(a, b):
        return (a.astype(f32) @ b.astype(f32)).astype(dt)
    dp = reference._dropped(mm(dout, v.transpose(0, 2, 1)), mods).astype(dt)
    dvec = (dout.astype(f32) * out.astype(f32)).sum(-1, keepdims=True).astype(dt)
    ds = (p * (dp - dvec)).astype(dt)
    if dmod is not None:
        ds = (ds * dmod).astype(dt)

    def mm_summed(a, b):  # a @ b summed over the q groups sharing a kv group, float32 -> dt
        return reference.sum_groups(a.astype(f32) @ b.astype(f32), kv_groups).astype(dt)
    dk = mm_summed(ds.transpose(0, 2, 1), q) * scale
    dv = mm_summed(reference._dropped(p, mods).astype(dt).transpose(0, 2, 1), dout)
    return mm(ds, k) * scale, dk, dv


def grad_bounds(dout, q, k, v, *, causal, scale, window, dtype, **segments):
    """Float64 error scales of dq, dk, dv, from the true probabilities P.

    Returns:
        ``(magnitudes, stash_errors)``, each a tuple for (dq, dk, dv):

        * magnitude: max over entries of the sum of |terms| the entry accumulates (the float32
          accumulation floor multiplies it by ``4 (n + c + D) eps32``);
          ``|dS| <= P (|dO| |V|^T + rowsum(|dO| |O|))``.
        * stash error: the backward reads ``out`` rounded to the input dtype (stash mode, and
          recompute mode's forward output, as in FlashAttention), so ``Dvec = rowsum(dO * O)``
          carries up to ``u * rowsum(|dO| |O|)`` (u = unit roundoff of the dtype). Through
          ``dS = P (dP - Dvec)`` it reaches dq as ``|scale| P u rowsum(|dO||O|) |K|`` and dk as
          the transpose with |Q|; dv does not use Dvec. Any implementation that stashes the
          output in the input dtype has this error, whatever its summation order.

        With grouped-query k, v ``[Gk, Lkv, D]`` the dk and dv terms add over the q groups that
        share a kv group. Score modifiers multiply ``|dS|`` by ``max|ds_mod/ds|``, dropout the
        probabilities by ``1 / (1 - p)``.
    """
    segs, mods = reference._split_modifiers(dict(segments))
    boost = 1.0 / (1.0 - mods.get("dropout", 0.0)) if mods.get("keep") is not None else 1.0
    q64, k64, v64, do64 = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    kv_groups = k64.shape[0]
    k64, v64 = reference.repeat_kv(q64, k64, v64)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    p, _, _ = reference._probabilities(q64, k64, causal=causal, scale=scale, window=window,
                                       **segments)
    aq, ak, av, ado = (np.abs(a) for a in (q64, k64, v64, do64))
    rowdot = (ado * np.abs(boost * p @ v64)).sum(-1, keepdims=True)  # rowsum(|dO| |O|)
    ds = p * (boost * ado @ av.transpose(0, 2, 1) + rowdot)
    ds_stash = p * (np.finfo(dtype).eps / 2) * rowdot
    if mods:
        _, dmod = reference.modify_scores(scale * (q64 @ k64.transpose(0, 2, 1)), segs, **mods)
        ds, ds_stash = ds * np.abs(dmod), ds_stash * np.abs(dmod)
    scale = abs(scale)

    def kv_max(t):  # max entry of a per-q-group [G, Lkv, D] term summed per kv group
        return float(reference.sum_groups(t, kv_groups).max(initial=0))

    def through(t):  # (dq, dk) bounds of a |dS|-like term
        return (float((scale * t @ ak).max(initial=0)),
                kv_max(scale * t.transpose(0, 2, 1) @ aq))
    mags = (*through(ds), kv_max(boost * p.transpose(0, 2, 1) @ ado))
    return mags, (*through(ds_stash), 0.0)


def probability_rounding_floor(q, k, v, *, causal, scale=None, window=None,
                               **segments):
    """Error bound of rounding the block probabilities to the input dtype before ``P V``.

    Flash multiplies ``fl(p_j) v_j`` with ``p_j = exp(s_j - m) <= 1`` rounded to the input
    dtype (``|fl(p) - p| <= u p + tiny / 2``: unit roundoff ``u``, and half the smallest
    subnormal for probabilities that underflow the normal range) and divides by ``l >= 1``, the
    float32 sum of the unrounded ``p_j``. The output row's error is then at most
    ``u (P |V|) + tiny / 2 * sum of |v_j| over its visible keys`` (``P`` normalised), whatever
    the chunking. Zero for float32 inputs (no cast).

    Args:
        q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]``; causal, scale, window, segments: as
            :func:`naive_attention`.

    Returns:
        The bound (float), the largest over the output's entries.
    """
    dtype = np.dtype(q.dtype)
    if dtype == np.float32:
        return 0.0
    info = np.finfo(dtype)
    p, _, _ = reference._probabilities(q, k, causal=causal, scale=scale, window=window,
                                       **segments)
    v64 = np.abs(reference.repeat_kv(q, np.asarray(v, np.float64))[0])  # [G, Lkv, D]
    visible = (p > 0).astype(np.float64)
    bound = (float(info.eps) / 2 * (p @ v64)
             + float(info.smallest_subnormal) / 2 * (visible @ v64))  # [G, Lq, D]
    return float(bound.max(initial=0.0))


def gradient_accum_steps(cfg):
    """``accum_steps`` of :func:`rule_bound` for dq, dk, dv of a configuration.

    dq sums ``dS k_j`` over the kv chunks (``num_chunks_kv`` rescaled additions, ``chunk_kv +
    D`` products per block); dk and dv sum over the q chunks, and their block matmuls contract
    the ``group_size * chunk_q`` rows of the q groups that share a kv group.

    Args:
        cfg: the call's :class:`~popxl_flash.plan.config.AttentionConfig`.

    Returns:
        ``(dq_steps, dk_steps, dv_steps)``.
    """
    D = cfg.head_dim
    rows = cfg.group_size * cfg.chunk_q
    kv = cfg.num_chunks_q + rows + D
    return cfg.num_chunks_kv + cfg.chunk_kv + D, kv, kv


def gradient_rounding_parity(magnitude, dtype):
    """The backward's counterpart of :func:`probability_rounding_floor` (a ``parity`` of
    :func:`rule_bound`): with float16 inputs the block matmuls take ``P`` (for dv) and ``dS``
    (for dq, dk) rounded to the input dtype, as the naive attention does, so a gradient entry
    carries up to ``u`` times the sum of the |terms| it accumulates: ``u * magnitude`` with the
    magnitudes of :func:`grad_bounds` (unit roundoff ``u``). On tiny problems (one q row,
    ``D = 1``, a few keys) the naive error is a single sample that can fall far below that by
    luck (``G = 1, Lq = 1, Lkv = 4, D = 1``, scale 1.86: flash's dq error was 6.8x the naive's,
    1.08x the 3x bound); on large ones 3x the naive error exceeds it. Zero for float32 (no
    cast).

    Args:
        magnitude: the gradient's magnitude from :func:`grad_bounds`. dtype: the input dtype.

    Returns:
        The bound (float).
    """
    if np.dtype(dtype) == np.float32:
        return 0.0
    return float(np.finfo(dtype).eps) / 2 * magnitude


def rounding_floor(ref, dtype):
    """FlashAttention's floor: twice the rounding error of ``ref`` in ``dtype``."""
    dt = np.dtype(dtype).type
    ref = np.where(np.isfinite(ref), ref, 0.0)
    rounded = (ref.astype(dt) + dt(0.3) - dt(0.3)).astype(np.float64)
    return 2.0 * float(np.max(np.abs(rounded - ref), initial=0.0))


def max_err(x, ref):
    """max |x - ref| over finite reference entries (infinite ones are checked separately)."""
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(x.astype(np.float64)[finite] - ref[finite])))


def rule_bound(naive, ref, *, factor, dtype, accum_steps, magnitude, extra_floor=0.0,
               parity=0.0):
    """``max(factor * max|naive - ref|, parity) + floor`` (see the module docstring).

    Args:
        naive, ref: the same-precision naive result and the float64 reference.
        factor: 2 (forward) or 3 (backward).
        dtype: the input dtype name (for the rounding floor).
        accum_steps: ``n + c + D`` of the accumulation-error floor.
        magnitude: bound on the accumulated values (e.g. ``max|v|`` for the output).
        extra_floor: a further error bound the caller derives (the backward's stashed-output
            rounding, :func:`grad_bounds`).
        parity: a bound on an error the naive attention makes too but whose size its own
            error may miss on tiny problems (a float16 forward's probability rounding,
            :func:`probability_rounding_floor`); 0: none.

    Returns:
        The bound (float).
    """
    floor = rounding_floor(ref, dtype) + 4 * accum_steps * EPS32 * magnitude + extra_floor
    return max(factor * max_err(naive, ref), parity) + floor
