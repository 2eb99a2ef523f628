"""Tensor attributes, indexing and operator overloads (reference §2, §11.4, §11.5, §11.9, §11.14)."""
import operator

import numpy as np
import pytest

from conftest import IR_ERRORS, emulator_only, run, run_fn
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32

X = np.arange(12, dtype=np.float32).reshape(4, 3)


def _ir_with(array):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(array)
    return ir, t


# --- creation / attributes ----------------------------------------------------------------------


def test_attributes():
    ir, t = _ir_with(np.zeros((2, 3, 4), np.float32))
    assert t.shape == (2, 3, 4) and isinstance(t.shape, tuple)
    assert t.rank == 3
    assert t.nelms == 24
    assert t.dtype == f32
    assert t.spec == popxl.TensorSpec((2, 3, 4), f32)
    assert len(t) == 2
    assert isinstance(t, popxl.Tensor)
    assert isinstance(t, popxl.tensor.Constant)


@pytest.mark.parametrize(
    "data, dtype",
    [
        (3, "int32"),
        (2.5, "float32"),
        (True, "bool"),
        (np.zeros(2, np.float64), "float32"),
        (np.zeros(2, np.int64), "int32"),
        (np.zeros(2, np.uint64), "uint32"),
        (np.zeros(2, np.float16), "float16"),
    ],
)
def test_constant_dtype_inference_downcasts_64_bit(data, dtype):
    _, t = _ir_with(data)
    assert t.dtype == getattr(popxl, dtype)


def test_explicit_dtype_wins_and_float_to_int_truncates():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant([2.7, -2.7], dtype=popxl.int32)
        assert t.dtype == popxl.int32
    np.testing.assert_array_equal(run(ir, None, t), np.array([2, -2], np.int32))


def test_variable_attributes_and_type():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones((2, 2)), name="w")
    assert isinstance(v, popxl.tensor.Variable)
    assert v.dtype == f32  # float64 data downcast
    assert v.name == "w"


# --- methods that exist / do not exist -----------------------------------------------------------


@pytest.mark.parametrize("name", ["squeeze", "astype", "cast", "sum", "numpy"])
def test_missing_tensor_methods(name):
    _, t = _ir_with(X)
    assert not hasattr(t, name)


def test_T_reverses_all_axes():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    r = run_fn(lambda t: t.T, a)
    np.testing.assert_array_equal(r, a.T)
    assert r.shape == (4, 3, 2)


def test_transpose_and_reshape_take_one_iterable():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    ir, t = _ir_with(a)
    with ir.main_graph:
        with pytest.raises(TypeError):
            t.reshape(3, 2)
        with pytest.raises(TypeError):
            t.transpose(1, 0)
        r1 = t.reshape((3, 2))
        r2 = t.reshape([-1, 6])
        r3 = t.transpose((1, 0))
        r4 = t.transpose()
        r5 = t.flatten()
    outs = run(ir, None, [r1, r2, r3, r4, r5])
    for got, want in zip(outs, [a.reshape(3, 2), a.reshape(1, 6), a.T, a.T, a.reshape(-1)]):
        np.testing.assert_array_equal(got, want)
        assert got.shape == want.shape


# --- Python protocol: comparisons, bool, len, iteration ------------------------------------------


@pytest.mark.parametrize("cmp", [operator.lt, operator.le, operator.gt, operator.ge])
def test_no_comparison_dunders(cmp):
    """§11.5: ``a > b`` is a TypeError, also against Python numbers."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones(3, np.float32))
        b = popxl.constant(np.zeros(3, np.float32))
        with pytest.raises(TypeError):
            cmp(a, b)
        with pytest.raises(TypeError):
            cmp(a, 1.0)


def test_eq_is_identity_and_returns_python_bool():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones(3, np.float32))
        b = popxl.constant(np.ones(3, np.float32))  # same values, different tensor
    assert (a == a) is True
    assert (a == b) is False
    assert (a != b) is True
    assert (a != a) is False
    d = {a: 1, b: 2}  # hashable
    assert d[a] == 1 and d[b] == 2


def test_bool_uses_len():
    ir = popxl.Ir()
    with ir.main_graph:
        vec = popxl.constant(np.ones(3, np.float32))
        scalar = popxl.constant(np.float32(1.0))
    assert bool(vec) is True
    assert len(vec) == 3
    with pytest.raises(ValueError):
        bool(scalar)
    with pytest.raises(ValueError):
        len(scalar)
    with pytest.raises(ValueError):
        if scalar:
            pass


def test_tensors_are_not_iterable():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError):
        a, b = t
    with pytest.raises(TypeError):
        for _ in t:
            pass
    with pytest.raises(TypeError):
        list(t)
    with pytest.raises(TypeError):
        _ = 1.0 in t


# --- indexing ------------------------------------------------------------------------------------


def test_int_and_slice_indexing_copies_and_squeezes():
    ir, t = _ir_with(X)
    with ir.main_graph:
        outs = [t[1], t[1:3], t[:, 1], t[1, 2], t[::2], t[1:, ::2], t[-2:], t[-10:2], t[1:100]]
    want = [X[1], X[1:3], X[:, 1], X[1, 2], X[::2], X[1:, ::2], X[-2:], X[-10:2], X[1:100]]
    for got, w in zip(run(ir, None, outs), want):
        assert got.shape == w.shape
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("key", [-1, (0, -1), (slice(None), -1)])
def test_negative_int_index_is_broken(key):
    """§2 / §11.9: ``t[-1]`` becomes ``slice(-1, 0)`` of length n-1 (here n >= 4), so the squeeze
    raises ValueError."""
    ir, t = _ir_with(np.arange(20, dtype=np.float32).reshape(4, 5))
    with ir.main_graph:
        with pytest.raises(ValueError):
            t[key]


@pytest.mark.parametrize("key", [None, Ellipsis, 1.5, "a", (None, 0)])
def test_unsupported_index_keys_raise(key):
    ir, t = _ir_with(X)
    with ir.main_graph:
        with pytest.raises(Exception):
            t[key]


def test_int_list_array_and_tensor_index_gather_axis_0():
    ir, t = _ir_with(X)
    with ir.main_graph:
        idx = popxl.constant(np.array([3, 0, 3], np.int32))
        outs = [t[[2, 0]], t[np.array([1, 3])], t[idx]]
    want = [X[[2, 0]], X[[1, 3]], X[[3, 0, 3]]]
    for got, w in zip(run(ir, None, outs), want):
        assert got.shape == w.shape
        np.testing.assert_array_equal(got, w)


@emulator_only
def test_out_of_range_gather_raises_on_emulator():
    """Undefined data in PopXL (without zero_OOR); the emulator raises."""
    ir, t = _ir_with(X)
    with ir.main_graph:
        y = t[[1, 4]]
    with pytest.raises(Exception):
        run(ir, None, y)


def test_bool_mask_zeroes_and_keeps_shape():
    """§11.9: ``t[mask]`` is ``where(mask, t, 0)`` (broadcast), unlike numpy's compaction."""
    mask_row = np.array([True, False, True])
    mask_full = X > 5
    ir, t = _ir_with(X + 1)
    with ir.main_graph:
        m_row = popxl.constant(mask_row)
        m_full = popxl.constant(mask_full)
        outs = [t[m_row], t[m_full], t[[True, False, True]]]
    want = [np.where(mask_row, X + 1, 0), np.where(mask_full, X + 1, 0), np.where(mask_row, X + 1, 0)]
    for got, w in zip(run(ir, None, outs), want):
        assert got.shape == (4, 3)
        np.testing.assert_array_equal(got, w.astype(np.float32))


# --- operator overloads --------------------------------------------------------------------------


def test_dunder_scalar_takes_tensor_dtype():
    """§11.4: ``int_t * 0.5`` multiplies by int32(0.5) == 0; ``int_t + 1.7`` adds 1."""
    a = np.array([3, -4, 5], np.int32)
    ir, t = _ir_with(a)
    with ir.main_graph:
        y1 = t * 0.5
        y2 = t + 1.7
        y3 = 10 - t
        y4 = 2.9 * t
        assert y1.dtype == popxl.int32 and y2.dtype == popxl.int32
    r1, r2, r3, r4 = run(ir, None, [y1, y2, y3, y4])
    np.testing.assert_array_equal(r1, np.zeros(3, np.int32))
    np.testing.assert_array_equal(r2, a + 1)
    np.testing.assert_array_equal(r3, 10 - a)
    np.testing.assert_array_equal(r4, 2 * a)
    assert r1.dtype == np.int32


def test_dunder_scalar_on_float16_stays_float16():
    a = np.array([1.0, 2.0, 2049.0], np.float16)
    ir, t = _ir_with(a)
    with ir.main_graph:
        y = t * 3.0 + 0.1
        assert y.dtype == popxl.float16
    r = run(ir, None, y)
    assert r.dtype == np.float16
    np.testing.assert_array_equal(r, a * np.float16(3.0) + np.float16(0.1))


def test_pow_scalar_uses_inferred_dtype():
    """§11.4: ``t ** 2`` makes an int32 constant -> IR dtype error on float tensors."""
    ir = popxl.Ir()
    with ir.main_graph:
        f = popxl.constant(np.array([1.0, 2.0, 3.0], np.float32))
        h = popxl.constant(np.array([1.0, 2.0], np.float16))
        i = popxl.constant(np.array([1, 2, 3], np.int32))
        with pytest.raises(IR_ERRORS):
            f ** 2
        with pytest.raises(IR_ERRORS):
            h ** 2.0
        with pytest.raises(IR_ERRORS):
            i ** 2.0
        y_f = f ** 2.0
        y_i = i ** 2
        y_r = 2.0 ** f
        assert y_f.dtype == f32 and y_i.dtype == popxl.int32
    r_f, r_i, r_r = run(ir, None, [y_f, y_i, y_r])
    np.testing.assert_allclose(r_f, [1.0, 4.0, 9.0], rtol=1e-6)
    np.testing.assert_array_equal(r_i, np.array([1, 4, 9], np.int32))
    np.testing.assert_allclose(r_r, [2.0, 4.0, 8.0], rtol=1e-6)


def test_arithmetic_dunders_match_numpy():
    a = np.array([[1.5, -2.0, 3.0]], np.float32)
    b = np.array([[2.0], [-4.0]], np.float32)
    outs = run_fn(lambda x, y: [x + y, x - y, x * y, x / y, -x, y - 1.0, 1.0 - y, 3.0 / y], a, b)
    want = [a + b, a - b, a * b, a / b, -a, b - 1, 1 - b, 3 / b]
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got, w, rtol=1e-6)
        assert got.shape == w.shape


def test_mod_dunder_is_c_fmod():
    a = np.array([-7, 7, -7, 7], np.int32)
    b = np.array([3, -3, -3, 3], np.int32)
    r = run_fn(lambda x, y: x % y, a, b)
    np.testing.assert_array_equal(r, np.array([-1, 1, -1, 1], np.int32))


def test_matmul_dunder():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(run_fn(lambda x, y: x @ y, a, b), a @ b)


def test_logical_dunders_cast_to_bool():
    a = np.array([0, 1, 2, 0], np.int32)
    b = np.array([0, 0, 3, 5], np.int32)
    outs = run_fn(lambda x, y: [x & y, x | y, ~x], a, b)
    want = [np.logical_and(a, b), np.logical_or(a, b), np.logical_not(a)]
    for got, w in zip(outs, want):
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(got, w)


def test_empty_host_value_in_arithmetic_is_value_error():
    ir, t = _ir_with(np.ones(3, np.float32))
    with ir.main_graph:
        with pytest.raises(ValueError):
            t + np.zeros((0,), np.float32)
