"""Greedy generation with a key/value cache: prefill a prompt batch, then decode in one loop.

A tiny decoder (token and learned position embeddings, pre-LN blocks with grouped-query
attention, a vocabulary head) with random weights. One main
graph does the whole generation, the way Graphcore's PopXL inference examples keep a
static-size cache on the device:

    prefill   x = emb[prompts] + pos[0:Lp]       [B, Lp] right-padded prompts of lengths p_b
              per layer: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=0,
                                                 causal=True)     # writes rows 0..Lp-1
              token_0 = argmax(head(x at row p_b - 1))
    decode    ops.repeat(step, N - 1): x = emb[token] + pos[p_b + t] -> cache row p_b + t
              (per-row cache_seqlens: a run-time [B] tensor carried by the loop), attend,
              next token (greedy)

The caches (one k and one v per layer, ``[B, Lcache, Hkv, Dh]``, ``Lcache = Lp + N``) are
variables; the decode step takes them by reference (``*caches: popxl.TensorByRef``), so every
iteration writes its row into them in place. A prompt's padding rows are written by the
prefill but never seen: row ``b`` attends to its first ``p_b + t + 1`` rows, and decode step
``t`` overwrites row ``p_b + t`` before attending.

``--no-cache`` generates the same tokens by recomputing the whole sequence for every token
(``pf.flash_attn_func``, causal, one session run per token); the tests compare the two.

Run::

    python examples/generate.py [--prompt-lens 5,2,7] [--new-tokens 6] [--layers 2] ...
"""
import argparse
from dataclasses import dataclass

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import cli
from popxl_flash import popxl

ops = popxl.ops

#: Sizes and settings used unless overridden.
DEFAULTS = dict(prompt_lens=(5, 2, 7), new_tokens=6, vocab=32, heads=4, kv_heads=2, head_dim=8,
                layers=2, dtype="float32", num_splits=None, seed=0, device="ipu_model")

#: The weights of one layer (E = heads * head_dim, Ekv = kv_heads * head_dim, MLP 4E).
LAYER_WEIGHTS = ("w_q", "w_k", "w_v", "w_o", "w_mlp1", "w_mlp2")


@dataclass(frozen=True)
class Sizes:
    """Model sizes: vocabulary, heads, kv heads, head dim, layers."""
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @property
    def embed(self):
        """E = heads x head_dim."""
        return self.heads * self.head_dim


def init_weights(sizes, seed, max_len, dtype="float32"):
    """Random weights: ``{"emb": [V, E], "pos": [max_len, E], "head": [E, V],
    "layers": [{name: array}]}``."""
    rng = np.random.default_rng(seed)
    E, Ekv, V = sizes.embed, sizes.kv_heads * sizes.head_dim, sizes.vocab
    shapes = dict(w_q=(E, E), w_k=(E, Ekv), w_v=(E, Ekv), w_o=(E, E), w_mlp1=(E, 4 * E),
                  w_mlp2=(4 * E, E))

    def normal(shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)
    return dict(emb=rng.standard_normal((V, E)).astype(dtype),
                pos=rng.standard_normal((max_len, E)).astype(dtype), head=normal((E, V)),
                layers=[{n: normal(shapes[n]) for n in LAYER_WEIGHTS}
                        for _ in range(sizes.layers)])


def _norm(x):
    """Layer norm without scale and bias of tokens ``x [T, E]``."""
    E = x.shape[1]
    one = popxl.constant(np.ones(E, np.float32), dtype=x.dtype)
    zero = popxl.constant(np.zeros(E, np.float32), dtype=x.dtype)
    return ops.layer_norm(x, one, zero)


def block(x, w, sizes, attend):
    """One pre-LN block on ``x [B, L, E]``; ``attend(q, k, v)`` on ``[B, L, H(kv), Dh]``."""
    B, L, E = x.shape
    h = _norm(x.reshape((B * L, E)))
    q = (h @ w["w_q"]).reshape((B, L, sizes.heads, sizes.head_dim))
    k = (h @ w["w_k"]).reshape((B, L, sizes.kv_heads, sizes.head_dim))
    v = (h @ w["w_v"]).reshape((B, L, sizes.kv_heads, sizes.head_dim))
    o = attend(q, k, v).reshape((B * L, E)) @ w["w_o"]
    x = x.reshape((B * L, E)) + o
    x = x + ops.gelu(_norm(x) @ w["w_mlp1"]) @ w["w_mlp2"]
    return x.reshape((B, L, E))


def greedy(x_last, head):
    """The first index of the largest logit of ``head(x_last [B, E])``: int32 ``[B]`` (argmax
    from max, equal and min, so ties go to the lowest token id)."""
    logits = ops.cast(_norm(x_last) @ head, popxl.float32)  # [B, V]
    V = logits.shape[1]
    best = ops.max(logits, axis=1, keepdims=True)
    ids = popxl.constant(np.arange(V, dtype=np.int32).reshape(1, V))
    return ops.min(ops.where(ops.equal(logits, best), ids, popxl.constant(np.int32(V))),
                   axis=1)


def last_rows(x, positions):
    """``x [B, L, E]`` at row ``positions[b]`` of each batch row: ``[B, E]``."""
    B, L, E = x.shape
    flat = popxl.constant(np.arange(B, dtype=np.int32) * L) + positions
    return ops.gather(x.reshape((B * L, E)), flat)


def decode_step(t, token, lens, out: popxl.TensorByRef, weights, *caches: popxl.TensorByRef,
                sizes, num_splits):
    """One greedy step: carried ``t [1]``, ``token [B]``, ``lens [B]`` (rows in the caches);
    writes the next token into ``out [B, N]`` at column ``t + 1``.

    Args:
        weights: ``[emb, pos, head, *per-layer weights]`` (by value); caches: ``k_0, v_0,
            k_1, ...`` by reference.
    """
    emb, pos, head, *flat = weights
    layers = [dict(zip(LAYER_WEIGHTS, flat[i:i + len(LAYER_WEIGHTS)]))
              for i in range(0, len(flat), len(LAYER_WEIGHTS))]
    B = token.shape[0]
    x = (ops.gather(emb, token) + ops.gather(pos, lens)).reshape((B, 1, sizes.embed))
    for i, w in enumerate(layers):
        kc, vc = caches[2 * i], caches[2 * i + 1]
        x = block(x, w, sizes, lambda q, k, v, kc=kc, vc=vc: pf.flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=lens, causal=True, num_splits=num_splits))
    nxt = greedy(x.reshape((B, sizes.embed)), head)
    ops.dynamic_update_(out, t + popxl.constant(np.array([1], np.int32)), nxt.reshape((B, 1)),
                        axes=[1], sizes=[1], no_overlap=True)
    return t + popxl.constant(np.array([1], np.int32)), nxt, lens + popxl.constant(np.int32(1))


@dataclass
class GenerateGraph:
    """The generation graph: its Ir, input streams (prompts, lengths) and output stream."""
    ir: object
    prompts: object
    lengths: object
    tokens: object


def build_generate(weights, sizes, batch, prompt_len, new_tokens, *, num_splits=None):
    """Prefill + ``ops.repeat`` decode in one main graph (see the module docstring)."""
    ir = popxl.Ir()
    Lc, Dh, Hkv = prompt_len + new_tokens, sizes.head_dim, sizes.kv_heads
    with ir.main_graph, popxl.in_sequence():
        emb, pos, head = (popxl.variable(weights[n], name=n) for n in ("emb", "pos", "head"))
        layers = [{n: popxl.variable(w[n], name=f"layer{i}.{n}") for n in LAYER_WEIGHTS}
                  for i, w in enumerate(weights["layers"])]
        caches = [popxl.variable(np.zeros((batch, Lc, Hkv, Dh), weights["emb"].dtype),
                                 name=f"layer{i // 2}.{'kv'[i % 2]}_cache")
                  for i in range(2 * sizes.layers)]
        prompts_in = popxl.h2d_stream((batch, prompt_len), popxl.int32, name="prompts")
        lens_in = popxl.h2d_stream((batch,), popxl.int32, name="prompt_lens")
        tokens_out = popxl.d2h_stream((batch, new_tokens), popxl.int32, name="tokens")
        prompts, lens = ops.host_load(prompts_in), ops.host_load(lens_in)
        x = ops.gather(emb, prompts) + ops.slice(pos, start=[0], stop=[prompt_len], axis=[0])
        for i, w in enumerate(layers):
            kc, vc = caches[2 * i], caches[2 * i + 1]
            x = block(x, w, sizes, lambda q, k, v, kc=kc, vc=vc: pf.flash_attn_with_kvcache(
                q, kc, vc, k, v, cache_seqlens=0, causal=True))
        first = greedy(last_rows(x, lens - popxl.constant(np.int32(1))), head)  # [B]
        out = ops.init((batch, new_tokens), popxl.int32, init_type="zero")
        out = ops.dynamic_update_(out, popxl.constant(np.array([0], np.int32)),
                                  first.reshape((batch, 1)), axes=[1], sizes=[1],
                                  no_overlap=True)
        if new_tokens > 1:
            flat = [emb, pos, head] + [w[n] for w in layers for n in LAYER_WEIGHTS]
            step = ir.create_graph(decode_step, popxl.TensorSpec((1,), popxl.int32),
                                   first.spec, lens.spec, out.spec, [t.spec for t in flat],
                                   *[c.spec for c in caches], sizes=sizes,
                                   num_splits=num_splits)
            ops.repeat(step, new_tokens - 1, popxl.constant(np.array([0], np.int32)), first,
                       lens, out, flat, *caches)
        ops.host_store(tokens_out, out)
    return GenerateGraph(ir, prompts_in, lens_in, tokens_out)


def build_recompute(weights, sizes, batch, total_len):
    """The no-cache model: the whole (right-padded) sequence ``[B, total_len]`` each run,
    causal ``pf.flash_attn_func``, the greedy token after row ``positions[b]``."""
    ir = popxl.Ir()
    with ir.main_graph:
        emb, pos, head = (popxl.variable(weights[n]) for n in ("emb", "pos", "head"))
        layers = [{n: popxl.variable(w[n]) for n in LAYER_WEIGHTS} for w in weights["layers"]]
        seq_in = popxl.h2d_stream((batch, total_len), popxl.int32, name="tokens")
        pos_in = popxl.h2d_stream((batch,), popxl.int32, name="positions")
        next_out = popxl.d2h_stream((batch,), popxl.int32, name="next")
        x = ops.gather(emb, ops.host_load(seq_in)) + ops.slice(pos, start=[0], stop=[total_len],
                                                              axis=[0])
        for w in layers:
            x = block(x, w, sizes, lambda q, k, v: pf.flash_attn_func(q, k, v, causal=True))
        ops.host_store(next_out, greedy(last_rows(x, ops.host_load(pos_in)), head))
    return ir, seq_in, pos_in, next_out


def random_prompts(prompt_lens, vocab, seed):
    """Right-padded prompts ``[B, max(prompt_lens)]`` (padding token 0) and their lengths."""
    rng = np.random.default_rng(seed + 1)
    Lp = max(prompt_lens)
    prompts = np.zeros((len(prompt_lens), Lp), np.int32)
    for b, n in enumerate(prompt_lens):
        prompts[b, :n] = rng.integers(0, vocab, n)
    return prompts, np.asarray(prompt_lens, np.int32)


def generate(weights, sizes, prompts, lens, new_tokens, *, device="ipu_model", num_splits=None):
    """Greedy tokens ``[B, new_tokens]`` with the cache (one session run)."""
    graph = build_generate(weights, sizes, prompts.shape[0], prompts.shape[1], new_tokens,
                           num_splits=num_splits)
    with popxl.Session(graph.ir, device) as session:
        out = session.run({graph.prompts: prompts, graph.lengths: lens})
    return out[graph.tokens]


def generate_without_cache(weights, sizes, prompts, lens, new_tokens, *, device="ipu_model"):
    """The same tokens by full recomputation: one session run per token."""
    B, Lp = prompts.shape
    ir, seq_in, pos_in, next_out = build_recompute(weights, sizes, B, Lp + new_tokens)
    seq = np.zeros((B, Lp + new_tokens), np.int32)
    seq[:, :Lp] = prompts
    tokens = np.zeros((B, new_tokens), np.int32)
    with popxl.Session(ir, device) as session:
        for t in range(new_tokens):
            nxt = session.run({seq_in: seq, pos_in: lens + t - 1})[next_out]
            tokens[:, t] = nxt
            seq[np.arange(B), lens + t] = nxt
    return tokens


def _lengths(text):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") \
            from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected prompt lengths >= 1, got {text!r}")
    return values


def parse_args(argv=None):
    """Parse the command line (bad values are argparse errors: exit status 2)."""
    d = DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-lens", type=_lengths, default=d["prompt_lens"],
                   help="comma-separated prompt lengths, one per batch row (default 5,2,7)")
    p.add_argument("--new-tokens", type=cli.positive_int, default=d["new_tokens"],
                   help="tokens to generate per row (default 6)")
    p.add_argument("--vocab", type=cli.positive_int, default=d["vocab"],
                   help="vocabulary size (default 32)")
    p.add_argument("--heads", type=cli.positive_int, default=d["heads"],
                   help="query heads (default 4)")
    p.add_argument("--kv-heads", type=cli.positive_int, default=d["kv_heads"],
                   help="key/value heads, a divisor of --heads (default 2: grouped-query)")
    p.add_argument("--head-dim", type=cli.positive_int, default=d["head_dim"],
                   help="head dimension (default 8)")
    p.add_argument("--layers", type=cli.positive_int, default=d["layers"],
                   help="decoder blocks (default 2)")
    p.add_argument("--dtype", choices=["float32", "float16"], default=d["dtype"],
                   help="weights, activations and caches (default float32)")
    p.add_argument("--num-splits", type=cli.positive_int, default=d["num_splits"],
                   help="split-KV parts of the decode attention (default: automatic)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence for every token instead (no cache)")
    p.add_argument("--seed", type=cli.int_at_least(0), default=d["seed"],
                   help="weights and prompts seed (default 0)")
    p.add_argument("--device", choices=["ipu_model", "ipu_hw", "cpu"], default=d["device"],
                   help="popxl.Session device (default ipu_model)")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    sizes = Sizes(args.vocab, args.heads, args.kv_heads, args.head_dim, args.layers)
    weights = init_weights(sizes, args.seed, max(args.prompt_lens) + args.new_tokens,
                           args.dtype)
    prompts, lens = random_prompts(args.prompt_lens, args.vocab, args.seed)
    if args.no_cache:
        tokens = generate_without_cache(weights, sizes, prompts, lens, args.new_tokens,
                                        device=args.device)
    else:
        tokens = generate(weights, sizes, prompts, lens, args.new_tokens, device=args.device,
                          num_splits=args.num_splits)
    for b, n in enumerate(lens):
        print(f"row {b}: prompt {prompts[b, :n].tolist()} -> {tokens[b].tolist()}")
    return tokens


if __name__ == "__main__":
    main()
