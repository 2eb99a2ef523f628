"""``popxl_flash.emulator.install()``: ``import popxl`` / ``import popart`` give the
emulator in a process without the SDK, and nothing changes when a real popxl is importable.

Each case runs in a subprocess: install() edits ``sys.modules`` for the whole process.
"""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code, extra_path=None, **env_vars):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [extra_path, ROOT])),
               **env_vars)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_install_makes_popxl_and_popart_the_emulator():
    out = _run("""
        import sys
        from popxl_flash import emulator
        assert emulator.install() is True and emulator.install() is True  # idempotent
        import popxl, popxl.context, popxl.ops.call, popart, popart._internal.ir as _ir
        from popxl.tensor import HostTensor, host_tensor_types, Variable
        from popxl.transforms.autodiff import GradGraphInfo
        from popxl.ops.utils import check_in_graph, check_tensor_ipu_and_tile_set
        from popxl.ops.conv import PadType
        from popxl.streams import Stream
        from popxl.session import Session, d2hStreamBufferMaps, h2dStreamBufferMaps
        from popxl.graph import Graph
        from popxl.utils import to_numpy
        from popxl.context import get_current_context, debug_context_frame_offset
        from popxl.context import op_debug_context
        from popxl.ops.negative_log_likelihood import REDUCTION_TYPE
        from popart import popart_exception
        assert popxl is emulator.popxl
        assert popxl.ops.call is popxl.ops.call_with_info.__globals__["call"] or callable(
            popxl.ops.call)
        assert sys.modules["popxl.ops.call"].CallSiteInfo is popxl.ops.CallSiteInfo
        assert popart_exception is emulator.PopartError
        assert issubclass(Stream, popxl.HostToDeviceStream.__mro__[1])
        assert popxl.ops.add.__name__ == "add"          # attribute: the op, as in PopXL
        from popxl.ops.add import add_                   # module: its names
        assert add_ is popxl.ops.add_
        from popxl.ops.var_updates.accumulate import accumulate_
        assert accumulate_ is popxl.ops.var_updates.accumulate_
        from popxl.transforms.merge_exchange import merge_exchange  # a stub, importable
        print("ok")
    """)
    assert out.strip() == "ok"


def test_install_refuses_names_popxl_lacks():
    _run("""
        from popxl_flash import emulator
        emulator.install()
        import popxl
        for mod, name in ((popxl, "count_ops"), (popxl.ops, "RepeatSiteInfo")):
            try:
                getattr(mod, name)
            except AttributeError:
                pass
            else:
                raise SystemExit(f"{name} present")
        try:
            import popxl.not_a_popxl_module  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("unknown submodule imported")
        import popxl.ops.collectives.collectives as c   # a PopXL module the emulator stubs
        try:
            c.CommGroup()
        except NotImplementedError:
            pass
        else:
            raise SystemExit("stub ran")
    """)


def test_install_changes_nothing_when_popxl_is_importable(tmp_path):
    (tmp_path / "popxl").mkdir()
    (tmp_path / "popxl" / "__init__.py").write_text("REAL = True\n")
    out = _run("""
        import sys
        from popxl_flash import emulator
        assert emulator.install() is False
        assert "popxl" not in sys.modules and "popart" not in sys.modules
        import popxl
        assert popxl.REAL
        print("ok")
    """, extra_path=str(tmp_path), POPXL_FLASH_BACKEND="emulator")
    assert out.strip() == "ok"


@pytest.mark.parametrize("stmt", ["import popxl", "import popart._internal.ir",
                                  "from popxl.context import get_current_context"])
def test_without_install_nothing_is_importable(stmt):
    """The emulator never installs itself: importing ``popxl_flash`` leaves ``popxl`` alone."""
    _run(f"""
        import popxl_flash
        try:
            {stmt}
        except ImportError:
            pass
        else:
            raise SystemExit("imported without install()")
    """)


def test_backend_after_install_is_the_emulator():
    """popxl_flash imported after install() still knows it runs on the emulator."""
    out = _run("""
        import sys, importlib
        sys.path.insert(0, ".")
        import popxl_flash.emulator.installer as inst  # imports popxl_flash (backend chosen)
        inst.install()
        import popxl_flash.backend as b
        importlib.reload(b)                            # choose again, now with popxl importable
        print(b.BACKEND)
    """)
    assert out.strip() == "emulator"


#: Public names of the PopXL 3.4 modules (``python/popxl/python_files/<path>.py``: its
#: definitions and the names it imports) that install() provides as implemented modules.
POPXL_34_NAMES = {
    "popxl.context": {"Context", "_execution_context", "debug_context_frame_offset", "gcg",
                      "get_current_context", "get_current_graph", "get_ir", "get_main_graph",
                      "get_source_location", "gir", "gmg", "in_sequence", "io_tiles", "ipu",
                      "name_scope", "op_debug_context"},
    "popxl.dtypes": {"dtype", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                     "uint32", "uint64", "float8_143", "float8_152", "float16", "float32",
                     "float64", "complex64", "complex128", "half", "float", "double",
                     "np_dtype_float8_143", "np_dtype_float8_152"},
    "popxl.errors": {"UndefinedValue"},
    "popxl.graph": {"Graph"}, "popxl.ir": {"Ir"}, "popxl.module": {"Module"},
    "popxl.replica_grouping": {"ReplicaGrouping"},
    "popxl.session": {"Session", "d2hStreamBufferMaps", "h2dStreamBufferMaps",
                      "StreamBufferMaps"},
    "popxl.streams": {"Stream", "HostToDeviceStream", "DeviceToHostStream", "h2d_stream",
                      "d2h_stream"},
    "popxl.utils": {"to_numpy", "table_to_string"},
    "popxl.tensor": {"Tensor", "Variable", "Constant", "TensorSpec", "TensorByRef", "constant",
                     "variable", "graph_input", "graph_output", "remote_variable",
                     "remote_replica_sharded_variable", "replica_sharded_variable",
                     "replica_sharded_buffer", "HostTensor", "host_tensor_types", "ScalarType",
                     "HostScalarTensor", "TensorLike"},
    "popxl.ops.utils": {"cast_if_needed", "check_in_graph", "check_tensor_ipu_and_tile_set",
                        "handle_negative_axis", "convert_optional_float",
                        "convert_optional_int", "convert_optional_dtype",
                        "convert_optional_int64_list", "Tensor", "Graph", "dtype"},
    "popxl.ops.call": {"CallSiteInfo", "call", "call_with_info"},
    "popxl.ops.conv": {"PadType", "conv", "conv_pow2scaled", "conv_transpose",
                       "conv_transpose_pow2scaled"},
    "popxl.transforms.autodiff": {"ExpectedConnection", "ExpectedConnectionType",
                                  "GradGraphInfo", "autodiff"},
    "popxl.ops.collectives.collectives": {"CollectiveOps", "CommGroup", "CommGroupType",
                                          "to_collective_op", "OP_MAP"},
}


@pytest.mark.parametrize("name", sorted(POPXL_34_NAMES))
def test_installed_submodules_hold_only_popxl_names(name):
    from popxl_flash.emulator import installer
    mod = installer.MODULES[name]
    present = {k for k in vars(mod) if not k.startswith("__")}
    assert present <= POPXL_34_NAMES[name], present - POPXL_34_NAMES[name]


def test_internal_ir_surface_has_no_emulator_helpers():
    from popxl_flash.emulator import installer
    names = {k for k in vars(installer.MODULES["popart._internal.ir"]) if not k.startswith("__")}
    assert not {n for n in names if n.startswith("Pb") or n.startswith("_")} | (
        names & {"make_op", "PopartError", "enum", "types"})


def test_popart_exceptions_and_version_string():
    """``popart_core/popart.cpp``: ``poplibs_exception`` and ``poplar_exception`` are
    registered on their own (not ``popart_exception`` subclasses); the internal and runtime
    errors derive from ``popart_exception``; ``versionString()`` is a function."""
    from popxl_flash import emulator
    emulator.install()
    import popart
    assert not issubclass(popart.poplibs_exception, popart.popart_exception)
    assert not issubclass(popart.poplar_exception, popart.popart_exception)
    assert issubclass(popart.popart_internal_exception, popart.popart_exception)
    assert issubclass(popart.popart_runtime_error, popart.popart_exception)
    assert issubclass(popart.poplar_runtime_error, popart.poplar_exception)
    assert popart.versionString().startswith("3.")


def test_internal_ir_op_classes_of_random_collective_and_shape_ops():
    """``popart._internal.ir``'s op bindings are generated per PopART op header, in
    ``_ir.op.collectives`` for ``op/collectives/``: ``isinstance`` checks work on them."""
    from popxl_flash import emulator
    emulator.install()
    import numpy as np
    import popart._internal.ir as _ir
    import popxl
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        seed = popxl.constant(np.array([1, 2], np.uint32))
        x = popxl.ops.random_uniform(seed, (4,))
        a, b = popxl.ops.split(x, 2)
        y = popxl.ops.gelu(popxl.ops.gather(x, popxl.constant(np.array([0], np.int32))))
        popxl.ops.collectives.replicated_all_reduce_(a)
        popxl.ops.collectives.replicated_reduce_scatter(b)
    ops = list(ir.main_graph._pb_graph.getOps())
    for cls in (_ir.op.RandomUniformOp, _ir.op.SplitOp, _ir.op.GatherOp, _ir.op.GeluOp,
                _ir.op.collectives.ReplicatedAllReduceInplaceOp,
                _ir.op.collectives.ReplicatedAllReduceOp,
                _ir.op.collectives.ReplicatedReduceScatterOp,
                _ir.op.collectives.CollectivesBaseOp):
        assert any(isinstance(o, cls) for o in ops), cls
    assert y.shape == (1,)
