"""The emulator's models of popxl-addons' training ops (``popxl_flash/emulator/addons_ops``):
``CrossEntropyShardedOp`` (the tensor-parallel cross entropy) and ``GradReduceSquareAddOp``,
driven through their bindings as popxl-addons' builders drive them, checked against numpy
models of the C++ sources. Emulator only: on the SDK these are cppimport-compiled C++.
"""
import numpy as np
import pytest

import popxl_flash
from conftest import COMPILE_ERRORS, IR_ERRORS
from popxl_flash import popxl

if popxl_flash.BACKEND != "emulator":
    pytest.skip("the emulator's models of popxl-addons' C++ ops", allow_module_level=True)

from popxl_flash.emulator import addons_ops  # noqa: E402

ops = popxl.ops


def _binding(leaf, cls):
    return getattr(addons_ops.binding(f"popxl_addons.ops.x.{leaf}"), cls)


def _cross_entropy(logits, indices, group):
    ctx = popxl.context.get_current_context()
    g = ctx.graph
    op = _binding("crossentropysharded_binding", "CrossEntropyShardedOp").createOpInGraph(
        g._pb_graph, {0: logits.id, 1: indices.id},
        {0: g._create_tensor_id("loss"), 1: g._create_tensor_id("nls")},
        group=group._pb_replica_grouping, availableMemoryProportion=0.4,
        settings=ctx._get_op_settings("cross_entropy_sharded"))
    ctx._op_created(op)
    return popxl.Tensor._from_pb_tensor(op.outTensor(0))


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


def _reference(full_logits, labels):
    """Cross entropy per sample and its gradient w.r.t. the logits (numpy, float64)."""
    x = full_logits.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    rows = np.arange(x.shape[0])
    loss = -np.log(p[rows, labels])
    grad = p.copy()
    grad[rows, labels] -= 1
    return loss, grad


def test_cross_entropy_sharded_forward_and_gradient():
    """Classes sharded over 2 replicas: each replica's indices are the labels shifted into
    its class range (out of range: another shard's class). Loss identical on both replicas,
    the logits' gradient ``dloss * (softmax - onehot)`` on each shard."""
    r, n, c = 2, 5, 6
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((n, r * c)).astype(np.float32)
    labels = rng.integers(0, r * c, n)
    dloss = rng.standard_normal(n).astype(np.float32)
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        s_x = popxl.h2d_stream((n, c), popxl.float32)
        s_i = popxl.h2d_stream((n,), popxl.int32)
        x, idx = ops.host_load(s_x), ops.host_load(s_i)
        g = ir.create_graph(lambda a, b: _cross_entropy(a, b, ir.replica_grouping()), x, idx)
        grad = popxl.transforms.autodiff(g, grads_required=g.inputs[:1])
        info = ops.call_with_info(g, x, idx)
        (dx,) = ops.call(grad.graph, popxl.constant(dloss), inputs_dict=grad.inputs_dict(info))
        outs = [_store(info.outputs[0]), _store(dx)]
    shards = np.stack([logits[:, k * c:(k + 1) * c] for k in range(r)])
    shifted = np.stack([labels - k * c for k in range(r)]).astype(np.int32)
    with popxl.Session(ir, "ipu_model") as session:
        res = session.run({s_x: shards, s_i: shifted})
    loss, gx = res[outs[0]], res[outs[1]]
    ref_loss, ref_grad = _reference(logits, labels)
    for k in range(r):
        np.testing.assert_allclose(loss[k], ref_loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gx[k], (dloss[:, None] * ref_grad)[:, k * c:(k + 1) * c],
                                   rtol=1e-5, atol=1e-6)


def test_cross_entropy_sharded_setup_and_lowering_refusals():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x = popxl.variable(np.zeros((3, 4), np.float32))
        i3 = popxl.variable(np.zeros(3, np.int32))
        with pytest.raises(IR_ERRORS, match="rank 2"):
            _cross_entropy(popxl.variable(np.zeros(4, np.float32)), i3, ir.replica_grouping())
        with pytest.raises(IR_ERRORS, match="rank 1"):
            _cross_entropy(x, popxl.variable(np.zeros((3, 1), np.int32)), ir.replica_grouping())
        with pytest.raises(IR_ERRORS, match="same"):
            _cross_entropy(x, popxl.variable(np.zeros(2, np.int32)), ir.replica_grouping())
        _store(_cross_entropy(x, popxl.variable(np.zeros(3, np.float32)), ir.replica_grouping()))
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_grad_reduce_square_add():
    """``scale * sum(t**2)`` as a float32 scalar (float16 input squared in float32)."""
    rng = np.random.default_rng(1)
    t_np = rng.standard_normal((4, 3)).astype(np.float16)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(t_np)
        scale = popxl.constant(1 / 64.0, popxl.float32)
        ctx = popxl.context.get_current_context()
        g = ctx.graph
        op = _binding("grad_reduce_square_add_binding", "GradReduceSquareAddOp").createOpInGraph(
            g._pb_graph, {0: t.id, 1: scale.id}, {0: g._create_tensor_id("grad_reduced")},
            ctx._get_op_settings("GradReduceSquareAdd"))
        out = popxl.Tensor._from_pb_tensor(op.outTensor(0))
        assert out.dtype == popxl.float32 and out.shape == ()
        s = _store(out)
    with popxl.Session(ir, "ipu_model") as session:
        value = session.run()[s]
    ref = (t_np.astype(np.float32) ** 2).sum() / 64.0
    np.testing.assert_allclose(value, ref, rtol=1e-6)
