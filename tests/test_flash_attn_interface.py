"""pf.flash_attn_func: flash-attn's names, defaults and [B, L, H, D] layout vs the reference."""
import itertools
import re

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import (EPS32, assert_grads_within_rule, assert_within_rule, build_only,
                             naive_attention, run_flash_attn_func, run_graph, to_groups,
                             zeros_variable)
from popxl_flash import popxl
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.checks.tolerance import gradient_accum_steps, probability_rounding_floor

ops = popxl.ops

MASKS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=False, window_size=(8, 4)),
    "causal-window": dict(causal=True, window_size=(6, -1)),
}
D = 16
CHUNKS = dict(num_chunks_q=2, num_chunks_kv=3)


def random_blhd(rng, B, Lq, Lkv, Hq, Hkv, dtype, layout="BLHD"):
    """q ``[B, Lq, Hq, D]``, k/v ``[B, Lkv, Hkv, D]`` (or BHLD) standard normal in ``dtype``."""
    def make(L, H):
        shape = (B, L, H, D) if layout == "BLHD" else (B, H, L, D)
        return rng.standard_normal(shape).astype(dtype)
    return make(Lq, Hq), make(Lkv, Hkv), make(Lkv, Hkv)


def core_options(mask):
    """flash_attn_func options -> the reference's ``causal``, ``scale``, ``window``."""
    return dict(causal=mask.get("causal", False), scale=mask.get("softmax_scale"),
                window=mask.get("window_size"))


def check_against_reference(q, k, v, mask, dtype, layout="BLHD"):
    """Run flash_attn_func and hold out and lse to the 2x rule in the [B*H, L, D] view."""
    out, lse, _ = run_flash_attn_func(q, k, v, layout=layout, **CHUNKS, **mask)
    qg, kg, vg = (to_groups(x, layout) for x in (q, k, v))
    B, Hq, Lq = q.shape[0], qg.shape[0] // q.shape[0], qg.shape[1]
    assert out.shape == q.shape and out.dtype == np.dtype(dtype)
    assert lse.shape == (B, Hq, Lq) and lse.dtype == np.float32
    opts = core_options(mask)
    ref_out, ref_lse = pf.reference.attention(qg, kg, vg, **opts)
    naive_out, _ = naive_attention(qg, kg, vg, **opts)
    cfg = AttentionConfig.from_shapes(qg.shape, kg.shape, vg.shape, (dtype,) * 3, **CHUNKS,
                                      **opts)
    steps = cfg.num_chunks_kv + cfg.chunk_kv + D
    out_g, lse_g = to_groups(out, layout), lse.reshape(B * Hq, Lq)
    assert_within_rule("out", out_g, naive_out, ref_out, factor=2, dtype=dtype,
                       accum_steps=steps, magnitude=float(np.abs(v).max()),
                       parity=probability_rounding_floor(qg, kg, vg, **opts))
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse_g), empty)
    assert (out_g[empty] == 0).all()
    _, naive32_lse = naive_attention(*(a.astype(np.float32) for a in (qg, kg, vg)), **opts)
    assert_within_rule("lse", lse_g, naive32_lse, ref_lse, factor=2, dtype="float32",
                       accum_steps=steps, magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))
    return out, lse


#: (Hq, Hkv): multi-head, grouped-query (4 q heads per kv head) and multi-query attention.
HEADS = [(4, 4), (8, 2), (8, 1)]
CASES = list(itertools.product([1, 2, 3], HEADS, list(MASKS), ["float16", "float32"]))
CASE_IDS = [f"B{b}-H{hq}x{hkv}-{m}-{d}" for b, (hq, hkv), m, d in CASES]


def _lengths(B, Hkv):
    """Lq != Lkv, both ways round across the cases."""
    return (21, 34) if (B + Hkv) % 2 else (34, 19)


@pytest.mark.parametrize("B,heads,mask,dtype", CASES, ids=CASE_IDS)
def test_matches_reference(B, heads, mask, dtype):
    """B in 1..3, (Hq, Hkv) in {(4, 4), (8, 2), (8, 1)}, Lq != Lkv (both ways), four masks, both
    dtypes: the 2x rule against the float64 reference (which repeats k/v heads itself)."""
    Hq, Hkv = heads
    rng = np.random.default_rng(100 * B + 10 * Hq + Hkv)
    q, k, v = random_blhd(rng, B, *_lengths(B, Hkv), Hq, Hkv, dtype)
    check_against_reference(q, k, v, MASKS[mask], dtype)


def _groups(t):
    """In the graph: ``[B, L, H, D] -> [B*H, L, D]`` (heads batch-major, as flash_attn_func)."""
    B, L, H, D = t.shape
    return t.transpose((0, 2, 1, 3)).reshape((B * H, L, D))


def _blhd_graph(t, B):
    """In the graph: ``[B*H, L, D] -> [B, L, H, D]``."""
    G, L, D = t.shape
    return t.reshape((B, G // B, L, D)).transpose((0, 2, 1, 3))


def _composed_grads(mask):
    """Build function: dq, dk, dv from flash_attention and flash_attention_grad (stash mode)
    composed by hand through the [B, L, H, D] layout."""
    opts = core_options(mask)

    def build(q, k, v, do):
        groups = [_groups(t) for t in (q, k, v, do)]
        out, lse = pf.flash_attention(*groups[:3], return_lse=True, **CHUNKS, **opts)
        grads = pf.flash_attention_grad(groups[3], *groups[:3], out, lse, **CHUNKS, **opts)
        return [_blhd_graph(g, q.shape[0]) for g in grads]
    return build


def _autodiff_grads(mask):
    """Build function: dq, dk, dv of a graph that calls flash_attn_func, by pf.autodiff (flash's
    backward plugged into PopXL's autodiff; the layout ops differentiated by autodiff)."""
    def build(q, k, v, do):
        ir = popxl.gcg().ir
        graph = ir.create_graph(lambda q, k, v: pf.flash_attn_func(q, k, v, **CHUNKS, **mask),
                                q, k, v)
        info = pf.autodiff(graph)
        call = ops.call_with_info(graph, q, k, v)
        return ops.call(info.graph, do, inputs_dict=info.inputs_dict(call))
    return build


def _func_grad_grads(mask, stash=True):
    """Build function: dq, dk, dv by pf.flash_attn_func_grad in flash-attn's layout (stash or
    recompute mode), with the forward's keywords."""
    def build(q, k, v, do):
        out, lse = (pf.flash_attn_func(q, k, v, return_lse=True, **CHUNKS, **mask) if stash
                    else (None, None))
        return pf.flash_attn_func_grad(do, q, k, v, out, lse, **CHUNKS, **mask)
    return build


def check_grads_against_reference(q, k, v, dout, mask, dtype, route="composed"):
    """Gradients of flash_attn_func's attention (``route``: "composed" by hand or "autodiff")
    under the 3x rule; dk/dv come back with Hkv heads, summed over the q heads sharing each."""
    opts = core_options(mask)
    build = {"composed": _composed_grads, "autodiff": _autodiff_grads,
             "func_grad": _func_grad_grads}[route](mask)
    grads, _ = run_graph(build, [q, k, v, dout])
    qg, kg, vg, dog = (to_groups(x) for x in (q, k, v, dout))
    cfg = AttentionConfig.from_shapes(qg.shape, kg.shape, vg.shape, (dtype,) * 3, **CHUNKS,
                                      **opts)
    for g, like in zip(grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
    assert_grads_within_rule([to_groups(g) for g in grads], dog, qg, kg, vg, dtype=dtype,
                             steps=gradient_accum_steps(cfg), **opts)


GRAD_CASES = list(itertools.product([1, 2, 3], HEADS, ["causal", "full", "causal-window"],
                                    ["float16", "float32"]))


@pytest.mark.parametrize("route", ["composed", "autodiff", "func_grad"])
@pytest.mark.parametrize("B,heads,mask,dtype", GRAD_CASES,
                         ids=[f"B{b}-H{hq}x{hkv}-{m}-{d}" for b, (hq, hkv), m, d in GRAD_CASES])
def test_grads_match_reference(B, heads, mask, dtype, route):
    """dq [B, Lq, Hq, D] and dk, dv [B, Lkv, Hkv, D] under the 3x rule, Lq != Lkv: composed by
    hand from flash_attention_grad, and through pf.autodiff on a graph calling flash_attn_func."""
    Hq, Hkv = heads
    rng = np.random.default_rng(1000 + 100 * B + 10 * Hq + Hkv)
    q, k, v = random_blhd(rng, B, *_lengths(B, Hkv), Hq, Hkv, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    check_grads_against_reference(q, k, v, dout, MASKS[mask], dtype, route)


@pytest.mark.parametrize("layout", ["BLHD", "BHLD"])
def test_func_grad_recompute_equals_stash_and_defaults_match_the_forward(layout):
    """flash_attn_func_grad defaults to causal=False like flash_attn_func (flash-attn's
    default), so the same keywords give the matching backward; recompute mode (no out/lse)
    gives the stash-mode gradients bit for bit; dk, dv come back with Hkv heads."""
    rng = np.random.default_rng(5)
    q, k, v = random_blhd(rng, 2, 7, 11, 4, 2, "float32", layout=layout)
    dout = rng.standard_normal(q.shape).astype(np.float32)

    def build(stash, **opts):
        def fn(q, k, v, do):
            out, lse = (pf.flash_attn_func(q, k, v, return_lse=True, layout=layout, **opts)
                        if stash else (None, None))
            return pf.flash_attn_func_grad(do, q, k, v, out, lse, layout=layout, **opts)
        return fn
    stash, _ = run_graph(build(True), [q, k, v, dout])
    recompute, _ = run_graph(build(False), [q, k, v, dout])
    explicit, _ = run_graph(build(True, causal=False), [q, k, v, dout])
    causal, _ = run_graph(build(True, causal=True), [q, k, v, dout])
    for a, b, c, d, like in zip(stash, recompute, explicit, causal, (q, k, v)):
        assert a.shape == like.shape
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        assert np.abs(a - d).max() > 1e-3  # the causal mask changes them


@pytest.mark.parametrize("fwd, grad, fragment", [
    (dict(causal=True), dict(), "flash_attn_func_grad was given .*causal, softmax_scale"),
    (dict(), dict(softmax_scale=0.25), "flash_attn_func_grad was given"),
    (dict(window_size=(2, 0)), dict(), "flash_attn_func_grad was given"),
])
def test_func_grad_refuses_stash_of_other_options(fwd, grad, fragment):
    def fn():
        q = popxl.constant(np.ones((1, 6, 2, 4), np.float32))
        out, lse = pf.flash_attn_func(q, q, q, return_lse=True, **fwd)
        return pf.flash_attn_func_grad(q, q, q, q, out, lse, **grad)
    with pytest.raises(ValueError, match=fragment):
        build_only(fn)


@pytest.mark.parametrize("override, fragment", [
    (dict(out=None), "out and lse must be given together"),
    (dict(lse="q"), "lse must be float32 \\[B, Hq, Lq\\]"),
    (dict(out="lse"), "out must have q's shape"),
    (dict(dout="lse"), "dout must have q's shape"),
])
def test_func_grad_rejects_bad_stash(override, fragment):
    def fn():
        q = popxl.constant(np.ones((1, 6, 2, 4), np.float32))
        out, lse = pf.flash_attn_func(q, q, q, return_lse=True)
        named = dict(dout=q, out=out, lse=lse, q=q)
        args = {n: (named[v] if isinstance(v, str) else v) for n, v in override.items()}
        call = {**dict(dout=q, out=out, lse=lse), **args}
        return pf.flash_attn_func_grad(call["dout"], q, q, q, call["out"], call["lse"])
    with pytest.raises(ValueError, match=fragment):
        build_only(fn)


def test_grouped_query_reads_kv_head_h_over_r():
    """flash-attn's head convention, checked directly: with Hq = 4, Hkv = 2, q heads 0, 1 read
    kv head 0 and heads 2, 3 read kv head 1, per batch entry: the result equals multi-head
    attention on k/v heads repeated that way, to float32 accumulation error (the folded matmul
    may sum in another order than the per-head one)."""
    rng = np.random.default_rng(11)
    q, k, v = random_blhd(rng, 2, 9, 13, 4, 2, "float32")
    k4, v4 = (np.repeat(x, 2, axis=2) for x in (k, v))  # [B, L, 4, D]: head h -> kv head h // 2
    out, lse, _ = run_flash_attn_func(q, k, v, causal=True, num_chunks_kv=1)
    out4, lse4, _ = run_flash_attn_func(q, k4, v4, causal=True, num_chunks_kv=1)
    # one kv chunk of 13, D = 16: 4 * (n + c + D) * eps32 * max|.| per result (attention_utils)
    tol = 2 * 4 * (1 + 13 + D) * EPS32 * max(np.abs(v).max(), np.abs(lse).max())
    np.testing.assert_allclose(out, out4, rtol=0, atol=tol)
    np.testing.assert_allclose(lse, lse4, rtol=0, atol=tol)
    # the interleaved assignment (head h -> kv head h % 2) is far from it
    k_mod, v_mod = (np.stack([x[:, :, h % 2] for h in range(4)], axis=2) for x in (k, v))
    out_mod, _, _ = run_flash_attn_func(q, k_mod, v_mod, causal=True, num_chunks_kv=1)
    assert np.abs(out_mod - out).max() > 100 * tol


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_bhld_layout(dtype):
    """layout="BHLD" (SDPA's order) meets the rule and equals BLHD bit for bit."""
    rng = np.random.default_rng(7)
    q, k, v = random_blhd(rng, 2, 19, 27, 3, 3, dtype, layout="BHLD")
    out, lse = check_against_reference(q, k, v, MASKS["causal"], dtype, layout="BHLD")
    blhd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    out_blhd, lse_blhd, _ = run_flash_attn_func(*blhd, causal=True, **CHUNKS)
    np.testing.assert_array_equal(out_blhd.transpose(0, 2, 1, 3), out)
    np.testing.assert_array_equal(lse_blhd, lse)


def test_lse_layout_and_defaults():
    """lse[b, h] is the core's lse of group b*H + h; the defaults are flash-attn's (causal=False,
    window (-1, -1), scale 1/sqrt(D)) and out alone is returned without return_lse."""
    rng = np.random.default_rng(3)
    B, L, H = 2, 12, 3
    q, k, v = random_blhd(rng, B, L, L, H, H, "float32")
    qg, kg, vg = (to_groups(x) for x in (q, k, v))

    def build(q, k, v, qg, kg, vg):
        out, lse = pf.flash_attn_func(q, k, v, return_lse=True)
        core_out, core_lse = pf.flash_attention(qg, kg, vg, causal=False, return_lse=True)
        return out, lse, core_out, core_lse, pf.flash_attn_func(q, k, v)
    (out, lse, core_out, core_lse, out_only), _ = run_graph(build, [q, k, v, qg, kg, vg])
    for b, h in itertools.product(range(B), range(H)):
        np.testing.assert_array_equal(lse[b, h], core_lse[b * H + h])
        np.testing.assert_array_equal(out[b, :, h], core_out[b * H + h])
    np.testing.assert_array_equal(out_only, out)
    ref_out, ref_lse = pf.reference.attention(qg, kg, vg, causal=False)
    np.testing.assert_allclose(to_groups(out), ref_out, atol=1e-5)
    np.testing.assert_allclose(lse.reshape(B * H, L), ref_lse, atol=1e-5)


def test_softmax_scale_and_numpy_options():
    """softmax_scale is used; NumPy scalars/arrays give the Python options' exact result."""
    rng = np.random.default_rng(5)
    q, k, v = random_blhd(rng, 1, 10, 13, 2, 2, "float32")
    py = dict(softmax_scale=0.3, causal=True, window_size=(4, 0), num_chunks_q=2)
    npy = dict(softmax_scale=np.float32(0.3), causal=np.True_, window_size=np.array([4, 0]),
               num_chunks_q=np.int64(2))
    out_py, lse_py, _ = run_flash_attn_func(q, k, v, **py)
    out_np, lse_np, _ = run_flash_attn_func(q, k, v, **npy)
    np.testing.assert_array_equal(out_np, out_py)
    np.testing.assert_array_equal(lse_np, lse_py)
    ref_out, _ = pf.reference.attention(*(to_groups(x) for x in (q, k, v)), causal=True,
                                        scale=0.3, window=(4, 0))
    np.testing.assert_allclose(to_groups(out_py), ref_out, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Errors at build time


QKV = dict(q=(2, 8, 4, 16), k=(2, 6, 4, 16), v=(2, 6, 4, 16))

BAD = [
    # (id, shapes override, options, exception, message fragment)
    ("q rank 3", dict(q=(8, 8, 16)), {}, ValueError,
     "q must have rank 4 [B, L, H, D] (layout='BLHD'), got shape (8, 8, 16); for [G, L, D] "
     "tensors use pf.flash_attention"),
    ("k batch", dict(k=(3, 6, 4, 16), v=(3, 6, 4, 16)), {}, ValueError,
     "k must have q's batch B=2 and head dim D=16"),
    ("k head dim", dict(k=(2, 6, 4, 8), v=(2, 6, 4, 8)), {}, ValueError, "head dim D=16"),
    ("v shape", dict(v=(2, 7, 4, 16)), {}, ValueError, "v must have the shape of k (2, 6, 4, 16)"),
    ("heads not multiple", dict(k=(2, 6, 3, 16), v=(2, 6, 3, 16)), {}, ValueError,
     "Hq=4 must be a multiple of k/v's Hkv=3"),
    ("Hkv > Hq", dict(k=(2, 6, 8, 16), v=(2, 6, 8, 16)), {}, ValueError,
     "Hq=4 must be a multiple of k/v's Hkv=8"),
    ("v heads differ from k", dict(k=(2, 6, 2, 16), v=(2, 6, 4, 16)), {}, ValueError,
     "v must have the shape of k (2, 6, 2, 16), got v shape (2, 6, 4, 16)"),
    ("layout", {}, dict(layout="BLDH"), ValueError, "layout must be one of ('BLHD', 'BHLD')"),
    ("scale kw", {}, dict(scale=0.5), TypeError,
     "flash_attn_func() got an unexpected keyword argument 'scale': flash_attn_func calls it "
     "softmax_scale="),
    ("window kw", {}, dict(window=(1, 1)), TypeError, "calls it window_size="),
    ("is_causal kw", {}, dict(is_causal=True), TypeError, "calls it causal="),
    ("dropout without seed", {}, dict(dropout_p=0.1), ValueError,
     "dropout_p=0.1 needs seed=, a uint32 [2] tensor"),
    ("attn probs without dropout", {}, dict(return_attn_probs=True), ValueError,
     "return_attn_probs=True needs dropout_p > 0"),
    ("dropout_p = 1", {}, dict(dropout_p=1.0), ValueError,
     "dropout_p must be in [0.0, 1.0), got dropout_p=1.0"),
    ("softcap < 0", {}, dict(softcap=-1.0), ValueError, "softcap must be in [0.0"),
    ("dropout kw", {}, dict(dropout=0.1), TypeError, "flash_attn_func calls it dropout_p="),
    ("softmax_scale str", {}, dict(softmax_scale="1"), TypeError,
     "softmax_scale must be a real number or None, got softmax_scale='1'"),
    ("softmax_scale inf", {}, dict(softmax_scale=np.inf), ValueError,
     "softmax_scale must be finite"),
    ("window_size < -1", {}, dict(window_size=(-2, 0)), ValueError,
     "window_size=(-2, 0) has a side -2 < -1"),
    ("window_size float array", {}, dict(window_size=np.array([1.5, 0.0])), TypeError,
     "window_size=[1.5, 0.0] has a non-int side 1.5"),
    ("causal int", {}, dict(causal=1), TypeError, "causal must be a bool"),
    ("causal 0-d int array", {}, dict(causal=np.array(1)), TypeError, "causal must be a bool"),
    ("return_lse str", {}, dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    ("chunks > Lq", {}, dict(num_chunks_q=9), ValueError, "num_chunks_q must be in [1, 8]"),
    ("int dtype", dict(dtype=np.int32), {}, TypeError, "expected one of ('float16', 'float32')"),
]


@pytest.mark.parametrize("desc,override,options,exc,fragment", BAD, ids=[c[0] for c in BAD])
def test_rejects(desc, override, options, exc, fragment):
    shapes = {**QKV, **{n: s for n, s in override.items() if n != "dtype"}}
    dtype = override.get("dtype", np.float32)

    def fn():
        q, k, v = (zeros_variable(shapes[n], dtype) for n in "qkv")
        pf.flash_attn_func(q, k, v, **options)
    with pytest.raises(exc, match=re.escape(fragment)):
        build_only(fn)


def test_options_are_keyword_only():
    """flash-attn's 4th positional is dropout_p: a positional option here is an error."""
    with pytest.raises(TypeError):
        build_only(lambda: pf.flash_attn_func(*(zeros_variable(QKV[n]) for n in "qkv"), 0.0))


def test_errors_create_nothing():
    """Validation happens before any graph, op or tensor is created."""
    ir = popxl.Ir()
    with ir.main_graph:
        q, k, v = zeros_variable(QKV["q"]), zeros_variable((2, 6, 2, 16)), zeros_variable((2, 6, 2, 16))
        before = len(ir.main_graph.tensors)
        for options in (dict(softmax_scale="x"), dict(causal=2), dict(num_chunks_kv=7)):
            with pytest.raises((ValueError, TypeError)):
                pf.flash_attn_func(q, k, v, **options)
        assert len(ir.main_graph.tensors) == before
        assert ir.main_graph.called_graphs == ()
