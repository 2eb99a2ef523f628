"""The emulator's models of popxl-addons' custom C++ ops (``popxl_flash/emulator/addons_ops``),
driven the way popxl-addons' Python builders drive the compiled bindings
(``<binding>.<Op>.createOpInGraph(graph._pb_graph, inputs, outputs, ..., settings)``) and
checked against numpy models of the C++ sources. Emulator only: on the SDK these bindings are
cppimport-compiled C++.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import popxl_flash
from conftest import COMPILE_ERRORS, IR_ERRORS
from popxl_flash import popxl

if popxl_flash.BACKEND != "emulator":
    pytest.skip("the emulator's models of popxl-addons' C++ ops", allow_module_level=True)

from popxl_flash.emulator import addons_ops  # noqa: E402
from popxl_flash.emulator._internal_ir import CollectiveOperator  # noqa: E402

ops = popxl.ops
f32 = popxl.float32
ADD = CollectiveOperator.Add


def _build(name, *args):
    """``<binding>.<Op>.createOpInGraph`` in the current graph, as popxl-addons calls it.
    ``args[0]``: {index: input Tensor}; ``args[1]``: output names. Returns: output Tensors."""
    ctx = popxl.context.get_current_context()
    g = ctx.graph
    leaf, cls = name.split(".")
    binding = getattr(addons_ops.binding(f"popxl_addons.ops.x.{leaf}"), cls)
    ins = {i: t.id for i, t in args[0].items()}
    outs = {i: g._create_tensor_id(n) for i, n in enumerate(args[1])}
    op = binding.createOpInGraph(g._pb_graph, ins, outs, *args[2:],
                                 ctx._get_op_settings(cls))
    ctx._op_created(op)
    return [popxl.Tensor._from_pb_tensor(op.outTensor(i)) for i in range(len(args[1]))]


def _tp_all_reduce(t, ir, identical_inputs=False, identical_grad_inputs=False, op=ADD):
    return _build("replicated_all_reduce_TP_binding.ReplicatedAllReduceTPOp", {0: t}, ["out"],
                  op, ir.replica_grouping()._pb_replica_grouping, identical_inputs,
                  identical_grad_inputs)[0]


def _replicated_run(ir, feeds, outs):
    with popxl.Session(ir, "ipu_model") as session:
        res = session.run(feeds)
    return [res[s] for s in outs]


def _feed(ir, shape, data):
    s = popxl.h2d_stream(shape, f32)
    return s, ops.host_load(s)


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


# -- ReplicatedAllReduceTPOp -------------------------------------------------------------------
@pytest.mark.parametrize("identical_inputs,identical_grad", [(False, False), (False, True),
                                                            (True, False)])
def test_tp_all_reduce_forward_and_gradient(identical_inputs, identical_grad):
    """Forward: sum over the group, or the identity with identical inputs (after the
    pre-alias patterns); gradient: the same op with the two flags swapped."""
    r = 4
    data = np.arange(r * 3, dtype=np.float32).reshape(r, 3)
    dy = np.arange(r * 3, dtype=np.float32).reshape(r, 3) * 10
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        sx, x = _feed(ir, (3,), data)
        sd, d = _feed(ir, (3,), dy)
        g = ir.create_graph(lambda t: _tp_all_reduce(t, ir, identical_inputs, identical_grad), x)
        grad = popxl.transforms.autodiff(g)
        info = ops.call_with_info(g, x)
        (dx,) = ops.call(grad.graph, d, inputs_dict=grad.inputs_dict(info))
        outs = [_store(info.outputs[0]), _store(dx)]
    for graph in (g, grad.graph, ir.main_graph):
        ir._pb_ir.applyPreAliasPatterns(graph._pb_graph)
    y, gx = _replicated_run(ir, {sx: data, sd: dy}, outs)
    fwd_sum = not identical_inputs
    bwd_sum = not identical_grad
    np.testing.assert_array_equal(y, np.broadcast_to(data.sum(0), data.shape) if fwd_sum
                                  else data)
    np.testing.assert_array_equal(gx, np.broadcast_to(dy.sum(0), dy.shape) if bwd_sum else dy)


def test_tp_all_reduce_with_identical_inputs_needs_the_pattern():
    """``ReplicatedAllReduceTPOpx`` throws unless ``OpToIdentityPattern`` replaced the op."""
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        _, x = _feed(ir, (3,), None)
        _store(_tp_all_reduce(x, ir, identical_inputs=True))
    with pytest.raises(COMPILE_ERRORS, match="OpToIdentityPattern"):
        popxl.Session(ir, "ipu_model")


def test_tp_all_reduce_refuses_other_operators_at_setup():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        _, x = _feed(ir, (3,), None)
        with pytest.raises(IR_ERRORS, match="Add"):
            _tp_all_reduce(x, ir, op=CollectiveOperator.Max)



def test_a_fresh_import_of_popxl_registers_the_models():
    """The models register themselves into the lower layers' tables (op table, gradient
    rules, pre-alias patterns) when they are imported, and a bare ``import
    popxl_flash.emulator.popxl`` imports them: a new process builds, differentiates, rewrites
    and runs the identical-inputs TP all-reduce without naming ``addons_ops`` first."""
    code = textwrap.dedent("""
        import numpy as np
        import popxl_flash.emulator.popxl as popxl
        import popxl_flash
        from popxl_flash.emulator._internal_ir import CollectiveOperator
        addons_ops = popxl_flash.emulator.addons_ops  # imported by the emulator itself
        ops = popxl.ops
        ir = popxl.Ir(replication=2)
        data = np.arange(6, dtype=np.float32).reshape(2, 3)

        def reduce(t):
            ctx = popxl.context.get_current_context()
            g = ctx.graph
            op = addons_ops.binding("popxl_addons.ops.x.replicated_all_reduce_TP_binding"
                                    ).ReplicatedAllReduceTPOp.createOpInGraph(
                g._pb_graph, {0: t.id}, {0: g._create_tensor_id("out")},
                CollectiveOperator.Add,
                ir.replica_grouping()._pb_replica_grouping, True, False,
                ctx._get_op_settings("tp"))
            return popxl.Tensor._from_pb_tensor(op.outTensor(0)) + t  # Tensor's operators

        with ir.main_graph:
            sx = popxl.h2d_stream((3,), popxl.float32)
            x = ops.host_load(sx)
            g = ir.create_graph(reduce, x)
            grad = popxl.transforms.autodiff(g)
            info = ops.call_with_info(g, x)
            (dx,) = ops.call(grad.graph, x, inputs_dict=grad.inputs_dict(info))
            outs = []
            for t in (info.outputs[0], dx):
                outs.append(popxl.d2h_stream(t.shape, t.dtype))
                ops.host_store(outs[-1], t)
        for graph in (g, grad.graph, ir.main_graph):
            ir._pb_ir.applyPreAliasPatterns(graph._pb_graph)
        with popxl.Session(ir, "ipu_model") as session:
            res = session.run({sx: data})
        np.testing.assert_array_equal(res[outs[0]], 2 * data)
        np.testing.assert_array_equal(res[outs[1]], data + data.sum(0))
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr

# -- strided collectives -----------------------------------------------------------------------
def test_strided_collectives_follow_the_grouping():
    """Groups of stride 2, size 2 over 4 replicas: {0, 2} and {1, 3}. All-gather: 1-D rank
    order; reduce-scatter: chunk k of the sum; all-reduce (mean)."""
    r = 4
    data = np.arange(r * 4, dtype=np.float32).reshape(r, 4)
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        s, x = _feed(ir, (4,), data)
        gathered = _build("replicated_all_gather_strided_binding.ReplicatedAllGatherStridedOp",
                          {0: x}, ["g"], 2, 2)[0]
        scattered = _build(
            "replicated_reduce_scatter_strided_binding.ReplicatedReduceScatterStridedOp",
            {0: x}, ["s"], ADD, 2, 2, False)[0]
        mean = _build("replicated_all_reduce_strided_binding.ReplicatedAllReduceStridedOp",
                      {0: x}, ["m"], CollectiveOperator.Mean, 2, 2, False, False)[0]
        assert gathered.shape == (8,) and scattered.shape == (2,)
        outs = [_store(gathered), _store(scattered), _store(mean)]
    g, sc, m = _replicated_run(ir, {s: data}, outs)
    groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rep, members in groups.items():
        np.testing.assert_array_equal(g[rep], data[members].reshape(-1))
        total = data[members].sum(0)
        rank = members.index(rep)
        np.testing.assert_array_equal(sc[rep], total[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(m[rep], data[members].mean(0))


# -- RotaryPosEmbedOp --------------------------------------------------------------------------
def _rope_numpy(x, sin, cos, rotary_dim):
    """GPT-J's rotate-every-two rotation of the first ``rotary_dim`` features."""
    out = x.copy()
    s = np.repeat(sin, 2, axis=-1)[None, :, None, :]
    c = np.repeat(cos, 2, axis=-1)[None, :, None, :]
    part = x[..., :rotary_dim]
    rot = np.stack([-part[..., 1::2], part[..., ::2]], axis=-1).reshape(part.shape)
    out[..., :rotary_dim] = part * c + rot * s
    return out


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_rotary_pos_embed_forward_and_gradient(rotary_dim):
    """Forward: interleaved pairs rotated by the tables' angle; the grad op rotates back, so
    the gradient is the transpose of the rotation."""
    rng = np.random.default_rng(0)
    b, seq, heads, hh = 2, 5, 3, 8
    x_np = rng.standard_normal((b, seq, heads, hh)).astype(np.float32)
    dy_np = rng.standard_normal((b, seq, heads, hh)).astype(np.float32)
    theta = 10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    phi = np.outer(np.arange(seq), theta).astype(np.float32)
    sin_np, cos_np = np.sin(phi), np.cos(phi)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(x_np)
        sin = popxl.constant(sin_np[None])
        cos = popxl.constant(cos_np[None])
        g = ir.create_graph(lambda t, s, c: _build(
            "rotary_pos_embed_binding.RotaryPosEmbedOp", {0: t, 1: s, 2: c}, ["r"],
            rotary_dim)[0], x, sin, cos)
        grad = popxl.transforms.autodiff(g, grads_required=g.inputs[:1])
        info = ops.call_with_info(g, x, sin, cos)
        (dx,) = ops.call(grad.graph, popxl.constant(dy_np), inputs_dict=grad.inputs_dict(info))
        outs = [_store(info.outputs[0]), _store(dx)]
    y, gx = _replicated_run(ir, {}, outs)
    np.testing.assert_allclose(y, _rope_numpy(x_np, sin_np, cos_np, rotary_dim), rtol=1e-6,
                               atol=1e-6)
    # the rotation is orthogonal: its transpose is the rotation by the opposite angle
    np.testing.assert_allclose(gx, _rope_numpy(dy_np, -sin_np, cos_np, rotary_dim), rtol=1e-6,
                               atol=1e-6)


def test_rotary_pos_embed_refuses_odd_rotary_dim_and_bad_ranks():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((1, 2, 1, 4), np.float32))
        t3 = popxl.constant(np.zeros((1, 2, 2), np.float32))
        with pytest.raises(IR_ERRORS, match="multiple of 2"):
            _build("rotary_pos_embed_binding.RotaryPosEmbedOp", {0: x, 1: t3, 2: t3}, ["r"], 3)
        with pytest.raises(IR_ERRORS, match="rank 4"):
            _build("rotary_pos_embed_binding.RotaryPosEmbedOp",
                   {0: popxl.constant(np.zeros((2, 4), np.float32)), 1: t3, 2: t3}, ["r"], 4)


# -- LayerNormDistributedOp --------------------------------------------------------------------
def test_layer_norm_distributed_matches_a_full_layer_norm():
    """Shards of the hidden dimension over 2 replicas: forward equals layer norm of the whole
    row with each shard's weight and bias; gradient as the C++ grad op (dx for w = 1, dw, db
    per shard)."""
    r, n, h = 2, 3, 8
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    b = rng.standard_normal(h).astype(np.float32)
    dy = rng.standard_normal((n, h)).astype(np.float32)
    shard = lambda a, axis: np.stack(np.split(a, r, axis=axis))  # noqa: E731
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        sx, xt = _feed(ir, (n, h // r), None)
        sw, wt = _feed(ir, (h // r,), None)
        sb, bt = _feed(ir, (h // r,), None)
        sd, dt = _feed(ir, (n, h // r), None)
        g = ir.create_graph(lambda a, c, d: _build(
            "layer_norm_distributed_binding.LayerNormDistributedOp", {0: a, 1: c, 2: d},
            ["y", "mean", "std"], 1e-5, ir.replica_grouping()._pb_replica_grouping)[0],
            xt, wt, bt)
        grad = popxl.transforms.autodiff(g)
        info = ops.call_with_info(g, xt, wt, bt)
        dx, dw, db = ops.call(grad.graph, dt, inputs_dict=grad.inputs_dict(info))
        outs = [_store(info.outputs[0]), _store(dx), _store(dw), _store(db)]
    feeds = {sx: shard(x, 1), sw: shard(w, 0), sb: shard(b, 0), sd: shard(dy, 1)}
    y, gx, gw, gb = _replicated_run(ir, feeds, outs)
    mean, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    xhat = (x - mean) / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(np.concatenate(list(y), 1), xhat * w + b, rtol=1e-5, atol=1e-5)
    inv = 1 / np.sqrt(var + 1e-5)
    ref_dx = inv * (dy - dy.mean(1, keepdims=True) - xhat * (dy * xhat).mean(1, keepdims=True))
    np.testing.assert_allclose(np.concatenate(list(gx), 1), ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(list(gw)), (dy * xhat).sum(0), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.concatenate(list(gb)), dy.sum(0), rtol=1e-5, atol=1e-5)


def test_unmodelled_cpp_source_raises_when_used():
    """A cppimport module the emulator does not model imports, and raises when used."""
    import importlib
    import sys
    from popxl_flash.emulator import standins
    assert addons_ops.binding("popxl_addons.ops.x.sparse_matmul_binding") is None
    # another package's C++ op of a modelled file name is not taken for popxl-addons' op
    assert addons_ops.binding("modelling.rotary_pos_embed.rotary_pos_embed_binding") is None
    finder = standins.CppFinder()
    spec = importlib.machinery.ModuleSpec("pkg.unknown_binding", finder)
    mod = finder.create_module(spec)
    with pytest.raises(NotImplementedError):
        mod.SomeOp  # noqa: B018
    assert "pkg.unknown_binding" not in sys.modules
