"""A Llama-style and a GPT-J-style attention layer built from popxl-addons ``Linear`` layers and
this library (``popxl_flash.addons.SelfAttention``: no biases, rotary, grouped-query heads)
against Hugging Face's ``LlamaAttention`` and ``GPTJAttention`` with a tiny random config, forward
and gradients (``addons.autodiff``) for training; and the KV-cache mode (prefill, then decode in
Graphcore's Llama cache layout ``k [B, Hkv, D, S]``, ``v [B, Hkv, S, D]``) against the same
``LlamaAttention`` run on the whole sequence.

Tolerance: the project's rule (``popxl_flash/checks/tolerance.py``) with Hugging Face as both
sides of it: the float64 module is the reference and the float32 module the naive
same-precision implementation (it materialises the score matrix); the flash layer's error must
be at most 2x (forward) / 3x (gradients) the float32 module's, plus the rounding and
accumulation floor.

Needs ``POPXL_ADDONS_PATH`` (the directory's conftest) and ``transformers`` (the ``hf`` extra);
skips with the reason otherwise.
"""
import os

import numpy as np
import pytest

if not os.environ.get("POPXL_ADDONS_PATH", "").strip():
    pytest.skip("set POPXL_ADDONS_PATH to a popxl-addons checkout", allow_module_level=True)
try:
    import torch
    from transformers.models.gptj import modeling_gptj
    from transformers.models.llama import modeling_llama
except ImportError as error:
    pytest.skip(f"transformers is not installed ({error}); pip install -e '.[hf]'",
                allow_module_level=True)

import popxl  # noqa: E402 - the emulator, installed by conftest.py
import popxl_addons as addons  # noqa: E402
from popxl import ops  # noqa: E402

import popxl_flash as pf  # noqa: E402
from attention_utils import assert_within_rule, gradient_magnitude  # noqa: E402
from popxl_flash.addons import SelfAttention  # noqa: E402

B, L, E, H, HKV = 2, 12, 32, 4, 2
D = E // H
CHUNKS = dict(num_chunks_q=3, num_chunks_kv=2)


# -- Hugging Face modules ----------------------------------------------------------------------
def causal_mask(length, dtype):
    """Hugging Face's additive 4D mask ``[1, 1, L, L]``: query ``i`` sees keys ``j <= i``."""
    visible = np.arange(length)[None, :] <= np.arange(length)[:, None]
    mask = np.where(visible, 0.0, torch.finfo(dtype).min)
    return torch.tensor(mask, dtype=dtype)[None, None]


def llama_module(seed):
    config = modeling_llama.LlamaConfig(hidden_size=E, num_attention_heads=H,
                                        num_key_value_heads=HKV, max_position_embeddings=64,
                                        attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    module = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    return module, modeling_llama.LlamaRotaryEmbedding(config)


LLAMA_NAMES = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj"))
GPTJ_NAMES = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj"))


def run_hf(module, x, dy, dtype, forward, names):
    """``forward(module, x tensor, positions) -> y`` on ``x [B, L, E]`` at positions
    ``0 .. L-1`` in ``dtype``: ``(y, {our name: grad})`` by autograd (``{}`` for ``dy=None``)."""
    m = module.to(dtype)
    m.zero_grad()
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    y = forward(m, xt, positions)
    if dy is None:
        return y.detach().numpy(), {}
    y.backward(torch.tensor(dy, dtype=dtype))
    grads = {"x": xt.grad.numpy()}
    for ours, theirs in names:
        grads[f"{ours}.weight"] = getattr(m, theirs).weight.grad.numpy().T
    return y.detach().numpy(), grads


def run_llama(module, rope, x, dy, dtype):
    """LlamaAttention, causal (explicit 4D mask, eager attention)."""
    def forward(m, xt, positions):
        cos, sin = rope.to(dtype)(xt, positions)
        return m(xt, (cos, sin), causal_mask(xt.shape[1], dtype))[0]
    return run_hf(module, x, dy, dtype, forward, LLAMA_NAMES)


def gptj_module(seed, rotary_dim):
    config = modeling_gptj.GPTJConfig(n_embd=E, n_head=H, rotary_dim=rotary_dim, n_positions=64,
                                      attn_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(seed)
    return modeling_gptj.GPTJAttention(config, layer_idx=0).eval()


def run_gptj(module, x, dy, dtype):
    """GPTJAttention, causal (explicit 4D mask)."""
    def forward(m, xt, positions):
        return m(xt, attention_mask=causal_mask(xt.shape[1], dtype), position_ids=positions)[0]
    return run_hf(module, x, dy, dtype, forward, GPTJ_NAMES)


def hf_weights(module, names):
    """``{our name: [in, out] float32}`` from a Hugging Face module's ``[out, in]`` weights."""
    return {f"{ours}.weight": getattr(module, theirs).weight.detach().double().numpy().T
            .astype(np.float32) for ours, theirs in names}


# -- the flash layer ---------------------------------------------------------------------------
def run_layer(layer, x, dy, weights):
    """Forward and ``addons.autodiff`` gradients of ``layer`` on ``x`` with ``weights``."""
    ir = popxl.Ir()
    with ir.main_graph:
        xt = popxl.variable(x, popxl.float32, name="x")
        facts, graph = layer.create_graph(xt.spec)
        dgraph = addons.autodiff(graph)
        variables = facts.init()
        fwd = graph.bind(variables).call_with_info(xt)
        grads = dgraph.call(popxl.variable(dy, popxl.float32, name="dy"),
                            args=dgraph.grad_graph_info.inputs_dict(fwd))
        names = {t: n for n, t in graph.args.named_tensors.items()}
        names[graph.graph.inputs[0]] = "x"
        fwd_ts = [ec.fwd_tensor for ec in dgraph.grad_graph_info.expected_outputs]
        streams = {"y": addons.host_store(fwd.outputs[0])}
        streams.update({names[t]: addons.host_store(g) for t, g in zip(fwd_ts, grads)})
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variables_data({variables.to_dict()[n]: w for n, w in weights.items()})
        out = session.run()
    return {n: out[s] for n, s in streams.items()}


def check_against(got, ref_y, refs, naive_y, naives):
    steps = L + D + E + B * L  # keys, head dim, projections, batch-summed weight gradients
    assert_within_rule("y", got["y"], naive_y, ref_y, factor=2, dtype="float32",
                       accum_steps=steps, magnitude=float(np.abs(ref_y).max()))
    assert sorted(n for n in got if n != "y") == sorted(refs)
    for name, ref in refs.items():
        assert got[name].shape == ref.shape, name
        assert_within_rule(name, got[name], naives[name], ref, factor=3, dtype="float32",
                           accum_steps=steps, magnitude=gradient_magnitude(refs, name))


def test_llama_layer_matches_hugging_face_llama_attention():
    """No biases, half-split rotary on every head dim, 4 q heads over 2 kv heads (Llama's
    repeat_kv order), causal: forward and every gradient within the rule."""
    module, rope = llama_module(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    dy = rng.standard_normal((B, L, E)).astype(np.float32)
    weights = hf_weights(module, LLAMA_NAMES)
    layer = SelfAttention(E, H, HKV, causal=True, bias=False, rotary_dim=D,
                          rotary_interleaved=False, **CHUNKS)
    got = run_layer(layer, x, dy, weights)
    ref_y, refs = run_llama(module, rope, x, dy, torch.float64)
    naive_y, naives = run_llama(module, rope, x, dy, torch.float32)
    check_against(got, ref_y, refs, naive_y, naives)


@pytest.mark.parametrize("rotary_dim", [4, D], ids=["partial-rotary", "full-rotary"])
def test_gptj_layer_matches_hugging_face_gptj_attention(rotary_dim):
    """GPT-J: no biases, interleaved rotary on the first rotary_dim dims of each head (the rest
    pass through), multi-head, causal: forward and every gradient within the rule."""
    module = gptj_module(1, rotary_dim)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    dy = rng.standard_normal((B, L, E)).astype(np.float32)
    weights = hf_weights(module, GPTJ_NAMES)
    layer = SelfAttention(E, H, causal=True, bias=False, rotary_dim=rotary_dim,
                          rotary_interleaved=True, **CHUNKS)
    got = run_layer(layer, x, dy, weights)
    ref_y, refs = run_gptj(module, x, dy, torch.float64)
    naive_y, naives = run_gptj(module, x, dy, torch.float32)
    check_against(got, ref_y, refs, naive_y, naives)


# -- KV-cache mode -----------------------------------------------------------------------------
def run_cached(weights, steps, lc, k_layout, v_layout):
    """Prefill then decode with one SelfAttention(cache_len=lc) graph per shape, the caches
    variables in their layouts, taken by reference. ``steps``: ``[(x [B, Lnew, E],
    cache_seqlens [B])]``. Returns the outputs and the caches after the last step."""
    shapes = dict(BSHD=(B, lc, HKV, D), BHSD=(B, HKV, lc, D), BHDS=(B, HKV, D, lc))
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        k_cache = popxl.variable(np.zeros(shapes[k_layout], np.float32), name="k_cache")
        v_cache = popxl.variable(np.zeros(shapes[v_layout], np.float32), name="v_cache")
        streams, bound = [], []
        for x, lens in steps:
            layer = SelfAttention(E, H, HKV, causal=True, bias=False, rotary_dim=D,
                                  cache_len=lc, k_cache_layout=k_layout,
                                  v_cache_layout=v_layout)
            xt = popxl.constant(x, popxl.float32)
            lt = popxl.constant(lens, popxl.int32)
            facts, graph = layer.create_graph(xt.spec, k_cache, v_cache, lt.spec)
            variables = facts.init()
            bound.append(variables)
            (y,) = graph.bind(variables).call(xt, k_cache, v_cache, lt)
            streams.append(addons.host_store(y))
        kc_out, vc_out = addons.host_store(ops.identity(k_cache)), \
            addons.host_store(ops.identity(v_cache))
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variables_data({v.to_dict()[n]: w for v in bound for n, w in weights.items()})
        out = session.run()
    return [out[s] for s in streams], out[kc_out], out[vc_out]


@pytest.mark.parametrize("k_layout,v_layout", [("BHDS", "BHSD"), ("BSHD", "BSHD")],
                         ids=["graphcore-llama", "flash-attn"])
def test_kv_cache_prefill_and_decode_match_hugging_face_llama(k_layout, v_layout):
    """Prefill 7 tokens (cache_seqlens 0), then decode 2 tokens one at a time (cache_seqlens 7,
    8: Graphcore's last_token_indices, the index the new token is written at): every output
    row equals LlamaAttention's on the whole 9-token sequence within the rule; the k cache
    holds the rotated keys (in the BHDS layout), the v cache the values."""
    module, rope = llama_module(2)
    rng = np.random.default_rng(2)
    total, prompt, lc = 9, 7, 16
    x = rng.standard_normal((B, total, E)).astype(np.float32)
    weights = hf_weights(module, LLAMA_NAMES)
    steps = [(x[:, :prompt], np.zeros(B, np.int32))]
    steps += [(x[:, t:t + 1], np.full(B, t, np.int32)) for t in range(prompt, total)]
    outs, kc, vc = run_cached(weights, steps, lc, k_layout, v_layout)
    got = np.concatenate(outs, axis=1)  # [B, total, E]
    ref_y, _ = run_llama(module, rope, x, None, torch.float64)
    naive_y, _ = run_llama(module, rope, x, None, torch.float32)
    assert_within_rule("y", got, naive_y, ref_y, factor=2, dtype="float32",
                       accum_steps=total + D + E, magnitude=float(np.abs(ref_y).max()))
    # the caches: v = x @ Wv per kv head; k = rope(x @ Wk) at positions 0 .. total-1
    perm = dict(BSHD=(0, 1, 2, 3), BHSD=(0, 2, 1, 3), BHDS=(0, 3, 1, 2))  # layout -> BSHD
    kc, vc = kc.transpose(perm[k_layout]), vc.transpose(perm[v_layout])
    v_want = (x.astype(np.float64) @ weights["v.weight"]).reshape(B, total, HKV, D)
    np.testing.assert_allclose(vc[:, :total], v_want, rtol=1e-4, atol=1e-4)
    assert (vc[:, total:] == 0).all() and (kc[:, total:] == 0).all()
    k_lin = torch.tensor((x.astype(np.float64) @ weights["k.weight"]).reshape(B, total, HKV, D))
    cos, sin = rope.to(torch.float64)(k_lin, torch.arange(total)[None])
    k_want, _ = modeling_llama.apply_rotary_pos_emb(k_lin.transpose(1, 2), k_lin.transpose(1, 2),
                                                    cos, sin)
    np.testing.assert_allclose(kc[:, :total], k_want.transpose(1, 2).numpy(), rtol=1e-4,
                               atol=1e-4)


def test_self_attention_modifiers_and_dropout_seed_per_layer():
    """SelfAttention with softcap, ALiBi slopes (a build input) and dropout (a seed input):
    two calls with seeds from split_random_seed give different outputs, one seed twice the
    same; without dropout the layer is the float64 reference with the same modifiers."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    np.random.seed(3)  # addons' Linear draws its initial weights there
    ir = popxl.Ir()
    with ir.main_graph:
        xt = popxl.variable(x, name="x")
        st = popxl.variable(slopes, name="slopes")
        seed = popxl.variable(np.array([5, 6], np.uint32), popxl.uint32, name="seed")
        s0, s1 = ops.split_random_seed(seed, 2)
        drop = SelfAttention(E, H, HKV, softcap=5.0, alibi=True, dropout=0.3, **CHUNKS)
        facts, graph = drop.create_graph(xt.spec, st.spec, seed.spec)
        variables = facts.init()
        ys = [graph.bind(variables).call(xt, st, s)[0] for s in (s0, s1, s0)]
        plain = SelfAttention(E, H, HKV, softcap=5.0, alibi=True, **CHUNKS)
        pfacts, pgraph = plain.create_graph(xt.spec, st.spec)
        pvars = pfacts.init()
        (yp,) = pgraph.bind(pvars).call(xt, st)
        streams = [addons.host_store(y) for y in ys + [yp]]
    with popxl.Session(ir, "ipu_model") as session:
        w = {n: session.get_tensor_data(t).copy() for n, t in variables.to_dict().items()}
        session.write_variables_data({pvars.to_dict()[n]: a for n, a in w.items()})
        out = session.run()
    y0, y1, y0_again, yp = (out[s] for s in streams)
    np.testing.assert_array_equal(y0, y0_again)
    assert np.abs(y0 - y1).max() > 1e-3
    # the reference: the same projections and modifiers in float64
    x64 = x.astype(np.float64)

    def heads(t, h):
        return t.reshape(B, L, h, D).transpose(0, 2, 1, 3).reshape(B * h, L, D)
    q, k, v = (heads(x64 @ w[f"{n}.weight"] + w[f"{n}.bias"], h)
               for n, h in (("q", H), ("k", HKV), ("v", HKV)))
    ref, _ = pf.reference.attention(q, k, v, causal=True, softcap=5.0,
                                    alibi_slopes=np.tile(slopes, B))
    ref = ref.reshape(B, H, L, D).transpose(0, 2, 1, 3).reshape(B, L, E)
    ref = ref @ w["o.weight"] + w["o.bias"]
    np.testing.assert_allclose(yp, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("args, exc, fragment", [
    (dict(rotary_dim=3), ValueError, "rotary_dim must be even, got rotary_dim=3"),
    (dict(rotary_dim=16), ValueError, "rotary_dim must be in [2, 8]"),
    (dict(bias="no"), TypeError, "bias must be a bool"),
    (dict(alibi=1), TypeError, "alibi must be a bool"),
    (dict(cache_len=16, dropout=0.1), ValueError, "the KV-cache mode is inference only"),
    (dict(cache_len=16, k_cache_layout="SBHD"), ValueError, "k_cache_layout must be one of"),
    (dict(cache_len=16, num_chunks_q=2), TypeError, "unexpected options ['num_chunks_q']"),
])
def test_self_attention_rejects_bad_options(args, exc, fragment):
    import re
    with pytest.raises(exc, match=re.escape(fragment)):
        SelfAttention(E, H, HKV, **args)
