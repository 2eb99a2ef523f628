"""``profile.bytes_copied``: the copies Poplar's lowering makes at subgraph boundaries.

Model (emulator README, "Lowering copies"): IfOpx copies every input and output of the taken
branch; CallOpx copies an input in only when the callee modifies it (in place, or by passing it
by reference to a further call or repeat: PopXL marks a by-ref input modified at its call
site), copies modified by-ref inputs back, and gives an output its own copy only when it is a
graph input or a constant (AliasZeroCopy shares the rest); LoopOpx copies the carried values
into its clones once before, the body outputs into the clones every iteration, and the clones
out once after, around the wrapper's CallOpx copies per iteration.
"""
import numpy as np
import pytest

from conftest import emulator_only, store
from popxl_flash import popxl

pytestmark = emulator_only

ops = popxl.ops
f32 = popxl.float32
N = 64  # floats per tensor: 256 bytes
B = 4 * N


def _profile(ir):
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        return session.profile


def _main(body):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = ops.init((N,), f32, init_type="zero")
        y = body(ir, x)
        if y is not None:
            store(y)
    return ir


def test_straight_line_graph_copies_nothing():
    assert _profile(_main(lambda ir, x: x + 1.0)).bytes_copied == 0


def test_call_of_unmodified_input_with_fresh_output_copies_nothing():
    def body(ir, x):
        return ops.call(ir.create_graph(lambda a: a + 1.0, x), x)[0]
    assert _profile(_main(body)).bytes_copied == 0


def test_call_returning_its_input_copies_the_output():
    def body(ir, x):
        return ops.call(ir.create_graph(lambda a: a, x), x)[0]
    assert _profile(_main(body)).bytes_copied == B


def test_by_ref_input_is_copied_in_and_back_per_call():
    def inc(a: popxl.TensorByRef):
        ops.add_(a, popxl.constant(np.float32(1.0)))

    def body(ir, x):
        g = ir.create_graph(inc, x)
        ops.call(g, x)
        ops.call(g, x)
        return None
    assert _profile(_main(body)).bytes_copied == 2 * 2 * B


def test_by_ref_input_passed_on_by_ref_counts_as_modified():
    """A leaf callee that only reads a by-ref input shares its buffer (nothing copied), but a
    graph passing it on by reference modifies it in PopART's eyes (PopXL calls
    ``set_parent_input_modified`` at every by-ref call site), so its own call copies it."""
    def leaf(a: popxl.TensorByRef):
        return a + 1.0

    def middle(a: popxl.TensorByRef):
        return ops.call(popxl.gir().create_graph(leaf, a), a)[0]

    def body_leaf(ir, x):
        return ops.call(ir.create_graph(leaf, x), x)[0]

    def body_middle(ir, x):
        return ops.call(ir.create_graph(middle, x), x)[0]
    assert _profile(_main(body_leaf)).bytes_copied == 0
    assert _profile(_main(body_middle)).bytes_copied == 2 * B  # in and back at the outer call


@pytest.mark.parametrize("cond", [True, False])
def test_conditional_copies_all_inputs_and_outputs_of_the_taken_branch(cond):
    def body(ir, x):
        y = ops.init((2 * N,), f32, init_type="zero")
        then_g = ir.create_graph(lambda a, b: a + 1.0, x, y)  # in 3B, out B
        else_g = ir.create_graph(lambda a: a * 2.0, x)  # in B, out B
        return ops.conditional(popxl.constant(cond), then_g, else_g, then_inputs=[x, y],
                               else_inputs=[x])[0]
    assert _profile(_main(body)).bytes_copied == (4 * B if cond else 2 * B)


@pytest.mark.parametrize("count", [0, 1, 5])
def test_repeat_copies_carried_values_through_the_clones(count):
    def body(ir, x):
        k = ops.init((N,), f32, init_type="zero")
        g = ir.create_graph(lambda acc, kk: acc * kk + 1.0, x, k)  # carried acc, implicit kk
        return ops.repeat(g, count, x, k)[0]
    assert _profile(_main(body)).bytes_copied == 2 * B + count * B


def test_modified_by_ref_input_counts_in_the_peak():
    """The callee's copy of a by-ref input it modifies is live next to the caller's."""
    M = 100_000

    def inc(a: popxl.TensorByRef):
        ops.add_(a, popxl.constant(np.float32(1.0)))

    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = ops.init((M,), f32, init_type="zero")
        ops.call(ir.create_graph(inc, x), x)
        store(x)
    profile = _profile(ir)
    assert profile.peak_live_bytes >= 2 * 4 * M
    assert profile.bytes_copied == 2 * 4 * M
