"""Host streams and Session (reference §3, §11.11)."""
import numpy as np
import pytest

from conftest import load, run, store
from popxl_flash import popxl

ops = popxl.ops
f32, f16, i32 = popxl.float32, popxl.float16, popxl.int32


def _double_program(shape=(3,), dtype=f32):
    ir = popxl.Ir()
    with ir.main_graph:
        s_in = popxl.h2d_stream(shape, dtype, name="x")
        x = ops.host_load(s_in)
        s_out = popxl.d2h_stream(shape, dtype, name="y")
        ops.host_store(s_out, x + x)
    return ir, s_in, s_out


def test_streams_have_spec():
    ir = popxl.Ir()
    with ir.main_graph:
        s = popxl.h2d_stream((2, 3), f16, name="s")
        d = popxl.d2h_stream((4,), i32, name="d")
    assert s.shape == (2, 3) and s.dtype == f16
    assert d.shape == (4,) and d.dtype == i32
    assert s.spec == popxl.TensorSpec((2, 3), f16)
    assert len({s, d}) == 2  # hashable


def test_run_returns_dict_keyed_by_d2h_streams():
    ir, s_in, s_out = _double_program()
    x = np.array([1.0, 2.0, 3.0], np.float32)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({s_in: x})
    assert isinstance(out, dict) and list(out) == [s_out]
    assert out[s_out].shape == (3,) and out[s_out].dtype == np.float32
    np.testing.assert_array_equal(out[s_out], 2 * x)


@pytest.mark.parametrize("shape", [(), (1,), (1, 3), (2, 1)])
def test_stream_shape_is_kept_exactly(shape):
    """Only the (num_host_transfers, replicas) dims are dropped when 1, never the stream's own."""
    ir, s_in, s_out = _double_program(shape)
    x = np.full(shape, 1.5, np.float32)
    with popxl.Session(ir, "ipu_model") as session:
        r = session.run({s_in: x})[s_out]
    assert r.shape == shape
    np.testing.assert_array_equal(r, 2 * x)


def test_stream_registered_on_main_graph_from_subgraph():
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_empty_graph("io")
        with g:
            s_in = popxl.h2d_stream((2,), f32, name="x")
            s_out = popxl.d2h_stream((2,), f32, name="y")
            ops.host_store(s_out, ops.host_load(s_in) * 3.0)
        ops.call(g)
    with popxl.Session(ir, "ipu_model") as session:
        r = session.run({s_in: np.array([1.0, -1.0], np.float32)})
    np.testing.assert_array_equal(r[s_out], np.array([3.0, -3.0], np.float32))


def test_host_store_must_match_stream():
    ir = popxl.Ir()
    with ir.main_graph:
        s = popxl.d2h_stream((3,), f32)
        with pytest.raises(ValueError):
            ops.host_store(s, popxl.constant(np.zeros(3, np.float16)))
        with pytest.raises(ValueError):
            ops.host_store(s, popxl.constant(np.zeros(4, np.float32)))


def test_num_host_transfers_and_host_io_inside_repeat():
    """The program runs once per run; each host_load/host_store execution takes the next entry."""
    n = 4
    xs = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    ir = popxl.Ir()
    ir.num_host_transfers = n
    with ir.main_graph:
        s_in = popxl.h2d_stream((3,), f32, name="x")
        s_each = popxl.d2h_stream((3,), f32, name="running")
        acc0 = popxl.constant(np.zeros(3, np.float32))

        def body(acc):
            acc = acc + ops.host_load(s_in)
            ops.host_store(s_each, acc)
            return acc

        g = ir.create_graph(body, acc0)
        ops.repeat(g, n, acc0)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({s_in: xs})
    assert list(out) == [s_each]
    assert out[s_each].shape == (n, 3)
    np.testing.assert_array_equal(out[s_each], np.cumsum(xs, axis=0))


def _io_repeat_program(n):
    """repeat n: y_k = 2 * x_k, one host_load and one host_store per iteration."""
    ir = popxl.Ir()
    ir.num_host_transfers = n
    with ir.main_graph:
        s_in = popxl.h2d_stream((3,), f32, name="x")
        s_out = popxl.d2h_stream((3,), f32, name="y")
        i0 = popxl.constant(np.int32(0))

        def body(i):
            ops.host_store(s_out, ops.host_load(s_in) * 2.0)
            return i + 1

        ops.repeat(ir.create_graph(body, i0), n, i0)
    return ir, s_in, s_out


def test_num_host_transfers_leading_dim_required():
    ir, s_in, s_out = _io_repeat_program(2)
    xs = np.arange(6, dtype=np.float32).reshape(2, 3)
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(Exception):
            session.run({s_in: xs[0]})  # (3,) lacks the num_host_transfers dim
        out = session.run({s_in: xs})
    assert out[s_out].shape == (2, 3)
    np.testing.assert_array_equal(out[s_out], 2 * xs)


def test_input_key_set_must_be_exact():
    ir, s_in, s_out = _double_program()
    with ir.main_graph:
        unused = popxl.h2d_stream((3,), f32, name="unused")  # no host_load -> invisible
    x = np.ones(3, np.float32)
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(ValueError):
            session.run({})
        with pytest.raises(ValueError):
            session.run()
        with pytest.raises(ValueError):
            session.run({s_in: x, unused: x})
        np.testing.assert_array_equal(session.run({s_in: x})[s_out], 2 * x)


@pytest.mark.parametrize(
    "stream_dtype, data",
    [
        (f32, np.ones(3, np.int32)),
        (f32, np.ones(3, np.float16)),
        (f16, np.ones(3, np.float32)),
        (i32, np.ones(3, np.float32)),
        (i32, np.ones(3, np.uint32)),
    ],
)
def test_input_dtype_is_not_cast(stream_dtype, data):
    ir, s_in, _ = _double_program((3,), stream_dtype)
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(Exception):
            session.run({s_in: data})


@pytest.mark.parametrize(
    "stream_dtype, data, want",
    [
        (f32, np.array([1.0, 2.0, 3.0], np.float64), np.array([2.0, 4.0, 6.0], np.float32)),
        (i32, np.array([1, 2, 3], np.int64), np.array([2, 4, 6], np.int32)),
    ],
)
def test_input_64_bit_arrays_are_downcast(stream_dtype, data, want):
    ir, s_in, s_out = _double_program((3,), stream_dtype)
    with popxl.Session(ir, "ipu_model") as session:
        r = session.run({s_in: data})[s_out]
    assert r.dtype == want.dtype
    np.testing.assert_array_equal(r, want)


def test_input_trailing_shape_must_match():
    ir, s_in, _ = _double_program((3,))
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(Exception):
            session.run({s_in: np.ones(4, np.float32)})
        with pytest.raises(Exception):
            session.run({s_in: np.ones((2, 2), np.float32)})


def test_runtime_calls_need_the_session_context():
    ir, s_in, _ = _double_program()
    session = popxl.Session(ir, "ipu_model")
    x = np.ones(3, np.float32)
    with pytest.raises(ValueError):
        session.run({s_in: x})
    with session:
        session.run({s_in: x})
    with pytest.raises(ValueError):
        session.run({s_in: x})


def test_cpu_session_rejects_replication():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        store(popxl.constant(np.ones(2, np.float32)))
    with pytest.raises(ValueError):
        popxl.Session(ir, "cpu")


def test_default_device_runs():
    ir, s_in, s_out = _double_program()
    with popxl.Session(ir) as session:
        r = session.run({s_in: np.ones(3, np.float32)})[s_out]
    np.testing.assert_array_equal(r, np.full(3, 2.0, np.float32))


# --- variables ---------------------------------------------------------------------------------


def _var_program():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.array([1.0, 2.0], np.float32), name="v")
        k = popxl.variable(np.int32(7), name="k")
        c = popxl.constant(np.array([5.0, 6.0], np.float32), name="c")
        y = v * 2.0
        out = store(y)
        out_k = store(k + 0)
    return ir, v, k, c, y, out, out_k


def test_write_variable_data_then_run_reads_it():
    ir, v, k, _, _, out, out_k = _var_program()
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variable_data(v, np.array([10.0, 20.0], np.float32))
        session.write_variable_data(k, 3)  # Python numbers are converted
        r = session.run()
        np.testing.assert_array_equal(session.get_tensor_data(v), np.array([10.0, 20.0], np.float32))
    np.testing.assert_array_equal(r[out], np.array([20.0, 40.0], np.float32))
    assert r[out_k] == 3


@pytest.mark.parametrize(
    "data", [np.array([1.0, 2.0], np.float64), np.array([1.0, 2.0], np.float16), np.array([1, 2], np.int32)]
)
def test_write_variable_data_needs_exact_numpy_dtype(data):
    ir, v, *_ = _var_program()
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(TypeError):
            session.write_variable_data(v, data)


def test_write_variable_data_shape_must_match():
    ir, v, *_ = _var_program()
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(ValueError):
            session.write_variable_data(v, np.zeros(3, np.float32))
        with pytest.raises(ValueError):
            session.write_variable_data(v, np.zeros((1, 2), np.float32))


def test_write_variable_data_only_for_variables():
    ir, _, _, c, y, *_ = _var_program()
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(TypeError):
            session.write_variable_data(c, np.zeros(2, np.float32))
        with pytest.raises(TypeError):
            session.write_variable_data(y, np.zeros(2, np.float32))


def test_get_tensor_data_variables_and_constants_only():
    ir, v, _, c, y, *_ = _var_program()
    with popxl.Session(ir, "ipu_model") as session:
        np.testing.assert_array_equal(session.get_tensor_data(v), np.array([1.0, 2.0], np.float32))
        np.testing.assert_array_equal(session.get_tensor_data(c), np.array([5.0, 6.0], np.float32))
        with pytest.raises(TypeError):
            session.get_tensor_data(y)
    # outside the context: the host copy
    np.testing.assert_array_equal(session.get_tensor_data(v), np.array([1.0, 2.0], np.float32))


def test_variable_updated_on_device_is_synced_to_host():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros(2, np.float32), name="v")
        ops.var_updates.accumulate_(v, popxl.constant(np.array([1.0, 2.0], np.float32)))
    session = popxl.Session(ir, "ipu_model")
    with session:
        session.run()
        session.run()
        np.testing.assert_array_equal(session.get_tensor_data(v), np.array([2.0, 4.0], np.float32))
    np.testing.assert_array_equal(session.get_tensor_data(v), np.array([2.0, 4.0], np.float32))


def test_run_helper_smoke():
    ir = popxl.Ir()
    feeds = {}
    with ir.main_graph:
        y = load(feeds, np.array([1, 2], np.int32)) * 3
    np.testing.assert_array_equal(run(ir, feeds, y), np.array([3, 6], np.int32))


def test_only_streams_with_host_io_are_listed():
    ir, s_in, s_out = _double_program()
    with ir.main_graph:
        popxl.h2d_stream((3,), f32, name="unused_in")
        popxl.d2h_stream((3,), f32, name="unused_out")
    assert list(ir.get_all_h2d_streams()) == [s_in]
    assert list(ir.get_all_d2h_streams()) == [s_out]


def test_more_entries_than_host_transfers_accepted():
    """Reference §3: with num_host_transfers > 1, dim 0 must be >= num_host_transfers; a larger
    leading dim is accepted (fewer is an error)."""
    ir, s_in, s_out = _io_repeat_program(2)
    xs = np.arange(9, dtype=np.float32).reshape(3, 3)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({s_in: xs})
        with pytest.raises(ValueError):
            session.run({s_in: xs[:1]})
    assert out[s_out].shape == (2, 3)
    np.testing.assert_array_equal(out[s_out], 2 * xs[:2])  # the emulator reads the first two
