"""Floating-point checks on the emulator (``pf.enable_floating_point_checks``).

The IPU's traps (invalid, divide-by-zero, overflow), read conservatively: arithmetic on an
infinite or NaN operand traps; ``where`` (data movement) does not; comparisons only on NaN;
an overflowing cast traps; ``init(..., "undef")`` alone does not.
"""
import numpy as np
import pytest

import popxl_flash as pf
from conftest import emulator_only, store
from popxl_flash import popxl

pytestmark = emulator_only

ops = popxl.ops
f32 = popxl.float32


def _run(build, *arrays, checks=True):
    """Main graph ``build(*loaded) -> tensor``; returns the stored result."""
    ir = popxl.Ir()
    with ir.main_graph:
        streams = [popxl.h2d_stream(a.shape, getattr(popxl, a.dtype.name)) for a in arrays]
        out = store(build(*[ops.host_load(s) for s in streams]))
    if checks:
        pf.enable_floating_point_checks(ir)
    with popxl.Session(ir, "ipu_model") as session:
        return session.run(dict(zip(streams, arrays)))[out]


X = np.array([1.0, 0.0, -2.0], np.float32)
BIG = np.array([1e30, 1.0, 2.0], np.float32)
INF = np.array([-np.inf, 1.0, 2.0], np.float32)


@pytest.mark.parametrize("name, build, x, kind", [
    ("overflow", lambda x: x * x, BIG, "mul"),
    ("log(0)", lambda x: ops.log(x), X, "log"),
    ("x/0", lambda x: popxl.constant(np.float32(1.0)) / x, X, "div"),
    ("exp overflow", lambda x: ops.exp(x), BIG, "exp"),
    ("inf - inf", lambda x: x - x, INF, "sub"),
    ("0 * inf", lambda x: x * popxl.constant(np.float32(0.0)), INF, "mul"),
    ("inf operand", lambda x: x + 1.0, INF, "add"),
    ("matmul inf", lambda x: ops.matmul(x.reshape((1, 3)), x.reshape((3, 1))), INF, "matmul"),
    ("cast overflow", lambda x: ops.cast(x * 1e-25, popxl.float16), BIG, "cast"),
])
def test_trapping_ops_raise_naming_the_op(name, build, x, kind):
    with pytest.raises(FloatingPointError, match=f"op {kind} of graph main"):
        _run(build, x)
    _run(build, x, checks=False)  # without the checks the same graph runs


def test_nan_comparison_traps_in_the_comparison():
    nan = np.array([np.nan, 1.0, 2.0], np.float32)
    with pytest.raises(FloatingPointError, match="op greater"):
        _run(lambda x: ops.greater(x, popxl.constant(np.float32(0.0))), nan)


def test_select_of_constant_minus_inf_and_comparison_with_inf_are_clean():
    def build(x):
        keep = ops.greater(x, popxl.constant(np.float32(-np.inf)))  # inf in a comparison: ok
        return ops.where(keep, x, popxl.constant(np.float32(-np.inf)))  # select: no trap
    np.testing.assert_array_equal(_run(build, INF), INF)


def test_undef_init_alone_does_not_trap():
    def build(x):
        junk = ops.init((3,), f32, init_type="undef")
        return ops.dynamic_update(junk, popxl.constant(np.array([0], np.int32)), x, axes=[0],
                                  sizes=[3], no_overlap=True) + 1.0
    np.testing.assert_array_equal(_run(build, X), X + 1)


def test_checks_apply_inside_subgraphs_and_name_them():
    def build(x):
        g = popxl.gir().create_graph(lambda a: ops.log(a), x)
        return ops.call(g, x)[0]
    with pytest.raises(FloatingPointError, match="op log of graph"):
        _run(build, X)


def test_enable_floating_point_checks_sets_the_session_option():
    ir = popxl.Ir()
    assert ir._pb_ir.getSessionOptions().enableFloatingPointChecks is False
    assert pf.enable_floating_point_checks(ir) is ir
    assert ir._pb_ir.getSessionOptions().enableFloatingPointChecks is True
    with pytest.raises(TypeError, match="popxl.Ir"):
        pf.enable_floating_point_checks("ir")
