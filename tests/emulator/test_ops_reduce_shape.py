"""Reductions and shape ops (reference §5 "Reductions", "Casting / shape", §11.6, §11.14)."""
import numpy as np
import pytest

import popxl_flash
from conftest import IR_ERRORS, run, run_fn
from popxl_flash import popxl

ops = popxl.ops

A = np.random.default_rng(7).standard_normal((2, 3, 4)).astype(np.float32)
AI = np.arange(24, dtype=np.int32).reshape(2, 3, 4) - 10

AXES = [None, 0, 1, 2, -1, -3, [0, 2], (1, -1), [0, 1, 2], []]
def _logsumexp64(a, axis=None, keepdims=False):
    return np.log(np.sum(np.exp(a.astype(np.float64)), axis=axis, keepdims=keepdims))


REDUCTIONS = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean,
              "logsumexp": _logsumexp64}


def _np_axis(axis):
    if axis is None:
        return None
    if isinstance(axis, int):
        return axis
    return tuple(axis)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
def test_reductions_axis_and_keepdims(axis, keepdims):
    names = list(REDUCTIONS)
    outs = run_fn(lambda t: [getattr(ops, n)(t, axis=axis, keepdims=keepdims) for n in names], A)
    for name, got in zip(names, outs):
        want = REDUCTIONS[name](A, axis=_np_axis(axis), keepdims=keepdims)
        assert got.shape == want.shape, name
        assert got.dtype == np.float32, name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_reduce_default_axis_is_all_and_empty_axis_reduces_nothing():
    s_all, s_none = run_fn(lambda t: [ops.sum(t), ops.sum(t, axis=[])], A)
    assert s_all.shape == ()
    np.testing.assert_allclose(s_all, A.sum(), rtol=1e-5)
    assert s_none.shape == A.shape
    np.testing.assert_array_equal(s_none, A)


def test_integer_reductions_keep_dtype():
    s, mx, mn = run_fn(lambda t: [ops.sum(t, axis=1), ops.max(t, axis=-1), ops.min(t)], AI)
    for got, want in zip([s, mx, mn], [AI.sum(axis=1), AI.max(axis=-1), AI.min()]):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


def test_max_min_are_reductions_not_elementwise():
    """§11.6: ``ops.max(t)`` reduces; it is not numpy's elementwise maximum."""
    a = np.array([[1.0, 5.0], [7.0, 2.0]], np.float32)
    r = run_fn(lambda t: ops.max(t, axis=0), a)
    np.testing.assert_array_equal(r, np.array([7.0, 5.0], np.float32))


def test_logsumexp_is_stable_and_keeps_the_input_dtype():
    """PopXL 3.4 ``ops.logsumexp`` lowers as ``log(sum(exp(x - max))) + max``
    (``ReduceLogSumExpOpx``): finite for scores far beyond exp's range, in the input's dtype."""
    big = np.array([[1000.0, 999.0, -1e30], [-3.0e38, -3.0e38, -3.0e38]], np.float32)
    got = run_fn(lambda t: ops.logsumexp(t, axis=-1), big)
    np.testing.assert_allclose(got, [1000.0 + np.log1p(np.exp(-1.0)), -3.0e38 + 0.0],
                               rtol=1e-6)
    half = A.astype(np.float16)
    got = run_fn(lambda t: ops.logsumexp(t, axis=1, keepdims=True), half)
    assert got.dtype == np.float16 and got.shape == (2, 1, 4)
    # float16 maps (exp, log) round to 2^-11 relative; the sum of 3 terms adds no more.
    np.testing.assert_allclose(got, _logsumexp64(half, axis=1, keepdims=True), rtol=3e-3)


def test_logsumexp_of_zero_elements_is_refused():
    """As max: the lowering's reduce_max over nothing has no specified result."""
    with pytest.raises(IR_ERRORS):
        run_fn(lambda t: ops.logsumexp(t, axis=1), np.zeros((2, 0), np.float32))


# --- reshape ------------------------------------------------------------------------------------


def test_reshape_with_one_minus_one():
    outs = run_fn(lambda t: [ops.reshape(t, (4, -1)), ops.reshape(t, [24]), ops.reshape(t, (-1,)),
                             ops.flatten(t)], A)
    for got, want in zip(outs, [A.reshape(4, -1), A.reshape(24), A.reshape(-1), A.reshape(-1)]):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", [(0, 24), (-1, -1, 6), (-2, 12), (4, 0, 6)])
def test_reshape_bad_entries_are_value_error(shape):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)
        with pytest.raises(ValueError):
            ops.reshape(t, shape)


def test_reshape_element_count_mismatch_is_ir_error():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)
        with pytest.raises(IR_ERRORS):
            ops.reshape(t, (5, 5))


# --- transpose / squeeze / concat -----------------------------------------------------------------


def test_transpose_default_and_permutation():
    d, p = run_fn(lambda t: [ops.transpose(t), ops.transpose(t, (1, 0, 2))], A)
    np.testing.assert_array_equal(d, A.transpose())
    np.testing.assert_array_equal(p, A.transpose(1, 0, 2))


def test_transpose_entry_out_of_range_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)
        with pytest.raises(ValueError):
            ops.transpose(t, (0, 3, 1))


def test_squeeze():
    a = np.arange(6, dtype=np.float32).reshape(1, 3, 1, 2, 1)
    outs = run_fn(lambda t: [ops.squeeze(t), ops.squeeze(t, [0]), ops.squeeze(t, [-1, 2])], a)
    for got, want in zip(outs, [a.reshape(3, 2), a.reshape(3, 1, 2, 1), a.reshape(1, 3, 2)]):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axes", [[1], [0, 0], [-2]])
def test_squeeze_bad_axes_are_value_error(axes):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(np.zeros((1, 3, 1), np.float32))
        with pytest.raises(ValueError):
            ops.squeeze(t, axes)


def test_concat():
    b = np.ones((2, 3, 1), np.float32)
    c0, c2, cn = run_fn(lambda x, y: [ops.concat([x, x], 0), ops.concat([x, y], 2),
                                      ops.concat([x, y, x], axis=-1)], A, b)
    np.testing.assert_array_equal(c0, np.concatenate([A, A], 0))
    np.testing.assert_array_equal(c2, np.concatenate([A, b], 2))
    np.testing.assert_array_equal(cn, np.concatenate([A, b, A], -1))


def test_concat_errors():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(A)
        with pytest.raises(TypeError):
            ops.concat([x, popxl.constant(A.astype(np.float16))], 0)
        with pytest.raises(Exception):
            ops.concat([x, popxl.constant(np.ones((2, 2, 4), np.float32))], 0)


# --- slice / softmax ----------------------------------------------------------------------------


def test_slice_onnx_semantics():
    outs = run_fn(
        lambda t: [
            ops.slice(t, start=1, stop=3, axis=1),
            ops.slice(t, start=[0, 1], stop=[1, 3], axis=[0, 2]),
            ops.slice(t, start=[1], stop=[2]),  # axis defaults to 0..k-1
            ops.slice(t, start=-2, axis=2),  # negative bound normalised, stop defaults to the end
            ops.slice(t, start=1, stop=100, axis=1),  # out-of-range bound clamps
            ops.slice(t, start=3, stop=0, step=-1, axis=2),
        ],
        A,
    )
    want = [A[:, 1:3], A[0:1, :, 1:3], A[1:2], A[:, :, -2:], A[:, 1:], A[:, :, 3:0:-1]]
    for got, w in zip(outs, want):
        assert got.shape == w.shape
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax(axis):
    """ONNX-11 Softmax: SoftmaxComputex coerces the input to 2-D at ``axis``
    (willow/src/popx/op/softmaxx.cpp, EwuComputex::coerceTo2D in elementwisex.cpp), so the
    normalisation runs over all axes from ``axis`` on, flattened."""
    r = run_fn(lambda t: ops.softmax(t, axis), A)
    a = axis % A.ndim
    flat = A.reshape(int(np.prod(A.shape[:a])), -1)
    e = np.exp(flat - flat.max(axis=1, keepdims=True))
    expected = (e / e.sum(axis=1, keepdims=True)).reshape(A.shape)
    np.testing.assert_allclose(r, expected, rtol=1e-5, atol=1e-7)
    assert r.shape == A.shape and r.dtype == np.float32


def test_softmax_needs_axis():
    """§11.14: ``axis`` is required."""
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)
        with pytest.raises(TypeError):
            ops.softmax(t)


def test_cast_parameter_is_data_type():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(A)
        y = ops.cast(t, data_type=popxl.float16)
    np.testing.assert_array_equal(run(ir, None, y), A.astype(np.float16))


# python/popxl/python_files/ops/{slice,split,subsample,transpose,reshape}.py pass these
# attributes to pybind11-bound C++ op constructors as std::vector<int64_t>: floats -> TypeError
# (the emulator used to accept them and produce float shapes such as (2.0, 6)).
@pytest.mark.parametrize("make", [
    lambda x: ops.slice(x, [1.0], [3]),
    lambda x: ops.slice(x, [1], [3], axis=[0.0]),
    lambda x: ops.split(x, [2.0, 2.0]),
    lambda x: ops.subsample(x, [2.0, 1]),
    lambda x: x.transpose((1.0, 0)),
    lambda x: x.reshape((12.0, 2)),
])
def test_shape_attributes_reject_floats(make):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones((4, 6), np.float32))
        with pytest.raises(TypeError):
            make(x)
        assert ops.slice(x, [np.int64(1)], [3]).shape == (2, 6)  # numpy ints are fine
        assert all(type(d) is int for d in ops.slice(x, [np.int64(1)], [3]).shape)


# -- argmax / argmin (PopXL ops/argminmax.py, PopART op/argextrema.cpp) -----------------------
def test_argmax_argmin_dims_and_keepdim():
    a = np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 3.0]], np.float32)
    outs = run_fn(lambda t: [ops.argmax(t, 1), ops.argmin(t, 0, keepdim=True),
                             ops.argmax(t, -1, True)], a)
    np.testing.assert_array_equal(outs[0], [1, 0])
    np.testing.assert_array_equal(outs[1], [[0, 1, 0]])
    np.testing.assert_array_equal(outs[2], [[1], [0]])
    assert all(o.dtype == np.int32 for o in outs)


def test_argmax_refusals():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.zeros((2, 3), np.float32))
        with pytest.raises(IR_ERRORS):
            ops.argmax(t, 2)
        with pytest.raises(IR_ERRORS):
            ops.argmin(popxl.variable(np.float32(1.0)), 0)


@pytest.mark.parametrize("data", [[[1.0, 3.0, 3.0]], [[1.0, np.nan, 0.0]]],
                         ids=["tie", "nan"])
def test_argmax_of_ties_or_nan_raises(data):
    """popnn's argMax does not specify which index it returns for ties or NaN: the emulator
    raises when the op runs."""
    if popxl_flash.BACKEND != "emulator":
        pytest.skip("the emulator raises on unspecified behaviour")
    with pytest.raises(RuntimeError):
        run_fn(lambda t: ops.argmax(t, 1), np.array(data, np.float32))


# -- concat_ (ConcatInplaceOp: the output aliases the inputs) --------------------------------
def test_concat_inplace_values():
    a, b = np.ones((2, 2), np.float32), np.zeros((1, 2), np.float32)
    out = run_fn(lambda x, y: ops.concat_([x, y], 0) + 0.0, a, b)
    np.testing.assert_array_equal(out, np.concatenate([a, b]))


def test_concat_inplace_sees_a_later_write_to_an_input():
    # ConcatInplaceOp::aliases = uses (willow/include/popart/op/concat.hpp): the output is a
    # view of every input, so a later in-place write to an input is read through it.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        x = popxl.variable(np.ones(2, np.float32))
        y = ops.concat_([x, x + 1.0], 0)
        ops.var_updates.accumulate_(x, popxl.constant(np.ones(2, np.float32)))
        s = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(s, y)
    with popxl.Session(ir, "ipu_model") as sess:
        out = sess.run()[s]
    np.testing.assert_array_equal(out, [2.0, 2.0, 2.0, 2.0])
