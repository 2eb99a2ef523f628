"""Emulator run profile by op kind, priced by PopART's lowering (emulator only; exact counts on
micro-graphs).

Rules (emulator README, "Run profile"; the table is ``popxl_flash/lowering.py``): every executed
op counts once per execution under its kind, with its output elements; ops of a subgraph count
per execution of the subgraph (a repeat body per iteration, a conditional's taken branch only).
``compute_sets`` sums the table's compute sets per execution (2 per repeat iteration);
``vector_elements`` the table's vector work (output elements of maps, input elements of
reductions, 5x and 3x the input for softmax and logsumexp); outplace views copy their output
(``copied_by_kind["view"]``), their ``_`` forms nothing.
"""
import numpy as np
import pytest

from conftest import emulator_only, store
from popxl_flash import ipu_model, lowering, popxl

pytestmark = emulator_only

ops = popxl.ops


def _profile(ir, inputs=None):
    with popxl.Session(ir, "ipu_model") as session:
        session.run(dict(inputs or {}))
        return session.profile


def test_straight_line_kinds_elements_and_derived_counts():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones((2, 3), np.float32))
        y = v * 2.0  # mul: 6 elements
        r = ops.reshape(y, (3, 2))  # view (copying reshape)
        t = ops.transpose_(r)  # view
        z = ops.exp(t)  # exp: 6 elements
        s = ops.sum(z, axis=[1])  # sum: 2 elements
        m = ops.matmul(z, popxl.constant(np.ones((3, 4), np.float32)))  # matmul: 8 elements
        store(s)
        store(m)
    p = _profile(ir)
    assert p.ops_by_kind == {"mul": 1, "reshape": 1, "transpose_": 1, "exp": 1,
                             "sum": 1, "matmul": 1, "host_store": 2}
    assert p.elements_by_kind == {"mul": 6, "reshape": 6, "transpose_": 6, "exp": 6,
                                  "sum": 2, "matmul": 8, "host_store": 0}
    assert sum(p.ops_by_kind.values()) == p.ops_executed == 8
    # mul 1, reshape 1 (a copy), transpose_ 0 (a view), exp 1, sum 2, matmul 3; host IO 0
    assert p.compute_sets == 1 + 1 + 0 + 1 + 2 + 3
    assert p.vector_elements == 6 + 6 + 6  # mul, exp, sum (its input's 6 elements)
    assert p.copied_by_kind["view"] == 6 * 4  # the outplace reshape's output
    assert p.work.vector_work == {"arithmetic.float32": 12, "transcendental.float32": 6}
    assert p.work.matmul_flops == {"float32": 2 * 2 * 3 * 4}  # [2, 3] @ [3, 4]


def test_static_slices_and_detach_are_views():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones((4, 4), np.float32))
        a = ops.slice(v, start=[0], stop=[2], axis=[0])
        b = ops.slice_(v, start=[2], stop=[4], axis=[0])
        store(ops.detach(a) + ops.detach_(b))  # add: 8 elements
    p = _profile(ir)
    assert p.ops_by_kind == {"slice": 1, "slice_": 1, "detach": 1, "detach_": 1, "add": 1,
                             "host_store": 1}
    assert p.compute_sets == 1 + 1 + 1  # slice, detach (copies) and add; the _ forms are views
    assert p.vector_elements == 8
    assert p.copied_by_kind["view"] == 2 * (8 * 4)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_repeat_multiplies_body_kinds(count):
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(4, np.float32))
        k = popxl.constant(np.float32(2.0))
        g = ir.create_graph(lambda acc, kk: ops.reshape(acc * kk + 1.0, (4,)), v, k)
        (y,) = ops.repeat(g, count, v, k)
        store(y)
    p = _profile(ir)
    body = {"mul": count, "add": count, "reshape": count}
    assert p.ops_by_kind == {**{k_: n for k_, n in body.items() if n}, "repeat": 1,
                             "host_store": 1}
    assert p.elements_by_kind == {**{k_: 4 * n for k_, n in body.items() if n}, "repeat": 4,
                                  "host_store": 0}
    assert sum(p.ops_by_kind.values()) == p.ops_executed
    # mul, add and the copying reshape per iteration, and the loop's two scalar updates
    assert p.compute_sets == 3 * count + 2 * count
    assert p.vector_elements == 8 * count  # the repeat's own outputs are not vector work
    assert p.copied_by_kind["view"] == 16 * count


def test_call_and_conditional_inside_repeat():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(3, np.float32))
        flag = popxl.constant(np.array([False]))
        inner = ir.create_graph(lambda a: ops.negate(a), v)  # negate: 3
        then_g = ir.create_graph(lambda a: a + 1.0, v)  # not taken
        else_g = ir.create_graph(lambda a: ops.exp(a * 2.0), v)  # mul, exp: 3 each

        def body(a, f):
            (b,) = ops.call(inner, a)
            (c,) = ops.conditional(f, then_g, else_g, then_inputs=[b], else_inputs=[b])
            return c

        g = ir.create_graph(body, v, flag)
        (y,) = ops.repeat(g, 4, v, flag)
        (z,) = ops.call(inner, y)
        store(z)
    p = _profile(ir)
    assert p.ops_by_kind == {"repeat": 1, "call": 4 + 1, "negate": 4 + 1, "conditional": 4,
                             "mul": 4, "exp": 4, "host_store": 1}
    assert "add" not in p.elements_by_kind  # the untaken branch never ran
    assert p.elements_by_kind["negate"] == 3 * 5
    assert p.elements_by_kind["mul"] == p.elements_by_kind["exp"] == 3 * 4
    assert sum(p.ops_by_kind.values()) == p.ops_executed == 1 + 4 * 5 + 2 + 1
    assert p.compute_sets == 5 + 4 * 2 + 4 * 2  # negate x5, mul and exp x4, 2 per iteration
    assert p.vector_elements == 3 * 5 + 3 * 4 * 2


def test_nested_repeats_multiply():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(2, np.float32))
        inner = ir.create_graph(lambda a: a + 1.0, v)
        outer = ir.create_graph(lambda a: ops.repeat(inner, 4, a)[0] * 2.0, v)
        (y,) = ops.repeat(outer, 3, v)
        store(y)
    p = _profile(ir)
    assert p.ops_by_kind == {"repeat": 1 + 3, "add": 12, "mul": 3, "host_store": 1}
    assert p.vector_elements == 2 * (12 + 3)
    assert p.compute_sets == 12 + 3 + 2 * (12 + 3)  # add, mul; 2 per iteration of each loop


def test_by_kind_counts_are_per_run():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(4, np.float32))
        store(ops.exp(v))
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        session.run()
        assert session.profile.ops_by_kind == {"exp": 1, "host_store": 1}
        assert session.profile.vector_elements == 4


def test_replicas_sum_by_kind():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        s = popxl.h2d_stream((3,), popxl.float32, name="x")
        y = ops.exp(ops.host_load(s))
        d = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(d, y)
    with popxl.Session(ir, "ipu_model") as session:
        session.run({s: np.ones((2, 3), np.float32)})
        p = session.profile
    assert [r.ops_by_kind for r in p.replicas] == [{"host_load": 1, "exp": 1,
                                                    "host_store": 1}] * 2
    assert p.ops_by_kind == {"host_load": 2, "exp": 2, "host_store": 2}
    assert p.elements_by_kind["exp"] == 6 and p.vector_elements == 6


def test_in_place_dynamic_update_counts_its_update():
    """An in-place dynamic update writes its update (2 x 3 elements), not the whole tensor it
    returns (8 x 3); the dynamic slice's output is its slice."""
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros((8, 3), np.float32))
        at = popxl.constant(np.array([2], np.int32))
        part = ops.dynamic_slice(v, at, axes=[0], sizes=[2], no_overlap=True)
        w = ops.dynamic_update_(v, at, part + 1.0, axes=[0], sizes=[2], no_overlap=True)
        store(w)
    p = _profile(ir)
    assert p.elements_by_kind == {"dynamic_slice": 6, "add": 6, "dynamic_update_": 6,
                                  "host_store": 0}
    assert p.vector_elements == 6  # the add; slices and updates are copies
    assert p.compute_sets == 2 + 1 + 2
    assert p.copied_by_kind["op"] == 6 * 4 + 6 * 4  # the slice's output, the update


def _single(fn, shape=(4, 64, 64), dtype=popxl.float16):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(shape, dtype.as_numpy()), dtype)
        store(fn(x))
    return _profile(ir)


@pytest.mark.parametrize("name, fn, low, high", [
    ("softmax", lambda x: ops.softmax(x, axis=-1), 7, 11),  # popnn NonLinearity.cpp:94-141
    ("logsumexp", lambda x: ops.logsumexp(x, axis=[-1]), 4, 8),  # reducelogsumexpx.cpp:42-85
    ("matmul", lambda x: ops.matmul(x, x), 2, 5),  # poplin Convolution.cpp:2164-2260
    ("add", lambda x: x + x, 1, 1),  # popops::map
    ("cast", lambda x: ops.cast(x, popxl.float32), 1, 1),
])
def test_single_op_compute_sets_are_within_the_sources_ranges(name, fn, low, high):
    assert low <= _single(fn).compute_sets <= high


def test_softmax_copies_its_input_and_works_five_times_it():
    p = _single(lambda x: ops.softmax(x, axis=-1))
    n = 4 * 64 * 64
    assert p.copied_by_kind["op"] == 2 * n  # cloneNcopy of the float16 input
    assert p.work.vector_work == {"arithmetic.float16": 5 * n}


def test_outplace_reshape_copies_and_allocates_the_inplace_one_does_neither():
    n = 4 * 64 * 64
    copy = _single(lambda x: ops.reshape(x, (4, 4096)) + 0.0)
    view = _single(lambda x: ops.reshape_(x, (4, 4096)) + 0.0)
    assert copy.copied_by_kind["view"] == 2 * n and view.copied_by_kind["view"] == 0
    assert copy.compute_sets == view.compute_sets + 1
    assert copy.peak_live_bytes == view.peak_live_bytes + 2 * n  # a new tensor


def test_modelled_time_follows_the_formula():
    p = _single(lambda x: ops.exp(ops.cast(x, popxl.float32)))
    c = ipu_model.REFERENCE
    n = 4 * 64 * 64
    expected = (2 * c.compute_set_cycles + n / (c.tiles * c.vector_rates["cast"])
                + n / (c.tiles * c.vector_rates["transcendental.float32"]))
    assert p.modelled(c).cycles == pytest.approx(expected)
    by_kind = p.modelled_by_kind(c)
    assert sum(t.cycles for t in by_kind.values()) == pytest.approx(expected)
    assert by_kind["exp"].vector_cycles == pytest.approx(
        n / (c.tiles * c.vector_rates["transcendental.float32"]))


def test_every_emulator_kind_has_a_lowering_row():
    from popxl_flash.emulator import addons_ops  # noqa: F401  (registers the custom ops)
    from popxl_flash.emulator.registry import SHAPE_RULES
    assert sorted(set(SHAPE_RULES) - set(lowering.TABLE)) == []
    for kind, row in lowering.TABLE.items():
        assert row.source, kind
        assert row.work is None or row.rate in lowering.RATE_CLASSES, kind
