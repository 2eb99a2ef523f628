"""popxl_flash.addons.SelfAttention passes its mask options to flash attention: causal=False
attends to every key (forward and gradients), the default is causal."""
import os

import numpy as np
import pytest

if not os.environ.get("POPXL_ADDONS_PATH", "").strip():
    pytest.skip("set POPXL_ADDONS_PATH to a popxl-addons checkout", allow_module_level=True)

import popxl  # noqa: E402 - the emulator, installed by conftest.py
from popxl import ops  # noqa: E402

import popxl_flash as pf
from popxl_flash.addons import SelfAttention

B, L, E, H = 2, 8, 8, 2
D = E // H


def _run(causal):
    """y and dx of SelfAttention(causal=...) on fixed x, dy, and the layer's weights."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    dy = rng.standard_normal((B, L, E)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        xt = popxl.variable(x)
        layer = SelfAttention(E, H) if causal is None else SelfAttention(E, H, causal=causal)
        facts, graph = layer.create_graph(xt.spec)
        args = facts.init()
        dgraph = graph.autodiff()
        info = graph.bind(args).call_with_info(xt)
        grads = dgraph.bind().call(popxl.variable(dy),
                                   args=dgraph.grad_graph_info.inputs_dict(info))
        fwd = [e.fwd_tensor for e in dgraph.grad_graph_info.expected_outputs]
        dx = grads[fwd.index(graph.graph.inputs[0])]
        streams = []
        for t in (info.outputs[0], dx):
            streams.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(streams[-1], t)
    with popxl.Session(ir, "ipu_model") as session:
        w = {n: session.get_tensor_data(t).copy() for n, t in args.named_tensors.items()}
        res = session.run()
    return x, dy, w, res[streams[0]], res[streams[1]]


def _reference(x, dy, w, causal):
    def heads(t):
        return t.reshape(B, L, H, D).transpose(0, 2, 1, 3).reshape(B * H, L, D)

    def merge(t):
        return t.reshape(B, H, L, D).transpose(0, 2, 1, 3).reshape(B, L, E)
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    p = {n: x @ w[f"{n}.weight"] + w[f"{n}.bias"] for n in "qkv"}
    q, k, v = (heads(p[n]) for n in "qkv")
    out, _ = pf.reference.attention(q, k, v, causal=causal)
    y = merge(out) @ w["o.weight"] + w["o.bias"]
    dq, dk, dv = pf.reference.attention_grad(heads(dy @ w["o.weight"].T), q, k, v,
                                             causal=causal)
    dx = sum(merge(g) @ w[f"{n}.weight"].T for n, g in zip("qkv", (dq, dk, dv)))
    return y, dx


@pytest.mark.parametrize("causal", [False, True, None], ids=["non-causal", "causal", "default"])
def test_self_attention_mask_option(causal):
    x, dy, w, y, dx = _run(causal)
    want = True if causal is None else causal
    ref_y, ref_dx = _reference(x, dy, w, want)
    other_y, _ = _reference(x, dy, w, not want)
    for got, ref in ((y, ref_y), (dx, ref_dx)):  # float32 rounding, relative to the size
        np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    # the other mask is far off (so a layer that ignored causal= fails above)
    assert np.abs(y - other_y).max() > 0.1 * np.abs(ref_y).max()


def test_self_attention_misuse_is_answered_in_the_layers_terms():
    """Issue 33 through the adapter: window=3 with a cache at construction; [B * heads] slopes
    at build time (the layer's heads and B, not the core's G)."""
    import re
    with pytest.raises(TypeError, match=re.escape("window=3 must be None or a (left, right)")):
        SelfAttention(E, H, cache_len=8, window=3)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((B, L, E), np.float32))
        slopes = popxl.variable(np.ones(B * H, np.float32))
        with pytest.raises(ValueError, match=re.escape(
                f"alibi_slopes must be float32 [heads={H}] or [B={B}, heads={H}]")):
            SelfAttention(E, H, alibi=True).create_graph(x.spec, slopes.spec)
