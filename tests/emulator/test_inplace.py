"""In-place semantics and ordering (reference §2 "Operator overloads", §5 "General rules", §11.8)."""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, run, store
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32

X0 = np.array([1.0, 2.0, 3.0], np.float32)


def test_iadd_is_in_place_and_returns_same_tensor():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        v = popxl.variable(X0, name="v")
        alias = v
        v += 1.0
        assert v == alias  # same tensor object (identity equality)
        out = store(alias)
    with popxl.Session(ir, "ipu_model") as session:
        r = session.run()[out]
        v_data = session.get_tensor_data(alias)
    np.testing.assert_array_equal(r, X0 + 1)
    np.testing.assert_array_equal(v_data, X0 + 1)


@pytest.mark.parametrize("op", ["isub", "imul", "itruediv"])
def test_other_augmented_assignments_rebind_out_of_place(op):
    """§11.8: ``-=``, ``*=``, ``/=`` are not defined -> a new tensor; the original is unchanged."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        v = popxl.variable(X0, name="v")
        t = v
        if op == "isub":
            t -= 1.0
        elif op == "imul":
            t *= 2.0
        else:
            t /= 2.0
        assert not (t == v)
        out_t, out_v = store(t), store(v)
    rt, rv = run(ir, None, [out_t, out_v])
    want = {"isub": X0 - 1, "imul": X0 * 2, "itruediv": X0 / 2}[op]
    np.testing.assert_array_equal(rt, want)
    np.testing.assert_array_equal(rv, X0)


def test_underscore_op_returns_alias_and_modifies_input_0():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X0, name="x")
        c = popxl.constant(np.float32(10.0))
        y = ops.add_(x, c)
        assert not (y == x)  # a new Tensor ...
        z = y * 1.0  # ... that aliases x
        out_x, out_y, out_z = store(x), store(y), store(z)
    rx, ry, rz = run(ir, None, [out_x, out_y, out_z])
    for r in (rx, ry, rz):
        np.testing.assert_array_equal(r, X0 + 10)


def test_increment_mod_in_place_and_accumulate():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        i = popxl.variable(np.array([2, 3], np.int32), name="i")
        acc = popxl.variable(np.zeros(2, np.float32), name="acc")
        ops.increment_mod_(i, 1, 4)
        ops.var_updates.accumulate_(acc, popxl.constant(np.array([1.0, 2.0], np.float32)))
        ops.var_updates.accumulate_(acc, popxl.constant(np.array([1.0, 2.0], np.float32)), f=0.5)
        out_i, out_acc = store(i), store(acc)
    ri, racc = run(ir, None, [out_i, out_acc])
    np.testing.assert_array_equal(ri, np.array([3, 0], np.int32))
    np.testing.assert_array_equal(racc, np.array([1.5, 3.0], np.float32))


def test_add_in_place_lhs_must_have_broadcast_shape():
    """AddLhsInplaceOp's setup gives the broadcast shape (willow/src/op/elementwise.cpp); the
    in-place lowering (popx/op/elementwisex.cpp) needs lhs to have it: refused at Session()."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X0)
        y = ops.add_(x, popxl.constant(np.ones((2, 3), np.float32)))
        assert y.shape == (2, 3)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def _read_modify_program(ordered):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X0, name="x")
        with popxl.in_sequence(ordered):
            y = x * 2.0  # reads x
            z = ops.add_(x, popxl.constant(np.float32(1.0)))  # modifies x; no data dependency with y
        out_y, out_z = store(y), store(z)
    return ir, out_y, out_z


def test_unordered_read_and_modify_is_ambiguous_at_session():
    """§11.8: ops are unordered without in_sequence -> error when the Session compiles."""
    ir, _, _ = _read_modify_program(ordered="pass")
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_same_program_in_sequence_is_fine():
    ir, out_y, out_z = _read_modify_program(ordered=True)
    ry, rz = run(ir, None, [out_y, out_z])
    np.testing.assert_array_equal(ry, X0 * 2)
    np.testing.assert_array_equal(rz, X0 + 1)


def test_in_sequence_false_block_is_unordered_again():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        x = popxl.variable(X0, name="x")
        with popxl.in_sequence(False):
            y = x * 2.0
            z = ops.add_(x, popxl.constant(np.float32(1.0)))
        store(y)
        store(z)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_modify_after_dependent_read_is_not_ambiguous():
    """A modify that consumes the reader's output is ordered by data dependency."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X0, name="x")
        y = x * 2.0
        z = ops.add_(y, popxl.constant(np.float32(1.0)))
        out_z = store(z)
    np.testing.assert_array_equal(run(ir, None, out_z), X0 * 2 + 1)
