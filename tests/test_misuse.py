"""Issue 33's misuses by a new user: each answered with right numbers or a ``ValueError`` /
``TypeError`` when the graph is built, naming the argument as spelled, its value and what was
expected."""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import popxl

from attention_utils import build_only, zeros_variable


# -- rotary tables -----------------------------------------------------------------------------
@pytest.mark.parametrize("base, exc, fragment", [
    (0, ValueError, "base must be a finite number > 0 (the rotary frequency base, e.g. "
                    "10000.0; the frequencies base**(-2i / rotary_dim) are NaN or infinite "
                    "otherwise), got base=0.0"),
    (-10000.0, ValueError, "got base=-10000.0"),
    (float("nan"), ValueError, "got base=nan"),
    (float("inf"), ValueError, "got base=inf"),
    ("abc", TypeError, "base must be a real number (the rotary frequency base, e.g. 10000.0), "
                       "got base='abc' (str)"),
    (True, TypeError, "got base=True (bool)"),
])
def test_rotary_tables_refuses_bad_base(base, exc, fragment):
    with pytest.raises(exc) as err:
        pf.rotary_tables(8, 4, base=base)
    assert fragment in str(err.value)


@pytest.mark.parametrize("base", [500, np.float32(10000.0), np.array(2.5), 0.5])
def test_rotary_tables_any_positive_base(base):
    """Every finite positive base gives the RoPE formula's finite tables (float64 here)."""
    cos, sin = pf.rotary_tables(5, 6, base=base, dtype=np.float64)
    theta = np.outer(np.arange(5), float(base) ** (-np.arange(0, 6, 2) / 6))
    np.testing.assert_allclose(cos, np.cos(theta), rtol=0, atol=1e-15)
    np.testing.assert_allclose(sin, np.sin(theta), rtol=0, atol=1e-15)


# -- pf.autodiff ---------------------------------------------------------------------------------
@pytest.mark.parametrize("graph, fragment", [
    (None, "graph must be a popxl.Graph, got graph=None (NoneType)"),
    ("main", "graph must be a popxl.Graph, got graph='main' (str)"),
])
def test_autodiff_refuses_non_graph(graph, fragment):
    with pytest.raises(TypeError) as err:
        pf.autodiff(graph)
    assert fragment in str(err.value)


# -- pf.kvcache.explain validates as flash_attn_with_kvcache ---------------------------------
def _kv_call(batch, q_len, cache_len, *, q_heads, kv_heads=None, head_dim, dtype="float16",
             new_len=None, window=(-1, -1), **options):
    """Build ``flash_attn_with_kvcache`` with tensors of the explain arguments' sizes."""
    kv_heads = q_heads if kv_heads is None else kv_heads
    new_len = q_len if new_len is None else new_len

    def fn():
        q = zeros_variable((batch, q_len, q_heads, head_dim), dtype)
        kc, vc = (zeros_variable((batch, cache_len, kv_heads, head_dim), dtype)
                  for _ in range(2))
        k, v = (zeros_variable((batch, new_len, kv_heads, head_dim), dtype)
                for _ in range(2)) if new_len else (None, None)
        return pf.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=0 if new_len else None,
                                          window_size=window, **options)
    return build_only(fn)


KV_SHAPE = dict(q_heads=8, kv_heads=8, head_dim=16)
KV_EXPLAIN_BAD = [
    # (positional sizes, options, exception, message fragment)
    ((1, 0, 64), {}, ValueError, "q_len must be >= 1, got q_len=0"),
    ((1, 1, 0), {}, ValueError, "cache_len must be >= 1, got cache_len=0"),
    ((0, 1, 64), {}, ValueError, "batch must be >= 1, got batch=0"),
    ((1, 1, 64), dict(head_dim=0), ValueError, "head_dim must be >= 1, got head_dim=0"),
    ((1, 1, 64), dict(num_splits=-2), ValueError,
     "num_splits must be in [0, 64], got num_splits=-2"),
    ((1, 1, 64), dict(num_splits=1000), ValueError,
     "num_splits must be in [0, 64], got num_splits=1000"),
    ((1, 1, 64), dict(dtype="int8"), TypeError,
     "dtype must be one of ('float16', 'float32') (a name, a NumPy or a PopXL dtype), got "
     "dtype='int8'"),
    ((1, 1, 64), dict(kv_heads=3), ValueError,
     "q's head count q_heads=8 must be a multiple of the caches' kv_heads=3"),
    ((1, 1, 64), dict(new_len=65), ValueError,
     "k has new_len=65 new rows, more than the cache holds (cache_len=64)"),
    ((1, 1, 64), dict(window=(-5, 0)), ValueError, "window=(-5, 0) has a side -5 < -1"),
    ((1, 1, 64), dict(softcap=-1.0), ValueError, "softcap must be in [0.0, "),
    ((1, 1, 64), dict(causal="yes"), TypeError, "causal must be a bool"),
    ((1, 1, 64), dict(alibi=1), TypeError, "alibi must be a bool"),
]


@pytest.mark.parametrize("sizes, options, exc, fragment", KV_EXPLAIN_BAD)
def test_kvcache_explain_refuses_what_the_call_refuses(sizes, options, exc, fragment):
    """The explain names its own argument; the call, built at the same sizes, refuses too
    (same exception type) -- except the sizes a tensor cannot have (0) or spell (dtype)."""
    with pytest.raises(exc) as err:
        pf.kvcache.explain(*sizes, **dict(KV_SHAPE, **options))
    assert fragment in str(err.value)
    call = dict(KV_SHAPE, **options)
    if 0 in sizes or call["head_dim"] == 0 or call.get("dtype") == "int8" or "alibi" in call:
        return  # no tensor of that shape or dtype; alibi is a tensor in the call
    with pytest.raises(exc):
        _kv_call(*sizes, **call)


@pytest.mark.parametrize("dtype", ["float32", np.float32, np.dtype("float32"), popxl.float32])
def test_kvcache_explain_takes_dtype_spellings(dtype):
    """A NumPy or PopXL dtype explains the same call as its name."""
    want = pf.kvcache.explain(2, 1, 256, **KV_SHAPE, dtype="float32")
    got = pf.kvcache.explain(2, 1, 256, **KV_SHAPE, dtype=dtype)
    assert got == want


# -- pf.explain validates as the call it explains --------------------------------------------
EXPLAIN_BAD = [
    (dict(max_seqlen=(8,)), ValueError,
     "max_seqlen must be an int or a (max_seqlen_q, max_seqlen_k) pair, got max_seqlen=(8,)"),
    (dict(max_seqlen=(8, 0)), ValueError, "max_seqlen_k must be >= 1, got max_seqlen_k=0"),
    (dict(score_mod=3), TypeError, "score_mod must be a callable score_mod(score, g, q_idx, "
                                   "kv_idx, *inputs) or None, got score_mod=3 (int)"),
    (dict(score_mod_inputs=(popxl.TensorSpec((2,), popxl.float32),)), ValueError,
     "score_mod_inputs given (1 tensors) without a score_mod"),
    (dict(score_mod_inputs=3), TypeError, "score_mod_inputs must be a tuple of popxl.TensorSpec"),
    (dict(segment_ids="yes"), TypeError,
     "segment_ids must be a bool (Python or NumPy), got segment_ids='yes' (str)"),
    (dict(dtype="int8"), TypeError, "dtype must be one of ('float16', 'float32')"),
    (dict(dtype=np.int32), TypeError, "dtype must be one of ('float16', 'float32')"),
    (dict(groups=4, kv_groups=3), ValueError, "kv_groups must divide groups=4, got kv_groups=3"),
    (dict(head_dim=0), ValueError, "head_dim must be >= 1, got head_dim=0"),
    (dict(Lq=0), ValueError, "Lq must be >= 1, got Lq=0"),
    (dict(segment_ids=True, score_mod=lambda s, g, q, k: s), ValueError,
     "score_mod with segment_ids or max_seqlen"),
]


@pytest.mark.parametrize("options, exc, fragment", EXPLAIN_BAD)
def test_explain_refuses_with_the_calls_checks(options, exc, fragment):
    args = dict(dict(Lq=64, Lkv=64, head_dim=16), **options)
    with pytest.raises(exc) as err:
        pf.explain(args.pop("Lq"), args.pop("Lkv"), **args)
    assert fragment in str(err.value)


def test_call_refuses_what_explain_refuses():
    """The calls raise the same type for the score_mod cases pf.explain refuses."""
    def call(**options):
        def fn():
            q, k, v = (zeros_variable((2, 8, 4)) for _ in range(3))
            extra = dict(score_mod_inputs=(zeros_variable((2,)),)) if options.pop("inputs") \
                else {}
            return pf.flash_attention(q, k, v, **options, **extra)
        return build_only(fn)
    with pytest.raises(TypeError, match=r"got score_mod=3 \(int\)"):
        call(score_mod=3, inputs=False)
    with pytest.raises(ValueError, match="without a score_mod"):
        call(inputs=True)


@pytest.mark.parametrize("dtype", [np.float16, np.dtype("float16"), popxl.float16])
def test_explain_takes_dtype_spellings(dtype):
    want = pf.explain(256, 512, head_dim=32, groups=4, dtype="float16")
    got = pf.explain(256, 512, head_dim=32, groups=4, dtype=dtype)
    assert got.chosen == want.chosen and got.candidates == want.candidates


# -- varlen ALiBi slopes -----------------------------------------------------------------------
@pytest.mark.parametrize("slopes", [(3, 2), (2, 2), (2,)])
def test_varlen_slopes_message_has_no_batch(slopes):
    """Packed sequences have no B: the message offers [Hq] or [1, Hq]."""
    def fn():
        q, k, v = (zeros_variable((10, 4, 8)) for _ in range(3))
        cu = [zeros_variable((4,), np.int32) for _ in range(2)]
        return pf.flash_attn_varlen_func(q, k, v, *cu, 5, 5,
                                         alibi_slopes=zeros_variable(slopes))
    with pytest.raises(ValueError) as err:
        build_only(fn)
    msg = str(err.value)
    assert msg.startswith("alibi_slopes must be float32 [Hq=4] or [1, Hq=4] (packed sequences "
                          "have no batch axis")
    assert f"got {slopes} float32" in msg and "B=" not in msg
