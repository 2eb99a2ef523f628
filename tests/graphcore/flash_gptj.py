"""Flash attention swapped into Graphcore's GPT-J (graphcore/examples ``nlp/gpt_j/popxl``), as a
user applies it: ``GPTJAttentionHeads.build`` (``modelling/attention.py``) replaced by a
function that keeps their fused ``qkv`` projection and computes GPT-J's interleaved rotary
embeddings on the first ``rotary_dim`` features and causal attention (with their dropout
probability and seed, when training with dropout) with ``popxl_flash`` (see
``docs/porting-graphcore.md``). The backward is flash's, through PopXL's autodiff of the
decoder block as Graphcore's fine-tuning builds it (``register_flash_entries`` puts its
entries into the module's ``called_graphs_grad_info``, which popxl-addons' autodiff reads).

    import flash_gptj
    flash_gptj.swap()           # before the session is built (finetuning(config))
"""
import popxl

import popxl_flash as pf
from popxl_flash.addons import register_flash_entries


def flash_build(self, x, seed=None):
    """``GPTJAttentionHeads.build`` with flash attention.

    Args:
        self: the ``GPTJAttentionHeads`` module (``qkv`` Linear layer, ``n_heads`` per replica,
            ``rotary_dim``, ``config``).
        x: ``[B * S, hidden]``.
        seed: the attention block's dropout seed (uint32 ``[2]``) or None.
    Returns:
        ``[B * S, n_heads * D]``, as Graphcore's layer returns it.
    """
    cfg = self.config
    s = cfg.model.sequence_length
    q, k, v = popxl.ops.split(self.qkv(x), 3, axis=-1)
    b, d = q.shape[0] // s, q.shape[1] // self.n_heads
    q, k, v = (t.reshape((b, s, self.n_heads, d)) for t in (q, k, v))
    cos, sin = (popxl.constant(t) for t in pf.rotary_tables(
        s, self.rotary_dim, cfg.model.attention.rotary_positional_embeddings_base,
        dtype=cfg.model.dtype.as_numpy()))
    q = pf.apply_rotary(q, cos, sin, interleaved=True)
    k = pf.apply_rotary(k, cos, sin, interleaved=True)
    p = 0.0 if cfg.model.eval else cfg.model.dropout_prob
    out = pf.flash_attn_func(q, k, v, causal=True, dropout_p=p,
                             seed=seed if p > 0.0 else None)
    register_flash_entries(self)  # flash's backward for the decoder block's autodiff
    return out.reshape((b * s, self.n_heads * d))


def swap():
    """Replace Graphcore's GPT-J attention core with :func:`flash_build` (their
    ``modelling.attention`` must be importable: run from ``nlp/gpt_j/popxl``)."""
    from modelling.attention import GPTJAttentionHeads
    GPTJAttentionHeads.build = flash_build
