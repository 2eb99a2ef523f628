"""The attention layers' graph logic (:mod:`popxl_flash.api.layers`, what the popxl-addons
adapters in ``popxl_flash.addons`` call) without popxl-addons: the projections are plain
matmuls here, the layer functions do the rest, and the results are checked against float64
host pipelines under the project's tolerance rule (``popxl_flash/checks/tolerance.py``).
``tests/addons`` tests the adapters themselves against real popxl-addons."""
import re

import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import popxl
from popxl_flash.api import layers
from popxl_flash.checks import reference, tolerance

from attention_utils import assert_within_rule, build_only, run_graph, zeros_variable

ops = popxl.ops


# -- host pipelines --------------------------------------------------------------------------
def _rotate(x, positions, rotary_dim, base, interleaved):
    """Host RoPE of ``x [B, L, h, D]`` at ``positions [B, L]`` (x's dtype, tables float64
    rounded to it)."""
    cos, sin = pf.rotary_tables(int(positions.max()) + 1, rotary_dim, base, dtype=np.float64)
    c = cos[positions][:, :, None, :].astype(x.dtype)  # [B, L, 1, R/2]
    s = sin[positions][:, :, None, :].astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(rot.shape)
    else:
        half = rotary_dim // 2
        a, b = rot[..., :half], rot[..., half:]
        out = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return np.concatenate([out, rest], axis=-1)


def _groups(t):
    """``[B, L, h, D]`` -> ``[B * h, L, D]``."""
    B, L, h, D = t.shape
    return t.transpose(0, 2, 1, 3).reshape(B * h, L, D)


def _project(x, w, heads, D):
    """``x [B, L, E] @ w [E, heads * D]`` -> ``[B, L, heads, D]`` in x's dtype."""
    B, L, E = x.shape
    return (x.reshape(B * L, E) @ w).reshape(B, L, heads, D)


def _train_host(x, w, case, slopes, dtype):
    """The training layer's attention output ``[B * L, H * D]`` on the host: float64 with the
    reference attention, float32 with the naive one."""
    B, L, _ = x.shape
    H, Hkv, D = case["heads"], case["kv_heads"], case["D"]
    x = x.astype(dtype)
    q, k, v = (_project(x, w[n].astype(dtype), h, D) for n, h in (("q", H), ("k", Hkv),
                                                                     ("v", Hkv)))
    if case["rotary_dim"]:
        pos = np.broadcast_to(np.arange(L), (B, L))
        q, k = (_rotate(t, pos, case["rotary_dim"], 10000.0, case["interleaved"])
                for t in (q, k))
    mods = {}
    if slopes is not None:
        mods["alibi_slopes"] = np.broadcast_to(slopes, (B, H)).reshape(B * H)
    if case["softcap"]:
        mods["softcap"] = case["softcap"]
    attend = reference.attention if dtype == np.float64 else tolerance.naive_attention
    out, _ = attend(_groups(q), _groups(k), _groups(v), causal=case["causal"], scale=None,
                    window=None, **mods)
    return out.reshape(B, H, L, D).transpose(0, 2, 1, 3).reshape(B * L, H * D)


def _weights(rng, E, H, Hkv, D):
    return {n: (rng.standard_normal((E, h * D)) / np.sqrt(E)).astype(np.float32)
            for n, h in (("q", H), ("k", Hkv), ("v", Hkv))}


def _project_graph(x, w, heads, D):
    B, L, E = x.shape
    return layers.split_heads(x.reshape((B * L, E)) @ w, B, L, heads, D)


# -- training --------------------------------------------------------------------------------
TRAIN_CASES = [
    dict(B=2, L=6, heads=2, kv_heads=2, D=4, rotary_dim=None, interleaved=False, causal=True,
         slopes=None, softcap=0.0),
    dict(B=2, L=5, heads=4, kv_heads=2, D=4, rotary_dim=4, interleaved=False, causal=True,
         slopes=None, softcap=0.0),
    dict(B=2, L=5, heads=4, kv_heads=1, D=6, rotary_dim=4, interleaved=True, causal=False,
         slopes=None, softcap=0.0),
    dict(B=3, L=4, heads=2, kv_heads=2, D=4, rotary_dim=2, interleaved=True, causal=True,
         slopes="heads", softcap=5.0),
    dict(B=2, L=7, heads=2, kv_heads=1, D=4, rotary_dim=None, interleaved=False, causal=True,
         slopes="batch", softcap=0.0),
    dict(B=1, L=6, heads=3, kv_heads=3, D=4, rotary_dim=4, interleaved=False, causal=False,
         slopes="heads", softcap=0.0),
]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: (
    f"B{c['B']}H{c['heads']}kv{c['kv_heads']}-rot{c['rotary_dim']}"
    f"{'i' if c['interleaved'] else 'h'}-{'causal' if c['causal'] else 'full'}-{c['slopes']}"))
def test_training_attention_matches_float64_reference(case):
    """The layer's layouts (heads batch-major into groups and back), rotary in either pairing,
    grouped-query heads and ALiBi slopes of ``[heads]`` or ``[B, heads]``: within the 2x rule
    of a float64 host pipeline of the same layer."""
    B, L, H, Hkv, D = (case[n] for n in ("B", "L", "heads", "kv_heads", "D"))
    E = H * D
    rng = np.random.default_rng(B * 100 + L)
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    w = _weights(rng, E, H, Hkv, D)
    slopes = {None: None, "heads": rng.uniform(0.1, 1.0, H),
              "batch": rng.uniform(0.1, 1.0, (B, H))}[case["slopes"]]
    cfg = layers.layer_config(E, H, Hkv, case["causal"], rotary_dim=case["rotary_dim"],
                              rotary_interleaved=case["interleaved"], softcap=case["softcap"],
                              alibi=slopes is not None)
    inputs = [x, w["q"], w["k"], w["v"]] + ([] if slopes is None else
                                            [slopes.astype(np.float32)])

    def build(xt, wq, wk, wv, *extras):
        q, k, v = (_project_graph(xt, wt, h, D) for wt, h in ((wq, H), (wk, Hkv), (wv, Hkv)))
        return [layers.self_attention(cfg, q, k, v, extras)]
    (got,), _ = run_graph(build, inputs, fp_checks=True)
    ref = _train_host(x, w, case, slopes, np.float64)
    naive = _train_host(x, w, case, None if slopes is None else slopes.astype(np.float32),
                        np.float32)
    assert got.shape == (B * L, H * D)
    assert_within_rule("out", got, naive, ref, factor=2, dtype="float32",
                       accum_steps=2 * L + D + E, magnitude=float(np.abs(ref).max()) + 1.0)


def test_training_rotary_pairing_is_used():
    """The two pairings give different layers (so a dropped rotary_interleaved shows)."""
    case = dict(TRAIN_CASES[1])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 16))
    w = _weights(rng, 16, 4, 2, 4)
    half = _train_host(x, w, dict(case, interleaved=False), None, np.float64)
    inter = _train_host(x, w, dict(case, interleaved=True), None, np.float64)
    assert np.abs(half - inter).max() > 0.05 * np.abs(half).max()


# -- KV cache --------------------------------------------------------------------------------
_CACHE_SHAPE = dict(BSHD=lambda B, S, H, D: (B, S, H, D), BHSD=lambda B, S, H, D: (B, H, S, D),
                    BHDS=lambda B, S, H, D: (B, H, D, S))
_TO_BSHD = dict(BSHD=(0, 1, 2, 3), BHSD=(0, 2, 1, 3), BHDS=(0, 3, 1, 2))


def _cached_host(x, w, caches, seqlens, case, dtype):
    """The cached layer on the host: ``(out [B * Lnew, H * D], k_cache, v_cache)``, caches in
    BSHD."""
    B, Ln, _ = x.shape
    H, Hkv, D, R = case["heads"], case["kv_heads"], case["D"], case["rotary_dim"]
    x = x.astype(dtype)
    q, k, v = (_project(x, w[n].astype(dtype), h, D) for n, h in (("q", H), ("k", Hkv),
                                                                     ("v", Hkv)))
    pos = np.asarray(seqlens)[:, None] + np.arange(Ln)[None, :]
    if R:
        q, k = (_rotate(t, pos, R, 10000.0, case["interleaved"]) for t in (q, k))
    kc, vc = (c.astype(dtype).copy() for c in caches)
    out = np.zeros((B, Ln, H, D), dtype)
    attend = reference.attention if dtype == np.float64 else tolerance.naive_attention
    for b in range(B):
        s = seqlens[b]
        kc[b, s:s + Ln], vc[b, s:s + Ln] = k[b], v[b]
        n = s + Ln
        qb = q[b].transpose(1, 0, 2)  # [H, Ln, D]
        kb, vb = (c[b, :n].transpose(1, 0, 2) for c in (kc, vc))  # [Hkv, n, D]
        o, _ = attend(qb, kb, vb, causal=True, scale=None, window=None)
        out[b] = o.transpose(1, 0, 2)
    return out.reshape(B * Ln, H * D), kc, vc


CACHE_CASES = [
    dict(heads=2, kv_heads=2, D=4, rotary_dim=4, interleaved=False, layouts=("BSHD", "BSHD"),
         new=3, seqlens=(0, 2)),
    dict(heads=4, kv_heads=2, D=4, rotary_dim=2, interleaved=True, layouts=("BHDS", "BHSD"),
         new=1, seqlens=(5, 3)),
    dict(heads=2, kv_heads=1, D=6, rotary_dim=4, interleaved=False, layouts=("BHSD", "BSHD"),
         new=1, seqlens=(7, 0)),
    dict(heads=2, kv_heads=2, D=4, rotary_dim=None, interleaved=False, layouts=("BSHD", "BHSD"),
         new=2, seqlens=(1, 4)),
]


@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: (
    f"H{c['heads']}kv{c['kv_heads']}-rot{c['rotary_dim']}{'i' if c['interleaved'] else 'h'}"
    f"-{'/'.join(c['layouts'])}-new{c['new']}"))
def test_cached_attention_matches_float64_reference(case):
    """Prefill or decode through :func:`layers.cached_self_attention`: the new rows written in
    place (rotated keys) in the layer's layouts, and the output of every new row within the
    2x rule of a float64 host pipeline (each row attends to its first cache_seqlens + Lnew
    rows, causal bottom-right, rotary at the cache positions in the layer's pairing)."""
    B, LC = 2, 8
    H, Hkv, D = case["heads"], case["kv_heads"], case["D"]
    E, Ln = H * D, case["new"]
    kl, vl = case["layouts"]
    rng = np.random.default_rng(Ln * 10 + H)
    x = rng.standard_normal((B, Ln, E)).astype(np.float32)
    w = _weights(rng, E, H, Hkv, D)
    caches = [rng.standard_normal((B, LC, Hkv, D)).astype(np.float32) for _ in range(2)]
    seqlens = np.array(case["seqlens"], np.int32)
    cfg = layers.layer_config(E, H, Hkv, True, rotary_dim=case["rotary_dim"],
                              rotary_interleaved=case["interleaved"], cache_len=LC,
                              k_cache_layout=kl, v_cache_layout=vl)
    in_layout = [np.ascontiguousarray(c.transpose(np.argsort(_TO_BSHD[lay])))
                 for c, lay in zip(caches, (kl, vl))]

    def build(xt, wq, wk, wv, lens):
        kc = popxl.variable(in_layout[0], name="k_cache")
        vc = popxl.variable(in_layout[1], name="v_cache")
        q, k, v = (_project_graph(xt, wt, h, D) for wt, h in ((wq, H), (wk, Hkv), (wv, Hkv)))
        with popxl.in_sequence():
            out = layers.cached_self_attention(cfg, q, k, v, kc, vc, lens)
            return [out, ops.identity(kc), ops.identity(vc)]
    (got, kc, vc), _ = run_graph(build, [x, w["q"], w["k"], w["v"], seqlens], fp_checks=True)
    ref, ref_k, ref_v = _cached_host(x, w, caches, seqlens, case, np.float64)
    naive, _, _ = _cached_host(x, w, caches, seqlens, case, np.float32)
    assert_within_rule("out", got, naive, ref, factor=2, dtype="float32",
                       accum_steps=2 * LC + D + E, magnitude=float(np.abs(ref).max()) + 1.0)
    for name, cache, want, lay in (("k_cache", kc, ref_k, kl), ("v_cache", vc, ref_v, vl)):
        np.testing.assert_allclose(cache.transpose(_TO_BSHD[lay]), want, rtol=0,
                                   atol=1e-5 * (np.abs(want).max() + 1), err_msg=name)


# -- the flash module's build and build_grad ---------------------------------------------------
def test_flash_forward_returns_no_stashed_tensor_and_backward_matches_reference():
    """flash_forward's output equals the stashed out but is another tensor (popxl-addons would
    label a stashed output's gradient Fwd: the aux trap); flash_backward's gradients are within
    the 3x rule of the float64 reference, and the extras' gradients are zeros."""
    G, L, D = 4, 10, 8
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((G, L, D)).astype(np.float32) for _ in range(4))
    slopes = np.array([0.5, 0.25, 0.1, 0.05], np.float32)
    options = dict(causal=True, num_chunks_q=2, num_chunks_kv=2, scale=None, window=None)
    mods = layers.check_modifiers(3.0, True, 0.0, None)
    seen = {}

    def build(qt, kt, vt, st, dt):
        out, stash = layers.flash_forward(qt, kt, vt, (st,), options, mods)
        seen["distinct"] = all(out.id != t.id for t in stash.values())
        grads = layers.flash_backward(dt, stash, options, mods)
        return [out, stash["out"], *grads]
    (out, stashed, dq, dk, dv, dslopes), _ = run_graph(build, [q, k, v, slopes, dout],
                                                       fp_checks=True)
    assert seen["distinct"]
    np.testing.assert_array_equal(out, stashed)
    assert dslopes.shape == slopes.shape and not dslopes.any()
    ref_out, _ = reference.attention(q, k, v, causal=True, alibi_slopes=slopes, softcap=3.0)
    naive_out, _ = tolerance.naive_attention(q, k, v, causal=True, scale=None, window=None,
                                             alibi_slopes=slopes, softcap=3.0)
    assert_within_rule("out", out, naive_out, ref_out, factor=2, dtype="float32",
                       accum_steps=2 * L + D, magnitude=float(np.abs(v).max()))
    refs = reference.attention_grad(dout, q, k, v, causal=True, alibi_slopes=slopes,
                                    softcap=3.0)
    naives = tolerance.naive_attention_grad(dout, q, k, v, causal=True, scale=None,
                                            window=None, alibi_slopes=slopes, softcap=3.0)
    for name, g, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, naives):
        assert_within_rule(name, g, n, r, factor=3, dtype="float32", accum_steps=4 * L + D,
                           magnitude=float(np.abs(r).max()) + 1.0)


# -- misuse, in the layer's terms ---------------------------------------------------------------
def _slopes_error(B, shape, dtype=np.float32, cached=False):
    cfg = layers.layer_config(8, 2, alibi=True, **(dict(cache_len=8) if cached else {}))

    def fn():
        q = zeros_variable((B, 3, 2, 4))
        k, v = zeros_variable((B, 3, 2, 4)), zeros_variable((B, 3, 2, 4))
        s = zeros_variable(shape, dtype)
        if cached:
            caches = [zeros_variable((B, 8, 2, 4)) for _ in range(2)]
            return layers.cached_self_attention(cfg, q, k, v, *caches, 0, (s,))
        return layers.self_attention(cfg, q, k, v, (s,))
    with pytest.raises(ValueError) as err:
        build_only(fn)
    return str(err.value)


@pytest.mark.parametrize("cached", [False, True], ids=["training", "cached"])
@pytest.mark.parametrize("B, shape, dtype", [
    (2, (4,), np.float32),      # [B * heads]: the core's layout, not the layer's
    (2, (2, 2, 1), np.float32),
    (1, (4,), np.float32),      # [2 * heads] at B=1
    (2, (2,), np.float16),      # float16 [heads]
    (2, (3, 2), np.float32),    # [B + 1, heads]
])
def test_layer_slopes_refused_in_the_layers_terms(cached, B, shape, dtype):
    msg = _slopes_error(B, shape, dtype, cached)
    want = (f"alibi_slopes must be float32 [heads=2] or [B={B}, heads=2] (one slope per head, "
            f"or per batch row and head), got shape {shape} {np.dtype(dtype).name}")
    assert msg == want
    assert "G=" not in msg


@pytest.mark.parametrize("options, exc, fragment", [
    (dict(cache_len=8, window=3), TypeError,
     "window=3 must be None or a (left, right) pair"),
    (dict(window=(-5, 0)), ValueError, "window=(-5, 0) has a side -5 < -1"),
    (dict(scale="x"), TypeError, "scale must be a real number or None, got scale='x'"),
    (dict(num_chunks_q=0), ValueError, "num_chunks_q must be >= 1, got num_chunks_q=0"),
    (dict(cache_len=8, num_splits=-1), ValueError, "num_splits must be >= 0, got num_splits=-1"),
    (dict(rotary_dim=4, rotary_base=0), ValueError, "rotary_base must be a finite number > 0"),
    (dict(softcap=-1.0), ValueError, "softcap must be in [0.0, "),
    (dict(score_mod=3), TypeError, "score_mod must be a callable"),
    (dict(cache_len=8, dropout=0.1), ValueError, "the KV-cache mode is inference only"),
    (dict(hidden_size=9), ValueError, "hidden_size=9 must be a multiple of heads=2"),
    (dict(kv_heads=3), ValueError, "kv_heads=3 must divide heads=2"),
    (dict(dropout_p=0.1), TypeError, "SelfAttention got unexpected options ['dropout_p']"),
])
def test_layer_config_refuses_at_construction(options, exc, fragment):
    args = dict(dict(hidden_size=8, heads=2), **options)
    with pytest.raises(exc) as err:
        layers.layer_config(**args)
    assert fragment in str(err.value)


@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_cache_rows_must_be_cache_len(rotary_dim):
    """Caches of another length than cache_len: a message naming cache_len and the caches,
    not the internal rotary_cos."""
    cfg = layers.layer_config(8, 2, cache_len=8, rotary_dim=rotary_dim)

    def fn():
        q, k, v = (zeros_variable((2, 1, 2, 4)) for _ in range(3))
        caches = [zeros_variable((2, 16, 2, 4)) for _ in range(2)]
        return layers.cached_self_attention(cfg, q, k, v, *caches, 0)
    with pytest.raises(ValueError, match=re.escape(
            "k_cache has 16 cache rows (k_cache_layout='BSHD', shape (2, 16, 2, 4)), but the "
            "layer has cache_len=8: make the caches cache_len rows long")) as err:
        build_only(fn)
    assert "rotary_cos" not in str(err.value)
