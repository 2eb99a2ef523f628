"""popxl-addons layers: flash attention as an ``addons.Module``, and a GPT-style self-attention.

Importable when ``popxl_addons`` is (popxl-addons 3.4; on the emulator call
``popxl_flash.emulator.install()`` before importing popxl-addons). Two modules:

* :class:`FlashAttention`: ``build(q, k, v) -> out`` on the core API's ``[G, L, D]`` tensors,
  with the core options; its ``build_grad`` is flash's stash-mode backward
  (:func:`popxl_flash.flash_attention_grad`);
* :class:`SelfAttention`: ``build(x) -> y`` on ``[B, L, hidden_size]``: ``addons.layers.Linear``
  projections named ``q``, ``k``, ``v`` (GQA when ``kv_heads < heads``) and ``o`` around flash
  attention; its variables are ``q.weight``, ``q.bias``, ..., ``o.bias``.

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

from popxl_flash.api.autodiff import called_graphs_grad_info
from popxl_flash.backend import popxl
from popxl_flash.plan.config import _check_int
from popxl_flash.api.functional import flash_attention, flash_attention_grad

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


class FlashAttention(addons.Module):
    """Flash attention with a hand-written backward: ``build(q, k, v) -> out``.

    Args (constructor, keyword-only): num_chunks_q, num_chunks_kv, causal, scale, window: as
    :func:`popxl_flash.flash_attention` (``causal`` defaults to True). grad_inlining_error:
    popxl-addons' guard against calling a module with ``build_grad`` inline; ``"none"`` by
    default because inlining is correct here (autodiff then uses the entries this module
    registers, the same stash-mode backward).
    """

    def __init__(self, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                 window=None, grad_inlining_error="none"):
        super().__init__(grad_inlining_error=grad_inlining_error)
        self.options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window)

    def build(self, q, k, v):
        """Args: q ``[G, Lq, D]``; k, v ``[Gk, Lkv, D]`` (``G % Gk == 0``), q's dtype.

        Returns:
            out ``[G, Lq, D]``: an identity of the flash call's output, which is stashed (see the
            module docstring: returning the stashed tensor itself would make its gradient
            input ``Fwd``).
        """
        out, lse = flash_attention(q, k, v, return_lse=True, **self.options)
        register_flash_entries(self)
        for name, t in dict(q=q, k=k, v=v, out=out, lse=lse).items():
            self.aux[name] = t  # forward outputs the gradient graph reads (Fwd)
        return ops.identity(out)

    def build_grad(self, dout):
        """Args: dout ``[G, Lq, D]``, the gradient of ``out``.

        Returns:
            ``(dq, dk, dv)``: stash-mode :func:`popxl_flash.flash_attention_grad`.
        """
        a = self.aux
        return flash_attention_grad(dout, a["q"], a["k"], a["v"], a["out"], a["lse"],
                                    **self.options)


class SelfAttention(addons.Module):
    """GPT-style multi-head self-attention on ``[B, L, hidden_size]`` with flash attention.

    ``y = o(attention(q(x), k(x), v(x)))``: ``addons.layers.Linear`` projections (with bias)
    named ``q`` (``hidden_size -> heads * D``), ``k`` and ``v`` (``-> kv_heads * D``) and ``o``
    (``heads * D -> hidden_size``), ``D = hidden_size / heads``. Heads flatten batch-major into
    the core's groups (``g = b * heads + h``), so q head ``h`` reads k/v head
    ``h // (heads / kv_heads)`` (grouped-query attention; ``kv_heads = 1``: multi-query).

    Args:
        hidden_size: E, divisible by ``heads``.
        heads: query heads.
        kv_heads: key/value heads, a divisor of ``heads`` (default ``heads``).
        causal: causal mask (default True).
        **options: ``num_chunks_q``, ``num_chunks_kv``, ``scale``, ``window`` of
            :func:`popxl_flash.flash_attention`.
    """

    def __init__(self, hidden_size, heads, kv_heads=None, causal=True, **options):
        super().__init__()
        self.hidden_size = _check_int("hidden_size", hidden_size, low=1)
        self.heads = _check_int("heads", heads, low=1)
        self.kv_heads = _check_int("kv_heads", heads if kv_heads is None else kv_heads, low=1)
        if hidden_size % heads:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of heads={heads}")
        if heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={heads}")
        unknown = set(options) - {"num_chunks_q", "num_chunks_kv", "scale", "window"}
        if unknown:
            raise TypeError(f"SelfAttention got unexpected options {sorted(unknown)}; expected "
                            "num_chunks_q, num_chunks_kv, scale, window")
        self.head_dim = hidden_size // heads
        self.options = dict(options, causal=causal)
        self.q = Linear(heads * self.head_dim)
        self.k = Linear(self.kv_heads * self.head_dim)
        self.v = Linear(self.kv_heads * self.head_dim)
        self.o = Linear(hidden_size)

    def build(self, x):
        """Args: x ``[B, L, hidden_size]``. Returns: y ``[B, L, hidden_size]``, x's dtype."""
        if len(x.shape) != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape [B, L, hidden_size={self.hidden_size}], got "
                             f"{tuple(x.shape)}")
        B, L, _ = x.shape
        q = self._to_groups(self.q(x), self.heads)  # [B*H, L, D]
        k = self._to_groups(self.k(x), self.kv_heads)  # [B*Hkv, L, D]
        v = self._to_groups(self.v(x), self.kv_heads)
        out = self.attend(q, k, v)  # [B*H, L, D]
        out = out.reshape((B, self.heads, L, self.head_dim)).transpose((0, 2, 1, 3))
        return self.o(out.reshape((B, L, self.heads * self.head_dim)))

    def attend(self, q, k, v):
        """The attention between the projections (override it to compare another attention
        on the same layer and weight names).

        Args:
            q: ``[B * heads, L, D]``; k, v: ``[B * kv_heads, L, D]``.

        Returns:
            ``[B * heads, L, D]``: :func:`popxl_flash.flash_attention` with this layer's
            options, its gradient entries registered in ``called_graphs_grad_info``.
        """
        out = flash_attention(q, k, v, **self.options)
        register_flash_entries(self)
        return out

    def _to_groups(self, t, heads):
        """``[B, L, heads * D]`` -> ``[B * heads, L, D]`` (batch-major)."""
        B, L, _ = t.shape
        t = t.reshape((B, L, heads, self.head_dim)).transpose((0, 2, 1, 3))
        return t.reshape((B * heads, L, self.head_dim))
