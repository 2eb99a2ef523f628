"""Ops Graphcore's training scripts use: the negative log likelihood ops, Adam's updater and
moving-average-square accumulator, swish, the gather gradient, and PopART's session options.
Each is compared with a numpy model of PopART sdk-release-3.4's lowering (named per test)."""
import numpy as np
import pytest

from conftest import IR_ERRORS, run
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32


def _forward_and_grad(fn, x, other, dy):
    """Build ``fn(x, other)`` as a graph, its gradient for ``x`` only, call both in the main
    graph (``x`` a variable, ``other`` and ``dy`` constants) and run. Returns: (y, dx)."""
    ir = popxl.Ir()
    with ir.main_graph:
        xv, ov = popxl.variable(x), popxl.constant(other)
        g = ir.create_graph(fn, xv, ov)
        grad = popxl.transforms.autodiff(g, grads_required=g.inputs[:1])
        info = ops.call_with_info(g, xv, ov)
        (dx,) = ops.call(grad.graph, popxl.constant(dy), inputs_dict=grad.inputs_dict(info))
    return run(ir, None, [info.outputs[0], dx])


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# -- nll -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 2])
def test_nll_loss_with_softmax_grad(reduction, ignore_index):
    """``NlllWithSoftmaxGradDirectOpx`` (``popx/op/softmaxx.cpp``): loss ``-log(p + 1e-7)`` of
    the kept rows, dx ``(probs - onehot) * loss_grad`` masked, mean over N (or the kept rows
    with an ignore index)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    labels = np.array([0, 2, 4, 1, 2, 3], np.int32)
    probs = _softmax(x)
    ir = popxl.Ir()
    with ir.main_graph:
        p = ops.softmax(popxl.constant(x), axis=-1)
        loss, dx = ops.nll_loss_with_softmax_grad(p, popxl.constant(labels), loss_grad=2.0,
                                                  ignore_index=ignore_index, reduction=reduction)
    got_loss, got_dx = run(ir, None, [loss, dx])
    keep = labels != ignore_index if ignore_index is not None else np.ones(6, bool)
    onehot = np.eye(5, dtype=np.float32)[labels]
    rows = np.where(keep, -np.log(probs[np.arange(6), labels] + 1e-7), 0)
    count = keep.sum() if ignore_index is not None else 6
    want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / count}[reduction]
    grad = np.where(keep[:, None], probs - onehot, 0) * 2.0
    if reduction == "mean":
        grad = grad / count
    np.testing.assert_allclose(got_loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_dx, grad, rtol=1e-5, atol=1e-6)


def test_nll_loss_and_its_gradient():
    """NllOpx: ``-log(max(p, 1e-7))``; NllGradOpx: ``-onehot / max(p, 1e-10)`` scaled by the
    loss gradient, mean over the leading dimension of probs (the lowering scales the gradient
    reshaped to probs' shape)."""
    rng = np.random.default_rng(1)
    probs = _softmax(rng.standard_normal((2, 3, 4))).astype(np.float32)
    labels = np.array([[0, 1, 3], [2, 2, 0]], np.int32)
    loss, got = _forward_and_grad(lambda t, lab: ops.nll_loss(t, lab), probs, labels,
                                  np.float32(1.0))
    picked = np.take_along_axis(probs, labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, -np.log(picked).mean(), rtol=1e-6)
    onehot = np.eye(4, dtype=np.float32)[labels]
    np.testing.assert_allclose(got, -onehot / probs / 2, rtol=1e-6)


def test_nll_label_checks():
    """NllOp::setup: labels of all but the last dimension, an integer type."""
    ir = popxl.Ir()
    with ir.main_graph:
        p = popxl.constant(np.full((2, 3), 1 / 3, np.float32))
        with pytest.raises(IR_ERRORS):
            ops.nll_loss(p, popxl.constant(np.zeros((3,), np.int32)))
        with pytest.raises(IR_ERRORS):
            ops.nll_loss(p, popxl.constant(np.zeros((2,), np.float32)))
        with pytest.raises(ValueError):
            ops.nll_loss(p, popxl.constant(np.zeros((2,), np.int32)), reduction="avg")


# -- Adam ----------------------------------------------------------------------------------------
def test_adam_updater_with_bias_correction_and_weight_decay():
    """AdamUpdaterOpx: the step is incremented in place, then
    ``m / (1 - b1**t) / (sqrt(v / (1 - b2**t)) + eps) + wd * w``."""
    m = np.array([0.1, -0.2, 0.3], np.float32)
    v = np.array([0.01, 0.04, 0.09], np.float32)
    w = np.array([1.0, 2.0, 3.0], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        step = popxl.variable(np.float32(2.0), name="step")
        upd = ops.var_updates.adam_updater(popxl.constant(m), popxl.constant(v),
                                           weight=popxl.constant(w), time_step=step,
                                           weight_decay=0.1, beta1=0.9, beta2=0.999,
                                           epsilon=1e-5)
        s = popxl.d2h_stream(upd.shape, upd.dtype)
        ops.host_store(s, upd)
    with popxl.Session(ir, "ipu_model") as session:
        got = session.run()[s]
        new_step = session.get_tensor_data(step)
    t = 3.0
    want = (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-5) + 0.1 * w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert new_step == 3.0


def test_adam_updater_argument_checks():
    """``adam_updater``: weight decay needs the weight; a time step needs both betas."""
    ir = popxl.Ir()
    with ir.main_graph:
        m = popxl.constant(np.zeros(3, np.float32))
        with pytest.raises(ValueError):
            ops.var_updates.adam_updater(m, m, weight_decay=0.1)
        with pytest.raises(ValueError):
            ops.var_updates.adam_updater(m, m, time_step=popxl.variable(np.float32(0)),
                                         beta1=0.9)


def test_accumulate_moving_average_square():
    """AccumulateOpx MovingAverageSquare: ``f * t + (1 - f) * x**2``."""
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.array([1.0, 2.0], np.float32))
        out = ops.var_updates.accumulate_moving_average_square_(
            t, popxl.constant(np.array([3.0, -1.0], np.float32)), 0.25)
    np.testing.assert_allclose(run(ir, None, out), [0.25 + 0.75 * 9, 0.5 + 0.75])


# -- swish, gather gradient --------------------------------------------------------------------
def test_swish_and_its_gradient():
    """SwishOp ``x * sigmoid(x)``; SwishGradOp ``dy * (s + x s (1 - s))``."""
    x = np.linspace(-3, 3, 7).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        xv = popxl.variable(x)
        g = ir.create_graph(ops.swish, xv)
        grad = popxl.transforms.autodiff(g)
        info = ops.call_with_info(g, xv)
        (dx,) = ops.call(grad.graph, popxl.constant(np.ones(7, np.float32)),
                         inputs_dict=grad.inputs_dict(info))
    y, d = run(ir, None, [info.outputs[0], dx])
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(y, x * s, rtol=1e-6)
    np.testing.assert_allclose(d, s + x * s * (1 - s), rtol=1e-5)


def test_gather_gradient_adds_into_the_gathered_rows():
    """GatherGradOp: the incoming gradient scattered, repeated indices adding."""
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    idx = np.array([[1, 3], [1, 0]], np.int32)
    dy = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    _, got = _forward_and_grad(lambda t, i: ops.gather(t, i), table, idx, dy)
    want = np.zeros_like(table)
    np.add.at(want, idx, dy)
    np.testing.assert_array_equal(got, want)


# -- session options -----------------------------------------------------------------------------
def test_session_options_have_popart_fields():
    """``popart_core/popart.cpp`` binds SessionOptions' fields; PopXL's ``Ir()`` sets some
    (``python_files/ir.py``); an unknown name raises AttributeError; the dictionary
    properties write back an item set on them (``__init__.py.in``)."""
    ir = popxl.Ir(replication=2)
    opts = ir._pb_ir.getSessionOptions()
    assert opts.aliasZeroCopy and opts.enableInplaceAmbiguityChecking
    assert opts.numIOTiles == 0 and opts.partialsTypeMatMuls == ""
    assert opts.replicatedGraphCount == 2 and opts.getGlobalReplicationFactor() == 2
    opts.numIOTiles = 32
    opts.partialsTypeMatMuls = "half"
    opts.engineOptions["opt.internalExchangeOptimisationTarget"] = "memory"
    assert opts.engineOptions == {"opt.internalExchangeOptimisationTarget": "memory"}
    with pytest.raises(AttributeError):
        opts.notAnOption = 1
    with pytest.raises(AttributeError):
        opts.notAnOption  # noqa: B018
