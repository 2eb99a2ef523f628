"""popxl.transforms.autodiff: gradient rules against float64 central differences, the
GradGraphInfo API, forward-graph stitching and the errors PopART raises (reference section 7).

Gradient checks: each case builds ``f(inputs)`` in float32, differentiates it with autodiff,
runs the forward and gradient graphs with a random output gradient ``dy`` and compares each
input gradient with a float64 central difference of ``sum(f64(inputs) * dy)`` (a NumPy twin of
``f``). Tolerance: the float32 graphs sum at most a few dozen terms per value, each rounding
contributing <= eps32 relative to the magnitudes involved, so ``64 * eps32 * scale`` with
``scale = max(1, max|reference|) * max(1, max|dy|)`` bounds them; the float64 central difference
(step 1e-6) is exact to ~1e-9 relative here, far below that.
"""
import numpy as np
import pytest

from popxl_flash import popxl

from conftest import IR_ERRORS, emulator_only, run

ops = popxl.ops
f32 = popxl.float32
EPS32 = float(np.finfo(np.float32).eps)
GELU_C = 0.7978845608028654


def _gelu64(x):
    return 0.5 * x * (1 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))


def _layer_norm64(x, g, b, eps=1e-5):
    m = x.mean(1, keepdims=True)
    v = ((x - m) ** 2).mean(1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def _softmax64(x, axis):
    """ONNX-11 softmax, as PopART: over every axis from ``axis`` on, flattened."""
    axes = tuple(range(axis, x.ndim))
    e = np.exp(x - x.max(axes, keepdims=True))
    return e / e.sum(axes, keepdims=True)


def _pos(shape):
    return lambda rng: rng.uniform(0.5, 2.0, shape)


def _normal(shape):
    return lambda rng: rng.standard_normal(shape)


def _mm_lhs_1d(a, b):
    return a @ b


def _call_nested(x, w):
    """``ops.call`` of a graph that itself calls a graph."""
    ir = popxl.gcg().ir
    inner = ir.create_graph(lambda a, b: ops.exp(a) * b, x, w)
    outer = ir.create_graph(lambda a, b: ops.call(inner, a @ b, b)[0] + a, x, w)
    return ops.call(outer, x, w)[0]


def _product(parts):
    return parts[1] * parts[0]


def _dyn_slice(x):
    idx = popxl.constant(np.array([1, 2], np.int32))
    return ops.dynamic_slice(x, idx, axes=[0, 1], sizes=[2, 3], no_overlap=True)


# name: (popxl builder, float64 twin, input makers)
CASES = {
    "matmul_broadcast": (lambda a, b: a @ b, lambda a, b: a @ b,
                         [_normal((2, 1, 3, 4)), _normal((3, 4, 5))]),
    "matmul_1d": (_mm_lhs_1d, _mm_lhs_1d, [_normal((4,)), _normal((2, 4, 3))]),
    "add_broadcast": (lambda a, b: a + b, lambda a, b: a + b, [_normal((3, 4)), _normal((4,))]),
    "sub_broadcast": (lambda a, b: a - b, lambda a, b: a - b, [_normal((3, 1)), _normal((3, 4))]),
    "mul_broadcast": (lambda a, b: a * b, lambda a, b: a * b, [_normal((2, 3)), _normal((1, 3))]),
    "div_broadcast": (lambda a, b: a / b, lambda a, b: a / b, [_normal((2, 3)), _pos((3,))]),
    "negate": (ops.negate, np.negative, [_normal((3, 2))]),
    "reshape_transpose": (lambda a: a.reshape((3, 2, 2)).transpose((2, 0, 1)),
                          lambda a: a.reshape(3, 2, 2).transpose(2, 0, 1), [_normal((4, 3))]),
    "slice": (lambda a: a[1:3, ::-1], lambda a: a[1:3, ::-1], [_normal((4, 3))]),
    "concat": (lambda a, b: ops.concat([a, b, a], axis=1),
               lambda a, b: np.concatenate([a, b, a], axis=1), [_normal((2, 3)), _normal((2, 1))]),
    # values exact in float16, so the round trip is the identity the gradient assumes
    "cast": (lambda a: ops.cast(ops.cast(a, popxl.float16), f32) * a, lambda a: a * a,
             [lambda rng: rng.integers(-8, 8, (5,)) / 4]),
    "split": (lambda a: _product(ops.split(a, [1, 3], axis=1)),
              lambda a: a[:, 1:] * a[:, :1], [_normal((2, 4))]),
    "sum": (lambda a: ops.sum(a, axis=[0, 2], keepdims=False), lambda a: a.sum(axis=(0, 2)),
            [_normal((2, 3, 4))]),
    "mean": (lambda a: ops.mean(a, axis=1, keepdims=True), lambda a: a.mean(1, keepdims=True),
             [_normal((3, 4))]),
    "softmax": (lambda a: ops.softmax(a, axis=-1), lambda a: _softmax64(a, 1), [_normal((4, 3))]),
    "logsumexp": (lambda a: ops.logsumexp(a, axis=[0, 2], keepdims=False),
                  lambda a: np.log(np.exp(a).sum(axis=(0, 2))), [_normal((2, 3, 4))]),
    "softmax_2d": (lambda a: ops.softmax(a, axis=1), lambda a: _softmax64(a, 1),
                   [_normal((2, 3, 4))]),
    "exp_log_sqrt": (lambda a: ops.exp(a) + ops.log(a) * ops.sqrt(a),
                     lambda a: np.exp(a) + np.log(a) * np.sqrt(a), [_pos((2, 3))]),
    "where": (lambda c, a, b: ops.where(ops.greater(c, a), a * a, b),
              lambda c, a, b: np.where(c > a, a * a, b),
              [_normal((3, 4)), _normal((3, 4)), _normal((4,))]),
    "gelu": (ops.gelu, _gelu64, [_normal((3, 5))]),
    "tanh_relu": (lambda a: ops.relu(ops.tanh(a)), lambda a: np.maximum(np.tanh(a), 0),
                  [_normal((3, 5))]),
    "pow": (ops.pow, np.power, [_pos((2, 3)), _normal((3,))]),
    "layer_norm": (ops.layer_norm, _layer_norm64, [_normal((3, 6)), _normal((6,)), _normal((6,))]),
    "dynamic_slice": (_dyn_slice, lambda a: a[1:3, 2:5], [_normal((4, 6))]),
    "identity": (lambda a: ops.identity(a) * a, lambda a: a * a, [_normal((3,))]),
    "call_nested": (_call_nested, lambda x, w: np.exp(x @ w) * w + x,
                    [_normal((3, 3)), _normal((3, 3))]),
}
#: inputs without a gradient (where's condition is compared, not differentiated)
NO_GRAD_INPUTS = {"where": {0}}
#: the cast case's gradient passes through float16 too: small dyadic dy keeps dy * a exact there
DY_MAKERS = {"cast": lambda rng, shape: rng.integers(-8, 8, shape) / 4}


def _central_difference(fn, inputs, dy, k, h=1e-6):
    grad = np.zeros_like(inputs[k])
    for idx in np.ndindex(grad.shape):
        plus = [a.copy() for a in inputs]
        minus = [a.copy() for a in inputs]
        plus[k][idx] += h
        minus[k][idx] -= h
        grad[idx] = ((fn(*plus) * dy).sum() - (fn(*minus) * dy).sum()) / (2 * h)
    return grad


def _autodiff_grads(build, arrays, dy, skip):
    """Run ``build`` and its autodiff gradient graph; return the gradients of the inputs whose
    position is not in ``skip``."""
    ir = popxl.Ir()
    with ir.main_graph:
        xs = [popxl.constant(a) for a in arrays]
        graph = ir.create_graph(build, *xs)
        info = popxl.transforms.autodiff(graph, grads_required=[
            t for i, t in enumerate(graph.inputs) if i not in skip])
        call = ops.call_with_info(graph, *xs)
        grads = ops.call(info.graph, popxl.constant(dy), inputs_dict=info.inputs_dict(call))
    return run(ir, None, list(grads))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_central_difference(name):
    build, twin, makers = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    x64 = [m(rng) for m in makers]
    arrays = [a.astype(np.float32) for a in x64]
    x64 = [a.astype(np.float64) for a in arrays]  # the float32 values, exactly
    out_shape = np.shape(twin(*x64))
    dy_maker = DY_MAKERS.get(name, lambda rng, shape: rng.standard_normal(shape))
    dy = dy_maker(rng, out_shape).astype(np.float32)
    skip = NO_GRAD_INPUTS.get(name, set())
    grads = _autodiff_grads(build, arrays, dy, skip)
    grads = grads if isinstance(grads, list) else [grads]
    wanted = [k for k in range(len(arrays)) if k not in skip]
    assert len(grads) == len(wanted)
    for k, g in zip(wanted, grads):
        ref = _central_difference(twin, x64, dy.astype(np.float64), k)
        assert g.shape == arrays[k].shape and g.dtype == np.float32
        scale = max(1.0, np.abs(ref).max()) * max(1.0, np.abs(dy).max())
        err = np.abs(g - ref).max()
        assert err <= 64 * EPS32 * scale, f"{name} input {k}: error {err:.3e}"


# -- GradGraphInfo and stitching -----------------------------------------------------------
def _two_layer(x, w):
    h = ops.exp(x @ w)           # exp's output h is read by its gradient: stitched
    return ops.sum(h * 3.0, axis=0)


def test_stitching_adds_outputs_to_existing_call_sites():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones((2, 3), np.float32))
        w = popxl.constant(np.ones((3, 4), np.float32))
        graph = ir.create_graph(_two_layer, x, w)
        early = ops.call_with_info(graph, x, w)   # created before autodiff
        assert len(early.outputs) == 1
        info = popxl.transforms.autodiff(graph)
        n_out = len(graph.outputs)
        assert n_out > 1                           # activations became outputs
        assert len(early.outputs) == n_out         # ... at the existing call site too
        late = ops.call_with_info(graph, x, w)
        assert len(late.outputs) == n_out
    kinds = [ec.connection_type for ec in info.expected_inputs]
    first_fwd = kinds.index(popxl.transforms.ExpectedConnectionType.Fwd)
    assert kinds[:first_fwd] == [popxl.transforms.ExpectedConnectionType.FwdGrad]
    assert info.expected_inputs[0].fwd_tensor == graph.outputs[0]
    assert [t.id for t in info.outputs] == [t.id for t in graph.inputs]
    assert info.forward_graph == graph
    for ec in info.expected_inputs[first_fwd:]:       # every Fwd input is an input or output
        assert ec.fwd_tensor in graph.inputs or ec.fwd_tensor in graph.outputs


def test_site_info_helpers():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.full((2, 3), 0.5, np.float32))
        w = popxl.constant(np.full((3, 4), 0.25, np.float32))
        graph = ir.create_graph(_two_layer, x, w)
        info = popxl.transforms.autodiff(graph, grads_required=[graph.inputs[1]])
        fwd = ops.call_with_info(graph, x, w)
        dy = popxl.constant(np.ones((4,), np.float32))
        grad = ops.call_with_info(info.graph, dy, inputs_dict=info.inputs_dict(fwd))
        assert list(info.fwd_graph_ins_to_grad_parent_outs(grad)) == [graph.inputs[1]]
        mapping = info.fwd_parent_ins_to_grad_parent_outs(fwd, grad)
        assert list(mapping) == [w]
        other = ir.create_graph(lambda a: a + 1.0, x)
        with pytest.raises(TypeError):
            info.inputs_dict(ops.call_with_info(other, x))
        dw = grad.outputs[0]
    # d/dw sum_i 3 exp(x w)_ij = 3 x^T exp(x w)
    expected = 3 * np.full((2, 3), 0.5).T @ np.exp(np.full((2, 4), 0.375))
    np.testing.assert_allclose(run(ir, None, dw), expected, rtol=1e-6)


def test_grad_graph_info_has_no_public_constructor():
    with pytest.raises(TypeError):
        popxl.transforms.GradGraphInfo()
    with pytest.raises(TypeError):
        popxl.transforms.ExpectedConnection()


def test_return_all_grad_graphs_lists_called_graphs():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones((3, 3), np.float32))
        inner = ir.create_graph(lambda a: ops.exp(a), x)
        outer = ir.create_graph(lambda a: ops.call(inner, a)[0] * a, x)
        infos = popxl.transforms.autodiff(outer, return_all_grad_graphs=True)
    assert set(infos) == {inner, outer}
    assert infos[inner].forward_graph == inner


# -- errors ---------------------------------------------------------------------------------
def test_required_gradient_without_path_raises():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        graph = ir.create_graph(lambda a, unused: a * a, x, x)
        with pytest.raises(IR_ERRORS, match="Unable to provide required gradient"):
            popxl.transforms.autodiff(graph)


def test_modifying_op_raises():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))

        def inplace(a):
            b = a * 2.0
            b += a
            return b
        graph = ir.create_graph(inplace, x)
        with pytest.raises(IR_ERRORS, match="modifying op"):
            popxl.transforms.autodiff(graph)


def test_repeat_is_not_differentiable():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        body = ir.create_graph(lambda a: a + a, x)
        graph = ir.create_graph(lambda a: ops.repeat(body, 2, a)[0], x)
        with pytest.raises(IR_ERRORS):
            popxl.transforms.autodiff(graph)


def _hand_written(ir, fwd, grad, ins, outs):
    """``GradGraphInfo._from_pb`` the SDK's way (emulator: its _internal_ir stand-in)."""
    from popxl_flash.emulator import _internal_ir as _ir
    conns = [[_ir.ExpectedConnection(t.id, getattr(_ir.ExpectedConnectionType, kind))
              for kind, t in spec] for spec in (ins, outs)]
    info = _ir.BwdGraphInfo(grad._pb_graph.id, *conns)
    return popxl.transforms.GradGraphInfo._from_pb(ir._pb_ir, fwd._pb_graph, info)


@emulator_only
def test_hand_written_gradient_graph_is_used_for_the_call():
    """A custom entry replaces differentiation of the callee: here a deliberately scaled
    gradient (10x) shows that the given graph, not autodiff's, computes it."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.full(3, 2.0, np.float32))
        callee = ir.create_graph(lambda a: a * a, x)
        grad = ir.create_graph(lambda dy, a: dy * a * 20.0, x, x)
        info = _hand_written(ir, callee, grad, [("FwdGrad", callee.outputs[0]),
                                                ("Fwd", callee.inputs[0])],
                             [("FwdGrad", callee.inputs[0])])
        parent = ir.create_graph(lambda a: ops.call(callee, a)[0] + a, x)
        pinfo = popxl.transforms.autodiff(parent, called_graphs_grad_info={callee: info})
        call = ops.call_with_info(parent, x)
        (dx,) = ops.call(pinfo.graph, popxl.constant(np.ones(3, np.float32)),
                         inputs_dict=pinfo.inputs_dict(call))
        assert len(callee.outputs) == 1   # a callee with an entry is not stitched
    np.testing.assert_array_equal(run(ir, None, dx), np.full(3, 41.0, np.float32))


@emulator_only
def test_descendants_of_a_custom_callee_need_entries():
    """Section 7.1: every graph reachable from the target is visited, also below a graph with
    an entry; a modifying descendant without an entry is refused."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))

        def modifying(a):
            b = a + 0.0
            b += a
            return b
        child = ir.create_graph(modifying, x)
        callee = ir.create_graph(lambda a: ops.call(child, a)[0], x)
        grad = ir.create_graph(lambda dy: dy * 2.0, x)
        info = _hand_written(ir, callee, grad, [("FwdGrad", callee.outputs[0])],
                             [("FwdGrad", callee.inputs[0])])
        parent = ir.create_graph(lambda a: ops.call(callee, a)[0], x)
        with pytest.raises(IR_ERRORS, match="modifying op"):
            popxl.transforms.autodiff(parent, called_graphs_grad_info={callee: info})
        empty = ir.create_empty_graph("no_grad")
        child_info = _hand_written(ir, child, empty, [], [])
        popxl.transforms.autodiff(parent, called_graphs_grad_info={callee: info,
                                                                   child: child_info})


@emulator_only
def test_graph_marked_not_recursively_differentiable_needs_an_entry():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        callee = ir.create_graph(lambda a: a * a, x)
        callee._pb_graph.setCanBeRecursivelyAutodiffed(False)
        parent = ir.create_graph(lambda a: ops.call(callee, a)[0], x)
        with pytest.raises(IR_ERRORS, match="unsafe to autodiff"):
            popxl.transforms.autodiff(parent)
        popxl.transforms.autodiff(callee)   # the target itself is exempt


@emulator_only
def test_expected_gradient_of_an_output_off_the_loss_path_is_not_optional():
    """An entry expecting FwdGrad of a callee output nobody differentiates: PopART's
    "No input found ... but input is not optional"."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        callee = ir.create_graph(lambda a: (a * a, a + 1.0), x)
        grad = ir.create_graph(lambda d0, d1, a: d0 * a * 2.0 + d1, x, x, x)
        info = _hand_written(ir, callee, grad, [("FwdGrad", callee.outputs[0]),
                                                ("FwdGrad", callee.outputs[1]),
                                                ("Fwd", callee.inputs[0])],
                             [("FwdGrad", callee.inputs[0])])
        parent = ir.create_graph(lambda a: ops.call(callee, a)[0], x)
        with pytest.raises(IR_ERRORS, match="not optional"):
            popxl.transforms.autodiff(parent, called_graphs_grad_info={callee: info})


def test_grads_provided_and_required_choose_inputs_and_outputs():
    """FwdGrad inputs follow grads_provided (kept even if unused), outputs follow
    grads_required, which may name an intermediate tensor."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.full((2,), 3.0, np.float32))
        inner = {}

        def fn(a, b):
            inner["h"] = a * b
            return inner["h"] + b, ops.exp(a)
        graph = ir.create_graph(fn, x, x)
        y, z = graph.outputs
        info = popxl.transforms.autodiff(graph, grads_provided=[z, y],
                                         grads_required=[inner["h"], graph.inputs[0]])
        FwdGrad = popxl.transforms.ExpectedConnectionType.FwdGrad
        assert [(e.connection_type, e.fwd_tensor) for e in info.expected_inputs[:2]] == [
            (FwdGrad, z), (FwdGrad, y)]
        assert [e.fwd_tensor for e in info.expected_outputs] == [inner["h"], graph.inputs[0]]
        call = ops.call_with_info(graph, x, x)
        dz = popxl.constant(np.full((2,), 2.0, np.float32))
        dy = popxl.constant(np.full((2,), 5.0, np.float32))
        dh, da = ops.call(info.graph, dz, dy, inputs_dict=info.inputs_dict(call))
    dh, da = run(ir, None, [dh, da])
    np.testing.assert_allclose(dh, 5.0)                             # dL/dh = dy
    np.testing.assert_allclose(da, 5.0 * 3.0 + 2.0 * np.exp(3.0), rtol=1e-6)  # b dy + e^a dz


@emulator_only
def test_recursive_callee_output_off_the_loss_path_is_not_optional():
    """A called graph is differentiated with all its outputs provided; if the parent has no
    gradient for one its gradient graph uses, the CallGradOp input is missing (PopART)."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        callee = ir.create_graph(lambda a: (a * 2.0, ops.exp(a)), x)
        parent = ir.create_graph(lambda a: ops.call(callee, a)[0], x)
        with pytest.raises(IR_ERRORS, match="not optional"):
            popxl.transforms.autodiff(parent)


@emulator_only
def test_custom_entry_with_an_internal_fwd_tensor_is_refused():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        inner = {}

        def callee_fn(a):
            inner["h"] = a * a
            return inner["h"] + 1.0
        callee = ir.create_graph(callee_fn, x)
        grad = ir.create_graph(lambda dy, h: dy * h, x, x)
        info = _hand_written(ir, callee, grad, [("FwdGrad", callee.outputs[0]),
                                                ("Fwd", inner["h"])],
                             [("FwdGrad", callee.inputs[0])])
        parent = ir.create_graph(lambda a: ops.call(callee, a)[0], x)
        with pytest.raises(IR_ERRORS, match="While trying to produce the grad op"):
            popxl.transforms.autodiff(parent, called_graphs_grad_info={callee: info})


@emulator_only
def test_split_needs_the_gradient_of_every_output():
    """PopART's SplitGradOp has no optional inputs: one split output off the loss path makes
    "input is not optional"."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones((2, 4), np.float32))
        graph = ir.create_graph(lambda a: ops.split(a, 2, axis=1)[0] * 2.0, x)
        with pytest.raises(IR_ERRORS, match="not optional"):
            popxl.transforms.autodiff(graph)
