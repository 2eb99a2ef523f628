"""Binding parent tensors to subgraph inputs, and op-less subgraphs (reference §4, §11.15-16).

Each rule is settled by PopART's source (sdk-release-3.4), cited per test.
"""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, IR_ERRORS, run, store
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32
X0 = np.array([1.0, 2.0, 3.0], np.float32)


def _two_carried(a, b):
    return a + 1.0, b * 2.0


# --- repeat: one wrapper-graph input per bound input, named after the parent tensor ----------


def test_repeat_same_parent_for_two_carried_inputs_is_ir_error():
    """python/popxl/python_files/ops/repeat.py `_setup_inputs` adds wrapper input
    `<wrapper>/<parent name>` per input; the second one fails in `Tensors::insert`
    (willow/src/tensors.cpp: "tensor ... already in M") when `ops.repeat` is called."""
    ir = popxl.Ir()
    with ir.main_graph:
        z = ops.init((3,), f32)
        g = ir.create_graph(_two_carried, z, z)
        with pytest.raises(IR_ERRORS, match="already in M"):
            ops.repeat(g, 2, z, z)


def test_repeat_same_parent_for_two_invariant_inputs_is_ir_error():
    """The wrapper input is added for every input, carried or not (ops/repeat.py)."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda acc, a, b: acc + a * b, x, x, x)
        with pytest.raises(IR_ERRORS):
            ops.repeat(g, 2, popxl.constant(X0), inputs_dict={g.inputs[1]: x, g.inputs[2]: x})


def test_repeat_distinct_parents_run():
    ir = popxl.Ir()
    with ir.main_graph:
        a, b = ops.init((3,), f32), ops.init((3,), f32)
        g = ir.create_graph(_two_carried, a, b)
        ya, yb = ops.repeat(g, 3, a, ops.identity(b) + 1.0)
    out_a, out_b = run(ir, None, [ya, yb])
    np.testing.assert_array_equal(out_a, np.full(3, 3.0, np.float32))
    np.testing.assert_array_equal(out_b, np.full(3, 8.0, np.float32))


def test_repeat_parent_named_like_the_wrapper_iterator_is_ir_error():
    """ops/repeat.py `_setup_call_and_repeat` adds wrapper inputs `Iterator___` and
    `LoopCond___` first; a parent tensor of that name collides the same way."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0, name="Iterator___")
        g = ir.create_graph(lambda a: a + 1.0, x)
        with pytest.raises(IR_ERRORS):
            ops.repeat(g, 2, x)


# --- call: duplicates allowed, except where a by-ref input's parent must be marked modified ---


def test_call_same_parent_twice_by_value_is_fine():
    """ops/call.py connects each index to the parent id; nothing looks an index up."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda a, b: a * b, x, x)
        (y,) = ops.call(g, x, x)
    np.testing.assert_array_equal(run(ir, None, y), X0 * X0)


def test_call_same_parent_for_a_by_ref_input_and_another_is_ir_error():
    """ops/call.py step 4: `set_parent_input_modified` -> `Op::inIndex(parent)`, which raises
    "Tensor ... is an input of ... at more than one index" (willow/src/op.cpp)."""
    def bump(acc: popxl.TensorByRef, step):
        acc += step

    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(X0)
        g = ir.create_graph(bump, v, v)
        with pytest.raises(IR_ERRORS, match="more than one index"):
            ops.call(g, v, v)


def test_conditional_same_parent_for_several_inputs_is_fine():
    """ops/conditional.py connects parent ids directly (no wrapper graph, no index lookup)."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        then_g = ir.create_graph(lambda a, b: a + b, x, x)
        else_g = ir.create_graph(lambda a, b: a - b, x, x)
        (y,) = ops.conditional(popxl.constant(True), then_g, else_g, then_inputs=[x, x],
                               else_inputs=[x, x])
    np.testing.assert_array_equal(run(ir, None, y), X0 + X0)


# --- op-less graphs ---------------------------------------------------------------------------


@pytest.mark.parametrize("empty_branch", ["then", "else"])
def test_opless_conditional_branch_fails_at_session(empty_branch):
    """An op-less graph gets no program fragment; `IfOpx::grow` (willow/src/popx/op/ifx.cpp)
    asks `PopPrograms::scopeFragments` for it, which raises "There are no scope fragments"
    (willow/src/popx/popprograms.cpp) while the Session compiles, not at build time."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        busy = ir.create_graph(lambda a: a + 1.0, x)
        empty = ir.create_graph(lambda a: a, x)
        branches = (empty, busy) if empty_branch == "then" else (busy, empty)
        (y,) = ops.conditional(popxl.constant(True), *branches, then_inputs=[x],
                               else_inputs=[x])
        store(y)
    with pytest.raises(COMPILE_ERRORS, match="no scope fragments"):
        popxl.Session(ir, "ipu_model")


def test_identity_branch_compiles_and_runs():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        busy = ir.create_graph(lambda a: a + 1.0, x)
        same = ir.create_graph(ops.identity, x)
        (y,) = ops.conditional(popxl.constant(False), busy, same, then_inputs=[x],
                               else_inputs=[x])
    np.testing.assert_array_equal(run(ir, None, y), X0)


def test_opless_call_and_repeat_bodies_are_fine():
    """A called graph with no ops lowers to its copies only (CallOpx); a repeat body is called
    by the wrapper graph's CallOp, so the wrapper always has an op."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X0)
        g = ir.create_graph(lambda a: a, x)
        (y,) = ops.call(g, x)
        (z,) = ops.repeat(g, 3, x)
    out_y, out_z = run(ir, None, [y, z])
    np.testing.assert_array_equal(out_y, X0)
    np.testing.assert_array_equal(out_z, X0)
