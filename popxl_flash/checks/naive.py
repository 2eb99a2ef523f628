"""Naive attention as plain PopXL graph code: the baseline flash attention is measured against.

It materialises the whole ``[G, Lq, Lkv]`` score matrix, as a PopXL user writes attention
without this library (``q @ k.T``, mask, ``ops.softmax``, ``@ v``). Same semantics as
:func:`popxl_flash.flash_attention` for rows that see at least one key (a row that sees nothing
gets a uniform softmax here, not 0). Used by the demo, the benchmarks, the training example and
the tests; not part of the supported API.
"""
import numpy as np

from popxl_flash.backend import popxl
from popxl_flash.graph.blocks import MASKED_SCORE, to_float32
from popxl_flash.checks.reference import visibility

ops = popxl.ops

def _like(t, ref):
    return t if t.dtype == ref.dtype else ops.cast(t, ref.dtype)


def naive_probabilities(q, k, *, causal=True, scale=None, window=None):
    """``softmax(scale * q k^T + mask)`` in float32.

    Args:
        q: ``[G, Lq, D]``; k: ``[G, Lkv, D]`` (float16 or float32).

    Returns:
        float32 ``[G, Lq, Lkv]``.
    """
    f32 = popxl.float32
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = ops.matmul(q, k.transpose((0, 2, 1)), output_type=f32) * float(scale)
    visible = visibility(q.shape[1], k.shape[1], causal=causal, window=window)
    if not visible.all():
        s = ops.where(popxl.constant(visible), s, popxl.constant(MASKED_SCORE, f32))
    return ops.softmax(s, axis=-1)


def naive_attention(q, k, v, *, causal=True, scale=None, window=None):
    """Naive attention forward.

    Returns:
        out ``[G, Lq, D]`` in q's dtype.
    """
    p = naive_probabilities(q, k, causal=causal, scale=scale, window=window)
    return ops.matmul(_like(p, v), v)


def naive_attention_grad(dout, q, k, v, out=None, *, causal=True, scale=None, window=None):
    """Naive attention backward, written by hand (PopART cannot differentiate for us here).

    ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``, with ``P`` recomputed from q and k.

    Args:
        dout, q: ``[G, Lq, D]``; k, v: ``[G, Lkv, D]``.
        out: the forward's output (5 matmuls, like flash's stash mode), or ``None`` to
            recompute it (a sixth matmul).

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtype.
    """
    f32 = popxl.float32
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = naive_probabilities(q, k, causal=causal, scale=scale, window=window)  # [G, Lq, Lkv]
    out = ops.matmul(_like(p, v), v, output_type=f32) if out is None else to_float32(out)
    dv = ops.matmul(_like(p, v).transpose((0, 2, 1)), dout, output_type=f32)
    dp = ops.matmul(dout, v.transpose((0, 2, 1)), output_type=f32)
    dvec = ops.sum(to_float32(dout) * out, axis=-1, keepdims=True)
    ds = _like(p * (dp - dvec), q)
    dq = ops.matmul(ds, k, output_type=f32) * scale
    dk = ops.matmul(ds.transpose((0, 2, 1)), q, output_type=f32) * scale
    return tuple(_like(g, q) for g in (dq, dk, dv))
