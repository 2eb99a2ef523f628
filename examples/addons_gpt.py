"""Train a small GPT written with popxl-addons, its attention popxl_flash.addons.SelfAttention;
with ``--block llama``, a Llama-style model, then decode with a KV cache.

The model is ordinary popxl-addons code (``addons.Module``, ``addons.layers.Linear`` and
``LayerNorm``, ``call_module``, ``autodiff_with_accumulation``), as Graphcore's GPT examples
are; only the attention layer comes from this library::

    x = onehot(tokens) @ wte (+ wpe: gpt blocks only)       # token (and position) embedding
    for each of N blocks (call_module, one graph each):
      gpt:    x = x + SelfAttention(ln1(x))                 # causal flash attention, GQA option
              x = x + fc2(gelu(fc1(ln2(x))))                # MLP (4E)
      llama:  x = x + SelfAttention(rms1(x))                # no biases, rotary (half-split), GQA
              x = x + down(silu(gate(rms2(x))) * up(rms2(x)))    # SwiGLU MLP, no biases
    logits = norm_f(x) @ wte.T   (tied)  or  head(norm_f(x))   (untied, --untied-head)
    loss = mean cross-entropy of the next token

The gradient graph comes from ``addons.autodiff_with_accumulation`` with no
``called_graphs_grad_info`` passed: each ``SelfAttention`` registers flash's backward in its
``called_graphs_grad_info`` and ``call_module`` hands it up. Each step runs ``--micro-batches``
forward and backward passes (the gradients accumulate as a running mean) and then one SGD
update ``w -= lr * mean gradient`` of every weight, all in one main graph.

The task: every sequence follows a fixed random successor table (token ``t`` is followed by
``succ[t]``), so the next token is learnable from the current one; the loss of each step is
printed. ``--attention naive`` runs the same model and weights with naive attention (full score
matrix, differentiated by autodiff), for comparison.

``--decode N`` (llama blocks) then generates ``N`` tokens greedily after a prompt of
``--seq-len // 2`` tokens with the trained weights and a KV cache per layer in Graphcore's
Llama layout (k ``[B, Hkv, D, S]``, v ``[B, Hkv, S, D]``): one prefill graph
(``SelfAttention(cache_len=...)`` writes the prompt's keys and values in place), then one
decode-step graph run once per token (``cache_seqlens`` = the rows already in the cache,
Graphcore's ``last_token_indices``). It prints the generated tokens and how many follow the
successor table.

Needs popxl-addons 3.4 and its dependencies (``pip install -e ".[addons]"``;
``POPXL_ADDONS_PATH`` naming a checkout is put on ``sys.path``). Without the Poplar SDK the
emulator stands in for PopXL and stand-ins for ``mpi4py``, ``popdist`` and ``cppimport`` where
they are missing or cannot load (``popxl_flash.emulator.install(standins=True)``). Run::

    python examples/addons_gpt.py [--steps 10] [--layers 2] [--kv-heads 1] ...
    python examples/addons_gpt.py --block llama --kv-heads 2 --steps 20 --decode 6
"""
import argparse
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Dict

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import cli
from popxl_flash import popxl

if pf.BACKEND == "emulator":
    from popxl_flash import emulator
    # `import popxl` inside popxl-addons gives the emulator; mpi4py, popdist and cppimport get
    # stand-ins where they are missing or cannot load (no MPI library)
    emulator.install(standins=True)
    emulator.set_strict(True)  # our own code: unspecified behaviour raises
if os.environ.get("POPXL_ADDONS_PATH"):
    sys.path.insert(0, os.environ["POPXL_ADDONS_PATH"])

import popxl_addons as addons  # noqa: E402
from popxl_addons.layers import LayerNorm, Linear  # noqa: E402

from popxl_flash.addons import SelfAttention  # noqa: E402
from popxl_flash.checks.naive import naive_attention  # noqa: E402

ops = popxl.ops

#: Settings used unless overridden.
DEFAULTS = dict(vocab=16, seq_len=16, hidden=32, heads=4, kv_heads=None, layers=2, batch=2,
                micro_batches=2, steps=10, lr=0.5, num_chunks=2, untied_head=False,
                attention="flash", seed=0, device="ipu_model", block="gpt", decode=0)
#: The KV caches' layouts of --decode: Graphcore's Llama keeps k pre-transposed.
K_CACHE_LAYOUT, V_CACHE_LAYOUT = "BHDS", "BHSD"


class NaiveSelfAttention(SelfAttention):
    """:class:`popxl_flash.addons.SelfAttention` with naive attention (same weights and names):
    k/v heads repeated per q head, the full score matrix, autodiff's own gradient."""

    def attend(self, q, k, v):
        r = self.heads // self.kv_heads
        if r > 1:  # [B*Hkv, L, D] -> [B*H, L, D], kv head h // r for q head h
            Gk, L, D = k.shape
            k, v = (ops.concat([t.reshape((Gk, 1, L, D))] * r, axis=1).reshape((Gk * r, L, D))
                    for t in (k, v))
        return naive_attention(q, k, v, causal=True, **{
            n: self.options[n] for n in ("scale", "window") if n in self.options})


class Block(addons.Module):
    """One pre-LN GPT block on ``x [B, L, E]``."""

    def __init__(self, hidden, heads, kv_heads, attention, num_chunks):
        super().__init__()
        layer = SelfAttention if attention == "flash" else NaiveSelfAttention
        self.ln1, self.ln2 = LayerNorm(), LayerNorm()
        self.attn = layer(hidden, heads, kv_heads, causal=True, num_chunks_q=num_chunks,
                          num_chunks_kv=num_chunks)
        self.fc1, self.fc2 = Linear(4 * hidden), Linear(hidden)

    def build(self, x):
        B, L, E = x.shape
        x = x + self.attn(self.ln1(x.reshape((B * L, E))).reshape((B, L, E)))
        h = self.fc2(ops.gelu(self.fc1(self.ln2(x.reshape((B * L, E))))))
        return x + h.reshape((B, L, E))


class RMSNorm(addons.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` on ``x [N, E]`` (Llama's norm)."""

    def build(self, x):
        w = self.add_variable_input("weight", partial(np.ones, (x.shape[-1],)), x.dtype)
        ms = ops.mean(x * x, axis=-1, keepdims=True)
        return x / ops.sqrt(ms + 1e-5) * w


def silu(x):
    """``x * sigmoid(x)`` in differentiable PopXL ops."""
    return x / (ops.exp(-x) + 1.0)


class LlamaBlock(addons.Module):
    """One Llama-style block on ``x [B, L, E]``: RMS norms, attention without biases with
    half-split rotary on every head dim and grouped-query heads, a SwiGLU MLP without biases.

    With ``cache_len`` it is the inference block: ``build(x, k_cache, v_cache, cache_seqlens)``
    with the caches by reference (the same variable names as the training block).
    """

    def __init__(self, hidden, heads, kv_heads, attention, num_chunks, cache_len=None):
        super().__init__()
        layer = SelfAttention if attention == "flash" else NaiveSelfAttention
        D = hidden // heads
        self.ln1, self.ln2 = RMSNorm(), RMSNorm()
        if cache_len is None:
            self.attn = layer(hidden, heads, kv_heads, causal=True, bias=False, rotary_dim=D,
                              num_chunks_q=num_chunks, num_chunks_kv=num_chunks)
        else:
            self.attn = SelfAttention(hidden, heads, kv_heads, causal=True, bias=False,
                                      rotary_dim=D, cache_len=cache_len,
                                      k_cache_layout=K_CACHE_LAYOUT,
                                      v_cache_layout=V_CACHE_LAYOUT)
            self.build = self.build_cached
        self.gate, self.up = Linear(4 * hidden, bias=False), Linear(4 * hidden, bias=False)
        self.down = Linear(hidden, bias=False)

    def _mlp(self, x):
        B, L, E = x.shape
        h = self.ln2(x.reshape((B * L, E)))
        return x + self.down(silu(self.gate(h)) * self.up(h)).reshape((B, L, E))

    def build(self, x):
        B, L, E = x.shape
        x = x + self.attn(self.ln1(x.reshape((B * L, E))).reshape((B, L, E)))
        return self._mlp(x)

    def build_cached(self, x, k_cache: popxl.TensorByRef, v_cache: popxl.TensorByRef, lens):
        B, L, E = x.shape
        x = x + self.attn(self.ln1(x.reshape((B * L, E))).reshape((B, L, E)), k_cache,
                          v_cache, lens)
        return self._mlp(x)


class GPT(addons.Module):
    """Embedding, ``layers`` blocks, final norm, tied or untied head, cross-entropy.

    ``build(tokens, targets)``: one-hot ``[B, L, vocab]`` float32 each; returns the mean
    cross-entropy (a scalar). ``s["block"]`` picks GPT blocks (layer norms, learned position
    embedding ``wpe``) or Llama blocks (RMS norms, rotary positions, no ``wpe``).
    """

    def __init__(self, s):
        super().__init__()
        self.s = s
        self.ln_f = RMSNorm() if s["block"] == "llama" else LayerNorm()
        if s["untied_head"]:
            self.head = Linear(s["vocab"], bias=False)

    def block(self, i):
        s = self.s
        if s["block"] == "llama":
            return LlamaBlock(s["hidden"], s["heads"], s["kv_heads"], s["attention"],
                              s["num_chunks"])
        return Block(s["hidden"], s["heads"], s["kv_heads"], s["attention"], s["num_chunks"])

    def embed(self, tokens):
        s = self.s
        B, L, V = tokens.shape
        E = s["hidden"]
        self.wte = self.add_variable_input("wte", partial(np.zeros, (V, E)), popxl.float32)
        x = (tokens.reshape((B * L, V)) @ self.wte).reshape((B, L, E))
        if s["block"] == "gpt":
            x = x + self.add_variable_input("wpe", partial(np.zeros, (L, E)), popxl.float32)
        return x

    def logits(self, x):
        B, L, E = x.shape
        h = self.ln_f(x.reshape((B * L, E)))
        return self.head(h) if self.s["untied_head"] else h @ self.wte.transpose()  # [B*L, V]

    def build(self, tokens, targets):
        B, L, V = tokens.shape
        x = self.embed(tokens)
        for i in range(self.s["layers"]):
            (x,) = self.call_module(self.block(i), name=f"layer{i}")(x)
        logp = ops.log(ops.softmax(self.logits(x), axis=-1))
        return -ops.mean(ops.sum(targets.reshape((B * L, V)) * logp, axis=-1))


class CachedLM(GPT):
    """The Llama-style model for inference: ``build(tokens, cache_seqlens, *caches)`` ->
    logits ``[B, L, vocab]`` of the new tokens, the caches (``k_0, v_0, k_1, ...`` in the
    layouts above) by reference, written in place. The same variable names as :class:`GPT`."""

    def __init__(self, s, cache_len):
        super().__init__(s)
        self.cache_len = cache_len

    def build(self, tokens, lens, *caches: popxl.TensorByRef):
        s = self.s
        B, L, V = tokens.shape
        x = self.embed(tokens)
        for i in range(s["layers"]):
            block = LlamaBlock(s["hidden"], s["heads"], s["kv_heads"], "flash", None,
                               cache_len=self.cache_len)
            (x,) = self.call_module(block, name=f"layer{i}")(x, caches[2 * i],
                                                           caches[2 * i + 1], lens)
        return self.logits(x).reshape((B, L, V))


@dataclass
class TrainGraph:
    """What :func:`build` returns: the Ir (its main graph is one training step), the h2d
    streams per micro-batch (``tokens``, ``targets``), the loss d2h streams, the weight and
    gradient-accumulator variables (``{name: Variable}``)."""
    ir: object
    inputs: list
    losses: list
    weights: Dict[str, object]
    accums: Dict[str, object]


def build(s):
    """One training step: ``micro_batches`` forward + backward passes, then SGD."""
    ir = popxl.Ir()
    B, L, V = s["batch"], s["seq_len"], s["vocab"]
    with ir.main_graph:
        spec = popxl.TensorSpec((B, L, V), popxl.float32)
        facts, graph = GPT(s).create_graph(spec, spec)
        dfacts, dgraph = addons.autodiff_with_accumulation(graph, graph.args.tensors)
        weights, accums = facts.init(), dfacts.init()  # replaced by initial_weights()
        inputs, losses = [], []
        with popxl.in_sequence(True):
            for _ in range(s["micro_batches"]):
                streams = [popxl.h2d_stream(spec.shape, popxl.float32) for _ in range(2)]
                info = graph.bind(weights).call_with_info(*(ops.host_load(t) for t in streams))
                losses.append(popxl.d2h_stream((), popxl.float32))
                ops.host_store(losses[-1], info.outputs[0])
                dgraph.bind(accums).call(popxl.constant(1.0, popxl.float32),
                                         args=dgraph.grad_graph_info.inputs_dict(info))
                inputs.append(streams)
            accum = accums.named_tensors
            for name, w in weights.named_tensors.items():  # SGD on the mean gradient
                ops.var_updates.accumulate_(w, accum[f"accum.{name}"], f=-s["lr"])
            ops.var_updates.accumulator_zero_(accums.mean_accum_counter)
    return TrainGraph(ir, inputs, losses, dict(weights.named_tensors),
                      {n[len("accum."):]: t for n, t in accums.named_tensors.items()
                       if n.startswith("accum.")})


def initial_weights(s, variables):
    """Seeded initial values (written into the session before the first step, so they do not
    depend on the global random state addons' factories draw from): embeddings normal with
    std 0.1, linear weights normal with std ``1/sqrt(fan_in)``, biases 0, layer-norm scales 1.

    Args:
        s: the settings. variables: ``{name: Variable}``.

    Returns:
        ``{name: float32 array}``.
    """
    rng = np.random.default_rng(s["seed"])
    out = {}
    for name, t in sorted(variables.items()):
        shape = tuple(t.shape)
        if name in ("wte", "wpe"):
            a = rng.normal(0, 0.1, shape)
        elif name.endswith(".bias"):
            a = np.zeros(shape)
        elif ".ln" in name or name.startswith("ln"):
            a = np.ones(shape)
        else:
            a = rng.normal(0, shape[0] ** -0.5, shape)
        out[name] = a.astype(np.float32)
    return out


def batches(s):
    """Host data of one step: per micro-batch one-hot ``(tokens, targets)`` ``[B, L, V]``."""
    rng = np.random.default_rng(s["seed"] + 1)
    succ = rng.permutation(s["vocab"])  # the successor table to learn
    eye = np.eye(s["vocab"], dtype=np.float32)
    out = []
    for _ in range(s["micro_batches"]):
        seq = np.empty((s["batch"], s["seq_len"] + 1), np.int64)
        seq[:, 0] = rng.integers(0, s["vocab"], s["batch"])
        for t in range(s["seq_len"]):
            seq[:, t + 1] = succ[seq[:, t]]
        out.append((eye[seq[:, :-1]], eye[seq[:, 1:]]))
    return out


def run(steps, *, store_grads=False, return_trained=False, **settings):
    """Build and train ``steps`` steps (the same micro-batches every step).

    Returns:
        ``(losses, grads, weights)``: the mean loss of each step (before its update); with
        ``store_grads``, the first step's mean gradients and the initial weights
        (``{name: array}``), else ``{}`` twice; with ``return_trained``, the weights after
        the last step instead of the initial ones.
    """
    s = dict(DEFAULTS, **settings)
    graph = build(s)
    feed = {t: a for streams, pair in zip(graph.inputs, batches(s))
            for t, a in zip(streams, pair)}
    losses, grads = [], {}
    weights = initial_weights(s, graph.weights)
    with popxl.Session(graph.ir, s["device"]) as session:
        session.write_variables_data({graph.weights[n]: a for n, a in weights.items()})
        for step in range(steps):
            out = session.run(feed)
            losses.append(float(np.mean([out[t] for t in graph.losses])))
            if step == 0 and store_grads:
                grads = {n: session.get_tensor_data(t).copy() for n, t in graph.accums.items()}
        if return_trained:
            weights = {n: session.get_tensor_data(t).copy() for n, t in graph.weights.items()}
    return losses, grads, (weights if store_grads or return_trained else {})


def cache_shapes(s, cache_len):
    """``(k, v)`` cache shapes of one layer in the layouts above."""
    B, Hkv = s["batch"], s["kv_heads"] or s["heads"]
    D = s["hidden"] // s["heads"]
    shapes = dict(BSHD=(B, cache_len, Hkv, D), BHSD=(B, Hkv, cache_len, D),
                  BHDS=(B, Hkv, D, cache_len))
    return shapes[K_CACHE_LAYOUT], shapes[V_CACHE_LAYOUT]


def _lm_session(s, weights, tokens_shape, cache_len, caches=None):
    """A session whose main graph is one :class:`CachedLM` call on ``tokens_shape``, the caches
    variables (zeros, or ``caches``), ``cache_seqlens`` from a stream.

    Returns:
        ``(session, tokens stream, lens stream, logits stream, cache variables)``.
    """
    k_shape, v_shape = cache_shapes(s, cache_len)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        cache_vars = []
        for i in range(s["layers"]):
            for name, shape in ((f"k_cache{i}", k_shape), (f"v_cache{i}", v_shape)):
                init = np.zeros(shape, np.float32) if caches is None else caches[len(cache_vars)]
                cache_vars.append(popxl.variable(init, popxl.float32, name=name))
        tokens = popxl.h2d_stream(tokens_shape, popxl.float32)
        lens = popxl.h2d_stream((s["batch"],), popxl.int32)
        facts, graph = CachedLM(s, cache_len).create_graph(
            popxl.TensorSpec(tokens_shape, popxl.float32),
            popxl.TensorSpec((s["batch"],), popxl.int32), *cache_vars)
        variables = facts.init()
        (logits,) = graph.bind(variables).call(ops.host_load(tokens), ops.host_load(lens),
                                               *cache_vars)
        out = popxl.d2h_stream(logits.shape, logits.dtype)
        ops.host_store(out, logits)
    session = popxl.Session(ir, s["device"])
    named = dict(variables.named_tensors)
    session.write_variables_data({named[n]: weights[n] for n in named})
    return session, tokens, lens, out, cache_vars


class FullLM(GPT):
    """The trained model without a cache: ``build(tokens) -> logits [B, L, vocab]`` (the
    recomputation :func:`generate` is compared with)."""

    def build(self, tokens):
        B, L, V = tokens.shape
        x = self.embed(tokens)
        for i in range(self.s["layers"]):
            (x,) = self.call_module(self.block(i), name=f"layer{i}")(x)
        return self.logits(x).reshape((B, L, V))


def full_logits(s, weights, tokens):
    """Logits ``[B, L, vocab]`` of int ``tokens [B, L]``, recomputed without a cache."""
    eye = np.eye(s["vocab"], dtype=np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        stream = popxl.h2d_stream(tokens.shape + (s["vocab"],), popxl.float32)
        facts, graph = FullLM(s).create_graph(popxl.TensorSpec(stream.shape, popxl.float32))
        variables = facts.init()
        (logits,) = graph.bind(variables).call(ops.host_load(stream))
        out = popxl.d2h_stream(logits.shape, logits.dtype)
        ops.host_store(out, logits)
    named = dict(variables.named_tensors)
    with popxl.Session(ir, s["device"]) as session:
        session.write_variables_data({named[n]: weights[n] for n in named})
        return session.run({stream: eye[tokens]})[out]


def generate(s, weights, prompts, new_tokens):
    """Greedy generation with a KV cache: one prefill of the prompts, then one decode step per
    token (the caches carried over from the prefill session into the decode session).

    Args:
        s: the settings (llama blocks). weights: the trained ``{name: array}``.
        prompts: int ``[B, P]`` tokens. new_tokens: how many to generate.

    Returns:
        ``(tokens [B, new_tokens], logits)``: the generated tokens and each step's logits
        (the prefill's last row, then every decode step's), ``[new_tokens, B, vocab]``.
    """
    B, P = prompts.shape
    V, cache_len = s["vocab"], P + new_tokens
    eye = np.eye(V, dtype=np.float32)
    session, tokens, lens, out, cache_vars = _lm_session(s, weights, (B, P, V), cache_len)
    with session:  # prefill: cache_seqlens 0, the prompt's keys and values written in place
        logits = session.run({tokens: eye[prompts], lens: np.zeros(B, np.int32)})[out][:, -1]
        caches = [session.get_tensor_data(t).copy() for t in cache_vars]
    generated, steps = [], [logits]
    session, tokens, lens, out, _ = _lm_session(s, weights, (B, 1, V), cache_len, caches)
    with session:  # decode: one token per run, written at row P + t (last_token_indices)
        for t in range(new_tokens):
            token = np.argmax(logits, axis=-1)
            generated.append(token)
            if t + 1 == new_tokens:
                break
            logits = session.run({tokens: eye[token][:, None],
                                  lens: np.full(B, P + t, np.int32)})[out][:, 0]
            steps.append(logits)
    return np.stack(generated, axis=1), np.stack(steps)


def parse_args(argv=None):
    """Parse the command line (bad values are argparse errors: exit status 2)."""
    d = DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=cli.int_at_least(2), default=d["vocab"],
                   help=f"vocabulary size (default {d['vocab']})")
    p.add_argument("--seq-len", type=cli.positive_int, default=d["seq_len"],
                   help=f"sequence length L (default {d['seq_len']})")
    p.add_argument("--hidden", type=cli.positive_int, default=d["hidden"],
                   help=f"hidden size E, a multiple of --heads (default {d['hidden']})")
    p.add_argument("--heads", type=cli.positive_int, default=d["heads"],
                   help=f"attention (query) heads (default {d['heads']})")
    p.add_argument("--kv-heads", type=cli.positive_int, default=d["kv_heads"],
                   help="key/value heads, a divisor of --heads: fewer is grouped-query "
                        "attention (default: --heads)")
    p.add_argument("--layers", type=cli.positive_int, default=d["layers"],
                   help=f"number of blocks (default {d['layers']})")
    p.add_argument("--batch", type=cli.positive_int, default=d["batch"],
                   help=f"sequences per micro-batch (default {d['batch']})")
    p.add_argument("--micro-batches", type=cli.positive_int, default=d["micro_batches"],
                   help="micro-batches whose gradients accumulate before each update "
                        f"(default {d['micro_batches']})")
    p.add_argument("--steps", type=cli.positive_int, default=d["steps"],
                   help=f"training steps (default {d['steps']})")
    p.add_argument("--lr", type=cli.positive_float, default=d["lr"],
                   help=f"SGD learning rate (default {d['lr']})")
    p.add_argument("--num-chunks", type=cli.positive_int, default=d["num_chunks"],
                   help="flash chunk count of both loops, at most --seq-len (default "
                        f"{d['num_chunks']})")
    p.add_argument("--untied-head", action="store_true",
                   help="a separate output projection instead of the embedding's transpose")
    p.add_argument("--attention", choices=["flash", "naive"], default=d["attention"],
                   help="flash attention, or naive attention differentiated by autodiff "
                        "(default flash)")
    p.add_argument("--seed", type=cli.int_at_least(0), default=d["seed"],
                   help=f"seed of the weights and data (default {d['seed']})")
    p.add_argument("--device", choices=["ipu_model", "ipu_hw", "cpu"], default=d["device"],
                   help="popxl.Session device (default ipu_model)")
    p.add_argument("--block", choices=["gpt", "llama"], default=d["block"],
                   help="GPT blocks (layer norm, biases, learned positions) or Llama-style "
                        "blocks (RMS norm, no biases, rotary, SwiGLU) (default gpt)")
    p.add_argument("--decode", type=cli.int_at_least(0), default=d["decode"],
                   help="after training, generate this many tokens with a KV cache in "
                        "Graphcore's Llama layout (needs --block llama; default 0)")
    args = p.parse_args(argv)
    if args.decode and args.block != "llama":
        p.error("--decode needs --block llama (rotary positions; the gpt blocks' learned "
                "position table is not cached)")
    if args.num_chunks > args.seq_len:
        p.error(f"--num-chunks must be at most --seq-len ({args.seq_len}), got "
                f"{args.num_chunks}")
    if args.hidden % args.heads or args.heads % (args.kv_heads or args.heads):
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}), and "
                f"--kv-heads ({args.kv_heads}) a divisor of it")
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("steps", "decode")}
    losses, _, trained = run(args.steps, return_trained=bool(args.decode), **settings)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.6f}")
    if args.decode:
        s = dict(DEFAULTS, **settings)
        prompt_len = max(1, s["seq_len"] // 2)
        tokens, _ = batches(s)[0]
        prompts = np.argmax(tokens[:, :prompt_len], axis=-1)
        generated, _ = generate(s, trained, prompts, args.decode)
        succ = successors(s)
        previous = np.concatenate([prompts[:, -1:], generated[:, :-1]], axis=1)
        follows = int((generated == succ[previous]).sum())
        for b in range(s["batch"]):
            print(f"prompt {prompts[b].tolist()} -> generated {generated[b].tolist()}")
        print(f"{follows} of {generated.size} generated tokens follow the successor table")
    return losses


def successors(s):
    """The successor table :func:`batches` draws its sequences from."""
    return np.random.default_rng(s["seed"] + 1).permutation(s["vocab"])


if __name__ == "__main__":
    main()
