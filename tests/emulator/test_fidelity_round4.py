"""Differences from PopXL 3.4 found by reading PopART's source (graphcore/popart
sdk-release-3.4), each settled as the SDK behaves. Written against ``popxl_flash.popxl`` so the
same tests run on a Graphcore machine (``IR_ERRORS`` is ``popart_exception`` there)."""
import numpy as np
import pytest

from popxl_flash import popxl

from conftest import IR_ERRORS, load, run

ops = popxl.ops
f32 = popxl.float32


# -- npOut: a zero dimension both operands have is not broadcastable ------------------------------
@pytest.mark.parametrize("s0,s1", [((2, 0), (2, 0)), ((0,), (0,)), ((2, 0), (1, 0)),
                                   ((3, 0, 2), (0, 1))])
def test_binary_op_with_a_zero_dimension_in_the_overlap_is_refused(s0, s1):
    """``npOut`` (willow/src/tensorinfo.cpp): ``isBroadcastableDims`` needs both dims > 0 in
    the trailing ``min(rank)`` dimensions, so the op's setup raises when it is created."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros(s0, np.float32))
        b = popxl.variable(np.zeros(s1, np.float32))
        with pytest.raises(IR_ERRORS, match="np broadcasting failed"):
            ops.add(a, b)


@pytest.mark.parametrize("s0,s1,out", [((0, 3), (3,), (0, 3)), ((0, 3), (), (0, 3)),
                                       ((0, 2, 3), (2, 3), (0, 2, 3))])
def test_binary_op_with_a_zero_dimension_outside_the_overlap_runs(s0, s1, out):
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros(s0, np.float32))
        y = a * popxl.constant(np.ones(s1, np.float32))
    assert run(ir, None, y).shape == out


@pytest.mark.parametrize("s0,s1", [((0, 2, 3), (3, 4)), ((2, 0, 2, 3), (3, 4)),
                                   ((0, 2, 3), (0, 3, 4)), ((2, 3), (0, 3, 4))])
def test_matmul_with_a_zero_group_dimension_in_the_overlap_is_refused(s0, s1):
    """``MatMulOp::npMatMulOut`` (willow/src/op/matmul.cpp) gives a rank-2 operand a group
    dimension of 1, then takes ``npOut`` of the group dimensions: 0 against 1 or 0 raises."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros(s0, np.float32))
        b = popxl.variable(np.zeros(s1, np.float32))
        with pytest.raises(IR_ERRORS, match="np broadcasting failed"):
            ops.matmul(a, b)


def test_matmul_with_a_zero_group_dimension_outside_the_overlap_runs():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros((0, 2, 2, 3), np.float32))
        y = a @ popxl.constant(np.ones((2, 3, 4), np.float32))
    assert run(ir, None, y).shape == (0, 2, 2, 4)


# -- dynamic_slice: the lowering casts the index to unsigned --------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dynamic_slice_takes_a_float_index_truncated(dtype):
    """``DynamicSliceOpx`` / ``DynamicUpdateOpx`` (popx/op/dynamic/dynamicslicex.cpp,
    dynamicupdatex.cpp) ``popops::cast`` the index to ``UNSIGNED_INT``; setup checks no type."""
    data = np.arange(12, dtype=np.float32).reshape(6, 2)
    ir = popxl.Ir()
    feeds = {}
    with ir.main_graph:
        idx = load(feeds, np.array([2.75], dtype))
        t = popxl.variable(data)
        s = ops.dynamic_slice(t, idx, [0], [3], False)
        u = ops.dynamic_update(t, idx, popxl.constant(-np.ones((3, 2), np.float32)), [0], [3],
                               False)
    out_s, out_u = run(ir, feeds, [s, u])
    np.testing.assert_array_equal(out_s, data[2:5])
    expected = data.copy()
    expected[2:5] = -1
    np.testing.assert_array_equal(out_u, expected)


# -- call: inputs_dict keyed by a tensor of the graph that is not one of its inputs ---------------
def test_inputs_dict_key_that_is_not_a_graph_input_raises_popart_exception():
    """PopXL's ``_validate_inputs`` (ops/call.py) asks ``graph._pb_graph.getInputIndex`` for
    the key's index; ``Graph::getInputIndex`` (willow/src/graph.cpp) throws ``popart::error``
    for a tensor of the graph that is not an input."""
    ir = popxl.Ir()
    g = ir.create_empty_graph("g")
    with g:
        x = popxl.graph_input((2,), f32, "x")
        inner = x + 1.0
        popxl.graph_output(inner)
    with ir.main_graph:
        v = popxl.variable(np.ones(2, np.float32))
        with pytest.raises(IR_ERRORS, match="Could not find input tensor"):
            ops.call(g, v, inputs_dict={inner: v})


# -- in_sequence: a mode that is not True/False/"pass" fails when an op is created ---------------
def test_in_sequence_with_another_mode_raises_only_when_an_op_is_created():
    """PopXL's ``in_sequence`` sets any mode; ``Context._add_in_sequence_topocons``
    (context.py) raises ValueError for one it does not understand when an op is created."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(2, np.float32))
        with popxl.in_sequence(1) as mode:
            assert mode == 1
            with pytest.raises(ValueError, match="mode not understood: 1"):
                x + 1.0
        with popxl.in_sequence(True):
            x * 2.0


# -- variables: a replica grouping that does not tile the replicas -------------------------------
@pytest.mark.parametrize("replicas,group_size", [(4, 3), (6, 4), (8, 3)])
def test_variable_grouping_that_does_not_tile_the_replicas_is_refused_when_created(replicas,
                                                                                  group_size):
    """``Tensors::addVarInitCore`` (willow/src/tensors.cpp) builds the C++
    ``ReplicaGrouping(replicas, stride, group_size)`` through
    ``VariableSettings::shapeOnReplica``; its constructor (willow/src/replicagrouping.cpp)
    checks that ``stride * group_size`` divides the replicas. (Strides above 1 that do not
    tile already fail in PopXL's Python grouping.)"""
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph:
        rg = ir.replica_grouping(stride=1, group_size=group_size)
        with pytest.raises(IR_ERRORS, match="divisible by the product of the stride"):
            popxl.variable(np.ones((rg.num_groups, 2), np.float32), replica_grouping=rg)


# -- popxl.constant([]): to_numpy infers the type with np.obj2sctype ------------------------------
def test_constant_of_an_empty_list_is_refused():
    """PopXL's ``to_numpy`` (python_files/utils.py) infers the type of data given without a
    dtype with NumPy 1.x's ``np.obj2sctype``: ``np.dtype([])`` is an empty structured dtype, so
    the array is ``np.void`` and ``dtype.as_dtype`` finds no PopXL dtype (``ValueError``).
    Nested or tuple empties read as float64 data and become float32."""
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(ValueError, match="popxl.dtype"):
            popxl.constant([])
        with pytest.raises(ValueError, match="popxl.dtype"):
            popxl.variable([])
        assert popxl.constant([[]]).shape == (1, 0) and popxl.constant(()).dtype == f32
        assert popxl.constant([], popxl.int32).shape == (0,)  # an explicit dtype is fine
