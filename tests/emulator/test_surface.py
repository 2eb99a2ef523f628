"""The emulator's ``popxl`` module holds only PopXL's names.

Names PopXL 3.4 has (graphcore/popart sdk-release-3.4 ``python/popxl/__init__.py.in`` and
``python_files/ops/__init__.py``) are present; the ones the emulator does not implement raise
``NotImplementedError`` when used. Emulator-only helpers are absent, so a script written against
the emulator cannot depend on something the SDK lacks.
"""
import pytest

import popxl_flash
from popxl_flash import popxl

if popxl_flash.BACKEND != "emulator":
    pytest.skip("checks the emulator's module surface", allow_module_level=True)

from popxl_flash import emulator  # noqa: E402

#: Names the emulator's helpers use that PopXL does not have at these places.
NOT_IN_POPXL = {
    popxl: ("count_ops", "RunProfile", "PopartError", "Variable", "Constant", "stub",
            "namespace", "unsupported", "registry", "interpreter", "plan", "profile"),
    popxl.ops: ("RepeatSiteInfo", "ConditionalSiteInfo", "control", "elementwise", "fused",
                "misc", "shape", "dynamic", "io", "stub", "namespace", "minimum", "less",
                "fill", "reduce_sum"),
}

#: PopXL names the emulator does not implement: present, raising when used.
STUBS = {
    popxl: ("TileSet",),
    popxl.ops: ("conv_pow2scaled", "conv_transpose_pow2scaled", "PadType", "topk", "cumsum",
                "remote_code_load"),
    popxl.ops.collectives: ("all_reduce", "CommGroup"),
    popxl.ops.var_updates: ("lamb_updater", "sparse_accumulate_"),
}


@pytest.mark.parametrize("where,name", [(m, n) for m, ns in NOT_IN_POPXL.items() for n in ns])
def test_emulator_only_names_are_absent(where, name):
    with pytest.raises(AttributeError):
        getattr(where, name)


@pytest.mark.parametrize("where,name", [(m, n) for m, ns in STUBS.items() for n in ns])
def test_unimplemented_popxl_names_raise_when_used(where, name):
    with pytest.raises(NotImplementedError):
        getattr(where, name)()


def test_unimplemented_submodules_raise_on_use():
    """``popxl.tensorlocation`` exists in PopXL (bound by its imports); the emulator
    implements nothing of it."""
    with pytest.raises(NotImplementedError):
        popxl.tensorlocation.TensorLocation()


def test_implemented_submodules_are_popxl_modules():
    """``popxl.utils.to_numpy`` and ``popxl.context.get_current_context`` work."""
    assert popxl.utils.to_numpy([1.0]).dtype.name == "float32"
    assert popxl.context.get_current_context() is popxl.context.get_current_context()


def test_variable_and_constant_live_in_popxl_tensor():
    """PopXL's docs spell them ``popxl.tensor.Variable`` (docs/popxl/api/tensors.rst)."""
    assert issubclass(popxl.tensor.Variable, popxl.Tensor)
    assert issubclass(popxl.tensor.Constant, popxl.Tensor)


def test_extras_live_in_the_emulator_package():
    assert emulator.popxl is popxl
    assert callable(emulator.count_ops) and issubclass(emulator.PopartError, Exception)
    assert emulator.RunProfile().ops_executed == 0


def test_transforms_slot_has_popxl_names():
    for name in ("autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType",
                 "merge_exchange", "io_tile_exchange", "decompose_sum"):
        assert hasattr(popxl.transforms, name)
