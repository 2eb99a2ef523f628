"""Train a causal self-attention layer with FlashAttention in PopXL, backward written by hand.

The usual way to train with ``popxl_flash`` is autodiff of the layer graph with flash's
backward plugged in (:func:`popxl_flash.api.autodiff`, see ``examples/train_gpt_block.py``). This
script shows the other way, with full control over what is stashed: it composes forward and
backward itself:

1. **Forward graph** (``layer_forward``): ``x [B, L, E]`` -> q, k, v projections -> split heads
   to ``[G = B*H, L, Dh]`` -> ``pf.flash_attention(q, k, v, return_lse=True)`` -> merge heads ->
   output projection. Besides the output ``y`` it returns the *stash* the backward needs:
   ``q``, ``k``, ``v``, and the attention's ``out`` and ``lse``.
2. **Backward graph** (``layer_backward``): the gradient of the output projection and the
   head merge (transposed matmuls, the inverse reshape/transpose), then
   ``pf.flash_attention_grad(dout, q, k, v, out, lse, **same_options)`` (stash mode: only the
   block probabilities are recomputed, from ``lse``), then the gradients of the head split and
   of the q, k, v projections. It returns ``dx`` (for the layer below) and the four weight
   gradients.
3. **Main graph** (``build_layer_graph``): the weights are ``popxl.variable``s (variables exist
   only in the main graph; the layer graphs get them as inputs). It loads a batch, calls the
   forward graph, computes the mean-squared-error loss and its gradient ``dy = 2 (y - t) / N``,
   calls the backward graph with the stash, and applies SGD in place with
   ``ops.var_updates.accumulate_(w, dw, f=-lr)``. Everything runs under
   ``popxl.in_sequence(True)``, so the updates run after every read of the weights.

On SDK 3.3+ the same two functions fit popxl-addons' hand-written-backward interface
unchanged in substance: ``build`` is ``layer_forward`` with the weights created by
``add_variable_input`` and the stash stored as ``self.aux["q"]``, ..., ``self.aux["out"]``,
``self.aux["lse"]``; ``build_grad(dy)`` is ``layer_backward`` reading them back from
``self.aux``, setting ``self.var_grad[...]`` and returning ``dx`` (see the user guide, "popxl-addons
3.3+"). Without popxl-addons, as here, you call the two graphs yourself.

``--attention naive`` swaps in :func:`popxl_flash.checks.naive.naive_attention` /
:func:`popxl_flash.checks.naive.naive_attention_grad` (which materialise the ``[L, L]`` score matrix
and recompute the probabilities in the backward). The layer code is otherwise identical, which is
what the tests use to check the flash gradients.

Run::

    python examples/train_causal_self_attention.py [--steps 8] [--attention flash|naive] \
        [--batch 2] [--seq-len 22] [--heads 2] [--head-dim 8] [--num-chunks-q 3] ...  (--help)

It runs on the emulator, the IPU model or IPU hardware (``--device``); see the user guide's
"Backends".
"""
import argparse
from dataclasses import dataclass
from typing import Callable, Dict

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import cli, devices
from popxl_flash import popxl
from popxl_flash.checks.naive import naive_attention, naive_attention_grad

ops = popxl.ops

#: The layer's sizes and the SGD learning rate used unless overridden. L = 22 with 3 query and 4
#: key/value chunks gives chunks of 8 and 6 rows with padded tails (2 rows each).
DEFAULTS = dict(batch=2, seq_len=22, hidden=16, heads=2, num_chunks_q=3, num_chunks_kv=4,
                lr=0.5)

WEIGHTS = ("wq", "wk", "wv", "wo")


# --------------------------------------------------------------------------------------------
# Attention: the only part that differs between the flash and the naive layer.


@dataclass(frozen=True)
class Attention:
    """A forward/backward pair of attention functions on ``[G, L, Dh]`` tensors.

    ``forward(q, k, v) -> (out, extra)``: ``extra`` is a tuple of additional tensors to stash
    for the backward. ``backward(dout, q, k, v, out, *extra) -> (dq, dk, dv)``.
    """
    name: str
    forward: Callable
    backward: Callable


def flash(num_chunks_q=None, num_chunks_kv=None):
    """Causal FlashAttention; stash mode backward (``out`` and ``lse`` kept from the forward)."""
    # The backward must get exactly the forward's options, or its gradients are wrong.
    options = dict(causal=True, num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv)

    def forward(q, k, v):
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **options)
        return out, (lse,)

    def backward(dout, q, k, v, out, lse):
        return pf.flash_attention_grad(dout, q, k, v, out, lse, **options)

    return Attention("flash", forward, backward)


def naive():
    """Naive causal attention (``[G, L, L]`` scores); its backward recomputes the softmax."""
    def forward(q, k, v):
        return naive_attention(q, k, v, causal=True), ()

    def backward(dout, q, k, v, out):
        return naive_attention_grad(dout, q, k, v, causal=True)

    return Attention("naive", forward, backward)


# --------------------------------------------------------------------------------------------
# The layer: forward and hand-written backward as PopXL graph code.


def split_heads(t, heads):
    """``[B, L, H*Dh] -> [B*H, L, Dh]``."""
    B, L, E = t.shape
    D = E // heads
    return t.reshape((B, L, heads, D)).transpose((0, 2, 1, 3)).reshape((B * heads, L, D))


def merge_heads(t, heads):
    """``[B*H, L, Dh] -> [B, L, H*Dh]``: the inverse of :func:`split_heads`.

    Each function is also the other's gradient: reshapes and transposes only move elements.
    """
    G, L, D = t.shape
    B = G // heads
    return t.reshape((B, heads, L, D)).transpose((0, 2, 1, 3)).reshape((B, L, heads * D))


def _weight_grad(a, b):
    """``dW = sum over batch and positions of a^T b`` for ``y = a @ W``; a, b ``[B, L, *]``."""
    B, L, _ = a.shape
    a2 = a.reshape((B * L, a.shape[-1]))
    b2 = b.reshape((B * L, b.shape[-1]))
    return a2.transpose((1, 0)) @ b2


def layer_forward(x, wq, wk, wv, wo, *, heads, attention):
    """Forward of the layer: ``y = merge(attention(split(x Wq), split(x Wk), split(x Wv))) Wo``.

    Traced by ``ir.create_graph``; every tensor argument becomes a graph input.

    Returns:
        ``(y, q, k, v, out, *extra)``: the output ``[B, L, E]`` followed by the stash for
        :func:`layer_backward` (q, k, v, out ``[G, L, Dh]``; for flash ``extra = (lse,)``,
        float32 ``[G, L]``). With popxl-addons 3.3+ the stash is ``self.aux[...]``.
    """
    q, k, v = (split_heads(x @ w, heads) for w in (wq, wk, wv))
    out, extra = attention.forward(q, k, v)
    y = merge_heads(out, heads) @ wo
    return (y, q, k, v, out) + tuple(extra)


def layer_backward(dy, x, wq, wk, wv, wo, q, k, v, out, *extra, heads, attention):
    """Backward of :func:`layer_forward`, written by hand.

    Args:
        dy: gradient of the loss with respect to ``y``, ``[B, L, E]``.
        x, wq, wk, wv, wo: the forward's inputs.
        q, k, v, out, *extra: the stash returned by :func:`layer_forward`.

    Returns:
        ``(dx, dwq, dwk, dwv, dwo)``. With popxl-addons 3.3+ the weight gradients go to
        ``self.var_grad[...]`` and ``dx`` is returned.
    """
    h = merge_heads(out, heads)                        # [B, L, E], the output projection's input
    dwo = _weight_grad(h, dy)                          # y = h Wo  ->  dWo = h^T dy
    dout = split_heads(dy @ wo.transpose((1, 0)), heads)   # dh = dy Wo^T; merge^-1 = split
    dq, dk, dv = attention.backward(dout, q, k, v, out, *extra)
    dx = None
    grads = []
    for w, dt in zip((wq, wk, wv), (dq, dk, dv)):
        dp = merge_heads(dt, heads)                    # split^-1 = merge: [B, L, E]
        grads.append(_weight_grad(x, dp))              # p = x W  ->  dW = x^T dp
        dxw = dp @ w.transpose((1, 0))                 # dx = sum over projections of dp W^T
        dx = dxw if dx is None else dx + dxw
    return (dx, *grads, dwo)


# --------------------------------------------------------------------------------------------
# The training program: main graph with loss, backward and SGD.


@dataclass
class LayerGraph:
    """What :func:`build_layer_graph` returns.

    Attributes:
        ir: the Ir (main graph = one training step).
        inputs: ``{"x": h2d stream [B, L, E], "target": h2d stream [B, L, E]}``.
        outputs: ``{"loss": d2h stream ()}``, plus ``"dx"`` and one ``"d<weight>"`` per weight
            when built with ``store_grads=True``.
        variables: ``{"wq", "wk", "wv", "wo"}`` -> ``popxl.tensor.Variable`` ``[E, E]``.
    """
    ir: object
    inputs: Dict[str, object]
    outputs: Dict[str, object]
    variables: Dict[str, object]


def initial_weights(seed, hidden=DEFAULTS["hidden"]):
    """``{name: float32 [E, E]}``, normal with std ``1/sqrt(E)``."""
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0.0, hidden ** -0.5, (hidden, hidden)).astype(np.float32)
            for n in WEIGHTS}


def batch(seed, batch=DEFAULTS["batch"], seq_len=DEFAULTS["seq_len"], hidden=DEFAULTS["hidden"]):
    """The fixed training batch: ``{"x": float32 [B, L, E], "target": float32 [B, L, E]}``."""
    rng = np.random.default_rng(seed + 1000)
    shape = (batch, seq_len, hidden)
    return {"x": rng.standard_normal(shape).astype(np.float32),
            "target": rng.standard_normal(shape).astype(np.float32)}


def build_layer_graph(weights, *, attention="flash", batch=DEFAULTS["batch"],
                      seq_len=DEFAULTS["seq_len"], heads=DEFAULTS["heads"], lr=DEFAULTS["lr"],
                      num_chunks_q=DEFAULTS["num_chunks_q"],
                      num_chunks_kv=DEFAULTS["num_chunks_kv"], store_grads=False):
    """Build one SGD training step of the layer as a PopXL main graph.

    Args:
        weights: ``{"wq", "wk", "wv", "wo"}`` -> float32 ``[E, E]`` initial values.
        attention: ``"flash"`` or ``"naive"``.
        batch, seq_len, heads: ``B``, ``L``, ``H`` (``E`` comes from the weights; ``H`` must
            divide it).
        lr: SGD learning rate.
        num_chunks_q, num_chunks_kv: flash chunk counts (ignored by naive).
        store_grads: also stream ``dx`` and the weight gradients to the host.

    Returns:
        :class:`LayerGraph`.
    """
    if attention == "flash":
        att = flash(num_chunks_q, num_chunks_kv)
    elif attention == "naive":
        att = naive()
    else:
        raise ValueError(f"attention must be 'flash' or 'naive', got attention={attention!r}")
    E = weights["wq"].shape[0]
    if E % heads:
        raise ValueError(f"heads must divide the hidden size {E}, got heads={heads}")
    B, L, f32 = batch, seq_len, popxl.float32

    ir = popxl.Ir()
    with ir.main_graph:
        w = {n: popxl.variable(weights[n], f32, name=n) for n in WEIGHTS}
        x_in = popxl.h2d_stream((B, L, E), f32, name="x")
        t_in = popxl.h2d_stream((B, L, E), f32, name="target")
        x_spec = popxl.TensorSpec((B, L, E), f32)

        # The layer's two graphs. A transformer builds them once and calls them once per layer
        # (forward in order, backward in reverse order), passing each layer's weights.
        fwd_graph = ir.create_graph(layer_forward, x_spec, *(w[n] for n in WEIGHTS),
                                    heads=heads, attention=att)
        stash_specs = [t.spec for t in fwd_graph.outputs[1:]]
        bwd_graph = ir.create_graph(layer_backward, x_spec, x_spec, *(w[n] for n in WEIGHTS),
                                    *stash_specs, heads=heads, attention=att)

        with popxl.in_sequence(True):             # SGD updates after every read of the weights
            x, target = ops.host_load(x_in), ops.host_load(t_in)
            y, *stash = ops.call(fwd_graph, x, *(w[n] for n in WEIGHTS))

            # loss = mean((y - target)^2); dloss/dy = 2 (y - target) / N
            diff = y - target
            loss = ops.mean(diff * diff)
            dy = diff * (2.0 / diff.nelms)

            dx, *dws = ops.call(bwd_graph, dy, x, *(w[n] for n in WEIGHTS), *stash)
            for n, dw in zip(WEIGHTS, dws):
                ops.var_updates.accumulate_(w[n], dw, f=-lr)   # w += -lr * dw

            outputs = {"loss": loss}
            if store_grads:
                outputs.update(dx=dx, **{"d" + n: dw for n, dw in zip(WEIGHTS, dws)})
            streams = {}
            for name, t in outputs.items():
                streams[name] = popxl.d2h_stream(t.shape, t.dtype, name=name)
                ops.host_store(streams[name], t)
    return LayerGraph(ir, {"x": x_in, "target": t_in}, streams, w)


def _run(steps, *, attention, seed, device, store_grads, **sizes):
    """Build, then run ``steps`` training steps; return per-step outputs and final weights."""
    hidden = sizes.pop("hidden", DEFAULTS["hidden"])
    data = batch(seed, sizes.get("batch", DEFAULTS["batch"]),
                 sizes.get("seq_len", DEFAULTS["seq_len"]), hidden)
    layer = build_layer_graph(initial_weights(seed, hidden), attention=attention,
                              store_grads=store_grads, **sizes)
    feed = {layer.inputs[n]: data[n] for n in ("x", "target")}
    results = []
    with popxl.Session(layer.ir, devices.session_device(device)) as session:
        for _ in range(steps):
            out = session.run(feed)
            results.append({n: out[s] for n, s in layer.outputs.items()})
        weights = {n: session.get_tensor_data(v) for n, v in layer.variables.items()}
    return results, weights


def train(steps=8, *, attention="flash", seed=0, device="ipu_model", return_weights=False,
          **sizes):
    """Train the layer for ``steps`` SGD steps on one fixed batch.

    Args:
        steps: number of ``session.run`` calls (one step each).
        attention: ``"flash"`` or ``"naive"``.
        seed: seeds the initial weights, the input and the target.
        device: a device name of ``popxl_flash.checks.devices`` (``ipu_model``: the full-size model).
        return_weights: also return the weights after training.
        **sizes: overrides of :data:`DEFAULTS` (``batch``, ``seq_len``, ``hidden``, ``heads``,
            ``lr``, ``num_chunks_q``, ``num_chunks_kv``).

    Returns:
        the loss of each step (computed before that step's update), and with ``return_weights``
        also ``{name: float32 [E, E]}`` read back with ``session.get_tensor_data``.
    """
    results, weights = _run(steps, attention=attention, seed=seed, device=device,
                            store_grads=False, **sizes)
    losses = [float(r["loss"]) for r in results]
    return (losses, weights) if return_weights else losses


def gradients(*, attention="flash", seed=0, device="ipu_model", **sizes):
    """Gradients of the loss for the first training step (at the initial weights).

    Returns:
        ``{"wq", "wk", "wv", "wo": float32 [E, E], "x": float32 [B, L, E]}``.
    """
    results, _ = _run(1, attention=attention, seed=seed, device=device, store_grads=True,
                      **sizes)
    return {n: results[0]["d" + n] for n in WEIGHTS + ("x",)}


def parse_args(argv=None):
    """The command line: training options and the layer's sizes (defaults: :data:`DEFAULTS`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=cli.int_at_least(1), default=8, help="SGD steps (default: %(default)s)")
    add("--attention", choices=["flash", "naive"], default="flash",
        help="flash attention, or naive attention as the baseline (default: %(default)s)")
    add("--seed", type=cli.int_at_least(0), default=0,
        help="seed of the weights, input and target (default: %(default)s)")
    add("--lr", type=cli.positive_float, default=DEFAULTS["lr"],
        help="SGD learning rate (default: %(default)s)")
    add("--batch", type=cli.int_at_least(1), default=DEFAULTS["batch"],
        help="batch size B (default: %(default)s)")
    add("--seq-len", type=cli.int_at_least(1), default=DEFAULTS["seq_len"],
        help="sequence length L (default: %(default)s)")
    add("--heads", type=cli.int_at_least(1), default=DEFAULTS["heads"],
        help="attention heads H (default: %(default)s)")
    add("--head-dim", type=cli.int_at_least(1), default=DEFAULTS["hidden"] // DEFAULTS["heads"],
        help="head dimension Dh; the hidden size is H x Dh (default: %(default)s)")
    add("--num-chunks-q", type=cli.int_at_least(1), default=DEFAULTS["num_chunks_q"],
        help="flash query chunks, at most L (default: %(default)s)")
    add("--num-chunks-kv", type=cli.int_at_least(1), default=DEFAULTS["num_chunks_kv"],
        help="flash key/value chunks, at most L (default: %(default)s)")
    add("--device", choices=devices.NAMES, default="ipu_model",
        help="ipu_model (full-size 1472-tile model), ipu_hw or cpu (default: %(default)s)")
    args = parser.parse_args(argv)
    for flag in ("num_chunks_q", "num_chunks_kv"):
        if getattr(args, flag) > args.seq_len:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at most "
                         f"--seq-len {args.seq_len}")
    return args


def main(argv=None):
    args = parse_args(argv)
    sizes = dict(batch=args.batch, seq_len=args.seq_len, hidden=args.heads * args.head_dim,
                 heads=args.heads, num_chunks_q=args.num_chunks_q,
                 num_chunks_kv=args.num_chunks_kv, lr=args.lr)
    print(f"backend: {pf.BACKEND}; attention: {args.attention}; "
          + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    losses, weights = train(args.steps, attention=args.attention, seed=args.seed,
                            device=args.device, return_weights=True, **sizes)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.6f}")
    moved = max(float(np.abs(weights[n] - w0).max())
                for n, w0 in initial_weights(args.seed, sizes["hidden"]).items())
    print(f"max |weight change| after {args.steps} steps: {moved:.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
