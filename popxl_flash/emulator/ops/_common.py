"""Helpers shared by the op families: dtype classes, broadcasting, axis handling."""
import numpy as np

from .. import dtypes
from ..errors import PopartError

FLOATS = frozenset((dtypes.float16, dtypes.float32))
INTS = frozenset((dtypes.int32, dtypes.uint32))
NUMERIC = FLOATS | INTS
F32 = np.float32


def broadcast(kind, *tensors):
    """Args: kind: op name. tensors: input tensors. Returns: numpy-broadcast output shape."""
    try:
        return tuple(np.broadcast_shapes(*(t.shape for t in tensors)))
    except ValueError:
        shapes = ", ".join(str(t.shape) for t in tensors)
        raise PopartError(f"{kind}: np broadcasting failed on shapes {shapes}") from None


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


def as_int_list(kind, name, value):
    """Args: value: int or iterable of ints. Returns: list of Python ints."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return [int(value)]
    try:
        out = [int(v) for v in value]
    except TypeError:
        raise TypeError(f"{kind}: `{name}` must be an int or a list of ints, got {value!r}") from None
    return out


def scalar_value(kind, name, value):
    """Check a Python scalar attribute. Returns: it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{kind}: `{name}` must be a Python number, got {value!r}")
    return float(value)
