"""numpy float64 oracle of the attention the library computes, forward and analytic backward.

Same semantics as :func:`popxl_flash.flash_attention` (see ``docs/user-guide.md``):

* shapes ``q [G, Lq, D]``, ``k, v [Gk, Lkv, D]`` with ``G % Gk == 0`` (grouped-query attention
  when ``Gk < G``: q group ``g`` reads kv group ``g // (G // Gk)``);
* ``scale=None`` means ``1/sqrt(D)``;
* bottom-right causal alignment: row ``i`` sees column ``j`` iff ``j <= i + (Lkv - Lq)``;
* ``window=(left, right)`` (``None`` or ``-1`` = unbounded side) keeps
  ``i + (Lkv - Lq) - left <= j <= i + (Lkv - Lq) + right``, intersected with ``causal``;
* a row that sees no key has output 0, lse ``-inf`` and zero gradient.

Packed sequences (``q_segment_ids [G or 1, Lq]``, ``kv_segment_ids [Gk or 1, Lkv]``, integer):
row ``i`` of group ``g`` sees column ``j`` only if ``q_segment_ids[g, i] == kv_segment_ids[g',
j] >= 0`` (``g'`` the kv group of ``g``; a negative id is padding: it sees nothing and nothing
sees it) and the mask above allows ``(i, j)``. With ``q_positions``/``kv_positions`` (integer,
the ids' shapes) the causal and window conditions compare positions instead of indices:
``kv_pos <= q_pos`` (causal) and ``q_pos - left <= kv_pos <= q_pos + right`` (window).
:func:`varlen_segments` gives flash-attn's varlen masks in these terms, and
:func:`attention_varlen` is the per-sequence oracle.

Everything is computed in float64 whatever the input dtype. Grouped-query attention is done the
obvious way, in the oracle only: each kv group is repeated for the ``G // Gk`` q groups that read
it, and the gradients of the copies are summed.
"""
import numpy as np


def repeat_kv(q, *kv):
    """Repeat each kv group for the q groups that share it (grouped-query attention).

    Args:
        q: ``[G, Lq, D]``.
        kv: arrays ``[Gk, Lkv, D]`` with ``G % Gk == 0``.

    Returns:
        The kv arrays as ``[G, Lkv, D]``: group ``g`` is kv group ``g // (G // Gk)``.
    """
    G = q.shape[0]
    out = []
    for x in kv:
        if x.ndim != 3 or G % x.shape[0]:
            raise ValueError(f"kv groups {x.shape[0]} must divide q's groups G={G}, "
                             f"got shapes {q.shape} and {x.shape}")
        out.append(np.repeat(x, G // x.shape[0], axis=0))
    return out


def sum_groups(x, kv_groups):
    """Sum ``x [G, L, D]`` over the q groups that share each kv group -> ``[Gk, L, D]``."""
    G = x.shape[0]
    return x.reshape(kv_groups, G // kv_groups, *x.shape[1:]).sum(axis=1)


def visibility(Lq, Lkv, *, causal=True, window=None):
    """Dense visibility matrix.

    Args:
        Lq, Lkv: query and key lengths.
        causal: bottom-right aligned causal mask.
        window: ``None`` or ``(left, right)``; ``None``/``-1`` entries are unbounded.

    Returns:
        bool array ``[Lq, Lkv]``, True where query row ``i`` sees key column ``j``.
    """
    offset = np.arange(Lkv)[None, :] - (np.arange(Lq)[:, None] + (Lkv - Lq))  # j - diag(i)
    return _band(offset, causal, window)


def _band(offset, causal, window):
    """Visibility of a key whose offset from the query's diagonal is ``offset`` (array)."""
    left, right = (None, None) if window is None else window
    visible = np.ones(offset.shape, dtype=bool)
    if causal:
        visible &= offset <= 0
    if left is not None and left >= 0:
        visible &= offset >= -left
    if right is not None and right >= 0:
        visible &= offset <= right
    return visible


def _as_rows(name, ids, length):
    """An integer ``[G or 1, length]`` array, or raise naming ``name``."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] != length or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array [G or 1, {length}], got "
                         f"{ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def mask(Lq, Lkv, *, causal=True, window=None, q_segment_ids=None, kv_segment_ids=None,
         q_positions=None, kv_positions=None, groups=None):
    """Dense visibility, with optional segment ids and positions (see the module docstring).

    Args:
        Lq, Lkv: query and key lengths.
        causal, window: as :func:`visibility`.
        q_segment_ids, kv_segment_ids: ``None`` or integer ``[G or 1, Lq]`` / ``[Gk or 1, Lkv]``
            (given together); negative ids are padding.
        q_positions, kv_positions: ``None`` or integer ``[G or 1, Lq]`` / ``[G or 1, Lkv]``
            (given together, with segment ids): causal and window compare these.
        groups: ``None`` or G; kv ids (and positions) of ``Gk`` rows, ``1 < Gk < G`` (or
            fewer than the q ids' rows), are repeated for the q groups of each kv group.

    Returns:
        bool ``[Lq, Lkv]`` without segment ids, else ``[G or 1, Lq, Lkv]``.
    """
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if (q_positions is None) != (kv_positions is None):
        raise ValueError("q_positions and kv_positions must be given together")
    if q_segment_ids is None:
        if q_positions is not None:
            raise ValueError("positions need segment ids")
        return visibility(Lq, Lkv, causal=causal, window=window)
    q_rows = len(_as_rows("q_segment_ids", q_segment_ids, Lq))
    kv = _repeat_kv_rows(dict(kv_segment_ids=kv_segment_ids, kv_positions=kv_positions),
                         max(q_rows, groups or 1))
    kv_segment_ids, kv_positions = kv["kv_segment_ids"], kv["kv_positions"]
    sq = _as_rows("q_segment_ids", q_segment_ids, Lq)[:, :, None]  # [Gs, Lq, 1]
    sk = _as_rows("kv_segment_ids", kv_segment_ids, Lkv)[:, None, :]  # [Gs, 1, Lkv]
    visible = (sq == sk) & (sq >= 0)
    if q_positions is None:
        return visible & visibility(Lq, Lkv, causal=causal, window=window)
    pq = _as_rows("q_positions", q_positions, Lq)[:, :, None]
    pk = _as_rows("kv_positions", kv_positions, Lkv)[:, None, :]
    return visible & _band(pk - pq, causal, window)


def varlen_segments(cu_seqlens, total):
    """flash-attn's ``cu_seqlens`` as segment ids and bottom-right positions.

    Sequence ``s`` holds rows ``cu_seqlens[s] <= r < cu_seqlens[s + 1]``; rows outside every
    sequence are padding (id -1). The position of a row is its distance to the end of its
    sequence, ``r - cu_seqlens[s + 1]`` (so the last row has -1), which aligns causal masks
    bottom-right per sequence, as flash-attn's varlen functions do.

    Args:
        cu_seqlens: integer ``[num_seqs + 1]``; if it decreases anywhere, every row is padding
            (:func:`is_packing`).
        total: the number of rows (``total_q`` or ``total_k``).

    Returns:
        ``(segment_ids, positions)``, int64 ``[1, total]`` each (positions 0 on padding).
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    rows = np.arange(total)
    seg = np.full(total, -1, dtype=np.int64)
    pos = np.zeros(total, dtype=np.int64)
    for s in range(len(cu) - 1 if is_packing(cu) else 0):
        inside = (rows >= cu[s]) & (rows < cu[s + 1])
        seg[inside] = s
        pos[inside] = rows[inside] - cu[s + 1]
    return seg[None], pos[None]


def is_packing(cu_seqlens):
    """Whether offsets describe a packing: they never decrease. The varlen functions treat
    every row of a call whose ``cu_seqlens_q`` or ``cu_seqlens_k`` decreases as padding.

    Args:
        cu_seqlens: integer ``[num_seqs + 1]``.

    Returns:
        bool.
    """
    return bool(np.all(np.diff(np.asarray(cu_seqlens, dtype=np.int64)) >= 0))


def _repeat_kv_rows(segments, groups):
    """kv segment ids / positions with ``Gk`` rows (``1 < Gk < G``) repeated to ``G`` rows."""
    out = dict(segments)
    for name in ("kv_segment_ids", "kv_positions"):
        rows = out.get(name)
        if rows is not None and np.ndim(rows) == 2 and 1 < len(rows) < groups:
            out[name] = np.repeat(np.asarray(rows), groups // len(rows), axis=0)
    return out


#: Score-modifier keywords of :func:`attention` and :func:`attention_grad` (FlashAttention-2's
#: semantics; see :mod:`popxl_flash.graph.score_mods`): ``softcap`` (float, 0 = off),
#: ``alibi_slopes`` (``[G]``), ``score_mod(s, g, q_idx, kv_idx)`` on float64 ``[G, Lq, Lkv]``
#: with integer index arrays ``[G, 1, 1]``, ``[Gs, Lq, 1]``, ``[Gs, 1, Lkv]`` and
#: ``score_mod_grad`` (its elementwise derivative in ``s``, same arguments; gradients only),
#: ``keep`` (bool ``[G, Lq, Lkv]`` dropout keep mask) with ``dropout`` (its probability).
MODIFIERS = ("softcap", "alibi_slopes", "score_mod", "score_mod_grad", "keep", "dropout")


def _split_modifiers(kwargs):
    """``(segments, modifiers)`` from the keyword arguments of :func:`attention`."""
    mods = {n: kwargs.pop(n) for n in MODIFIERS if n in kwargs}
    return kwargs, mods


def _indices(G, Lq, Lkv, q_positions=None, kv_positions=None, **_):
    """``(g, q_idx, kv_idx, offset)``: the positions score modifiers see (row and column
    indices, or the varlen positions; ``offset`` = ``Lkv - Lq``, 0 with positions)."""
    g = np.arange(G).reshape(G, 1, 1)
    if q_positions is None:
        return g, np.arange(Lq).reshape(1, Lq, 1), np.arange(Lkv).reshape(1, 1, Lkv), Lkv - Lq
    qp, kp = np.asarray(q_positions), np.asarray(kv_positions)
    return g, qp[:, :, None], kp[:, None, :], 0


def modify_scores(s, segments, *, softcap=0.0, alibi_slopes=None, score_mod=None,
                  score_mod_grad=None, **_):
    """Scores after softcap, ALiBi and score_mod, and their derivative in ``s`` (float64).

    Args:
        s: ``scale * q k^T`` ``[G, Lq, Lkv]``. segments: the position keywords (if any).

    Returns:
        ``(s_mod, ds_mod/ds)``.
    """
    G, Lq, Lkv = s.shape
    g, qi, kj, offset = _indices(G, Lq, Lkv, **segments)
    grad = np.ones_like(s)
    if softcap:
        t = np.tanh(s / softcap)
        s, grad = softcap * t, grad * (1 - t * t)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64).reshape(G, 1, 1)
        s = s - slopes * np.abs(qi + offset - kj)
    if score_mod is not None:
        if score_mod_grad is not None:
            grad = grad * score_mod_grad(s, g, qi, kj)
        s = score_mod(s, g, qi, kj)
    return s, grad


def _probabilities(q, k, *, causal, scale, window, **segments):
    """Softmax probabilities and lse in float64.

    Args:
        segments: the segment-id and position keywords of :func:`mask`, and the score
            modifiers (:data:`MODIFIERS`).

    Returns:
        p ``[G, Lq, Lkv]`` (0 where masked or the row sees nothing), lse ``[G, Lq]``
        (``-inf`` for rows that see nothing), and the scale.
    """
    segments, mods = _split_modifiers(dict(segments))
    q = np.asarray(q, dtype=np.float64)
    k, = repeat_kv(q, np.asarray(k, dtype=np.float64))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    s, _ = modify_scores(scale * (q @ k.transpose(0, 2, 1)), segments, **mods)
    segments = dict(segments, groups=q.shape[0]) if segments else segments
    visible = mask(q.shape[1], k.shape[1], causal=causal, window=window, **segments)
    s = np.where(visible, s, -np.inf)  # [G, Lq, Lkv]
    m = s.max(axis=-1, keepdims=True)  # [G, Lq, 1]
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)  # exp(-inf) = 0 where masked
    l = p.sum(axis=-1, keepdims=True)  # [G, Lq, 1]
    with np.errstate(divide="ignore"):
        lse = (m_safe + np.log(l))[..., 0]  # log(0) = -inf for rows that see nothing
    p = p / np.where(l > 0, l, 1.0)
    return p, lse, scale


def attention(q, k, v, *, causal=True, scale=None, window=None, **segments):
    """Reference attention.

    Args:
        q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]`` with ``G % Gk == 0`` (any float dtype;
            computed in float64).
        causal, scale, window: as :func:`popxl_flash.flash_attention`.
        segments: ``q_segment_ids``, ``kv_segment_ids``, ``q_positions``, ``kv_positions``
            (see :func:`mask`).

    Returns:
        ``(out, lse)``: out ``[G, Lq, D]`` float64, lse ``[G, Lq]`` float64.
    """
    p, lse, _ = _probabilities(q, k, causal=causal, scale=scale, window=window, **segments)
    v, = repeat_kv(q, np.asarray(v, dtype=np.float64))
    return _dropped(p, segments) @ v, lse


def _dropped(p, mods):
    """``p * keep / (1 - dropout)`` when a keep mask is given, else ``p``."""
    keep = mods.get("keep")
    if keep is None:
        return p
    return p * np.asarray(keep, bool) / (1.0 - mods.get("dropout", 0.0))


def attention_grad(dout, q, k, v, *, causal=True, scale=None, window=None, **segments):
    """Analytic gradients of :func:`attention`'s ``out`` for an upstream gradient ``dout``.

    With ``P = softmax(scale * Q K^T)`` and ``O = P V``:
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``; with ``Gk < G`` dK and dV of the repeated
    kv groups are summed over the q groups that share them.

    Args:
        dout: ``[G, Lq, D]``; q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]``.
        causal, scale, window, segments: as :func:`attention`.

    Returns:
        ``(dq, dk, dv)`` float64 with the shapes of q, k, v.
    """
    q64, k64, v64, do64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    kv_groups = k64.shape[0]
    k64, v64 = repeat_kv(q64, k64, v64)
    p, _, scale = _probabilities(q64, k64, causal=causal, scale=scale, window=window,
                                 **segments)
    seg, mods = _split_modifiers(dict(segments))
    _, dmod = modify_scores(scale * (q64 @ k64.transpose(0, 2, 1)), seg, **mods)
    p_drop = _dropped(p, mods)
    out = p_drop @ v64
    dv = p_drop.transpose(0, 2, 1) @ do64
    dp = _dropped(do64 @ v64.transpose(0, 2, 1), mods)
    ds = p * (dp - (do64 * out).sum(axis=-1, keepdims=True)) * dmod
    dq = scale * (ds @ k64)
    dk = scale * (ds.transpose(0, 2, 1) @ q64)
    return dq, sum_groups(dk, kv_groups), sum_groups(dv, kv_groups)


def _num_seqs(cu_seqlens_q, cu_seqlens_k):
    """Sequences to run: ``num_seqs``, or 0 (all padding) if either offset list decreases."""
    ok = is_packing(cu_seqlens_q) and is_packing(cu_seqlens_k)
    return len(cu_seqlens_q) - 1 if ok else 0


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                     window=None):
    """Per-sequence oracle of flash-attn's varlen attention, in float64.

    Each sequence ``s`` (q rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, k/v rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``) is run alone through :func:`attention` (causal and
    window bottom-right aligned per sequence). Rows outside every sequence are padding.

    Args:
        q: ``[G, total_q, D]``; k, v: ``[G, total_k, D]`` (heads as groups).
        cu_seqlens_q, cu_seqlens_k: integer ``[num_seqs + 1]``; if either decreases anywhere,
            every row is padding (as in :func:`popxl_flash.flash_attn_varlen_func`).
        causal, scale, window: as :func:`attention`.

    Returns:
        ``(out, lse)``: out ``[G, total_q, D]`` (0 on padding and rows that see nothing), lse
        ``[G, total_q]`` (``-inf`` there).
    """
    G, total_q, D = np.shape(q)
    out = np.zeros((G, total_q, D))
    lse = np.full((G, total_q), -np.inf)
    for s in range(_num_seqs(cu_seqlens_q, cu_seqlens_k)):
        rows = slice(int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]))
        cols = slice(int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1]))
        if rows.start == rows.stop or cols.start == cols.stop:
            continue
        out[:, rows], lse[:, rows] = attention(q[:, rows], k[:, cols], v[:, cols],
                                               causal=causal, scale=scale, window=window)
    return out, lse


def attention_varlen_grad(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                          scale=None, window=None):
    """Per-sequence gradients of :func:`attention_varlen` (0 on padding).

    Args:
        dout: ``[G, total_q, D]``.
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window: as
            :func:`attention_varlen`.

    Returns:
        ``(dq, dk, dv)`` float64 with the shapes of q, k, v.
    """
    dq, dk, dv = (np.zeros(np.shape(a)) for a in (q, k, v))
    for s in range(_num_seqs(cu_seqlens_q, cu_seqlens_k)):
        rows = slice(int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]))
        cols = slice(int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1]))
        if rows.start == rows.stop or cols.start == cols.stop:
            continue
        dq[:, rows], dk[:, cols], dv[:, cols] = attention_grad(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], causal=causal, scale=scale,
            window=window)
    return dq, dk, dv
