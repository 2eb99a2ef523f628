"""numpy float64 oracle of the attention the library computes, forward and analytic backward.

Same semantics as :func:`popxl_flash.flash_attention` (see ``docs/user-guide.md``):

* shapes ``q [G, Lq, D]``, ``k, v [Gk, Lkv, D]`` with ``G % Gk == 0`` (grouped-query attention
  when ``Gk < G``: q group ``g`` reads kv group ``g // (G // Gk)``);
* ``scale=None`` means ``1/sqrt(D)``;
* bottom-right causal alignment: row ``i`` sees column ``j`` iff ``j <= i + (Lkv - Lq)``;
* ``window=(left, right)`` (``None`` or ``-1`` = unbounded side) keeps
  ``i + (Lkv - Lq) - left <= j <= i + (Lkv - Lq) + right``, intersected with ``causal``;
* a row that sees no key has output 0, lse ``-inf`` and zero gradient.

Everything is computed in float64 whatever the input dtype. Grouped-query attention is done the
obvious way, in the oracle only: each kv group is repeated for the ``G // Gk`` q groups that read
it, and the gradients of the copies are summed.
"""
import numpy as np


def repeat_kv(q, *kv):
    """Repeat each kv group for the q groups that share it (grouped-query attention).

    Args:
        q: ``[G, Lq, D]``.
        kv: arrays ``[Gk, Lkv, D]`` with ``G % Gk == 0``.

    Returns:
        The kv arrays as ``[G, Lkv, D]``: group ``g`` is kv group ``g // (G // Gk)``.
    """
    G = q.shape[0]
    out = []
    for x in kv:
        if x.ndim != 3 or G % x.shape[0]:
            raise ValueError(f"kv groups {x.shape[0]} must divide q's groups G={G}, "
                             f"got shapes {q.shape} and {x.shape}")
        out.append(np.repeat(x, G // x.shape[0], axis=0))
    return out


def sum_groups(x, kv_groups):
    """Sum ``x [G, L, D]`` over the q groups that share each kv group -> ``[Gk, L, D]``."""
    G = x.shape[0]
    return x.reshape(kv_groups, G // kv_groups, *x.shape[1:]).sum(axis=1)


def visibility(Lq, Lkv, *, causal=True, window=None):
    """Dense visibility matrix.

    Args:
        Lq, Lkv: query and key lengths.
        causal: bottom-right aligned causal mask.
        window: ``None`` or ``(left, right)``; ``None``/``-1`` entries are unbounded.

    Returns:
        bool array ``[Lq, Lkv]``, True where query row ``i`` sees key column ``j``.
    """
    left, right = (None, None) if window is None else window
    offset = np.arange(Lkv)[None, :] - (np.arange(Lq)[:, None] + (Lkv - Lq))  # j - diag(i)
    visible = np.ones((Lq, Lkv), dtype=bool)
    if causal:
        visible &= offset <= 0
    if left is not None and left >= 0:
        visible &= offset >= -left
    if right is not None and right >= 0:
        visible &= offset <= right
    return visible


def _probabilities(q, k, *, causal, scale, window):
    """Softmax probabilities and lse in float64.

    Returns:
        p ``[G, Lq, Lkv]`` (0 where masked or the row sees nothing), lse ``[G, Lq]``
        (``-inf`` for rows that see nothing), and the visibility ``[Lq, Lkv]``.
    """
    q = np.asarray(q, dtype=np.float64)
    k, = repeat_kv(q, np.asarray(k, dtype=np.float64))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    visible = visibility(q.shape[1], k.shape[1], causal=causal, window=window)
    s = np.where(visible, scale * (q @ k.transpose(0, 2, 1)), -np.inf)  # [G, Lq, Lkv]
    m = s.max(axis=-1, keepdims=True)  # [G, Lq, 1]
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)  # exp(-inf) = 0 where masked
    l = p.sum(axis=-1, keepdims=True)  # [G, Lq, 1]
    with np.errstate(divide="ignore"):
        lse = (m_safe + np.log(l))[..., 0]  # log(0) = -inf for rows that see nothing
    p = p / np.where(l > 0, l, 1.0)
    return p, lse, scale


def attention(q, k, v, *, causal=True, scale=None, window=None):
    """Reference attention.

    Args:
        q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]`` with ``G % Gk == 0`` (any float dtype;
            computed in float64).
        causal, scale, window: as :func:`popxl_flash.flash_attention`.

    Returns:
        ``(out, lse)``: out ``[G, Lq, D]`` float64, lse ``[G, Lq]`` float64.
    """
    p, lse, _ = _probabilities(q, k, causal=causal, scale=scale, window=window)
    v, = repeat_kv(q, np.asarray(v, dtype=np.float64))
    return p @ v, lse


def attention_grad(dout, q, k, v, *, causal=True, scale=None, window=None):
    """Analytic gradients of :func:`attention`'s ``out`` for an upstream gradient ``dout``.

    With ``P = softmax(scale * Q K^T)`` and ``O = P V``:
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``; with ``Gk < G`` dK and dV of the repeated
    kv groups are summed over the q groups that share them.

    Args:
        dout: ``[G, Lq, D]``; q: ``[G, Lq, D]``; k, v: ``[Gk, Lkv, D]``.
        causal, scale, window: as :func:`attention`.

    Returns:
        ``(dq, dk, dv)`` float64 with the shapes of q, k, v.
    """
    q64, k64, v64, do64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    kv_groups = k64.shape[0]
    k64, v64 = repeat_kv(q64, k64, v64)
    p, _, scale = _probabilities(q64, k64, causal=causal, scale=scale, window=window)
    out = p @ v64
    dv = p.transpose(0, 2, 1) @ do64
    dp = do64 @ v64.transpose(0, 2, 1)
    ds = p * (dp - (do64 * out).sum(axis=-1, keepdims=True))
    dq = scale * (ds @ k64)
    dk = scale * (ds.transpose(0, 2, 1) @ q64)
    return dq, sum_groups(dk, kv_groups), sum_groups(dv, kv_groups)
