"""A strict CPU emulator of the PopXL API subset (SDK 3.3/3.4).

Use it like ``popxl``: ``from popxl_flash import emulator as popxl``. Whatever it accepts, real
PopXL accepts and computes the same; where PopXL raises, it raises. Unimplemented ops and
features raise ``NotImplementedError``. Deliberate choices are listed in ``README.md`` here.
Emulator-only extras: ``Session.profile`` (a ``RunProfile``) and ``count_ops``.
"""
from . import dtypes, ops
from .context import gcg, get_current_graph, get_ir, get_main_graph, gir, gmg, in_sequence, \
    io_tiles, ipu, name_scope
from .dtypes import (bool, complex64, complex128, double, dtype, float, float8_143, float8_152,
                     float16, float32, float64, half, int8, int16, int32, int64, uint8, uint16,
                     uint32, uint64)
from .errors import PopartError
from .ir import (DeviceToHostStream, Graph, HostToDeviceStream, Ir, Module, d2h_stream,
                 graph_input, graph_output, h2d_stream)
from .profile import RunProfile, count_ops
from .session import Session
from .unsupported import stub
from .tensor import Constant, Tensor, TensorByRef, TensorSpec, Variable, constant, variable

__all__ = [
    "Constant", "DeviceToHostStream", "Graph", "HostToDeviceStream", "Ir", "Module",
    "PopartError", "RunProfile", "Session", "Tensor", "TensorByRef", "TensorSpec", "Variable",
    "bool", "complex64", "complex128", "constant", "count_ops", "d2h_stream", "double", "dtype",
    "dtypes", "float", "float8_143", "float8_152", "float16", "float32", "float64", "gcg",
    "get_current_graph", "get_ir", "get_main_graph", "gir", "gmg", "graph_input", "graph_output",
    "h2d_stream", "half", "in_sequence", "int8", "int16", "int32", "int64", "io_tiles", "ipu",
    "name_scope", "ops", "transforms", "uint8", "uint16", "uint32", "uint64", "variable",
]


from . import transforms  # noqa: E402 - popxl.transforms (autodiff)
remote_buffer = stub("popxl.remote_buffer")
RemoteBuffer = stub("popxl.RemoteBuffer")
ReplicaGrouping = stub("popxl.ReplicaGrouping")
