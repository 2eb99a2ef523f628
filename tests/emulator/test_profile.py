"""Emulator run profile: ops_executed, matmul_flops, peak_live_bytes (emulator only).

Counting rules (from the emulator's contract): every executed op instance counts once per
execution; ops of a subgraph count per execution; the call/repeat/conditional op itself counts once
per execution; constants and variables are tensors, not ops; host_store is an op.
"""
import numpy as np
import pytest

from conftest import emulator_only, store
from popxl_flash import popxl

pytestmark = emulator_only

ops = popxl.ops
f32 = popxl.float32


def _profile(ir, inputs=None):
    with popxl.Session(ir, "ipu_model") as session:
        session.run(dict(inputs or {}))
        return session.profile


# --- ops_executed -------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 3, 5])
def test_ops_executed_repeat(count):
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(4, np.float32))
        k = popxl.constant(np.float32(2.0))
        g = ir.create_graph(lambda acc, kk: acc * kk + 1.0, v, k)  # 2 ops per iteration
        (y,) = ops.repeat(g, count, v, k)
        store(y)  # 1 op
    assert _profile(ir).ops_executed == 1 + 2 * count + 1


@pytest.mark.parametrize("cond, body_ops", [(True, 1), (False, 3)])
def test_ops_executed_conditional_counts_only_the_taken_branch(cond, body_ops):
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(4, np.float32))
        then_g = ir.create_graph(lambda a: a + 1.0, v)  # 1 op
        else_g = ir.create_graph(lambda a: ops.exp(a * 2.0 - 1.0), v)  # 3 ops
        (y,) = ops.conditional(popxl.constant(cond), then_g, else_g, then_inputs=[v], else_inputs=[v])
        store(y)
    assert _profile(ir).ops_executed == 1 + body_ops + 1


def test_ops_executed_nested_call_in_repeat_with_conditional():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(3, np.float32))
        flag = popxl.constant(np.array([False]))
        inner = ir.create_graph(lambda a: ops.negate(a), v)  # 1 op
        then_g = ir.create_graph(lambda a: a + 1.0, v)  # 1 op
        else_g = ir.create_graph(lambda a: a * 2.0 + 1.0, v)  # 2 ops

        def body(a, f):
            (b,) = ops.call(inner, a)  # 1 + 1
            (c,) = ops.conditional(f, then_g, else_g, then_inputs=[b], else_inputs=[b])  # 1 + 2
            return c

        g = ir.create_graph(body, v, flag)
        (y,) = ops.repeat(g, 4, v, flag)  # 1 + 4 * 5
        z = y * 3.0  # 1
        store(z)  # 1
    assert _profile(ir).ops_executed == 1 + 4 * 5 + 1 + 1


def test_loop_iterations_count_every_body_execution():
    """A repeat of 3 around a repeat of 4 executes the inner body 12 times: 3 + 12 iterations;
    a repeat of 0 adds none."""
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(2, np.float32))
        inner = ir.create_graph(lambda a: a + 1.0, v)
        outer = ir.create_graph(lambda a: ops.repeat(inner, 4, a)[0] * 2.0, v)
        (y,) = ops.repeat(outer, 3, v)
        (z,) = ops.repeat(inner, 0, y)
        store(z)
    assert _profile(ir).loop_iterations == 3 + 3 * 4


def test_profile_is_per_run():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(4, np.float32))
        store(ops.exp(v))
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        first = session.profile.ops_executed
        session.run()
        assert session.profile.ops_executed == first == 2


# --- matmul_flops -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ls, rs, flops",
    [
        ((2, 3), (3, 4), 2 * 2 * 4 * 3),
        ((3,), (3, 4), 2 * 1 * 4 * 3),
        ((2, 3), (3,), 2 * 2 * 1 * 3),
        ((5, 2, 3), (3, 4), 5 * 2 * 2 * 4 * 3),
        ((2, 1, 2, 3), (5, 3, 4), 10 * 2 * 2 * 4 * 3),
    ],
)
def test_matmul_flops(ls, rs, flops):
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(np.ones(ls, np.float32))
        b = popxl.constant(np.ones(rs, np.float32))
        store(ops.matmul(a, b))
    assert _profile(ir).matmul_flops == flops


def test_matmul_flops_summed_over_repeat_and_calls():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones((2, 8), np.float32))
        w = popxl.constant(np.ones((8, 8), np.float32) / 8)
        g = ir.create_graph(lambda a, ww: a @ ww, x, w)  # 2*2*8*8 = 256 per execution
        (y,) = ops.repeat(g, 3, x, w)
        (z,) = ops.call(g, y, w)
        store(z @ popxl.constant(np.ones((8, 1), np.float32)))  # 2*2*1*8 = 32
    assert _profile(ir).matmul_flops == 4 * 256 + 32


# --- peak_live_bytes ----------------------------------------------------------------------------


def _chain(n, k, keep_all=False):
    """k exps on an (n,) float32 variable; keep_all concatenates every intermediate at the end."""
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros(n, np.float32))
        ts = [v]
        for _ in range(k):
            ts.append(ops.exp(ts[-1]))
        store(ops.concat(ts[1:], 0) if keep_all else ts[-1])
    return _profile(ir).peak_live_bytes


def test_peak_live_bytes_straight_line_by_hand():
    """v (variable, 4n) -> a = exp(v) -> b = exp(a) -> c = a + b -> host_store(c).

    With dead values freed after their last use the peak is at the add: a, b, c live (12n bytes),
    plus the variable's 4n bytes (device memory for the whole run).
    """
    n = 1000
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros(n, np.float32))
        a = ops.exp(v)
        b = ops.exp(a)
        store(a + b)
    assert _profile(ir).peak_live_bytes == 4 * n + 12 * n


def test_peak_live_bytes_chain_does_not_grow_with_length():
    assert _chain(256, 2) == _chain(256, 10)


def test_peak_live_bytes_grows_when_values_are_kept():
    n = 256
    assert _chain(n, 8, keep_all=True) > _chain(n, 2, keep_all=True)
    assert _chain(n, 8, keep_all=True) - _chain(n, 4, keep_all=True) >= 4 * n * 4 * 2  # 4 more inputs + output rows


def test_peak_live_bytes_scales_linearly_with_size():
    p1, p2, p3 = (_chain(n, 3) for n in (100, 200, 300))
    assert p2 - p1 == p3 - p2 > 0


@emulator_only
@pytest.mark.parametrize("read_after", [False, True])
def test_call_input_dead_after_copy_unless_read_again(read_after):
    """A by-value call input read for the last time by the call is dead once copied in.

    x (4n, host_load). The callee copies x (4n) and computes y = x * 2 (4n). At the copy both
    x and its copy are live: 8n. Inside the callee: copy + y = 8n, plus x only if the caller
    reads x again after the call (then: 12n). Output z = y + x or y + 1 afterwards.
    """
    n = 1000
    ir = popxl.Ir()
    with ir.main_graph:
        stream = popxl.h2d_stream((n,), popxl.float32)
        x = ops.host_load(stream)
        g = ir.create_graph(lambda a: a * 2.0, x.spec)
        (y,) = ops.call(g, x)
        store(y + x if read_after else y + 1.0)
    prof = _profile(ir, {stream: np.ones(n, np.float32)})
    # After the call: y + (x or nothing) + z; the callee's peak dominates either way.
    assert prof.peak_live_bytes - prof.const_bytes == (12 * n if read_after else 8 * n)


@pytest.mark.parametrize("count", [1, 3])
def test_repeat_invariant_input_lives_through_the_loop(count):
    """A repeat body's loop-invariant input is read by every iteration, so its storage lives for
    the whole loop: the peak must not depend on whether the body reads it before or after its
    big temporaries (LoopOpx copies/aliases it once, before the loop; reference page 3.2).
    Before this rule the profile freed it after its last read within an iteration."""
    def body_early(c, a):
        s = ops.sum(a, axis=0, keepdims=True)  # [1]: last read of a, before the temporaries
        t = ops.init((4096,), f32, init_type="zero")
        return c + ops.sum(t + s, axis=0, keepdims=True)

    def body_late(c, a):
        t = ops.init((4096,), f32, init_type="zero")
        u = ops.sum(t + 1.0, axis=0, keepdims=True)
        return c + u + ops.sum(a, axis=0, keepdims=True)  # last read of a, after them

    peaks = []
    for body in (body_early, body_late):
        ir = popxl.Ir()
        with ir.main_graph:
            c = popxl.constant(np.zeros(1, np.float32)) + 0.0
            a = ops.init((2048,), f32, init_type="zero")
            g = ir.create_graph(body, c, a)
            (y,) = ops.repeat(g, count, c, a)
            store(y)
        peaks.append(_profile(ir).peak_live_bytes)
    assert peaks[0] == peaks[1]
