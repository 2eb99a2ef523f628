"""Tests of examples/train_gpt_block.py: pre-LN GPT blocks trained with pf.autodiff gradients.

The first step's weight gradients of the flash stack are held to the FlashAttention rule (3x
for the backward, tests/attention_utils.py) against a float64 reference: central differences
of a NumPy float64 twin of the stack's loss. The same-precision baseline is the same stack on
naive PopXL attention, differentiated entirely by autodiff. Sizes are small so the reference
(two loss evaluations per weight) stays cheap: B=2, L=8, H=2, Dh=4 (E=8, MLP 32), 2 layers,
3 flash chunks of 3 rows (a padded tail of 1).
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from attention_utils import assert_within_rule

_PATH = Path(__file__).resolve().parents[1] / "examples" / "train_gpt_block.py"
_spec = importlib.util.spec_from_file_location("train_gpt_block", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

SIZES = dict(batch=2, seq_len=8, heads=2, head_dim=4, layers=2, num_chunks=3, seed=3)
GELU_C = 0.7978845608028654


def _layer_norm(x, g, b):
    m = x.mean(1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(1, keepdims=True) + 1e-5) * g + b


def _attention(h, w_qkv, w_out, batch, heads):
    T, E = h.shape
    L, D = T // batch, E // heads
    qkv = h @ w_qkv
    q, k, v = (qkv[:, i * E:(i + 1) * E].reshape(batch, L, heads, D).transpose(0, 2, 1, 3)
               for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ v
    return o.transpose(0, 2, 1, 3).reshape(T, E) @ w_out


def loss64(layers, x, target, batch, heads):
    """float64 twin of the example's loss."""
    for w in layers:
        x = x + _attention(_layer_norm(x, w["ln1_scale"], w["ln1_bias"]), w["w_qkv"],
                           w["w_out"], batch, heads)
        z = _layer_norm(x, w["ln2_scale"], w["ln2_bias"]) @ w["w_mlp1"]
        x = x + 0.5 * z * (1 + np.tanh(GELU_C * (z + 0.044715 * z ** 3))) @ w["w_mlp2"]
    return ((x - target) ** 2).mean()


def reference_grads(h=1e-6):
    """Central differences of :func:`loss64` at the example's initial weights."""
    s = SIZES
    sizes = dict(heads=s["heads"], head_dim=s["head_dim"], dtype="float32")
    layers = [{n: a.astype(np.float64) for n, a in w.items()}
              for w in example.initial_weights(s["seed"], layers=s["layers"], **sizes)]
    batch = example.data(s["seed"], batch=s["batch"], seq_len=s["seq_len"], **sizes)
    x, target = (batch[n].astype(np.float64) for n in ("x", "target"))
    grads = {}
    for i, w in enumerate(layers):
        for n, a in w.items():
            g = np.zeros_like(a)
            for idx in np.ndindex(a.shape):
                a[idx] += h
                up = loss64(layers, x, target, s["batch"], s["heads"])
                a[idx] -= 2 * h
                down = loss64(layers, x, target, s["batch"], s["heads"])
                a[idx] += h
                g[idx] = (up - down) / (2 * h)
            grads[f"{i}.{n}"] = g
    return grads


@pytest.fixture(scope="module")
def grads():
    out = {a: example.run(1, store_grads=True, attention=a, **SIZES)[1]
           for a in ("flash", "naive")}
    out["ref"] = reference_grads()
    return out


def test_weight_gradients_follow_the_flash_attention_rule(grads):
    assert set(grads["flash"]) == set(grads["ref"]) == set(grads["naive"])
    cq = -(-SIZES["seq_len"] // SIZES["num_chunks"])
    for name, ref in grads["ref"].items():
        flash = grads["flash"][name]
        assert flash.shape == ref.shape and flash.dtype == np.float32
        assert_within_rule(name, flash, grads["naive"][name], ref, factor=3, dtype="float32",
                           accum_steps=SIZES["num_chunks"] + cq + SIZES["head_dim"],
                           magnitude=float(np.abs(ref).max()))


def test_loss_decreases_over_five_steps(capsys):
    losses = example.main(["--steps", "5"])
    printed = capsys.readouterr().out.splitlines()
    assert len(losses) == 5 and len(printed) == 5
    assert all(f"step {i}: loss" in line for i, line in enumerate(printed))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_float16_runs_and_learns():
    losses, _ = example.run(3, dtype="float16", **SIZES)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("argv", [["--heads", "0"], ["--seq-len", "x"], ["--lr", "-1"],
                                  ["--dtype", "bfloat16"], ["--num-chunks", "40"]])
def test_bad_arguments_are_argparse_errors(argv):
    with pytest.raises(SystemExit) as err:
        example.parse_args(argv)
    assert err.value.code == 2
