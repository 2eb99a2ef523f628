"""Train a small GPT written with popxl-addons, its attention popxl_flash.addons.SelfAttention.

The model is ordinary popxl-addons code (``addons.Module``, ``addons.layers.Linear`` and
``LayerNorm``, ``call_module``, ``autodiff_with_accumulation``), as Graphcore's GPT examples
are; only the attention layer comes from this library::

    x = onehot(tokens) @ wte + wpe                      # token and position embedding [B, L, E]
    for each of N blocks (call_module, one graph each):
        x = x + SelfAttention(ln1(x))                   # causal flash attention, GQA option
        x = x + fc2(gelu(fc1(ln2(x))))                  # MLP (4E)
    logits = ln_f(x) @ wte.T   (tied)  or  head(ln_f(x))   (untied, --untied-head)
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

Needs popxl-addons 3.4 and its dependencies (``POPXL_ADDONS_PATH`` naming a checkout is put on
``sys.path``). Without the Poplar SDK the emulator stands in for PopXL
(``popxl_flash.emulator.install()``). Run::

    python examples/addons_gpt.py [--steps 10] [--layers 2] [--kv-heads 1] ...
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
    emulator.install()  # `import popxl` inside popxl-addons gives the emulator
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
                attention="flash", seed=0, device="ipu_model")


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


class GPT(addons.Module):
    """Embedding, ``layers`` blocks, final layer norm, tied or untied head, cross-entropy.

    ``build(tokens, targets)``: one-hot ``[B, L, vocab]`` float32 each; returns the mean
    cross-entropy (a scalar).
    """

    def __init__(self, s):
        super().__init__()
        self.s = s
        self.ln_f = LayerNorm()
        if s["untied_head"]:
            self.head = Linear(s["vocab"], bias=False)

    def build(self, tokens, targets):
        s = self.s
        B, L, V = tokens.shape
        E = s["hidden"]
        wte = self.add_variable_input("wte", partial(np.zeros, (V, E)), popxl.float32)
        wpe = self.add_variable_input("wpe", partial(np.zeros, (L, E)), popxl.float32)
        x = (tokens.reshape((B * L, V)) @ wte).reshape((B, L, E)) + wpe
        for i in range(s["layers"]):
            block = Block(E, s["heads"], s["kv_heads"], s["attention"], s["num_chunks"])
            (x,) = self.call_module(block, name=f"layer{i}")(x)
        h = self.ln_f(x.reshape((B * L, E)))
        logits = self.head(h) if s["untied_head"] else h @ wte.transpose()  # [B*L, V]
        logp = ops.log(ops.softmax(logits, axis=-1))
        return -ops.mean(ops.sum(targets.reshape((B * L, V)) * logp, axis=-1))


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


def run(steps, *, store_grads=False, **settings):
    """Build and train ``steps`` steps (the same micro-batches every step).

    Returns:
        ``(losses, grads, weights)``: the mean loss of each step (before its update); with
        ``store_grads``, the first step's mean gradients and the initial weights
        (``{name: array}``), else ``{}`` twice.
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
    return losses, grads, (weights if store_grads else {})


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
    args = p.parse_args(argv)
    if args.num_chunks > args.seq_len:
        p.error(f"--num-chunks must be at most --seq-len ({args.seq_len}), got "
                f"{args.num_chunks}")
    if args.hidden % args.heads or args.heads % (args.kv_heads or args.heads):
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}), and "
                f"--kv-heads ({args.kv_heads}) a divisor of it")
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k != "steps"}
    losses, _, _ = run(args.steps, **settings)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.6f}")
    return losses


if __name__ == "__main__":
    main()
