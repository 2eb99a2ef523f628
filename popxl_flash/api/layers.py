"""The attention layers' graph logic as plain functions, without popxl-addons.

:mod:`popxl_flash.addons` wraps these in ``addons.Module`` adapters (the projections are
``addons.layers.Linear``, the variables and ``called_graphs_grad_info`` are the module's); what
happens between the projections is here, so CI tests it without popxl-addons
(``tests/test_layer_functions.py``, against float64 references):

* :func:`layer_config`: the constructor's checks, in the layer's terms (``heads``, ``B``, not
  the core's ``G``), giving a :class:`LayerConfig`;
* the layouts: :func:`split_heads` (a projection ``[B * L, h * D]`` to ``[B, L, h, D]``),
  :func:`to_groups` (``[B, L, h, D]`` to the core's ``[B * h, L, D]``, heads batch-major),
  :func:`from_groups` and :func:`merge_heads` back;
* :func:`training_groups` (rotary at positions ``0 .. L-1``, the groups, the modifiers with the
  slopes laid out per group), :func:`default_attend` (the flash call) and
  :func:`training_output`; :func:`self_attention` composes them;
* :func:`cached_self_attention`: the KV-cache mode (the caches' rows checked against
  ``cache_len``, rotary tables of ``cache_len`` rows, the layouts and options handed to
  :func:`popxl_flash.flash_attn_with_kvcache`);
* :func:`flash_forward` and :func:`flash_backward`: the flash module's build and build_grad
  (the stash, and an output that is not a stashed tensor: see :mod:`popxl_flash.addons`, "the
  aux trap").
"""
from dataclasses import dataclass, field
from typing import Optional

from popxl_flash.api import kvcache, rotary
from popxl_flash.api.functional import check_tensors, flash_attention, flash_attention_grad
from popxl_flash.backend import popxl
from popxl_flash.plan import score_mods
from popxl_flash.plan.config import _check_int, check_bool, check_scale, check_window

ops = popxl.ops

__all__ = ["LayerConfig", "layer_config", "check_modifiers", "split_extras", "check_x",
           "split_heads", "to_groups", "from_groups", "merge_heads", "layer_slopes",
           "rotary_constants", "training_groups", "default_attend", "training_output",
           "self_attention", "cached_self_attention", "flash_forward", "flash_backward"]

#: The flash options a training layer takes, and a KV-cache layer's.
TRAINING_OPTIONS = ("num_chunks_q", "num_chunks_kv", "scale", "window")
CACHED_OPTIONS = ("scale", "window", "num_splits")


@dataclass(frozen=True)
class LayerConfig:
    """A self-attention layer's static settings, validated (:func:`layer_config`).

    Attributes:
        hidden_size: E. heads, kv_heads: H and Hkv (Hkv divides H). head_dim: D = E / H.
        bias: biases in the projections. rotary_dim: ``None`` or the rotated dims R (even,
            ``<= D``); rotary_base, rotary_interleaved: its frequency base and pairing.
        mods: ``{"softcap", "alibi", "dropout", "score_mod"}``.
        cache_len: ``None`` (training) or the KV cache's rows.
        layouts: ``{"k_cache_layout", "v_cache_layout"}`` with ``cache_len``, else ``{}``.
        options: the flash options (``causal`` and those given of :data:`TRAINING_OPTIONS` or
            :data:`CACHED_OPTIONS`; ``window`` as ``(left, right)``, ``-1`` unbounded).
    """
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    bias: bool
    rotary_dim: Optional[int]
    rotary_base: float
    rotary_interleaved: bool
    mods: dict = field(default_factory=dict)
    cache_len: Optional[int] = None
    layouts: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)


def check_modifiers(softcap, alibi, dropout, score_mod, num_mod_inputs=0):
    """The layers' modifier options (fixed at construction; the slopes, the seed and the
    score_mod inputs are build inputs), checked as :func:`popxl_flash.flash_attention` checks
    them.

    Returns:
        ``{"softcap", "alibi", "dropout", "score_mod"}`` (floats, a bool, the callable).
    """
    if not isinstance(alibi, bool):
        raise TypeError(f"alibi must be a bool (the slopes are a build input), got "
                        f"alibi={alibi!r}")
    mods = score_mods.options(softcap, alibi, score_mod, num_mod_inputs, dropout)
    mods = mods or score_mods.ScoreMods()
    return dict(softcap=mods.softcap, alibi=alibi, dropout=mods.dropout, score_mod=score_mod)


def split_extras(extras, mods, n_mod_inputs, where):
    """``(alibi_slopes, seed, score_mod_inputs)`` out of a build's extra inputs, in that order
    (each present only when its modifier is on).

    Args:
        extras: the build's inputs after its tensors. mods: :func:`check_modifiers`'s dict.
        n_mod_inputs: how many score_mod inputs. where: the build's name in messages.
    """
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


def _check_options(options, cached, head_dim):
    """The flash options of a layer, checked (values and names) at construction."""
    allowed = CACHED_OPTIONS if cached else TRAINING_OPTIONS
    unknown = set(options) - set(allowed)
    if unknown:
        raise TypeError(f"SelfAttention got unexpected options {sorted(unknown)}; expected "
                        f"{', '.join(sorted(allowed))}{' (with cache_len)' if cached else ''}")
    out = {}
    for name, value in options.items():
        if value is None:
            out[name] = None
        elif name == "window":
            out[name] = check_window(value)
        elif name == "scale":
            check_scale(value, head_dim)
            out[name] = value
        else:
            out[name] = _check_int(name, value, low=0 if name == "num_splits" else 1)
    return out


def layer_config(hidden_size, heads, kv_heads=None, causal=True, *, bias=True, rotary_dim=None,
                 rotary_base=10000.0, rotary_interleaved=False, softcap=0.0, alibi=False,
                 dropout=0.0, score_mod=None, cache_len=None, k_cache_layout="BSHD",
                 v_cache_layout="BSHD", **options):
    """:class:`popxl_flash.addons.SelfAttention`'s constructor arguments, checked (a
    ``ValueError``/``TypeError`` naming the argument, its value and what was expected).

    Returns:
        :class:`LayerConfig`.
    """
    hidden_size = _check_int("hidden_size", hidden_size, low=1)
    heads = _check_int("heads", heads, low=1)
    kv_heads = _check_int("kv_heads", heads if kv_heads is None else kv_heads, low=1)
    if hidden_size % heads:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of heads={heads}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    head_dim = hidden_size // heads
    rotary_dim = None if rotary_dim is None or (not isinstance(rotary_dim, bool) and
                                                rotary_dim == 0) else \
        _check_int("rotary_dim", rotary_dim, low=2, high=head_dim)
    if rotary_dim is not None and rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got rotary_dim={rotary_dim}")
    cached = cache_len is not None
    cfg = dict(hidden_size=hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
               bias=check_bool("bias", bias), rotary_dim=rotary_dim,
               rotary_base=rotary.check_base(rotary_base, "rotary_base"),
               rotary_interleaved=check_bool("rotary_interleaved", rotary_interleaved),
               mods=check_modifiers(softcap, alibi, dropout, score_mod),
               options=dict(_check_options(options, cached, head_dim),
                            causal=check_bool("causal", causal)))
    if cached:
        cfg["cache_len"] = _check_int("cache_len", cache_len, low=1)
        if cfg["mods"]["dropout"]:
            raise ValueError(f"dropout={dropout} with cache_len: the KV-cache mode is "
                             "inference only (no dropout)")
        if score_mod is not None:
            raise ValueError("score_mod with cache_len: flash_attn_with_kvcache takes no "
                             "score_mod")
        cfg["layouts"] = dict(
            k_cache_layout=kvcache.check_layout("k_cache_layout", k_cache_layout,
                                                kvcache.K_CACHE_LAYOUTS),
            v_cache_layout=kvcache.check_layout("v_cache_layout", v_cache_layout,
                                                kvcache.V_CACHE_LAYOUTS))
    return LayerConfig(**cfg)


# -- layouts ---------------------------------------------------------------------------------
def check_x(cfg, x):
    """Returns ``(B, L)`` of ``x [B, L, hidden_size]`` (``ValueError`` otherwise)."""
    check_tensors(x=x)
    if len(x.shape) != 3 or x.shape[-1] != cfg.hidden_size or min(x.shape) < 1:
        raise ValueError(f"x must have shape [B, L, hidden_size={cfg.hidden_size}] with "
                         f"non-empty dims, got {tuple(x.shape)}")
    return x.shape[0], x.shape[1]


def split_heads(t, B, L, heads, head_dim):
    """A projection ``[B * L, heads * D]`` -> ``[B, L, heads, D]`` (flash-attn's layout)."""
    return t.reshape((B, L, heads, head_dim))


def to_groups(t):
    """``[B, L, h, D]`` -> the core's ``[B * h, L, D]`` (group ``b * h + head``)."""
    B, L, h, D = t.shape
    return t.transpose((0, 2, 1, 3)).reshape((B * h, L, D))


def from_groups(out, B, heads):
    """The core's ``[B * heads, L, D]`` -> ``[B, L, heads, D]``."""
    _, L, D = out.shape
    return out.reshape((B, heads, L, D)).transpose((0, 2, 1, 3))


def merge_heads(out):
    """``[B, L, heads, D]`` -> ``[B * L, heads * D]`` (the output projection's input)."""
    B, L, H, D = out.shape
    return out.reshape((B * L, H * D))


def layer_slopes(cfg, slopes, B):
    """ALiBi slopes of a layer, checked in the layer's terms: float32 ``[heads]`` (every batch
    row) or ``[B, heads]``.

    Returns:
        The slopes as the core's float32 ``[B * heads]`` (group ``b * heads + h``).
    """
    check_tensors(alibi_slopes=slopes)
    H = cfg.heads
    shape = tuple(slopes.shape)
    if shape not in ((H,), (B, H)) or slopes.dtype.name != "float32":
        raise ValueError(f"alibi_slopes must be float32 [heads={H}] or [B={B}, heads={H}] "
                         f"(one slope per head, or per batch row and head), got shape {shape} "
                         f"{slopes.dtype.name}")
    if shape == (H,) and B > 1:
        slopes = ops.concat([slopes.reshape((1, H))] * B, axis=0)
    return slopes.reshape((B * H,))


def rotary_constants(cfg, rows):
    """The layer's rotary cos/sin tables ``[rows, R/2]`` as float32 constants."""
    cos, sin = rotary.rotary_tables(rows, cfg.rotary_dim, cfg.rotary_base)
    return popxl.constant(cos, popxl.float32), popxl.constant(sin, popxl.float32)


# -- training --------------------------------------------------------------------------------
def training_groups(cfg, q, k, v, extras):
    """Everything between the projections and the attention of a training layer.

    Args:
        cfg: :class:`LayerConfig` (``cache_len`` None). q ``[B, L, heads, D]``; k, v
            ``[B, L, kv_heads, D]`` (:func:`split_heads` of the projections).
        extras: the build's extra inputs (the slopes with ``alibi``, the seed with dropout).

    Returns:
        ``(q, k, v, mods)``: q ``[B * heads, L, D]``, k, v ``[B * kv_heads, L, D]`` (rotated
        at positions ``0 .. L-1`` with rotary), and the keyword arguments of the modifiers for
        :func:`popxl_flash.flash_attention` (those on; the slopes ``[B * heads]``).
    """
    B, L = q.shape[0], q.shape[1]
    slopes, seed, _ = split_extras(extras, cfg.mods, 0, "SelfAttention.build")
    if cfg.rotary_dim is not None:
        cos, sin = rotary_constants(cfg, L)
        q, k = (rotary.apply_rotary(t, cos, sin, interleaved=cfg.rotary_interleaved)
                for t in (q, k))
    m = cfg.mods
    mods = dict(softcap=m["softcap"], dropout=m["dropout"], score_mod=m["score_mod"],
                seed=seed, alibi_slopes=None if slopes is None else layer_slopes(cfg, slopes, B))
    mods = {n: val for n, val in mods.items()
            if val is not None and not (isinstance(val, float) and val == 0.0)}
    return to_groups(q), to_groups(k), to_groups(v), mods


def default_attend(cfg, q, k, v, mods):
    """:func:`popxl_flash.flash_attention` with the layer's options and ``mods``.

    Returns:
        ``[B * heads, L, D]``.
    """
    return flash_attention(q, k, v, **cfg.options, **mods)


def training_output(out, B):
    """The attention's ``[B * heads, L, D]`` -> ``[B * L, heads * D]``."""
    return merge_heads(from_groups(out, B, out.shape[0] // B))


def self_attention(cfg, q, k, v, extras=(), attend=None):
    """A training layer's attention between its projections.

    Args:
        cfg, q, k, v, extras: as :func:`training_groups`.
        attend: ``attend(q, k, v, mods) -> out`` on the groups (default
            :func:`default_attend` with ``cfg``).

    Returns:
        ``[B * L, heads * D]``, the output projection's input.
    """
    qg, kg, vg, mods = training_groups(cfg, q, k, v, extras)
    attend = attend or (lambda a, b, c, m: default_attend(cfg, a, b, c, m))
    return training_output(attend(qg, kg, vg, mods), q.shape[0])


# -- inference with a KV cache -----------------------------------------------------------------
def _check_cache_rows(cfg, k_cache, v_cache):
    """The caches' rows must be ``cache_len`` (the rotary tables have that many rows)."""
    for name, cache, layout in (("k_cache", k_cache, cfg.layouts["k_cache_layout"]),
                                ("v_cache", v_cache, cfg.layouts["v_cache_layout"])):
        check_tensors(**{name: cache})
        if len(cache.shape) != 4:
            continue  # the call's own check names the rank
        rows = cache.shape[layout.index("S")]
        if rows != cfg.cache_len:
            raise ValueError(f"{name} has {rows} cache rows ({name}_layout={layout!r}, shape "
                             f"{tuple(cache.shape)}), but the layer has cache_len="
                             f"{cfg.cache_len}: make the caches cache_len rows long")


def cached_self_attention(cfg, q, k, v, k_cache, v_cache, cache_seqlens, extras=()):
    """A KV-cache layer's attention between its projections: the new keys and values written
    into the caches in place, then :func:`popxl_flash.flash_attn_with_kvcache`.

    Args:
        cfg: :class:`LayerConfig` with ``cache_len``. q ``[B, L, heads, D]``; k, v
            ``[B, L, kv_heads, D]``, the new tokens' projections.
        k_cache, v_cache: ``cache_len`` rows in the layer's layouts (by reference).
        cache_seqlens: int32 ``[B]`` (or an int), the rows already in each cache.
        extras: the slopes with ``alibi`` (float32 ``[heads]`` or ``[B, heads]``).

    Returns:
        ``[B * L, heads * D]``, the output projection's input.
    """
    B = q.shape[0]
    slopes, _, _ = split_extras(extras, cfg.mods, 0, "SelfAttention.build_cached")
    if slopes is not None:
        layer_slopes(cfg, slopes, B)  # the layer's message; the call takes these shapes
    _check_cache_rows(cfg, k_cache, v_cache)
    tables = {}
    if cfg.rotary_dim is not None:
        cos, sin = rotary_constants(cfg, cfg.cache_len)
        tables = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=cfg.rotary_interleaved)
    opts = cfg.options
    window = opts.get("window")
    out = kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=opts["causal"],
        softmax_scale=opts.get("scale"), window_size=(-1, -1) if window is None else window,
        softcap=cfg.mods["softcap"], alibi_slopes=slopes, num_splits=opts.get("num_splits"),
        **tables, **cfg.layouts)
    return merge_heads(out)


# -- the flash module --------------------------------------------------------------------------
def _flash_modifiers(mods, n_mod_inputs, extras, where):
    slopes, seed, inputs = split_extras(extras, mods, n_mod_inputs, where)
    return dict(softcap=mods["softcap"], alibi_slopes=slopes, dropout=mods["dropout"],
                seed=seed, score_mod=mods["score_mod"], score_mod_inputs=inputs)


def flash_forward(q, k, v, extras, options, mods, n_mod_inputs=0):
    """The flash module's build: the forward and what its backward reads.

    Args:
        q ``[G, Lq, D]``; k, v ``[Gk, Lkv, D]``; extras: the slopes, seed and score_mod
        inputs ``mods`` asks for; options: :func:`popxl_flash.flash_attention`'s options;
        mods: :func:`check_modifiers`'s dict; n_mod_inputs: the score_mod inputs' count.

    Returns:
        ``(out, stash)``: ``out`` ``[G, Lq, D]`` an identity of the flash call's output (not a
        stashed tensor: popxl-addons would label its gradient ``Fwd``, the aux trap), and
        ``stash`` ``{"q", "k", "v", "out", "lse", "extra0", ...}``.
    """
    modifiers = _flash_modifiers(mods, n_mod_inputs, extras, "FlashAttention.build")
    out, lse = flash_attention(q, k, v, return_lse=True, **options, **modifiers)
    stash = dict(q=q, k=k, v=v, out=out, lse=lse)
    stash.update({f"extra{i}": t for i, t in enumerate(extras)})
    return ops.identity(out), stash


def flash_backward(dout, stash, options, mods, n_mod_inputs=0):
    """The flash module's build_grad: stash-mode :func:`popxl_flash.flash_attention_grad`.

    Args:
        dout ``[G, Lq, D]``; stash: :func:`flash_forward`'s; options, mods, n_mod_inputs: the
        forward's.

    Returns:
        ``(dq, dk, dv, *zeros)``: a zero gradient per extra input.
    """
    count = int(mods["alibi"]) + int(mods["dropout"] > 0) + n_mod_inputs
    extras = [stash[f"extra{i}"] for i in range(count)]
    modifiers = _flash_modifiers(mods, n_mod_inputs, extras, "FlashAttention.build_grad")
    grads = flash_attention_grad(dout, stash["q"], stash["k"], stash["v"], stash["out"],
                                 stash["lse"], **options, **modifiers)
    zeros = [ops.init(t.shape, t.dtype, init_type="zero") for t in extras]
    return (*grads, *zeros)
