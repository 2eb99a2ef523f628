"""Run-time values the graph cannot check when it is built: each row of the user guide's
"Run-time values" table (docs/user-guide.md, Errors) holds here. Also the KV cache's aliasing
refusals and the message for a cache_seqlens given as a Python list.
"""
import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import build_only, run_graph
from popxl_flash import popxl

ops = popxl.ops

B, LC, H, D = 3, 8, 2, 4


def _kvcache(seqlens, new, fp_checks=False, causal=True):
    """out, lse and k_cache after one flash_attn_with_kvcache call with run-time lengths."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    kc, vc = (rng.standard_normal((B, LC, H, D)).astype(np.float32) for _ in range(2))
    kn = rng.standard_normal((B, 1, H, D)).astype(np.float32)

    def build(q, kc_in, vc_in, kn, lens):
        kc = popxl.variable(kc_in_data, name="k_cache")
        vc = popxl.variable(vc_in_data, name="v_cache")
        rows = (kn, kn) if new else ()
        with popxl.in_sequence():
            out, lse = pf.flash_attn_with_kvcache(q, kc, vc, *rows, cache_seqlens=lens,
                                                  causal=causal, return_lse=True)
            return [out, lse, ops.identity(kc)]
    kc_in_data, vc_in_data = kc, vc
    lens = np.asarray(seqlens, np.int32)
    (out, lse, k_after), _ = run_graph(build, [q, kc, vc, kn, lens], fp_checks=fp_checks)
    return out, lse, k_after, kc, kn


@pytest.mark.parametrize("new", [False, True], ids=["read-only", "write"])
@pytest.mark.parametrize("bad", [-3, -1, "high", "edge", 2 ** 31 - 1])
def test_out_of_range_cache_seqlens_give_nan_rows(new, bad):
    """A batch row whose run-time cache_seqlens is outside [0, Lcache - Lnew] gets NaN out and
    lse; the other rows equal a call without it; a write lands inside the cache."""
    high = LC - int(new)
    bad = {"high": high + 5, "edge": high + 1}.get(bad, bad)
    good = [2, bad, 5]
    out, lse, k_after, kc, kn = _kvcache(good, new)
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
    ref_out, ref_lse, ref_k, _, _ = _kvcache([2, 0, 5], new)
    for b in (0, 2):
        np.testing.assert_array_equal(out[b], ref_out[b])
        np.testing.assert_array_equal(lse[b], ref_lse[b])
        np.testing.assert_array_equal(k_after[b], ref_k[b])
    if new:  # written at the clamped row, the rest of that batch row's cache untouched
        row = 0 if bad < 0 else high
        np.testing.assert_array_equal(k_after[1, row], kn[1, 0])
        others = [r for r in range(LC) if r != row]
        np.testing.assert_array_equal(k_after[1, others], kc[1, others])


@pytest.mark.parametrize("new", [False, True], ids=["read-only", "write"])
def test_out_of_range_cache_seqlens_trap_under_fp_checks(new):
    with pytest.raises(FloatingPointError, match="cache_seqlens_out_of_range"):
        _kvcache([2, LC + 1, 0], new, fp_checks=True)


def _rotary(positions, fp_checks=False, dtype=np.float32):
    """apply_rotary on x [2, 3, 2, 6] (rotary_dim 4 of 6) at run-time positions over tables of
    4 rows; returns (out, the same call at in-range positions given as an int offset per row)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 2, 6)).astype(dtype)
    cos, sin = pf.rotary_tables(4, 4)

    def build(x, pos):
        c, s = popxl.constant(cos), popxl.constant(sin)
        return [pf.apply_rotary(x, c, s, positions=pos)]
    (out,), _ = run_graph(build, [x, np.asarray(positions, np.int32)], fp_checks=fp_checks)
    return out, x, cos, sin


def _rotate_row(x, cos, sin, p):
    """Host half-split rotation of x [H, D] at table row p (float64)."""
    x = x.astype(np.float64)
    c, s = cos[p].astype(np.float64), sin[p].astype(np.float64)
    a, b = x[:, :2], x[:, 2:4]
    return np.concatenate([a * c - b * s, b * c + a * s, x[:, 4:]], axis=-1)


@pytest.mark.parametrize("positions", [[0, 3, 10], [-1, 2, 3], [[0, 1, 2], [3, 4, 2**31 - 1]]])
def test_out_of_range_rotary_positions_give_nan_rows(positions):
    """apply_rotary at run-time positions past its tables: those rows NaN (every head and dim),
    the others equal the host rotation at their positions."""
    out, x, cos, sin = _rotary(positions)
    pos = np.broadcast_to(np.asarray(positions, np.int64), (2, 3))
    for b in range(2):
        for i in range(3):
            if 0 <= pos[b, i] < 4:
                np.testing.assert_allclose(out[b, i], _rotate_row(x[b, i], cos, sin, pos[b, i]),
                                           rtol=0, atol=1e-6)
            else:
                assert np.isnan(out[b, i]).all()


def test_out_of_range_rotary_positions_trap_under_fp_checks():
    with pytest.raises(FloatingPointError, match="positions_out_of_range"):
        _rotary([0, 3, 10], fp_checks=True)


def test_in_range_rotary_positions_are_not_poisoned():
    out, *_ = _rotary([[0, 3, 1], [2, 0, 3]], fp_checks=True, dtype=np.float16)
    assert not np.isnan(out).any()


@pytest.mark.parametrize("new", [False, True], ids=["read-only", "write"])
def test_in_range_edges_are_not_poisoned(new):
    """0 and Lcache - Lnew are valid lengths (a row that sees no key: out 0, lse -inf)."""
    out, lse, *_ = _kvcache([0, LC - int(new), 3], new, fp_checks=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    if not new:
        assert (out[0] == 0).all() and np.isneginf(lse[0]).all()


@pytest.mark.parametrize("value", [[1, 2], (1, 2), np.array([1, 2])])
def test_cache_seqlens_as_host_values_say_how_to_make_a_tensor(value):
    def fn():
        q = popxl.variable(np.zeros((2, 1, 1, 4), np.float32))
        kc = popxl.variable(np.zeros((2, 8, 1, 4), np.float32))
        vc = popxl.variable(np.zeros((2, 8, 1, 4), np.float32))
        pf.flash_attn_with_kvcache(q, kc, vc, q, q, cache_seqlens=value)
    with pytest.raises(TypeError, match=r"cache_seqlens must be an int32 \[B=2\] popxl.Tensor "
                                        r"or an int, got .*ops.host_load"):
        build_only(fn)


def _caches():
    q = popxl.variable(np.zeros((2, 1, 1, 4), np.float32))
    kc = popxl.variable(np.zeros((2, 8, 1, 4), np.float32))
    vc = popxl.variable(np.zeros((2, 8, 1, 4), np.float32))
    new = popxl.variable(np.zeros((2, 1, 1, 4), np.float32))
    return q, kc, vc, new


@pytest.mark.parametrize("with_rows", [False, True])
def test_one_tensor_as_both_caches_is_refused(with_rows):
    def fn():
        q, kc, _, new = _caches()
        rows = (new, new) if with_rows else ()
        pf.flash_attn_with_kvcache(q, kc, kc, *rows, cache_seqlens=0 if with_rows else None)
    with pytest.raises(ValueError, match="k_cache and v_cache are the same tensor"):
        build_only(fn)


@pytest.mark.parametrize("role", ["q", "k", "v"])
def test_a_cache_that_is_also_an_input_is_refused(role):
    """The cache is written in place: it cannot also be q or the new rows."""
    def fn():
        q, kc, vc, k, v = (popxl.variable(np.zeros((2, 1, 1, 4), np.float32))
                           for _ in range(5))
        args = dict(q=q, k=k, v=v)
        args[role] = kc if role != "v" else vc
        pf.flash_attn_with_kvcache(args["q"], kc, vc, args["k"], args["v"], cache_seqlens=0)
    with pytest.raises(ValueError, match=f"{role} and (k|v)_cache are the same tensor"):
        build_only(fn)


# -- varlen offsets -----------------------------------------------------------------------------
def _varlen(cu_q, cu_k, total=12, max_seqlen=12, causal=True, **options):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((total, 2, 4)).astype(np.float32) for _ in range(3))

    def build(q, k, v, cq, ck):
        return list(pf.flash_attn_varlen_func(q, k, v, cq, ck, max_seqlen, max_seqlen,
                                              causal=causal, return_lse=True, **options))
    (out, lse), _ = run_graph(build, [q, k, v, np.asarray(cu_q, np.int32),
                                      np.asarray(cu_k, np.int32)], fp_checks=True)
    to_hld = (lambda x: x.transpose(1, 0, 2))
    ref_out, ref_lse = pf.reference.attention_varlen(  # negative offsets act as 0
        to_hld(q), to_hld(k), to_hld(v), np.maximum(cu_q, 0), np.maximum(cu_k, 0),
        causal=causal)
    return out, lse, to_hld(ref_out), ref_lse


def test_decreasing_offsets_make_every_row_padding():
    out, lse, ref_out, ref_lse = _varlen([0, 7, 4], [0, 7, 4])
    assert (out == 0).all() and np.isneginf(lse).all()
    assert (ref_out == 0).all() and np.isneginf(ref_lse).all()


@pytest.mark.parametrize("cu", [[0, 5, 20], [-4, 5, 12], [2, 5, 9]])
def test_offsets_outside_the_row_are_padding_as_the_reference(cu):
    out, lse, ref_out, ref_lse = _varlen(cu, cu)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    first = max(cu[0], 0)
    assert (out[:first] == 0).all()


def test_sequences_longer_than_max_seqlen_give_the_same_result():
    cu = [0, 9, 12]
    out, _, ref_out, _ = _varlen(cu, cu, max_seqlen=2)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)


# -- segment ids, seeds, slopes -----------------------------------------------------------------
def test_any_int32_segment_ids():
    """Equal non-negative ids see each other, any negative id is padding (out 0, lse -inf)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 6, 4)).astype(np.float32) for _ in range(3))
    ids = np.array([[2 ** 31 - 1, 2 ** 31 - 1, -5, 7, 7, -2 ** 31]], np.int32)

    def build(q, k, v, qi, ki):
        return list(pf.flash_attention(q, k, v, causal=False, return_lse=True,
                                       q_segment_ids=qi, kv_segment_ids=ki))
    (out, lse), _ = run_graph(build, [q, k, v, ids, ids], fp_checks=True)
    ref_out, ref_lse = pf.reference.attention(q, k, v, causal=False, q_segment_ids=ids,
                                              kv_segment_ids=ids)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    assert (out[0, [2, 5]] == 0).all() and np.isneginf(lse[0, [2, 5]]).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))


def test_any_uint32_seed_value():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 16, 4)).astype(np.float32) for _ in range(3))
    masks = []
    for seed in ([2 ** 32 - 1, 2 ** 32 - 1], [0, 0]):
        def build(q, k, v, s):
            return list(pf.flash_attention(q, k, v, dropout=0.5, seed=s,
                                           return_dropout_mask=True))
        (_, keep), _ = run_graph(build, [q, k, v, np.array(seed, np.uint32)], fp_checks=True)
        assert 0.3 < keep.mean() < 0.7
        masks.append(keep)
    assert (masks[0] != masks[1]).mean() > 0.3


def test_nan_slopes_give_nan_out():
    q = np.ones((2, 4, 4), np.float32)

    def build(q, s):
        return [pf.flash_attention(q, q, q, alibi_slopes=s)]
    (out,), _ = run_graph(build, [q, np.array([np.nan, 0.5], np.float32)])
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()
