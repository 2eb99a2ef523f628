"""Argument checks of segment ids and flash_attn_varlen_func, at graph-build time."""
import re

import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import popxl

from attention_utils import build_only as build, zeros_variable as _tensor


def _core(q_ids=(1, 8), kv_ids=(1, 6), q_dtype=np.int32, kv_dtype=np.int32, **options):
    """flash_attention on q [2, 8, 4], k/v [2, 6, 4] with ids of the given shapes/dtypes."""
    def fn():
        q, k, v = _tensor((2, 8, 4)), _tensor((2, 6, 4)), _tensor((2, 6, 4))
        ids = dict(q_segment_ids=None if q_ids is None else _tensor(q_ids, q_dtype),
                   kv_segment_ids=None if kv_ids is None else _tensor(kv_ids, kv_dtype))
        return pf.flash_attention(q, k, v, **ids, **options)
    return build(fn)


BAD_IDS = [
    (dict(kv_ids=None), ValueError, "q_segment_ids and kv_segment_ids must be given together"),
    (dict(q_ids=None), ValueError, "q_segment_ids and kv_segment_ids must be given together"),
    (dict(q_dtype=np.float32), TypeError,
     "q_segment_ids must have dtype int32 [G=2 or 1, Lq=8], got dtype float32"),
    (dict(kv_dtype=np.uint32), TypeError, "kv_segment_ids must have dtype int32"),
    (dict(q_ids=(3, 8)), ValueError,
     "q_segment_ids must have shape [G=2 or 1, Lq=8], got shape (3, 8)"),
    (dict(kv_ids=(1, 8)), ValueError,
     "kv_segment_ids must have shape [Gk=2 or 1, Lkv=6], got shape (1, 8)"),
    (dict(q_ids=(8,)), ValueError, "q_segment_ids must have shape"),
]


@pytest.mark.parametrize("override, exc, fragment", BAD_IDS)
def test_segment_ids_rejected(override, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        _core(**override)


def test_segment_ids_accepted_per_group_or_shared():
    assert _core(q_ids=(2, 8), kv_ids=(1, 6)).shape == (2, 8, 4)


def test_segment_ids_must_be_tensors_of_this_graph():
    def not_tensor():
        q = _tensor((1, 4, 2))
        return pf.flash_attention(q, q, q, q_segment_ids=np.zeros((1, 4), np.int32),
                                  kv_segment_ids=np.zeros((1, 4), np.int32))
    with pytest.raises(TypeError, match="q_segment_ids must be a popxl.Tensor"):
        build(not_tensor)


def test_grad_and_packed_check_segment_ids():
    def grad():
        q = _tensor((1, 4, 2))
        return pf.flash_attention_grad(q, q, q, q, q_segment_ids=_tensor((1, 4), np.int32),
                                       kv_segment_ids=_tensor((1, 3), np.int32))
    with pytest.raises(ValueError, match=re.escape("kv_segment_ids must have shape [Gk=1 or 1, "
                                                   "Lkv=4], got shape (1, 3)")):
        build(grad)

    def packed():
        return pf.flash_attention_qkv_packed(_tensor((3, 1, 4, 2)),
                                             q_segment_ids=_tensor((1, 4), np.float32),
                                             kv_segment_ids=_tensor((1, 4), np.int32))
    with pytest.raises(TypeError, match="q_segment_ids must have dtype int32"):
        build(packed)


def _varlen(q=(10, 2, 4), k=(12, 2, 4), v=None, cu_q=(4,), cu_k=(4,), cu_dtype=np.int32,
            max_q=5, max_k=6, **options):
    def fn():
        tensors = [_tensor(s) for s in (q, k, v or k)]
        cus = [_tensor(s, cu_dtype) for s in (cu_q, cu_k)]
        return pf.flash_attn_varlen_func(*tensors, *cus, max_q, max_k, **options)
    return build(fn)


BAD_VARLEN = [
    (dict(q=(2, 10, 2, 4)), ValueError, "q must have rank 3 [total, H, D]"),
    (dict(k=(12, 2, 5)), ValueError, "k must have q's head dim D=4"),
    (dict(v=(11, 2, 4)), ValueError, "v must have the shape of k (12, 2, 4)"),
    (dict(q=(10, 3, 4)), ValueError, "Hq=3 must be a multiple of k/v's Hkv=2"),
    (dict(cu_dtype=np.float32), TypeError,
     "cu_seqlens_q must have dtype int32 [num_seqs + 1], got dtype float32"),
    (dict(cu_q=(1,), cu_k=(1,)), ValueError, "cu_seqlens_q must have shape [num_seqs + 1] with "
                                             "num_seqs >= 1, got shape (1,)"),
    (dict(cu_k=(5,)), ValueError, "cu_seqlens_q and cu_seqlens_k must have one shape"),
    (dict(max_q=0), ValueError, "max_seqlen_q must be >= 1, got max_seqlen_q=0"),
    (dict(max_k=2.0), TypeError, "max_seqlen_k must be an int"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window_size=(-2, 0)), ValueError, "window_size=(-2, 0) has a side -2 < -1"),
    (dict(softmax_scale="1"), TypeError, "softmax_scale must be a real number"),
    (dict(num_chunks_q=11), ValueError, "num_chunks_q must be in [1, 10]"),
    (dict(layout="BLHD"), TypeError, "varlen tensors are [total, H, D]"),
    (dict(scale=0.5), TypeError, "softmax_scale="),
    (dict(q_segment_ids=None), TypeError, "derives them from cu_seqlens_q/cu_seqlens_k"),
]


@pytest.mark.parametrize("override, exc, fragment", BAD_VARLEN)
def test_varlen_rejected(override, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        _varlen(**override)


def test_varlen_options_keyword_only():
    def fn():
        q = _tensor((4, 1, 2))
        cu = _tensor((2,), np.int32)
        return pf.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, 0.5)
    with pytest.raises(TypeError):
        build(fn)


def test_varlen_shapes_and_defaults():
    def fn():
        q, k = _tensor((10, 2, 4)), _tensor((12, 2, 4))
        cu = [_tensor((4,), np.int32) for _ in range(2)]
        out, lse = pf.flash_attn_varlen_func(q, k, k, *cu, 5, 6, return_lse=True)
        return out.shape, lse.shape, lse.dtype
    assert build(fn) == ((10, 2, 4), (2, 10), popxl.float32)


def test_core_hints_for_varlen_keywords():
    def fn():
        q = _tensor((1, 4, 2))
        return pf.flash_attention(q, q, q, cu_seqlens_q=None)
    with pytest.raises(TypeError, match="pf.flash_attn_varlen_func takes flash-attn's cu_seqlens"):
        build(fn)


def test_grad_refuses_stash_of_a_call_with_other_segment_ids():
    def fn(forward_ids, backward_ids):
        q = _tensor((1, 4, 2))
        ids = dict(q_segment_ids=_tensor((1, 4), np.int32),
                   kv_segment_ids=_tensor((1, 4), np.int32))
        out, lse = pf.flash_attention(q, q, q, return_lse=True, **(ids if forward_ids else {}))
        return pf.flash_attention_grad(q, q, q, q, out, lse, **(ids if backward_ids else {}))
    with pytest.raises(ValueError, match="produced by flash_attention with segment ids, but "
                                         "flash_attention_grad was called without them"):
        build(lambda: fn(True, False))
    with pytest.raises(ValueError, match="without segment ids, but flash_attention_grad was "
                                         "called with them"):
        build(lambda: fn(False, True))
    assert len(build(lambda: fn(True, True))) == 3


def test_segment_ids_choose_automatic_chunks_by_modelled_time():
    """With segment ids, automatic chunks are the packed choice (the least modelled forward +
    backward time within the budget, one sequence over the row assumed:
    ``popxl_flash.plan.packed.choose``), forward and backward alike; explicit counts are kept
    and only the automatic side is chosen."""
    from popxl_flash.plan import packed
    from popxl_flash.plan.segments import SegmentConfig
    spec = popxl.TensorSpec
    q = spec((2, 4096, 64), popxl.float16)
    ids = spec((1, 4096), popxl.int32)
    cfg = pf.FlashAttention(causal=True).config(q, q, q, ids, ids)
    choice = packed.choose(4096, 4096, head_dim=64, groups=2, dtype="float16", causal=True,
                           window=(-1, -1), segments=SegmentConfig(1, 1, False))
    assert (cfg.chunk_q, cfg.chunk_kv) == (choice.chosen.chunk_q, choice.chosen.chunk_kv)
    assert choice.chosen.seconds < choice.seed.seconds  # the earlier 64-row rule (modelled)
    grad = pf.FlashAttentionGrad(causal=True).config(q, q, q, q, q, spec((2, 4096), popxl.float32),
                                                     ids, ids)
    assert (grad.chunk_q, grad.chunk_kv) == (cfg.chunk_q, cfg.chunk_kv)
    explicit = pf.FlashAttention(causal=True, num_chunks_q=8).config(q, q, q, ids, ids)
    fixed = packed.choose(4096, 4096, head_dim=64, groups=2, dtype="float16", causal=True,
                          window=(-1, -1), segments=SegmentConfig(1, 1, False), chunk_q=512)
    assert (explicit.chunk_q, explicit.chunk_kv) == (512, fixed.chosen.chunk_kv)
    both = pf.FlashAttention(causal=True, num_chunks_q=64, num_chunks_kv=64).config(
        q, q, q, ids, ids)
    assert (both.chunk_q, both.chunk_kv) == (64, 64)
