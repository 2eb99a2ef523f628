"""Program fragments (``popxl.context._execution_context``, PopXL 3.4 ``context.py``;
PopART ``popx/irlowering.cpp`` ``opTaskFunc``, ``popx/popprograms.cpp``,
``schedulegraphgrower.cpp``) and ``popxl.transforms.merge_exchange``
(``transforms/merge_exchange.py``, ``willow/src/transforms/mergeexchange.cpp``).

Main-graph ops built in ``WeightsFromHostFragment`` run in the weights-from-host program
(after the weights are written), ``WeightsToHostFragment`` ops in the weights-to-host program
(before they are read); what they produce stays on the device for the later programs. The
pattern is popxl-addons' ``seed_variable`` and PopXL's ``replica_sharded_variable``.
"""
import numpy as np
import pytest

import popxl_flash
from conftest import COMPILE_ERRORS, emulator_only
from popxl_flash import popxl

ops = popxl.ops

if popxl_flash.BACKEND == "emulator":
    from popxl_flash.emulator import _internal_ir as _ir
else:  # pragma: no cover - the SDK
    import popart._internal.ir as _ir

WFH = _ir.ExecutionContext.WeightsFromHostFragment
WTH = _ir.ExecutionContext.WeightsToHostFragment


def _fragments():
    return popxl.context._execution_context


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


def _counter_ir(replication=1):
    """A remote variable loaded in the weights-from-host program, incremented in place by
    every run, stored back in the weights-to-host program (popxl-addons' seed_variable)."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32)
        var = popxl.remote_variable(np.array([1.0, 10.0], np.float32), buf, name="counter")
        with _fragments()(WFH):
            t = ops.remote_load(buf, 0, "counter_h2d")
        with _fragments()(WTH):
            ops.remote_store(buf, 0, t)
        with popxl.in_sequence(True):
            ops.var_updates.accumulate_(t, popxl.constant(np.ones(2, np.float32)))
            s = _store(t)
    return ir, var, s


def test_weights_fragments_carry_a_device_value_across_runs():
    ir, var, s = _counter_ir()
    session = popxl.Session(ir, "ipu_model")
    with session:
        first = session.run()[s]
        second = session.run()[s]
    np.testing.assert_array_equal(first, [2.0, 11.0])
    np.testing.assert_array_equal(second, [3.0, 12.0])
    # leaving the context ran weights_to_host: the fragment stored the value into the buffer
    np.testing.assert_array_equal(session.get_tensor_data(var), [3.0, 12.0])


def test_weights_from_host_reruns_the_fragment():
    """Writing the variable pushes all weights again (weights_from_host), and the fragment
    reloads the device value from the remote variable."""
    ir, var, s = _counter_ir()
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        session.write_variable_data(var, np.array([100.0, 200.0], np.float32))
        np.testing.assert_array_equal(session.run()[s], [101.0, 201.0])


def test_fragments_run_on_every_replica():
    ir, var, s = _counter_ir(replication=2)
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        out = session.run()[s]
    np.testing.assert_array_equal(out, [[3.0, 12.0], [3.0, 12.0]])


def test_weights_from_host_op_reading_a_main_program_tensor_is_refused():
    """PopART's scheduler puts weights-from-host ops before the main program's: an op there
    that reads a main-program tensor cannot be scheduled."""
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32)
        x = popxl.variable(np.ones(2, np.float32)) + 1.0
        with _fragments()(WFH):
            ops.remote_store(buf, 0, x)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


@emulator_only
def test_unmodelled_fragments_and_subgraph_fragment_ops_raise():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(2, np.float32))
        with _fragments()(_ir.ExecutionContext.OptimizerFromHostFragment):
            with pytest.raises(NotImplementedError):
                x + 1.0
    ir = popxl.Ir()
    g = ir.create_empty_graph("sub")
    with g, _fragments()(WFH):
        t = popxl.graph_input((2,), popxl.float32, "t")
        with pytest.raises(NotImplementedError):
            t + 1.0


@emulator_only
def test_weights_to_host_reading_an_unwritten_main_program_tensor_raises():
    """A weights-to-host op storing a tensor the main program computes: before any run the
    device memory was never written (unspecified)."""
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32)
        var = popxl.remote_variable(np.zeros(2, np.float32), buf)
        y = popxl.variable(np.ones(2, np.float32)) * 3.0
        with _fragments()(WTH):
            ops.remote_store(buf, 0, y)
    session = popxl.Session(ir, "ipu_model", weights_to_host_on_exit=False)
    with session:
        with pytest.raises(RuntimeError):
            session.weights_to_host()
        session.run()
        session.weights_to_host()
        np.testing.assert_array_equal(session.get_tensor_data(var), [3.0, 3.0])


def test_profile_counts_the_main_program_only():
    ir, _, s = _counter_ir()
    if popxl_flash.BACKEND != "emulator":
        pytest.skip("the emulator's run profile")
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        kinds = session.profile.ops_by_kind
    assert "remote_load" not in kinds and "remote_store" not in kinds


# -- merge_exchange ----------------------------------------------------------------------------
def test_merge_exchange_keeps_the_values():
    """Loads of several buffers merged into one exchange, in a subgraph called with an int32
    offset (popxl-addons' ``load_remote_graph``)."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.remote_buffer((2,), popxl.float32, entries=2)
        b = popxl.remote_buffer((3,), popxl.float32, entries=2)
        va = popxl.remote_variable(np.array([3, 4], np.float32), a, 1)
        vb = popxl.remote_variable(np.array([5, 6, 7], np.float32), b, 1)
        g = ir.create_empty_graph("load")
        with g, popxl.transforms.merge_exchange(), popxl.in_sequence(False):
            index = popxl.graph_input([], popxl.int32, "index")
            popxl.graph_output(ops.remote_load(a, index, "a"))
            popxl.graph_output(ops.remote_load(b, index, "b"))
        la, lb = ops.call(g, popxl.constant(1))
        sa, sb = _store(la), _store(lb)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()
    np.testing.assert_array_equal(out[sa], [3, 4])
    np.testing.assert_array_equal(out[sb], [5, 6, 7])
    assert va.shape == (2,) and vb.shape == (3,)


@emulator_only
def test_merge_exchange_refuses_an_unordered_store_and_load_of_one_entry():
    """Merging strips the constraints between the merged exchanges: a store and a load of one
    buffer entry that only in_sequence ordered have no defined order (raised when they run);
    other entries of the buffer are fine (popxl-addons' overlapped batch serialisation)."""
    def build(load_entry):
        ir = popxl.Ir()
        with ir.main_graph:
            buf = popxl.remote_buffer((2,), popxl.float32, entries=2)
            x = popxl.variable(np.ones(2, np.float32))
            ops.remote_store(buf, 1, x)
            with popxl.transforms.merge_exchange(), popxl.in_sequence(True):
                ops.remote_store(buf, 0, x)
                s = _store(ops.remote_load(buf, load_entry))
        return ir, s

    ir, s = build(1)
    with popxl.Session(ir, "ipu_model") as session:
        np.testing.assert_array_equal(session.run()[s], [1.0, 1.0])
    ir, _ = build(0)
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(RuntimeError):
            session.run()


def test_io_tile_exchange_and_io_tile_copy():
    """Loads on the IO tiles in one exchange, copied to the compute tiles (popxl-addons'
    remote graphs with IO tiles)."""
    ir = popxl.Ir()
    ir._pb_ir.getSessionOptions().numIOTiles = 32
    with ir.main_graph:
        a = popxl.remote_buffer((2,), popxl.float32)
        b = popxl.remote_buffer((2,), popxl.float32)
        popxl.remote_variable(np.array([1, 2], np.float32), a)
        popxl.remote_variable(np.array([3, 4], np.float32), b)
        with popxl.transforms.io_tile_exchange():
            la, lb = ops.remote_load(a, 0), ops.remote_load(b, 0)
        assert la.tile_set == "io"
        ca, cb = ops.io_tile_copy(la), ops.io_tile_copy(lb)
        assert ca.tile_set == "compute"
        s = _store(ca + cb)
    with popxl.Session(ir, "ipu_hw") as session:
        np.testing.assert_array_equal(session.run()[s], [4, 6])


def test_tile_sets_must_match():
    """PopXL's ``check_tensor_ipu_and_tile_set``: an op reading tensors of the IO and the
    compute tiles is refused (ValueError); ``io_tile_exchange`` leaving more than one op
    raises RuntimeError; ops on IO tiles need ``numIOTiles``."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(2, np.float32))
        y = x * 2.0
        with popxl.io_tiles():
            z = ops.io_tile_copy(y)
        with pytest.raises(ValueError):
            y + z
        with pytest.raises(RuntimeError):
            with popxl.transforms.io_tile_exchange():
                z * 2.0
                z * 3.0
        _store(ops.io_tile_copy(z))
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_hw")


# -- views of storage nothing writes -----------------------------------------------------------
def test_inplace_reshape_of_a_transposed_view():
    """``reshape_`` of a ``transpose_`` view (not contiguous): the values of the reshape of
    the transposed tensor."""
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(data)
        y = ops.reshape_(ops.transpose_(x, (0, 2, 1)), (2, 12))
        s = _store(y + 0.0)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
    np.testing.assert_array_equal(out, data.transpose(0, 2, 1).reshape(2, 12))
