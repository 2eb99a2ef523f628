"""Score modifiers: softcap, ALiBi and a user ``score_mod`` against the float64 reference,
forward and gradients, with FlashAttention's 2x/3x rule (``popxl_flash.checks.tolerance``).

Semantics (FlashAttention-2's, ``popxl_flash.graph.score_mods``): ``s = scale q k^T``, softcap, ALiBi
``-slope[g] |i + Lkv - Lq - j|``, score_mod, then the mask; lse is the logsumexp of the modified,
masked scores.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash import popxl

from attention_utils import build_only, random_qkv, run_graph, zeros_variable
from score_mod_utils import alibi_slopes, check_rule, run_modified

ops = popxl.ops

MASKS = [dict(causal=True, window=None), dict(causal=False, window=None),
         dict(causal=False, window=(5, 3)), dict(causal=True, window=(6, None))]
MASK_IDS = ["causal", "full", "window", "causal-window"]


def _case(seed, G=4, Gk=2, Lq=21, Lkv=30, D=16, dtype="float32"):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, G, Lq, Lkv, D, dtype, Gk)
    dout = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, dout


def _check(mask, dtype, extras, make, ref_mods, *, chunks=(3, 4), shape=(4, 2, 21, 30, 16),
           seed=0, scale=None):
    G, Gk, Lq, Lkv, D = shape
    q, k, v, dout = _case(seed, G, Gk, Lq, Lkv, D, dtype)
    options = dict(num_chunks_q=chunks[0], num_chunks_kv=chunks[1], scale=scale, **mask)
    out, lse, grads, _ = run_modified(q, k, v, dout, extras, make, options)
    check_rule(out, lse, grads, q, k, v, dout, options, dict(scale=scale, **mask, **ref_mods),
               dtype)
    return out, lse, grads


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap(mask, dtype):
    # scale 1: raw scores of size ~sqrt(D) = 4, so a cap of 2 bends most of them.
    _check(mask, dtype, [], lambda: dict(softcap=2.0), dict(softcap=2.0), scale=1.0)


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_alibi(mask, dtype):
    slopes = alibi_slopes(4)
    _check(mask, dtype, [slopes], lambda s: dict(alibi_slopes=s), dict(alibi_slopes=slopes))


@pytest.mark.parametrize("Lq,Lkv", [(30, 21), (21, 30), (17, 17)])
def test_softcap_and_alibi_unequal_lengths(Lq, Lkv):
    slopes = alibi_slopes(4)
    _check(dict(causal=True, window=None), "float32", [slopes],
           lambda s: dict(alibi_slopes=s, softcap=3.0),
           dict(alibi_slopes=slopes, softcap=3.0), shape=(4, 1, Lq, Lkv, 8))


def _alibi_mod(offset):
    """ALiBi written as a score_mod (slopes passed as ``[G, 1, 1]``)."""
    def mod(score, g, q_idx, kv_idx, neg_slopes):
        rel = ops.cast(q_idx - kv_idx, popxl.float32) + float(offset)
        return score + neg_slopes * ops.abs(rel)
    return mod


def test_alibi_as_score_mod_equals_the_builtin():
    Lq, Lkv = 21, 30
    slopes = alibi_slopes(4)
    mod = _alibi_mod(Lkv - Lq)
    neg = (-slopes).reshape(4, 1, 1)
    q, k, v, dout = _case(1)
    options = dict(num_chunks_q=3, num_chunks_kv=4, causal=True)
    builtin = run_modified(q, k, v, dout, [slopes], lambda s: dict(alibi_slopes=s), options)
    as_mod = run_modified(q, k, v, dout, [neg], lambda n: dict(score_mod=mod,
                                                               score_mod_inputs=(n,)), options)
    for a, b in zip((builtin[0], builtin[1], *builtin[2]), (as_mod[0], as_mod[1], *as_mod[2])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _table_mod(score, g, q_idx, kv_idx, table, offset):
    """A learned relative-position bias: ``table[q_idx - kv_idx + offset]`` (T5-style).
    ``zero_OOR``: the padded tail chunk's positions run past the table (results discarded)."""
    return score + ops.gather(table, q_idx - kv_idx + offset, zero_OOR=True)


@pytest.mark.parametrize("mask", MASKS[:3], ids=MASK_IDS[:3])
def test_relative_bias_table_via_score_mod_inputs(mask):
    Lq, Lkv = 21, 30
    rng = np.random.default_rng(5)
    table = rng.standard_normal(Lq + Lkv - 1).astype(np.float32)
    offset = np.array(Lkv - 1, np.int32)

    def ref_mod(s, g, qi, kj):
        return s + table[qi - kj + (Lkv - 1)]
    _check(mask, "float32", [table, offset],
           lambda t, o: dict(score_mod=_table_mod, score_mod_inputs=(t, o)),
           dict(score_mod=ref_mod, score_mod_grad=lambda s, g, qi, kj: np.ones_like(s)))


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_row_passes_offset_the_modifiers(mask):
    """One kv chunk, 3 q chunks: the forward's row passes slice each chunk's rows and the
    columns they see, so ALiBi's distances and a score_mod's positions must carry both
    offsets (grouped-query, float16, with softcap)."""
    slopes = alibi_slopes(4)
    _check(mask, "float16", [slopes], lambda s: dict(alibi_slopes=s, softcap=3.0),
           dict(alibi_slopes=slopes, softcap=3.0), chunks=(3, 1))
    Lq, Lkv = 21, 30
    table = np.random.default_rng(6).standard_normal(Lq + Lkv - 1).astype(np.float32)

    def ref_mod(s, g, qi, kj):
        return s + table[qi - kj + (Lkv - 1)]
    _check(mask, "float32", [table, np.array(Lkv - 1, np.int32)],
           lambda t, o: dict(score_mod=_table_mod, score_mod_inputs=(t, o)),
           dict(score_mod=ref_mod, score_mod_grad=lambda s, g, qi, kj: np.ones_like(s)),
           chunks=(3, 1))


def _temperature_mod(score, g, q_idx, kv_idx, temps):
    """Per-head temperature: ``score * temps[g]`` (``g`` picks the group's entry)."""
    return score * ops.gather(temps, g)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_per_head_temperature(dtype):
    temps = np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    t3 = temps.reshape(4, 1, 1)
    _check(dict(causal=True, window=None), dtype, [temps],
           lambda t: dict(score_mod=_temperature_mod, score_mod_inputs=(t,)),
           dict(score_mod=lambda s, g, qi, kj: s * t3,
                score_mod_grad=lambda s, g, qi, kj: np.broadcast_to(t3, s.shape)))


def test_score_mod_after_softcap_and_alibi():
    """Order: softcap, then ALiBi, then score_mod (the reference applies them in that order)."""
    slopes = alibi_slopes(4)

    def square_mod(score, g, q_idx, kv_idx):  # not linear: the order matters
        return score * score * 0.1 + score
    _check(dict(causal=False, window=None), "float32", [slopes],
           lambda s: dict(softcap=2.5, alibi_slopes=s, score_mod=square_mod),
           dict(softcap=2.5, alibi_slopes=slopes, score_mod=lambda s, g, qi, kj: 0.1 * s * s + s,
                score_mod_grad=lambda s, g, qi, kj: 0.2 * s + 1), scale=1.0)


def _packed(seed, lengths, G=2, D=8):
    rng = np.random.default_rng(seed)
    L = sum(lengths)
    ids = np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(lengths)])[None]
    q, k, v = random_qkv(rng, G, L, L, D, "float32")
    return q, k, v, rng.standard_normal(q.shape).astype(np.float32), ids


@pytest.mark.parametrize("modifier", ["softcap", "alibi", "score_mod"])
def test_packed_segments(modifier):
    """Segment ids without positions: positions are the packed row/column indices, which the
    causal mask compares too."""
    q, k, v, dout, ids = _packed(2, [7, 12, 5])
    slopes = alibi_slopes(2)
    make = {"softcap": lambda i, j, s: dict(softcap=1.5),
            "alibi": lambda i, j, s: dict(alibi_slopes=s),
            "score_mod": lambda i, j, s: dict(score_mod=_alibi_mod(0),
                                              score_mod_inputs=(ops.negate(s).reshape((2, 1, 1)),))}
    ref = {"softcap": dict(softcap=1.5), "alibi": dict(alibi_slopes=slopes),
           "score_mod": dict(alibi_slopes=slopes)}

    def build(q, k, v, do, i, j, s):
        mods = make[modifier](i, j, s)
        seg = dict(q_segment_ids=i, kv_segment_ids=j)
        out, lse = pf.flash_attention(q, k, v, return_lse=True, num_chunks_q=4, num_chunks_kv=3,
                                      causal=True, **seg, **mods)
        return [out, lse, *pf.flash_attention_grad(do, q, k, v, out, lse, num_chunks_q=4,
                                                    num_chunks_kv=3, causal=True, **seg, **mods)]
    res, _ = run_graph(build, [q, k, v, dout, ids, ids, slopes], fp_checks=True)
    check_rule(res[0], res[1], res[2:], q, k, v, dout, dict(num_chunks_q=4, num_chunks_kv=3),
               dict(causal=True, scale=None, window=None, q_segment_ids=ids, kv_segment_ids=ids,
                    **ref[modifier]), "float32")


def test_varlen_alibi_is_per_sequence():
    """flash_attn_varlen_func: ALiBi and score_mod positions are per sequence, bottom-right
    (``i + seqlen_k - seqlen_q - j``), as flash-attn's varlen ALiBi."""
    rng = np.random.default_rng(3)
    H, D = 2, 8
    cu_q, cu_k = np.array([0, 5, 14, 20], np.int32), np.array([0, 9, 15, 26], np.int32)
    q = rng.standard_normal((20, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((26, H, D)).astype(np.float32) for _ in range(2))
    slopes = alibi_slopes(H)

    def build(q, k, v, cq, ck, s):
        return [pf.flash_attn_varlen_func(q, k, v, cq, ck, 9, 11, causal=True, alibi_slopes=s,
                                          softcap=2.0)]
    (out,), _ = run_graph(build, [q, k, v, cu_q, cu_k, slopes], fp_checks=True)
    qg, kg, vg = (a.transpose(1, 0, 2).astype(np.float64) for a in (q, k, v))
    for s in range(3):
        rows, cols = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        ref, _ = pf.reference.attention(qg[:, rows], kg[:, cols], vg[:, cols], causal=True,
                                        alibi_slopes=slopes, softcap=2.0)
        np.testing.assert_allclose(out[rows].transpose(1, 0, 2), ref, atol=2e-6)


def test_flash_attn_func_alibi_per_batch_and_autodiff():
    """flash_attn_func with [B, H] slopes, gradients through pf.autodiff."""
    rng = np.random.default_rng(4)
    B, L, H, D = 2, 13, 2, 8
    q, k, v = (rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(3))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    slopes = np.array([[0.5, 0.25], [0.125, 1.0]], np.float32)

    def build(q, k, v, do, s):
        ir = popxl.gcg().ir
        spec = q.spec
        layer = ir.create_graph(
            lambda q, k, v, s: pf.flash_attn_func(q, k, v, causal=True, alibi_slopes=s,
                                                  softcap=4.0, num_chunks_q=2, num_chunks_kv=3),
            spec, spec, spec, s.spec)
        grad = pf.autodiff(layer, grads_required=layer.inputs[:3])
        info = ops.call_with_info(layer, q, k, v, s)
        out = info.outputs[0]
        grads = ops.call(grad.graph, do, inputs_dict=grad.inputs_dict(info))
        return [out, *grads]
    res, _ = run_graph(build, [q, k, v, dout, slopes], fp_checks=True)

    def groups(x):
        return x.transpose(0, 2, 1, 3).reshape(B * H, L, D)
    kw = dict(causal=True, alibi_slopes=slopes.reshape(-1), softcap=4.0)
    ref_out, _ = pf.reference.attention(groups(q), groups(k), groups(v), **kw)
    refs = pf.reference.attention_grad(groups(dout), groups(q), groups(k), groups(v), **kw)
    np.testing.assert_allclose(groups(res[0]), ref_out, atol=2e-6)
    for g, r in zip(res[1:], refs):
        np.testing.assert_allclose(groups(g), r, atol=1e-5)


# -- graphs: one set per (configuration, score_mod); nothing when off -----------------------------
def _forward_graph_count(make):
    ir = popxl.Ir()
    with ir.main_graph:
        q = zeros_variable((2, 16, 8))
        make(q)
    return len(getattr(ir, "_popxl_flash_graphs", {}))


def _mod_a(score, g, q_idx, kv_idx):
    return score * 0.5


def _mod_b(score, g, q_idx, kv_idx):
    return score * 0.5


def test_one_graph_per_score_mod():
    def same(q):
        for _ in range(2):
            pf.flash_attention(q, q, q, score_mod=_mod_a)
    def different(q):
        pf.flash_attention(q, q, q, score_mod=_mod_a)
        pf.flash_attention(q, q, q, score_mod=_mod_b)
    assert _forward_graph_count(same) == 1
    assert _forward_graph_count(different) == 2


def test_off_modifiers_build_todays_graphs():
    """softcap=0, dropout=0, no slopes, no score_mod: no modifiers in the configuration, so the
    graphs are the ones of a call without the keywords (same cache entry, same op counts)."""
    ir = popxl.Ir()
    with ir.main_graph:
        q = zeros_variable((2, 16, 8))
        pf.flash_attention(q, q, q, num_chunks_q=2)
        pf.flash_attention(q, q, q, num_chunks_q=2, softcap=0.0, dropout=0.0,
                           alibi_slopes=None, score_mod=None)
    graphs = ir._popxl_flash_graphs
    assert len(graphs) == 1
    (key,) = graphs
    assert key[1].mods is None


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,fragment", [
    (dict(softcap=-1.0), ValueError, "softcap must be in [0.0"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(score_mod=3), TypeError, "score_mod must be a callable"),
    (dict(score_mod_inputs=(None,)), TypeError, "score_mod_inputs[0] must be a popxl.Tensor"),
    (dict(dropout=0.5), ValueError, "dropout=0.5 needs seed="),
    (dict(dropout=1.0), ValueError, "dropout must be in [0.0, 1.0)"),
    (dict(return_dropout_mask=True), ValueError, "return_dropout_mask=True needs dropout > 0"),
])
def test_bad_modifier_arguments(kwargs, exc, fragment):
    def fn():
        q = zeros_variable((2, 8, 4))
        pf.flash_attention(q, q, q, **kwargs)
    with pytest.raises(exc, match=__import__("re").escape(fragment)):
        build_only(fn)


def test_bad_modifier_tensors():
    def slopes_shape():
        q = zeros_variable((2, 8, 4))
        pf.flash_attention(q, q, q, alibi_slopes=zeros_variable((3,)))
    def seed_dtype():
        q = zeros_variable((2, 8, 4))
        pf.flash_attention(q, q, q, dropout=0.1, seed=popxl.variable(np.zeros(2, np.int32)))
    def inputs_without_mod():
        q = zeros_variable((2, 8, 4))
        pf.flash_attention(q, q, q, score_mod_inputs=(q,))
    with pytest.raises(ValueError, match=r"alibi_slopes must be float32 \[G=2\]"):
        build_only(slopes_shape)
    with pytest.raises(ValueError, match=r"seed must be a uint32 \[2\] tensor"):
        build_only(seed_dtype)
    with pytest.raises(ValueError, match="score_mod_inputs given"):
        build_only(inputs_without_mod)


def test_score_mod_must_be_elementwise_and_differentiable():
    def wrong_shape(score, g, q_idx, kv_idx):
        return ops.sum(score, axis=-1, keepdims=True)

    def ignores_score(score, g, q_idx, kv_idx):
        return ops.cast(q_idx - kv_idx, popxl.float32) + ops.cast(g, popxl.float32)

    def run(mod):
        def fn():
            q = zeros_variable((2, 8, 4))
            out, lse = pf.flash_attention(q, q, q, return_lse=True, score_mod=mod)
            pf.flash_attention_grad(q, q, q, q, out, lse, score_mod=mod)
        build_only(fn)
    with pytest.raises(ValueError, match="score_mod must be elementwise in score"):
        run(wrong_shape)
    with pytest.raises(ValueError, match="score_mod has no gradient with respect to score"):
        run(ignores_score)


# -- property test: each feature over chunk sizes and masks -----------------------------------
@st.composite
def modifier_cases(draw):
    Lq, Lkv = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    return dict(Lq=Lq, Lkv=Lkv, nq=draw(st.integers(1, Lq)), nkv=draw(st.integers(1, Lkv)),
                causal=draw(st.booleans()),
                window=draw(st.sampled_from([None, (3, 2), (0, None)])),
                feature=draw(st.sampled_from(["softcap", "alibi", "score_mod"])),
                seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=30)  # each example builds and runs two graphs
@given(modifier_cases())
def test_modifiers_over_chunkings(case):
    slopes = alibi_slopes(2)
    t3 = np.array([0.7, 1.3], np.float32).reshape(2, 1, 1)
    make = {"softcap": lambda s, t: dict(softcap=1.5),
            "alibi": lambda s, t: dict(alibi_slopes=s),
            "score_mod": lambda s, t: dict(score_mod=_scaled, score_mod_inputs=(t,))}[
        case["feature"]]
    ref = {"softcap": dict(softcap=1.5), "alibi": dict(alibi_slopes=slopes),
           "score_mod": dict(score_mod=lambda s, g, qi, kj: s * t3,
                             score_mod_grad=lambda s, g, qi, kj: np.broadcast_to(t3, s.shape))}[
        case["feature"]]
    mask = dict(causal=case["causal"], window=case["window"])
    _check(mask, "float32", [slopes, t3], make, ref, chunks=(case["nq"], case["nkv"]),
           shape=(2, 1, case["Lq"], case["Lkv"], 4), seed=case["seed"], scale=1.0)


def _scaled(score, g, q_idx, kv_idx, t):
    return score * t


def test_explain_reports_score_mod_cost():
    """pf.explain counts the score_mod graph's ops (and its gradient's) at the chosen chunking;
    FLOPs are ops x G x the cells the steps run on."""
    def two_ops(score, g, q_idx, kv_idx, t):
        return score * t + 1.0
    spec = popxl.TensorSpec((4, 1, 1), popxl.float32)
    choice = pf.explain(256, 256, head_dim=32, groups=4, causal=False, num_chunks_q=4,
                        num_chunks_kv=4, score_mod=two_ops, score_mod_inputs=(spec,))
    cost = choice.score_mod
    assert cost.ops == 2 and cost.grad_ops >= 1
    assert cost.steps == 16 and cost.cells == 256 * 256
    assert cost.forward_flops == 2 * 4 * 256 * 256
    assert "score_mod: 2 ops/step" in choice.table()
    plain = pf.explain(256, 256, head_dim=32, groups=4, causal=False, num_chunks_q=4,
                       num_chunks_kv=4)
    assert not hasattr(plain, "score_mod")
    # a pass of one block calls it once, on the whole block
    one = pf.explain(256, 256, head_dim=32, groups=4, causal=True, num_chunks_q=1,
                     num_chunks_kv=1, score_mod=two_ops, score_mod_inputs=(spec,)).score_mod
    assert one.steps == 1 and one.cells == 256 * 256
    # inline groups of one step call it too: causal 2 x 2 is one full block and two diagonal
    # halves (3 groups of one step, none looped)
    two = pf.explain(256, 256, head_dim=32, groups=4, causal=True, num_chunks_q=2,
                     num_chunks_kv=2, score_mod=two_ops, score_mod_inputs=(spec,)).score_mod
    assert two.steps >= 3


@pytest.mark.skipif(pf.BACKEND != "emulator", reason="op counts are an emulator feature")
def test_cost_benchmark_counts():
    """benchmarks.modifiers: with every feature off nothing is added; softcap adds exactly its
    3 forward and 6 backward ops per whole block; matmul FLOPs are equal (checked inside)."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks import modifiers
    rows = modifiers.measure(modifiers.parse_args(["--seq-len", "32", "--head-dim", "4",
                                                   "--chunks", "2,4"]))
    by = {(r["mask"], r["feature"]): r for r in rows}
    assert by[("none", "none")]["extra_fwd"] == 0
    softcap = by[("none", "softcap")]
    assert (softcap["extra_fwd"], softcap["extra_bwd"]) == (pytest.approx(3), pytest.approx(6))
    assert all(r["extra_fwd"] > 0 and r["extra_bwd"] > 0 for r in rows if r["feature"] != "none")


@pytest.mark.parametrize("api", ["core", "flash_attn_func", "varlen"])
def test_score_mod_errors_leave_no_name_scope(api):
    """A bad score_mod raises before any name scope opens (PopXL's is not exception-safe)."""
    def bad(score, g, q_idx, kv_idx):
        return ops.sum(score, axis=-1, keepdims=True)

    def fn():
        if api == "core":
            q = zeros_variable((2, 8, 4))
            pf.flash_attention(q, q, q, score_mod=bad)
        elif api == "flash_attn_func":
            q = zeros_variable((1, 8, 2, 4))
            pf.flash_attn_func(q, q, q, score_mod=bad)
        else:
            q = zeros_variable((8, 2, 4))
            cu = popxl.variable(np.array([0, 8], np.int32))
            pf.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, score_mod=bad)
        return None
    with pytest.raises(ValueError, match="score_mod must be elementwise"):
        build_only(fn)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.zeros(2, np.float32), name="probe")
    assert t.id == "probe"


def test_packed_qkv_passes_modifiers():
    """flash_attention_qkv_packed(_grad) take the same modifiers and equal the unpacked call."""
    rng = np.random.default_rng(11)
    qkv = rng.standard_normal((3, 2, 12, 8)).astype(np.float32)
    dout = rng.standard_normal((2, 12, 8)).astype(np.float32)
    slopes = alibi_slopes(2)

    def build(qkv, do, s):
        mods = dict(softcap=2.0, alibi_slopes=s)
        out, lse = pf.flash_attention_qkv_packed(qkv, return_lse=True, num_chunks_q=3, **mods)
        dqkv = pf.flash_attention_qkv_packed_grad(do, qkv, out, lse, num_chunks_q=3, **mods)
        return [out, dqkv]
    (out, dqkv), _ = run_graph(build, [qkv, dout, slopes], fp_checks=True)
    kw = dict(causal=True, softcap=2.0, alibi_slopes=slopes)
    ref, _ = pf.reference.attention(*qkv, **kw)
    np.testing.assert_allclose(out, ref, atol=2e-6)
    np.testing.assert_allclose(dqkv, np.stack(pf.reference.attention_grad(dout, *qkv, **kw)),
                               atol=1e-5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dropout_rate'"):
        build_only(lambda: pf.flash_attention_qkv_packed(zeros_variable((3, 1, 4, 2)),
                                                         dropout_rate=0.1))


def test_score_mod_layer_through_autodiff_defaults():
    """A layer calling flash_attention with a score_mod and a float score_mod input,
    differentiated by pf.autodiff with its defaults: dq, dk, dv (no gradient for the input)."""
    q, k, v, dout = _case(12, Lq=11, Lkv=17, D=8)
    temps = np.array([0.5, 1.0, 1.5, 2.0], np.float32)

    def build(q, k, v, do, t):
        ir = popxl.gcg().ir
        layer = ir.create_graph(
            lambda q, k, v, t: pf.flash_attention(q, k, v, causal=False, score_mod=_temperature_mod,
                                                  score_mod_inputs=(t,)),
            q.spec, k.spec, v.spec, t.spec)
        grad = pf.autodiff(layer)
        info = ops.call_with_info(layer, q, k, v, t)
        return [info.outputs[0], *ops.call(grad.graph, do, inputs_dict=grad.inputs_dict(info))]
    res, _ = run_graph(build, [q, k, v, dout, temps], fp_checks=True)
    assert len(res) == 4
    t3 = temps.reshape(4, 1, 1)
    kw = dict(causal=False, score_mod=lambda s, g, qi, kj: s * t3,
              score_mod_grad=lambda s, g, qi, kj: np.broadcast_to(t3, s.shape))
    np.testing.assert_allclose(res[0], pf.reference.attention(q, k, v, **kw)[0], atol=2e-6)
    for g, r in zip(res[1:], pf.reference.attention_grad(dout, q, k, v, **kw)):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_modules_take_mods():
    """FlashAttention / FlashAttentionGrad with ``mods``: extras after the (absent) segment
    inputs, slopes then the score_mod inputs."""
    from popxl_flash.graph import score_mods
    q, k, v, dout = _case(13, Lq=10, Lkv=14, D=8)
    slopes, temps = alibi_slopes(4), np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    mods = score_mods.options(softcap=3.0, alibi=True, score_mod=_temperature_mod,
                              num_mod_inputs=1)

    def build(q, k, v, do, s, t):
        ir = popxl.gcg().ir
        fwd = ir.create_graph(pf.FlashAttention(num_chunks_q=2, causal=True, mods=mods),
                              q, k, v, s, t)
        out, lse = ops.call(fwd, q, k, v, s, t)
        bwd = ir.create_graph(pf.FlashAttentionGrad(num_chunks_q=2, causal=True, mods=mods),
                              do, q, k, v, out, lse, s, t)
        return [out, *ops.call(bwd, do, q, k, v, out, lse, s, t)]
    res, _ = run_graph(build, [q, k, v, dout, slopes, temps], fp_checks=True)
    t3 = temps.reshape(4, 1, 1)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=slopes, score_mod=lambda s, g, i, j: s * t3,
              score_mod_grad=lambda s, g, i, j: np.broadcast_to(t3, s.shape))
    np.testing.assert_allclose(res[0], pf.reference.attention(q, k, v, **kw)[0], atol=2e-6)
    for g, r in zip(res[1:], pf.reference.attention_grad(dout, q, k, v, **kw)):
        np.testing.assert_allclose(g, r, atol=1e-5)
