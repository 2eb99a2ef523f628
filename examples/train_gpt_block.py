"""Train a stack of pre-LN GPT blocks with FlashAttention; the backward comes from autodiff.

This is the PopXL way of writing a transformer (as Graphcore's GPT examples do): build the layer
graph, let ``popxl.transforms.autodiff`` build its gradient graph, call both. Autodiff cannot
differentiate flash attention's loops, so the script calls :func:`popxl_flash.api.autodiff`, which
is ``popxl.transforms.autodiff`` with flash's hand-written backward plugged into the layer's
``ops.call`` of the flash graph (``called_graphs_grad_info``).

One block, on tokens ``x [T = B*L, E]`` (2-D, as ``ops.layer_norm`` normalises each row)::

    h  = layer_norm(x)                          # pre-LN
    q, k, v = split(h @ Wqkv)                   # [T, 3E] -> 3 x [B*H, L, Dh]
    x  = x + merge(attention(q, k, v)) @ Wo     # causal flash attention, residual
    h  = layer_norm(x)
    x  = x + gelu(h @ W1) @ W2                  # MLP (4E), residual

The loss is the mean squared error to a fixed random target; its gradient graph is also built
by autodiff. Each step runs forward, loss, the gradient graphs in reverse layer order and an SGD
update ``ops.var_updates.accumulate_(w, dw, f=-lr)`` of every weight, all in one main graph
under ``popxl.in_sequence()``.

``--attention naive`` swaps in :func:`popxl_flash.checks.naive.naive_attention` (full score matrix,
plain ops), which autodiff differentiates on its own; the tests compare the two.

Run::

    python examples/train_gpt_block.py [--steps 5] [--seq-len 32] [--layers 2] ...
"""
import argparse
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import cli
from popxl_flash import popxl
from popxl_flash.checks.naive import naive_attention

ops = popxl.ops

#: Sizes and settings used unless overridden (E = heads * head_dim, MLP width 4E).
DEFAULTS = dict(batch=2, seq_len=32, heads=2, head_dim=8, layers=2, steps=5, lr=0.1,
                dtype="float32", num_chunks=2, attention="flash", seed=0, device="ipu_model")

#: The weights of one block, in the order the block graph takes them.
WEIGHTS = ("ln1_scale", "ln1_bias", "w_qkv", "w_out", "ln2_scale", "ln2_bias", "w_mlp1",
           "w_mlp2")


def split_heads(t, batch, heads):
    """``[T, H*Dh] -> [B*H, L, Dh]``."""
    T, E = t.shape
    L, D = T // batch, E // heads
    return t.reshape((batch, L, heads, D)).transpose((0, 2, 1, 3)).reshape((batch * heads, L, D))


def merge_heads(t, batch):
    """``[B*H, L, Dh] -> [T, H*Dh]``, the inverse of :func:`split_heads`."""
    G, L, D = t.shape
    heads = G // batch
    return t.reshape((batch, heads, L, D)).transpose((0, 2, 1, 3)).reshape((batch * L, heads * D))


def attention_layer(h, w_qkv, w_out, *, batch, heads, attention, num_chunks):
    """Causal self-attention of normalised tokens ``h [T, E]``: returns ``[T, E]``."""
    E = h.shape[1]
    qkv = h @ w_qkv                                                      # [T, 3E]
    q, k, v = (split_heads(ops.slice(qkv, start=[i * E], stop=[(i + 1) * E], axis=[1]), batch,
                           heads) for i in range(3))                     # [B*H, L, Dh]
    if attention == "flash":
        out = pf.flash_attention(q, k, v, causal=True, num_chunks_q=num_chunks,
                                 num_chunks_kv=num_chunks)
    else:
        out = naive_attention(q, k, v, causal=True)
    return merge_heads(out, batch) @ w_out


def block(x, ln1_scale, ln1_bias, w_qkv, w_out, ln2_scale, ln2_bias, w_mlp1, w_mlp2, *, batch,
          heads, attention, num_chunks):
    """One pre-LN GPT block on tokens ``x [T, E]`` (traced by ``ir.create_graph``).

    Returns:
        ``[T, E]``, x's dtype.
    """
    h = ops.layer_norm(x, ln1_scale, ln1_bias)
    x = x + attention_layer(h, w_qkv, w_out, batch=batch, heads=heads, attention=attention,
                            num_chunks=num_chunks)
    h = ops.layer_norm(x, ln2_scale, ln2_bias)
    return x + ops.gelu(h @ w_mlp1) @ w_mlp2


def mse(y, target):
    """``mean((y - target)^2)`` (a scalar)."""
    d = y - target
    return ops.mean(d * d)


def initial_weights(seed, *, layers, heads, head_dim, dtype):
    """One ``{name: array}`` per layer: linear weights normal with std ``1/sqrt(fan_in)``,
    layer-norm scales 1 and biases 0."""
    rng = np.random.default_rng(seed)
    E = heads * head_dim
    shapes = dict(w_qkv=(E, 3 * E), w_out=(E, E), w_mlp1=(E, 4 * E), w_mlp2=(4 * E, E))
    out = []
    for _ in range(layers):
        w = {n: rng.normal(0.0, s[0] ** -0.5, s) for n, s in shapes.items()}
        w.update(ln1_scale=np.ones(E), ln1_bias=np.zeros(E), ln2_scale=np.ones(E),
                 ln2_bias=np.zeros(E))
        out.append({n: w[n].astype(dtype) for n in WEIGHTS})
    return out


def data(seed, *, batch, seq_len, heads, head_dim, dtype):
    """The fixed training batch: ``{"x", "target"}`` arrays ``[T, E]``."""
    rng = np.random.default_rng(seed + 1000)
    shape = (batch * seq_len, heads * head_dim)
    return {n: rng.standard_normal(shape).astype(dtype) for n in ("x", "target")}


@dataclass
class TrainGraph:
    """What :func:`build` returns.

    Attributes:
        ir: the Ir; its main graph is one training step.
        inputs: ``{"x", "target"}`` -> h2d streams ``[T, E]``.
        outputs: ``{"loss"}`` -> d2h stream, plus ``"<layer>.<weight>"`` gradients when built
            with ``store_grads``.
        variables: one ``{name: popxl.Variable}`` per layer.
    """
    ir: object
    inputs: Dict[str, object]
    outputs: Dict[str, object]
    variables: List[Dict[str, object]]


def build(weights, *, batch, seq_len, heads, head_dim, lr, dtype, num_chunks, attention,
          store_grads=False):
    """Build one SGD training step of the block stack as a PopXL main graph.

    Args:
        weights: from :func:`initial_weights` (one dict per layer).
        batch, seq_len, heads, head_dim: B, L, H, Dh.
        lr: SGD learning rate. dtype: ``"float32"`` or ``"float16"``.
        num_chunks: flash chunk count for both loops (``None``: automatic).
        attention: ``"flash"`` or ``"naive"``.
        store_grads: also stream every weight gradient (first step) to the host.

    Returns:
        :class:`TrainGraph`.
    """
    dt = getattr(popxl, dtype)
    T, E = batch * seq_len, heads * head_dim
    options = dict(batch=batch, heads=heads, attention=attention, num_chunks=num_chunks)
    ir = popxl.Ir()
    with ir.main_graph:
        variables = [{n: popxl.variable(w[n], dt, name=f"layer{i}.{n}") for n in WEIGHTS}
                     for i, w in enumerate(weights)]
        x_in, t_in = (popxl.h2d_stream((T, E), dt, name=n) for n in ("x", "target"))
        spec = popxl.TensorSpec((T, E), dt)
        block_graph = ir.create_graph(block, spec, *variables[0].values(), **options)
        block_grad = pf.autodiff(block_graph)          # flash's backward plugged in
        loss_graph = ir.create_graph(mse, spec, spec)
        loss_grad = popxl.transforms.autodiff(loss_graph, grads_required=loss_graph.inputs[:1])
        with popxl.in_sequence(True):                  # updates after every read of a weight
            h = ops.host_load(x_in)
            calls = []
            for w in variables:
                calls.append(ops.call_with_info(block_graph, h, *w.values()))
                h = calls[-1].outputs[0]
            loss_call = ops.call_with_info(loss_graph, h, ops.host_load(t_in))
            one = popxl.constant(1.0, dt)
            (dh,) = ops.call(loss_grad.graph, one, inputs_dict=loss_grad.inputs_dict(loss_call))
            outputs = {"loss": loss_call.outputs[0]}
            for i in reversed(range(len(variables))):
                dh, *dws = ops.call(block_grad.graph, dh,
                                    inputs_dict=block_grad.inputs_dict(calls[i]))
                for n, dw in zip(WEIGHTS, dws):
                    if store_grads:
                        outputs[f"{i}.{n}"] = dw
                    ops.var_updates.accumulate_(variables[i][n], dw, f=-lr)
            streams = {}
            for n, t in outputs.items():
                streams[n] = popxl.d2h_stream(t.shape, t.dtype, name=n)
                ops.host_store(streams[n], t)
    return TrainGraph(ir, {"x": x_in, "target": t_in}, streams, variables)


def run(steps, *, store_grads=False, **settings):
    """Build and run ``steps`` training steps.

    Args:
        steps: number of steps (``session.run`` calls).
        store_grads: also return the first step's weight gradients.
        **settings: overrides of :data:`DEFAULTS` (except ``steps``).

    Returns:
        ``(losses, grads)``: the loss of each step (before its update) and, with
        ``store_grads``, ``{"<layer>.<weight>": array}`` of the first step (else ``{}``).
    """
    s = dict(DEFAULTS, **settings)
    sizes = {n: s[n] for n in ("batch", "seq_len", "heads", "head_dim", "dtype")}
    weights = initial_weights(s["seed"], layers=s["layers"], heads=s["heads"],
                              head_dim=s["head_dim"], dtype=s["dtype"])
    graph = build(weights, lr=s["lr"], num_chunks=s["num_chunks"], attention=s["attention"],
                  store_grads=store_grads, **sizes)
    batch = data(s["seed"], **sizes)
    feed = {graph.inputs[n]: batch[n] for n in ("x", "target")}
    losses, grads = [], {}
    with popxl.Session(graph.ir, s["device"]) as session:
        for step in range(steps):
            out = session.run(feed)
            losses.append(float(out[graph.outputs["loss"]]))
            if step == 0 and store_grads:
                grads = {n: out[st] for n, st in graph.outputs.items() if n != "loss"}
    return losses, grads


def parse_args(argv=None):
    """Parse the command line (bad values are argparse errors: exit status 2)."""
    d = DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=cli.positive_int, default=d["seq_len"],
                   help=f"sequence length L (default {d['seq_len']})")
    p.add_argument("--heads", type=cli.positive_int, default=d["heads"],
                   help=f"attention heads H (default {d['heads']})")
    p.add_argument("--head-dim", type=cli.positive_int, default=d["head_dim"],
                   help=f"head dimension Dh; the hidden size is H*Dh (default {d['head_dim']})")
    p.add_argument("--layers", type=cli.positive_int, default=d["layers"],
                   help=f"number of blocks (default {d['layers']})")
    p.add_argument("--steps", type=cli.positive_int, default=d["steps"],
                   help=f"training steps (default {d['steps']})")
    p.add_argument("--lr", type=cli.positive_float, default=d["lr"],
                   help=f"SGD learning rate (default {d['lr']})")
    p.add_argument("--dtype", choices=["float32", "float16"], default=d["dtype"],
                   help="dtype of weights and activations (default float32)")
    p.add_argument("--batch", type=cli.positive_int, default=d["batch"],
                   help=f"sequences per batch B (default {d['batch']})")
    p.add_argument("--num-chunks", type=cli.positive_int, default=d["num_chunks"],
                   help=f"flash chunk count of both loops, at most --seq-len (default "
                        f"{d['num_chunks']})")
    p.add_argument("--attention", choices=["flash", "naive"], default=d["attention"],
                   help="flash attention, or naive attention differentiated by autodiff")
    p.add_argument("--device", choices=["ipu_model", "ipu_hw", "cpu"], default=d["device"],
                   help="popxl.Session device (default ipu_model)")
    args = p.parse_args(argv)
    if args.num_chunks > args.seq_len:
        p.error(f"--num-chunks must be at most --seq-len ({args.seq_len}), got "
                f"{args.num_chunks}")
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k != "steps"}
    losses, _ = run(args.steps, **settings)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.6f}")
    return losses


if __name__ == "__main__":
    main()
