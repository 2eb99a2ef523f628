"""Flash attention swapped into Graphcore's Llama (graphcore/examples ``nlp/llama/popxl``), as a
user applies it: ``LlamaAttentionHeads.build`` (``modelling/attention.py``) replaced by a
function that keeps their projections and their KV-cache buffers and layouts, and computes
rotary embeddings and attention with ``popxl_flash`` (see ``docs/porting-graphcore.md``).

    import flash_llama
    flash_llama.swap()          # before the session is built (inference(config))

No mask tensor, no kv expansion, no custom rotary op: ``pf.apply_rotary`` and
``pf.flash_attn_func(causal=True)`` without a cache; with ``use_cache`` one
``pf.flash_attn_with_kvcache`` call that rotates q and the new key at row
``last_token_indices``, writes the key and value into the caches in Graphcore's layouts
(k ``[B, Hkv, D, S]``, v ``[B, Hkv, S, D]``) and attends to rows ``<= last_token_indices``.
"""
import popxl

import popxl_flash as pf


def flash_build(self, x, last_token_indices=None, past_k=None, past_v=None):
    """``LlamaAttentionHeads.build`` with flash attention.

    Args:
        self: the ``LlamaAttentionHeads`` module (its ``q``/``kv`` Linear layers, head counts,
            ``config``).
        x: ``[B * S, hidden]`` (``S`` = 1 with ``use_cache``).
        last_token_indices: int32 ``[B]``, the cache row of the new token (``use_cache``).
        past_k, past_v: the layer's caches ``[B, Hkv, D, Smax]`` and ``[B, Hkv, Smax, D]``.
    Returns:
        ``(out [B * S, heads * D],)``, or with ``use_cache`` ``(out, past_k, past_v)`` with the
        new token's key and value written (what Graphcore's layer returns for the caller's
        ``remote_store``).
    """
    cfg = self.config
    b, s, d = self.num_seqs, self.initial_seq_len, self.dim_head
    key, value = popxl.ops.split(self.kv(x), 2, axis=-1)
    q = self.q(x).reshape((b, s, self.n_heads, d))
    k = key.reshape((b, s, self.kv_heads, d))
    v = value.reshape((b, s, self.kv_heads, d))
    cos, sin = (popxl.constant(t) for t in pf.rotary_tables(
        cfg.model.sequence_length, self.rotary_ndims, self.rotary_pos_emb_base,
        dtype=cfg.model.dtype.as_numpy()))
    if not cfg.execution.use_cache:
        q = pf.apply_rotary(q, cos, sin, interleaved=False)
        k = pf.apply_rotary(k, cos, sin, interleaved=False)
        out = pf.flash_attn_func(q, k, v, causal=True)
        return (out.reshape((b * s, self.n_heads * d)),)
    out = pf.flash_attn_with_kvcache(
        q, past_k, past_v, k, v, cache_seqlens=last_token_indices, causal=True,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False,
        k_cache_layout="BHDS", v_cache_layout="BHSD")
    return out.reshape((b * s, self.n_heads * d)), past_k, past_v


def swap():
    """Replace Graphcore's Llama attention core with :func:`flash_build` (their
    ``modelling.attention`` must be importable: run from ``nlp/llama/popxl``)."""
    from modelling.attention import LlamaAttentionHeads
    LlamaAttentionHeads.build = flash_build
