"""Replicated tensor sharding of variables (PopXL 3.4 ``tensor.py``: ``replica_sharded_buffer``,
``remote_replica_sharded_variable``, ``replica_sharded_variable``): the host value is the whole
tensor, each replica holds a shard (loaded in the weights-from-host program), an all-gather with
``output_shape="meta_shape"`` gives the whole tensor back, and the weights-to-host program
stores the updated shards so the host sees the updated whole tensor.
"""
import numpy as np
import pytest

from popxl_flash import popxl

ops = popxl.ops


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


@pytest.mark.parametrize("shard_over", [2, 4])
def test_replica_sharded_variable_round_trip(shard_over):
    """10 elements over 4 replicas: shards of ceil(10 / shard_over) with zero padding; the
    gather over each shard group gives the value; an in-place update of the shards reaches the
    host through weights_to_host."""
    data = np.arange(10, dtype=np.float32).reshape(2, 5)
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        var, shard = popxl.replica_sharded_variable(data, name="w", shard_over=shard_over)
        assert shard.shape == (-(10 // -shard_over),) and shard.meta_shape == (2, 5)
        group = ir.replica_grouping(group_size=shard_over)
        with popxl.in_sequence(True):
            full = ops.collectives.replicated_all_gather(shard, group=group,
                                                         output_shape="meta_shape")
            s = _store(full)
            ops.var_updates.accumulate_(shard, popxl.constant(np.ones(shard.shape, np.float32)))
    session = popxl.Session(ir, "ipu_model")
    with session:
        out = session.run()[s]
    for r in range(4):
        np.testing.assert_array_equal(out[r], data)
    np.testing.assert_array_equal(session.get_tensor_data(var), data + 1.0)


def test_replica_sharded_buffer_and_variable_checks():
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        with pytest.raises(ValueError):
            popxl.replica_sharded_buffer((8,), popxl.float32, shard_over=8)
        with pytest.raises(ValueError):
            popxl.replica_sharded_buffer((8,), popxl.float32, shard_over=3)
        buf = popxl.replica_sharded_buffer((3, 3), popxl.float32, shard_over=2)
        assert buf.tensor_shape == (5,) and buf.meta_shape == (3, 3)
        with pytest.raises(ValueError):  # the buffer's meta shape is another one
            popxl.remote_replica_sharded_variable(np.zeros((9,), np.float32), buf)
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32)
        with pytest.raises(ValueError):  # no replication
            popxl.remote_replica_sharded_variable(np.zeros(4, np.float32), buf)


def test_call_outputs_keep_the_meta_shape():
    """A loaded shard returned from a subgraph keeps its meta shape through the call (PopART's
    CallOp::setup copies the graph output's TensorInfo), so it can be passed on to a graph
    whose input has that spec."""
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        buf = popxl.replica_sharded_buffer((4,), popxl.float32)
        popxl.remote_replica_sharded_variable(np.arange(4, dtype=np.float32), buf)
        load = ir.create_empty_graph("load")
        with load:
            popxl.graph_output(ops.remote_load(buf, 0))
        (shard,) = ops.call(load)
        assert shard.meta_shape == (4,)
        gather = ir.create_graph(
            lambda t: ops.collectives.replicated_all_gather(t, output_shape="meta_shape"),
            shard.spec)
        (full,) = ops.call(gather, shard)
        s = _store(full)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
    np.testing.assert_array_equal(out, [[0, 1, 2, 3], [0, 1, 2, 3]])
