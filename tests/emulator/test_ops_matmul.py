"""ops.matmul: numpy shape rules, dtype rules, output_type / partials_type (reference §5 "Matmul")."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import COMPILE_ERRORS, IR_ERRORS, run, run_fn, store
from popxl_flash import popxl

ops = popxl.ops
f32, f16 = popxl.float32, popxl.float16

SMALL_INTS = st.integers(-4, 4).map(float)


@given(data=st.data())
def test_matmul_shapes_and_values_follow_numpy(data):
    """Broadcast group dims, 1-D operands (prepended / appended 1 removed afterwards)."""
    shapes = data.draw(
        hnp.mutually_broadcastable_shapes(signature=np.matmul.signature, max_dims=2, max_side=4)
    )
    ls, rs = shapes.input_shapes
    a = data.draw(hnp.arrays(np.float32, ls, elements=SMALL_INTS))
    b = data.draw(hnp.arrays(np.float32, rs, elements=SMALL_INTS))
    r = run_fn(lambda x, y: ops.matmul(x, y), a, b)
    want = np.matmul(a, b)
    assert r.shape == want.shape and r.dtype == np.float32
    np.testing.assert_array_equal(r, want)  # small integers: exact in any summation order


@pytest.mark.parametrize(
    "ls, rs, out",
    [
        ((2, 3), (3, 4), (2, 4)),
        ((3,), (3, 4), (4,)),
        ((2, 3), (3,), (2,)),
        ((3,), (3,), ()),
        ((5, 2, 3), (3, 4), (5, 2, 4)),
        ((2, 1, 2, 3), (5, 3, 4), (2, 5, 2, 4)),
        ((3,), (6, 3, 2), (6, 2)),
    ],
)
def test_matmul_output_shape(ls, rs, out):
    ir = popxl.Ir()
    with ir.main_graph:
        y = ops.matmul(popxl.constant(np.ones(ls, np.float32)), popxl.constant(np.ones(rs, np.float32)))
        assert y.shape == out
    np.testing.assert_array_equal(run(ir, None, y), np.ones(ls, np.float32) @ np.ones(rs, np.float32))


@pytest.mark.parametrize(
    "ls, rs", [((2, 3), (4, 5)), ((3,), (4,)), ((2, 3), (2,)), ((2, 2, 3), (3, 3, 4)), ((), (3, 3)), ((3,), ())]
)
def test_matmul_bad_shapes_are_ir_errors(ls, rs):
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones(ls, np.float32))
        b = popxl.constant(np.ones(rs, np.float32))
        with pytest.raises(IR_ERRORS):
            ops.matmul(a, b)


def test_matmul_mixed_dtypes_rejected():
    """MatMulOp::setup (willow/src/op/matmul.cpp) never compares the operand dtypes (the output
    takes the lhs dtype): the op is created, and the Session's compilation refuses it."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones((2, 3), np.float16))
        b = popxl.constant(np.ones((3, 2), np.float32))
        y = ops.matmul(a, b)
        assert y.dtype == popxl.float16
        store(y)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_matmul_output_dtype_is_lhs_dtype_unless_output_type():
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    b = np.arange(6, dtype=np.float16).reshape(3, 2)
    ir = popxl.Ir()
    with ir.main_graph:
        x, y = popxl.constant(a), popxl.constant(b)
        z16 = ops.matmul(x, y)
        z32 = ops.matmul(x, y, output_type=f32)
        assert z16.dtype == f16 and z32.dtype == f32
    r16, r32 = run(ir, None, [z16, z32])
    assert r16.dtype == np.float16 and r32.dtype == np.float32
    want = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_array_equal(r32, want)
    np.testing.assert_array_equal(r16, want.astype(np.float16))


@pytest.mark.parametrize("bad", ["int32", "bool", "uint32"])
def test_partials_type_must_be_float16_or_float32(bad):
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones((2, 2), np.float32))
        with pytest.raises(ValueError):
            ops.matmul(a, a, partials_type=getattr(popxl, bad))


def test_float16_matmul_accumulates_in_float32_then_rounds():
    """Default / float32 partials: 2048 + 1 + 1 + 1 = 2051 exactly in float32.

    float16 accumulation would give 2048 (each +1 rounds away); float32 output keeps 2051;
    float16 output rounds 2051 -> 2052 (round half to even).
    """
    a = np.array([[2048.0, 1.0, 1.0, 1.0]], np.float16)
    b = np.ones((4, 1), np.float16)
    ir = popxl.Ir()
    with ir.main_graph:
        x, y = popxl.constant(a), popxl.constant(b)
        outs = [
            ops.matmul(x, y, output_type=f32, partials_type=f32),
            ops.matmul(x, y, output_type=f32),
            ops.matmul(x, y, partials_type=f32),
            ops.matmul(x, y),
        ]
    r = run(ir, None, outs)
    np.testing.assert_array_equal(r[0], np.array([[2051.0]], np.float32))
    np.testing.assert_array_equal(r[1], np.array([[2051.0]], np.float32))
    np.testing.assert_array_equal(r[2], np.array([[2052.0]], np.float16))
    np.testing.assert_array_equal(r[3], np.array([[2052.0]], np.float16))
    assert [o.dtype for o in r] == [np.float32, np.float32, np.float16, np.float16]


def test_float16_random_matmul_close_to_float32_reference():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 8, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    r = run_fn(lambda x, y: ops.matmul(x, y, output_type=f32), a, b)
    np.testing.assert_allclose(r, a.astype(np.float32) @ b.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_matmul_float32_random():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 5, 7)).astype(np.float32)
    b = rng.standard_normal((3, 7, 2)).astype(np.float32)
    np.testing.assert_allclose(run_fn(lambda x, y: ops.matmul(x, y), a, b), a @ b, rtol=1e-5, atol=1e-5)
