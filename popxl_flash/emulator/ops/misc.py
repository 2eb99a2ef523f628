"""``init``: a zero or uninitialised tensor created by an op (usable in any graph).

"undef" tensors are filled with NaN (floats) 0x5A5A5A5A (ints) or True (bool) so programs
that read them before writing show it.
"""
import numpy as np

from .. import dtypes
from ..registry import emit, register


def _init_rule(shape, dtype, init_type):
    return [(shape, dtype)]


def _init(shape, dtype, init_type):
    npdt = dtype.as_numpy()
    if init_type == "zero":
        return np.zeros(shape, npdt)
    if npdt.kind == "f":
        return np.full(shape, np.nan, npdt)
    if npdt.kind == "b":
        return np.ones(shape, npdt)
    return np.full(shape, 0x5A5A5A5A, npdt)


register("init", _init_rule, _init)


def init(shape, dtype, name=None, init_type="zero", meta_shape=None):
    """Args: shape, dtype, name. init_type: "zero" or "undef". meta_shape: unused here.
    Returns: a new non-variable tensor."""
    if init_type not in ("zero", "undef"):
        raise ValueError(f"Unknown init_type: {init_type}")
    dtypes.check_device(dtype, "init")
    if meta_shape:
        raise NotImplementedError("init(meta_shape=...) is not supported by the emulator")
    shape = dtypes.check_shape(shape, "init")
    return emit("init", {}, {"shape": shape, "dtype": dtype, "init_type": init_type},
                names=[name or "init"])[0]
