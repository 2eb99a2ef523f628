"""ops.gelu / ops.layer_norm / ops.group_norm: PopART semantics (reference section 5).

gelu is popnn's tanh approximation; group_norm treats axis 0 as the batch and axis 1 as the
channels and normalises each (batch row, channel group) over its channels and every further
axis with the biased variance; layer_norm is group_norm with one group. float32 results are held
to 16 eps32 times the output magnitude (at most 8 here) against the float64 formula (a handful of
roundings per element, and sums of at most 24 terms); float16 ones to 2 float16 ulps.
"""
import numpy as np
import pytest

from conftest import IR_ERRORS, run_fn
from popxl_flash import popxl

ops = popxl.ops
EPS32 = float(np.finfo(np.float32).eps)


def gelu64(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def group_norm64(x, w, b, groups, eps=1e-5):
    n, c = x.shape[:2]
    g = x.reshape(n * groups, -1)
    y = (g - g.mean(1, keepdims=True)) / np.sqrt(g.var(1, keepdims=True) + eps)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return y.reshape(x.shape) * w.reshape(shape) + b.reshape(shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gelu_is_the_tanh_approximation(dtype):
    x = np.linspace(-6, 6, 49).astype(dtype)
    out = run_fn(ops.gelu, x)
    ref = gelu64(x.astype(np.float64))
    tol = 16 * EPS32 if dtype == np.float32 else 2 * float(np.finfo(np.float16).eps)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


def test_layer_norm_normalises_rows_of_a_2d_input():
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((5, 24), (24,), (24,)))
    out = run_fn(ops.layer_norm, x, w, b)
    np.testing.assert_allclose(out, group_norm64(x, w, b, 1), rtol=0, atol=16 * EPS32 * 8)


def test_group_norm_groups_channels_and_trailing_axes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    w, b = (rng.standard_normal(4).astype(np.float32) for _ in range(2))
    out = run_fn(lambda t, u, v: ops.group_norm(t, u, v, num_groups=2, eps=1e-3), x, w, b)
    np.testing.assert_allclose(out, group_norm64(x, w, b, 2, eps=1e-3), rtol=0,
                               atol=16 * EPS32 * 8)


@pytest.mark.parametrize("shapes", [((4,), (4,), (4,)),          # rank 1: no channel axis
                                    ((3, 4), (3,), (4,)),        # weight not per channel
                                    ((3, 4), (4,), (2,))])       # bias not per channel
def test_layer_norm_shape_errors(shapes):
    """``GroupNormOp::setup`` checks none of these (``willow/src/op/groupnorm.cpp``): the
    op builds and the Session (PopLibs' lowering) refuses it."""
    ir = popxl.Ir()
    with ir.main_graph:
        ts = [popxl.constant(np.ones(s, np.float32)) for s in shapes]
        ops.layer_norm(*ts)
    with pytest.raises(IR_ERRORS):
        popxl.Session(ir)


def test_group_norm_groups_must_divide_channels():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones((2, 3), np.float32))
        w = popxl.constant(np.ones(3, np.float32))
        ops.group_norm(x, w, w, num_groups=2)
    with pytest.raises(IR_ERRORS):
        popxl.Session(ir)


def test_group_norm_of_a_scalar_is_an_ir_error():
    """setup reads ``dim(0)``: "Invalid input dimension 0, tensor of rank 0"."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.float32(1))
        with pytest.raises(IR_ERRORS):
            ops.group_norm(x, x, x, num_groups=1)
