"""``popxl.utils.to_numpy`` (PopXL 3.4 signature) and the ``popxl.ops.utils`` helpers
third-party op code calls (PopXL 3.4 ``python_files/utils.py``, ``python_files/ops/utils.py``,
``python_files/ops/conv.py``)."""
import sys
from typing import Literal

import numpy as np

from . import dtypes
from .ir import Graph, check_in_graph as _check_in_graph
from .ops import cast
from .tensor import Tensor
from .tiles import check_same_tile_set

#: ``popxl.ops.conv.PadType``.
PadType = Literal["not_set", "same_upper", "same_lower", "valid"]


def to_numpy(x, dtype=None, downcast=True, copy=True, log2_scale=None, nan_on_overflow=None):
    """``popxl.utils.to_numpy``: host data as a C-ordered numpy array.

    Args:
        x: array-like, a torch tensor, or an ``np.memmap`` (then ``dtype`` must be None or its
            dtype, it must be C-contiguous, aligned and need no downcast; ValueError otherwise).
        dtype: popxl dtype to convert to; None infers (64-bit downcast to 32-bit if
            ``downcast``). downcast: see ``dtype``. copy: always copy the data.
        log2_scale, nan_on_overflow: float8 only (RuntimeError for other dtypes; float8 is not
            implemented by the emulator).
    Returns:
        np.ndarray.
    """
    if isinstance(x, np.memmap):
        if dtype is not None and dtype.as_numpy() != x.dtype:
            raise ValueError("When passing a memory-mapped NumPy array, the `dtype` parameter "
                             "must be None or the same as the array's dtype")
        if not (x.flags.c_contiguous and x.flags.aligned):
            raise ValueError("When passing a memory-mapped NumPy array, it must already be in "
                             "C-ordered and aligned form.")
        if x.dtype in dtypes._DOWNCAST:
            raise ValueError("When passing a memory-mapped NumPy array, the dtype "
                             f"{dtype} is not supported, as it requires downcasting the array "
                             "into a new array with a dtype supported by PopXL.")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().numpy()
    if dtype in dtypes.FLOAT8:
        raise NotImplementedError(f"float8 data ({dtype.name}) is not supported by the emulator")
    if log2_scale is not None:
        raise RuntimeError("Non-default value for 'log2scale' is not supported for dtypes  that "
                           "are not popxl.float8_143 or popxl.float8_152")
    if nan_on_overflow is not None:
        raise RuntimeError("Non-default value for 'nan_on_overflow' is not supported for  "
                           "dtypes that are not popxl.float8_143 or popxl.float8_152")
    keep = isinstance(x, np.memmap)
    if dtype is not None:
        out = x if keep else np.asarray(x, dtype=dtype.as_numpy(), order="C")
    else:
        out = x if keep else np.asarray(x, order="C")
        if downcast and out.dtype in dtypes._DOWNCAST:
            return np.array(out, dtype=dtypes._DOWNCAST[out.dtype], order="C")
    return out.copy() if copy else out


def table_to_string(rows, delimiter=" | ", header=True):
    """``popxl.utils.table_to_string``: rows as left-aligned columns joined by ``delimiter``,
    one line each; with ``header`` (and more than one row) the first line is underlined by
    dashes as long as that line including its newline.

    Args:
        rows: sequence of equally long sequences of stringable items.
    Returns:
        str.
    """
    widths = [max(len(str(c)) for c in col) for col in zip(*rows)]
    lines = []
    for i, row in enumerate(rows):
        line = delimiter.join(format(c, f"<{w}") for c, w in zip(row, widths)) + "\n"
        lines.append(line)
        if header and i == 0 and len(rows) > 1:
            lines.append("-" * len(line) + "\n")
    return "".join(lines)


def check_tensor_ipu_and_tile_set(*args, **tensors):
    """``popxl.ops.utils.check_tensor_ipu_and_tile_set``: keyword arguments, at least one
    (PopXL unpacks ``zip(*[])`` into three names), each a Tensor (PopXL reads
    ``t._get_ipu_and_tile_set``); every emulated tensor is on IPU 0, and tensors on different
    tile sets (undefined ones skipped) raise ValueError (``tiles.py``)."""
    if args:
        raise Exception("Internal error: please specify all tensors as keyword arguments.")
    if not tensors:
        raise ValueError("not enough values to unpack (expected 3, got 0)")
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise AttributeError(f"'{type(t).__name__}' object has no attribute "
                                 "'_get_ipu_and_tile_set'")
    check_same_tile_set(tensors)


def check_in_graph(graph, *args, **tensors):
    """``popxl.ops.utils.check_in_graph``: TypeError for non-tensors, ValueError for tensors
    of another graph."""
    if args:
        raise Exception("Internal error: please specify all tensors as keyword arguments.")
    _check_in_graph(graph, **tensors)


def cast_if_needed(t, data_type):
    """Returns: ``t`` cast to ``data_type`` when its dtype differs."""
    return cast(t, data_type) if t.dtype != data_type else t


def handle_negative_axis(t, axis):
    """Returns: ``axis`` made non-negative by adding ``t``'s rank once."""
    return len(t.shape) + axis if axis < 0 else axis


def _optional(name):
    def convert(v):
        raise NotImplementedError(f"popxl.ops.utils.{name} (a PopART C++ optional for a "
                                  "custom op) is not implemented by the emulator")
    convert.__name__ = name
    return convert


OPS_UTILS = {"cast_if_needed": cast_if_needed, "check_in_graph": check_in_graph,
             "check_tensor_ipu_and_tile_set": check_tensor_ipu_and_tile_set,
             "handle_negative_axis": handle_negative_axis,
             **{n: _optional(n) for n in ("convert_optional_float", "convert_optional_int",
                                          "convert_optional_dtype",
                                          "convert_optional_int64_list")},
             "Tensor": Tensor, "Graph": Graph, "dtype": dtypes.dtype}
