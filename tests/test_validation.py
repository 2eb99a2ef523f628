"""Bad input raises ValueError/TypeError at graph-build time, naming the argument."""
import re

import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import popxl

from attention_utils import build_only as build, zeros_variable as _tensor


GOOD = dict(q=(2, 8, 4), k=(2, 6, 4), v=(2, 6, 4))

BAD_FORWARD = [
    # (description, shapes/dtypes override, options, exception, message fragment)
    ("q rank", dict(q=(8, 4)), {}, ValueError, "q must have rank 3"),
    ("k rank", dict(k=(2, 6, 4, 1)), {}, ValueError, "k must have rank 3"),
    ("Gk not dividing G", dict(k=(3, 6, 4), v=(3, 6, 4)), {}, ValueError,
     "k must have a group count Gk that divides q's G=2 (Gk = G for multi-head attention; "
     "Gk < G is grouped-query attention, q group g reading kv group g // (G // Gk)), got k "
     "shape (3, 6, 4) for q shape (2, 8, 4)"),
    ("Gk > G", dict(k=(4, 6, 4), v=(4, 6, 4)), {}, ValueError,
     "k must have a group count Gk that divides q's G=2"),
    ("v groups differ from k", dict(k=(1, 6, 4)), {}, ValueError,
     "v must have the shape of k (1, 6, 4), got v shape (2, 6, 4)"),
    ("D mismatch", dict(k=(2, 6, 5), v=(2, 6, 5)), {}, ValueError,
     "k must have q's head dim D=4 ([Gk, Lkv, D=4] to match q (2, 8, 4)), got k shape "
     "(2, 6, 5)"),
    ("v mismatch", dict(v=(2, 7, 4)), {}, ValueError, "v must have the shape of k"),
    ("int dtype", dict(dtype=np.int32), {}, TypeError, "expected one of ('float16', 'float32')"),
    ("chunks 0", {}, dict(num_chunks_q=0), ValueError, "num_chunks_q must be in [1, 8]"),
    ("chunks > L", {}, dict(num_chunks_kv=7), ValueError, "num_chunks_kv=7"),
    ("chunks float", {}, dict(num_chunks_q=2.0), TypeError, "num_chunks_q must be an int"),
    ("chunks bool", {}, dict(num_chunks_q=True), TypeError, "num_chunks_q must be an int"),
    ("causal int", {}, dict(causal=1), TypeError, "causal must be a bool"),
    ("scale str", {}, dict(scale="0.5"), TypeError, "scale must be a real number"),
    ("scale nan", {}, dict(scale=float("nan")), ValueError, "scale must be finite in float32"),
    ("window < -1", {}, dict(window=(-2, -3)), ValueError, "window=(-2, -3) has a side -2 < -1"),
    ("window right < -1", {}, dict(window=(1, -2)), ValueError, "has a side -2 < -1"),
    ("window triple", {}, dict(window=(1, 2, 3)), ValueError, "window=(1, 2, 3) has 3 entries"),
    ("window int", {}, dict(window=3), TypeError, "window=3 must be None or a (left, right)"),
    ("window float", {}, dict(window=(1.5, 2)), TypeError, "has a non-int side 1.5"),
    ("window dict", {}, dict(window={0: 1, 1: 2}), TypeError, "window={0: 1, 1: 2} must be"),
    ("window set", {}, dict(window={1, 2}), TypeError, "window={1, 2} must be"),
    ("scale inf", {}, dict(scale=float("inf")), ValueError, "scale must be finite in float32"),
    ("scale > f32", {}, dict(scale=1e39), ValueError, "scale must be finite in float32"),
    ("scale > f64", {}, dict(scale=10 ** 400), ValueError, "scale must be finite in float32"),
    ("return_lse", {}, dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
]


@pytest.mark.parametrize("desc,override,options,exc,fragment", BAD_FORWARD,
                         ids=[case[0] for case in BAD_FORWARD])
def test_flash_attention_rejects(desc, override, options, exc, fragment):
    shapes = {**GOOD, **{n: s for n, s in override.items() if n != "dtype"}}
    dtype = override.get("dtype", np.float32)

    def fn():
        q, k, v = (_tensor(shapes[n], dtype) for n in "qkv")
        pf.flash_attention(q, k, v, **options)
    with pytest.raises(exc, match=re.escape(fragment)):
        build(fn)


def test_non_tensor_input():
    with pytest.raises(TypeError, match="q must be a popxl.Tensor"):
        build(lambda: pf.flash_attention(np.zeros((1, 2, 2)), _tensor((1, 2, 2)),
                                         _tensor((1, 2, 2))))


def test_mixed_dtypes():
    with pytest.raises(TypeError, match="share one dtype"):
        build(lambda: pf.flash_attention(_tensor((1, 4, 2), np.float16), _tensor((1, 4, 2)),
                                         _tensor((1, 4, 2))))


def test_packed_requires_three():
    with pytest.raises(ValueError, match=r"qkv.shape\[0\]=2"):
        build(lambda: pf.flash_attention_qkv_packed(_tensor((2, 1, 4, 2))))
    with pytest.raises(ValueError, match="qkv must have rank 4"):
        build(lambda: pf.flash_attention_qkv_packed(_tensor((3, 4, 2))))


def test_grad_requires_out_and_lse_together():
    def fn():
        q = _tensor((1, 4, 2))
        pf.flash_attention_grad(q, q, q, q, out=q, lse=None)
    with pytest.raises(ValueError, match="out and lse must be given together"):
        build(fn)


def test_grad_checks_specs():
    def bad_dout():
        q = _tensor((1, 4, 2))
        pf.flash_attention_grad(_tensor((1, 5, 2)), q, q, q)

    def bad_lse():
        q = _tensor((1, 4, 2))
        pf.flash_attention_grad(q, q, q, q, out=q, lse=_tensor((1, 5)))
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 4, 2\)"):
        build(bad_dout)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 4\) and dtype float32"):
        build(bad_lse)


def test_grad_checks_grouped_query_specs():
    """With Gk < G, dout/out/lse follow q (G groups) and k/v keep Gk groups."""
    def bad_dout():
        q, kv = _tensor((4, 4, 2)), _tensor((2, 3, 2))
        pf.flash_attention_grad(_tensor((2, 4, 2)), q, kv, kv)

    def bad_kv():
        q, kv = _tensor((4, 4, 2)), _tensor((3, 3, 2))
        pf.flash_attention_grad(q, q, kv, kv)
    with pytest.raises(ValueError, match=r"dout must have shape \(4, 4, 2\)"):
        build(bad_dout)
    with pytest.raises(ValueError, match="k must have a group count Gk that divides q's G=4"):
        build(bad_kv)



# --------------------------------------------------------------------------------------------
# Friendlier edges: other APIs' keywords, [B, L, H, D] tensors, foreign tensors, NumPy values


@pytest.mark.parametrize("fn", [pf.flash_attention, pf.flash_attention_qkv_packed,
                                pf.flash_attention_grad, pf.flash_attention_qkv_packed_grad],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("keyword,hint", [
    ("softmax_scale", "this API calls it scale= (pf.flash_attn_func takes flash-attn's names"),
    ("window_size", "this API calls it window= (pf.flash_attn_func"),
    ("is_causal", "this API calls it causal="),
    ("attn_mask", "mask tensors are not supported"),
    ("dropout_p", "this API calls it dropout= (with seed="),
])
def test_other_apis_keywords_point_to_ours(fn, keyword, hint):
    def call():
        q = _tensor((1, 4, 2))
        args = {"flash_attention": (q, q, q), "flash_attention_grad": (q, q, q, q)}.get(
            fn.__name__, (_tensor((3, 1, 4, 2)),) * (2 if "grad" in fn.__name__ else 1))
        fn(*args, **{keyword: 1})
    expected = f"{fn.__name__}() got an unexpected keyword argument '{keyword}': {hint}"
    with pytest.raises(TypeError, match=re.escape(expected)):
        build(call)


def test_unknown_keyword_is_pythons_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'scael'"):
        build(lambda: pf.flash_attention(*(_tensor((1, 4, 2)),) * 3, scael=1.0))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_rank4_points_to_flash_attn_func(name):
    shapes = dict(q=(2, 8, 4), k=(2, 8, 4), v=(2, 8, 4))
    shapes[name] = (1, 8, 2, 4)
    with pytest.raises(ValueError, match=re.escape(
            f"{name} must have rank 3 [G, L, D] (G = batch x heads), got shape (1, 8, 2, 4); "
            "for [B, L, H, D] tensors use pf.flash_attn_func")):
        build(lambda: pf.flash_attention(*(_tensor(shapes[n]) for n in "qkv")))


def test_rank4_grad_points_to_flash_attn_func():
    q = (1, 8, 2, 4)
    with pytest.raises(ValueError, match="dout must have rank 3 .* use pf.flash_attn_func"):
        build(lambda: pf.flash_attention_grad(*(_tensor(q) for _ in range(4))))


def _count_graphs(ir):
    return len(ir.main_graph.called_graphs)


@pytest.mark.parametrize("fn,position,foreign_shape", [
    (lambda t, o: pf.flash_attention(o, t, t), "q", (1, 4, 2)),
    (lambda t, o: pf.flash_attention(t, t, o), "v", (1, 4, 2)),
    (lambda t, o: pf.flash_attention_grad(t, t, o, t), "k", (1, 4, 2)),
    (lambda t, o: pf.flash_attention_grad(t, t, t, t, out=t, lse=o), "lse", (1, 4)),
    (lambda t, o: pf.flash_attention_qkv_packed(o), "qkv", (3, 1, 4, 2)),
    (lambda t, o: pf.flash_attn_func(*(t.reshape((1, 4, 1, 2)),) * 2, o), "v", (1, 4, 1, 2)),
], ids=["fwd-q", "fwd-v", "grad-k", "grad-lse", "packed", "flash_attn_func-v"])
def test_tensor_of_another_ir_fails_early(fn, position, foreign_shape):
    """A tensor of another Ir: a ValueError naming the argument before any graph is built."""
    other_ir = popxl.Ir()
    with other_ir.main_graph:
        other = popxl.variable(np.zeros(foreign_shape, np.float32), name="foreign")
    ir = popxl.Ir()
    with ir.main_graph:
        t = _tensor((1, 4, 2))
        with pytest.raises(ValueError, match=re.escape(
                f"{position} (foreign) belongs to another popxl.Ir than the current graph")):
            fn(t, other)
    assert _count_graphs(ir) == 0 and _count_graphs(other_ir) == 0


def test_parent_tensor_in_subgraph_fails_early():
    """Using a main-graph tensor inside a traced subgraph: named, before any graph is built."""
    ir = popxl.Ir()
    with ir.main_graph:
        outer = popxl.variable(np.zeros((1, 4, 2), np.float32), name="outer")

        def body(q):
            return pf.flash_attention(q, outer, q)
        with pytest.raises(ValueError, match=re.escape(
                "k (outer) is not a tensor of the current graph")):
            ir.create_graph(body, outer)
    assert _count_graphs(ir) == 0


NUMPY_ACCEPTED = [
    dict(causal=np.True_), dict(causal=np.array(False)), dict(return_lse=np.False_),
    dict(num_chunks_q=np.int64(2)), dict(num_chunks_kv=np.array(3, dtype=np.int32)),
    dict(scale=np.float16(0.5)), dict(scale=np.array(0.25)), dict(scale=np.int32(1)),
    dict(window=np.array([2, 0])), dict(window=(np.int64(2), None)),
    dict(window=[np.array(1), -1]),
]


@pytest.mark.parametrize("options", NUMPY_ACCEPTED, ids=lambda o: repr(o))
def test_numpy_values_accepted_like_python_ones(options):
    """NumPy scalars, 0-d arrays and a 1-D window array stand for the Python value: the
    validated configuration is the one the Python value gives."""
    python = {k: (v.tolist() if isinstance(v, np.ndarray) else
                  type(v)(x.item() if isinstance(x, np.generic) or isinstance(x, np.ndarray)
                          else x for x in v) if isinstance(v, (tuple, list)) else v.item())
              for k, v in options.items()}
    shapes = ((2, 8, 4), (2, 6, 4), (2, 6, 4))
    core = {k: v for k, v in options.items() if k != "return_lse"}
    core_py = {k: v for k, v in python.items() if k != "return_lse"}
    cfg = pf.AttentionConfig.from_shapes(*shapes, ("float32",) * 3, **core)
    assert cfg == pf.AttentionConfig.from_shapes(*shapes, ("float32",) * 3, **core_py)
    assert all(type(x) in (bool, int, float) for x in (cfg.causal, cfg.scale, *cfg.window))
    build(lambda: pf.flash_attention(*(_tensor(s) for s in shapes), **options))


NUMPY_REJECTED = [
    (dict(causal=np.int64(1)), TypeError,
     "causal must be a bool (Python or NumPy), got causal=1 (int64)"),
    (dict(causal=np.array([True])), TypeError, "causal must be a bool"),
    (dict(return_lse=np.array([True, False])), TypeError, "return_lse must be a bool"),
    (dict(num_chunks_q=np.float64(2.0)), TypeError, "num_chunks_q must be an int"),
    (dict(num_chunks_q=np.True_), TypeError, "num_chunks_q must be an int"),
    (dict(num_chunks_q=np.array([2])), TypeError, "num_chunks_q must be an int"),
    (dict(scale=np.array([0.5])), TypeError, "scale must be a real number"),
    (dict(scale=np.True_), TypeError, "scale must be a real number"),
    (dict(window=np.array([1.5, 0])), TypeError, "window=[1.5, 0.0] has a non-int side 1.5"),
    (dict(window=np.array([True, False])), TypeError, "has a non-int side True"),
    (dict(window=np.array([1, 2, 3])), ValueError, "window=[1, 2, 3] has 3 entries"),
    (dict(window=np.array(2)), TypeError, "window=2 must be None or a (left, right) pair"),
    (dict(window=np.array([[1, 2]])), ValueError, "has 1 entries"),
    (dict(window=np.array([-2, 0])), ValueError, "window=[-2, 0] has a side -2 < -1"),
]


@pytest.mark.parametrize("options,exc,fragment", NUMPY_REJECTED, ids=lambda o: repr(o))
def test_numpy_values_rejected_like_python_ones(options, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        build(lambda: pf.flash_attention(*(_tensor((2, 8, 4)) for _ in range(3)), **options))
