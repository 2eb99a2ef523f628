"""``profile.boundary_bytes_copied``: the copies Poplar's lowering makes at subgraph boundaries.

Model (``popxl_flash/emulator/copies.py``, emulator README "Lowering copies"), one micro-graph
per rule, each figure computed by hand in the docstring. PopXL sets ``aliasZeroCopy``; PopART's
``checkSubgraphInputCompatible`` aliases a call input when ``!conflict && (!overlapping ||
!modified)``; ``LoopOpx`` copies carried values through clones every iteration; ``IfOpx``
copies every input and output of the taken branch; constants are always live.

Sizes: N = 64 float32 = 256 bytes (B). LoopOpx's own copies (``"loop_control"``): 2 bytes once
(true into the condition's clone, false into the exit flag), 6 bytes per iteration (int32
iterator, bool condition into its clone and back).
"""
import numpy as np
import pytest

from conftest import emulator_only, store
from popxl_flash import popxl

pytestmark = emulator_only

ops = popxl.ops
f32 = popxl.float32
N = 64
B = 4 * N
CONTROL_ONCE, CONTROL_STEP = 2, 6


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


def _kinds(**nonzero):
    kinds = dict.fromkeys(("call", "branch", "loop_carried", "loop_in_out", "loop_control"), 0)
    kinds.update(nonzero)
    return kinds


def _inc(a: popxl.TensorByRef):
    ops.add_(a, popxl.constant(np.float32(1.0)))


def test_straight_line_graph_copies_nothing():
    prof = _profile(_main(lambda ir, x: x + 1.0))
    assert prof.boundary_bytes_copied == 0
    assert prof.boundary_copied_by_kind == _kinds()


@pytest.mark.parametrize("read_after", [False, True])
def test_call_by_value_unmodified_input_is_aliased(read_after):
    """(f) The callee reads x without modifying it: aliased (``!modified``) whether or not the
    caller reads x again; its output is fresh: aliased too. 0 bytes."""
    def body(ir, x):
        y = ops.call(ir.create_graph(lambda a: a + 1.0, x), x)[0]
        return y + x if read_after else y
    assert _profile(_main(body)).boundary_bytes_copied == 0


@pytest.mark.parametrize("read_after", [False, True])
def test_call_by_value_modified_input_copied_only_when_the_parent_is_live(read_after):
    """The callee modifies its by-value input in place. x dead after the call: no liveness
    overlap, aliased, 0 bytes. x read after the call: overlapping and modified, copied in: B
    (a by-value input is never copied back)."""
    def callee(a):
        ops.add_(a, popxl.constant(np.float32(1.0)))
        return a * 2.0

    def body(ir, x):
        y = ops.call(ir.create_graph(callee, x), x)[0]
        return y + x if read_after else y
    prof = _profile(_main(body))
    assert prof.boundary_bytes_copied == (B if read_after else 0)
    assert prof.boundary_copied_by_kind == _kinds(call=prof.boundary_bytes_copied)


@pytest.mark.parametrize("read_after", [False, True])
def test_call_returning_its_input(read_after):
    """The callee returns its input. x dead after: x, the callee's input and the call's output
    are one buffer, 0 bytes. x read after: the output overlaps x, copied out: B."""
    def body(ir, x):
        y = ops.call(ir.create_graph(lambda a: a, x), x)[0]
        return y + x if read_after else y
    assert _profile(_main(body)).boundary_bytes_copied == (B if read_after else 0)


def test_by_ref_input_modified_per_call_is_aliased():
    """Two calls modify x by reference, x is read afterwards. The copy back re-produces x after
    each call, so x is not live while the callee runs: aliased, 0 bytes per call."""
    def body(ir, x):
        g = ir.create_graph(_inc, x)
        ops.call(g, x)
        ops.call(g, x)
        return x
    assert _profile(_main(body)).boundary_bytes_copied == 0


def test_by_ref_input_with_a_concurrent_reader_is_copied_in_and_back():
    """A view of x taken before the calls and read after them keeps x's storage live across
    both calls: overlapping and modified, copied in and back at each call: 2 x 2B = 4B."""
    def body(ir, x):
        view = x.reshape_((N // 2, 2))
        g = ir.create_graph(_inc, x)
        ops.call(g, x)
        ops.call(g, x)
        return view
    prof = _profile(_main(body))
    assert prof.boundary_bytes_copied == 4 * B
    assert prof.boundary_copied_by_kind == _kinds(call=4 * B)


def test_by_ref_input_passed_on_by_ref_counts_as_modified():
    """A graph passing its by-ref input on by reference modifies it in PopART's eyes (PopXL
    marks the parent modified at every by-ref call site): with a view of x live across the
    outer call, the outer call copies x in and back (2B); the inner call's parent (the middle
    graph's input) is re-produced by its copy back and read by nobody else: aliased. A leaf
    callee that only reads its by-ref input shares it: 0."""
    def leaf(a: popxl.TensorByRef):
        return a + 1.0

    def middle(a: popxl.TensorByRef):
        return ops.call(popxl.gir().create_graph(leaf, a), a)[0]

    def run(fn):
        def body(ir, x):
            view = x.reshape_((N // 2, 2))
            y = ops.call(ir.create_graph(fn, x), x)[0]
            return y + view.reshape((N,))
        return _profile(_main(body)).boundary_bytes_copied
    assert run(leaf) == 0
    assert run(middle) == 2 * B


def test_constants_are_always_live():
    """(e) Constants are always live for AliasZeroCopy. A callee modifying its by-value input
    in place: a constant parent is copied in (B) where a dead tensor is aliased (0). A callee
    returning a constant: copied out (B). A repeat's carried constant initial value: copied
    into the clone once (B) like every carried value (below)."""
    def callee(a):
        ops.add_(a, popxl.constant(np.float32(1.0)))
        return a * 2.0

    def call_const(ir, x):
        c = popxl.constant(np.zeros(N, np.float32))
        return ops.call(ir.create_graph(callee, c), c)[0] + x

    def call_dead(ir, x):
        d = x + 0.0  # dead after the call
        return ops.call(ir.create_graph(callee, d), d)[0]

    def return_const(ir, x):
        g = ir.create_graph(lambda a: (a + 1.0, popxl.constant(np.ones(N, np.float32))), x)
        y, c = ops.call(g, x)
        return y + c
    assert _profile(_main(call_const)).boundary_bytes_copied == B
    assert _profile(_main(call_dead)).boundary_bytes_copied == 0
    assert _profile(_main(return_const)).boundary_bytes_copied == B

    def carried_const(ir, x):
        c = popxl.constant(np.zeros(N, np.float32))
        g = ir.create_graph(lambda acc, k: acc * k + 1.0, c, x)
        return ops.repeat(g, 3, c, x)[0]
    # once: c into the clone B, the clone out B; per iteration (3): clone -> input B,
    # output -> clone B; control 2 + 3 x 6.
    assert _profile(_main(carried_const)).boundary_bytes_copied == 2 * B + 3 * 2 * B + 2 + 3 * 6


@pytest.mark.parametrize("cond", [True, False])
def test_conditional_copies_all_inputs_and_outputs_of_the_taken_branch(cond):
    """IfOpx copies every input and output of the taken branch (never aliased): then reads
    x (B) and y (2B) and returns B: 4B; else reads x and returns B: 2B."""
    def body(ir, x):
        y = ops.init((2 * N,), f32, init_type="zero")
        then_g = ir.create_graph(lambda a, b: a + 1.0, x, y)
        else_g = ir.create_graph(lambda a: a * 2.0, x)
        return ops.conditional(popxl.constant(cond), then_g, else_g, then_inputs=[x, y],
                               else_inputs=[x])[0]
    prof = _profile(_main(body))
    assert prof.boundary_bytes_copied == (4 * B if cond else 2 * B)
    assert prof.boundary_copied_by_kind == _kinds(branch=prof.boundary_bytes_copied)


@pytest.mark.parametrize("levels", [1, 2])
def test_nested_conditionals_copy_at_every_level(levels):
    """(d) One conditional: the branch's input and output, 2B. Two nested: the outer branch
    copies x in and the result out (2B), the inner branch again (2B): 4B."""
    def inner(a):
        return a + 1.0

    def outer(a):
        g = popxl.gir().create_graph(inner, a)
        return ops.conditional(popxl.constant(True), g, g, then_inputs=[a], else_inputs=[a])[0]

    def body(ir, x):
        g = ir.create_graph(outer if levels == 2 else inner, x)
        return ops.conditional(popxl.constant(True), g, g, then_inputs=[x], else_inputs=[x])[0]
    prof = _profile(_main(body))
    assert prof.boundary_bytes_copied == 2 * B * levels
    assert prof.boundary_copied_by_kind == _kinds(branch=2 * B * levels)


@pytest.mark.parametrize("count", [0, 1, 5])
def test_repeat_copies_carried_values_through_the_clones(count):
    """(c) Carried acc (B), invariant k (B, read only: aliased, 0). Once: acc's initial value
    into its clone (B), the clone into the op output after the loop (B). Every iteration: the
    clone into the body input (B) and the body output into its clone (B), without an
    AliasZeroCopy check; the wrapper's call aliases acc (dead after the call) and k (not
    modified): 0."""
    def body(ir, x):
        k = ops.init((N,), f32, init_type="zero")
        g = ir.create_graph(lambda acc, kk: acc * kk + 1.0, x, k)
        return ops.repeat(g, count, x, k)[0]
    prof = _profile(_main(body))
    assert prof.boundary_copied_by_kind == _kinds(loop_in_out=2 * B, loop_carried=count * 2 * B,
                                               loop_control=CONTROL_ONCE + count * CONTROL_STEP)
    assert prof.boundary_bytes_copied == sum(prof.boundary_copied_by_kind.values())
    assert prof.boundary_bytes_copied == sum(b * n for (_, _, b), n in prof.copy_sites.items())


def test_repeat_dead_carried_input_is_not_copied_back():
    """A body that never reads its carried input: the clone -> input copy is dead code; the
    output -> clone copy is not (no check). Once: B (the initial value in: the loop's output
    is read) + B out; per iteration (4): B; control 2 + 4 x 6."""
    def body(ir, x):
        k = ops.init((N,), f32, init_type="zero")
        g = ir.create_graph(lambda acc, kk: kk * 2.0, x, k)
        return ops.repeat(g, 4, x, k)[0]
    prof = _profile(_main(body))
    assert prof.boundary_copied_by_kind == _kinds(loop_in_out=2 * B, loop_carried=4 * B,
                                               loop_control=CONTROL_ONCE + 4 * CONTROL_STEP)


def test_repeat_invariant_input_modified_by_value_is_copied_every_iteration():
    """The body modifies its invariant by-value input k in place: every next iteration reads
    k again, so the wrapper's k is live across the call and the call copies it in: B per
    iteration (3). Plus the carried acc as above: 2B once, 2B per iteration, control."""
    def callee(acc, kk):
        ops.add_(kk, popxl.constant(np.float32(1.0)))
        return acc + kk

    def body(ir, x):
        k = ops.init((N,), f32, init_type="zero")
        g = ir.create_graph(callee, x, k)
        return ops.repeat(g, 3, x, k)[0]
    prof = _profile(_main(body))
    assert prof.boundary_copied_by_kind == _kinds(call=3 * B, loop_in_out=2 * B,
                                               loop_carried=3 * 2 * B,
                                               loop_control=CONTROL_ONCE + 3 * CONTROL_STEP)


def _dynamic_update_loop(rows, count, concurrent_reader):
    """Main: x = zeros [rows, N] (rows * B bytes); repeat ``count``: body(i carried int32 [1],
    x by reference) writes row i of x with dynamic_update_ and returns i + 1; store x after."""
    def step(i, xx: popxl.TensorByRef):
        row = popxl.constant(np.ones((1, N), np.float32))
        ops.dynamic_update_(xx, i, row, axes=[0], sizes=[1], no_overlap=True)
        return i + popxl.constant(np.int32(1))

    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = ops.init((rows, N), f32, init_type="zero")
        view = x.reshape_((rows * N,)) if concurrent_reader else None
        i0 = popxl.constant(np.zeros(1, np.int32)) + popxl.constant(np.int32(0))
        g = ir.create_graph(step, i0, x)
        ops.repeat(g, count, i0, x)
        store(view if concurrent_reader else x)
    return _profile(ir)


@pytest.mark.parametrize("rows", [4, 16])
def test_repeat_by_ref_dynamic_update_read_by_nobody_else_copies_no_tensor(rows):
    """(a) x enters the loop by reference and is updated by dynamic_update_; nobody else reads
    it while the loop runs. The loop's copy back re-produces x after the loop, the wrapper
    call's copy back after each call: no liveness overlap, aliased at both levels: no copy of x
    at all, whatever its size. Left: the carried i (int32 [1], 4 bytes): once into its clone
    (4; the loop's output is never read: no copy out), every iteration (4) clone -> input 4 and
    output -> clone 4; control 2 + 4 x 6. Total 4 + 4 x 8 + 2 + 24 = 62."""
    prof = _dynamic_update_loop(rows, 4, concurrent_reader=False)
    assert prof.boundary_copied_by_kind == _kinds(loop_in_out=4, loop_carried=4 * 8,
                                               loop_control=CONTROL_ONCE + 4 * CONTROL_STEP)
    assert prof.boundary_bytes_copied == 62


@pytest.mark.parametrize("rows", [4, 16])
def test_repeat_by_ref_with_a_concurrent_reader_is_copied_once_per_repeat(rows):
    """(b) The same with a view of x taken before the loop and read after it: x's storage is
    live while the loop runs, overlapping and modified, so LoopOpx copies x into the wrapper
    once and back once (2 x rows x B); inside, the wrapper's own x is re-produced by each
    call's copy back: still aliased per iteration. 62 + 2 x rows x B."""
    prof = _dynamic_update_loop(rows, 4, concurrent_reader=True)
    assert prof.boundary_copied_by_kind == _kinds(loop_in_out=4 + 2 * rows * B,
                                               loop_carried=4 * 8,
                                               loop_control=CONTROL_ONCE + 4 * CONTROL_STEP)
    assert prof.boundary_bytes_copied == 62 + 2 * rows * B
    # The wrapper's copy of x is live during the loop next to x: the peak holds x twice.
    alone = _dynamic_update_loop(rows, 4, concurrent_reader=False)
    assert prof.peak_live_bytes - alone.peak_live_bytes == rows * B


def test_modified_by_ref_input_counts_in_the_peak_only_when_copied():
    """The callee's copy of a by-ref input it modifies is live next to the caller's, so it
    counts in the peak; an aliased one is one buffer. x: M floats (4M bytes)."""
    M = 100_000

    def run(concurrent_reader):
        ir = popxl.Ir()
        with ir.main_graph, popxl.in_sequence():
            x = ops.init((M,), f32, init_type="zero")
            view = x.reshape_((M // 2, 2)) if concurrent_reader else x
            ops.call(ir.create_graph(_inc, x), x)
            store(view)
        return _profile(ir)
    aliased, copied = run(False), run(True)
    assert aliased.boundary_bytes_copied == 0
    assert aliased.peak_live_bytes - aliased.const_bytes == 4 * M
    assert copied.boundary_bytes_copied == 2 * 4 * M
    assert copied.peak_live_bytes - copied.const_bytes == 2 * 4 * M


def _row_update(i, xx):
    row = popxl.constant(np.ones((1, N), np.float32))
    ops.dynamic_update_(xx, i, row, axes=[0], sizes=[1], no_overlap=True)
    return i + popxl.constant(np.int32(1))


@pytest.mark.parametrize("view_first", [False, True])
def test_repeat_by_ref_with_a_view_also_passed_in(view_first):
    """A view of x (same bytes) is also an invariant input the body reads, while x is updated
    by reference. AliasZeroCopy processes the wrapper's inputs by bytes, then index, largest
    first. View after x (higher index): the view is aliased first, so x's storage is live in
    the loop: x copied in and back once (2 x rows x B). View before x: x is aliased first, then
    the view, which links the wrapper's x to the view the next iteration reads: the wrapper's
    call copies x in and back every iteration (count x 2 x rows x B). Plus the carried i and
    control as in (a): 62 with count 4."""
    rows, count = 4, 4
    if view_first:
        def step(i, vv, xx: popxl.TensorByRef):
            vv + 0.0
            return _row_update(i, xx)
    else:
        def step(i, xx: popxl.TensorByRef, vv):
            vv + 0.0
            return _row_update(i, xx)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = ops.init((rows, N), f32, init_type="zero")
        view = x.reshape_((rows * N,))
        i0 = popxl.constant(np.zeros(1, np.int32)) + popxl.constant(np.int32(0))
        ins = (i0, view, x) if view_first else (i0, x, view)
        ops.repeat(ir.create_graph(step, *ins), count, *ins)
        store(x)
    prof = _profile(ir)
    whole = 2 * rows * B
    assert prof.boundary_copied_by_kind == _kinds(
        loop_in_out=4 + (0 if view_first else whole), loop_carried=count * 8,
        call=count * whole if view_first else 0,
        loop_control=CONTROL_ONCE + count * CONTROL_STEP)


@pytest.mark.parametrize("view_first", [False, True])
def test_call_by_ref_with_a_view_also_passed_in(view_first):
    """The call version: view after x (processed first): x copied in and back, 2B; view before
    x: x aliased first, then the view: 0."""
    def callee(a: popxl.TensorByRef, v):
        _inc(a)
        return v + 1.0

    def callee_view_first(v, a: popxl.TensorByRef):
        _inc(a)
        return v + 1.0

    def body(ir, x):
        view = x.reshape_((N // 2, 2))
        fn, ins = (callee_view_first, (view, x)) if view_first else (callee, (x, view))
        y = ops.call(ir.create_graph(fn, *ins), *ins)[0]
        return y.reshape((N,)) + x  # x read after the call: its copy back is not dead
    assert _profile(_main(body)).boundary_bytes_copied == (0 if view_first else 2 * B)
