"""call / repeat / conditional and pass-by-reference (reference §4, §11.1, §11.3, §11.8, §11.12)."""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, IR_ERRORS, load, run, store
from popxl_flash import popxl

ops = popxl.ops
f32, i32 = popxl.float32, popxl.int32

X0 = np.array([1.0, 2.0, 3.0], np.float32)
C = np.array([0.5, -1.0, 2.0], np.float32)


def _acc_step(acc, step):
    """Body with 2 inputs, 1 output: acc is carried (input 0), step invariant (input 1)."""
    return acc + step


# --- call -----------------------------------------------------------------------------------------


def test_call_returns_tuple_in_output_order():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g1 = ir.create_graph(lambda a: a * 2.0, x)
        g2 = ir.create_graph(lambda a: (a + 1.0, a - 1.0), x)
        r1 = ops.call(g1, x)
        r2 = ops.call(g2, x)
        assert isinstance(r1, tuple) and len(r1) == 1
        assert isinstance(r2, tuple) and len(r2) == 2
    o1, o2a, o2b = run(ir, None, [r1[0], r2[0], r2[1]])
    np.testing.assert_array_equal(o1, X0 * 2)
    np.testing.assert_array_equal(o2a, X0 + 1)
    np.testing.assert_array_equal(o2b, X0 - 1)


@pytest.mark.parametrize(
    "arg", [np.zeros(4, np.float32), np.zeros(3, np.float16), np.zeros(3, np.int32), np.zeros((1, 3), np.float32)]
)
def test_call_spec_mismatch_is_ir_error(arg):
    """§11.3: no broadcasting or casting at call boundaries."""
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a: a, popxl.TensorSpec((3,), f32))
        with pytest.raises(IR_ERRORS):
            ops.call(g, popxl.constant(arg))


def test_call_coerces_host_values_to_graph_input_dtype():
    """§11.3: scalars (and arrays) coerce to the graph input's dtype: 2.9 -> int32 2."""
    ir = popxl.Ir()
    with ir.main_graph:
        gi = ir.create_graph(lambda a: a + 1, popxl.TensorSpec((), i32))
        gf = ir.create_graph(lambda a: a * 2.0, popxl.TensorSpec((3,), f32))
        (yi,) = ops.call(gi, 2.9)
        # (positional iterables are flattened, so pass the host array through inputs_dict)
        (yf,) = ops.call(gf, inputs_dict={gf.inputs[0]: np.array([1.0, 2.0, 3.0])})  # f64 -> f32
        assert yi.dtype == i32 and yf.dtype == f32
    ri, rf = run(ir, None, [yi, yf])
    assert ri == 3 and ri.dtype == np.int32
    np.testing.assert_array_equal(rf, np.array([2.0, 4.0, 6.0], np.float32))


def test_call_with_inputs_dict():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        c = popxl.constant(C)
        g = ir.create_graph(lambda a, b: a - b, x, c)
        (y1,) = ops.call(g, x, inputs_dict={g.inputs[1]: c})
        (y2,) = ops.call(g, inputs_dict={g.inputs[1]: x, g.inputs[0]: c})
        info = ops.call_with_info(g, x, c)
        y3 = info.outputs[0]
        assert info.called_graph == g
    r1, r2, r3 = run(ir, None, [y1, y2, y3])
    np.testing.assert_array_equal(r1, X0 - C)
    np.testing.assert_array_equal(r2, C - X0)
    np.testing.assert_array_equal(r3, X0 - C)


def test_call_binding_errors_are_value_errors():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda a, b: a - b, x, x)
        other = ir.create_graph(lambda a: a, x)
        with pytest.raises(ValueError):  # too many positional inputs
            ops.call(g, x, x, x)
        with pytest.raises(ValueError):  # missing input
            ops.call(g, x)
        with pytest.raises(ValueError):  # same input positionally and in the dict
            ops.call(g, x, x, inputs_dict={g.inputs[0]: x})
        with pytest.raises(ValueError):  # dict key not an input of the called graph
            ops.call(g, x, inputs_dict={other.inputs[0]: x})
        sub = ir.create_empty_graph("sub")
        with sub:
            with pytest.raises(ValueError):  # parent tensor not in the current graph
                ops.call(other, x)


def test_call_inside_subgraph():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        inner = ir.create_graph(lambda a: a * 3.0, x)

        def outer(a):
            (b,) = ops.call(inner, a)
            return b + 1.0

        g = ir.create_graph(outer, x)
        (y,) = ops.call(g, x)
    np.testing.assert_array_equal(run(ir, None, y), X0 * 3 + 1)


# --- repeat -------------------------------------------------------------------------------------


def test_repeat_invariant_passed_positionally_after_carried():
    """§11.1: N=1 output, M=2 inputs -> input 0 carried, input 1 invariant even if positional."""
    ir = popxl.Ir()
    with ir.main_graph:
        x, c = popxl.constant(X0), popxl.constant(C)
        g = ir.create_graph(_acc_step, x, c)
        outs = ops.repeat(g, 4, x, c)
        assert isinstance(outs, tuple) and len(outs) == 1  # invariant input not returned
    np.testing.assert_allclose(run(ir, None, outs[0]), X0 + 4 * C)


def test_repeat_carried_input_supplied_via_inputs_dict():
    """§4.2: the carry rule is by graph input index, not by how the input is supplied."""
    ir = popxl.Ir()
    with ir.main_graph:
        x, c = popxl.constant(X0), popxl.constant(C)
        g = ir.create_graph(_acc_step, x, c)
        (y1,) = ops.repeat(g, 3, inputs_dict={g.inputs[1]: c, g.inputs[0]: x})
        (y2,) = ops.repeat(g, 3, x, inputs_dict={g.inputs[1]: c})
    r1, r2 = run(ir, None, [y1, y2])
    np.testing.assert_allclose(r1, X0 + 3 * C)
    np.testing.assert_allclose(r2, X0 + 3 * C)


def test_repeat_output_i_feeds_input_i():
    """Two carried inputs swapped by the body: (a, b) -> (b, a + c)."""
    a0 = np.array([1.0, 0.0], np.float32)
    b0 = np.array([10.0, 20.0], np.float32)
    c = np.array([100.0, 200.0], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        ta, tb, tc = popxl.constant(a0), popxl.constant(b0), popxl.constant(c)
        g = ir.create_graph(lambda a, b, k: (b, a + k), ta, tb, tc)
        ya, yb = ops.repeat(g, 3, ta, tb, tc)
    ra, rb = run(ir, None, [ya, yb])
    # (a0, b0) -> (b0, a0+c) -> (a0+c, b0+c) -> (b0+c, a0+2c)
    np.testing.assert_array_equal(ra, b0 + c)
    np.testing.assert_array_equal(rb, a0 + 2 * c)


def test_repeat_with_own_counter_and_graph_input_order():
    """The body carries its own counter; extra graph_inputs are appended after the signature ones."""
    ir = popxl.Ir()
    with ir.main_graph:
        i0 = popxl.constant(np.int32(0))
        acc0 = popxl.constant(np.float32(0.0))

        def body(i, acc):
            w = popxl.graph_input((), f32, "w")  # input 2: invariant
            return i + 1, acc + ops.cast(i, f32) * w

        g = ir.create_graph(body, i0, acc0)
        i_end, acc_end = ops.repeat(g, 5, i0, acc0, popxl.constant(np.float32(2.0)))
    ri, racc = run(ir, None, [i_end, acc_end])
    assert ri == 5
    assert racc == 2.0 * (0 + 1 + 2 + 3 + 4)


def test_repeat_count_zero_returns_initial_values():
    ir = popxl.Ir()
    with ir.main_graph:
        x, c = popxl.constant(X0), popxl.constant(C)
        g = ir.create_graph(_acc_step, x, c)
        (y,) = ops.repeat(g, 0, x, c)
    np.testing.assert_array_equal(run(ir, None, y), X0)


def test_repeat_negative_count_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        x, c = popxl.constant(X0), popxl.constant(C)
        g = ir.create_graph(_acc_step, x, c)
        with pytest.raises(ValueError):
            ops.repeat(g, -1, x, c)


def test_repeat_more_outputs_than_inputs_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda a: (a, a + 1.0), x)
        with pytest.raises(ValueError):
            ops.repeat(g, 2, x)


def test_repeat_input_spec_mismatch_is_ir_error():
    ir = popxl.Ir()
    with ir.main_graph:
        x, c = popxl.constant(X0), popxl.constant(C)
        g = ir.create_graph(_acc_step, x, c)
        with pytest.raises(IR_ERRORS):
            ops.repeat(g, 2, popxl.constant(X0.astype(np.float16)), c)


def test_repeat_output_input_spec_mismatch_fails_at_session():
    """Output i must match input i; not checked when the repeat is built, but at compile time."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda a: ops.sum(a), x)  # output () vs input (3,)
        (y,) = ops.repeat(g, 2, x)
        store(y)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_repeat_scalar_inputs_coerce():
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a, b: a * b, popxl.TensorSpec((), i32), popxl.TensorSpec((), i32))
        (y,) = ops.repeat(g, 3, 1, 3.7)  # 3.7 -> int32 3
    assert run(ir, None, y) == 27


# --- conditional ---------------------------------------------------------------------------------


def _branch_program(cond_shape):
    ir = popxl.Ir()
    feeds = {}
    with ir.main_graph:
        cond = load(feeds, np.zeros(cond_shape, np.bool_), name="cond")
        x, c = popxl.constant(X0), popxl.constant(C)
        then_g = ir.create_graph(lambda a: (a * 2.0, ops.sum(a)), x)
        else_g = ir.create_graph(lambda a, b: (a - b, ops.max(b)), x, c)
        y, s = ops.conditional(cond, then_g, else_g, then_inputs=[x], else_inputs=[x, c])
        out_y, out_s = store(y), store(s)
    (cond_stream,) = feeds
    return ir, cond_stream, out_y, out_s


@pytest.mark.parametrize("cond_shape", [(), (1,)])
def test_conditional_executes_the_selected_branch(cond_shape):
    ir, cond_stream, out_y, out_s = _branch_program(cond_shape)
    with popxl.Session(ir, "ipu_model") as session:
        r_true = session.run({cond_stream: np.ones(cond_shape, np.bool_)})
        r_false = session.run({cond_stream: np.zeros(cond_shape, np.bool_)})
    np.testing.assert_array_equal(r_true[out_y], X0 * 2)
    np.testing.assert_allclose(r_true[out_s], X0.sum())
    np.testing.assert_array_equal(r_false[out_y], X0 - C)
    np.testing.assert_array_equal(r_false[out_s], C.max())


def test_conditional_with_inputs_dict():
    ir = popxl.Ir()
    with ir.main_graph:
        x, c = popxl.constant(X0), popxl.constant(C)
        then_g = ir.create_graph(lambda a, b: a + b, x, c)
        else_g = ir.create_graph(lambda a: -a, c)
        cond = popxl.constant(np.array([True]))
        (y,) = ops.conditional(cond, then_g, else_g, then_inputs=[x],
                               then_inputs_dict={then_g.inputs[1]: c},
                               else_inputs_dict={else_g.inputs[0]: c})
    np.testing.assert_array_equal(run(ir, None, y), X0 + C)


@pytest.mark.parametrize(
    "cond_value", [np.int32(1), np.float32(1.0), np.array([True, False]), np.ones((1, 2), np.bool_)]
)
def test_conditional_needs_one_element_bool(cond_value):
    """§11.12: not auto-cast; exactly one element. IfOp::setup (willow/src/op/if.cpp) does not
    check `cond`; IfOpx reshapes it to a scalar predicate (willow/src/popx/op/ifx.cpp), so it
    fails when the Session compiles."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda a: a + 1.0, x)
        cond = popxl.constant(cond_value)
        (y,) = ops.conditional(cond, g, g, then_inputs=[x], else_inputs=[x])
        store(y)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_conditional_output_count_mismatch_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g1 = ir.create_graph(lambda a: a + 1.0, x)
        g2 = ir.create_graph(lambda a: (a, a), x)
        cond = popxl.constant(True)
        with pytest.raises(ValueError):
            ops.conditional(cond, g1, g2, then_inputs=[x], else_inputs=[x])


def test_conditional_missing_branch_input_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g1 = ir.create_graph(lambda a: a + 1.0, x)
        g2 = ir.create_graph(lambda a, b: a - b, x, x)
        cond = popxl.constant(True)
        with pytest.raises(ValueError):
            ops.conditional(cond, g1, g2, then_inputs=[x], else_inputs=[x])


def test_conditional_else_output_spec_mismatch_fails_at_session():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g1 = ir.create_graph(lambda a: a + 1.0, x)
        g2 = ir.create_graph(lambda a: ops.sum(a), x)
        (y,) = ops.conditional(popxl.constant(True), g1, g2, then_inputs=[x], else_inputs=[x])
        store(y)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_conditional_by_ref_input_not_implemented():
    def bump(a: popxl.TensorByRef):
        a += 1.0

    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(X0)
        g1 = ir.create_graph(bump, v)
        g2 = ir.create_graph(lambda a: None, v)
        with pytest.raises(NotImplementedError):
            ops.conditional(popxl.constant(True), g1, g2, then_inputs=[v], else_inputs=[v])


# --- pass by reference ---------------------------------------------------------------------------


def _bump_by_ref(a: popxl.TensorByRef, b):
    a += b


def _bump_by_value(a, b):
    a += b


@pytest.mark.parametrize("by_ref", [True, False])
def test_call_by_ref_writes_back_and_by_value_does_not(by_ref):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        v = popxl.variable(X0, name="v")
        c = popxl.constant(C)
        g = ir.create_graph(_bump_by_ref if by_ref else _bump_by_value, v, c)
        ops.call(g, v, c)
        ops.call(g, v, c)
        out = store(v)
    with popxl.Session(ir, "ipu_model") as session:
        r = session.run()[out]
        v_data = session.get_tensor_data(v)
    want = X0 + 2 * C if by_ref else X0
    np.testing.assert_array_equal(r, want)
    np.testing.assert_array_equal(v_data, want)


def test_graph_input_by_ref_flag_and_accumulate():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        v = popxl.variable(np.zeros(3, np.float32), name="acc")
        g = ir.create_empty_graph("accum")
        with g:
            acc = popxl.graph_input((3,), f32, "acc", by_ref=True)
            x = popxl.graph_input((3,), f32, "x")
            ops.var_updates.accumulate_(acc, x)
        ops.call(g, v, popxl.constant(C))
        out = store(v)
    np.testing.assert_array_equal(run(ir, None, out), C)


def test_repeat_by_ref_invariant_keeps_changes_and_writes_back():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        i0 = popxl.constant(np.int32(0))
        buf = popxl.variable(np.zeros(3, np.float32), name="buf")

        def body(i, b: popxl.TensorByRef):
            b += ops.cast(i, f32)  # 0, then 1, 2, 3
            return i + 1

        g = ir.create_graph(body, i0, buf)
        (i_end,) = ops.repeat(g, 4, i0, buf)
        out_buf, out_i = store(buf), store(i_end)
    rb, ri = run(ir, None, [out_buf, out_i])
    np.testing.assert_array_equal(rb, np.full(3, 6.0, np.float32))
    assert ri == 4


def test_repeat_without_by_ref_in_place_stays_local():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        i0 = popxl.constant(np.int32(0))
        buf = popxl.variable(np.zeros(3, np.float32), name="buf")

        def body(i, b):
            b += 1.0
            return i + 1

        g = ir.create_graph(body, i0, buf)
        ops.repeat(g, 4, i0, buf)
        out_buf = store(buf)
    np.testing.assert_array_equal(run(ir, None, out_buf), np.zeros(3, np.float32))


def test_conditional_branch_inputs_must_be_lists():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda a: a + 1.0, x)
        with pytest.raises(Exception):
            ops.conditional(popxl.constant(True), g, g, then_inputs=x, else_inputs=[x])
