"""Functional API: call inside a PopXL graph context; returns tensors of the current graph.

Each function validates its arguments (raising ``TypeError``/``ValueError`` that name the
argument), builds the module's graph with ``ir.create_graph`` and calls it with ``ops.call``.

Causal alignment is bottom-right (FlashAttention >= 2.1). With ``Lq = 2, Lkv = 5``::

    1 1 1 1 0
    1 1 1 1 1

and with ``Lq = 5, Lkv = 2`` (the first three rows see nothing: output 0, lse -inf)::

    0 0
    0 0
    0 0
    1 0
    1 1
"""
from popxl_flash.backend import popxl
from popxl_flash.backward import FlashAttentionGrad
from popxl_flash.config import AttentionConfig
from popxl_flash.forward import FlashAttention

ops = popxl.ops


def _check_tensors(**tensors):
    for name, t in tensors.items():
        if not isinstance(t, popxl.Tensor):
            shape = getattr(t, "shape", None)
            raise TypeError(f"{name} must be a popxl.Tensor, got {type(t).__name__}"
                            + (f" of shape {tuple(shape)}" if shape is not None else ""))


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def _call_module(module, *inputs):
    """Trace ``module`` into a subgraph of the current Ir and call it with ``inputs``."""
    graph = popxl.gcg().ir.create_graph(module, *inputs)
    return ops.call(graph, *inputs)


def flash_attention(q, k, v, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                    window=None, return_lse=False):
    """Exact attention with O(L) memory: ``softmax(scale * q k^T + mask) v``.

    Args:
        q: ``[G, Lq, D]`` float16 or float32 (G = batch x heads).
        k, v: ``[G, Lkv, D]``, same dtype as q.
        num_chunks_q, num_chunks_kv: chunk counts in ``[1, L]``; ``None`` picks
            the cost model's choice (:func:`popxl_flash.explain`). Lengths need not be
            divisible (the tail chunk is padded).
        causal: bottom-right aligned causal mask (row i sees j <= i + Lkv - Lq).
        scale: softmax scale; ``None`` means ``1/sqrt(D)``. ``1.0`` matches the PopART op.
        window: ``None`` or ``(left, right)`` local window around the diagonal; ``None`` or
            ``-1`` for an unbounded side. Intersected with ``causal``.
        return_lse: also return the logsumexp.

    Returns:
        out ``[G, Lq, D]`` in q's dtype; with ``return_lse``, ``(out, lse)`` where lse is
        float32 ``[G, Lq]`` (``-inf`` for rows that see no key; their out is 0).
    """
    _check_tensors(q=q, k=k, v=v)
    _check_bool("return_lse", return_lse)
    module = FlashAttention(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window)
    module.config(q, k, v)  # validate before any graph is created
    out, lse = _call_module(module, q, k, v)
    return (out, lse) if return_lse else out


def _unpack(qkv, options):
    """Validate a packed ``qkv [3, G, L, D]`` and return ``(q, k, v)`` views of it."""
    _check_tensors(qkv=qkv)
    AttentionConfig.from_packed_shape(qkv.shape, qkv.dtype.name, **options)
    return qkv[0], qkv[1], qkv[2]


def flash_attention_qkv_packed(qkv, *, num_chunks_q=None, num_chunks_kv=None, causal=True,
                               scale=None, window=None, return_lse=False):
    """:func:`flash_attention` on a packed ``qkv [3, G, L, D]`` (the PopART op's layout).

    Args:
        qkv: ``[3, G, L, D]`` float16 or float32; ``qkv[0]``, ``qkv[1]``, ``qkv[2]`` are q, k, v.
        num_chunks_q, num_chunks_kv, causal, scale, window, return_lse: as
            :func:`flash_attention`.

    Returns:
        out ``[G, L, D]`` (and lse float32 ``[G, L]`` with ``return_lse``).
    """
    options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal,
                   scale=scale, window=window)
    return flash_attention(*_unpack(qkv, options), return_lse=return_lse, **options)


def flash_attention_grad(dout, q, k, v, out=None, lse=None, *, num_chunks_q=None,
                         num_chunks_kv=None, causal=True, scale=None, window=None):
    """Gradients of :func:`flash_attention` with respect to q, k and v.

    Stash mode (``out`` and ``lse`` given, from ``flash_attention(..., return_lse=True)``)
    recomputes only the block probabilities: 5 block matmuls per visited block. Recompute mode
    (both ``None``) first reruns the forward, like the PopART op.

    Args:
        dout: ``[G, Lq, D]`` gradient of the output, q's dtype.
        q, k, v: the forward's inputs.
        out, lse: the forward's outputs, or both ``None``.
        num_chunks_q, num_chunks_kv, causal, scale, window: the forward's options.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v.
    """
    _check_tensors(dout=dout, q=q, k=k, v=v)
    if (out is None) != (lse is None):
        raise ValueError("out and lse must be given together (stash mode) or both be None "
                         f"(recompute mode), got out={out!r}, lse={lse!r}")
    options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal,
                   scale=scale, window=window)
    module = FlashAttentionGrad(**options)
    if out is None:
        cfg = FlashAttention(**options).config(q, k, v)
        cfg.check_like("dout", dout.shape, dout.dtype.name, q.shape, cfg.dtype)
        out, lse = flash_attention(q, k, v, return_lse=True, **options)
    _check_tensors(out=out, lse=lse)
    module.config(dout, q, k, v, out, lse)
    return _call_module(module, dout, q, k, v, out, lse)


def flash_attention_qkv_packed_grad(dout, qkv, out=None, lse=None, *, num_chunks_q=None,
                                    num_chunks_kv=None, causal=True, scale=None, window=None):
    """Gradient of :func:`flash_attention_qkv_packed` with respect to the packed ``qkv``.

    Args:
        dout: ``[G, L, D]``; qkv: ``[3, G, L, D]``; out, lse: stash (see
            :func:`flash_attention_grad`) or both ``None``.
        num_chunks_q, num_chunks_kv, causal, scale, window: the forward's options.

    Returns:
        dqkv ``[3, G, L, D]`` in qkv's dtype.
    """
    options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv, causal=causal,
                   scale=scale, window=window)
    q, k, v = _unpack(qkv, options)
    grads = flash_attention_grad(dout, q, k, v, out, lse, **options)
    return ops.concat([g.reshape((1,) + tuple(g.shape)) for g in grads], axis=0)
