"""flash_attn_with_kvcache: prefill and decode against a float64 reference on each row's valid
prefix, the caches after the in-place update, split-KV, run-time skipping by length (executed
matmul FLOPs on the emulator's profile), the decode cost model, and build-time errors.
"""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st


import popxl_flash as pf
from attention_utils import output_elements
from attention_utils import FP_CHECKS, assert_within_rule, build_only, run_graph, zeros_variable
from popxl_flash.api import kvcache
from popxl_flash import popxl
from popxl_flash.checks.tolerance import naive_attention

ops = popxl.ops

emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator run profile")


def make_case(seed, B, Lq, Lc, Hq, Hkv, D, dtype, Lnew=None, seqlens=None):
    """Random q, caches, new rows (``Lnew`` defaults to ``Lq``; 0: no new rows) and lengths."""
    rng = np.random.default_rng(seed)
    Lnew = Lq if Lnew is None else Lnew
    q = rng.standard_normal((B, Lq, Hq, D)).astype(dtype)
    kc, vc = (rng.standard_normal((B, Lc, Hkv, D)).astype(dtype) for _ in range(2))
    kn, vn = ((rng.standard_normal((B, Lnew, Hkv, D)).astype(dtype) for _ in range(2))
              if Lnew else (None, None))
    if seqlens is None:
        seqlens = rng.integers(0, Lc - Lnew + 1, size=B)
    return q, kc, vc, kn, vn, np.asarray(seqlens, np.int32)


def run_kvcache(q, kc, vc, kn, vn, seqlens, *, int_seqlens=False, slopes=None, **options):
    """Run ``flash_attn_with_kvcache`` (floating-point traps on) and read the caches after it.

    Args:
        slopes: ``None`` or host ALiBi slopes (``[Hq]`` or ``[B, Hq]``), a graph input.

    Returns:
        ``(out, lse, k_cache, v_cache, run)``.
    """
    arrays = [q, kc, vc] + ([kn, vn] if kn is not None else []) + \
        ([] if int_seqlens else [seqlens]) + ([] if slopes is None else [slopes])

    def build(q, kc, vc, *rest):
        rest = list(rest)
        alibi = rest.pop() if slopes is not None else None
        new = rest[:2] if kn is not None else (None, None)
        lens = int(seqlens[0]) if int_seqlens else rest[-1]
        with popxl.in_sequence():  # read the caches after the in-place write
            out, lse = pf.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=lens,
                                                  return_lse=True, alibi_slopes=alibi,
                                                  **options)
            return [out, lse, ops.identity(kc), ops.identity(vc)]
    (out, lse, kc2, vc2), run = run_graph(build, arrays, fp_checks=FP_CHECKS)
    return out, lse, kc2, vc2, run


def expected_caches(kc, vc, kn, vn, seqlens):
    k, v = kc.copy(), vc.copy()
    if kn is not None:
        for b, s in enumerate(seqlens):
            k[b, s:s + kn.shape[1]] = kn[b]
            v[b, s:s + kn.shape[1]] = vn[b]
    return k, v


def row_modifiers(b, softcap=0.0, slopes=None):
    """The reference's modifier keywords for batch row ``b`` (slopes ``[Hq]`` or ``[B, Hq]``)."""
    mods = dict(softcap=softcap) if softcap else {}
    if slopes is not None:
        mods["alibi_slopes"] = slopes if slopes.ndim == 1 else slopes[b]
    return mods


def check_rows(out, lse, q, k, v, seqlens, Lnew, *, causal, window, scale=None, dtype,
               softcap=0.0, slopes=None):
    """Each batch row against the float64 reference on its valid prefix (2x rule; rows that
    see no key exactly out 0, lse -inf). The reference's ALiBi offset is ``n - Lq`` on the
    prefix of ``n`` rows: flash-attn's ``seqlen_k - seqlen_q`` per row."""
    D = q.shape[-1]
    for b in range(q.shape[0]):
        n = int(seqlens[b]) + Lnew
        qb = q[b].transpose(1, 0, 2)  # [Hq, Lq, D]
        ob, lb = out[b].transpose(1, 0, 2), lse[b]
        assert ob.dtype == np.dtype(dtype) and lb.dtype == np.float32
        if n == 0:
            assert (ob == 0).all() and np.isneginf(lb).all()
            continue
        kb, vb = (x[b, :n].transpose(1, 0, 2) for x in (k, v))  # [Hkv, n, D]
        mask = dict(causal=causal, window=window, scale=scale,
                    **row_modifiers(b, softcap, slopes))
        ref_out, ref_lse = pf.reference.attention(qb, kb, vb, **mask)
        naive_out, _ = naive_attention(qb, kb, vb, **mask)
        steps = n + D + 64
        assert_within_rule(f"out[{b}]", ob, naive_out, ref_out, factor=2, dtype=dtype,
                           accum_steps=steps, magnitude=float(np.abs(vb).max()))
        empty = np.isneginf(ref_lse)
        np.testing.assert_array_equal(np.isneginf(lb), empty)
        assert (ob[empty] == 0).all() and not np.isnan(ob).any()
        _, naive_lse = naive_attention(*(x.astype(np.float32) for x in (qb, kb, vb)), **mask)
        assert_within_rule(f"lse[{b}]", lb, naive_lse, ref_lse, factor=2, dtype="float32",
                           accum_steps=steps,
                           magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))


def check_case(case, dtype, *, causal, window=(-1, -1), int_seqlens=False, softcap=0.0,
               slopes=None, **options):
    q, kc, vc, kn, vn, seqlens = case
    mods = dict(softcap=softcap) if softcap else {}
    out, lse, kc2, vc2, run = run_kvcache(q, kc, vc, kn, vn, seqlens, causal=causal,
                                          window_size=window, int_seqlens=int_seqlens,
                                          slopes=slopes, **mods, **options)
    k, v = expected_caches(kc, vc, kn, vn, seqlens)
    np.testing.assert_array_equal(kc2, k)  # written rows replaced, every other row unchanged
    np.testing.assert_array_equal(vc2, v)
    Lnew = 0 if kn is None else kn.shape[1]
    check_rows(out, lse, q, k, v, seqlens, Lnew, causal=causal,
               window=tuple(None if w < 0 else w for w in window), dtype=dtype,
               softcap=softcap, slopes=slopes)
    return run


MASKS = [dict(causal=True), dict(causal=False), dict(causal=True, window=(5, -1)),
         dict(causal=False, window=(3, 2))]


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "full", "causal-window", "window"])
@pytest.mark.parametrize("Lq", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_rows_match_reference_on_valid_prefix(mask, Lq, dtype):
    """Per-row lengths including 0 and Lcache - Lnew, grouped-query heads, both dtypes."""
    Lc = 37
    case = make_case(1, 4, Lq, Lc, 4, 2, 8, dtype, seqlens=[0, 11, Lc - Lq, 3])
    check_case(case, dtype, num_chunks_kv=5, **mask)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("mask", MASKS[:3], ids=["causal", "full", "causal-window"])
def test_split_kv_matches_reference(splits, mask):
    case = make_case(2, 3, 1, 45, 2, 1, 8, "float16", seqlens=[44, 0, 20])
    check_case(case, "float16", num_splits=splits, num_chunks_kv=6, **mask)


def test_speculative_decode_multi_query_and_int_seqlens():
    """Lq = 3 new tokens (speculative decoding), multi-query caches, an int cache_seqlens."""
    case = make_case(3, 2, 3, 30, 4, 1, 16, "float32", seqlens=[9, 9])
    check_case(case, "float32", causal=True, int_seqlens=True, num_splits=2)


def test_without_new_rows_and_lq_longer_than_prefix():
    """k=v=None: the caches are read as they are; causal rows beyond a short prefix see
    nothing (bottom-right alignment): out 0, lse -inf."""
    case = make_case(4, 3, 5, 24, 2, 2, 8, "float32", Lnew=0, seqlens=[2, 24, 0])
    check_case(case, "float32", causal=True, num_chunks_kv=3)


def test_caches_as_variables_are_updated_in_place():
    """Caches held in variables: two decode steps in one graph append two rows per batch row;
    the session's variables hold them after the run."""
    B, Lc, H, D = 2, 12, 2, 4
    rng = np.random.default_rng(5)
    kc0, vc0 = (rng.standard_normal((B, Lc, H, D)).astype(np.float32) for _ in range(2))
    rows = [rng.standard_normal((B, 1, H, D)).astype(np.float32) for _ in range(4)]
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        kc, vc = popxl.variable(kc0), popxl.variable(vc0)
        lens = popxl.variable(np.array([3, 7], np.int32))
        for step in range(2):
            q = popxl.constant(rows[step])
            pf.flash_attn_with_kvcache(q, kc, vc, popxl.constant(rows[step]),
                                       popxl.constant(rows[step + 2]), lens, causal=True)
            ops.var_updates.accumulate_(lens, popxl.constant(np.array([1, 1], np.int32)))
    session = popxl.Session(ir, "ipu_model")
    with session:
        session.run()
    k_after, v_after = session.get_tensor_data(kc), session.get_tensor_data(vc)
    k_exp, v_exp = kc0.copy(), vc0.copy()
    for step in range(2):
        for b, s in enumerate((3, 7)):
            k_exp[b, s + step] = rows[step][b, 0]
            v_exp[b, s + step] = rows[step + 2][b, 0]
    np.testing.assert_array_equal(k_after, k_exp)
    np.testing.assert_array_equal(v_after, v_exp)


@settings(max_examples=25)
@given(Lc=st.integers(1, 70), data=st.data(), Lq=st.integers(1, 5), splits=st.integers(1, 4),
       causal=st.booleans(), window=st.sampled_from([(-1, -1), (3, -1), (2, 1), (0, 0)]),
       seed=st.integers(0, 2 ** 16))
def test_hypothesis_cache_lengths_and_chunks(Lc, data, Lq, splits, causal, window, seed):
    Lnew = data.draw(st.integers(0, min(Lq, Lc)), label="Lnew")
    seqlens = data.draw(st.lists(st.integers(0, Lc - Lnew), min_size=2, max_size=2),
                        label="seqlens")
    if Lnew == 0:
        seqlens = [max(s, 1) for s in seqlens]  # the whole row of a query-only call
    splits = min(splits, Lc)
    nkv = data.draw(st.integers(1, Lc), label="num_chunks_kv")
    case = make_case(seed, 2, Lq, Lc, 2, 1, 4, "float32", Lnew=Lnew, seqlens=seqlens)
    check_case(case, "float32", causal=causal, window=window, num_splits=splits,
               num_chunks_kv=nkv)


# -- score modifiers: softcap and ALiBi ----------------------------------------------------
def geometric_slopes(heads):
    """The ALiBi paper's slopes ``2^(-8 h / H)``, float32 ``[H]``."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def make_slopes(kind, B, Hq, seed=0):
    """``None``, ``"H"`` (geometric ``[Hq]``) or ``"BH"`` (random ``[B, Hq]`` in [0.05, 1))."""
    if kind is None:
        return None
    if kind == "H":
        return geometric_slopes(Hq)
    return np.random.default_rng(seed).uniform(0.05, 1.0, (B, Hq)).astype(np.float32)


MODS = {"softcap": (1.5, None), "alibi-H": (0.0, "H"), "alibi-BH": (0.0, "BH"),
        "both": (2.0, "BH")}
#: (Lq, num_splits, mask, dtype): decode and prefill, split-KV and one loop, causal and windows.
STRUCTURES = {"decode-split3-causal": (1, 3, dict(causal=True), "float16"),
              "decode-loop-window": (1, 1, dict(causal=False, window=(6, 2)), "float32"),
              "prefill-loop-causal-window": (5, 1, dict(causal=True, window=(7, -1)),
                                             "float16"),
              "prefill-split2-full": (5, 2, dict(causal=False), "float32")}


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("mods", MODS)
def test_modifiers_match_reference_on_valid_prefix(mods, structure):
    """softcap and ALiBi ([Hq] and [B, Hq] slopes) with grouped-query heads, per-row lengths
    including 0 and Lcache - Lnew: ALiBi's distance is taken from each row's own bottom-right
    corner (``i + n_b - Lq - j``), so a wrong offset fails the rows of other lengths."""
    Lq, splits, mask, dtype = STRUCTURES[structure]
    softcap, kind = MODS[mods]
    B, Lc, Hq = 4, 37, 4
    case = make_case(11, B, Lq, Lc, Hq, 2, 8, dtype, seqlens=[0, 11, Lc - Lq, 3])
    check_case(case, dtype, softcap=softcap, slopes=make_slopes(kind, B, Hq),
               num_splits=splits, num_chunks_kv=6, **mask)


def test_modifiers_int_seqlens_and_no_new_rows():
    """An int cache_seqlens with both modifiers; and a query-only call (k = v = None)."""
    case = make_case(12, 2, 3, 30, 4, 1, 16, "float32", seqlens=[9, 9])
    check_case(case, "float32", causal=True, int_seqlens=True, num_splits=2, softcap=3.0,
               slopes=make_slopes("H", 2, 4))
    case = make_case(13, 3, 2, 24, 2, 2, 8, "float32", Lnew=0, seqlens=[0, 24, 5])
    check_case(case, "float32", causal=True, num_chunks_kv=3, slopes=make_slopes("BH", 3, 2))


def test_modifiers_change_the_result():
    """The modifiers reach the scores: the same call without them differs (so the reference
    comparisons above would fail on an ignored modifier)."""
    case = make_case(14, 2, 1, 20, 2, 1, 8, "float32", seqlens=[7, 19])
    plain = run_kvcache(*case, causal=True)[0]
    capped = run_kvcache(*case, causal=True, softcap=0.5)[0]
    alibi = run_kvcache(*case, causal=True, slopes=make_slopes("H", 2, 2))[0]
    assert np.abs(capped - plain).max() > 1e-3 and np.abs(alibi - plain).max() > 1e-3


@settings(max_examples=10)
@given(Lc=st.integers(1, 40), data=st.data(), Lq=st.integers(1, 4), splits=st.integers(1, 3),
       causal=st.booleans(), window=st.sampled_from([(-1, -1), (3, -1), (2, 1)]),
       mods=st.sampled_from(sorted(MODS)), seed=st.integers(0, 2 ** 16))
def test_hypothesis_modifiers(Lc, data, Lq, splits, causal, window, mods, seed):
    Lnew = data.draw(st.integers(1, min(Lq, Lc)), label="Lnew")
    seqlens = data.draw(st.lists(st.integers(0, Lc - Lnew), min_size=2, max_size=2),
                        label="seqlens")
    nkv = data.draw(st.integers(1, Lc), label="num_chunks_kv")
    softcap, kind = MODS[mods]
    case = make_case(seed, 2, Lq, Lc, 2, 1, 4, "float32", Lnew=Lnew, seqlens=seqlens)
    check_case(case, "float32", causal=causal, window=window, num_splits=min(splits, Lc),
               num_chunks_kv=nkv, softcap=softcap, slopes=make_slopes(kind, 2, 2, seed))


# -- run-time skipping and the cost model ------------------------------------------------------
def decode_profile(Lc, fill, *, B=2, Hq=4, Hkv=2, D=64, **options):
    """One decode step (Lq = Lnew = 1) of a cache holding ``fill`` rows in every batch row."""
    case = make_case(6, B, 1, Lc, Hq, Hkv, D, "float16", seqlens=[fill] * B)
    *_, run = run_kvcache(*case, causal=True, **options)
    return run.profile


@emulator_only
@pytest.mark.parametrize("splits,chunks", [(1, 16), (4, 64)])
def test_decode_flops_follow_the_fill(splits, chunks):
    """4096-row cache holding 100 tokens, decoding one more, with a kv loop of 256 cache rows
    per step (one loop of chunk 256, or 4 splits of chunk 64): the executed matmul FLOPs are
    those of at least the 101 valid rows and at most 256 cache rows. The automatic structure
    (the straight-line pass) reads the whole cache, whatever the fill."""
    B, Hq, D = 2, 4, 64
    profile = decode_profile(4096, 100, B=B, Hq=Hq, D=D, num_splits=splits,
                             num_chunks_kv=chunks)
    per_row = 4 * B * Hq * D  # q k^T and p v for one cache row, Lq = 1
    assert 101 * per_row <= profile.matmul_flops <= 256 * per_row
    auto = decode_profile(4096, 100, B=B, Hq=Hq, D=D)
    assert auto.matmul_flops == 4096 * per_row and auto.loop_iterations == 0


def _supersteps(profile):
    """Executed ops other than views without the harness's host transfers and its two
    identities (the op count the decode model predicts)."""
    return profile.ops_excluding_views - sum(profile.ops_by_kind.get(k, 0)
                                    for k in ("host_load", "host_store", "identity"))


@emulator_only
@pytest.mark.parametrize("splits,fill", [(1, 409), (1, 4095), (4, 2047)])
def test_decode_model_counts_match_emulator(splits, fill):
    """The kv-loop model's FLOPs and lowering copies (PopART's rules for the segment-id loop:
    costmodel.pass_copies over the runtime block classes of the fill) are the emulator's
    exactly, its supersteps within 5% (OPS_DECODE) and its vector elements within 10%
    (VEC_DECODE; the harness's identities aside)."""
    Lc = 4096
    choice = kvcache.decode_choice(2, 1, Lc, q_heads=4, kv_heads=2, head_dim=64,
                                   num_splits=splits, causal=True)
    chosen = choice.chosen
    assert not chosen.straight  # a fixed num_splits is a kv loop
    model = kvcache.evaluate(kvcache.Dims(2, 1, Lc, 1, 4, 2, 64), chosen.splits,
                             chosen.chunk_kv, lengths=(fill + 1,))
    profile = decode_profile(Lc, fill, num_splits=splits)
    assert model.flops[0] == profile.matmul_flops
    assert model.bytes_copied == profile.boundary_bytes_copied
    steps = _supersteps(profile)
    assert abs(model.ops[0] - steps) <= 0.05 * steps
    vec = output_elements(profile) - profile.elements_by_kind.get("identity", 0)
    assert abs(model.vector_elements[0] - vec) <= 0.10 * vec
    assert profile.loop_iterations == chosen.steps


@emulator_only
@pytest.mark.parametrize("splits,fill", [(1, 409), (1, 4095), (2, 300), (2, 2047), (4, 2047)])
def test_decode_model_counts_modifier_ops_exactly(splits, fill):
    """softcap and ALiBi ([Hq] slopes) add exactly the model's supersteps to a kv-loop decode
    step (the harness's one more host load for the slopes aside), and no FLOPs."""
    Lc, dims = 4096, kvcache.Dims(2, 1, 4096, 1, 4, 2, 64)
    chunk = kvcache.decode_choice(2, 1, Lc, q_heads=4, kv_heads=2, head_dim=64,
                                  num_splits=splits, softcap=True, alibi=True).chosen.chunk_kv
    plain, both = (kvcache.evaluate(dims, splits, chunk, lengths=(fill + 1,), softcap=m,
                                    alibi=m) for m in (False, True))
    base = decode_profile(Lc, fill, num_splits=splits)
    modified = decode_profile(Lc, fill, num_splits=splits, softcap=30.0,
                              slopes=geometric_slopes(4))
    assert modified.matmul_flops == base.matmul_flops == both.flops[0]
    assert _supersteps(modified) - _supersteps(base) == both.ops[0] - plain.ops[0]


def test_decode_choice_records_every_structure():
    choice = pf.kvcache.explain(2, 1, 4096, q_heads=4, kv_heads=2, head_dim=64)
    assert {c.structure for c in choice.candidates} == {"straight", "loop", "split"}
    assert {c.splits for c in choice.candidates} >= {1, 2, 4}
    assert choice.chosen.straight  # a decode step: least modelled time by far
    assert "chosen: straight, num_splits=" in choice.table()
    forced = pf.kvcache.explain(2, 1, 4096, q_heads=4, head_dim=64, num_splits=4)
    assert forced.chosen.splits == 4 and not any(c.straight for c in forced.candidates)


# -- build-time errors -------------------------------------------------------------------------
def _build(q=(2, 1, 4, 8), cache=(2, 16, 2, 8), new=(2, 1, 2, 8), v_cache=None, seqlens=(2,),
           seqlens_dtype=np.int32, slopes=None, **options):
    def fn():
        if slopes is not None:  # (shape, dtype) of an alibi_slopes variable
            options["alibi_slopes"] = zeros_variable(*slopes)
        tensors = [zeros_variable(s) for s in (q, cache, v_cache or cache)]
        kn = vn = None
        if new is not None:
            kn, vn = zeros_variable(new), zeros_variable(new)
        lens = seqlens
        if isinstance(seqlens, tuple):
            lens = zeros_variable(seqlens, seqlens_dtype)
        return pf.flash_attn_with_kvcache(*tensors, kn, vn, cache_seqlens=lens, **options)
    return build_only(fn)


BAD = [
    (dict(seqlens=(2, 1)), ValueError, "cache_seqlens must have shape [B=2], got shape (2, 1)"),
    (dict(seqlens=(3,)), ValueError, "cache_seqlens must have shape [B=2], got shape (3,)"),
    (dict(seqlens_dtype=np.float32), TypeError,
     "cache_seqlens must have dtype int32 [B=2], got dtype float32"),
    (dict(seqlens=None), ValueError, "cache_seqlens is required with new rows"),
    (dict(seqlens=16), ValueError, "cache_seqlens must be in [0, 15], got cache_seqlens=16"),
    (dict(seqlens=np.array([1, 2], np.int32)), TypeError,
     "cache_seqlens must be an int32 [B=2] popxl.Tensor or an int, got a numpy array"),
    (dict(new=(2, 17, 2, 8)), ValueError, "k has Lnew=17 new rows, more than the cache holds "
                                          "(Lcache=16)"),
    (dict(new=(2, 1, 1, 8)), ValueError, "k must have shape [B=2, Lnew, Hkv=2, D=8]"),
    (dict(q=(2, 1, 3, 8)), ValueError, "q's head count Hq=3 must be a multiple of the caches' "
                                       "Hkv=2"),
    (dict(v_cache=(2, 16, 1, 8)), ValueError, "v_cache must have the shape of k_cache"),
    (dict(q=(2, 1, 4, 4)), ValueError, "k_cache must have q's batch B=2 and head dim D=4"),
    (dict(q=(1, 4, 8)), ValueError, "q must have rank 4 [B, Lq, Hq, D]"),
    (dict(softcap=-1.0), ValueError, "softcap must be in [0.0, "),
    (dict(softcap="30"), TypeError, "softcap must be a real number, got softcap='30'"),
    (dict(softcap=float("nan")), ValueError, "softcap must be in [0.0, "),
    (dict(slopes=((3,), np.float32)), ValueError,
     "alibi_slopes must be float32 [Hq=4] or [B=2, Hq=4], got (3,) float32"),
    (dict(slopes=((1, 4), np.float32)), ValueError,
     "alibi_slopes must be float32 [Hq=4] or [B=2, Hq=4], got (1, 4) float32"),
    (dict(slopes=((2, 2), np.float32)), ValueError,
     "alibi_slopes must be float32 [Hq=4] or [B=2, Hq=4], got (2, 2) float32"),
    (dict(slopes=((4,), np.float16)), ValueError,
     "alibi_slopes must be float32 [Hq=4] or [B=2, Hq=4], got (4,) float16"),
    (dict(alibi_slopes=np.ones(4, np.float32)), TypeError, "alibi_slopes must be a popxl.Tensor"),
    (dict(dropout_p=0.1), TypeError, "'dropout_p': the KV cache is inference-only: "
                                     "flash_attn_with_kvcache has no dropout"),
    (dict(dropout=0.1), TypeError, "'dropout': the KV cache is inference-only: "
                                   "flash_attn_with_kvcache has no dropout"),
    (dict(seed=1), TypeError, "'seed': the KV cache is inference-only"),
    (dict(return_attn_probs=True), TypeError, "'return_attn_probs': the KV cache is "
                                              "inference-only"),
    (dict(score_mod=abs), TypeError, "flash_attn_with_kvcache takes no score_mod"),
    (dict(scale=0.5), TypeError, "flash_attn_with_kvcache calls it softmax_scale="),
    (dict(num_splits=-1), ValueError, "num_splits must be in [0, 16], got num_splits=-1"),
    (dict(num_splits=1.5), TypeError, "num_splits must be an int"),
    (dict(window_size=(1, 2, 3)), ValueError, "window_size"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(rotary_cos=1), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(k_cache_layout="BSDH"), ValueError,
     "k_cache_layout must be one of ('BSHD', 'BHSD', 'BHDS'), got k_cache_layout='BSDH'"),
    (dict(v_cache_layout="BHDS"), ValueError,
     "v_cache_layout must be one of ('BSHD', 'BHSD'), got v_cache_layout='BHDS'"),
    (dict(k_cache_layout="BHDS"), ValueError,
     "k_cache must have q's batch B=2 and head dim D=8 ([B, Hkv, D, Lcache], "
     "k_cache_layout='BHDS'), got k_cache shape (2, 16, 2, 8)"),
    (dict(block_table=1), TypeError, "paged caches are not supported"),
]


@pytest.mark.parametrize("override, exc, fragment", BAD)
def test_bad_input_is_a_build_time_error(override, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        _build(**override)


def test_k_without_v_and_dtype_mismatch():
    def one_new():
        q, c = zeros_variable((1, 1, 1, 4)), zeros_variable((1, 4, 1, 4))
        return pf.flash_attn_with_kvcache(q, c, c, zeros_variable((1, 1, 1, 4)), None, 0)
    with pytest.raises(ValueError, match="k and v must be given together"):
        build_only(one_new)

    def mixed():
        q = zeros_variable((1, 1, 1, 4), np.float16)
        c = zeros_variable((1, 4, 1, 4))
        return pf.flash_attn_with_kvcache(q, c, c, cache_seqlens=0)
    with pytest.raises(TypeError, match="must share one dtype"):
        build_only(mixed)


# -- optional PyTorch cross-check ---------------------------------------------------------------
def _sdpa(q, k, v, n, causal, dtype):
    """PyTorch SDPA of one batch row's ``q [Lq, Hq, D]`` over its valid prefix ``k, v [n, Hkv,
    D]`` (explicit bottom-right causal mask; grouped-query via ``enable_gqa``)."""
    import torch
    tq, tk, tv = (torch.tensor(a.astype(np.float64)).to(dtype).transpose(0, 1)[None]
                  for a in (q, k[:n], v[:n]))  # [1, H, L, D]
    Lq = q.shape[0]
    mask = None
    if causal:
        mask = torch.arange(n)[None, :] <= torch.arange(Lq)[:, None] + (n - Lq)
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                           enable_gqa=True)
    return out[0].transpose(0, 1).double().numpy()  # [Lq, Hq, D]


@pytest.mark.parametrize("Lq,dtype,splits", [(1, "float16", None), (1, "float32", 3),
                                             (4, "float16", 1)])
def test_matches_pytorch_sdpa_on_valid_prefix(Lq, dtype, splits):
    """Outputs and updated caches against PyTorch SDPA on each row's valid prefix (2x the
    same-precision SDPA's error against float64 SDPA, plus the rule's floor)."""
    torch = pytest.importorskip("torch")
    Lc = 50
    q, kc, vc, kn, vn, seqlens = make_case(7, 3, Lq, Lc, 4, 2, 16, dtype,
                                           seqlens=[Lc - Lq, 13, 30])
    out, _, kc2, vc2, _ = run_kvcache(q, kc, vc, kn, vn, seqlens, causal=True,
                                      num_splits=splits)
    k, v = expected_caches(kc, vc, kn, vn, seqlens)
    np.testing.assert_array_equal(kc2, k)
    np.testing.assert_array_equal(vc2, v)
    low = torch.float16 if dtype == "float16" else torch.float32
    for b in range(3):
        n = int(seqlens[b]) + Lq
        ref = _sdpa(q[b], k[b], v[b], n, True, torch.float64)
        same = _sdpa(q[b], k[b], v[b], n, True, low)
        assert_within_rule(f"out[{b}]", out[b], same, ref, factor=2, dtype=dtype,
                           accum_steps=n + 16 + 64, magnitude=float(np.abs(v[b, :n]).max()))


def _sdpa_alibi(q, k, v, n, slopes, causal, dtype):
    """PyTorch SDPA of one batch row over its valid prefix with flash-attn's ALiBi as an
    explicit float bias ``-slope[h] * |i + n - Lq - j|`` (``-inf`` where causal hides a key)."""
    import torch
    tq, tk, tv = (torch.tensor(a.astype(np.float64)).to(dtype).transpose(0, 1)[None]
                  for a in (q, k[:n], v[:n]))  # [1, H, L, D]
    Lq = q.shape[0]
    i, j = torch.arange(Lq)[:, None], torch.arange(n)[None, :]
    dist = (i + n - Lq - j).abs().double()  # [Lq, n]
    bias = -torch.tensor(slopes.astype(np.float64))[:, None, None] * dist  # [Hq, Lq, n]
    if causal:
        bias = bias.masked_fill(j > i + n - Lq, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias[None]
                                                           .to(dtype), enable_gqa=True)
    return out[0].transpose(0, 1).double().numpy()  # [Lq, Hq, D]


@pytest.mark.parametrize("Lq,dtype,splits,causal", [(1, "float16", 3, True),
                                                    (1, "float32", 1, False),
                                                    (4, "float16", 1, True)])
def test_alibi_matches_pytorch_sdpa_with_float_bias(Lq, dtype, splits, causal):
    """ALiBi ([B, Hq] slopes) against PyTorch SDPA given the bias as an explicit float mask,
    per row on its valid prefix (2x the same-precision SDPA's error against float64 SDPA)."""
    torch = pytest.importorskip("torch")
    B, Lc, Hq = 3, 40, 4
    q, kc, vc, kn, vn, seqlens = make_case(15, B, Lq, Lc, Hq, 2, 16, dtype,
                                           seqlens=[Lc - Lq, 0, 17])
    slopes = make_slopes("BH", B, Hq, seed=3)
    out, _, kc2, vc2, _ = run_kvcache(q, kc, vc, kn, vn, seqlens, causal=causal,
                                      num_splits=splits, slopes=slopes)
    k, v = expected_caches(kc, vc, kn, vn, seqlens)
    np.testing.assert_array_equal(kc2, k)
    np.testing.assert_array_equal(vc2, v)
    low = torch.float16 if dtype == "float16" else torch.float32
    for b in range(B):
        n = int(seqlens[b]) + Lq
        ref = _sdpa_alibi(q[b], k[b], v[b], n, slopes[b], causal, torch.float64)
        same = _sdpa_alibi(q[b], k[b], v[b], n, slopes[b], causal, low)
        assert_within_rule(f"out[{b}]", out[b], same, ref, factor=2, dtype=dtype,
                           accum_steps=n + 16 + 64, magnitude=float(np.abs(v[b, :n]).max()))


def test_docstring_names_every_parameter():
    import inspect
    doc = inspect.getdoc(pf.flash_attn_with_kvcache)
    params = inspect.signature(pf.flash_attn_with_kvcache).parameters
    assert not [p for p in params if not re.search(rf"\b{p}\b", doc)]


def test_benchmark_section_replaces_its_markers(tmp_path):
    """benchmarks/kvcache.py on a small cache: counts per fill, the section replaced in place."""
    from benchmarks import kvcache as bench
    out = tmp_path / "bench.md"
    out.write_text("# Title\n\nkept\n")
    argv = ["--cache-len", "512", "--fills", "0.25,1", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--batch", "1", "--markdown", str(out)]
    rows = bench.main(argv)
    bench.main(argv)  # a second run replaces the section, it does not append another
    text = out.read_text()
    assert text.startswith("# Title\n\nkept\n") and text.count(bench.BEGIN) == 1
    if pf.BACKEND == "emulator":
        by = {(r["fill"], r["graph"].split(" (")[0]): r for r in rows}
        naive = [r for r in rows if r["graph"] == "naive over the cache"]
        assert naive[0]["matmul_flops"] == naive[1]["matmul_flops"]  # whatever the fill
        loop = [r for k, r in by.items() if k[1] == "flash one loop, chunk 64"]
        assert loop[0]["matmul_flops"] < loop[1]["matmul_flops"]  # follows the fill
        auto = [r for k, r in by.items() if k[1] == "flash auto"]
        assert auto[0]["matmul_flops"] == naive[0]["matmul_flops"]  # the straight-line pass
        assert auto[0]["iterations"] == 0
