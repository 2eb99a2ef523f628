"""popxl-addons' ``Linear`` and ``LayerNorm`` layers, differentiated with ``addons.autodiff``,
run on the emulator and checked against float64 references (numpy, and PyTorch autograd when
torch is installed) under the project's tolerance rule (``popxl_flash/checks/tolerance.py``): error at
most 2x (forward) / 3x (gradients) the error of the same computation done naively in float32,
plus the rounding and accumulation floor."""
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

if not os.environ.get("POPXL_ADDONS_PATH", "").strip():
    pytest.skip("set POPXL_ADDONS_PATH to a popxl-addons checkout", allow_module_level=True)

import popxl  # noqa: E402 - the emulator, installed by conftest.py

import popxl_addons as addons  # noqa: E402
from popxl_addons.layers import LayerNorm, Linear  # noqa: E402

from popxl_flash.checks import tolerance  # noqa: E402

EPS = 1e-5
REFERENCES = ["numpy", "torch"]


def _run(module, x_np, dy_np, weights):
    """Build the forward, its ``addons.autodiff`` gradient graph, call both once and run.

    Returns: {"y": output, "x"/<weight name>: gradient}.
    """
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(x_np, popxl.float32, name="x")
        facts, graph = module.create_graph(x)
        dgraph = addons.autodiff(graph)
        variables = facts.init()
        fwd = graph.bind(variables).call_with_info(x)
        dy = popxl.variable(dy_np, popxl.float32, name="dy")
        grads = dgraph.call(dy, args=dgraph.grad_graph_info.inputs_dict(fwd))
        names = {t: n for n, t in graph.args.named_tensors.items()}
        names[graph.graph.inputs[0]] = "x"
        fwd_ts = [ec.fwd_tensor for ec in dgraph.grad_graph_info.expected_outputs]
        streams = {"y": addons.host_store(fwd.outputs[0])}
        streams.update({names[t]: addons.host_store(g) for t, g in zip(fwd_ts, grads)})
    session = popxl.Session(ir, "ipu_model")
    with session:
        session.write_variables_data({getattr(variables, n): w for n, w in weights.items()})
        out = session.run()
    return {n: out[s] for n, s in streams.items()}


# -- references ------------------------------------------------------------------------------
def _linear_np(x, w, b, dy):
    y = x @ w + b
    return {"y": y, "x": dy @ w.T, "weight": x.T @ dy, "bias": dy.sum(0)}


def _layer_norm_np(x, w, b, dy):
    mean = x.mean(-1, keepdims=True)
    xc = x - mean
    inv = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + x.dtype.type(EPS))
    xhat = xc * inv
    g = dy * w
    dx = inv * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return {"y": xhat * w + b, "x": dx, "weight": (dy * xhat).sum(0), "bias": dy.sum(0)}


def _torch_ref(kind, x, w, b, dy):
    torch = pytest.importorskip("torch")
    t = {n: torch.tensor(a, requires_grad=True) for n, a in (("x", x), ("weight", w),
                                                              ("bias", b))}
    if kind == "linear":
        y = t["x"] @ t["weight"] + t["bias"]
    else:
        y = torch.nn.functional.layer_norm(t["x"], (x.shape[-1],), t["weight"], t["bias"],
                                           eps=EPS)
    y.backward(torch.tensor(dy))
    return {"y": y.detach().numpy(), **{n: v.grad.numpy() for n, v in t.items()}}


def _references(kind, source, x, w, b, dy):
    """Returns: (float64 reference, naive float32) dicts."""
    f = _linear_np if kind == "linear" else _layer_norm_np
    args32 = [a.astype(np.float32) for a in (x, w, b, dy)]
    if source == "torch":
        return _torch_ref(kind, x, w, b, dy), _torch_ref(kind, *args32)
    return f(x, w, b, dy), f(*args32)


def _check(got, ref, naive, steps):
    for name in ref:
        factor = 2 if name == "y" else 3
        mag = float(np.max(np.abs(ref[name]), initial=0.0)) + 1.0
        bound = tolerance.rule_bound(naive[name], ref[name], factor=factor, dtype="float32",
                                     accum_steps=steps, magnitude=mag)
        err = tolerance.max_err(got[name], ref[name])
        assert got[name].shape == ref[name].shape, name
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


def _data(seed, rows, cols, out):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)), rng.standard_normal((cols, out)) * 0.5,
            rng.standard_normal(out), rng.standard_normal((rows, out)))


@pytest.mark.parametrize("source", REFERENCES)
@settings(max_examples=6)
@given(rows=st.integers(1, 6), cols=st.integers(1, 12), out=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_linear_autodiff(source, rows, cols, out, seed):
    x, w, b, dy = _data(seed, rows, cols, out)
    ref, naive = _references("linear", source, x, w, b, dy)
    got = _run(Linear(out), x, dy.astype(np.float32),
                  {"weight": w.astype(np.float32), "bias": b.astype(np.float32)})
    assert set(got) == {"y", "x", "weight", "bias"}
    _check(got, ref, naive, steps=max(rows, cols, out))


@pytest.mark.parametrize("source", REFERENCES)
@settings(max_examples=6)
@given(rows=st.integers(1, 6), cols=st.integers(2, 24), seed=st.integers(0, 2**16))
def test_layer_norm_autodiff(source, rows, cols, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 3 + 1
    w, b, dy = rng.standard_normal(cols), rng.standard_normal(cols), rng.standard_normal(
        (rows, cols))
    ref, naive = _references("layer_norm", source, x, w, b, dy)
    got = _run(LayerNorm(), x, dy.astype(np.float32),
                  {"weight": w.astype(np.float32), "bias": b.astype(np.float32)})
    _check(got, ref, naive, steps=4 * cols)


def test_linear_gradients_accumulate():
    """``autodiff_with_accumulation``: the accumulators hold the running mean of one step's
    weight gradients (one call: the gradients themselves)."""
    x, w, b, dy = _data(7, 4, 5, 3)
    ref, naive = _references("linear", "numpy", x, w, b, dy)
    ir = popxl.Ir()
    with ir.main_graph:
        xt = popxl.variable(x, popxl.float32, name="x")
        facts, graph = Linear(3).create_graph(xt)
        dfacts, dgraph = addons.autodiff_with_accumulation(graph, graph.args.tensors)
        variables, accums = facts.init(), dfacts.init()
        fwd = graph.bind(variables).call_with_info(xt)
        dyt = popxl.variable(dy, popxl.float32, name="dy")
        dgraph.bind(accums).call(dyt, args=dgraph.grad_graph_info.inputs_dict(fwd))
    session = popxl.Session(ir, "ipu_model")
    with session:
        session.write_variables_data({variables.weight: w.astype(np.float32),
                                      variables.bias: b.astype(np.float32)})
        session.run()
    got = {n: session.get_tensor_data(getattr(accums.accum, n)) for n in ("weight", "bias")}
    got["y"], ref["y"], naive["y"] = 0, 0, 0  # not stored here
    for name in ("weight", "bias"):
        bound = tolerance.rule_bound(naive[name], ref[name], factor=3, dtype="float32",
                                     accum_steps=4, magnitude=float(np.abs(ref[name]).max()) + 1)
        assert tolerance.max_err(got[name], ref[name]) <= bound
    assert float(session.get_tensor_data(accums.mean_accum_counter)) == 1.0
