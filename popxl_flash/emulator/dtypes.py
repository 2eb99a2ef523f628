"""PopXL dtypes: named objects mapping to numpy types.

Only ``bool, int32, uint32, float16, float32`` run on the emulated device; the other names
exist as dtype objects and raise ``NotImplementedError`` when a tensor of that type is created.
"""
import numpy as np


class dtype:
    """A PopXL data type (not constructible by users; use the module-level instances)."""

    def __init__(self, name, np_type, is_int, is_float, is_signed):
        self._name = name
        self._np = np_type
        self._is_int = is_int
        self._is_float = is_float
        self._is_signed = is_signed

    @property
    def name(self):
        return self._name

    @property
    def is_int(self):
        return self._is_int

    @property
    def is_floating_point(self):
        return self._is_float

    @property
    def is_signed(self):
        return self._is_signed

    def as_numpy(self):
        """Returns: the numpy dtype of this type."""
        if self._np is None:
            raise TypeError(f"popxl.{self._name} has no numpy equivalent")
        return np.dtype(self._np)

    def __repr__(self):
        return f"popxl.dtypes.{self._name}"

    __str__ = __repr__


_TABLE = [
    # name, numpy, is_int, is_float, is_signed
    ("bool", np.bool_, False, False, False),
    ("int8", np.int8, True, False, True),
    ("int16", np.int16, True, False, True),
    ("int32", np.int32, True, False, True),
    ("int64", np.int64, True, False, True),
    ("uint8", np.uint8, True, False, False),
    ("uint16", np.uint16, True, False, False),
    ("uint32", np.uint32, True, False, False),
    ("uint64", np.uint64, True, False, False),
    ("float8_143", np.uint8, False, True, True),
    ("float8_152", np.uint8, False, True, True),
    ("float16", np.float16, False, True, True),
    ("float32", np.float32, False, True, True),
    ("float64", np.float64, False, True, True),
    ("complex64", np.complex64, False, False, True),
    ("complex128", np.complex128, False, False, True),
]
ALL = {row[0]: dtype(*row) for row in _TABLE}
globals().update(ALL)
half = ALL["float16"]
float = ALL["float32"]  # noqa: A001 - PopXL alias
double = ALL["float64"]

DEVICE = frozenset(ALL[n] for n in ("bool", "int32", "uint32", "float16", "float32"))
FLOAT8 = frozenset((ALL["float8_143"], ALL["float8_152"]))
_FROM_NUMPY = {np.dtype(row[1]): ALL[row[0]] for row in _TABLE if not row[0].startswith("float8")}
_DOWNCAST = {np.dtype(np.float64): np.float32, np.dtype(np.int64): np.int32,
             np.dtype(np.uint64): np.uint32}


def from_numpy(np_dtype):
    """Args: np_dtype: a numpy dtype. Returns: the popxl dtype (TypeError if none)."""
    try:
        return _FROM_NUMPY[np.dtype(np_dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"numpy dtype {np_dtype!r} has no PopXL equivalent") from None


def check_device(dt, what):
    """Raise unless ``dt`` is one of the five device dtypes the emulator runs.

    Args:
        dt: a popxl dtype. what: text naming the tensor/op for the message.
    """
    if not isinstance(dt, dtype):
        raise TypeError(f"{what}: expected a popxl dtype, got {dt!r}")
    if dt not in DEVICE:
        raise NotImplementedError(
            f"{what}: dtype {dt.name} is not supported by the emulator "
            "(only bool, int32, uint32, float16, float32)")


def check_shape(shape, what):
    """Validate a user-given tensor shape (PopXL builds a C++ ``TensorInfo`` from it through
    pybind11: a sequence of ints, floats rejected -> TypeError). Negative sizes are not rejected
    by PopART but give no meaningful tensor; the emulator raises ValueError.

    Args:
        shape: iterable of ints. what: text naming the tensor/op for the message.
    Returns:
        tuple of Python ints.
    """
    import operator
    try:
        out = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"{what}: shape must be an iterable of ints, got {shape!r}") from None
    if any(s < 0 for s in out):
        raise ValueError(f"{what}: negative dimension in shape {out} (unspecified in PopART)")
    return out


def to_numpy(data, dt=None, downcast=True):
    """Convert host data like ``popxl.utils.to_numpy``.

    Args:
        data: array-like. dt: popxl dtype to convert to (numpy ``asarray`` casting rules).
        downcast: without ``dt``, turn 64-bit float/int/uint arrays into 32-bit.
    Returns:
        A numpy array (a fresh copy).
    """
    if dt is not None:
        if dt in FLOAT8:
            raise NotImplementedError(f"float8 data ({dt.name}) is not supported by the emulator")
        with np.errstate(all="ignore"):
            return np.array(data, dtype=dt.as_numpy())
    arr = np.array(data)
    if downcast and arr.dtype in _DOWNCAST:
        with np.errstate(all="ignore"):
            arr = arr.astype(_DOWNCAST[arr.dtype])
    if arr.dtype.kind in "USOV":
        raise TypeError(f"cannot convert {type(data).__name__} value {data!r} to a tensor")
    return arr

