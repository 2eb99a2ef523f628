"""popxl-addons layers: flash attention as an ``addons.Module``, and a self-attention layer.

Importable when ``popxl_addons`` is (popxl-addons 3.4; on the emulator call
``popxl_flash.emulator.install()`` before importing popxl-addons). Two modules:

* :class:`FlashAttention`: ``build(q, k, v, *extras) -> out`` on the core API's ``[G, L, D]``
  tensors, with the core options and modifiers (softcap, ALiBi slopes, score_mod, dropout with
  a seed input); its ``build_grad`` is flash's stash-mode backward
  (:func:`popxl_flash.flash_attention_grad`);
* :class:`SelfAttention`: ``build(x, *extras) -> y`` on ``[B, L, hidden_size]``:
  ``addons.layers.Linear`` projections named ``q``, ``k``, ``v`` (GQA when
  ``kv_heads < heads``) and ``o`` (biases optional) around flash attention, with rotary
  embeddings and the modifiers; its variables are ``q.weight``, ``q.bias``, ..., ``o.bias``.
  With ``cache_len`` it is the inference layer: ``build(x, k_cache, v_cache, cache_seqlens)``
  over a KV cache in any of :func:`popxl_flash.flash_attn_with_kvcache`'s layouts.

Both register what autodiff needs in their ``called_graphs_grad_info`` when they build: the
stash-mode backward of the flash forward graph and an entry for each graph below it (see
:mod:`popxl_flash.api.autodiff`). ``call_module`` hands that map to the parent module, and
``GraphWithNamedArgs.autodiff``, ``addons.autodiff`` and ``autodiff_with_accumulation`` use it,
so a plain parent autodiff needs no entries passed. A module called inline (``module(x)`` in a
parent's ``build``) adds its map to the parent only when it is an attribute of the parent (and
only at the parent's first ``create_graph``); for inline use, pass
``called_graphs_grad_info=pf.called_graphs_grad_info(parent_graph)``, which always covers it.

**The ``aux`` trap.** popxl-addons' ``create_grad_graph`` labels a gradient-graph input
``Fwd(t)`` (the forward value of ``t``) instead of ``FwdGrad(t)`` (its gradient) whenever ``t``
is also stashed in ``self.aux``. A ``build`` that stashes ``out`` with ``self.aux["out"] = out``
and returns that same tensor therefore gets ``out`` fed where ``build_grad`` expects ``dout``:
the gradients are silently wrong. :class:`FlashAttention` stashes the flash call's ``out`` and
returns a different tensor, ``ops.identity(out)`` (PopART's inplace pattern makes that an alias,
no copy), so the returned output's gradient is ``FwdGrad`` and the stash is ``Fwd``.

The modules are thin adapters: the graph logic between the projections (layouts, transposes,
rotary and cache wiring, modifiers, ALiBi slope shapes, the flash build and build_grad) is in
plain functions, :mod:`popxl_flash.api.layers`, which CI tests without popxl-addons; this
module adds the ``addons.Module`` parts (the ``Linear`` projections and their variables, the
``aux`` stash, the gradient entries).
"""
import popxl_addons as addons
from popxl_addons.layers import Linear

from popxl_flash.api import layers
from popxl_flash.api.autodiff import called_graphs_grad_info
from popxl_flash.backend import popxl
from popxl_flash.plan.config import _check_int


def register_flash_entries(module):
    """Add the gradient entries of the flash graphs in the current graph to ``module``.

    Args:
        module: the ``addons.Module`` whose ``build`` is running (it called
            :func:`popxl_flash.flash_attention`); its ``called_graphs_grad_info`` gets an
            entry for every flash forward graph the current graph calls and every graph below
            those.
    """
    for graph, info in called_graphs_grad_info(popxl.gcg(), grads_provided=[]).items():
        module.called_graphs_grad_info.add(graph, info)


class FlashAttention(addons.Module):
    """Flash attention with a hand-written backward: ``build(q, k, v, *extras) -> out``.

    Args (constructor, keyword-only): num_chunks_q, num_chunks_kv, causal, scale, window,
    softcap, dropout, score_mod: as :func:`popxl_flash.flash_attention` (``causal`` defaults to
    True). alibi: ``True`` to take ALiBi slopes (float32 ``[G]``) as a build input.
    score_mod_inputs: how many tensors ``score_mod`` reads (build inputs). grad_inlining_error:
    popxl-addons' guard against calling a module with ``build_grad`` inline; ``"none"`` by
    default because inlining is correct here (autodiff then uses the entries this module
    registers, the same stash-mode backward).

    The extra build inputs come after ``v``, in this order: the slopes (with ``alibi``), the
    uint32 ``[2]`` seed (with ``dropout > 0``; give every layer its own, e.g. from
    ``ops.split_random_seed``), then the ``score_mod_inputs``. Their gradients are zeros (the
    slopes, the seed and score_mod inputs are not trained).
    """

    def __init__(self, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                 window=None, softcap=0.0, alibi=False, dropout=0.0, score_mod=None,
                 score_mod_inputs=0, grad_inlining_error="none"):
        super().__init__(grad_inlining_error=grad_inlining_error)
        self.options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window)
        self.n_mod_inputs = _check_int("score_mod_inputs", score_mod_inputs, low=0)
        self.mods = layers.check_modifiers(softcap, alibi, dropout, score_mod,
                                           self.n_mod_inputs)

    def build(self, q, k, v, *extras):
        """Args: q ``[G, Lq, D]``; k, v ``[Gk, Lkv, D]`` (``G % Gk == 0``), q's dtype;
        extras: the slopes, seed and score_mod inputs the constructor's options ask for.

        Returns:
            out ``[G, Lq, D]``: an identity of the flash call's output, which is stashed (see the
            module docstring: returning the stashed tensor itself would make its gradient
            input ``Fwd``); :func:`popxl_flash.api.layers.flash_forward`.
        """
        out, stash = layers.flash_forward(q, k, v, extras, self.options, self.mods,
                                          self.n_mod_inputs)
        register_flash_entries(self)
        for name, t in stash.items():
            self.aux[name] = t  # forward tensors the gradient graph reads (Fwd)
        return out

    def build_grad(self, dout):
        """Args: dout ``[G, Lq, D]``, the gradient of ``out``.

        Returns:
            ``(dq, dk, dv, *zeros)``: :func:`popxl_flash.api.layers.flash_backward`
            (stash-mode :func:`popxl_flash.flash_attention_grad`, a zero gradient per extra
            input).
        """
        return layers.flash_backward(dout, self.aux, self.options, self.mods, self.n_mod_inputs)


class SelfAttention(addons.Module):
    """Multi-head self-attention on ``[B, L, hidden_size]`` with flash attention: GPT-style
    (biases, no rotary) or Llama-style (``bias=False``, rotary, grouped-query), for training
    and, with ``cache_len``, for inference with a KV cache.

    ``y = o(attention(rope(q(x)), rope(k(x)), v(x)))``: ``addons.layers.Linear`` projections
    named ``q`` (``hidden_size -> heads * D``), ``k`` and ``v`` (``-> kv_heads * D``) and ``o``
    (``heads * D -> hidden_size``), ``D = hidden_size / heads``. Heads flatten batch-major into
    the core's groups (``g = b * heads + h``), so q head ``h`` reads k/v head
    ``h // (heads / kv_heads)`` (grouped-query attention; ``kv_heads = 1``: multi-query), the
    order of Hugging Face's ``repeat_kv`` and Graphcore's Llama. The logic between the
    projections is :mod:`popxl_flash.api.layers`'.

    Args:
        hidden_size: E, divisible by ``heads``.
        heads: query heads.
        kv_heads: key/value heads, a divisor of ``heads`` (default ``heads``).
        causal: causal mask (default True).
        bias: biases in the four projections (default True; Llama: False).
        rotary_dim: ``None``/0 for no rotary embeddings, else the rotated dims ``R <= D``
            (even) of q and k, at positions ``0 .. L-1`` in training and at the cache positions
            with a cache (:func:`popxl_flash.apply_rotary`).
        rotary_base: the frequency base (10000; a finite number > 0). rotary_interleaved:
            ``False`` (Llama, GPT-NeoX: half-split pairs, the default) or ``True`` (GPT-J:
            adjacent pairs).
        softcap, dropout, score_mod: as :func:`popxl_flash.flash_attention`.
        alibi: ``True`` to take ALiBi slopes (float32 ``[heads]``, or ``[B, heads]`` per batch
            row) as a build input.
        cache_len: ``None`` (training: ``build(x, *extras)``) or the KV cache's rows
            (inference: ``build(x, k_cache, v_cache, cache_seqlens, *extras)``, the caches by
            reference, ``cache_len`` rows long, and written in place, see
            :meth:`build_cached`).
        k_cache_layout, v_cache_layout: the caches' layouts with ``cache_len``
            (:func:`popxl_flash.flash_attn_with_kvcache`; Graphcore's Llama: ``"BHDS"`` and
            ``"BHSD"``).
        **options: ``num_chunks_q``, ``num_chunks_kv``, ``scale``, ``window`` of
            :func:`popxl_flash.flash_attention` (with a cache: ``scale`` and ``window``, and
            ``num_splits``), checked here.

    Extra build inputs after the layer's tensors, in this order: the slopes (with ``alibi``),
    the uint32 ``[2]`` seed (with ``dropout > 0``, training only: give each layer its own).
    """

    def __init__(self, hidden_size, heads, kv_heads=None, causal=True, *, bias=True,
                 rotary_dim=None, rotary_base=10000.0, rotary_interleaved=False, softcap=0.0,
                 alibi=False, dropout=0.0, score_mod=None, cache_len=None,
                 k_cache_layout="BSHD", v_cache_layout="BSHD", **options):
        super().__init__()
        cfg = layers.layer_config(
            hidden_size, heads, kv_heads, causal, bias=bias, rotary_dim=rotary_dim,
            rotary_base=rotary_base, rotary_interleaved=rotary_interleaved, softcap=softcap,
            alibi=alibi, dropout=dropout, score_mod=score_mod, cache_len=cache_len,
            k_cache_layout=k_cache_layout, v_cache_layout=v_cache_layout, **options)
        self.cfg = cfg
        self.hidden_size, self.heads, self.kv_heads = cfg.hidden_size, cfg.heads, cfg.kv_heads
        self.head_dim, self.bias, self.rotary_dim = cfg.head_dim, cfg.bias, cfg.rotary_dim
        self.rotary_base, self.rotary_interleaved = cfg.rotary_base, cfg.rotary_interleaved
        self.mods, self.cache_len, self.options = cfg.mods, cfg.cache_len, cfg.options
        if cfg.cache_len is not None:
            self.layouts = cfg.layouts
            self.build = self.build_cached  # its signature takes the caches by reference
        self.q = Linear(cfg.heads * cfg.head_dim, bias=cfg.bias)
        self.k = Linear(cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.v = Linear(cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o = Linear(cfg.hidden_size, bias=cfg.bias)

    def _project(self, x):
        """q ``[B, L, heads, D]``, k, v ``[B, L, kv_heads, D]`` (flash-attn's layout)."""
        B, L = layers.check_x(self.cfg, x)
        flat = x.reshape((B * L, self.hidden_size))
        return tuple(layers.split_heads(proj(flat), B, L, h, self.head_dim)
                     for proj, h in ((self.q, self.heads), (self.k, self.kv_heads),
                                     (self.v, self.kv_heads)))

    def _output(self, flat, x):
        """The attention's ``[B * L, heads * D]`` -> y ``[B, L, hidden_size]``."""
        return self.o(flat).reshape(tuple(x.shape))

    # -- training -------------------------------------------------------------------------
    def build(self, x, *extras):
        """Args: x ``[B, L, hidden_size]``; extras: the slopes and seed the options ask for.
        Returns: y ``[B, L, hidden_size]``, x's dtype."""
        q, k, v = self._project(x)
        return self._output(layers.self_attention(self.cfg, q, k, v, extras, self._attend), x)

    def _attend(self, q, k, v, mods):
        self._call_mods = mods
        return self.attend(q, k, v)

    def attend(self, q, k, v):
        """The attention between the projections (override it to compare another attention
        on the same layer and weight names).

        Args:
            q: ``[B * heads, L, D]``; k, v: ``[B * kv_heads, L, D]`` (rotated when rotary is on).

        Returns:
            ``[B * heads, L, D]``: :func:`popxl_flash.flash_attention` with this layer's
            options and modifiers (``self._call_mods``), its gradient entries registered in
            ``called_graphs_grad_info``.
        """
        out = layers.default_attend(self.cfg, q, k, v, dict(getattr(self, "_call_mods", {})))
        register_flash_entries(self)
        return out

    # -- inference with a KV cache ----------------------------------------------------------
    def build_cached(self, x, k_cache: popxl.TensorByRef, v_cache: popxl.TensorByRef,
                     cache_seqlens, *extras):
        """The KV-cache mode's build (``cache_len`` given): prefill (``L > 1``) or decode.

        Args:
            x: ``[B, L, hidden_size]``, the new tokens.
            k_cache, v_cache: the caches in this layer's layouts (``[B, cache_len, kv_heads, D]``
                for ``"BSHD"``), by reference: the new keys and values are written in place at
                rows ``cache_seqlens[b] ..``.
            cache_seqlens: int32 ``[B]``, the rows already in each cache (Graphcore's Llama
                ``last_token_indices`` for one decoded token).
            extras: the slopes (with ``alibi``).

        Returns:
            y ``[B, L, hidden_size]``.
        """
        q, k, v = self._project(x)
        return self._output(layers.cached_self_attention(
            self.cfg, q, k, v, k_cache, v_cache, cache_seqlens, extras), x)
