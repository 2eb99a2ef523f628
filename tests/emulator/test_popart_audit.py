"""Ops checked against PopART's own code (sdk-release-3.4), not the reference page alone.

Each test cites the source that settles it: the popxl wrapper (``python/popxl/python_files/
ops/*.py``), the op's ``setup()`` (``willow/src/op/*.cpp``, what raises when the op is created)
and its lowering (``willow/src/popx/op/*``, what raises when ``popxl.Session`` compiles).
"""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, IR_ERRORS, run, run_fn, store
from popxl_flash import popxl

ops = popxl.ops
A = np.random.default_rng(11).standard_normal((2, 3, 4)).astype(np.float32)


def _built(build):
    """Build ``build()`` (returning a tensor) in a main graph and store it. Build errors
    propagate (these ops must build); returns the Ir for the caller to compile."""
    ir = popxl.Ir()
    with ir.main_graph:
        store(build())
    return ir


def _fails_at_session(build):
    ir = _built(build)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


# --- softmax: ops/softmax.py handle_negative_axis; op/softmax.cpp getAxis; popx/op/softmaxx.cpp
# and elementwisex.cpp coerceTo2D -------------------------------------------------------------


def _softmax_2d(x, axis):
    flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
    e = np.exp(flat - flat.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).reshape(x.shape)


def test_softmax_axis_equal_to_rank_normalises_single_elements():
    """coerceTo2D at axis == rank gives [nelms, 1]: every output is 1."""
    np.testing.assert_array_equal(run_fn(lambda t: ops.softmax(t, 3), A), np.ones_like(A))


def test_softmax_negative_axis_is_normalised_twice():
    """popxl adds the rank once (handle_negative_axis) and SoftmaxOp::getAxis again: on rank 3,
    axis -4 -> -1 -> 2."""
    r = run_fn(lambda t: ops.softmax(t, -4), A)
    np.testing.assert_allclose(r, _softmax_2d(A, 2), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("axis", [4, -7])
def test_softmax_axis_out_of_range_fails_at_session_not_build(axis):
    """SoftmaxOp::setup accepts any axis; coerceTo2D outside [0, rank] is undefined."""
    _fails_at_session(lambda: ops.softmax(popxl.constant(A), axis))


# --- matmul: ops/matmul.py; op/matmul.cpp MatMulOp::setup ----------------------------------


def test_matmul_integer_output_type_builds_then_fails_at_session():
    """setup takes `output_type` as given (int32 output info); Poplar's matmul cannot."""
    def build():
        a = popxl.constant(np.ones((2, 3), np.float32))
        y = ops.matmul(a, popxl.constant(np.ones((3, 2), np.float32)), output_type=popxl.int32)
        assert y.dtype == popxl.int32
        return y
    _fails_at_session(build)


def test_matmul_output_type_must_be_a_popxl_dtype():
    """ops/matmul.py reads `output_type._pb_dtype`."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones((2, 2), np.float32))
        with pytest.raises(AttributeError):
            ops.matmul(a, a, output_type="float32")


# --- reductions: ops/sum.py; op/reduce.cpp ReduceOp::setup + util.cpp validateReduceAxes ---


def test_reduce_duplicate_axes_pass_setup_and_fail_at_session():
    """validateReduceAxes checks only the range; the output drops a repeated axis once."""
    def build():
        y = ops.sum(popxl.constant(A), axis=[1, 1])
        assert y.shape == (2, 4)
        return y
    _fails_at_session(build)


def test_reduce_keepdims_goes_to_an_int64_parameter():
    """keepdims is passed to the C++ constructor's int64_t through pybind11: a str is a
    TypeError."""
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(TypeError):
            ops.sum(popxl.constant(A), axis=0, keepdims="yes")


# --- transpose: ops/transpose.py _handle_permutation; op/transpose.cpp setup ------------------


def test_transpose_empty_permutation_reverses_the_axes():
    """An empty permutation passes popxl's checks and setup's setDefaultPerm reverses."""
    np.testing.assert_array_equal(run_fn(lambda t: ops.transpose(t, []), A), A.transpose())


def test_transpose_repeated_entry_passes_setup_and_fails_at_session():
    def build():
        y = ops.transpose(popxl.constant(A), (0, 0, 2))
        assert y.shape == (2, 2, 4)  # setup reads in_shape[i] for each entry
        return y
    _fails_at_session(build)


# --- subsample: ops/subsample.py `strides += [1] * k` ------------------------------------------


def test_subsample_short_tuple_strides_is_type_error():
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(TypeError):
            ops.subsample(popxl.constant(A), (2,))
        assert ops.subsample(popxl.constant(A), [2]).shape == (1, 3, 4)


# --- gather: op/gather.cpp setup (no index dtype check); popx/op/gatherx.cpp reinterprets ----


def test_gather_float_indices_build_then_fail_at_session():
    def build():
        return ops.gather(popxl.constant(A), popxl.constant(np.array([0.0, 1.0], np.float32)))
    _fails_at_session(build)


# --- scaled_add: op/scaledadd.cpp setup (output = X's info); popx/op/scaledaddx.cpp ----------


def test_scaled_add_shape_mismatch_builds_then_fails_at_session():
    def build():
        x = popxl.constant(np.ones((2, 3), np.float32))
        return ops.scaled_add(x, popxl.constant(np.ones((3,), np.float32)), 2.0, 1.0)
    _fails_at_session(build)


# --- Tensor attributes PopXL has (tensor.py) ---------------------------------------------------


@pytest.mark.parametrize("use", [lambda t: t.location_info, lambda t: t.in_sync_with_ipu])
def test_unimplemented_tensor_attributes_raise(use):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)
        with pytest.raises(NotImplementedError):
            use(t)


def test_dynamic_update_rank_one_less_runs_like_popart():
    """DynamicUpdateOpx prepends a 1 to a lower-rank update (popx/op/dynamic/dynamicupdatex.cpp);
    dynamic_update_ in place likewise."""
    ir = popxl.Ir()
    with ir.main_graph:
        t = ops.init((3, 4), popxl.float32)
        idx = popxl.constant(np.array([2], np.uint32))
        u = ops.dynamic_update_(t, idx, popxl.constant(np.arange(4, dtype=np.float32)), [0], [1],
                                False)
        y = u + 0.0
    expected = np.zeros((3, 4), np.float32)
    expected[2] = np.arange(4)
    np.testing.assert_array_equal(run(ir, None, y), expected)


# --- increment_mod: op/incrementmod.cpp setup checks nothing ----------------------------------


def test_increment_mod_zero_modulus_builds_then_fails_at_session():
    """1.5 -> 1 and 0.5 -> 0 in int32: a zero modulus, unspecified on device."""
    _fails_at_session(lambda: ops.increment_mod(popxl.constant(np.int32(3)), 1.5, 0.5))


# --- greater/equal: BinaryComparisonOp::setup (op/elementwise.cpp) checks shapes only --------


@pytest.mark.parametrize("op", [ops.greater, ops.equal])
def test_comparison_dtype_mismatch_builds_then_fails_at_session(op):
    def build():
        a = popxl.constant(np.ones(3, np.float32))
        y = op(a, popxl.constant(np.ones(3, np.int32)))
        assert y.dtype == popxl.bool
        return y
    _fails_at_session(build)


# --- split: ops/split.py (handle_negative_axis, Python shape indexing); op/split.cpp setup ----


def test_split_axis_errors_come_from_where_popxl_raises_them():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)  # rank 3
        with pytest.raises(IndexError):  # t.shape[3] in the wrapper
            ops.split(t, 2, axis=3)
        with pytest.raises(IR_ERRORS):  # -5 -> -2: the shape index wraps, setup refuses
            ops.split(t, 3, axis=-5)


def test_split_zero_size_part_builds_then_fails_at_session():
    """SplitOp::setup only checks that the sizes sum to the axis length."""
    def build():
        parts = ops.split(popxl.constant(A), [0, 3], axis=1)
        assert [p.shape for p in parts] == [(2, 0, 4), (2, 3, 4)]
        return parts[1]
    _fails_at_session(build)


def test_rename_is_identity():
    """ops/identity.py: `rename = identity` (3.3+)."""
    assert ops.rename is ops.identity


# --- slice: op/slice.cpp createOutInfo (ceil(len / |step|)) vs growAliasModel (|step| == 1) ----


def test_slice_step_two_builds_with_its_shape_then_fails_at_session():
    def build():
        y = ops.slice(popxl.constant(np.arange(7, dtype=np.float32)), 0, 7, 2)
        assert y.shape == (4,)
        return y
    _fails_at_session(build)


def test_reshape_shape_must_support_count():
    """ops/reshape.py calls `shape.count(0)`: an ndarray shape is an AttributeError, an int a
    TypeError (not iterable)."""
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)
        with pytest.raises(AttributeError):
            ops.reshape(t, np.array([6, 4]))
        with pytest.raises(TypeError):
            ops.reshape(t, 24)
