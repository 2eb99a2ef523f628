"""Tests of examples/train_causal_self_attention.py: the hand-composed training step.

The example is imported from its path (``examples/`` is not a package). Sizes are the example's
defaults: B=2, L=22, E=16, H=2 (G=4, Dh=8), num_chunks_q=3, num_chunks_kv=4, so the flash loops
run 3 query chunks of 8 rows and 4 key/value chunks of 6 rows, both with a padded tail of 2.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import popxl_flash as pf

_PATH = Path(__file__).resolve().parents[1] / "examples" / "train_causal_self_attention.py"
_spec = importlib.util.spec_from_file_location("train_causal_self_attention", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

EPS32 = float(np.finfo(np.float32).eps)
STEPS = 8
SEED = 0
D = example.DEFAULTS
NAMES = example.WEIGHTS + ("x",)

# Gradient tolerance, relative to the largest entry of each gradient (a normwise bound).
# Both layers are float32 computations of the same function and differ only in the order of
# their sums: flash accumulates the softmax and its gradient chunk by chunk with online
# rescaling, naive in one pass. Each float32 sum of n terms carries a relative error of at
# most about n * eps32 of the sum of |terms|; a gradient entry here is the end of a chain of
# such sums: the projections (E = 16 terms), the attention forward and backward (L = 22 keys,
# Dh = 8, plus ~4 roundings per each of the 3 + 4 chunk steps), the output projection and its
# gradient (E), and the weight gradients' sums over B*L = 44 positions. That is 16 + 2 * (22 + 8
# + 28) + 16 + 44 ~ 200 roundings along the longest path, so a bound of 256 eps32 times the
# gradient's magnitude (~3e-5 relative) holds whatever the order; measured differences are
# ~1e-7 relative (a handful of eps32).
GRAD_RTOL = 256 * EPS32


@pytest.fixture(scope="module")
def grads():
    return {a: example.gradients(attention=a, seed=SEED) for a in ("flash", "naive")}


@pytest.fixture(scope="module")
def runs():
    return {a: example.train(STEPS, attention=a, seed=SEED, return_weights=True)
            for a in ("flash", "naive")}


def _split(t, H):
    B, L, E = t.shape
    return t.reshape(B, L, H, E // H).transpose(0, 2, 1, 3).reshape(B * H, L, E // H)


def _merge(t, H):
    G, L, Dh = t.shape
    return t.reshape(G // H, H, L, Dh).transpose(0, 2, 1, 3).reshape(G // H, L, H * Dh)


def reference_step(weights, data, heads):
    """float64 NumPy loss and gradients of the example's layer (oracle: ``pf.reference``)."""
    w = {n: a.astype(np.float64) for n, a in weights.items()}
    x, t = data["x"].astype(np.float64), data["target"].astype(np.float64)
    B, L, E = x.shape
    q, k, v = (_split(x @ w[n], heads) for n in ("wq", "wk", "wv"))
    out, _ = pf.reference.attention(q, k, v, causal=True)
    h = _merge(out, heads)
    diff = h @ w["wo"] - t
    dy = 2.0 * diff / diff.size
    g = {"wo": h.reshape(B * L, E).T @ dy.reshape(B * L, E)}
    dqkv = pf.reference.attention_grad(_split(dy @ w["wo"].T, heads), q, k, v, causal=True)
    g["x"] = 0.0
    for n, d in zip(("wq", "wk", "wv"), dqkv):
        dp = _merge(d, heads)
        g[n] = x.reshape(B * L, E).T @ dp.reshape(B * L, E)
        g["x"] = g["x"] + dp @ w[n].T
    return float(np.mean(diff ** 2)), g


def _rel(a, b):
    """max|a - b| / max|b|."""
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def test_flash_gradients_match_naive(grads):
    for n in NAMES:
        f, nv = grads["flash"][n], grads["naive"][n]
        assert f.shape == nv.shape and f.dtype == nv.dtype == np.float32
        assert np.all(np.isfinite(f)), n
        assert _rel(f, nv) <= GRAD_RTOL, f"{n}: {_rel(f, nv):.2e} > {GRAD_RTOL:.2e}"


def test_gradients_match_float64_reference(grads):
    # Same bound as flash vs naive: float32 against exact differs by the same kind of rounding.
    _, ref = reference_step(example.initial_weights(SEED), example.batch(SEED), D["heads"])
    for a in ("flash", "naive"):
        for n in NAMES:
            assert _rel(grads[a][n], ref[n]) <= GRAD_RTOL, (a, n, _rel(grads[a][n], ref[n]))


def test_loss_decreases(runs):
    losses, _ = runs["flash"]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    # Small lr: plain gradient descent on a smooth loss decreases it at every step.
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    ref_loss, _ = reference_step(example.initial_weights(SEED), example.batch(SEED), D["heads"])
    assert abs(losses[0] - ref_loss) <= 64 * EPS32 * ref_loss


def test_flash_and_naive_loss_trajectories_agree(runs):
    # Each step's loss is a float32 mean of B*L*E = 704 squares (relative rounding ~ eps32 per
    # term in the worst case), and the weights it is computed from differ only by the summation
    # order of earlier gradients (GRAD_RTOL relative, times lr * step, a small fraction of the
    # weights). 64 eps32 relative (~8e-6) covers both with room; measured agreement is ~1e-7.
    flash, naive = runs["flash"][0], runs["naive"][0]
    for step, (f, n) in enumerate(zip(flash, naive)):
        assert abs(f - n) <= 64 * EPS32 * abs(n), (step, f, n)
    for name in example.WEIGHTS:
        wf, wn = runs["flash"][1][name], runs["naive"][1][name]
        assert _rel(wf, wn) <= GRAD_RTOL, name


def test_sgd_update_uses_the_gradients(grads):
    # One step moves each weight by exactly -lr * grad (float32 accumulate_; a few eps32).
    _, after = example.train(1, attention="flash", seed=SEED, return_weights=True)
    for n, w0 in example.initial_weights(SEED).items():
        expected = w0 + np.float32(-D["lr"]) * grads["flash"][n]
        np.testing.assert_allclose(after[n], expected, rtol=0, atol=4 * EPS32 * np.abs(w0).max())


def test_bad_attention_name():
    with pytest.raises(ValueError, match="attention"):
        example.build_layer_graph(example.initial_weights(SEED), attention="sdpa")
