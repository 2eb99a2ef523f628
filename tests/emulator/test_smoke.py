"""Smoke tests of the PopXL emulator: a few end-to-end programs and exact run-profile numbers."""
import numpy as np
import pytest

import popxl_flash

if popxl_flash.BACKEND != "emulator":
    pytest.skip("emulator smoke tests", allow_module_level=True)

from popxl_flash.emulator import count_ops, popxl  # noqa: E402

ops = popxl.ops


def _store(t, name):
    s = popxl.d2h_stream(t.shape, t.dtype, name)
    ops.host_store(s, t)
    return s


def test_h2d_matmul_d2h():
    ir = popxl.Ir()
    with ir.main_graph:
        x_s = popxl.h2d_stream((2, 3), popxl.float16, "x")
        w = popxl.variable(np.arange(12, dtype=np.float16).reshape(3, 4), name="w")
        y = ops.matmul(ops.host_load(x_s), w, output_type=popxl.float32)
        y_s = _store(y, "y")
    x = np.linspace(-1, 1, 6, dtype=np.float16).reshape(2, 3)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({x_s: x})
    expected = x.astype(np.float32) @ np.arange(12, dtype=np.float32).reshape(3, 4)
    assert out[y_s].dtype == np.float32
    np.testing.assert_allclose(out[y_s], expected, rtol=1e-6)
    assert session.profile.matmul_flops == 2 * 2 * 3 * 4


def test_repeat_with_counter_and_invariant_input():
    ir = popxl.Ir()
    with ir.main_graph:
        def body(i, acc, step):
            return ops.increment_mod(i, 1, 100), acc + step

        step = popxl.constant(np.full(2, 0.5, np.float32))
        g = ir.create_graph(body, popxl.TensorSpec((), popxl.int32),
                            popxl.TensorSpec((2,), popxl.float32), step)
        i, acc = ops.repeat(g, 7, popxl.constant(0), popxl.constant(np.zeros(2, np.float32)),
                            step)
        i_s, acc_s = _store(i, "i"), _store(acc, "acc")
    with popxl.Session(ir) as session:
        out = session.run()
    assert out[i_s] == 7
    np.testing.assert_array_equal(out[acc_s], np.full(2, 3.5, np.float32))
    assert session.profile.ops_executed == 3 + 7 * 2  # repeat + 2 stores + 7 x body


@pytest.mark.parametrize("flag, expected", [(True, 11.0), (False, -9.0)])
def test_conditional_picks_branch(flag, expected):
    ir = popxl.Ir()
    with ir.main_graph:
        c_s = popxl.h2d_stream((), popxl.bool, "c")
        x = popxl.constant(np.float32(1.0))
        then_g = ir.create_graph(lambda a: a + 10.0, x)
        else_g = ir.create_graph(lambda a: a - 10.0, x)
        (y,) = ops.conditional(ops.host_load(c_s), then_g, else_g, [x], [x])
        y_s = _store(y, "y")
    with popxl.Session(ir) as session:
        out = session.run({c_s: np.array(flag)})
    assert out[y_s] == expected


def test_profile_numbers_are_exact():
    ir = popxl.Ir()
    with ir.main_graph:
        x_s = popxl.h2d_stream((4,), popxl.float32, "x")
        w = popxl.variable(np.ones(4, np.float32), name="w")  # 16 B, live all run
        sub = ir.create_graph(lambda a: a * 2.0, popxl.TensorSpec((4,), popxl.float32))  # 4 B
        x = ops.host_load(x_s)  # +16
        (y,) = ops.call(sub, x * w)  # +16 (mul), frame: +16 copy, +16 out
        z = y + 1.0  # 4 B constant
        z_s = _store(z, "z")
    assert count_ops(ir.main_graph) == 5 and count_ops(ir) == 6
    with popxl.Session(ir) as session:
        out = session.run({x_s: np.arange(4, dtype=np.float32)})
    np.testing.assert_array_equal(out[z_s], np.arange(4, dtype=np.float32) * 2 + 1)
    prof = session.profile
    assert prof.ops_executed == 6
    assert prof.matmul_flops == 0
    assert prof.const_bytes == 16 + 4 + 4
    # base 24; x 16 + x*w 16 -> 56 (then x freed: 40). Call entry: x*w 16 + its copy 16 -> 56;
    # x*w is read for the last time by the call, so it is dead once copied in: in the frame,
    # copy 16 + a*2 16 -> 24 + 32 = 56. Peak 56 (the old whole-call liveness gave 72).
    assert prof.peak_live_bytes == 56
