"""popxl_flash.addons.FlashAttention with the score modifiers and dropout: its build_grad
(popxl-addons' autodiff of the module graph) gives exactly pf.flash_attention_grad's gradients
for the same softcap, ALiBi slopes, score_mod and dropout seed, zero gradients for the extra
inputs, and a build-time error for a wrong number of extra inputs.
"""
import os
import re

import numpy as np
import pytest

if not os.environ.get("POPXL_ADDONS_PATH", "").strip():
    pytest.skip("set POPXL_ADDONS_PATH to a popxl-addons checkout", allow_module_level=True)

import popxl  # noqa: E402 - the emulator, installed by conftest.py
import popxl_addons as addons  # noqa: E402
from popxl import ops  # noqa: E402

import popxl_flash as pf  # noqa: E402
from popxl_flash.addons import FlashAttention  # noqa: E402

G, L, D = 4, 10, 8


def bias_mod(s, g, q_idx, kv_idx, table):
    """A score_mod with one input: a per-group bias (``g`` int32 ``[G, 1, 1]``)."""
    return s + ops.gather(table, g)


@pytest.mark.parametrize("method", ["build_grad", "addons.autodiff"])
def test_build_grad_with_every_modifier_equals_flash_attention_grad(method):
    """``GraphWithNamedArgs.autodiff`` (the module's build_grad, zero gradients for the extra
    inputs) and ``addons.autodiff`` with ``grads_required`` = q, k, v (the registered flash
    entries; the extras have no gradient there) both give flash_attention_grad's gradients."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((G, L, D)).astype(np.float32) for _ in range(4))
    slopes = np.array([0.5, 0.25, 0.1, 0.05], np.float32)
    table = rng.standard_normal(G).astype(np.float32)
    options = dict(causal=True, num_chunks_q=2, num_chunks_kv=2)
    mods = dict(softcap=4.0, dropout=0.2, score_mod=bias_mod)
    ir = popxl.Ir()
    with ir.main_graph:
        ts = [popxl.variable(a) for a in (q, k, v)]
        st, tt = popxl.variable(slopes), popxl.variable(table)
        seed = popxl.variable(np.array([3, 4], np.uint32), popxl.uint32)
        layer = FlashAttention(alibi=True, score_mod_inputs=1, **options, **mods)
        _, graph = layer.create_graph(*(t.spec for t in ts), st.spec, seed.spec, tt.spec)
        if method == "build_grad":
            dgraph = graph.autodiff()
        else:
            dgraph = addons.autodiff(graph, grads_required=graph.graph.inputs[:3])
        info = graph.bind().call_with_info(*ts, st, seed, tt)
        grads = dgraph.bind().call(popxl.variable(dout),
                                   args=dgraph.grad_graph_info.inputs_dict(info))
        out_direct, lse = pf.flash_attention(*ts, return_lse=True, alibi_slopes=st, seed=seed,
                                             score_mod_inputs=(tt,), **options, **mods)
        direct = pf.flash_attention_grad(popxl.variable(dout), *ts, out_direct, lse,
                                         alibi_slopes=st, seed=seed, score_mod_inputs=(tt,),
                                         **options, **mods)
        wanted = [info.outputs[0], out_direct, *grads, *direct]
        streams = [addons.host_store(t) for t in wanted]
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()
    got = [out[s] for s in streams]
    n = 6 if method == "build_grad" else 3
    out_layer, out_ref, grads, ref = got[0], got[1], got[2:2 + n], got[2 + n:]
    np.testing.assert_array_equal(out_layer, out_ref)
    for g, r in zip(grads[:3], ref):
        np.testing.assert_array_equal(g, r)
    assert np.abs(grads[0]).max() > 0
    assert all(not g.any() for g in grads[3:])  # slopes, seed, table: zeros


def test_wrong_number_of_extra_inputs_is_a_build_time_error():
    ir = popxl.Ir()
    with ir.main_graph:
        ts = [popxl.variable(np.zeros((G, L, D), np.float32)) for _ in range(3)]
        layer = FlashAttention(alibi=True, dropout=0.1)
        with pytest.raises(ValueError, match=re.escape(
                "FlashAttention.build takes 2 extra input(s) after its tensors with these "
                "options: ['alibi_slopes', 'seed']; got 0")):
            layer.create_graph(*(t.spec for t in ts))


def test_self_attention_dropout_gradient_is_the_derivative_of_its_forward():
    """SelfAttention(dropout=0.3) differentiated by addons.autodiff with ``grads_required=[x]``
    (the uint32 seed input has no gradient; with the default, every input, PopART's autodiff
    refuses it): the directional derivative ``<dx, u>`` equals the central difference of
    ``sum(y * dy)`` along ``u``, the mask fixed by the seed. float32 central difference with
    h = 1e-2: rounding ~ eps32 * |f| / h ~ 1e-4 relative, truncation O(h^2) ~ 1e-4; 1e-2
    relative is a safe bound that a wrong mask or a missing 1/(1-p) scale (30% off) fails."""
    from popxl_flash.addons import SelfAttention
    rng = np.random.default_rng(5)
    B, L, E = 2, 8, 16
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    u = rng.standard_normal((B, L, E)).astype(np.float32)
    dy = rng.standard_normal((B, L, E)).astype(np.float32)
    h = 1e-2
    np.random.seed(5)  # addons' Linear draws its initial weights there
    ir = popxl.Ir()
    with ir.main_graph:
        seed = popxl.variable(np.array([8, 9], np.uint32), popxl.uint32)
        xs = [popxl.variable(a) for a in (x, x + h * u, x - h * u)]
        layer = SelfAttention(E, 4, 2, dropout=0.3, rotary_dim=4, bias=False, num_chunks_q=2,
                              num_chunks_kv=2)
        facts, graph = layer.create_graph(xs[0].spec, seed.spec)
        with pytest.raises(Exception, match="Unable to provide required gradient"):
            addons.autodiff(graph)
        dgraph = addons.autodiff(graph, grads_required=graph.graph.inputs[:1])
        variables = facts.init()
        info = graph.bind(variables).call_with_info(xs[0], seed)
        (dx,) = dgraph.bind().call(popxl.variable(dy),
                                   args=dgraph.grad_graph_info.inputs_dict(info))
        ys = [info.outputs[0]] + [graph.bind(variables).call(t, seed)[0] for t in xs[1:]]
        streams = [addons.host_store(t) for t in [dx, *ys]]
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()
    dx, y0, yp, ym = (out[s].astype(np.float64) for s in streams)
    directional = float((dx * u).sum())
    central = float(((yp - ym) * dy).sum() / (2 * h))
    assert abs(directional - central) <= 1e-2 * abs(directional), (directional, central)
    assert abs(directional) > 1e-3
