"""pytest plugin: run popxl-addons' own tests against the emulator.

Usage (from this repository's root, with a popxl-addons sdk-release-3.4 checkout)::

    POPXL_ADDONS_PATH=<checkout> PYTHONPATH=tests/addons python -m pytest -p emulator_plugin \\
        -c <checkout>/pytest.ini --rootdir <checkout> <checkout>/tests/unit

Loading the plugin puts the checkout on ``sys.path`` and calls
``popxl_flash.emulator.install(standins=True)`` (the emulator as ``popxl``, the packaged
``mpi4py``/``popdist``/``cppimport`` stand-ins). The tests
that need what the emulator does not model are skipped with the reason listed in
:data:`OUT_OF_SCOPE` (mirrored in ``popxl_flash/emulator/README.md``); all others run.
"""
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATH = os.environ.get("POPXL_ADDONS_PATH", "").strip()
if not _PATH:
    raise pytest.UsageError("emulator_plugin: set POPXL_ADDONS_PATH to a popxl-addons checkout")
sys.path[:0] = [_PATH, _HERE]
from popxl_flash import emulator  # noqa: E402

emulator.install(standins=True)

#: {test id fragment (file or file::test): why the emulator cannot run it}. Mirrored in
#: ``popxl_flash/emulator/README.md`` ("popxl-addons' own tests").
_CUSTOM = "custom C++ op (cppimport-compiled PopART op, created through `_get_op_settings`)"
OUT_OF_SCOPE = {
    **{f"unit/test_route_tensor.py::test_route_tensor_into_graph{case}":
       "IR surgery (`route_tensor_into_graph`: `_ir.view.Region`, `CallOp.hasInputTensor`, "
       "adding inputs to existing ops)"
       for case in ("", "_many_calls", "_multiple_moves", "_nested", "_many_paths", "_loop")},
    "unit/test_autodiff.py::test_autodiff_patterns_executed":
        "PopART's inplace pattern rewriting ops (counts `MulRhsInplaceOp`); the emulator's "
        "pattern passes are no-ops",
    "unit/test_available_memory_proportion.py": "multi-IPU (`Tensor.copy_to_ipu`)",
    "unit/test_graph_cache.py::test_graph_cache": "multi-IPU (`popxl.ipu(1)`)",
    "unit/test_adam.py": "float16 first-order state: the update differs from PyTorch's float32 "
                         "AdamW by about 1e-3 of the step, the test's tolerance is 4 decimals",
    "integration/layers/test_conv_layer.py": "op the emulator does not implement (`conv`)",
    "integration/layers/test_linear_fp8.py": "float8 (`pow2scale_cast_to_fp8`)",
    "integration/ops/test_fp8_scale.py": "float8 (`popxl.fp8_utils`)",
    "integration/test_mnist_fp8.py": "float8; needs torchvision/tqdm",
    "integration/ops/test_rotary_embed.py": "needs transformers' `fixed_pos_embedding` (before "
                                            "4.27); the op itself is modelled "
                                            "(tests/emulator/test_addons_ops.py)",
    "integration/layers/test_linear_gq.py": _CUSTOM + " and uint16 tensors",
    "integration/ops/test_group_quantize_decompress.py": _CUSTOM + " (and two of its tests "
                                                         "call a helper without its `dim`)",
    "integration/ops/test_cross_entropy_sharded_wr_loss.py": "multi-IPU (`popxl.ipu(1)`)",
    "integration/ops/test_linear_layout.py": _CUSTOM,
    "integration/ops/test_sparse_matmul.py": _CUSTOM,
    "integration/test_memmap.py": "`np.memmap` variables shared with the host and remote "
                                  "variables",
    "integration/test_pipelining.py": "multi-IPU pipelining (op-created hooks, IPU copies)",
    **{f"integration/test_repeat_graph.py::{case}": "IR surgery (`Op.cloneIntoGraph`)"
       for case in ("test_basic[5]", "test_variables", "test_topological_constraints")},
}


def pytest_ignore_collect(collection_path, config):
    """Modules that fail at import for a reason in OUT_OF_SCOPE are not collected."""
    path = str(collection_path)
    if os.environ.get("POPXL_ADDONS_RUN_ALL"):
        return None
    if any(path.endswith(key) for key in OUT_OF_SCOPE if key.endswith(".py")) and \
            any(k in path for k in ("fp8", "rotary_embed")):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("POPXL_ADDONS_RUN_ALL"):  # run the out-of-scope tests too
        return
    for item in items:
        for key, reason in OUT_OF_SCOPE.items():
            if _matches(item.nodeid, key):
                item.add_marker(pytest.mark.skip(reason=f"out of the emulator's scope: {reason}"))
                break


def _matches(nodeid, key):
    """``key`` names a file (``dir/test_x.py``, or a prefix such as ``ops/test_replicated_``)
    or one test (``dir/test_x.py::name`` or ``::name[param]``)."""
    path, _, name = nodeid.partition("::")
    key_path, _, key_name = key.partition("::")
    if key_path not in path:
        return False
    return not key_name or name == key_name or (
        "[" not in key_name and name.startswith(key_name + "["))
