"""Reductions (sum, mean, max, min, prod) and softmax.

float16 sums/means/products/softmax accumulate in float32 and round once to float16 (the IPU
reduces half tensors with float partials); float32 inputs compute in float32.
"""
import numpy as np

from .. import dtypes
from ..errors import PopartError
from ..registry import emit, register
from ._common import F32, FLOATS, NUMERIC, norm_axis, require


def _axes(kind, axis, rank):
    if axis is None:
        return tuple(range(rank))
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
        axis = [axis]
    try:
        axes = [norm_axis(kind, a, rank) for a in axis]
    except TypeError:
        raise TypeError(f"{kind}: axis must be None, an int or an iterable of ints; "
                        f"got {axis!r}") from None
    if len(set(axes)) != len(axes):
        raise PopartError(f"{kind}: duplicate axes {list(axis)}")
    return tuple(sorted(axes))


def _reduce_rule(kind, allowed):
    def rule(t, axes, keepdims):
        require(kind, t, allowed)
        shape = tuple(1 if i in axes else d for i, d in enumerate(t.shape) if keepdims or
                      i not in axes)
        return [(shape, t.dtype)]
    return rule


def _sum(a, axes, keepdims):
    acc = F32 if a.dtype == np.float16 else a.dtype
    return np.sum(a, axis=axes, dtype=acc, keepdims=keepdims).astype(a.dtype, copy=False)


def _prod(a, axes, keepdims):
    acc = F32 if a.dtype == np.float16 else a.dtype
    return np.prod(a, axis=axes, dtype=acc, keepdims=keepdims).astype(a.dtype, copy=False)


def _mean(a, axes, keepdims):
    s = np.sum(a, axis=axes, dtype=F32, keepdims=keepdims)
    n = int(np.prod([a.shape[i] for i in axes], dtype=np.int64))
    return (s / F32(n)).astype(a.dtype, copy=False)


def _max(a, axes, keepdims):
    return np.max(a, axis=axes, keepdims=keepdims)


def _min(a, axes, keepdims):
    return np.min(a, axis=axes, keepdims=keepdims)


_REDUCE = {"sum": (_sum, NUMERIC), "mean": (_mean, FLOATS), "max": (_max, NUMERIC),
           "min": (_min, NUMERIC), "prod": (_prod, NUMERIC)}
for _kind, (_impl, _allowed) in _REDUCE.items():
    register(_kind, _reduce_rule(_kind, _allowed), _impl)


def _reduce_op(kind):
    def op(t, axis=None, keepdims=False):
        rank = t.rank if hasattr(t, "rank") else 0
        return emit(kind, {"t": t}, {"axes": _axes(kind, axis, rank),
                                     "keepdims": bool(keepdims)})[0]
    op.__name__ = kind
    op.__doc__ = (f"Reduce ``{kind}`` over ``axis``.\n\nArgs:\n    t: Tensor.\n    axis: int, "
                  "iterable of ints (negative ok) or None (all axes).\n    keepdims: keep "
                  "reduced axes as size 1.\nReturns:\n    Tensor of t's dtype.")
    return op


sum, mean, max, min, prod = map(_reduce_op, ("sum", "mean", "max", "min", "prod"))  # noqa: A001


def _softmax_rule(t, axis):
    require("softmax", t, FLOATS)
    return [(t.shape, t.dtype)]


def _softmax(a, axis):
    x = a.astype(F32, copy=False)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(a.dtype, copy=False)


register("softmax", _softmax_rule, _softmax)


def softmax(t, axis):
    """Args: t: float tensor. axis: int (required; negative ok). Returns: softmax along axis."""
    rank = t.rank if hasattr(t, "rank") else 0
    return emit("softmax", {"t": t}, {"axis": norm_axis("softmax", axis, rank)})[0]


_ = dtypes
