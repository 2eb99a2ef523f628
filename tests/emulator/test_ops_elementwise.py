"""Elementwise ops: numerics vs numpy, strict dtypes, C integer semantics (§5, §11.4, §11.6, §11.7)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import IR_ERRORS, pdtype, run, run_fn
from popxl_flash import popxl

ops = popxl.ops
f32, f16, i32 = popxl.float32, popxl.float16, popxl.int32

FLOAT_DTYPES = [np.float32, np.float16]


def _finite(dtype, lo=-8.0, hi=8.0):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=16 if dtype == np.float16 else 32)


@st.composite
def broadcast_pair(draw, dtype):
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4))
    a, b = (draw(hnp.arrays(dtype, s, elements=_finite(dtype))) for s in shapes.input_shapes)
    return a, b


# --- binary arithmetic --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_binary_float_ops_match_numpy_with_broadcast(dtype, data):
    a, b = data.draw(broadcast_pair(dtype))
    b = np.where(np.abs(b) < 0.25, dtype(1.0), b).astype(dtype)  # keep division well-conditioned
    outs = run_fn(lambda x, y: [ops.add(x, y), ops.sub(x, y), ops.mul(x, y), ops.div(x, y)], a, b)
    # numpy float16 arithmetic rounds each result to float16, as the device does.
    want = [a + b, a - b, a * b, a / b]
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == np.float16 else dict(rtol=1e-6, atol=1e-6)
    for got, w in zip(outs, want):
        assert got.dtype == dtype and got.shape == w.shape
        np.testing.assert_allclose(got.astype(np.float64), w.astype(np.float64), **tol)


def test_float16_computes_in_float16():
    """Each float16 op rounds to float16: (1 + 2048) - 2048 == 0 in float16 (2049 -> 2048)."""
    a = np.array([1.0, 3.0], np.float16)
    b = np.array([2048.0, 2048.0], np.float16)
    r = run_fn(lambda x, y: ops.sub(ops.add(x, y), y), a, b)
    assert r.dtype == np.float16
    np.testing.assert_array_equal(r, (a + b) - b)  # [0, 4]
    np.testing.assert_array_equal(r, np.array([0.0, 4.0], np.float16))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "fmod"])
@pytest.mark.parametrize(
    "lhs, rhs",
    [(np.float32, np.float16), (np.int32, np.float32), (np.int32, np.uint32), (np.float16, np.int32)],
)
def test_binary_ops_need_equal_dtypes(op, lhs, rhs):
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones(3, lhs))
        b = popxl.constant(np.ones(3, rhs))
        with pytest.raises(IR_ERRORS):
            getattr(ops, op)(a, b)


def test_mul_accepts_float16_with_one_element_float32():
    a = np.array([1.5, 2.0, -3.0], np.float16)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(a)
        y0 = ops.mul(x, popxl.constant(np.float32(2.0)))
        y1 = ops.mul(x, popxl.constant(np.array([0.5], np.float32)))
        assert y0.dtype == f16 and y1.dtype == f16
        with pytest.raises(IR_ERRORS):
            ops.mul(x, popxl.constant(np.ones(3, np.float32)))
        with pytest.raises(IR_ERRORS):
            ops.add(x, popxl.constant(np.float32(2.0)))
    r0, r1 = run(ir, None, [y0, y1])
    np.testing.assert_array_equal(r0, a * 2)
    np.testing.assert_array_equal(r1, a * 0.5)
    assert r0.dtype == np.float16


def test_ops_need_tensor_inputs():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        with pytest.raises(TypeError):
            ops.add(x, 1.0)
        with pytest.raises(TypeError):
            ops.mul(2.0, x)


def test_integer_div_truncates_and_fmod_keeps_dividend_sign():
    """§11.7: C semantics, not numpy's floor division / Python %."""
    a = np.array([-7, 7, -7, 7, 6, -1], np.int32)
    b = np.array([2, 2, -2, -2, 3, 5], np.int32)
    d, m, d2, m2 = run_fn(lambda x, y: [ops.div(x, y), ops.fmod(x, y), x / y, x % y], a, b)
    want_d = np.trunc(a / b).astype(np.int32)  # [-3, 3, 3, -3, 2, 0]
    want_m = np.fmod(a, b)  # [-1, 1, -1, 1, 0, -1]
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(d2, want_d)
    np.testing.assert_array_equal(m, want_m)
    np.testing.assert_array_equal(m2, want_m)
    assert d.dtype == np.int32 and m.dtype == np.int32
    assert not np.array_equal(want_d, a // b) and not np.array_equal(want_m, a % b)


def test_float_fmod_keeps_dividend_sign():
    a = np.array([-5.5, 5.5, -5.5, 0.25], np.float32)
    b = np.array([2.0, -2.0, -2.0, 0.5], np.float32)
    r = run_fn(lambda x, y: ops.fmod(x, y), a, b)
    np.testing.assert_array_equal(r, np.fmod(a, b))  # [-1.5, 1.5, -1.5, 0.25]


def test_increment_mod_casts_constants_to_tensor_dtype():
    """§11.7: increment 1.5 -> 1 and modulus 4.9 -> 4 for int32; C remainder."""
    a = np.array([-6, 2, 5, 7], np.int32)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(a)
        y = ops.increment_mod(t, 1.5, 4.9)
        assert y.dtype == i32
    np.testing.assert_array_equal(run(ir, None, y), np.fmod(a + 1, 4))  # [-1, 3, 2, 0]


def test_increment_mod_float():
    a = np.array([0.5, -2.5, 3.0], np.float32)
    r = run_fn(lambda t: ops.increment_mod(t, 1.0, 1.5), a)
    np.testing.assert_allclose(r, np.fmod(a + 1.0, 1.5), atol=1e-6)


# --- maximum / where / comparisons / logic ----------------------------------------------------


def test_maximum_of_several_same_shape_tensors():
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3))
    np.testing.assert_array_equal(run_fn(lambda x, y, z: ops.maximum(x, y, z), a, b, c),
                                  np.maximum(np.maximum(a, b), c))
    np.testing.assert_array_equal(run_fn(lambda x, y: ops.maximum(x, y), a, b), np.maximum(a, b))


@pytest.mark.parametrize(
    "shape_a, dtype_a, shape_b, dtype_b",
    [
        ((2, 3), np.float32, (3,), np.float32),
        ((2, 3), np.float32, (1, 3), np.float32),
        ((3,), np.float32, (), np.float32),
        ((3,), np.float32, (3,), np.float16),
        ((3,), np.int32, (3,), np.float32),
    ],
)
def test_maximum_needs_identical_shape_and_dtype(shape_a, dtype_a, shape_b, dtype_b):
    """§11.6: opset-6 Max, no broadcasting despite the docstring."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones(shape_a, dtype_a))
        b = popxl.constant(np.ones(shape_b, dtype_b))
        with pytest.raises(IR_ERRORS):
            ops.maximum(a, b)


@pytest.mark.parametrize("name", ["minimum", "less", "reduce_sum", "reduce_max", "sub_", "mul_",
                                  "div_", "negate_", "log_", "cast_", "fill"])
def test_names_that_do_not_exist(name):
    assert not hasattr(ops, name)


@given(data=st.data())
def test_where_three_way_broadcast(data):
    shapes = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3))
    cs, ls, rs = shapes.input_shapes
    c = data.draw(hnp.arrays(np.bool_, cs))
    lhs = data.draw(hnp.arrays(np.float32, ls, elements=_finite(np.float32)))
    rhs = data.draw(hnp.arrays(np.float32, rs, elements=_finite(np.float32)))
    r = run_fn(lambda cc, x, y: ops.where(cc, x, y), c, lhs, rhs)
    want = np.where(c, lhs, rhs)
    assert r.shape == want.shape and r.dtype == np.float32
    np.testing.assert_array_equal(r, want)


def test_where_casts_condition_and_needs_equal_value_dtypes():
    c = np.array([0, 2, -1], np.int32)
    lhs = np.array([1.0, 2.0, 3.0], np.float16)
    rhs = np.array([-1.0, -2.0, -3.0], np.float16)
    ir = popxl.Ir()
    with ir.main_graph:
        tc, tl, tr = popxl.constant(c), popxl.constant(lhs), popxl.constant(rhs)
        y = ops.where(tc, tl, tr)
        assert y.dtype == f16
        with pytest.raises(IR_ERRORS):
            ops.where(tc, tl, popxl.constant(rhs.astype(np.float32)))
        with pytest.raises(IR_ERRORS):
            ops.where(tc, popxl.constant(np.ones(3, np.int32)), tl)
    np.testing.assert_array_equal(run(ir, None, y), np.where(c != 0, lhs, rhs))


@given(data=st.data())
def test_greater_equal_broadcast_to_bool(data):
    shapes = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4))
    ints = st.integers(-3, 3)
    a = data.draw(hnp.arrays(np.int32, shapes.input_shapes[0], elements=ints))
    b = data.draw(hnp.arrays(np.int32, shapes.input_shapes[1], elements=ints))
    g, e = run_fn(lambda x, y: [ops.greater(x, y), ops.equal(x, y)], a, b)
    assert g.dtype == np.bool_ and e.dtype == np.bool_
    np.testing.assert_array_equal(g, a > b)
    np.testing.assert_array_equal(e, a == b)


def test_less_via_greater_with_swapped_operands():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([2.0, 2.0, 2.0], np.float32)
    np.testing.assert_array_equal(run_fn(lambda x, y: ops.greater(y, x), a, b), a < b)


def test_logical_ops_cast_inputs_to_bool():
    a = np.array([0, 1, 5, 0], np.int32)
    b = np.array([True, True, False, False])
    outs = run_fn(lambda x, y: [ops.logical_and(x, y), ops.logical_or(x, y), ops.logical_not(x),
                                ops.logical_not(y)], a, b)
    want = [np.logical_and(a, b), np.logical_or(a, b), np.logical_not(a), np.logical_not(b)]
    for got, w in zip(outs, want):
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(got, w)


# --- unary ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_exp_log_sqrt_negate(dtype):
    rng = np.random.default_rng(1)
    a = rng.uniform(0.1, 4.0, size=(3, 5)).astype(dtype)
    outs = run_fn(lambda t: [ops.exp(t), ops.log(t), ops.sqrt(t), ops.negate(t)], a)
    want = [np.exp(a), np.log(a), np.sqrt(a), -a]
    tol = dict(rtol=2e-3) if dtype == np.float16 else dict(rtol=1e-5)
    for got, w in zip(outs, want):
        assert got.dtype == dtype
        np.testing.assert_allclose(got.astype(np.float64), w.astype(np.float64), **tol)


def test_isnan_isinf():
    a = np.array([0.0, np.nan, np.inf, -np.inf, -1.0], np.float32)
    n, i = run_fn(lambda t: [ops.isnan(t), ops.isinf(t)], a)
    assert n.dtype == np.bool_ and i.dtype == np.bool_
    np.testing.assert_array_equal(n, np.isnan(a))
    np.testing.assert_array_equal(i, np.isinf(a))


@pytest.mark.parametrize(
    "src, dst",
    [
        (np.array([1.0, -2.0, 300.0], np.float32), np.int32),
        (np.array([1, -2, 70000], np.int32), np.float32),
        (np.array([1.0001, 65504.0, -3.0], np.float32), np.float16),
        (np.array([1.5, -2.25], np.float16), np.float32),
        (np.array([True, False]), np.int32),
        (np.array([0, 3, -1], np.int32), np.bool_),
        (np.array([0.0, 0.5], np.float32), np.bool_),
    ],
)
def test_cast(src, dst):
    ir = popxl.Ir()
    with ir.main_graph:
        y = ops.cast(popxl.constant(src), data_type=pdtype(dst))
        assert y.dtype == pdtype(dst)
    r = run(ir, None, y)
    assert r.dtype == dst
    np.testing.assert_array_equal(r, src.astype(dst))


@pytest.mark.parametrize("op", ["greater", "equal"])
def test_comparison_dtype_mismatch_fails_by_run_time(op):
    """The IR does not check it, a mismatch fails later: treat equal dtypes as required."""
    with pytest.raises(Exception):
        ir = popxl.Ir()
        with ir.main_graph:
            a = popxl.constant(np.ones(3, np.float32))
            b = popxl.constant(np.ones(3, np.float16))
            y = getattr(ops, op)(a, b)
        run(ir, None, y)
