"""flash-attn's packed names (flash_attn_qkvpacked_func, flash_attn_kvpacked_func and their
varlen forms) and ``deterministic=``: the packed calls give the unpacked calls' results bit for
bit (dropout with a seed, GQA, varlen packings included); their gradients by ``pf.autodiff``
are the unpacked gradients stacked; build-time errors.
"""
import re

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import build_only, run_graph, zeros_variable
from popxl_flash import popxl

ops = popxl.ops


def _rng(seed):
    return np.random.default_rng(seed)


def test_qkvpacked_equals_flash_attn_func_with_dropout():
    B, L, H, D = 2, 24, 2, 8
    qkv = _rng(0).standard_normal((B, L, 3, H, D)).astype(np.float16)
    seed = np.array([7, 9], np.uint32)
    options = dict(causal=True, dropout_p=0.25, softcap=20.0, return_lse=True,
                   num_chunks_q=2, num_chunks_kv=2)

    def build(qkv, s):
        packed = pf.flash_attn_qkvpacked_func(qkv, seed=s, deterministic=True, **options)
        q, k, v = (ops.slice(qkv, start=[i], stop=[i + 1], axis=[2]).reshape((B, L, H, D))
                   for i in range(3))
        plain = pf.flash_attn_func(q, k, v, seed=s, **options)
        return [*packed, *plain]
    (out, lse, out2, lse2), _ = run_graph(build, [qkv, seed])
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)
    assert out.shape == (B, L, H, D) and lse.shape == (B, H, L)


def test_kvpacked_gqa_equals_flash_attn_func():
    B, Lq, Lkv, Hq, Hkv, D = 2, 5, 19, 4, 2, 8
    rng = _rng(1)
    q = rng.standard_normal((B, Lq, Hq, D)).astype(np.float32)
    kv = rng.standard_normal((B, Lkv, 2, Hkv, D)).astype(np.float32)

    def build(q, kv):
        k, v = (kv[:, :, i] for i in range(2))  # Tensor.__getitem__: slice + squeeze
        return [pf.flash_attn_kvpacked_func(q, kv, causal=True, deterministic=False),
                pf.flash_attn_func(q, k, v, causal=True)]
    (packed, plain), _ = run_graph(build, [q, kv])
    np.testing.assert_array_equal(packed, plain)
    ref, _ = pf.reference.attention(q[0, :, 0][None], kv[0, :, 0, 0][None],
                                    kv[0, :, 1, 0][None], causal=True)
    np.testing.assert_allclose(packed[0, :, 0], ref[0], rtol=1e-5, atol=1e-5)


def test_varlen_packed_equal_varlen_func():
    lens = [7, 0, 12]
    cu = np.cumsum([0] + lens).astype(np.int32)
    total, H, D = int(cu[-1]) + 3, 2, 8
    rng = _rng(2)
    qkv = rng.standard_normal((total, 3, H, D)).astype(np.float32)
    q = rng.standard_normal((total, 2 * H, D)).astype(np.float32)

    def build(qkv, q, cu):
        a, b, c = (qkv[:, i] for i in range(3))
        return [pf.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True,
                                                    deterministic=True),
                pf.flash_attn_varlen_func(a, b, c, cu, cu, max(lens), max(lens), causal=True),
                pf.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, max(lens), max(lens)),
                pf.flash_attn_varlen_func(q, b, c, cu, cu, max(lens), max(lens))]
    (p1, u1, p2, u2), _ = run_graph(build, [qkv, q, cu])
    np.testing.assert_array_equal(p1, u1)
    np.testing.assert_array_equal(p2, u2)
    assert (p1[cu[-1]:] == 0).all()


def test_qkvpacked_gradient_is_the_stacked_unpacked_gradient():
    """pf.autodiff through the unpacking slices: dqkv[:, :, i] is flash_attn_func's gradient of
    q, k, v (the same hand-written backward, so bit for bit)."""
    B, L, H, D = 1, 16, 2, 8
    rng = _rng(3)
    qkv = rng.standard_normal((B, L, 3, H, D)).astype(np.float32)
    dout = rng.standard_normal((B, L, H, D)).astype(np.float32)

    def grads_of(fn, inputs, do):
        graph = popxl.gcg().ir.create_graph(fn, *inputs)
        info = pf.autodiff(graph)
        call = ops.call_with_info(graph, *inputs)
        return ops.call(info.graph, do, inputs_dict=info.inputs_dict(call))

    def build(qkv, do):
        (dqkv,) = grads_of(lambda t: pf.flash_attn_qkvpacked_func(t, causal=True), [qkv], do)
        q, k, v = (qkv[:, :, i] for i in range(3))
        plain = grads_of(lambda q, k, v: pf.flash_attn_func(q, k, v, causal=True), [q, k, v],
                         do)
        return [dqkv, *plain]
    (dqkv, dq, dk, dv), _ = run_graph(build, [qkv, dout])
    for i, g in enumerate((dq, dk, dv)):
        np.testing.assert_array_equal(dqkv[:, :, i], g)
    assert np.abs(dk).max() > 0


BAD = [
    (lambda: pf.flash_attn_qkvpacked_func(zeros_variable((2, 4, 2, 2, 8))), ValueError,
     "qkv must have shape [B, L, 3, H, D] with non-empty dims (axis 2 of size 3), got shape "
     "(2, 4, 2, 2, 8)"),
    (lambda: pf.flash_attn_kvpacked_func(zeros_variable((2, 4, 2, 8)),
                                         zeros_variable((2, 4, 2, 8))), ValueError,
     "kv must have shape [B, Lkv, 2, Hkv, D]"),
    (lambda: pf.flash_attn_varlen_qkvpacked_func(zeros_variable((9, 2, 2, 8)),
                                                 zeros_variable((3,), np.int32), 4), ValueError,
     "qkv must have shape [total, 3, H, D]"),
    (lambda: pf.flash_attn_varlen_kvpacked_func(np.zeros((9, 2, 8)), None, None, None, 4, 4),
     TypeError, "kv must be a popxl.Tensor"),
    (lambda: pf.flash_attn_qkvpacked_func(zeros_variable((2, 4, 3, 2, 8)), layout="BHLD"),
     TypeError, "the packed tensors are flash-attn's"),
    (lambda: pf.flash_attn_qkvpacked_func(zeros_variable((2, 4, 3, 2, 8)), deterministic="y"),
     TypeError, "deterministic must be a bool"),
    (lambda: pf.flash_attn_func(*(zeros_variable((1, 4, 2, 8)) for _ in range(3)),
                                deterministic=None), TypeError, "deterministic must be a bool"),
    (lambda: pf.flash_attn_qkvpacked_func(zeros_variable((2, 4, 3, 2, 8)), scale=0.5),
     TypeError, "calls it softmax_scale="),
]


@pytest.mark.parametrize("fn, exc, fragment", BAD)
def test_bad_input_is_a_build_time_error(fn, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        build_only(fn)
