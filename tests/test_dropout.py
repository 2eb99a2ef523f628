"""Attention dropout: a keep mask that is a function of (seed, g, row, column).

Checked: the keep fraction is within binomial bounds; out and gradients equal the float64
reference computed with the returned mask (so the backward computes the forward's mask);
stash and recompute are bit-identical; the same seed gives bit-identical results, another seed
another mask; flash_attn_func's return_attn_probs. Forward and backward under other chunks:
``tests/test_dropout_chunks.py``.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash import popxl

from attention_utils import build_only, random_qkv, run_graph, zeros_variable
from score_mod_utils import alibi_slopes, check_rule, run_modified

SEED = np.array([1234, 5678], np.uint32)


def _case(seed=0, G=4, Gk=2, Lq=21, Lkv=30, D=8, dtype="float32"):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, G, Lq, Lkv, D, dtype, Gk)
    return q, k, v, rng.standard_normal(q.shape).astype(dtype)


def _run(q, k, v, dout, p, options, seed=SEED, stash=True, extra=None):
    extras = [seed] + ([extra[0]] if extra else [])

    def make(s, *xs):
        mods = dict(dropout=p, seed=s)
        if extra:
            mods.update(extra[1](*xs))
        return mods
    return run_modified(q, k, v, dout, extras, make, options, stash=stash, mask=True)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_keep_fraction_within_binomial_bounds(p):
    q, k, v, dout = _case(G=2, Gk=2, Lq=64, Lkv=96)
    *_, keep = _run(q, k, v, dout, p, dict(num_chunks_q=4, num_chunks_kv=3, causal=False))
    assert keep.dtype == np.bool_ and keep.shape == (2, 64, 96)
    n = keep.size  # six standard deviations of the binomial keep count
    assert abs(keep.mean() - (1 - p)) < 6 * np.sqrt(p * (1 - p) / n)
    blocks = keep.reshape(2, 4, 16, 3, 32)  # distinct blocks draw distinct masks
    assert not np.array_equal(blocks[:, 0, :, 0], blocks[:, 1, :, 1])


MASKS = [dict(causal=True, window=None), dict(causal=False, window=None),
         dict(causal=False, window=(5, 3))]


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "full", "window"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(21, 30), (30, 21)], ids=["Lq<Lkv", "Lq>Lkv"])
def test_output_and_gradients_match_reference_with_the_mask(mask, dtype, shape):
    q, k, v, dout = _case(1, Lq=shape[0], Lkv=shape[1], dtype=dtype)
    options = dict(num_chunks_q=3, num_chunks_kv=4, **mask)
    out, lse, grads, keep = _run(q, k, v, dout, 0.3, options)
    check_rule(out, lse, grads, q, k, v, dout, options,
               dict(scale=None, keep=keep, dropout=0.3, **mask), dtype)


def test_dropout_with_softcap_and_alibi():
    q, k, v, dout = _case(2)
    slopes = alibi_slopes(4)
    options = dict(num_chunks_q=3, num_chunks_kv=2, causal=True)
    out, lse, grads, keep = _run(q, k, v, dout, 0.25, options,
                                 extra=(slopes, lambda s: dict(softcap=3.0, alibi_slopes=s)))
    check_rule(out, lse, grads, q, k, v, dout, options,
               dict(causal=True, window=None, scale=None, keep=keep, dropout=0.25,
                    softcap=3.0, alibi_slopes=slopes), "float32")


def test_stash_and_recompute_bit_identical_and_seed_determinism():
    q, k, v, dout = _case(3)
    options = dict(num_chunks_q=3, num_chunks_kv=4, causal=True)
    out, lse, stash, keep = _run(q, k, v, dout, 0.4, options)
    _, _, recompute, keep2 = _run(q, k, v, dout, 0.4, options, stash=False)
    for a, b in zip(stash, recompute):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(keep, keep2)
    out3, lse3, grads3, keep3 = _run(q, k, v, dout, 0.4, options)  # same seed, new graph
    np.testing.assert_array_equal(out, out3)
    np.testing.assert_array_equal(keep, keep3)
    other = _run(q, k, v, dout, 0.4, options, seed=np.array([1234, 5679], np.uint32))
    assert (other[3] != keep).mean() > 0.2  # another seed: another mask
    assert not np.array_equal(other[0], out)


def test_lse_ignores_dropout():
    """lse is the logsumexp before dropout: equal with and without it."""
    q, k, v, dout = _case(4)
    options = dict(num_chunks_q=3, num_chunks_kv=4, causal=True)
    _, lse, _, _ = _run(q, k, v, dout, 0.5, options)
    _, ref_lse = pf.reference.attention(q, k, v, causal=True)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-6)


def test_packed_segments_with_dropout():
    rng = np.random.default_rng(6)
    ids = np.repeat(np.arange(3, dtype=np.int32), [7, 12, 5])[None]
    q, k, v = random_qkv(rng, 2, 24, 24, 8, "float32")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    opts = dict(num_chunks_q=4, num_chunks_kv=3, causal=True)

    def build(q, k, v, do, i, s):
        seg = dict(q_segment_ids=i, kv_segment_ids=i, dropout=0.3, seed=s)
        out, lse, keep = pf.flash_attention(q, k, v, return_lse=True, return_dropout_mask=True,
                                            **opts, **seg)
        return [out, lse, *pf.flash_attention_grad(do, q, k, v, out, lse, **opts, **seg), keep]
    res, _ = run_graph(build, [q, k, v, dout, ids, SEED], fp_checks=True)
    check_rule(res[0], res[1], res[2:5], q, k, v, dout, opts,
               dict(causal=True, window=None, scale=None, q_segment_ids=ids,
                    kv_segment_ids=ids, keep=res[5], dropout=0.3), "float32")


def test_flash_attn_func_return_attn_probs():
    rng = np.random.default_rng(7)
    B, L, H, D = 2, 11, 2, 8
    q, k, v = (rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(3))

    def build(q, k, v, s):
        out, lse, keep = pf.flash_attn_func(q, k, v, dropout_p=0.2, seed=s, causal=True,
                                            return_attn_probs=True, num_chunks_q=2)
        return [out, lse, keep]
    (out, lse, keep), _ = run_graph(build, [q, k, v, SEED], fp_checks=True)
    assert keep.shape == (B, H, L, L) and keep.dtype == np.bool_
    assert lse.shape == (B, H, L)

    def groups(x):
        return x.transpose(0, 2, 1, 3).reshape(B * H, L, D)
    ref, _ = pf.reference.attention(groups(q), groups(k), groups(v), causal=True,
                                    keep=keep.reshape(B * H, L, L), dropout=0.2)
    np.testing.assert_allclose(groups(out), ref, atol=3e-6)


def test_varlen_dropout_mask_shape():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((13, 2, 8)).astype(np.float32) for _ in range(3))
    cu = np.array([0, 6, 13], np.int32)

    def build(q, k, v, c, s):
        out, lse, keep = pf.flash_attn_varlen_func(q, k, v, c, c, 7, 7, dropout_p=0.3, seed=s,
                                                   return_attn_probs=True)
        return [out, keep]
    (out, keep), _ = run_graph(build, [q, k, v, cu, SEED], fp_checks=True)
    assert keep.shape == (2, 13, 13)
    qg, kg, vg = (a.transpose(1, 0, 2) for a in (q, k, v))
    ids, pos = pf.reference.varlen_segments(cu, 13)
    ref, _ = pf.reference.attention(qg, kg, vg, causal=False, q_segment_ids=ids,
                                    kv_segment_ids=ids, q_positions=pos, kv_positions=pos,
                                    keep=keep, dropout=0.3)
    np.testing.assert_allclose(out.transpose(1, 0, 2), ref, atol=3e-6)


def test_flash_attn_func_dropout_errors():
    def no_seed():
        q = zeros_variable((1, 8, 2, 4))
        pf.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p=0.1 needs seed="):
        build_only(no_seed)


@settings(max_examples=30)  # each example builds and runs two graphs
@given(st.integers(1, 20), st.integers(1, 20), st.data())
def test_dropout_over_chunkings(Lq, Lkv, data):
    nq, nkv = data.draw(st.integers(1, Lq)), data.draw(st.integers(1, Lkv))
    causal = data.draw(st.booleans())
    p = data.draw(st.sampled_from([0.1, 0.5]))
    q, k, v, dout = _case(Lq * 31 + Lkv, G=2, Gk=1, Lq=Lq, Lkv=Lkv, D=4)
    options = dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=causal)
    out, lse, grads, keep = _run(q, k, v, dout, p, options)
    check_rule(out, lse, grads, q, k, v, dout, options,
               dict(causal=causal, window=None, scale=None, keep=keep, dropout=p), "float32")


def test_flash_attn_func_dropout_through_autodiff():
    """A layer with dropout and ALiBi differentiated by pf.autodiff with the default
    grads_required (the slopes, with no gradient path but the flash modifiers, are left out):
    gradients equal the reference computed with the returned mask."""
    rng = np.random.default_rng(9)
    B, L, H, D = 2, 13, 2, 8
    q, k, v = (rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(3))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    slopes = np.array([0.5, 0.25], np.float32)

    def build(q, k, v, do, s, sl):
        ir = popxl.gcg().ir

        def layer(q, k, v, s, sl):
            return pf.flash_attn_func(q, k, v, causal=True, dropout_p=0.3, seed=s,
                                      alibi_slopes=sl, return_attn_probs=True, num_chunks_q=2)
        graph = ir.create_graph(layer, q.spec, q.spec, q.spec, s.spec, sl.spec)
        grad = pf.autodiff(graph, grads_provided=graph.outputs[:1])
        info = popxl.ops.call_with_info(graph, q, k, v, s, sl)
        grads = popxl.ops.call(grad.graph, do, inputs_dict=grad.inputs_dict(info))
        return [info.outputs[0], info.outputs[2], *grads]
    res, _ = run_graph(build, [q, k, v, dout, SEED, slopes], fp_checks=True)
    assert len(res) == 5  # dq, dk, dv: no gradient for the seed or the slopes

    def groups(x):
        return x.transpose(0, 2, 1, 3).reshape(B * H, L, D)
    kw = dict(causal=True, keep=res[1].reshape(B * H, L, L), dropout=0.3,
              alibi_slopes=np.tile(slopes, B))
    ref_out, _ = pf.reference.attention(groups(q), groups(k), groups(v), **kw)
    refs = pf.reference.attention_grad(groups(dout), groups(q), groups(k), groups(v), **kw)
    np.testing.assert_allclose(groups(res[0]), ref_out, atol=3e-6)
    for g, r in zip(res[2:], refs):
        np.testing.assert_allclose(groups(g), r, atol=2e-5)


def test_flash_attn_func_grad_with_modifiers():
    """flash_attn_func_grad takes the forward's dropout and modifiers (stash and recompute
    bit-identical, equal to the reference with the returned mask); a stash from a forward with
    modifiers is refused without them."""
    rng = np.random.default_rng(10)
    B, L, H, D = 2, 12, 2, 8
    q, k, v, dout = (rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(4))
    slopes = np.array([0.5, 0.25], np.float32)

    def build(q, k, v, do, s, sl):
        mods = dict(dropout_p=0.2, seed=s, softcap=4.0, alibi_slopes=sl, causal=True,
                    num_chunks_q=3)
        out, lse, keep = pf.flash_attn_func(q, k, v, return_attn_probs=True, **mods)
        stash = pf.flash_attn_func_grad(do, q, k, v, out, lse, **mods)
        recompute = pf.flash_attn_func_grad(do, q, k, v, **mods)
        return [keep, *stash, *recompute]
    res, _ = run_graph(build, [q, k, v, dout, SEED, slopes], fp_checks=True)
    for a, b in zip(res[1:4], res[4:]):
        np.testing.assert_array_equal(a, b)

    def groups(x):
        return x.transpose(0, 2, 1, 3).reshape(B * H, L, D)
    kw = dict(causal=True, keep=res[0].reshape(B * H, L, L), dropout=0.2, softcap=4.0,
              alibi_slopes=np.tile(slopes, B))
    refs = pf.reference.attention_grad(groups(dout), groups(q), groups(k), groups(v), **kw)
    for g, r in zip(res[1:4], refs):
        np.testing.assert_allclose(groups(g), r, atol=2e-5)

    def refused():
        x = zeros_variable((1, 8, 2, 4))
        seed = popxl.variable(SEED)
        out, lse = pf.flash_attn_func(x, x, x, dropout_p=0.1, seed=seed, return_lse=True)
        pf.flash_attn_func_grad(x, x, x, x, out, lse)
    with pytest.raises(ValueError, match="score modifiers"):
        build_only(refused)


def test_dropout_in_many_layers_needs_a_seed_per_call():
    """Two layers' calls on the same q, k, v: one seed tensor for both gives identical keep
    masks (the mask is a function of the seed and the block only), a seed per call from
    ``ops.split_random_seed`` or a per-call offset (``seed + [0, i]``) gives different ones
    (the documented recipe for dropout in many layers)."""
    B, L, H, D = 1, 16, 2, 8
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(3))

    def build(q, k, v, seed):
        def mask(s):
            return pf.flash_attn_func(q, k, v, dropout_p=0.5, seed=s, causal=False,
                                      return_attn_probs=True)[2]
        s0, s1 = popxl.ops.split_random_seed(seed, 2)
        offset = popxl.constant(np.array([0, 1], np.uint32))
        return [mask(seed), mask(seed), mask(s0), mask(s1), mask(seed + offset)]
    (same0, same1, split0, split1, shifted), _ = run_graph(build, [q, k, v, SEED])
    np.testing.assert_array_equal(same0, same1)
    assert (split0 != split1).mean() > 0.25  # independent masks at p = 0.5 differ on ~half
    assert (shifted != same0).mean() > 0.25
