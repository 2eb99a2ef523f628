"""Remote buffers (PopXL 3.4 ``remote_buffer.py``, ``ops/remote_load.py``,
``ops/remote_store.py``, ``tensor.py`` ``remote_variable``)."""
import numpy as np
import pytest

import popxl_flash
from conftest import COMPILE_ERRORS, emulator_only, store
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32


def test_remote_buffer_ids_entries_and_validation():
    """Ids count from 1; entries must be positive; a tensor must match the buffer."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.remote_buffer((2, 3), f32, entries=4)
        b = popxl.remote_buffer((3,), popxl.int32)
        assert (a.remote_buffer_id, b.remote_buffer_id) == (1, 2)
        assert a.tensor_shape == (2, 3) and a.tensor_dtype == f32 and a.entries == 4
        a.entries = 5
        assert a.entries == 5
        with pytest.raises(ValueError):
            popxl.remote_buffer((2,), f32, entries=0)
        with pytest.raises(ValueError):
            ops.remote_store(a, 0, popxl.constant(np.zeros(3, np.float32)))


def test_store_then_load():
    """``remote_store`` then ``remote_load_`` of the same entry reads what was stored."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((3,), f32, entries=2)
        s_in = popxl.h2d_stream((3,), f32)
        x = ops.host_load(s_in)
        ops.remote_store(buf, popxl.constant(np.uint32(1)), x * 2.0)
        t = ops.remote_load_(buf, 1, ops.init((3,), f32, "t", "zero"))
        s_t = store(t)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({s_in: np.arange(3, dtype=np.float32)})[s_t]
        profile = session.profile
    np.testing.assert_array_equal(out, [0, 2, 4])
    if popxl_flash.BACKEND == "emulator":
        assert profile.remote_bytes_stored == 12 and profile.remote_bytes_loaded == 12


def test_remote_variable_lives_in_its_buffer():
    """``remote_variable``: weights_from_host writes it into its entry; a remote_store there
    is what weights_to_host reads back."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((2,), f32, entries=2)
        v = popxl.remote_variable(np.array([1.0, 2.0], np.float32), buf, 1)
        w = ops.remote_load(buf, 1)
        ops.remote_store(buf, 1, w + 10.0)
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        session.run()
    np.testing.assert_array_equal(session.get_tensor_data(v), [21.0, 22.0])


@emulator_only
def test_remote_variable_read_directly_and_bad_offsets_are_refused():
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), f32, entries=1)
        v = popxl.remote_variable(np.zeros(2, np.float32), buf, 0)
        store(v + 1.0)
    with pytest.raises(COMPILE_ERRORS, match="off chip"):
        popxl.Session(ir, "ipu_model")
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), f32, entries=1)
        store(ops.remote_load(buf, 3))
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(IndexError):
            session.run()


def test_int32_and_uint32_offset_tensors():
    """Offsets as one-element int32 tensors (PopART's own remote-buffer test passes
    ``popxl.constant(0)``; popxl-addons an int32 graph input) or uint32; others are refused."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((2,), f32, entries=2)
        ops.remote_store(buf, popxl.constant(1), popxl.constant(np.array([3.0, 4.0], np.float32)))
        s = store(ops.remote_load(buf, popxl.constant(np.uint32(1))))
    with popxl.Session(ir, "ipu_model") as session:
        np.testing.assert_array_equal(session.run()[s], [3.0, 4.0])
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), f32, entries=2)
        store(ops.remote_load(buf, popxl.constant(np.array([0, 1], np.int32))))
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), f32, entries=2)
        store(ops.remote_load(buf, popxl.constant(0.0)))
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_remote_buffers_are_per_replica():
    ir = popxl.Ir(replication=2)
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((1,), f32)
        idx = ops.collectives.replicated_slice(popxl.constant(np.arange(2, dtype=np.float32)))
        ops.remote_store(buf, 0, idx.reshape((1,)))
        s = store(ops.remote_load(buf, 0))
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
    np.testing.assert_array_equal(out.reshape(-1), [0, 1])


@emulator_only
def test_loading_an_entry_never_written_raises():
    """Remote memory starts uninitialised (unspecified on the device)."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((3,), f32, entries=2)
        s_in = popxl.h2d_stream((3,), f32)
        x = ops.host_load(s_in)
        old = ops.remote_load(buf, 1)
        ops.remote_store(buf, 1, x)
        new = ops.remote_load(buf, 1)
        store(old)
        store(new)
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(RuntimeError, match="never written"):
            session.run({s_in: np.ones(3, np.float32)})
