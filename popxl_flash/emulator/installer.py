"""``install()``: make ``import popxl`` / ``import popart`` give the emulator, for third-party
PopXL code (popxl-addons) that imports the SDK by name.

It puts module objects into ``sys.modules``: ``popxl`` (the emulator's
:mod:`popxl_flash.emulator.popxl`), the PopXL 3.4 submodules third-party code imports
(``popxl.context``, ``popxl.tensor``, ``popxl.ops.call``, ``popxl.transforms.autodiff``, ...),
``popart`` and ``popart._internal.ir``. Each submodule holds the names of the PopXL 3.4 module of
that name (``python/popxl/python_files/<path>.py``) that the emulator implements, stubs raising
``NotImplementedError`` for the public ones it does not, and nothing PopXL lacks. The files of
``popxl.ops``, ``popxl.ops.var_updates`` and ``popxl.transforms`` resolve their functions from
the package; the other PopXL submodules (``popxl_names.STUB_SUBMODULES``) are stub modules (any
attribute raises ``NotImplementedError``), so importing them works and using them fails loudly.

When a real ``popxl`` is importable nothing changes (``install()`` returns False).
"""
import importlib.util
import sys
import types

from . import popxl_names as _names

_STATE = {"installed": False}
#: {module name: module}, built once when ``popxl_flash.emulator.popxl`` is imported (it calls
#: :func:`attach` with itself: the installer sits below the ``popxl`` module and never imports
#: it; the emulator package's ``__init__`` imports ``popxl`` first, so the table is full before
#: anything can call :func:`install`).
MODULES = {}


def install(standins=False):
    """Make ``popxl``, its submodules, ``popart`` and ``popart._internal.ir`` the emulator's.

    Args:
        standins: also put the stand-ins for ``popdist``, ``mpi4py.MPI`` and ``cppimport``
            into ``sys.modules`` (``standins.py``: the first two only where the real module
            does not load; cppimport's hook then gives the emulator's models of popxl-addons'
            custom ops), as Graphcore's PopXL code imports them, and switch the emulator to
            its choosing mode for unspecified behaviour (``unspecified.set_strict(False)``:
            stated choices, counted and warned, where strict mode raises). Only when the
            emulator is (or becomes) ``popxl``. Without it the mode is left as it is
            (strict by default).
    Returns:
        True when the emulator is (now, or already) what ``import popxl`` gives; False when a
        real PopXL is importable (then nothing is changed). Idempotent.
    """
    emu_popxl = MODULES["popxl"]  # attached by the emulator's popxl module (attach)
    if not (_STATE["installed"] or sys.modules.get("popxl") is emu_popxl):
        if "popxl" in sys.modules or importlib.util.find_spec("popxl") is not None:
            return False
        sys.modules.update(MODULES)
        _STATE["installed"] = True
    if standins:
        from .standins import install_standins
        from .unspecified import set_strict
        install_standins()
        set_strict(False)
    return True


def inherit():
    """Make Python processes started from now on (``subprocess``) install the emulator and
    the stand-ins too: sets ``POPXL_FLASH_EMULATOR=1`` and puts ``_children`` (a
    ``sitecustomize`` that installs them) first on ``PYTHONPATH`` and last on ``sys.path``
    (Graphcore's tests hand ``":".join(sys.path)`` to their child processes as PYTHONPATH);
    the child must import ``popxl_flash`` as this process does (same environment)."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    parts = [os.path.join(here, "_children")]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in parts]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts + rest)
    os.environ["POPXL_FLASH_EMULATOR"] = "1"
    if parts[0] not in sys.path:  # last: code that passes its sys.path on as PYTHONPATH
        sys.path.append(parts[0])


class _OpModule(types.ModuleType):
    """A file of a PopXL package (``popxl.ops.add``, ``popxl.ops.var_updates.accumulate``,
    ``popxl.transforms.merge_exchange``): its names are the package names the PopXL 3.4 file
    holds (``popxl_names.file_names``) plus the module-level names set on it; another name of
    the package raises AttributeError, anything else (the file's helpers) NotImplementedError."""

    def __init__(self, qualname, package, names, package_names):
        super().__init__(qualname)
        self._package, self._names = package, frozenset(names)
        self._others = frozenset(package_names) - self._names

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_package", "_names", "_others"):
            raise AttributeError(name)
        if name in self._names:
            return getattr(MODULES[self._package], name)
        if name in self._others:  # a name of the package that this PopXL file does not hold
            raise AttributeError(f"module '{self.__name__}' has no attribute '{name}'")
        raise NotImplementedError(f"{self.__name__}.{name} is not implemented by the PopXL "
                                  "emulator")


def _module(qualname, attrs, public=(), doc=None):
    """A module holding ``attrs`` plus stubs for the ``public`` names not in ``attrs``."""
    from .unsupported import stub
    mod = types.ModuleType(qualname, doc)
    for name in public:
        if name not in attrs:
            setattr(mod, name, stub(f"{qualname}.{name}"))
    for name, value in attrs.items():
        setattr(mod, name, value)
    return mod


def attach(popxl):
    """Build :data:`MODULES` and bind the submodules as attributes of ``popxl`` (and of their
    parents) where PopXL binds them: called once at the end of the emulator's ``popxl``.

    Args:
        popxl: the emulator's popxl module.
    """
    MODULES.update(_build_modules(popxl))
    for full, mod in MODULES.items():
        parent, _, leaf = full.rpartition(".")
        if parent in MODULES and leaf not in vars(MODULES[parent]):
            setattr(MODULES[parent], leaf, mod)
        elif parent == "popxl" and isinstance(vars(popxl).get(leaf), types.ModuleType):
            setattr(popxl, leaf, mod)  # replaces the stub module (or emulator module) bound


def _build_modules(popxl):
    """Returns: {module name: module} for sys.modules."""
    from typing import Literal

    from . import _internal_ir, context, dtypes, errors, ir, popart, replica_grouping, session
    from . import random_seed, tensor, utils
    from .ops import random as _ops_random
    from .unsupported import stub_module
    ops = popxl.ops
    transforms = popxl.transforms
    mods = {"popxl": popxl, "popxl.ops": ops, "popxl.transforms": transforms}
    mods["popxl.context"] = _module("popxl.context", {
        **{n: getattr(context, n) for n in (
            "get_current_graph", "get_main_graph", "get_ir", "gcg", "gmg", "gir", "in_sequence",
            "name_scope", "ipu", "io_tiles", "get_current_context", "debug_context_frame_offset",
            "op_debug_context", "_execution_context", "Context")}},
        public=("get_source_location",))
    mods["popxl.tensor"] = popxl.tensor  # HostTensor, host_tensor_types: see popxl.py
    mods["popxl.dtypes"] = _module("popxl.dtypes", {
        "dtype": dtypes.dtype, **dtypes.ALL, "half": dtypes.half, "float": dtypes.float,
        "double": dtypes.double, "np_dtype_float8_143": dtypes._F8_143,
        "np_dtype_float8_152": dtypes._F8_152})
    mods["popxl.errors"] = _module("popxl.errors", {"UndefinedValue": errors.UndefinedValue})
    mods["popxl.graph"] = _module("popxl.graph", {"Graph": popxl.Graph})
    mods["popxl.ir"] = _module("popxl.ir", {"Ir": popxl.Ir})
    mods["popxl.module"] = _module("popxl.module", {"Module": popxl.Module})
    mods["popxl.replica_grouping"] = _module("popxl.replica_grouping", {
        "ReplicaGrouping": replica_grouping.ReplicaGrouping})
    mods["popxl.session"] = _module("popxl.session", {
        "Session": popxl.Session, **session.STREAM_BUFFER_MAPS})
    mods["popxl.streams"] = _module("popxl.streams", {
        "Stream": ir.Stream, "HostToDeviceStream": popxl.HostToDeviceStream,
        "DeviceToHostStream": popxl.DeviceToHostStream, "h2d_stream": popxl.h2d_stream,
        "d2h_stream": popxl.d2h_stream})
    mods["popxl.utils"] = _module("popxl.utils", {"to_numpy": utils.to_numpy,
                                                  "table_to_string": utils.table_to_string})
    mods["popxl.transforms.autodiff"] = _module("popxl.transforms.autodiff", {
        n: getattr(transforms, n) for n in ("autodiff", "GradGraphInfo", "ExpectedConnection",
                                            "ExpectedConnectionType")})
    mods["popxl.ops.call"] = _module("popxl.ops.call", {
        n: getattr(ops, n) for n in ("call", "call_with_info", "CallSiteInfo")})
    mods["popxl.ops.utils"] = _module("popxl.ops.utils", utils.OPS_UTILS)
    mods["popxl.ops.conv"] = _module("popxl.ops.conv", {"PadType": utils.PadType},
                                     public=("conv", "conv_pow2scaled", "conv_transpose",
                                             "conv_transpose_pow2scaled"))
    mods["popxl.ops.var_updates"] = ops.var_updates
    mods["popxl.ops.collectives"] = ops.collectives
    for package, files, names in (
            ("popxl.ops", _names.OP_MODULES, _names.OPS),
            ("popxl.ops.var_updates", _names.VAR_UPDATE_MODULES, _names.VAR_UPDATES),
            ("popxl.transforms", _names.TRANSFORM_MODULES, _names.TRANSFORMS),
            ("popxl.ops.collectives", _names.COLLECTIVE_MODULES, _names.COLLECTIVES)):
        for name in files:
            mods.setdefault(f"{package}.{name}", _OpModule(
                f"{package}.{name}", package, _names.file_names(package, name), names))
    from . import remote
    mods["popxl.remote_buffer"] = _module("popxl.remote_buffer", {
        "RemoteBuffer": remote.RemoteBuffer, "remote_buffer": remote.remote_buffer})
    mods["popxl.random_seed"] = _module("popxl.random_seed", {
        n: getattr(random_seed, n) for n in ("create_seeds", "uint64_to_two_uint32",
                                             "two_uint32_to_uint64", "MAX_UINT64")})
    mods["popxl.ops.random_seed"].create_random_seed = _ops_random._create_random_seed
    for name in _names.STUB_SUBMODULES:
        mods.setdefault(name, stub_module(name))
    # type aliases PopXL defines in op modules
    mods["popxl.ops.negative_log_likelihood"].REDUCTION_TYPE = Literal["mean", "sum", "none"]
    from .ops import collectives as _coll
    mods["popxl.ops.collectives.collectives"] = _module("popxl.ops.collectives.collectives", {
        "CollectiveOps": Literal["add", "mean", "mul", "min", "max", "and", "or",
                                 "square_add"], "to_collective_op": _coll.to_collective_op,
        "OP_MAP": {k: _coll.to_collective_op(k) for k in _coll.OP_MAP}},
        public=("CommGroup", "CommGroupType"))
    mods["popart"] = _module("popart", {
        "popart_exception": errors.PopartError,
        "popart_internal_exception": errors.PopartInternalError,
        "popart_runtime_error": errors.PopartRuntimeError,
        "poplibs_exception": errors.PoplibsError, "poplar_exception": errors.PoplarError,
        "poplar_runtime_error": errors.PoplarRuntimeError,
        "versionString": popart.version_string, "DeviceManager": popart.DeviceManager,
        "DeviceType": popart.DeviceType, "DeviceInfo": popart.DeviceInfo,
        "SessionOptions": popart.SessionOptions}, public=("PyWeightsIO", "getLogger"),
        doc="The emulator's ``popart`` (install()): the names PopXL code uses next to popxl.")
    pb_ir = _module("popart._internal.ir", {n: getattr(_internal_ir, n) for n in (
        "ExpectedConnection", "ExpectedConnectionType", "BwdGraphInfo", "Graph", "Ir", "Op",
        "CollectiveOperator",
        "Tensor", "TensorInfo", "GraphId", "TopoCons", "op", "view", "patterns",
        "ExecutionContext")}, doc=_internal_ir.__doc__)
    mods["popart._internal"] = _module("popart._internal", {"ir": pb_ir})
    mods["popart._internal.ir"] = pb_ir
    return mods
