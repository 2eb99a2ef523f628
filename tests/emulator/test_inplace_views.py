"""PopXL's in-place views (``reshape_``, ``transpose_``, ``flatten_``, ``slice_``, ``concat_``,
``detach_``), each test following the PopART source (sdk-release-3.4) named in it.

* Aliasing: an inplace view op's ``aliases(in, out)`` is ``uses(in)`` (``willow/include/popart/
  op/{reshape,transpose,slice,concat,detach}.hpp``); ``ConcatInplaceOp``'s output aliases every
  input. A write through any alias is read through every other. The outplace forms
  ``cloneNcopy`` their output (``willow/src/popx/op/{reshapex,transposex,slicex,concatx}.cpp``).
* Ambiguity: ``Session::checkInplacingAmbiguity`` (``willow/src/session.cpp``) runs poprithms'
  ``Graph::containsAmbiguity`` (``memory/inplace/graph.cpp``): a modifier of a tensor and an
  unordered reader of a tensor *sharing an element* with it (``allAliases``); a view op reads
  the elements it views (its alias gate is a ``readingConsumer``). Raised at
  ``popxl.Session(...)`` as ``popart_exception``.
* Autodiff: ``ConcatInplaceOp`` inherits ``ConcatOp::getGradOps`` (final); ``ReshapeInplaceOp``
  and ``TransposeInplaceOp`` keep ``Op::getGradOps`` (``{}``, ``willow/src/op.cpp``),
  ``DetachOp::getGradOps`` is ``{}``: no edge gradient (``GradGrower::processGradOps``,
  ``willow/src/transforms/autodiff/gradgrower.cpp``); ``SliceInplaceOp::getGradOps`` throws
  ``internal_error`` (``willow/src/op/slice.cpp``).

Runnable unchanged on the SDK: only the public popxl API; profile checks are emulator-only.
"""
import numpy as np
import pytest

import popxl_flash
from popxl_flash import popxl

from conftest import COMPILE_ERRORS, IR_ERRORS, emulator_only, run, store

ops = popxl.ops
f32 = popxl.float32
X = np.arange(12, dtype=np.float32).reshape(3, 4)


def _const(value):
    return popxl.constant(np.asarray(value, np.float32))


def _session_values(ir, streams, variables=()):
    """Run once; Returns: ([stream values], [variable values after the run])."""
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()
        return [out[s] for s in streams], [session.get_tensor_data(v) for v in variables]


# -- aliasing at run time -------------------------------------------------------------------
def test_write_through_concat_inplace_output_reaches_every_input():
    # ConcatInplaceOp::aliases(in, 0) = uses(in) for every input (op/concat.hpp);
    # ConcatInplaceOpx::grow returns the concatenated view (popx/op/concatx.cpp).
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        a = popxl.variable(X[:1], name="a")
        b = popxl.variable(X[1:], name="b")
        c = ops.concat_([a, b], axis=0)
        c += _const(np.arange(12).reshape(3, 4))
        s = store(b)
    (bs,), (av, bv) = _session_values(ir, [s], [a, b])
    want = X + np.arange(12).reshape(3, 4)
    np.testing.assert_array_equal(av, want[:1])
    np.testing.assert_array_equal(bv, want[1:])
    np.testing.assert_array_equal(bs, want[1:])


def test_write_to_an_input_is_read_through_concat_inplace():
    # The same alias edge, read the other way: the output is a view of the inputs.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        a = popxl.variable(X[:1], name="a")
        b = popxl.variable(X[1:], name="b")
        c = ops.concat_([b, a], axis=0)
        ops.var_updates.accumulate_(a, _const(np.full((1, 4), 100.0)))
        s = store(c)
    (cs,), _ = _session_values(ir, [s])
    np.testing.assert_array_equal(cs, np.concatenate([X[1:], X[:1] + 100]))


def test_concat_inplace_of_slices_of_one_tensor_writes_through_both():
    # poprithms concat of two settSample views of one allocation (op/concat.cpp
    # ConcatOp::growAliasModel, op/slice.cpp BaseSliceOp::growAliasModel): a rotated view.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        top = ops.slice_(x, start=0, stop=1, axis=0)
        rest = ops.slice_(x, start=1, stop=3, axis=0)
        rotated = ops.concat_([rest, top], axis=0)
        rotated += _const(np.array([[1.0], [2.0], [3.0]]) * np.ones((3, 4)))
    _, (xv,) = _session_values(ir, [], [x])
    np.testing.assert_array_equal(xv, X + np.array([[3.0], [1.0], [2.0]]))


def test_chained_transpose_then_flatten_views_alias_the_source():
    # TransposeInplaceOp then ReshapeInplaceOp (flatten_ builds ReshapeInplace,
    # python/popxl/python_files/ops/reshape.py): both alias uses(0), so the chain aliases x.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        flat = ops.flatten_(ops.transpose_(x))
        flat += _const(np.arange(12))
        ops.var_updates.accumulate_(x, _const(np.full((3, 4), 1000.0)))
        s = store(flat)
    (fs,), (xv,) = _session_values(ir, [s], [x])
    want_x = X + np.arange(12).reshape(4, 3).T + 1000
    np.testing.assert_array_equal(xv, want_x)
    np.testing.assert_array_equal(fs, want_x.T.reshape(-1))


def test_reversed_slice_inplace_writes_in_reverse_order():
    # BaseSliceOp::getSlices flips a step -1 slice (op/slice.cpp); SliceInplaceOpx reverses
    # the view (popx/op/slicex.cpp): element i of the view is element n-1-i of the region.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.zeros(5, np.float32), name="x")
        rev = ops.slice_(x, start=3, stop=0, step=-1)  # x[3], x[2], x[1]
        rev += _const([1.0, 2.0, 3.0])
    _, (xv,) = _session_values(ir, [], [x])
    np.testing.assert_array_equal(xv, [0.0, 3.0, 2.0, 1.0, 0.0])


def test_detach_inplace_aliases_its_input():
    # DetachInplaceOp::aliases = uses(in) (op/detach.hpp).
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        d = ops.detach_(x)
        d += _const(1.0)
    _, (xv,) = _session_values(ir, [], [x])
    np.testing.assert_array_equal(xv, X + 1)


@pytest.mark.parametrize("kind", ["reshape", "transpose", "slice", "concat", "flatten"])
def test_outplace_views_are_copies(kind):
    # ReshapeOpx/TransposeOpx/SliceOpx/ConcatOpx cloneNcopy their output (popx/op/
    # reshapex.cpp:27, transposex.cpp:38, slicex.cpp:61, concatx.cpp:79): later writes to the
    # source are not seen.
    build = {"reshape": lambda x: ops.reshape(x, (4, 3)),
             "transpose": lambda x: ops.transpose(x),
             "slice": lambda x: ops.slice(x, start=1, stop=3, axis=0),
             "concat": lambda x: ops.concat([x, x], axis=0),
             "flatten": lambda x: ops.flatten(x)}[kind]
    twin = {"reshape": lambda x: x.reshape(4, 3), "transpose": lambda x: x.T,
            "slice": lambda x: x[1:3], "concat": lambda x: np.concatenate([x, x]),
            "flatten": lambda x: x.reshape(-1)}[kind]
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        y = build(x)
        x += _const(1.0)
        s = store(y)
    (ys,), _ = _session_values(ir, [s])
    np.testing.assert_array_equal(ys, twin(X))


# -- the ambiguity check ----------------------------------------------------------------------
def test_unordered_writes_to_disjoint_slice_regions_are_not_ambiguous():
    # containsAmbiguity only pairs a modifier with readers of tensors in allAliases, which
    # share an element with it (poprithms memory/alias/graph.cpp Graph::allAliases).
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        top = ops.slice_(x, start=0, stop=1, axis=0)
        rest = ops.slice_(x, start=1, stop=3, axis=0)
        top_out = ops.add_(top, _const(1.0))
        rest_out = ops.add_(rest, _const(2.0))
        s0, s1 = store(top_out), store(rest_out)
    (t, r), (xv,) = _session_values(ir, [s0, s1], [x])
    np.testing.assert_array_equal(xv, X + np.array([[1.0], [2.0], [2.0]]))
    np.testing.assert_array_equal(t, xv[:1])
    np.testing.assert_array_equal(r, xv[1:])


def test_unordered_writes_to_overlapping_slice_regions_are_ambiguous():
    # Rows 0:2 and 1:3 share row 1: each add_ reads its own (modified) region, which aliases
    # the other's: Session::checkInplacingAmbiguity throws popart::error.
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        ops.add_(ops.slice_(x, start=0, stop=2, axis=0), _const(1.0))
        ops.add_(ops.slice_(x, start=1, stop=3, axis=0), _const(2.0))
    with pytest.raises(COMPILE_ERRORS, match="(?i)ambiguity"):
        popxl.Session(ir, "ipu_model")


def test_write_through_concat_inplace_with_an_unordered_read_of_an_input_is_ambiguous():
    # ConcatInplace is a view (not a reader), its output aliases the input a: a modifier of
    # the output and an unordered reader of a are ambiguous.
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(X[:1], name="a")
        b = popxl.variable(X[1:], name="b")
        ops.add_(ops.concat_([a, b], axis=0), _const(1.0))
        store(a * 2.0)
    with pytest.raises(COMPILE_ERRORS, match="(?i)ambiguity"):
        popxl.Session(ir, "ipu_model")


def test_write_through_one_part_of_concat_inplace_with_a_read_of_the_other_part_is_not():
    # The modified tensor (rows of a in the concat) and the read b share no element.
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(X[:1], name="a")
        b = popxl.variable(X[1:], name="b")
        c = ops.concat_([a, b], axis=0)
        ops.add_(ops.slice_(c, start=0, stop=1, axis=0), _const(1.0))
        s = store(b * 2.0)
    (bs,), (av,) = _session_values(ir, [s], [a])
    np.testing.assert_array_equal(bs, X[1:] * 2)
    np.testing.assert_array_equal(av, X[:1] + 1)


@pytest.mark.parametrize("view", ["reshape_", "transpose_", "detach_", "concat_", "reshape"])
def test_a_view_op_unordered_with_a_write_to_its_source_is_a_read(view):
    # AliasModel::insertViewChange (willow/src/alias/aliasmodel.cpp) grows a view change then
    # an alias gate, and AliasGate::isView is false (poprithms memory/inplace/ops.hpp): the
    # gate is a reading consumer of the viewed elements, so the view op itself is ambiguous
    # with an unordered write (identity ops such as detach_ grow the gate alone,
    # ElementWiseUnaryOp::growAliasModel in willow/src/op/elementwise.cpp).
    build = {"reshape_": lambda x: ops.reshape_(x, (4, 3)), "transpose_": ops.transpose_,
             "detach_": ops.detach_, "concat_": lambda x: ops.concat_([x, x], axis=0),
             "reshape": lambda x: ops.reshape(x, (4, 3))}[view]
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        build(x)
        ops.add_(x, _const(1.0))
    with pytest.raises(COMPILE_ERRORS, match="(?i)ambiguity"):
        popxl.Session(ir, "ipu_model")


@pytest.mark.parametrize("kind", ["slice", "slice_"])
def test_a_slice_reads_only_its_region(kind):
    # The gate after BaseSliceOp's settSample view change reads the region: a slice of row 0
    # unordered with a write to rows 1:3 is not ambiguous (nor is the outplace slice's copy).
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        top = getattr(ops, kind)(x, start=0, stop=1, axis=0)
        ops.add_(ops.slice_(x, start=1, stop=3, axis=0), _const(1.0))
        s = store(top * 1.0)
    (ts,), (xv,) = _session_values(ir, [s], [x])
    np.testing.assert_array_equal(ts, X[:1])
    np.testing.assert_array_equal(xv, X + np.array([[0.0], [1.0], [1.0]]))


def test_read_of_a_view_unordered_with_a_write_to_its_source_is_ambiguous():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        v = ops.transpose_(x)
        ops.add_(x, _const(1.0))
        store(v * 2.0)
    with pytest.raises(COMPILE_ERRORS, match="(?i)ambiguity"):
        popxl.Session(ir, "ipu_model")


# -- ops.call and ops.repeat ------------------------------------------------------------------
def _add_one(t: popxl.TensorByRef):
    t += 1.0


def _add_one_by_value(t):
    t += 1.0


def test_call_by_ref_on_a_slice_inplace_view_updates_that_region():
    # CallOpx copies a modified input back into the parent tensor (popx/op/callx.cpp); the
    # parent tensor is a view of x (SliceInplaceOp::aliases), so x's region changes.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        mid = ops.slice_(x, start=1, stop=3, axis=1)
        ops.call(ir.create_graph(_add_one, mid), mid)
    _, (xv,) = _session_values(ir, [], [x])
    want = X.copy()
    want[:, 1:3] += 1
    np.testing.assert_array_equal(xv, want)


def test_call_by_ref_on_a_concat_inplace_view_updates_every_input():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        a = popxl.variable(X[:1], name="a")
        b = popxl.variable(X[1:], name="b")
        c = ops.concat_([a, b], axis=0)
        ops.call(ir.create_graph(_add_one, c), c)
        s = store(c)
    (cs,), (av, bv) = _session_values(ir, [s], [a, b])
    np.testing.assert_array_equal(av, X[:1] + 1)
    np.testing.assert_array_equal(bv, X[1:] + 1)
    np.testing.assert_array_equal(cs, X + 1)


def test_call_by_value_on_a_view_leaves_the_source():
    # A by-value input is the callee's own copy (CallOpx copies it in, never back).
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        v = ops.flatten_(ops.transpose_(x))
        ops.call(ir.create_graph(_add_one_by_value, v), v)
    _, (xv,) = _session_values(ir, [], [x])
    np.testing.assert_array_equal(xv, X)


def _update_through_views(t: popxl.TensorByRef):
    flat = ops.flatten_(ops.transpose_(t))
    flat += _const(np.arange(12))


def test_views_of_a_by_ref_input_inside_the_callee_update_the_parent():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        ops.call(ir.create_graph(_update_through_views, x), x)
    _, (xv,) = _session_values(ir, [], [x])
    np.testing.assert_array_equal(xv, X + np.arange(12).reshape(4, 3).T)


def test_a_callee_output_that_is_a_view_of_its_input_is_a_copy_in_the_caller():
    # PopXL's CallOp has no input-output alias (its outputs are the callee's outputs copied
    # out, popx/op/callx.cpp): a later write to the argument is not seen by the output.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        (y,) = ops.call(ir.create_graph(lambda t: ops.transpose_(t), x), x)
        x += _const(1.0)
        s = store(y)
    (ys,), _ = _session_values(ir, [s])
    np.testing.assert_array_equal(ys, X.T)


def _bump_column(t: popxl.TensorByRef):
    col = ops.slice_(t, start=2, stop=3, axis=1)
    col += 1.0


def test_repeat_body_writing_a_view_of_a_by_ref_input_accumulates():
    # LoopOp copies modified implicit inputs back after the loop (popx/op/loopx.cpp); each
    # iteration writes the column through the body's slice_ view.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        ops.repeat(ir.create_graph(_bump_column, x), 5, x)
    _, (xv,) = _session_values(ir, [], [x])
    want = X.copy()
    want[:, 2] += 5
    np.testing.assert_array_equal(xv, want)


def _bump_flat(t: popxl.TensorByRef):
    t += _const(np.arange(12))


def test_repeat_by_ref_on_a_flattened_transpose_view_updates_the_source_each_iteration():
    # The by-ref argument is flatten_(transpose_(x)), a view of x (ReshapeInplaceOp of a
    # TransposeInplaceOp); LoopOp's modified input reaches it, hence x.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        flat = ops.flatten_(ops.transpose_(x))
        ops.repeat(ir.create_graph(_bump_flat, flat), 4, flat)
        s = store(flat)
    (fs,), (xv,) = _session_values(ir, [s], [x])
    want = X + 4 * np.arange(12).reshape(4, 3).T
    np.testing.assert_array_equal(xv, want)
    np.testing.assert_array_equal(fs, want.T.reshape(-1))


def _view_outputs(t):
    u = ops.concat_([t, t], axis=0) + 1.0  # [6, 4]
    return ops.reshape_(ops.slice_(ops.reshape_(u, (2, 3, 4)), start=0, stop=1, axis=0), (3, 4))


def test_repeat_body_output_that_is_a_view_carries_its_value():
    # LoopOpx copies each body output into the carried input's clone (popx/op/loopx.cpp): a
    # view output carries the viewed values, iteration after iteration.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        (y,) = ops.repeat(ir.create_graph(_view_outputs, x), 3, x)
        s = store(y)
    (ys,), (xv,) = _session_values(ir, [s], [x])
    np.testing.assert_array_equal(ys, X + 3)
    np.testing.assert_array_equal(xv, X)


def _concat_body(a: popxl.TensorByRef, b: popxl.TensorByRef):
    c = ops.concat_([a, b], axis=0)
    c += _const(np.arange(12).reshape(3, 4))


def test_repeat_body_writing_through_concat_inplace_updates_both_inputs():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        a = popxl.variable(X[:1], name="a")
        b = popxl.variable(X[1:], name="b")
        ops.repeat(ir.create_graph(_concat_body, a, b), 3, a, b)
    _, (av, bv) = _session_values(ir, [], [a, b])
    want = X + 3 * np.arange(12).reshape(3, 4)
    np.testing.assert_array_equal(av, want[:1])
    np.testing.assert_array_equal(bv, want[1:])


# -- autodiff -----------------------------------------------------------------------------------
def _grads(fn, arrays, dy, required=None):
    """Autodiff ``fn``'s graph and run forward and gradient. Returns: the gradients."""
    ir = popxl.Ir()
    with ir.main_graph:
        xs = [popxl.constant(a) for a in arrays]
        graph = ir.create_graph(fn, *xs)
        info = popxl.transforms.autodiff(
            graph, grads_required=None if required is None else [graph.inputs[i]
                                                                 for i in required])
        call = ops.call_with_info(graph, *xs)
        grads = ops.call(info.graph, popxl.constant(dy), inputs_dict=info.inputs_dict(call))
    return run(ir, None, list(grads))


def test_concat_inplace_is_differentiable_like_concat():
    # ConcatInplaceOp inherits ConcatOp::getGradOps (final): one ConcatGradOp per input.
    a, b = X[:1], X[1:]
    dy = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    ga, gb = _grads(lambda p, q: ops.concat_([p, q], axis=0) * 3.0, [a, b], dy)
    np.testing.assert_array_equal(ga, 3 * dy[:1])
    np.testing.assert_array_equal(gb, 3 * dy[1:])


@pytest.mark.parametrize("view", ["reshape_", "transpose_", "detach_", "flatten_"])
def test_inplace_views_without_grad_ops_cannot_provide_a_required_gradient(view):
    # ReshapeInplaceOp/TransposeInplaceOp keep Op::getGradOps ({}), DetachOp's is {}: no edge
    # gradient, so BackwardsGraphCreatorHelper throws "[Autodiff] Unable to provide required
    # gradient output" (transforms/autodiff/backwardsgraphcreatorhelper.cpp) at autodiff.
    build = {"reshape_": lambda t: ops.reshape_(t, (4, 3)), "transpose_": ops.transpose_,
             "detach_": ops.detach_, "flatten_": ops.flatten_}[view]
    ir = popxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda t: build(t) * 2.0, popxl.constant(X))
        with pytest.raises(IR_ERRORS, match="Unable to provide required gradient"):
            popxl.transforms.autodiff(graph)


@pytest.mark.parametrize("view", ["reshape_", "transpose_", "detach_"])
def test_a_gradient_through_an_inplace_view_without_grad_ops_is_dropped(view):
    # GradGrower::processGradOps decrements the expected edge count of an input no grad op
    # produces: the gradient sum is formed from the other edges only.
    build = {"reshape_": lambda t: ops.reshape(ops.reshape_(t, (4, 3)), (3, 4)),
             "transpose_": lambda t: ops.transpose(ops.transpose_(t)),
             "detach_": ops.detach_}[view]
    dy = np.ones((3, 4), np.float32)
    (g,) = _grads(lambda t: build(t) * 5.0 + t * 2.0, [X], dy)
    np.testing.assert_array_equal(g, np.full((3, 4), 2.0))


def test_autodiff_through_slice_inplace_raises_an_internal_error():
    # SliceInplaceOp::getGradOps throws internal_error ("All gradients should be generated
    # before any inplacing is performed", op/slice.cpp): popart_internal_exception at
    # autodiff, once the op's output gradient is available.
    ir = popxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda t: ops.slice_(t, start=0, stop=2, axis=0) * 2.0,
                                popxl.constant(X))
        with pytest.raises(IR_ERRORS, match="All gradients should be generated") as raised:
            popxl.transforms.autodiff(graph)
    if popxl_flash.BACKEND == "emulator":  # popart_internal_exception, a popart_exception
        from popxl_flash.emulator.errors import PopartInternalError
        assert raised.type is PopartInternalError


def test_slice_inplace_off_the_gradient_path_does_not_raise():
    # Only ops whose outputs get a gradient grow grad ops (OpGradRegistry::insert ignores
    # outputs not on the path to the loss).
    ir = popxl.Ir()
    with ir.main_graph:
        def fn(t):
            ops.slice_(t, start=0, stop=2, axis=0)
            return t * 2.0
        graph = ir.create_graph(fn, popxl.constant(X))
        info = popxl.transforms.autodiff(graph)
        assert [e.fwd_tensor for e in info.expected_outputs] == [graph.inputs[0]]


# -- error types and stages --------------------------------------------------------------------
def test_slice_inplace_with_start_after_stop_builds_and_fails_at_session():
    # BaseSliceOp::createOutInfo takes ceil(|end - start| / |step|) (op/slice.cpp); the
    # Session's alias map calls SliceInplaceOp::aliases -> getFullInRegion, whose
    # view::Region::checks throws popart::error for lower > upper (willow/src/region.cpp).
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        v = ops.slice_(x, start=3, stop=1, axis=1)
        assert v.shape == (3, 2)
        store(v * 1.0)
    with pytest.raises(COMPILE_ERRORS, match="lower bound"):
        popxl.Session(ir, "ipu_model")


def test_slice_inplace_with_step_two_builds_and_fails_at_session():
    # BaseSliceOp::growAliasModel refuses |step| != 1 (op/slice.cpp).
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        v = ops.slice_(x, start=0, stop=4, step=2, axis=1)
        assert v.shape == (3, 2)
        store(v * 1.0)
    with pytest.raises(COMPILE_ERRORS, match="Slice2SliceSubsample|step"):
        popxl.Session(ir, "ipu_model")


# -- memory accounting (emulator run profile) ---------------------------------------------------
def _peak(build):
    """Peak live bytes of x, y [64, 32] float32 and ``build(x, y)``, all stored to the host
    at the end (host_store allocates nothing)."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = ops.init((64, 32), f32, init_type="zero")
        y = ops.init((64, 32), f32, init_type="zero")
        out = build(x, y)
        for t in (out, x, y):
            store(t)
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        return session.profile.peak_live_bytes


_VIEW_PAIRS = {
    "reshape": lambda x, y, k: getattr(ops, k)(x, (32, 64)),
    "transpose": lambda x, y, k: getattr(ops, k)(x),
    "slice": lambda x, y, k: getattr(ops, k)(x, start=0, stop=32, axis=0),
    "concat": lambda x, y, k: getattr(ops, k)([x, y], axis=0),
    "flatten": lambda x, y, k: getattr(ops, k)(x),
}


@emulator_only
@pytest.mark.parametrize("kind", sorted(_VIEW_PAIRS))
def test_outplace_view_allocates_its_output_and_inplace_view_nothing(kind):
    # Outplace: cloneNcopy, a new tensor (fresh bytes, live with its source); `_`: an alias.
    build = _VIEW_PAIRS[kind]
    xy = 2 * 64 * 32 * 4
    out_bytes = {"slice": 32 * 32 * 4, "concat": xy}.get(kind, 64 * 32 * 4)
    assert _peak(lambda x, y: x) == xy
    assert _peak(lambda x, y: build(x, y, kind + "_")) == xy
    assert _peak(lambda x, y: build(x, y, kind)) == xy + out_bytes


def _join_input_to_local(t):
    c = ops.concat_([t * 2.0, t], axis=0)
    return t, c


def test_a_callee_output_joined_to_its_input_by_concat_inplace_is_a_copy_in_the_caller():
    # As above: CallOp outputs are copies out of the callee (popx/op/callx.cpp), also when a
    # concat_ makes the returned input one storage with the callee's own tensors.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X[:1], name="x")
        y, c = ops.call(ir.create_graph(_join_input_to_local, x), x)
        x += _const(1.0)
        s0, s1 = store(y), store(c)
    (ys, cs), _ = _session_values(ir, [s0, s1])
    np.testing.assert_array_equal(ys, X[:1])
    np.testing.assert_array_equal(cs, np.concatenate([2 * X[:1], X[:1]]))


def test_write_to_a_variable_joined_with_a_constant_by_concat_inplace():
    # Only the variable's elements are written: the constant's are not modified.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X[:1], name="x")
        c = ops.concat_([_const(X[1:]), x], axis=0)
        x += _const(1.0)
        s = store(c)
    (cs,), _ = _session_values(ir, [s])
    np.testing.assert_array_equal(cs, np.concatenate([X[1:], X[:1] + 1]))
