"""flash-attn's varlen interface: :func:`flash_attn_varlen_func` on packed ``[total, H, D]`` rows.

Several sequences of different lengths are packed into one row of ``total_q`` queries and
``total_k`` keys; ``cu_seqlens_q``/``cu_seqlens_k`` (int32 ``[num_seqs + 1]`` tensors given at
run time) hold the sequence offsets, exactly as in ``flash_attn.flash_attn_varlen_func``. IPU
programs have static shapes, so ``total_*`` and ``num_seqs`` are fixed when the graph is built
while the packing changes every step:

* fewer real sequences than ``num_seqs``: repeat the last offset (empty sequences), e.g.
  ``[0, 5, 9, 9, 9]`` for two sequences under a bound of four;
* fewer rows than ``total``: leave the rows after ``cu_seqlens[-1]`` unused; they are padding
  (output 0, lse ``-inf``, gradient 0).

On the device the offsets become segment ids and bottom-right positions
(:func:`popxl_flash.graph.segments.varlen_segments`), and the core kernel runs with runtime segment
masks: causal and window masks are aligned bottom-right **per sequence** (query ``i`` of a
sequence with ``Lq_s`` queries and ``Lk_s`` keys sees key ``j <= i + Lk_s - Lq_s``), as
flash-attn's varlen functions. The static schedule then has no causal structure to skip, and
runtime block skipping does that work: blocks between two sequences, or above a sequence's
diagonal, run no matmul.

Layouts::

    q [total_q, Hq, D] --transpose--> [Hq, total_q, D]   (G = Hq groups, one packed row)
    out [Hq, total_q, D] --transpose--> [total_q, Hq, D]
    lse [Hq, total_q]                                     (flash-attn's varlen softmax_lse)
"""
from popxl_flash.api import provenance
from popxl_flash.backend import popxl
from popxl_flash.plan.config import _check_int, check_bool
from popxl_flash.plan.packed import max_seqlen as packing_of
from popxl_flash.api.flash_attn_interface import (KEYWORD_HINTS, Dims, check_kv_heads, core_options,
                                              group_slopes, modifier_options, user_inputs)
from popxl_flash.api.functional import (check_tensors, dropout_mask, keyword_hints, modifier_inputs,
                                    segmented_attention)
from popxl_flash.graph.segments import varlen_segments

ops = popxl.ops

#: Keywords of ``flash_attn_func`` or PyTorch that the varlen function spells differently.
VARLEN_KEYWORD_HINTS = {
    **KEYWORD_HINTS,
    "layout": "varlen tensors are [total, H, D]; there is no layout option",
    "q_segment_ids": "segment ids are pf.flash_attention's; the varlen function derives them "
                     "from cu_seqlens_q/cu_seqlens_k",
    "kv_segment_ids": "segment ids are pf.flash_attention's; the varlen function derives them "
                      "from cu_seqlens_q/cu_seqlens_k",
}


def _check_packed(q, k, v):
    """Ranks and sizes of ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``.

    Returns:
        :class:`~popxl_flash.api.flash_attn_interface.Dims` with ``batch=1``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        shape = tuple(t.shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"{name} must have rank 3 [total, H, D] with non-empty dims, got "
                             f"shape {shape}")
    total_q, Hq, D = q.shape
    total_k, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"k must have q's head dim D={D} ([total_k, Hkv, D]), got k shape "
                         f"{tuple(k.shape)}")
    check_kv_heads(k, v, Hq, Hkv)
    return Dims(1, total_q, total_k, Hq, Hkv, D)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k):
    """Both int32 ``[num_seqs + 1]`` tensors of one length; return ``num_seqs``."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype.name != "int32":
            raise TypeError(f"{name} must have dtype int32 [num_seqs + 1], got dtype "
                            f"{t.dtype.name}")
        if len(t.shape) != 1 or t.shape[0] < 2:
            raise ValueError(f"{name} must have shape [num_seqs + 1] with num_seqs >= 1, got "
                             f"shape {tuple(t.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have one shape [num_seqs + 1], "
                         f"got {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    return cu_seqlens_q.shape[0] - 1


@keyword_hints(VARLEN_KEYWORD_HINTS)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_attn_probs=False, return_lse=False, num_chunks_q=None,
                           num_chunks_kv=None, seed=None, score_mod=None, score_mod_inputs=(),
                           deterministic=False, memory_budget=None):
    """flash-attn's ``flash_attn_varlen_func`` on PopXL tensors: packed sequences, O(L) memory.

    Args:
        q: ``[total_q, Hq, D]`` float16 or float32, the sequences' queries packed row-wise.
        k, v: ``[total_k, Hkv, D]``, q's dtype; ``Hkv`` divides ``Hq`` (grouped-query
            attention: q head ``h`` reads k/v head ``h // (Hq / Hkv)``).
        cu_seqlens_q, cu_seqlens_k: int32 tensors ``[num_seqs + 1]`` given at run time,
            non-decreasing offsets: sequence ``s`` is q rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
            and k/v rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``. ``num_seqs`` is a static
            bound: repeat the last offset for absent sequences. Rows after the last offset are
            padding (offsets beyond ``total`` too). Offsets that decrease anywhere describe no
            packing: the device checks it and then treats every row as padding (out 0, lse
            ``-inf``, gradients 0), never attending across sequences.
        max_seqlen_q, max_seqlen_k: ints >= 1, upper bounds on the sequence lengths (as in
            flash-attn; not checked on the device). The automatic chunks are the least
            modelled forward + backward IPU time within ``memory_budget`` for an assumed
            packing of sequences of ``max_seqlen_q`` / ``max_seqlen_k`` rows back to back
            (:mod:`popxl_flash.plan.packed`; ``pf.explain_packed`` prints the candidates).
        softmax_scale: ``None`` for ``1/sqrt(D)``, or a finite real number.
        causal: causal mask aligned bottom-right per sequence. Default ``False``.
        window_size: ``(left, right)`` around each sequence's bottom-right diagonal, ``-1``
            for an unbounded side; intersected with ``causal``.
        return_lse: also return the logsumexp.
        num_chunks_q, num_chunks_kv: chunk counts over ``total_q``/``total_k`` (``None``:
            the automatic choice above; a given count is kept as it is).
        dropout_p, seed, softcap, return_attn_probs, score_mod, score_mod_inputs: as
            :func:`popxl_flash.flash_attn_func` (the keep mask is ``[Hq, total_q, total_k]``);
            score_mod's ``q_idx``/``kv_idx`` are the per-sequence bottom-right positions
            (``i - seqlen_q``, ``j - seqlen_k``), ``g`` the head.
        alibi_slopes: ``None`` or float32 ``[Hq]`` (or ``[1, Hq]``): per sequence
            ``-slope * |i + seqlen_k - seqlen_q - j|``, as flash-attn's varlen ALiBi.
        deterministic: accepted for flash-attn compatibility (a bool); always deterministic.
        memory_budget: bytes the call may hold beyond its inputs and outputs, as
            :func:`popxl_flash.flash_attention`: the automatic chunks keep to it, and an
            explicit budget no chunking of the packed pass meets raises ``ValueError``.

    Returns:
        out ``[total_q, Hq, D]`` in q's dtype (0 on padding rows and rows that see no key);
        with ``return_lse``, ``(out, lse)`` with lse float32 ``[Hq, total_q]`` (``-inf``
        there); with ``return_attn_probs``, ``(out, lse, keep_mask)``.
    """
    check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    check_bool("deterministic", deterministic)  # always deterministic
    dims = _check_packed(q, k, v)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    max_q = _check_int("max_seqlen_q", max_seqlen_q, low=1)
    max_k = _check_int("max_seqlen_k", max_seqlen_k, low=1)
    options, return_lse = core_options(
        dims, (q, k, v),
        num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        return_lse=return_lse, memory_budget=memory_budget)
    return_probs = check_bool("return_attn_probs", return_attn_probs)
    modifiers = modifier_options(dims, (q, k, v), options, softcap=softcap,
                                 alibi_slopes=alibi_slopes,
                                 score_mod=score_mod, score_mod_inputs=score_mod_inputs,
                                 dropout_p=dropout_p, seed=seed, return_attn_probs=return_probs,
                                 varlen=True)
    options["packing"] = packing_of(max_q, max_k)  # what the automatic chunks are priced for
    with popxl.name_scope("flash_attn_varlen_func"):
        q_ids, q_pos = varlen_segments(cu_seqlens_q, dims.q_len)  # [1, total_q]
        kv_ids, kv_pos = varlen_segments(cu_seqlens_k, dims.kv_len)  # [1, total_k]
        groups = [t.transpose((1, 0, 2)) for t in (q, k, v)]  # [H, total, D]
        mods, extras = modifier_inputs(**group_slopes(modifiers, dims),
                                       dropout_name="dropout_p")
        segments = (q_ids, kv_ids, q_pos, kv_pos)
        out_g, lse = segmented_attention(*groups, *segments, mods=mods, extras=extras,
                                         **options)
        out = out_g.transpose((1, 0, 2))  # [total_q, Hq, D]
        named = dict(user_inputs(modifiers), cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k)
        for t, source in ((out, out_g), (lse, lse)):
            provenance.record_alias(t, source, api="flash_attn_varlen_func", inputs=named)
        if return_probs:
            mask = dropout_mask(*groups, segments, mods, extras, seed=seed, **options)
            return out, lse, mask
    return (out, lse) if return_lse else out
