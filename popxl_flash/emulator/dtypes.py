"""PopXL dtypes: named objects mapping to numpy types.

Only ``bool, int32, uint32, float16, float32`` run on the emulated device; the other names
exist as dtype objects and raise ``NotImplementedError`` when a tensor of that type is created.
"""
import numpy as np


class dtype:
    """A PopXL data type (PopXL 3.4 ``python_files/dtypes.py``): not constructible by users
    (``TypeError``); use the module-level instances, ``dtype.from_name`` or ``dtype.as_dtype``.
    """

    def __init__(self):
        raise TypeError("Cannot create popxl.dtypes.dtype instances.")

    @classmethod
    def _make(cls, name, np_type, is_int, is_float, is_signed, is_complex=False, py_type=None,
              torch_name=None):
        self = object.__new__(cls)
        self._name, self._np = name, np_type
        self._is_int, self._is_float, self._is_signed = is_int, is_float, is_signed
        self._is_complex, self._py_type, self._torch_name = is_complex, py_type, torch_name
        return self

    @property
    def name(self):
        return self._name

    @property
    def is_complex(self):
        return self._is_complex

    @property
    def is_int(self):
        return self._is_int

    @property
    def is_floating_point(self):
        return self._is_float

    @property
    def is_signed(self):
        return self._is_signed

    @classmethod
    def from_name(cls, name):
        """Args: name: a dtype name ("float32"; aliases such as "half" are not names).
        Returns: the dtype. Raises ValueError for any other value."""
        try:
            return ALL[name]
        except (KeyError, TypeError):
            raise ValueError(f"There is not a `popxl.dtype` that has a name: {name}.") from None

    @classmethod
    def as_dtype(cls, type_value):
        """Convert like PopXL, trying in turn: a dtype name, a Python type (``bool``,
        ``float`` -> float32), a numpy dtype, a torch dtype, ``np.dtype(type_value)``, then
        the ``.dtype`` of an array or torch tensor.

        Returns: the dtype. Raises ValueError when none matches.
        """
        for table in (ALL, _PY):
            try:
                return table[type_value]
            except (KeyError, TypeError):
                pass
        try:
            return _NP[type_value]
        except (KeyError, TypeError):
            pass
        found = _from_torch(type_value)
        if found is not None:
            return found
        try:
            return _NP[np.dtype(type_value)]
        except (KeyError, TypeError, ValueError):  # numpy 2 raises ValueError for a tensor
            pass
        if hasattr(type_value, "dtype"):
            try:
                return _NP[type_value.dtype]
            except (KeyError, TypeError):
                pass
            found = _from_torch(type_value.dtype)
            if found is not None:
                return found
        raise ValueError("There is not a `popxl.dtype` that is compatible with value: "
                         f"{type_value}, type: {type(type_value)}.")

    def as_numpy(self):
        """Returns: the numpy dtype of this type (float8: PopXL's structured one-byte dtype)."""
        return np.dtype(self._np)

    def as_torch(self):
        """Returns: the torch dtype (ModuleNotFoundError without torch, TypeError for types
        torch lacks: uint16/32/64, float8)."""
        import importlib
        try:
            torch = importlib.import_module("torch")
        except ModuleNotFoundError:
            raise ModuleNotFoundError("PyTorch is not installed.") from None
        if self._torch_name is None:
            raise TypeError(f"`popxl.{self._name}` does not have a corresponding PyTorch dtype.")
        return getattr(torch, self._torch_name)

    def __repr__(self):
        return f"popxl.dtypes.{self._name}"

    __str__ = __repr__


def _from_torch(value):
    """Returns: the dtype of a torch dtype, or None (torch is only looked at when loaded)."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.dtype):
        return None
    for dt in ALL.values():
        if dt._torch_name is not None and getattr(torch, dt._torch_name) == value:
            return dt
    return None


_F8_143 = np.dtype([("float8_143", "u1")])  # PopXL's numpy stand-ins for float8
_F8_152 = np.dtype([("float8_152", "u1")])
_TABLE = [
    # name, numpy, is_int, is_float, is_signed, is_complex, Python type, torch name
    ("bool", np.bool_, False, False, False, False, bool, "bool"),
    ("int8", np.int8, True, False, True, False, None, "int8"),
    ("int16", np.int16, True, False, True, False, None, "int16"),
    ("int32", np.int32, True, False, True, False, None, "int32"),
    ("int64", np.int64, True, False, True, False, None, "int64"),
    ("uint8", np.uint8, True, False, False, False, None, "uint8"),
    ("uint16", np.uint16, True, False, False, False, None, None),
    ("uint32", np.uint32, True, False, False, False, None, None),
    ("uint64", np.uint64, True, False, False, False, None, None),
    ("float8_143", _F8_143, False, True, True, False, None, None),
    ("float8_152", _F8_152, False, True, True, False, None, None),
    ("float16", np.float16, False, True, True, False, None, "float16"),
    ("float32", np.float32, False, True, True, False, float, "float32"),
    ("float64", np.float64, False, True, True, False, None, "float64"),
    ("complex64", np.complex64, False, False, True, True, None, "complex64"),
    ("complex128", np.complex128, False, False, True, True, None, "complex128"),
]
ALL = {row[0]: dtype._make(*row) for row in _TABLE}
_PY = {row[6]: ALL[row[0]] for row in _TABLE if row[6] is not None}
_NP = {np.dtype(row[1]): ALL[row[0]] for row in _TABLE}
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
    sct = _obj2sctype(data)
    if sct is not None and downcast and np.dtype(sct) in _DOWNCAST:
        sct = _DOWNCAST[np.dtype(sct)]
    arr = np.array(data) if sct is None else np.array(data, dtype=sct)
    if downcast and arr.dtype in _DOWNCAST:
        with np.errstate(all="ignore"):
            arr = arr.astype(_DOWNCAST[arr.dtype])
    if arr.dtype.kind == "V":  # PopXL's dtype.as_dtype finds no dtype for it
        raise ValueError(f"There is not a `popxl.dtype` that is compatible with value: {arr}, "
                         f"type: {type(arr)}.")
    if arr.dtype.kind in "USO":
        raise TypeError(f"cannot convert {type(data).__name__} value {data!r} to a tensor")
    return arr


def _obj2sctype(x):
    """NumPy 1.x's ``np.obj2sctype``, which PopXL 3.4's ``popxl.utils.to_numpy`` uses to infer
    the type of data given without a dtype (``python_files/utils.py``): ``np.dtype(x).type``
    when ``x`` reads as a dtype, so ``[]`` (an empty structured dtype) gives ``np.void`` and
    ``None`` float64; None otherwise (then ``np.asarray`` infers it).

    Args:
        x: host data (not a torch tensor).
    Returns:
        A numpy scalar type, or None.
    """
    if isinstance(x, type) and issubclass(x, np.generic):
        return x
    if isinstance(x, np.ndarray):
        return x.dtype.type
    try:
        return np.dtype(x).type
    except Exception:  # noqa: BLE001 - obj2sctype's own catch-all
        return None

