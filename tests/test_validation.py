"""Bad input raises ValueError/TypeError at graph-build time, naming the argument."""
import re

import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import popxl


def _tensor(shape, dtype=np.float32):
    return popxl.variable(np.zeros(shape, dtype))


def build(fn):
    """Run ``fn`` inside a fresh main graph (no session: errors must come at build time)."""
    ir = popxl.Ir()
    with ir.main_graph:
        return fn()


GOOD = dict(q=(2, 8, 4), k=(2, 6, 4), v=(2, 6, 4))

BAD_FORWARD = [
    # (description, shapes/dtypes override, options, exception, message fragment)
    ("q rank", dict(q=(8, 4)), {}, ValueError, "q must have rank 3"),
    ("k rank", dict(k=(2, 6, 4, 1)), {}, ValueError, "k must have rank 3"),
    ("G mismatch", dict(k=(3, 6, 4), v=(3, 6, 4)), {}, ValueError, "k must have shape [G=2"),
    ("D mismatch", dict(k=(2, 6, 5), v=(2, 6, 5)), {}, ValueError, "D=4"),
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

