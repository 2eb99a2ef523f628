"""examples/addons_gpt.py: a GPT written with popxl-addons and popxl_flash.addons.SelfAttention.

Its loss falls, and the first step's mean weight gradients (``autodiff_with_accumulation``, no
entries passed) are held to the FlashAttention rule: at most 3x the error of the same model and
weights on naive attention (``--attention naive``) against a float64 reference, central
differences of a NumPy float64 twin of the loss. Tiny sizes keep the reference cheap.
"""
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

if not os.environ.get("POPXL_ADDONS_PATH", "").strip():
    pytest.skip("set POPXL_ADDONS_PATH to a popxl-addons checkout", allow_module_level=True)

from attention_utils import assert_within_rule, gradient_magnitude
from popxl_flash.plan.config import AttentionConfig

_PATH = Path(__file__).resolve().parents[2] / "examples" / "addons_gpt.py"
_spec = importlib.util.spec_from_file_location("addons_gpt", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

SIZES = dict(vocab=8, seq_len=6, hidden=8, heads=2, kv_heads=1, layers=2, batch=2,
             micro_batches=2, num_chunks=2, seed=4)
GELU_C = 0.7978845608028654


def _layer_norm(x, g, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _linear(w, name, x):
    return x @ w[f"{name}.weight"] + w.get(f"{name}.bias", 0)


def _attention(w, x, s):
    """SelfAttention's twin: q, k, v projections, causal GQA attention, output projection."""
    B, L, E = x.shape
    H, Hkv = s["heads"], s["kv_heads"]
    D = E // H
    q = _linear(w, "attn.q", x).reshape(B, L, H, D).transpose(0, 2, 1, 3)
    k, v = (_linear(w, f"attn.{n}", x).reshape(B, L, Hkv, D).transpose(0, 2, 1, 3)
            for n in "kv")
    k, v = (np.repeat(t, H // Hkv, axis=1) for t in (k, v))  # q head h reads kv head h // r
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ v
    return _linear(w, "attn.o", out.transpose(0, 2, 1, 3).reshape(B, L, E))


def loss64(weights, data, s):
    """float64 twin of the example's loss, averaged over the micro-batches of one step."""
    total = 0.0
    for tokens, targets in data:
        x = tokens @ weights["wte"] + weights["wpe"]
        for i in range(s["layers"]):
            w = {n[len(f"layer{i}."):]: a for n, a in weights.items()
                 if n.startswith(f"layer{i}.")}
            x = x + _attention(w, _layer_norm(x, w["ln1.weight"], w["ln1.bias"]), s)
            z = _linear(w, "fc1", _layer_norm(x, w["ln2.weight"], w["ln2.bias"]))
            x = x + _linear(w, "fc2", 0.5 * z * (1 + np.tanh(GELU_C * (z + 0.044715 * z ** 3))))
        h = _layer_norm(x, weights["ln_f.weight"], weights["ln_f.bias"])
        logits = h @ (weights["head.weight"] if s["untied_head"] else weights["wte"].T)
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total += -(targets * logp).sum(-1).mean()
    return total / len(data)


def reference_grads(weights, s, h=1e-6):
    """Central differences of :func:`loss64` at ``weights``."""
    w64 = {n: a.astype(np.float64) for n, a in weights.items()}
    data = [tuple(a.astype(np.float64) for a in pair) for pair in example.batches(s)]
    grads = {}
    for name, a in w64.items():
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            old = a[i]
            a[i] = old + h
            up = loss64(w64, data, s)
            a[i] = old - h
            down = loss64(w64, data, s)
            a[i] = old
            g[i] = (up - down) / (2 * h)
        grads[name] = g
    return grads


@pytest.mark.parametrize("untied_head", [False, True], ids=["tied", "untied"])
def test_gradients_follow_the_rule_against_naive_attention(untied_head):
    s = dict(example.DEFAULTS, **SIZES, untied_head=untied_head)
    del s["steps"]
    _, flash, weights = example.run(1, store_grads=True, **s)
    _, naive, naive_weights = example.run(1, store_grads=True, **dict(s, attention="naive"))
    s["steps"] = 1
    assert sorted(flash) == sorted(naive) == sorted(weights)
    for name, w in weights.items():  # the same model: identical initial weights
        np.testing.assert_array_equal(w, naive_weights[name])
    assert ("head.weight" in weights) == untied_head
    refs = reference_grads(weights, s)
    L, D = s["seq_len"], s["hidden"] // s["heads"]
    cfg = AttentionConfig.from_shapes((2, L, D), (2, L, D), (2, L, D), ("float32",) * 3,
                                      num_chunks_q=s["num_chunks"],
                                      num_chunks_kv=s["num_chunks"])
    steps = cfg.num_chunks_kv + cfg.chunk_kv + D + s["batch"] * L * s["micro_batches"]
    for name, ref in refs.items():
        assert flash[name].shape == ref.shape, name
        assert_within_rule(name, flash[name], naive[name], ref, factor=3, dtype="float32",
                           accum_steps=steps, magnitude=gradient_magnitude(refs, name))


def test_loss_falls():
    losses, _, _ = example.run(6, **dict(SIZES, lr=0.2))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses


def test_cli_prints_the_loss_per_step(capsys):
    losses = example.main(["--steps", "3", "--vocab", "8", "--seq-len", "6", "--hidden", "8",
                           "--heads", "2", "--kv-heads", "1", "--layers", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out == [f"step {i}: loss {loss:.6f}" for i, loss in enumerate(losses)]


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exc:
        example.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--vocab", "--seq-len", "--hidden", "--heads", "--kv-heads", "--layers",
                   "--batch", "--micro-batches", "--steps", "--lr", "--num-chunks",
                   "--untied-head", "--attention", "--seed", "--device", "--block",
                   "--decode"):
        assert option in text, option
    assert set(example.DEFAULTS) == {"vocab", "seq_len", "hidden", "heads", "kv_heads",
                                     "layers", "batch", "micro_batches", "steps", "lr",
                                     "num_chunks", "untied_head", "attention", "seed",
                                     "device", "block", "decode"}


@pytest.mark.parametrize("argv, fragment", [
    (["--num-chunks", "7", "--seq-len", "6"], "--num-chunks must be at most --seq-len"),
    (["--hidden", "10", "--heads", "4"], "must be a multiple of --heads"),
    (["--heads", "4", "--kv-heads", "3"], "a divisor of it"),
    (["--vocab", "1"], "expected an int >= 2"),
    (["--decode", "3"], "--decode needs --block llama"),
])
def test_bad_options_are_usage_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        example.parse_args(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


LLAMA = dict(SIZES, block="llama", hidden=16, heads=4, kv_heads=2, seq_len=8, vocab=8)


def test_llama_block_loss_falls_and_its_variables():
    """Llama-style blocks (RMS norm, no biases, rotary, GQA, SwiGLU) train: the loss falls;
    no bias and no position table among the variables."""
    losses, _, weights = example.run(8, return_trained=True, **dict(LLAMA, lr=0.3))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
    assert not any(n.endswith(".bias") for n in weights) and "wpe" not in weights
    assert weights["layer0.attn.k.weight"].shape == (16, 2 * 4)  # kv_heads * D


def test_cached_generation_matches_recomputation():
    """Prefill and decode with the KV cache (Graphcore's BHDS/BHSD layouts) give, at every
    step, the logits of the no-cache model on the whole sequence so far, and the same greedy
    tokens. Tolerance: both sides are float32 computations of the same function in a
    different summation order (flash vs one-shot softmax, E=16 and 4E=64 projections, L <= 11,
    two layers): a few hundred float32 roundings of values up to max|logits|, so 1e-4 relative
    to max|logits|."""
    s = dict(example.DEFAULTS, **LLAMA)
    _, _, weights = example.run(3, return_trained=True, **{k: v for k, v in s.items()
                                                           if k != "steps"})
    prompts = np.array([[1, 2, 3, 4, 5], [6, 7, 0, 1, 2]])
    generated, logits = example.generate(s, weights, prompts, 4)
    seq = np.concatenate([prompts, generated], axis=1)
    full = example.full_logits(s, weights, seq[:, :-1])  # [B, 8, V]
    want = full[:, prompts.shape[1] - 1:].transpose(1, 0, 2)  # the rows that predict generated
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-4 * scale)
    np.testing.assert_array_equal(generated, np.argmax(want, axis=-1).T)


def test_cli_decodes_after_training(capsys):
    example.main(["--block", "llama", "--steps", "12", "--vocab", "8", "--seq-len", "8",
                  "--hidden", "16", "--heads", "4", "--kv-heads", "2", "--layers", "1",
                  "--lr", "0.3", "--decode", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].endswith("generated tokens follow the successor table"), out
    assert sum(line.startswith("prompt ") for line in out) == 2
