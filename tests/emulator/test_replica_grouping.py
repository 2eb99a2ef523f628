"""``popxl.ReplicaGrouping``, ``Ir.replica_grouping(_from_assignments)`` and
``variable(replica_grouping=...)`` with PopXL 3.4 semantics (graphcore/popart sdk-release-3.4
``python/popxl/python_files/replica_grouping.py``, ``ir.py``, ``tensor.py``; the host shape rule
from ``willow/src/variablesettings.cpp``). Expected assignments are the examples in PopXL's
docstrings."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import popxl_flash
from popxl_flash import popxl

if popxl_flash.BACKEND != "emulator":
    pytest.skip("checks the emulator's implementation", allow_module_level=True)

from popxl_flash.emulator import PopartError  # noqa: E402


@pytest.mark.parametrize("stride,size,expected", [
    (1, 8, [0] * 8), (1, 1, list(range(8))), (1, 2, [0, 0, 1, 1, 2, 2, 3, 3]),
    (2, 2, [0, 1, 0, 1, 2, 3, 2, 3]), (1, 4, [0, 0, 0, 0, 1, 1, 1, 1]),
    (2, 4, [0, 1, 0, 1, 0, 1, 0, 1]), (4, 2, [0, 1, 2, 3, 0, 1, 2, 3])])
def test_docstring_assignments(stride, size, expected):
    rg = popxl.Ir(replication=8).replica_grouping(stride, size)
    assert rg.assignment == expected
    assert (rg.stride, rg.group_size, rg.num_groups, rg.is_const) == (
        stride if size > 1 else 1, size, 8 // size, True)


def test_default_grouping_is_all_replicas():
    ir = popxl.Ir(replication=4)
    rg = ir.replica_grouping()
    assert (rg.stride, rg.group_size, rg.num_groups) == (1, 4, 1)
    assert ir.replica_grouping(stride=2).group_size == 2  # replication // stride
    assert repr(rg) == "ReplicaGrouping(num_replicas=4, stride=1, group_size=4, num_groups=1)"


@pytest.mark.parametrize("stride,size", [(0, 2), (3, None), (8, 1), (1, 0), (1, 5), (2, 4)])
def test_invalid_parameters_raise_value_error(stride, size):
    """(2, 4) passes PopXL's checks and fails filling the groups (extended-slice ValueError)."""
    with pytest.raises(ValueError):
        popxl.Ir(replication=4).replica_grouping(stride, size)


def test_zero_stride_without_group_size_divides_by_zero():
    """PopXL computes ``replication_factor // stride`` before validating."""
    with pytest.raises(ZeroDivisionError):
        popxl.Ir(replication=4).replica_grouping(0)


def test_cannot_construct_directly():
    with pytest.raises(RuntimeError):
        popxl.ReplicaGrouping()


def test_non_constant_stride_grouping():
    rg = popxl.Ir(replication=8).replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    assert not rg.is_const and rg.num_groups == 2 and rg.group_size == 4
    assert rg.const_rg.assignment == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rg.to_device_map == [0, 1, 0, 1] and rg.to_host_map == [0, 1]
    with pytest.raises(NotImplementedError):
        rg.stride
    assert repr(rg) == "ReplicaGrouping(assignment=[0, 0, 1, 1, 0, 0, 1, 1])"


@pytest.mark.parametrize("assignment", [[0, 0, 0, 1], [0, 2, 0, 2], [1, 1, 0, 0], [0, 1]])
def test_invalid_assignments_raise_value_error(assignment):
    with pytest.raises(ValueError):
        popxl.Ir(replication=4).replica_grouping_from_assignments(assignment)


@pytest.mark.parametrize("before,after", [
    ([0, 0, 0, 0], [0, 1, 2, 3]), ([0, 1, 0, 1], [0, 0, 1, 1]), ([0, 0, 1, 1], [0, 1, 0, 1]),
    ([0, 1, 2, 3], [0, 0, 0, 0]), ([0, 1, 0, 1, 2, 3, 2, 3], [0, 0, 1, 1, 0, 0, 1, 1])])
def test_transpose(before, after):
    ir = popxl.Ir(replication=len(before))
    rg = (ir.replica_grouping(1, 1) if len(set(before)) == len(before)
          else ir.replica_grouping_from_assignments(before))
    assert rg.assignment == before and rg.transpose().assignment == after


def test_singleton_assignment_is_refused_as_in_popxl():
    """PopXL finds no stride in all-singleton groups and fails taking ``min`` of none."""
    with pytest.raises(ValueError):
        popxl.Ir(replication=4).replica_grouping_from_assignments([0, 1, 2, 3])


def test_equality_needs_a_replica_grouping():
    ir = popxl.Ir(replication=2)
    assert ir.replica_grouping(1, 2) == ir.replica_grouping_from_assignments([0, 0])
    assert not ir.replica_grouping(1, 2) == ir.replica_grouping(1, 1)
    with pytest.raises(TypeError):
        ir.replica_grouping() == 1  # noqa: B015


@given(st.sampled_from([1, 2, 4, 6, 8, 12]), st.data())
def test_constant_groupings_partition_the_replicas(n, data):
    """Any group size dividing n with a stride dividing n // size: equal groups whose members
    are ``stride`` apart, and the assignment round-trips."""
    ir = popxl.Ir(replication=n)
    size = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    stride = data.draw(st.sampled_from([s for s in range(1, n // size + 1)
                                        if (n // size) % s == 0]))
    rg = ir.replica_grouping(stride, size)
    counts = np.bincount(rg.assignment)
    assert len(counts) == rg.num_groups == n // size and set(counts.tolist()) == {size}
    for k in range(rg.num_groups):
        members = [r for r, g in enumerate(rg.assignment) if g == k]
        assert set(np.diff(members).tolist()) <= {rg.stride}
    if size > 1:  # all-singleton assignments are refused (see above)
        assert ir.replica_grouping_from_assignments(rg.assignment) == rg


def test_variable_default_grouping_and_host_shape():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        v = popxl.variable(np.zeros((3, 4), np.float32))
        g = popxl.variable(np.zeros((2, 3, 4), np.float32),
                           replica_grouping=ir.replica_grouping(group_size=1),
                           retrieval_mode="all_replicas")
    assert v.replica_grouping.num_groups == 1 and v.retrieval_mode == "one_per_group"
    assert v.shape == v.shape_on_host == v.shape_on_replica == (3, 4)
    assert g.shape == (3, 4) and g.shape_on_host == (2, 3, 4)
    assert g.retrieval_mode == "all_replicas"


def test_variable_group_dimension_must_match():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        with pytest.raises(PopartError):
            popxl.variable(np.zeros((3, 4), np.float32),
                           replica_grouping=ir.replica_grouping(group_size=1))
        with pytest.raises(ValueError):
            popxl.variable(np.zeros(3, np.float32), retrieval_mode="some")
