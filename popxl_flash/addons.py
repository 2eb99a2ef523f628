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
"""
import popxl_addons as addons
from popxl_addons.layers import Linear

from popxl_flash.api import kvcache
from popxl_flash.api.autodiff import called_graphs_grad_info
from popxl_flash.api.functional import flash_attention, flash_attention_grad
from popxl_flash.api.kvcache import flash_attn_with_kvcache
from popxl_flash.api.rotary import apply_rotary, rotary_tables
from popxl_flash.backend import popxl
from popxl_flash.plan.config import _check_int, check_bool

ops = popxl.ops


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


def _check_modifiers(softcap, alibi, dropout, score_mod):
    """The layers' modifier options (values fixed at construction; the slopes, the seed and
    score_mod inputs are build inputs)."""
    if not isinstance(alibi, bool):
        raise TypeError(f"alibi must be a bool (the slopes are a build input), got "
                        f"alibi={alibi!r}")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be None or a callable, got score_mod={score_mod!r}")
    return dict(softcap=softcap, alibi=alibi, dropout=dropout, score_mod=score_mod)


def _split_extras(extras, mods, n_mod_inputs, where):
    """``(alibi_slopes, seed, score_mod_inputs)`` out of a build's extra inputs, in that order
    (each present only when its modifier is on)."""
    want = int(mods["alibi"]) + int(mods["dropout"] > 0) + n_mod_inputs
    if len(extras) != want:
        names = (["alibi_slopes"] if mods["alibi"] else []) + \
            (["seed"] if mods["dropout"] > 0 else []) + \
            [f"score_mod_inputs[{i}]" for i in range(n_mod_inputs)]
        raise ValueError(f"{where} takes {want} extra input(s) after its tensors with these "
                         f"options: {names or 'none'}; got {len(extras)}")
    extras = list(extras)
    slopes = extras.pop(0) if mods["alibi"] else None
    seed = extras.pop(0) if mods["dropout"] > 0 else None
    return slopes, seed, tuple(extras)


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
        self.mods = _check_modifiers(softcap, alibi, dropout, score_mod)
        self.n_mod_inputs = _check_int("score_mod_inputs", score_mod_inputs, low=0)

    def _modifiers(self, extras):
        slopes, seed, inputs = _split_extras(extras, self.mods, self.n_mod_inputs,
                                             "FlashAttention.build")
        m = self.mods
        return dict(softcap=m["softcap"], alibi_slopes=slopes, dropout=m["dropout"], seed=seed,
                    score_mod=m["score_mod"], score_mod_inputs=inputs)

    def build(self, q, k, v, *extras):
        """Args: q ``[G, Lq, D]``; k, v ``[Gk, Lkv, D]`` (``G % Gk == 0``), q's dtype;
        extras: the slopes, seed and score_mod inputs the constructor's options ask for.

        Returns:
            out ``[G, Lq, D]``: an identity of the flash call's output, which is stashed (see the
            module docstring: returning the stashed tensor itself would make its gradient
            input ``Fwd``).
        """
        modifiers = self._modifiers(extras)
        out, lse = flash_attention(q, k, v, return_lse=True, **self.options, **modifiers)
        register_flash_entries(self)
        for name, t in dict(q=q, k=k, v=v, out=out, lse=lse).items():
            self.aux[name] = t  # forward outputs the gradient graph reads (Fwd)
        for i, t in enumerate(extras):
            self.aux[f"extra{i}"] = t
        return ops.identity(out)

    def build_grad(self, dout):
        """Args: dout ``[G, Lq, D]``, the gradient of ``out``.

        Returns:
            ``(dq, dk, dv, *zeros)``: stash-mode :func:`popxl_flash.flash_attention_grad`, and
            a zero gradient per extra input.
        """
        a = self.aux
        count = int(self.mods["alibi"]) + int(self.mods["dropout"] > 0) + self.n_mod_inputs
        extras = [a[f"extra{i}"] for i in range(count)]
        grads = flash_attention_grad(dout, a["q"], a["k"], a["v"], a["out"], a["lse"],
                                     **self.options, **self._modifiers(extras))
        zeros = [ops.init(t.shape, t.dtype, init_type="zero") for t in extras]
        return (*grads, *zeros)


class SelfAttention(addons.Module):
    """Multi-head self-attention on ``[B, L, hidden_size]`` with flash attention: GPT-style
    (biases, no rotary) or Llama-style (``bias=False``, rotary, grouped-query), for training
    and, with ``cache_len``, for inference with a KV cache.

    ``y = o(attention(rope(q(x)), rope(k(x)), v(x)))``: ``addons.layers.Linear`` projections
    named ``q`` (``hidden_size -> heads * D``), ``k`` and ``v`` (``-> kv_heads * D``) and ``o``
    (``heads * D -> hidden_size``), ``D = hidden_size / heads``. Heads flatten batch-major into
    the core's groups (``g = b * heads + h``), so q head ``h`` reads k/v head
    ``h // (heads / kv_heads)`` (grouped-query attention; ``kv_heads = 1``: multi-query), the
    order of Hugging Face's ``repeat_kv`` and Graphcore's Llama.

    Args:
        hidden_size: E, divisible by ``heads``.
        heads: query heads.
        kv_heads: key/value heads, a divisor of ``heads`` (default ``heads``).
        causal: causal mask (default True).
        bias: biases in the four projections (default True; Llama: False).
        rotary_dim: ``None``/0 for no rotary embeddings, else the rotated dims ``R <= D``
            (even) of q and k, at positions ``0 .. L-1`` in training and at the cache positions
            with a cache (:func:`popxl_flash.apply_rotary`).
        rotary_base: the frequency base (10000). rotary_interleaved: ``False`` (Llama,
            GPT-NeoX: half-split pairs, the default) or ``True`` (GPT-J: adjacent pairs).
        softcap, dropout, score_mod: as :func:`popxl_flash.flash_attention`.
        alibi: ``True`` to take ALiBi slopes (float32 ``[heads]``) as a build input.
        cache_len: ``None`` (training: ``build(x, *extras)``) or the KV cache's rows
            (inference: ``build(x, k_cache, v_cache, cache_seqlens, *extras)``, the caches by
            reference and written in place, see :meth:`build_cached`).
        k_cache_layout, v_cache_layout: the caches' layouts with ``cache_len``
            (:func:`popxl_flash.flash_attn_with_kvcache`; Graphcore's Llama: ``"BHDS"`` and
            ``"BHSD"``).
        **options: ``num_chunks_q``, ``num_chunks_kv``, ``scale``, ``window`` of
            :func:`popxl_flash.flash_attention` (with a cache: ``scale`` and ``window``, and
            ``num_splits``).

    Extra build inputs after the layer's tensors, in this order: the slopes (with ``alibi``),
    the uint32 ``[2]`` seed (with ``dropout > 0``, training only: give each layer its own).
    """

    def __init__(self, hidden_size, heads, kv_heads=None, causal=True, *, bias=True,
                 rotary_dim=None, rotary_base=10000.0, rotary_interleaved=False, softcap=0.0,
                 alibi=False, dropout=0.0, score_mod=None, cache_len=None,
                 k_cache_layout="BSHD", v_cache_layout="BSHD", **options):
        super().__init__()
        self.hidden_size = _check_int("hidden_size", hidden_size, low=1)
        self.heads = _check_int("heads", heads, low=1)
        self.kv_heads = _check_int("kv_heads", heads if kv_heads is None else kv_heads, low=1)
        if hidden_size % heads:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of heads={heads}")
        if heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={heads}")
        allowed = {"num_chunks_q", "num_chunks_kv", "scale", "window"} if cache_len is None \
            else {"scale", "window", "num_splits"}
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"SelfAttention got unexpected options {sorted(unknown)}; expected "
                            f"{', '.join(sorted(allowed))}"
                            f"{' (with cache_len)' if cache_len is not None else ''}")
        self.head_dim = hidden_size // heads
        self.bias = check_bool("bias", bias)
        self.rotary_dim = None if not rotary_dim else _check_int(
            "rotary_dim", rotary_dim, low=2, high=self.head_dim)
        if self.rotary_dim is not None and self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got rotary_dim={rotary_dim}")
        self.rotary_base = rotary_base
        self.rotary_interleaved = check_bool("rotary_interleaved", rotary_interleaved)
        self.mods = _check_modifiers(softcap, alibi, dropout, score_mod)
        self.cache_len = None if cache_len is None else _check_int("cache_len", cache_len,
                                                                    low=1)
        if self.cache_len is not None:
            if dropout:
                raise ValueError(f"dropout={dropout} with cache_len: the KV-cache mode is "
                                 "inference only (no dropout)")
            if score_mod is not None:
                raise ValueError("score_mod with cache_len: flash_attn_with_kvcache takes no "
                                 "score_mod")
            self.layouts = dict(
                k_cache_layout=kvcache.check_layout("k_cache_layout", k_cache_layout,
                                                    kvcache.K_CACHE_LAYOUTS),
                v_cache_layout=kvcache.check_layout("v_cache_layout", v_cache_layout,
                                                    kvcache.V_CACHE_LAYOUTS))
            self.build = self.build_cached  # its signature takes the caches by reference
        self.options = dict(options, causal=causal)
        self.q = Linear(heads * self.head_dim, bias=self.bias)
        self.k = Linear(self.kv_heads * self.head_dim, bias=self.bias)
        self.v = Linear(self.kv_heads * self.head_dim, bias=self.bias)
        self.o = Linear(hidden_size, bias=self.bias)

    # -- shared pieces --------------------------------------------------------------------
    def _check_x(self, x):
        if len(x.shape) != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape [B, L, hidden_size={self.hidden_size}], got "
                             f"{tuple(x.shape)}")
        return x.shape[0], x.shape[1]

    def _project(self, x):
        """q ``[B, L, heads, D]``, k, v ``[B, L, kv_heads, D]`` (flash-attn's layout)."""
        B, L, E = x.shape
        flat = x.reshape((B * L, E))
        q, k, v = (proj(flat).reshape((B, L, h, self.head_dim))
                   for proj, h in ((self.q, self.heads), (self.k, self.kv_heads),
                                   (self.v, self.kv_heads)))
        return q, k, v

    def _tables(self, rows, dtype):
        """Rotary cos/sin constants ``[rows, R/2]`` (float32)."""
        cos, sin = rotary_tables(rows, self.rotary_dim, self.rotary_base)
        return popxl.constant(cos, popxl.float32), popxl.constant(sin, popxl.float32)

    def _output(self, out):
        """``out [B, L, heads, D] -> y [B, L, hidden_size]``."""
        B, L = out.shape[0], out.shape[1]
        y = self.o(out.reshape((B * L, self.heads * self.head_dim)))
        return y.reshape((B, L, self.hidden_size))

    # -- training -------------------------------------------------------------------------
    def build(self, x, *extras):
        """Args: x ``[B, L, hidden_size]``; extras: the slopes and seed the options ask for.
        Returns: y ``[B, L, hidden_size]``, x's dtype."""
        B, L = self._check_x(x)
        slopes, seed, _ = _split_extras(extras, self.mods, 0, "SelfAttention.build")
        q, k, v = self._project(x)
        if self.rotary_dim is not None:
            cos, sin = self._tables(L, x.dtype)
            q, k = (apply_rotary(t, cos, sin, interleaved=self.rotary_interleaved)
                    for t in (q, k))
        groups = [t.transpose((0, 2, 1, 3)).reshape((B * h, L, self.head_dim))
                  for t, h in ((q, self.heads), (k, self.kv_heads), (v, self.kv_heads))]
        if slopes is not None and B > 1:  # [heads] -> the core's [B * heads]
            slopes = ops.concat([slopes.reshape((1, self.heads))] * B, axis=0).reshape(
                (B * self.heads,))
        m = self.mods
        self._call_mods = dict(softcap=m["softcap"], alibi_slopes=slopes, dropout=m["dropout"],
                               seed=seed, score_mod=m["score_mod"])
        out = self.attend(*groups)  # [B*H, L, D]
        out = out.reshape((B, self.heads, L, self.head_dim)).transpose((0, 2, 1, 3))
        return self._output(out)

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
        mods = dict(getattr(self, "_call_mods", {}))
        mods = {n: val for n, val in mods.items()
                if val is not None and not (isinstance(val, float) and val == 0.0)}
        out = flash_attention(q, k, v, **self.options, **mods)
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
        B, L = self._check_x(x)
        slopes, _, _ = _split_extras(extras, self.mods, 0, "SelfAttention.build_cached")
        q, k, v = self._project(x)
        rotary = {}
        if self.rotary_dim is not None:
            cos, sin = self._tables(self.cache_len, x.dtype)
            rotary = dict(rotary_cos=cos, rotary_sin=sin,
                          rotary_interleaved=self.rotary_interleaved)
        opts = self.options
        window = opts.get("window")
        window = (-1, -1) if window is None else tuple(-1 if w is None else w for w in window)
        out = flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=opts["causal"],
            softmax_scale=opts.get("scale"), window_size=window, softcap=self.mods["softcap"],
            alibi_slopes=slopes, num_splits=opts.get("num_splits"), **rotary, **self.layouts)
        return self._output(out)
