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
