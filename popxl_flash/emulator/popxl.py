"""The emulator's ``popxl`` module: exactly the public names of PopXL 3.4 (SDK 3.3/3.4 subset).

``from popxl_flash.emulator import popxl`` behaves like ``import popxl``. Names PopXL has but the
emulator does not implement are present and raise ``NotImplementedError`` when used; names
PopXL lacks are absent (``AttributeError``). Emulator-only helpers (``count_ops``,
``RunProfile``, ``PopartError``) live in :mod:`popxl_flash.emulator`, not here. The name lists
are in ``popxl_names.py``.
"""
from . import dtypes, ops as _ops, popxl_names as _names, tensor as _tensor
from . import transforms as _transforms
from .context import (gcg, get_current_graph, get_ir, get_main_graph, gir, gmg, in_sequence,
                      io_tiles, ipu, name_scope)
from .dtypes import (bool, complex64, complex128, double, dtype, float, float8_143, float8_152,
                     float16, float32, float64, half, int8, int16, int32, int64, uint8, uint16,
                     uint32, uint64)
from .ir import (DeviceToHostStream, Graph, HostToDeviceStream, Ir, Module, d2h_stream,
                 graph_input, graph_output, h2d_stream)
from .random_seed import create_seeds
from .remote import (RemoteBuffer, remote_buffer, remote_replica_sharded_variable,
                     remote_variable, replica_sharded_buffer, replica_sharded_variable)
from .replica_grouping import ReplicaGrouping
from .session import Session
from .tensor import Tensor, TensorByRef, TensorSpec, constant, variable
from .unsupported import stub as _stub, stub_module as _stub_module, surface as _surface

#: what ``popxl.__version__`` gives on the emulator: the PopXL release it follows
__version__ = "3.4.0"

ops = _surface("popxl.ops", _names.OPS, _ops, doc=_ops.__doc__, children={
    "var_updates": _surface("popxl.ops.var_updates", _names.VAR_UPDATES, _ops.var_updates),
    "collectives": _surface("popxl.ops.collectives", _names.COLLECTIVES,
                            _ops.collectives),
    "CallSiteInfo": _ops.CallSiteInfo,
})
tensor = _surface("popxl.tensor", _names.TENSOR + _names.TENSOR_TYPES, _tensor,
                  children={"graph_input": graph_input, "graph_output": graph_output,
                            "remote_variable": remote_variable,
                            "remote_replica_sharded_variable": remote_replica_sharded_variable,
                            "replica_sharded_variable": replica_sharded_variable,
                            "replica_sharded_buffer": replica_sharded_buffer,
                            "TensorLike": _tensor.HostScalarTensor | Tensor})
# popxl.transforms: autodiff and GradGraphInfo implemented, the other passes stubs.
transforms = _surface("popxl.transforms", _names.TRANSFORMS, _transforms)

# PopXL 3.4's __all__ lists (what ``from popxl.ops import *`` binds)
for _mod, _pkg, _pub in ((ops, "popxl.ops", _names.OPS),
                         (ops.var_updates, "popxl.ops.var_updates", _names.VAR_UPDATES),
                         (ops.collectives, "popxl.ops.collectives", _names.COLLECTIVES),
                         (transforms, "popxl.transforms", _names.TRANSFORMS)):
    _mod.__all__ = _names.all_names(_pkg, _pub)
__all__ = _names.all_names("popxl", _names.TOP)
del _mod, _pkg, _pub

for _name in _names.TOP:
    if _name not in globals():
        globals()[_name] = _stub(f"popxl.{_name}")
for _name in _names.SUBMODULES:
    if _name not in globals():
        globals()[_name] = _stub_module(f"popxl.{_name}")
del _name

from . import installer as _install  # noqa: E402 - PopXL's submodules (popxl.context, ...)
_install.attach(__import__(__name__, fromlist=["*"]))
