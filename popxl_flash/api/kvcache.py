"""Inference with a key/value cache: :func:`flash_attn_with_kvcache` (prefill and decode).

flash-attn's ``flash_attn_with_kvcache`` on PopXL tensors. The caches are static-size tensors the
caller owns (variables, or by-reference inputs of a subgraph); the new keys and values are
written into them in place at each batch row's run-time length, then every row attends to its
first ``cache_seqlens[b] + Lnew`` cache rows, causal aligned bottom-right. Three structures
(chosen by :func:`~popxl_flash.plan.kvcache.decode_choice`: least modelled time within
``memory_budget``):

* the straight-line pass (:mod:`popxl_flash.graph.decode`; one q chunk): one batched matmul over
  the whole cache read through views, the run-time lengths compared with int32 position tables
  as the mask, no loop;
* one kv loop: the core's forward with run-time segment ids and positions
  (:mod:`popxl_flash.graph.segments`), which give exactly the per-row masks and the run-time
  block skipping a cache needs::

    write:     k_cache[b, s_b : s_b + Lnew] = k[b]      (dynamic_update_, per batch row)
    lengths:   n_b = s_b + Lnew                          (int32 [B], on the device)
    kv rows:   id 0 if j < n_b else -1 (padding)         kv position j
    q rows:    id 0                                      q position n_b - Lq + i
    mask:      causal kv_pos <= q_pos; window q_pos - left <= kv_pos <= q_pos + right

  A kv chunk whose rows are padding for every batch row is skipped at run time (no matmul), so
  a step costs the matmul FLOPs of the longest row's length, rounded up to whole chunks;
* split-KV (below).

Score modifiers (flash-attn's ``softcap`` and ``alibi_slopes``) are the core's
(:mod:`popxl_flash.graph.score_mods`), applied per block to the scores before the mask. ALiBi
measures its distance between the positions the mask compares, ``q_pos - kv_pos =
i + n_b - Lq - j``: flash-attn's ``|i + seqlen_k - seqlen_q - j|`` with each row's own
``seqlen_k = n_b``; the ``[Hq]``/``[B, Hq]`` slopes are laid out per core group (below).

Cache layouts (``k_cache_layout``, ``v_cache_layout``): the new rows ``[B, Lnew, Hkv, D]`` are
transposed into the cache's layout and written on its row axis; ``"BHSD"``/``"BHDS"`` caches
are then read through views (no copy of a cache), ``"BSHD"`` through a transpose. Rotary
(``rotary_cos``, ``rotary_sin``): q and the new keys are rotated at their cache positions
before the write (:mod:`popxl_flash.api.rotary`).

Split-KV (flash-decoding): with ``S = num_splits > 1`` the cache's chunks are dealt to ``S``
parts round robin (part ``s`` holds chunks ``s, s + S, s + 2S, ...``), the parts become extra
groups of one batched attention (one matmul per step serves all parts) and their outputs are
combined by their logsumexp. Step ``m`` of the loop then covers cache rows
``[m S c, (m + 1) S c)``, so skipping by length still works, at a granule of ``S c`` rows.
:func:`~popxl_flash.plan.kvcache.decode_choice` compares the structures (see
``docs/design.md``, "KV cache").

This module holds the argument checks, the graph code and the public function; the host-side
structure choice and its cost model live in :mod:`popxl_flash.plan.kvcache`, whose public names
(``Dims``, ``decode_choice``, ``evaluate``, ``explain``, the ``DECODE_*``/``OPS_*`` constants,
...) are re-exported here, so ``pf.kvcache.explain`` works as before.

Layouts (G = B x H, the core's groups)::

    q [B, Lq, Hq, D]          -> [B*Hkv*S*r, Lq, D]     (r = Hq // Hkv, each q row S times)
    cache [B, Lc, Hkv, D]     -> [B*Hkv*S, Lc / S, D]   (S = 1: [B*Hkv, Lc, D])
    cache [B, Hkv, Lc, D]     -> [B*Hkv, Lc, D]         ("BHSD", S = 1: a reshape_ view)
    cache [B, Hkv, D, Lc]     -> [B*Hkv, Lc, D]         ("BHDS", S = 1: transpose_ + reshape_)
    out [B*Hkv*S*r, Lq, D]    -> combine over S -> [B, Lq, Hq, D]
    lse                       -> [B, Hq, Lq] float32
    alibi_slopes [Hq], [B, Hq] -> [B*Hkv*S*r] float32  (each slope S times)
"""
import numpy as np

from popxl_flash.backend import popxl
from popxl_flash.plan.config import (AttentionConfig, _check_int, check_bool, check_scale,
                                check_window)
from popxl_flash.api import rotary
from popxl_flash.api.flash_attn_interface import check_alibi_slopes
from popxl_flash.api.functional import (check_tensors, keyword_hints, modifier_inputs,
                                    segmented_attention)
from popxl_flash.plan.kvcache import (DECODE_CHUNKS, DECODE_SPLITS, MAX_DECODE_Q,
                                      MODEL_FILLS, OPS_DECODE, OPS_MODS, PREFILL_CHUNK_Q,
                                      STRUCTURES, VEC_DECODE, DecodeCandidate, DecodeChoice,
                                      Dims, _structure, check_dims, decode_choice, evaluate, explain,
                                      straight_counts)
from popxl_flash.graph import decode

ops = popxl.ops

#: The public names, the structure choice's re-exported from :mod:`popxl_flash.plan.kvcache`.
__all__ = ["flash_attn_with_kvcache", "write_rows_", "write_caches_", "check_shapes", "check_modifiers",
           "check_layout", "check_rotary", "K_CACHE_LAYOUTS", "V_CACHE_LAYOUTS",
           "KVCACHE_KEYWORD_HINTS", "Dims", "DecodeCandidate", "DecodeChoice", "decode_choice",
           "evaluate", "explain", "straight_counts", "DECODE_CHUNKS", "DECODE_SPLITS",
           "STRUCTURES", "VEC_DECODE", "MAX_DECODE_Q", "PREFILL_CHUNK_Q", "MODEL_FILLS", "OPS_DECODE", "OPS_MODS"]

#: What an inference-only call says to dropout keywords (flash-attn's ``flash_attn_with_kvcache``
#: has no dropout either).
_NO_DROPOUT = ("the KV cache is inference-only: flash_attn_with_kvcache has no dropout "
               "(use pf.flash_attn_func with dropout_p= and seed= for training)")

#: Keywords of other attention APIs (or of flash-attn's ``flash_attn_with_kvcache``) that are
#: spelt differently or not supported here.
KVCACHE_KEYWORD_HINTS = {
    "scale": "flash_attn_with_kvcache calls it softmax_scale=",
    "window": "flash_attn_with_kvcache calls it window_size=",
    "is_causal": "flash_attn_with_kvcache calls it causal= (PyTorch SDPA's is_causal)",
    "attn_mask": "mask tensors are not supported; use causal=, window_size= and cache_seqlens=",
    "dropout_p": _NO_DROPOUT,
    "dropout": _NO_DROPOUT,
    "seed": _NO_DROPOUT + "; it takes no seed",
    "return_attn_probs": _NO_DROPOUT + "; there is no keep mask to return",
    "return_dropout_mask": _NO_DROPOUT + "; there is no keep mask to return",
    "score_mod": "flash_attn_with_kvcache takes no score_mod (softcap= and alibi_slopes= are "
                 "built in; pf.flash_attention takes a score_mod)",
    "score_mod_inputs": "flash_attn_with_kvcache takes no score_mod (softcap= and alibi_slopes= "
                        "are built in; pf.flash_attention takes a score_mod)",
    "cache_batch_idx": "the caches are indexed by batch row directly (no cache_batch_idx)",
    "cache_leftpad": "left-padded caches are not supported: rows start at cache row 0",
    "block_table": "paged caches are not supported: pass contiguous caches (k_cache_layout= "
                   "and v_cache_layout= name their axis order)",
}

#: Accepted cache layouts (axis order of the cache tensors; S = the cache rows): flash-attn's
#: ``[B, S, H, D]``, head-major ``[B, H, S, D]`` and, for k only, the pre-transposed
#: ``[B, H, D, S]`` Graphcore's PopXL Llama keeps.
K_CACHE_LAYOUTS = ("BSHD", "BHSD", "BHDS")
V_CACHE_LAYOUTS = ("BSHD", "BHSD")
#: The cache-row axis of each layout, and the permutation taking ``[B, L, H, D]`` rows to it.
_SEQ_AXIS = {"BSHD": 1, "BHSD": 2, "BHDS": 3}
_FROM_BSHD = {"BSHD": None, "BHSD": (0, 2, 1, 3), "BHDS": (0, 2, 3, 1)}


def _shape4(name, t, meaning):
    shape = tuple(t.shape)
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"{name} must have rank 4 {meaning} with non-empty dims, got shape "
                         f"{shape}")
    return shape


def check_layout(name, layout, allowed):
    """Raise unless ``layout`` is one of ``allowed`` (a cache's axis order)."""
    if not isinstance(layout, str) or layout not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {name}={layout!r}")
    return layout


def _bshd(shape, layout):
    """``(B, S, H, D)`` of a cache shape in ``layout``."""
    axis = dict(zip(layout, shape))
    return axis["B"], axis["S"], axis["H"], axis["D"]


def _order(layout):
    return "[" + ", ".join(dict(B="B", S="Lcache", H="Hkv", D="D")[c] for c in layout) + "]"


def check_shapes(q, k_cache, v_cache, k, v, k_layout="BSHD", v_layout="BSHD"):
    """Ranks, sizes and dtypes of q, the caches (in their layouts) and the new rows.

    Returns:
        :class:`Dims`.
    """
    B, Lq, Hq, D = _shape4("q", q, "[B, Lq, Hq, D]")
    k_order, v_order = _order(k_layout), _order(v_layout)
    Bc, Lc, Hkv, Dc = _bshd(_shape4("k_cache", k_cache, f"{k_order} (k_cache_layout="
                                    f"{k_layout!r})"), k_layout)
    if (Bc, Dc) != (B, D):
        raise ValueError(f"k_cache must have q's batch B={B} and head dim D={D} "
                         f"({k_order}, k_cache_layout={k_layout!r}), got k_cache shape "
                         f"{tuple(k_cache.shape)}")
    v_shape = _shape4("v_cache", v_cache, f"{v_order} (v_cache_layout={v_layout!r})")
    if _bshd(v_shape, v_layout) != (Bc, Lc, Hkv, Dc):
        want = tuple(dict(B=Bc, S=Lc, H=Hkv, D=Dc)[c] for c in v_layout)
        same = "" if k_layout == v_layout else \
            f" in v_cache_layout={v_layout!r} (k_cache_layout={k_layout!r})"
        raise ValueError(f"v_cache must have the shape of k_cache{same}: B={Bc}, "
                         f"Lcache={Lc}, Hkv={Hkv}, D={Dc} as {v_order} = {want}, got v_cache "
                         f"shape {v_shape}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or both None), got "
                         f"k={'None' if k is None else tuple(k.shape)}, "
                         f"v={'None' if v is None else tuple(v.shape)}")
    Lnew = 0
    if k is not None:
        Bn, Lnew, Hn, Dn = _shape4("k", k, "[B, Lnew, Hkv, D]")
        if (Bn, Hn, Dn) != (B, Hkv, D):
            raise ValueError(f"k must have shape [B={B}, Lnew, Hkv={Hkv}, D={D}] (the caches' "
                             f"batch, heads and head dim), got k shape {tuple(k.shape)}")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got v shape "
                             f"{tuple(v.shape)}")
    dims = check_dims(Dims(B, Lq, Lc, Lnew, Hq, Hkv, D))  # shared with pf.kvcache.explain
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    if k is not None:
        named.update(k=k, v=v)
    dtypes = {name: t.dtype.name for name, t in named.items()}
    AttentionConfig._check_dtypes(dtypes)
    return dims


def check_aliasing(q, k_cache, v_cache, k, v):
    """Refuse one tensor in two roles that the in-place write would confuse: the same tensor
    as ``k_cache`` and ``v_cache`` (the v rows would overwrite the k rows just written), or a
    cache that is also ``q``, ``k`` or ``v`` (with new rows, the write changes what the call
    reads; a cache is only ever written through ``k_cache``/``v_cache``).

    Only tensor identity is visible when the graph is built: two different view tensors of
    one storage (in-place ``slice_``/``reshape_`` of one variable) are not detected.
    """
    if k_cache.id == v_cache.id:
        raise ValueError(f"k_cache and v_cache are the same tensor ({k_cache.id}); pass two "
                         "caches: with new rows the v rows would overwrite the k rows just "
                         "written, and without them v would equal k")
    others = dict(q=q, k=k, v=v)
    for cache_name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        for name, t in others.items():
            if t is not None and t.id == cache.id:
                raise ValueError(f"{name} and {cache_name} are the same tensor ({t.id}); the "
                                 f"cache is written in place, so {name} must be another tensor "
                                 "(copy it first if you mean its values)")


def _check_seqlens(cache_seqlens, dims):
    """``cache_seqlens``: an int32 ``[B]`` tensor, a Python int, or ``None`` (no new rows:
    the whole cache).

    Returns:
        The tensor, or the int.
    """
    high = dims.cache_len - dims.new_len
    if cache_seqlens is None:
        if dims.new_len:
            raise ValueError("cache_seqlens is required with new rows k, v (where to write "
                             "them); got cache_seqlens=None")
        return dims.cache_len
    if isinstance(cache_seqlens, (list, tuple)) or (isinstance(cache_seqlens, np.ndarray)
                                                     and cache_seqlens.ndim):
        kind = "a numpy array" if isinstance(cache_seqlens, np.ndarray) else \
            f"a {type(cache_seqlens).__name__} {list(cache_seqlens)!r}"
        raise TypeError(f"cache_seqlens must be an int32 [B={dims.batch}] popxl.Tensor or an "
                        f"int, got {kind} (load it with ops.host_load, or make it a "
                        "popxl.constant or variable)")
    if not isinstance(cache_seqlens, popxl.Tensor):
        return _check_int("cache_seqlens", cache_seqlens, low=0, high=high)
    check_tensors(cache_seqlens=cache_seqlens)
    if cache_seqlens.dtype.name != "int32":
        raise TypeError(f"cache_seqlens must have dtype int32 [B={dims.batch}], got dtype "
                        f"{cache_seqlens.dtype.name}")
    if tuple(cache_seqlens.shape) != (dims.batch,):
        raise ValueError(f"cache_seqlens must have shape [B={dims.batch}], got shape "
                         f"{tuple(cache_seqlens.shape)}")
    return cache_seqlens


def check_modifiers(softcap, alibi_slopes, dims):
    """``softcap`` and ``alibi_slopes`` (float32 ``[Hq]`` or ``[B, Hq]``), validated.

    Returns:
        The :class:`~popxl_flash.graph.score_mods.ScoreMods` of the call, or ``None`` (both off).
    """
    check_alibi_slopes(alibi_slopes, dims)
    mods, _ = modifier_inputs(softcap=softcap, alibi_slopes=alibi_slopes)
    return mods


def check_rotary(rotary_cos, rotary_sin, rotary_interleaved, dims):
    """flash-attn's rotary arguments, validated.

    Returns:
        ``None`` (no rotary) or ``(cos, sin, interleaved)``.
    """
    interleaved = check_bool("rotary_interleaved", rotary_interleaved)
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together, got "
                         f"rotary_cos={'None' if rotary_cos is None else 'a tensor'}, "
                         f"rotary_sin={'None' if rotary_sin is None else 'a tensor'}")
    if not dims.new_len:
        raise ValueError("rotary_cos/rotary_sin rotate the new keys: they need the new rows k "
                         "and v (flash-attn applies rotary only with k and v), got k=None")
    rows, _ = rotary.check_tables(rotary_cos, rotary_sin, dims.head_dim, "rotary_cos",
                                  "rotary_sin")
    need = max(dims.cache_len, dims.cache_len - dims.new_len + dims.q_len)
    if rows < need:
        extra = "" if need == dims.cache_len else \
            f" + Lq - Lnew = {need} rows (q row i sits at cache_seqlens[b] + i)"
        raise ValueError(f"rotary_cos must have at least Lcache={dims.cache_len}"
                         f"{extra or ' rows (one per cache position)'}, got shape "
                         f"{tuple(rotary_cos.shape)}")
    return rotary_cos, rotary_sin, interleaved


# -- graph code -------------------------------------------------------------------------------
def _i32(values):
    return popxl.constant(np.ascontiguousarray(values, dtype=np.int32))


def write_rows_(cache, new, seqlens, layout="BSHD"):
    """Write ``new [B, Lnew, Hkv, D]`` into ``cache`` (in ``layout``) in place at rows
    ``seqlens[b]`` of each batch row.

    Only the new rows change layout (a transpose of ``[B, Lnew, Hkv, D]``); the cache is
    written where it is, on its own cache-row axis.

    Args:
        seqlens: int32 ``[B]`` tensor (one ``dynamic_update_`` per batch row, index
            ``[b, seqlens[b]]`` on the batch and cache-row axes) or an int (one
            ``dynamic_update_`` for all rows).
        layout: the cache's axis order, one of :data:`K_CACHE_LAYOUTS`.

    Returns:
        The updated cache (a tensor aliasing ``cache``).
    """
    return _write_(cache, new, seqlens, layout, _row_indices(seqlens, new.shape[0]))


def _row_indices(seqlens, batch):
    """The int32 ``[2]`` index ``[b, seqlens[b]]`` of each batch row (``None`` for an int)."""
    if not isinstance(seqlens, popxl.Tensor):
        return None
    return [ops.concat([_i32([b]), ops.slice(seqlens, start=[b], stop=[b + 1], axis=[0])],
                       axis=0) for b in range(batch)]


def _write_(cache, new, seqlens, layout, indices):
    B, Lnew = new.shape[0], new.shape[1]
    axis, perm = _SEQ_AXIS[layout], _FROM_BSHD[layout]
    if perm is not None:
        new = new.transpose(perm)  # the Lnew new rows only
    if indices is None:
        return ops.dynamic_update_(cache, _i32([seqlens]), new, axes=[axis], sizes=[Lnew],
                                   no_overlap=True)
    for b in range(B):
        row = ops.slice(new, start=[b], stop=[b + 1], axis=[0])  # [1, ...] in the layout
        cache = ops.dynamic_update_(cache, indices[b], row, axes=[0, axis], sizes=[1, Lnew],
                                    no_overlap=True)
    return cache


def write_caches_(k_cache, v_cache, k, v, seqlens, k_layout="BSHD", v_layout="BSHD"):
    """:func:`write_rows_` of the new keys and values into both caches, the per-row indices
    built once for both (one ``concat`` per batch row, then a ``dynamic_update_`` per row and
    cache).

    Returns:
        ``(k_cache, v_cache)``: the updated caches (aliases).
    """
    indices = _row_indices(seqlens, k.shape[0])
    return (_write_(k_cache, k, seqlens, k_layout, indices),
            _write_(v_cache, v, seqlens, v_layout, indices))


def _positions(seqlens, batch, rows):
    """Cache positions ``seqlens[b] + i`` of ``rows`` rows: an int offset (for an int), or
    int32 ``[B, rows]``."""
    if not isinstance(seqlens, popxl.Tensor):
        return seqlens
    return seqlens.reshape((batch, 1)) + _i32(np.arange(rows).reshape(1, rows))


def _rotate_new(q, k, seqlens, dims, tables, q_at_positions):
    """q and the new keys rotated at their cache positions (flash-attn's rotary semantics:
    k at ``seqlens[b] + i``; q too if ``q_at_positions`` (causal or local), else every q row at
    ``seqlens[b]``)."""
    cos, sin, interleaved = tables
    B, Lq = dims.batch, dims.q_len

    def at(x, positions, rows):
        c, s = (rotary.table_rows(t, positions, rows) for t in (cos, sin))  # [(B,) rows, R/2]
        lead = (B, rows) if len(c.shape) == 3 else (1, rows)
        c, s = (t.reshape(lead + (1, t.shape[-1])) for t in (c, s))
        return rotary.rotate(x, c, s, interleaved)

    k = at(k, _positions(seqlens, B, dims.new_len), dims.new_len)
    if q_at_positions:
        q = at(q, _positions(seqlens, B, Lq), Lq)
    else:  # every q row at seqlens[b]: one table row per batch row, broadcast over Lq
        q = at(q, _positions(seqlens, B, 1), 1)
    return q, k

def _guard_seqlens(seqlens, dims):
    """Run-time ``cache_seqlens`` outside ``[0, Lcache - Lnew]`` (the IPU checks nothing).

    Returns:
        ``(bad, clamped)``: bool ``[B]``, the batch rows whose length is out of range, and the
        lengths clamped into range, so a write stays inside the cache (it lands at the
        clamped row) and a read reads at most the whole cache; :func:`_poison` then makes
        those rows' results NaN.
    """
    bad, clamped, _ = _guard_lengths(seqlens, dims)
    return bad, clamped


def _guard_lengths(seqlens, dims):
    """:func:`_guard_seqlens` with the straight-line pass's read lengths too.

    Returns:
        ``(bad, clamped, read)``: as :func:`_guard_seqlens`, and ``read``: the lengths in range,
        ``Lcache - Lnew`` (the whole cache) in the bad rows, so a bad row always sees keys and
        the straight-line pass's NaN scale reaches its out and lse.
    """
    high = _i32(dims.cache_len - dims.new_len)
    zero = _i32(0)
    low_bad, high_bad = ops.greater(zero, seqlens), ops.greater(seqlens, high)
    bad = ops.logical_or(low_bad, high_bad)
    read = ops.where(bad, high, seqlens)
    return bad, ops.where(low_bad, zero, read), read


def _poison(out, lse, bad, dims):
    """``out`` and ``lse`` NaN in the batch rows ``bad`` (bool ``[B]``), unchanged elsewhere.

    The NaN comes from ``sqrt(-1)``, an invalid operation, so with floating-point checks on
    (:func:`popxl_flash.enable_floating_point_checks`) the run stops there; without, the rows
    read NaN, never a plausible number. ``lse`` (``-inf`` where a row sees no key) is selected,
    not added to, so no arithmetic meets an infinity.
    """
    f32 = popxl.float32
    with popxl.name_scope("cache_seqlens_out_of_range"):  # what a trap's message names
        nan = ops.sqrt(ops.where(bad, popxl.constant(np.float32(-1.0)),
                                 popxl.constant(np.float32(0.0))))  # [B]: NaN where bad
    B = dims.batch
    add = nan if out.dtype == f32 else ops.cast(nan, out.dtype)
    out = out + add.reshape((B, 1, 1, 1))
    lse = ops.where(bad.reshape((B, 1, 1)), nan.reshape((B, 1, 1)), lse)
    return out, lse


def _lengths(seqlens, dims):
    """``n_b = seqlens[b] + Lnew``: int32 ``[B, 1, 1]`` (a tensor, also for an int)."""
    if not isinstance(seqlens, popxl.Tensor):
        return _i32(np.full((dims.batch, 1, 1), seqlens + dims.new_len))
    return seqlens.reshape((dims.batch, 1, 1)) + _i32(dims.new_len)


def _segments(lengths, dims, splits, chunk_kv, per_part):
    """Segment ids and positions of the core call (see the module docstring).

    Returns:
        ``(q_ids, kv_ids, q_pos, kv_pos)``: int32 ``[G', Lq]``, ``[Gk', P]``, ``[G', Lq]``,
        ``[Gk', P]`` with ``G' = B Hkv S r``, ``Gk' = B Hkv S``, ``P = per_part x chunk_kv``.
    """
    B, Hkv, r, Lq = dims.batch, dims.kv_heads, dims.group_size, dims.q_len
    P = per_part * chunk_kv
    # cache row of part s, local row m*c + t: (m*S + s)*c + t
    local = np.arange(P)
    rows = (((local // chunk_kv) * splits)[None, :] + np.arange(splits)[:, None]) * chunk_kv \
        + (local % chunk_kv)[None, :]  # [S, P]
    rows_c = _i32(rows.reshape(1, 1, splits, P))
    kv_valid = ops.greater(lengths.reshape((B, 1, 1, 1)), rows_c)  # [B, 1, S, P]
    zero = _i32(np.zeros((1, Hkv, 1, 1)))
    kv_ids = ops.where(kv_valid, zero, _i32(-1)).reshape_((B * Hkv * splits, P))
    # broadcast on the device: no constant of the cache's row count per group
    kv_pos = (rows_c + _i32(np.zeros((B, Hkv, 1, 1)))).reshape_((B * Hkv * splits, P))
    q_offsets = _i32((np.arange(Lq) - Lq).reshape(1, 1, 1, 1, Lq))
    zeros_q = _i32(np.zeros((1, Hkv, splits, r, 1)))
    q_pos = (lengths.reshape((B, 1, 1, 1, 1)) + q_offsets + zeros_q).reshape(
        (B * Hkv * splits * r, Lq))
    q_ids = _i32(np.zeros((B * Hkv * splits * r, Lq)))
    return q_ids, kv_ids, q_pos, kv_pos


def _q_groups(q, dims, splits):
    """``q [B, Lq, Hq, D] -> [B*Hkv*S*r, Lq, D]`` (each q row repeated for the S parts)."""
    B, Lq, Hkv, r, D = dims.batch, dims.q_len, dims.kv_heads, dims.group_size, dims.head_dim
    g = q.transpose((0, 2, 1, 3)).reshape((B, Hkv, 1, r, Lq, D))
    if splits > 1:
        g = ops.concat([g] * splits, axis=2)
    return g.reshape((B * Hkv * splits * r, Lq, D))


def _group_slopes(slopes, dims, splits):
    """ALiBi slopes ``[Hq]`` or ``[B, Hq]`` -> the core's float32 ``[B*Hkv*S*r]`` (group
    ``(b, kv head, part, h % r)`` takes the slope of q head ``h`` of batch row ``b``)."""
    B, Hkv, r = dims.batch, dims.kv_heads, dims.group_size
    rows = 1 if len(slopes.shape) == 1 else B
    g = slopes.reshape((rows, Hkv, 1, r))
    if rows < B:
        g = ops.concat([g] * B, axis=0)
    if splits > 1:
        g = ops.concat([g] * splits, axis=2)
    return g.reshape((B * Hkv * splits * r,))


def _cache_groups(cache, dims, splits, chunk_kv, per_part, layout="BSHD"):
    """``cache`` (in ``layout``) ``-> [B*Hkv*S, P, D]``, part ``s`` holding chunks
    ``s, s+S, ...`` (zero rows padded to whole granules; they are padding for every batch row).

    ``"BHSD"`` and ``"BHDS"`` with one part are views of the cache (``transpose_``,
    ``reshape_``): the core reads the cache where it is, no copy. ``"BSHD"`` and split-KV
    regroup it (one transpose: one copy of the cache per call, its reshapes views), as does
    padding a cache whose length is not a whole number of granules.
    """
    B, Lc, Hkv, D = dims.batch, dims.cache_len, dims.kv_heads, dims.head_dim
    padded = per_part * chunk_kv * splits
    axis = _SEQ_AXIS[layout]
    if padded > Lc:
        shape = list(cache.shape)
        shape[axis] = padded - Lc
        cache = ops.concat([cache, ops.init(tuple(shape), cache.dtype, init_type="zero")],
                           axis=axis)
    if layout == "BSHD":
        if splits == 1:  # one copy (the transpose); its reshape is a view
            return cache.transpose((0, 2, 1, 3)).reshape_((B * Hkv, padded, D))
        g = cache.reshape_((B, per_part, splits, chunk_kv, Hkv, D))  # a view
        g = g.transpose((0, 4, 2, 1, 3, 5))  # [B, Hkv, S, M, c, D]: the one copy
        return g.reshape_((B * Hkv * splits, per_part * chunk_kv, D))
    if layout == "BHDS":
        cache = cache.transpose_((0, 1, 3, 2))  # [B, Hkv, Lc, D] view
    if splits == 1:
        return cache.reshape_((B * Hkv, padded, D))  # a view: B and Hkv are adjacent
    g = cache.reshape_((B, Hkv, per_part, splits, chunk_kv, D))  # a view
    g = g.transpose((0, 1, 3, 2, 4, 5))  # [B, Hkv, S, M, c, D]: the one copy
    return g.reshape_((B * Hkv * splits, per_part * chunk_kv, D))


def _combine(out, lse, dims, splits):
    """Combine the parts' ``out [G', Lq, D]``, ``lse [G', Lq]`` by their logsumexp (float32).

    Returns:
        out ``[B, Lq, Hq, D]`` (q's dtype) and lse float32 ``[B, Hq, Lq]`` (``-inf``, out 0
        where no part saw a key).
    """
    B, Lq, Hkv, r, D = dims.batch, dims.q_len, dims.kv_heads, dims.group_size, dims.head_dim
    out = out.reshape((B, Hkv, splits, r, Lq, D))
    lse = lse.reshape((B, Hkv, splits, r, Lq, 1))
    if splits > 1:
        f32, dtype = popxl.float32, out.dtype
        seen = ops.greater(lse, popxl.constant(float("-inf"), dtype=f32))
        lse_f = ops.where(seen, lse, popxl.constant(float(np.finfo(np.float32).min), dtype=f32))
        m = ops.max(lse_f, axis=2, keepdims=True)  # [B, Hkv, 1, r, Lq, 1]
        w = ops.where(seen, ops.exp(lse_f - m), popxl.constant(0.0, dtype=f32))  # [.., S, ..]
        total = ops.sum(w, axis=2)  # [B, Hkv, r, Lq, 1]
        out32 = out if dtype == f32 else ops.cast(out, f32)
        acc = ops.sum(w * out32, axis=2)  # [B, Hkv, r, Lq, D]
        any_seen = ops.greater(total, popxl.constant(0.0, dtype=f32))
        safe = ops.where(any_seen, total, popxl.constant(1.0, dtype=f32))
        out = acc / safe
        out = out if dtype == f32 else ops.cast(out, dtype)
        lse = ops.where(any_seen, m.reshape((B, Hkv, r, Lq, 1)) + ops.log(safe),
                        popxl.constant(float("-inf"), dtype=f32))
    out = out.reshape((B, dims.q_heads, Lq, D)).transpose((0, 2, 1, 3))
    return out, lse.reshape((B, dims.q_heads, Lq))


@keyword_hints(KVCACHE_KEYWORD_HINTS)
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, *,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, num_splits=None, return_lse=False,
                            return_softmax_lse=False, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=True, k_cache_layout="BSHD",
                            v_cache_layout="BSHD", num_chunks_q=None, num_chunks_kv=None,
                            memory_budget=None):
    """flash-attn's ``flash_attn_with_kvcache`` on PopXL tensors: attention over a static-size
    key/value cache, prefill (``Lq > 1``) and decode (``Lq = 1``).

    If ``k`` and ``v`` are given they are first written into the caches **in place** at rows
    ``cache_seqlens[b] : cache_seqlens[b] + Lnew`` of each batch row ``b`` (the caches are the
    caller's tensors: variables, or by-reference inputs of the graph being built); then batch
    row ``b`` attends to its first ``n_b = cache_seqlens[b] + Lnew`` cache rows, query ``i``
    sitting at position ``n_b - Lq + i`` (causal aligned bottom-right, as flash-attn). The
    structure (a straight-line pass over the whole cache, or a kv loop that skips the chunks
    beyond every row's ``n_b``) is the least modelled time within ``memory_budget``.

    The options after ``cache_seqlens`` are keyword-only (flash-attn's positional order has
    ``rotary_cos``/``rotary_sin`` there).

    Args:
        q: ``[B, Lq, Hq, D]`` float16 or float32.
        k_cache, v_cache: ``[B, Lcache, Hkv, D]`` (or the ``k_cache_layout`` /
            ``v_cache_layout`` axis order), q's dtype, ``Hkv`` divides ``Hq`` (grouped-query /
            multi-query attention: q head ``h`` reads cache head ``h // (Hq // Hkv)``).
            Modified in place when ``k``, ``v`` are given. Two different tensors, neither of
            them ``q``, ``k`` or ``v`` (``ValueError``; views of one storage are not detected).
        k, v: ``None`` or the new rows ``[B, Lnew, Hkv, D]``, ``Lnew <= Lcache``, whatever the
            caches' layouts (only the new rows are transposed into them).
        k_cache_layout: ``"BSHD"`` (flash-attn's ``[B, Lcache, Hkv, D]``, default),
            ``"BHSD"`` (``[B, Hkv, Lcache, D]``) or ``"BHDS"`` (``[B, Hkv, D, Lcache]``: k kept
            pre-transposed, as Graphcore's PopXL Llama's ``prepare_cache`` does).
        v_cache_layout: ``"BSHD"`` (default) or ``"BHSD"``. The straight-line pass reads every
            layout through views; with ``"BHSD"``/``"BHDS"`` caches one kv loop does too (the
            automatic choice then weighs no split); a ``"BSHD"`` kv loop and split-KV regroup
            the cache (one transpose of it per call).
        rotary_cos, rotary_sin: ``None`` or float tensors ``[Lro, R/2]`` (``R <= D`` rotated
            dims, ``Lro >= Lcache``, ``+ Lq - Lnew`` if ``Lq > Lnew``; needs ``k``, ``v``):
            flash-attn's semantics, applied before the write: the new keys are rotated at
            their cache positions ``cache_seqlens[b] + i``; q likewise with ``causal`` or a
            window, otherwise every q row at ``cache_seqlens[b]``. ``pf.rotary_tables`` makes the standard tables.
        rotary_interleaved: ``True`` (flash-attn's default): pairs ``(2i, 2i+1)`` (GPT-J);
            ``False``: pairs ``(i, i + R/2)`` (GPT-NeoX, Llama). See :func:`pf.apply_rotary`.
        cache_seqlens: the rows already in the cache per batch row: an int32 ``[B]`` tensor
            (run time) or an int; ``0 <= cache_seqlens[b] <= Lcache - Lnew`` (an int is
            checked when the graph is built; for a tensor, a batch row outside it gets NaN
            ``out`` and ``lse``, an invalid operation that floating-point checks trap, and
            its new rows land at the clamped row, never outside the cache). ``None`` (only
            without ``k``, ``v``): the whole cache is valid.
        softmax_scale: ``None`` for ``1/sqrt(D)``, or a finite real number.
        causal: causal mask aligned bottom-right per batch row. Default ``False``.
        window_size: ``(left, right)`` around each row's bottom-right diagonal, ``-1`` for an
            unbounded side; intersected with ``causal``.
        softcap: ``> 0``: scores become ``softcap * tanh(s / softcap)`` (before ALiBi and the
            mask); 0 = off.
        alibi_slopes: ``None`` or a float32 ``[Hq]`` or ``[B, Hq]`` runtime tensor: the score
            of query ``i`` and cache row ``j`` of batch row ``b`` gets
            ``-slope * |i + n_b - Lq - j|`` (flash-attn's ``|i + seqlen_k - seqlen_q - j|``
            with ``seqlen_k = n_b``, each row's own bottom-right alignment).
        num_splits: ``None`` or 0 (automatic, :func:`decode_choice`), or ``S >= 1`` parts of
            split-KV (1: one kv loop).
        return_lse, return_softmax_lse: also return the logsumexp (``return_softmax_lse`` is
            flash-attn's name; either one).
        num_chunks_q, num_chunks_kv: chunk counts over ``Lq`` and over the whole cache
            (``None``: automatic). With splits the cache chunks are dealt to the parts, the
            count rounded up to a multiple of ``num_splits``. Fixing ``num_splits`` (``>= 1``)
            or ``num_chunks_kv`` runs a kv loop.
        memory_budget: bytes the call may hold live beyond its inputs and outputs (``None``:
            twice the call's own inputs' and outputs' bytes plus 4 MiB, O(L),
            :meth:`popxl_flash.plan.kvcache.Dims.default_budget`, the least memory when no
            structure meets it): the automatic structure is the
            least modelled time among those whose modelled memory fits
            (:func:`~popxl_flash.plan.kvcache.decode_choice`); an explicit budget nothing
            meets raises ``ValueError``.

    Returns:
        out ``[B, Lq, Hq, D]`` in q's dtype (0 where a row sees no key); with ``return_lse``,
        ``(out, lse)`` with lse float32 ``[B, Hq, Lq]`` (``-inf`` there).
    """
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    tensors.update({n: t for n, t in (("k", k), ("v", v)) if t is not None})
    check_tensors(**tensors)
    k_layout = check_layout("k_cache_layout", k_cache_layout, K_CACHE_LAYOUTS)
    v_layout = check_layout("v_cache_layout", v_cache_layout, V_CACHE_LAYOUTS)
    dims = check_shapes(q, k_cache, v_cache, k, v, k_layout, v_layout)
    check_aliasing(q, k_cache, v_cache, k, v)
    seqlens = _check_seqlens(cache_seqlens, dims)
    mods = check_modifiers(softcap, alibi_slopes, dims)
    causal = check_bool("causal", causal)
    scale = check_scale(softmax_scale, dims.head_dim, name="softmax_scale")
    window = check_window(window_size, name="window_size")
    return_lse = check_bool("return_lse", return_lse) | \
        check_bool("return_softmax_lse", return_softmax_lse)
    rotary = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, dims)
    # split-KV regroups a cache: with other layouts the automatic choice keeps to views
    max_splits = None if (k_layout, v_layout) == ("BSHD", "BSHD") else 1
    straight, splits, chunk_q, nq, chunk_kv, per_part = _structure(
        dims, q.dtype.name, num_splits, num_chunks_q, num_chunks_kv, mods, causal=causal,
        window=window, return_lse=return_lse,
        runtime_lengths=isinstance(seqlens, popxl.Tensor), max_splits=max_splits,
        memory_budget=memory_budget, layouts=(k_layout, v_layout), scale=scale)
    with popxl.name_scope("flash_attn_with_kvcache"):
        bad = None
        read = seqlens
        if isinstance(seqlens, popxl.Tensor):
            if straight:
                bad, seqlens, read = _guard_lengths(seqlens, dims)
            else:
                bad, seqlens = _guard_seqlens(seqlens, dims)
        if rotary is not None:
            local = causal or any(w is not None and w >= 0 for w in window)
            q, k = _rotate_new(q, k, seqlens, dims, rotary, q_at_positions=local)
        if k is not None:
            k_cache, v_cache = write_caches_(k_cache, v_cache, k, v, seqlens, k_layout,
                                             v_layout)
        if straight:
            out, lse = decode.straight_pass(
                q, k_cache, v_cache, read, new_len=dims.new_len, k_layout=k_layout,
                v_layout=v_layout, scale=scale, causal=causal, window=window,
                softcap=0.0 if mods is None else mods.softcap, slopes=alibi_slopes, bad=bad,
                return_lse=return_lse)
            return (out, lse) if return_lse else out
        lengths = _lengths(seqlens, dims)  # [B, 1, 1]
        seg = _segments(lengths, dims, splits, chunk_kv, per_part)
        qg = _q_groups(q, dims, splits)
        kg = _cache_groups(k_cache, dims, splits, chunk_kv, per_part, k_layout)
        vg = _cache_groups(v_cache, dims, splits, chunk_kv, per_part, v_layout)
        extras = () if alibi_slopes is None else (_group_slopes(alibi_slopes, dims, splits),)
        out, lse = segmented_attention(qg, kg, vg, *seg, mods=mods, extras=extras,
                                       num_chunks_q=nq, num_chunks_kv=per_part, causal=causal,
                                       scale=scale, window=window)
        out, lse = _combine(out, lse, dims, splits)
        if bad is not None:
            out, lse = _poison(out, lse, bad, dims)
    return (out, lse) if return_lse else out
