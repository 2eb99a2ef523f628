"""``init``: a zero or uninitialised tensor created by an op (usable in any graph).

"undef" tensors are filled with NaN (floats) 0x5A5A5A5A (ints) or True (bool) so programs
that read them before writing show it.
"""
import numpy as np

from .. import dtypes
from ..context import gcg
from ..registry import emit, register
from ..tensor import Tensor
from ..tiles import current, tile_set_of


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


# -- io_tile_copy (PopXL ``ops/io_tile_copy.py``, PopART ``op/iotilecopy.cpp``) ---------------
def _copy_rule(t):
    return [(t.shape, t.dtype)]


register("io_tile_copy", _copy_rule, lambda t: np.array(t, copy=True))


def io_tile_copy(t):
    """Copy ``t`` to the other tile set of the IPU (IO tiles to compute tiles or back: the
    op's tile set is the opposite of ``t``'s; when ``t``'s is undefined, the current one,
    ``popxl.io_tiles()`` or not). Returns: the copy (same values). No grad op (PopART's
    IoTileCopyOp defines none)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"The input `t` is not a Tensor. Type: {type(t)}. Value: {t}.")
    source = tile_set_of(t)
    out = emit("io_tile_copy", {"t": t}, {}, names=[t.name + "_iotilecopy"])[0]
    op = gcg()._ops[-1]
    op.tile_set = current() if source == "undefined" else \
        ("io" if source == "compute" else "compute")
    if op.tile_set == "io":
        op.graph.ir._uses_io_tiles = True
    return out
