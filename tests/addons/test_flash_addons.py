"""popxl_flash.addons against real popxl-addons: every documented route's gradients.

``FlashAttention`` and ``SelfAttention`` are differentiated with ``GraphWithNamedArgs.autodiff``,
``addons.autodiff`` and ``addons.autodiff_with_accumulation``, each

* directly (the module's own graph from ``create_graph``),
* through ``call_module`` in a parent module (plain parent autodiff, no entries passed),
* inline in a parent's ``build`` (``called_graphs_grad_info=pf.called_graphs_grad_info(graph)``,
  given as the ``GraphWithNamedArgs``),

and every gradient (inputs and weights) is held to the FlashAttention rule (3x the error of the
same model on naive float32 attention against float64, :mod:`popxl_flash.checks.tolerance`).
"""
import os
from functools import partial

import numpy as np
import pytest

if not os.environ.get("POPXL_ADDONS_PATH", "").strip():
    pytest.skip("set POPXL_ADDONS_PATH to a popxl-addons checkout", allow_module_level=True)

import popxl  # noqa: E402 - the emulator, installed by conftest.py
import popxl_addons as addons  # noqa: E402
from popxl import ops  # noqa: E402

import popxl_flash as pf
from attention_utils import assert_within_rule, gradient_magnitude
from popxl_flash.addons import FlashAttention, SelfAttention
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.checks.tolerance import naive_attention, naive_attention_grad

B, L, E, H, HKV = 2, 12, 16, 4, 2
D = E // H
CHUNKS = dict(num_chunks_q=3, num_chunks_kv=2)
METHODS = ["GraphWithNamedArgs.autodiff", "addons.autodiff", "autodiff_with_accumulation"]
ROUTES = ["direct", "call_module", "inline"]


# -- modules under test -------------------------------------------------------------------
class FlashParent(addons.Module):
    """x [G, L, D] -> q, k, v = x @ wq, x @ wk, x @ wv -> FlashAttention (call_module or
    inline) -> out."""

    def __init__(self, route):
        super().__init__()
        self.route = route

    def build(self, x):
        ws = [self.add_variable_input(n, partial(np.random.default_rng(i).normal, 0, 0.5,
                                                 (D, D)), x.dtype)
              for i, n in enumerate(("wq", "wk", "wv"))]
        q, k, v = (x @ w for w in ws)
        if self.route == "call_module":
            (out,) = self.call_module(FlashAttention(causal=True, **CHUNKS), name="flash")(q, k, v)
        else:
            out = FlashAttention(causal=True, **CHUNKS)(q, k, v)  # inline, a local instance
        return out


class AttentionParent(addons.Module):
    """x -> SelfAttention (call_module, or inline as the attribute ``attn``) -> y."""

    def __init__(self, route):
        super().__init__()
        self.route = route
        if route == "inline":
            self.attn = SelfAttention(E, H, HKV, **CHUNKS)

    def build(self, x):
        if self.route == "inline":
            return self.attn(x)
        (y,) = self.call_module(SelfAttention(E, H, HKV, **CHUNKS), name="attn")(x)
        return y


def _module(kind, route):
    if kind == "flash":
        return FlashAttention(causal=True, **CHUNKS) if route == "direct" else FlashParent(route)
    return SelfAttention(E, H, HKV, **CHUNKS) if route == "direct" else AttentionParent(route)


# -- running a route ----------------------------------------------------------------------
def run_route(kind, route, method, inputs, dout):
    """Forward and gradient graph of one route on host ``inputs``.

    Returns:
        ``(out, grads, weights)``: the output, ``{name: gradient}`` for every input (``x`` or
        ``q``/``k``/``v``) and weight (names without the parent's ``attn.`` prefix), and the
        weights' values.
    """
    ir = popxl.Ir()
    with ir.main_graph:
        ts = [popxl.variable(a) for a in inputs]
        facts, graph = _module(kind, route).create_graph(*(t.spec for t in ts))
        extra = pf.called_graphs_grad_info(graph) if route == "inline" else None
        args = facts.init()
        names = {t: n for n, t in graph.args.named_tensors.items()}
        n_in = len(ts)
        if method == "autodiff_with_accumulation":
            dfacts, dgraph = addons.autodiff_with_accumulation(
                graph, graph.args.tensors, grads_required=graph.graph.inputs[:n_in],
                called_graphs_grad_info=extra)
            accum = dfacts.init()
            grad_graph = dgraph.bind(accum)
        else:
            dgraph = (graph.autodiff(called_graphs_grad_info=extra)
                      if method == "GraphWithNamedArgs.autodiff"
                      else addons.autodiff(graph, called_graphs_grad_info=extra))
            grad_graph = dgraph.bind()
        info = graph.bind(args).call_with_info(*ts)
        grads = grad_graph.call(popxl.variable(dout),
                                args=dgraph.grad_graph_info.inputs_dict(info))
        wanted = [info.outputs[0], *grads]
        if method != "autodiff_with_accumulation":
            fwd = [e.fwd_tensor for e in dgraph.grad_graph_info.expected_outputs]
        else:
            fwd = list(graph.graph.inputs[:n_in])
        streams = []
        for t in wanted:
            streams.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(streams[-1], t)
    input_names = ["x"] if n_in == 1 else ["q", "k", "v"]
    label = {t: input_names[i] for i, t in enumerate(graph.graph.inputs[:n_in])}
    label.update(names)
    with popxl.Session(ir, "ipu_model") as session:
        weights = {_strip(n): session.get_tensor_data(t).copy()
                   for n, t in args.named_tensors.items()}
        result = session.run()
        outs = [result[s] for s in streams]
        got = {_strip(label[t]): g for t, g in zip(fwd, outs[1:])}
        if method == "autodiff_with_accumulation":
            for n, t in accum.named_tensors.items():
                if n.startswith("accum."):
                    got[_strip(n[len("accum."):])] = session.get_tensor_data(t).copy()
    return outs[0], got, weights


def _strip(name):
    return name[len("attn."):] if name.startswith("attn.") else name


# -- numpy models (float64 reference and naive float32 baseline) ---------------------------
def _attention(dt, kind):
    if dt == np.float64:
        return (lambda *t: pf.reference.attention(*t, causal=True),
                lambda *t: pf.reference.attention_grad(*t, causal=True))
    opts = dict(causal=True, scale=None, window=None)
    return (lambda *t: naive_attention(*t, **opts), lambda *t: naive_attention_grad(*t, **opts))


def flash_model(dt, inputs, dout, weights):
    """FlashAttention (direct: inputs q, k, v) or FlashParent (x and wq, wk, wv)."""
    fwd, bwd = _attention(dt, "flash")
    do = dout.astype(dt)
    if len(inputs) == 3:
        q, k, v = (a.astype(dt) for a in inputs)
        return fwd(q, k, v)[0], dict(zip("qkv", bwd(do, q, k, v)))
    x = inputs[0].astype(dt)
    ws = [weights[n].astype(dt) for n in ("wq", "wk", "wv")]
    q, k, v = (x @ w for w in ws)
    dq, dk, dv = bwd(do, q, k, v)
    grads = {n: (x.transpose(0, 2, 1) @ g).sum(0) for n, g in zip(("wq", "wk", "wv"),
                                                                   (dq, dk, dv))}
    grads["x"] = sum(g @ w.T for g, w in zip((dq, dk, dv), ws))
    return fwd(q, k, v)[0], grads


def attention_model(dt, inputs, dout, weights):
    """SelfAttention: Linear q, k, v (GQA), flash attention, Linear o."""
    fwd, bwd = _attention(dt, "self")
    x, dy = inputs[0].astype(dt), dout.astype(dt)
    w = {n: a.astype(dt) for n, a in weights.items()}

    def heads(t, h):  # [B, L, h*D] -> [B*h, L, D]
        return t.reshape(B, L, h, D).transpose(0, 2, 1, 3).reshape(B * h, L, D)

    def merge(t, h):
        return t.reshape(B, h, L, D).transpose(0, 2, 1, 3).reshape(B, L, h * D)
    proj = {n: x @ w[f"{n}.weight"] + w[f"{n}.bias"] for n in "qkv"}
    q, k, v = heads(proj["q"], H), heads(proj["k"], HKV), heads(proj["v"], HKV)
    out = merge(fwd(q, k, v)[0], H)
    y = out @ w["o.weight"] + w["o.bias"]
    grads = {"o.weight": (out.transpose(0, 2, 1) @ dy).sum(0), "o.bias": dy.sum((0, 1))}
    dq, dk, dv = bwd(heads(dy @ w["o.weight"].T, H), q, k, v)
    dproj = dict(q=merge(dq, H), k=merge(dk, HKV), v=merge(dv, HKV))
    grads["x"] = 0
    for n, g in dproj.items():
        grads[f"{n}.weight"] = (x.transpose(0, 2, 1) @ g).sum(0)
        grads[f"{n}.bias"] = g.sum((0, 1))
        grads["x"] = grads["x"] + g @ w[f"{n}.weight"].T
    return y, grads


def _inputs(kind, route, rng):
    if kind == "flash" and route == "direct":
        return [rng.standard_normal((B * H, L, D)).astype(np.float32) for _ in range(3)], \
            rng.standard_normal((B * H, L, D)).astype(np.float32)
    shape = (B * H, L, D) if kind == "flash" else (B, L, E)
    return [rng.standard_normal(shape).astype(np.float32)], \
        rng.standard_normal(shape).astype(np.float32)


CASES = [(kind, route, method) for kind in ("flash", "self_attention") for route in ROUTES
         for method in METHODS]


@pytest.mark.parametrize("kind, route, method", CASES, ids=["-".join(c) for c in CASES])
def test_route_gradients_follow_the_rule(kind, route, method):
    rng = np.random.default_rng(CASES.index((kind, route, method)))
    np.random.seed(CASES.index((kind, route, method)))  # addons' Linear draws its weights there
    inputs, dout = _inputs(kind, route, rng)
    out, got, weights = run_route(kind, route, method, inputs, dout)
    model = flash_model if kind == "flash" else attention_model
    ref_out, refs = model(np.float64, inputs, dout, weights)
    naive_out, naives = model(np.float32, inputs, dout, weights)
    assert sorted(got) == sorted(refs)
    cfg = AttentionConfig.from_shapes((B * H, L, D), (B * H, L, D), (B * H, L, D),
                                      ("float32",) * 3, causal=True, **CHUNKS)
    steps = cfg.num_chunks_kv + cfg.chunk_kv + D + B * L
    assert_within_rule("out", out, naive_out, ref_out, factor=2, dtype="float32",
                       accum_steps=steps, magnitude=float(np.abs(ref_out).max()))
    for name, ref in refs.items():
        assert got[name].shape == ref.shape, name
        assert_within_rule(name, got[name], naives[name], ref, factor=3, dtype="float32",
                           accum_steps=steps, magnitude=gradient_magnitude(refs, name))


class StashedOutputReturned(FlashAttention):
    """The trap: stash ``out`` in ``self.aux`` and return that very tensor."""

    def build(self, q, k, v):
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **self.options)
        for name, t in dict(q=q, k=k, v=v, out=out, lse=lse).items():
            self.aux[name] = t
        return out


@pytest.mark.parametrize("module, dout_label", [(FlashAttention, "FwdGrad"),
                                                (StashedOutputReturned, "Fwd")])
def test_aux_labels_the_gradient_of_a_stashed_output_fwd(module, dout_label):
    """popxl-addons labels a gradient input Fwd(t) when t is also in aux: returning the stashed
    out feeds out where build_grad expects dout (wrong gradients); FlashAttention returns an
    identity of it, so its first gradient input is FwdGrad(returned output)."""
    rng = np.random.default_rng(0)
    qkv = [rng.standard_normal((2, 6, 4)).astype(np.float32) for _ in range(3)]
    ir = popxl.Ir()
    with ir.main_graph:
        ts = [popxl.variable(a) for a in qkv]
        _, graph = module(num_chunks_q=2).create_graph(*(t.spec for t in ts))
        dgraph = graph.autodiff()
    first = dgraph.grad_graph_info.expected_inputs[0]
    assert first.connection_type.name == dout_label
    assert first.fwd_tensor == graph.graph.outputs[0]


def test_called_graphs_grad_info_takes_a_graph_with_named_args():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((B, L, E), np.float32))
        _, graph = AttentionParent("inline").create_graph(x.spec)
        entries = pf.called_graphs_grad_info(graph)
        assert entries.keys() == pf.called_graphs_grad_info(graph.graph).keys()
        assert len(entries) > 1
        with pytest.raises(TypeError, match="popxl.Graph or a popxl-addons GraphWithNamedArgs"):
            pf.called_graphs_grad_info(graph.args)


@pytest.mark.parametrize("args, exc, fragment", [
    (dict(hidden_size=10, heads=4), ValueError, "hidden_size=10 must be a multiple of heads=4"),
    (dict(hidden_size=16, heads=4, kv_heads=3), ValueError, "kv_heads=3 must divide heads=4"),
    (dict(hidden_size=16, heads=4, dropout_p=0.1), TypeError, "unexpected options"),
    (dict(hidden_size=16.0, heads=4), TypeError, "hidden_size must be an int"),
])
def test_self_attention_rejects_bad_arguments(args, exc, fragment):
    with pytest.raises(exc, match=fragment):
        SelfAttention(**args)
