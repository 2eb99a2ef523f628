"""Helpers shared by the op families: dtype classes, broadcasting, axis handling."""
import operator
from collections.abc import Sequence

import numpy as np

from .. import dtypes
from ..errors import PopartError

FLOATS = frozenset((dtypes.float16, dtypes.float32))
INTS = frozenset((dtypes.int32, dtypes.uint32))
NUMERIC = FLOATS | INTS
F32 = np.float32


def np_out(kind, s0, s1):
    """PopART's ``npOut`` (``willow/src/tensorinfo.cpp``): numpy broadcasting, except that a
    dimension both shapes have (the trailing ``min(rank)`` ones) must be positive in both
    (``isBroadcastableDims``): ``(2, 0) + (2, 0)`` raises, ``(0, 3) + (3,)`` gives ``(0, 3)``.

    Args:
        kind: op name (for the message). s0, s1: shapes (tuples).
    Returns:
        The output shape (tuple).
    Raises:
        PopartError: the overlapping dimensions are not broadcastable.
    """
    n = min(len(s0), len(s1))
    tail = zip(s0[len(s0) - n:], s1[len(s1) - n:])
    if not all(a > 0 and b > 0 and (a == b or a == 1 or b == 1) for a, b in tail):
        raise PopartError(f"{kind}: np broadcasting failed, frames {list(s0)} and {list(s1)} "
                          "are not aligned")
    return tuple(np.broadcast_shapes(s0, s1))


def broadcast(kind, *tensors):
    """Args: kind: op name. tensors: input tensors. Returns: the output shape, PopART's
    ``npOut`` folded over the inputs' shapes (:func:`np_out`)."""
    out = tensors[0].shape
    for t in tensors[1:]:
        out = np_out(kind, out, t.shape)
    return tuple(out)


def same_dtype(kind, *tensors):
    """Raise PopartError unless all tensors share one dtype. Returns: that dtype."""
    dts = {t.dtype for t in tensors}
    if len(dts) != 1:
        desc = ", ".join(f"{t.id}: {t.dtype.name}" for t in tensors)
        raise PopartError(f"{kind}: np broadcasting failed, incompatible types ({desc})")
    return tensors[0].dtype


def require(kind, t, allowed, what="dtype"):
    """Raise NotImplementedError unless ``t.dtype`` is in ``allowed``."""
    if t.dtype not in allowed:
        names = sorted(d.name for d in allowed)
        raise NotImplementedError(f"{kind} on {t.dtype.name} tensor {t.id} is not supported by "
                                  f"the emulator ({what} must be one of {names})")


def norm_axis(kind, axis, rank):
    """Args: axis: int (negative ok). rank: tensor rank. Returns: axis in [0, rank)."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{kind}: axis must be an int, got {axis!r}")
    a = int(axis) + rank if axis < 0 else int(axis)
    if not 0 <= a < rank:
        raise PopartError(f"{kind}: axis {axis} is out of range for rank {rank}")
    return a


def int_vector(kind, name, value):
    """Convert like pybind11's ``std::vector<int64_t>`` caster (PopXL passes op attributes to
    C++ that way): a non-string sequence of ints (numpy ints and bools ok, floats not).

    Returns: tuple of Python ints. Raises TypeError otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{kind}: `{name}` must be a list of ints, got {value!r}")
    try:
        return tuple(operator.index(v) for v in value)
    except TypeError:
        raise TypeError(f"{kind}: `{name}` must be a list of ints, got {value!r}") from None


def scalar_value(kind, name, value):
    """Check a Python scalar attribute. Returns: it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{kind}: `{name}` must be a Python number, got {value!r}")
    return float(value)
