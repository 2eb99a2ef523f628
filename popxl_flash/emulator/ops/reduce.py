"""Reductions (sum, mean, max, min, prod, logsumexp) and softmax.

Axes follow PopART's ``ReduceOp::setup`` (``willow/src/op/reduce.cpp``): out-of-range axes are an
IR error; duplicate axes pass setup (the output drops the axis once) and are refused when the
Session compiles, as their lowering is unspecified. ``softmax`` is ONNX-11 style
(``SoftmaxComputex`` coerces the input to 2-D at ``axis``, ``willow/src/popx/op/softmaxx.cpp``
and ``elementwisex.cpp``): it normalises over all axes from ``axis`` on, flattened.

float16 sums/means/products/softmax accumulate in float32 and round once to float16 (the IPU
reduces half tensors with float partials); float32 inputs compute in float32.

``logsumexp`` follows ``ReduceLogSumExpOpx::grow`` (``willow/src/popx/op/reducelogsumexpx.cpp``):
``m = reduce_max(x)``, ``e = exp(x - m)`` (a map in the input's dtype), ``s = reduce_add(e)``,
``log(s) + m`` (a map in the input's dtype): stable for finite inputs; an all ``-inf`` slice
gives ``exp(-inf - -inf)`` = NaN there, as on the device.
"""
import numpy as np

from .. import dtypes, unspecified
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
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
    return tuple(sorted(axes))


def _check_duplicate_axes(op):
    axes = op.attrs["axes"]
    if len(set(axes)) != len(axes):
        raise PopartError(f"{op.kind}: duplicate axes {list(axes)} (PopART's setup accepts them; "
                          "their lowering is unspecified)")


def _check_reduce(op):
    """Duplicate axes; and max/min/mean over zero elements into a non-empty output, which
    PopART lowers to PopLibs' reduce without a special case (the result is not specified by
    its source; sum and prod give their identities 0 and 1)."""
    _check_duplicate_axes(op)
    t = op.inputs[0]
    empty = any(t.shape[a] == 0 for a in op.attrs["axes"])
    if op.kind in ("max", "min", "mean", "logsumexp") and empty and op.outputs[0].nelms > 0:
        raise PopartError(f"{op.kind} of {t.id} {t.shape} over axes {list(op.attrs['axes'])} "
                          "reduces zero elements (result unspecified in PopART's lowering)")


def _keepdims(kind, keepdims):
    # PopXL passes keepdims to an int64_t parameter through pybind11: bools and ints only.
    if not isinstance(keepdims, (int, np.integer)):
        raise TypeError(f"{kind}: keepdims must be a bool, got {keepdims!r}")
    return bool(keepdims)


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


def _logsumexp(a, axes, keepdims):
    m = np.max(a, axis=axes, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(a - m).astype(a.dtype, copy=False)  # popops::map in the input's dtype
        s = _sum(e, axes, True)
        out = (np.log(s) + m).astype(a.dtype, copy=False)
    return out if keepdims else np.squeeze(out, axis=axes)


_REDUCE = {"sum": (_sum, NUMERIC), "mean": (_mean, FLOATS), "max": (_max, NUMERIC),
           "min": (_min, NUMERIC), "prod": (_prod, NUMERIC), "logsumexp": (_logsumexp, FLOATS)}
for _kind, (_impl, _allowed) in _REDUCE.items():
    register(_kind, _reduce_rule(_kind, _allowed), _impl)
    COMPILE_CHECKS[_kind] = _check_reduce


def _reduce_op(kind):
    def op(t, axis=None, keepdims=False):
        rank = t.rank if hasattr(t, "rank") else 0
        return emit(kind, {"t": t}, {"axes": _axes(kind, axis, rank),
                                     "keepdims": _keepdims(kind, keepdims)})[0]
    op.__name__ = kind
    op.__doc__ = (f"Reduce ``{kind}`` over ``axis``.\n\nArgs:\n    t: Tensor.\n    axis: int, "
                  "iterable of ints (negative ok) or None (all axes).\n    keepdims: keep "
                  "reduced axes as size 1.\nReturns:\n    Tensor of t's dtype.")
    return op


sum, mean, max, min, prod, logsumexp = map(  # noqa: A001
    _reduce_op, ("sum", "mean", "max", "min", "prod", "logsumexp"))


def _softmax_rule(t, axis):
    require("softmax", t, FLOATS)
    return [(t.shape, t.dtype)]


def _softmax_axis(t, axis):
    """PopXL's ``handle_negative_axis`` then ``SoftmaxOp::getAxis`` (each adds the rank to a
    negative axis). Returns: the axis ``coerceTo2D`` splits at (valid when in [0, rank])."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"softmax: axis must be an int, got {axis!r}")
    axis = int(axis)
    for _ in range(2):
        if axis < 0:
            axis += t.rank
    return axis


def _check_softmax_axis(op):
    axis, rank = op.attrs["axis"], op.inputs[0].rank
    if not 0 <= axis <= rank:
        raise PopartError(f"softmax: axis {axis} is outside [0, {rank}] after PopART's "
                          "normalisation (the lowering's coerceTo2D is undefined there)")


def _softmax(a, axis):
    if a.size == 0:
        return np.empty_like(a)  # nothing to normalise
    n = int(np.prod(a.shape[:axis], dtype=np.int64))
    x = a.reshape(n, -1).astype(F32, copy=False)  # [outer, product of axes axis..]
    e = np.exp(x - np.max(x, axis=1, keepdims=True))
    return (e / np.sum(e, axis=1, keepdims=True)).astype(a.dtype, copy=False).reshape(a.shape)


register("softmax", _softmax_rule, _softmax)
COMPILE_CHECKS["softmax"] = _check_softmax_axis


def softmax(t, axis):
    """Softmax over all axes from ``axis`` on, flattened (ONNX-11 ``Softmax``, as PopART).

    Args:
        t: float tensor. axis: int (required; negative counts from the end).
    Returns:
        Tensor of t's shape and dtype; for ``axis = -1`` (or rank - 1) the usual last-axis
        softmax.
    """
    if not hasattr(t, "rank"):
        raise TypeError(f"The input `t` is not a Tensor. Type: {type(t)}. Value: {t}.")
    return emit("softmax", {"t": t}, {"axis": _softmax_axis(t, axis)})[0]


_ = dtypes


# -- argmax / argmin (PopXL ``ops/argminmax.py``; PopART ``op/argextrema.cpp``,
# ``popx/op/argextremax.cpp``: popnn::argMax/argMin over the axis, cast to int32) ----------
def _arg_rule(kind):
    def rule(t, dim, keepdims):
        require(kind, t, NUMERIC)
        if t.rank == 0:  # ArgExtremaOp::validateAxis
            raise PopartError(f"ArgExtremaOp input rank must be greater than 0, invalid "
                              f"ArgExtremaOp {kind}.")
        if not -t.rank <= dim < t.rank:
            raise PopartError(f"Axis {dim} is out of acceptable range [{-t.rank}, "
                              f"{t.rank - 1}]")
        axis = dim % t.rank
        shape = tuple(1 if i == axis else d for i, d in enumerate(t.shape)
                      if keepdims or i != axis)
        return [(shape, dtypes.int32)]
    return rule


def _arg_impl(kind):
    pick = np.argmax if kind == "argmax" else np.argmin
    extreme = np.max if kind == "argmax" else np.min

    def impl(a, dim, keepdims):
        axis = dim % a.ndim
        if a.shape[axis] == 0:
            unspecified.occurred("argmax_empty", RuntimeError(
                f"{kind} over an empty axis (unspecified)"))
            shape = tuple(1 if i == axis else d for i, d in enumerate(a.shape)
                          if keepdims or i != axis)
            return np.zeros(shape, np.int32)
        if a.dtype.kind == "f" and np.isnan(a).any():
            unspecified.occurred("argmax_nan", RuntimeError(
                f"{kind} of a tensor holding NaN: which index popnn returns is not specified"))
            return pick(a, axis=axis, keepdims=bool(keepdims)).astype(np.int32)  # first NaN
        best = extreme(a, axis=axis, keepdims=True)
        if ((a == best).sum(axis=axis) > 1).any():
            unspecified.occurred("argmax_tie", RuntimeError(
                f"{kind}: several elements tie for the extreme value along axis {axis}: "
                "which index popnn returns is not specified"))  # numpy: the lowest index
        return pick(a, axis=axis, keepdims=bool(keepdims)).astype(np.int32)
    return impl


for _kind in ("argmax", "argmin"):
    register(_kind, _arg_rule(_kind), _arg_impl(_kind))


def _arg_op(kind):
    def op(t, dim=0, keepdim=False):
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise TypeError(f"{kind}: dim must be an int, got {dim!r}")  # int64_t binding
        return emit(kind, {"t": t}, {"dim": int(dim), "keepdims": _keepdims(kind, keepdim)})[0]
    op.__name__ = kind
    op.__doc__ = (f"The indices (int32) of the {kind[3:]}imum elements of ``t`` along ``dim`` "
                  "(PopXL's ``ops.{kind}``).\n\nArgs:\n    t: Tensor (rank >= 1).\n    dim: "
                  "int in [-rank, rank).\n    keepdim: keep the axis as size 1.\nReturns:\n    "
                  "int32 Tensor. Ties and NaN raise RuntimeError when the op runs (popnn does "
                  "not specify the index; the emulator's choosing mode takes the lowest tied "
                  "or first NaN index).")
    return op


argmax, argmin = _arg_op("argmax"), _arg_op("argmin")
