"""pf.called_graphs_grad_info / pf.autodiff: flash attention inside autodiff-built layers, and
the option checks of flash_attention_grad.

The layer: ``x [L, E]`` -> q, k, v projections -> heads ``[H, L, Dh]`` -> attention -> merge ->
output projection. Its gradients by ``popxl.transforms.autodiff`` (flash's backward plugged in)
are held to the FlashAttention rule (tests/attention_utils.py, 3x for the backward) against a
float64 reference (NumPy chain rule around ``pf.reference.attention_grad``), with the same layer
built on naive PopXL attention and differentiated entirely by autodiff as the same-precision
baseline.
"""
import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import assert_within_rule
from popxl_flash.checks import harness
from popxl_flash import popxl
from popxl_flash.checks.naive import naive_attention

ops = popxl.ops
L, H, D = 12, 2, 4
E = H * D
CHUNKS = dict(num_chunks_q=3, num_chunks_kv=2)


def _heads(t):
    return t.reshape((L, H, D)).transpose((1, 0, 2))


def _merge(t):
    return t.transpose((1, 0, 2)).reshape((L, E))


def make_layer(attention, **options):
    def layer(x, wq, wk, wv, wo):
        q, k, v = (_heads(x @ w) for w in (wq, wk, wv))
        if attention == "flash":
            out = pf.flash_attention(q, k, v, **CHUNKS, **options)
        else:
            out = naive_attention(q, k, v, **options)
        return _merge(out) @ wo
    return layer


def layer_grads(layer, arrays, dy, differentiate):
    """Forward + gradient graph of ``layer`` on host arrays -> gradients of all inputs."""
    def build(*ts):
        *inputs, dy_t = ts
        ir = popxl.gcg().ir
        graph = ir.create_graph(layer, *inputs)
        info = differentiate(graph)
        call = ops.call_with_info(graph, *inputs)
        return ops.call(info.graph, dy_t, inputs_dict=info.inputs_dict(call))
    return harness.run_graph(lambda *ts: list(build(*ts)), list(arrays) + [dy]).outputs


def reference_grads(arrays, dy, **options):
    """float64 gradients of ``sum(layer(x, W...) * dy)``."""
    x, wq, wk, wv, wo = (a.astype(np.float64) for a in arrays)
    dy = dy.astype(np.float64)

    def heads(t):
        return t.reshape(L, H, D).transpose(1, 0, 2)

    def merge(t):
        return t.transpose(1, 0, 2).reshape(L, E)
    q, k, v = (heads(x @ w) for w in (wq, wk, wv))
    out, _ = pf.reference.attention(q, k, v, **options)
    dwo = merge(out).T @ dy
    dq, dk, dv = pf.reference.attention_grad(heads(dy @ wo.T), q, k, v, **options)
    dws = [x.T @ merge(g) for g in (dq, dk, dv)]
    dx = sum(merge(g) @ w.T for g, w in zip((dq, dk, dv), (wq, wk, wv)))
    return [dx, *dws, dwo]


def random_inputs(seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((L, E)).astype(np.float32)]
    arrays += [(rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32) for _ in range(4)]
    return arrays, rng.standard_normal((L, E)).astype(np.float32)


def with_flash_entries(graph):
    return popxl.transforms.autodiff(graph,
                                     called_graphs_grad_info=pf.called_graphs_grad_info(graph))


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False),
                                     dict(causal=False, window=(3, 2), scale=0.3)],
                         ids=["causal", "full", "window"])
def test_layer_gradients_follow_the_flash_attention_rule(options):
    arrays, dy = random_inputs(7)
    flash = layer_grads(make_layer("flash", **options), arrays, dy, with_flash_entries)
    naive = layer_grads(make_layer("naive", **options), arrays, dy, popxl.transforms.autodiff)
    ref = reference_grads(arrays, dy, **options)
    for name, f, n, r in zip(["x", "wq", "wk", "wv", "wo"], flash, naive, ref):
        assert f.shape == r.shape
        assert_within_rule(name, f, n, r, factor=3, dtype="float32", accum_steps=3 + 4 + D,
                           magnitude=float(np.abs(r).max()))


def test_pf_autodiff_equals_popxl_autodiff_with_entries():
    arrays, dy = random_inputs(3)
    layer = make_layer("flash")
    a = layer_grads(layer, arrays, dy, pf.autodiff)
    b = layer_grads(layer, arrays, dy, with_flash_entries)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_nested_calls_are_found():
    """The flash graph two ``ops.call`` levels down gets its entry too."""
    arrays, dy = random_inputs(5)
    flat = make_layer("flash")

    def nested(*ts):
        inner = popxl.gcg().ir.create_graph(flat, *ts)
        return ops.call(inner, *ts)[0]
    a = layer_grads(nested, arrays, dy, with_flash_entries)
    b = layer_grads(flat, arrays, dy, with_flash_entries)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=0)


def _descendants(graph):
    out, stack = set(), list(graph.called_graphs)
    while stack:
        g = stack.pop()
        if g not in out:
            out.add(g)
            stack.extend(g.called_graphs)
    return out


def test_entries_cover_the_flash_graph_and_all_its_descendants():
    ir = popxl.Ir()
    with ir.main_graph:
        arrays, _ = random_inputs(0)
        ts = [popxl.constant(a) for a in arrays]
        layer = ir.create_graph(make_layer("flash"), *ts)
        entries = pf.called_graphs_grad_info(layer)
    (flash_graph,) = layer.called_graphs
    assert set(entries) == {flash_graph} | _descendants(flash_graph)
    info = entries[flash_graph]
    q, k, v = flash_graph.inputs
    out, lse = flash_graph.outputs
    Fwd = popxl.transforms.ExpectedConnectionType.Fwd
    FwdGrad = popxl.transforms.ExpectedConnectionType.FwdGrad
    assert [(e.connection_type, e.fwd_tensor) for e in info.expected_inputs] == [
        (FwdGrad, out), (Fwd, q), (Fwd, k), (Fwd, v), (Fwd, out), (Fwd, lse)]
    assert [(e.connection_type, e.fwd_tensor) for e in info.expected_outputs] == [
        (FwdGrad, q), (FwdGrad, k), (FwdGrad, v)]
    assert [t.shape for t in info.graph.outputs] == [q.shape, k.shape, v.shape]


def _layer_with_lse(through_loss):
    def layer(x, wq):
        q = _heads(x @ wq)
        out, lse = pf.flash_attention(q, q, q, return_lse=True, **CHUNKS)
        y = _merge(out)
        return (y, lse) if not through_loss else y * ops.sum(lse)
    return layer


@pytest.mark.parametrize("through_loss", [False, True], ids=["lse_output", "lse_in_loss"])
def test_gradient_through_lse_is_refused(through_loss):
    ir = popxl.Ir()
    with ir.main_graph:
        arrays, _ = random_inputs(0)
        x, wq = popxl.constant(arrays[0]), popxl.constant(arrays[1])
        layer = ir.create_graph(_layer_with_lse(through_loss), x, wq)
        with pytest.raises(ValueError, match="lse"):
            pf.called_graphs_grad_info(layer)
        with pytest.raises(ValueError, match="lse"):
            pf.autodiff(layer)
        if not through_loss:  # lse returned but no gradient provided for it: fine
            info = pf.autodiff(layer, grads_provided=layer.outputs[:1])
            assert len(info.expected_outputs) == 2


def test_caller_entries_win():
    ir = popxl.Ir()
    with ir.main_graph:
        arrays, _ = random_inputs(0)
        ts = [popxl.constant(a) for a in arrays]
        layer = ir.create_graph(make_layer("flash"), *ts)
        entries = pf.called_graphs_grad_info(layer)
        (flash_graph,) = layer.called_graphs
        mine = dict(entries)
        infos = pf.autodiff(layer, called_graphs_grad_info=mine, return_all_grad_graphs=True)
    assert infos[flash_graph] is mine[flash_graph]


# -- option mismatch ----------------------------------------------------------------------
def _grad_with(forward_options, grad_options):
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.constant(np.ones((2, 8, 4), np.float32))
        out, lse = pf.flash_attention(q, q, q, return_lse=True, **forward_options)
        return pf.flash_attention_grad(out, q, q, q, out, lse, **grad_options)


@pytest.mark.parametrize("fwd,grad", [
    (dict(causal=True), dict(causal=False)),
    (dict(scale=0.25), dict()),  # the default is 1/sqrt(4) = 0.5
    (dict(causal=False, window=(2, 1)), dict(causal=False, window=(1, 2))),
], ids=["causal", "scale", "window"])
def test_grad_refuses_stash_from_other_options(fwd, grad):
    with pytest.raises(ValueError) as err:
        _grad_with(fwd, grad)
    message = str(err.value)
    assert "produced by flash_attention with options" in message
    for key in fwd:
        assert key in message


def test_grad_accepts_other_chunk_counts():
    """Chunk counts change the tiling, not out and lse: a different backward tiling is fine."""
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((2, 9, 4)).astype(np.float32) for _ in range(4))

    def build(dout, q, k, v):
        out, lse = pf.flash_attention(q, k, v, return_lse=True, num_chunks_q=3, num_chunks_kv=3)
        return pf.flash_attention_grad(dout, q, k, v, out, lse, num_chunks_q=2, num_chunks_kv=1)
    grads = harness.run_graph(lambda *ts: list(build(*ts)), [dout, q, k, v]).outputs
    ref = pf.reference.attention_grad(dout, q, k, v)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_grad_refuses_out_and_lse_of_two_calls():
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.constant(np.ones((2, 8, 4), np.float32))
        out, _ = pf.flash_attention(q, q, q, return_lse=True)
        _, lse = pf.flash_attention(q, q, q, return_lse=True)
        with pytest.raises(ValueError, match="two different flash_attention calls"):
            pf.flash_attention_grad(out, q, q, q, out, lse)


# -- differentiating twice ----------------------------------------------------------------
def test_differentiating_twice_says_so():
    """autodiff adds lse (and the other stashed activations) as outputs of the forward graph;
    a second pf.autodiff says the graph was already differentiated instead of reporting a
    gradient through lse, and the entries of a graph differentiated elsewhere point there."""
    ir = popxl.Ir()
    with ir.main_graph:
        arrays, _ = random_inputs(0)
        ts = [popxl.constant(a) for a in arrays]
        layer = ir.create_graph(make_layer("flash"), *ts)
        pf.autodiff(layer)
        for again in (pf.autodiff, pf.called_graphs_grad_info):
            with pytest.raises(ValueError, match="already differentiated by pf.autodiff"):
                again(layer)
        other = ir.create_graph(make_layer("flash"), *ts)
        popxl.transforms.autodiff(other,
                                  called_graphs_grad_info=pf.called_graphs_grad_info(other))
        with pytest.raises(ValueError, match="lse is an output of .* already differentiated"):
            pf.called_graphs_grad_info(other)
