"""Replication (reference §9): replicated Irs, per-replica streams and variables, lock-step
replicas and the collectives of ``popxl.ops.collectives``, each against a numpy model.

PopART sources: ``python/popxl/python_files/session.py`` (device IPU count, stream shapes),
``ops/collectives/*.py`` (wrappers, shapes), ``willow/src/op/collectives/*.cpp`` (setup, grad
ops), ``willow/src/replicagrouping.cpp`` (group membership and rank).
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import COMPILE_ERRORS, IR_ERRORS, emulator_only
from popxl_flash import popxl

ops = popxl.ops
coll = ops.collectives
f32, f16, i32 = popxl.float32, popxl.float16, popxl.int32


def _program(replicas, shape, dtype, build, nht=1):
    """Main graph: x = host_load(shape) per replica, outputs = build(x) stored.
    Returns: (ir, in stream, [out streams])."""
    ir = popxl.Ir(replication=replicas)
    ir.num_host_transfers = nht
    with ir.main_graph:
        s = popxl.h2d_stream(shape, dtype, name="x")
        outs = build(ops.host_load(s))
        streams = []
        for t in outs:
            d = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(d, t)
            streams.append(d)
    return ir, s, streams


def _run(ir, feeds, streams, device="ipu_model"):
    with popxl.Session(ir, device) as session:
        out = session.run(feeds)
    return [out[d] for d in streams], session


def _as_rows(out, replicas):
    """Host output of a replicated stream -> list of per-replica arrays."""
    return [out[r] for r in range(replicas)] if replicas > 1 else [out]


# -- Ir, devices, streams ----------------------------------------------------------------------
def test_replication_factor_and_cpu_refusal():
    ir = popxl.Ir(replication=2)
    assert ir.replication_factor == 2 and ir.instance_replication_factor == 2
    with ir.main_graph:
        s = popxl.h2d_stream((2,), f32)
        ops.host_store(popxl.d2h_stream((2,), f32), ops.host_load(s) + 1.0)
    with pytest.raises(ValueError, match="cpu device"):
        popxl.Session(ir, "cpu")  # utils._to_device_info: num_ipus > 1
    session = popxl.Session(ir, "ipu_model")
    assert session._device.numIpus == 2


@emulator_only
def test_device_ipus_must_split_over_replicas():
    from popxl_flash.emulator import popart
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        s = popxl.h2d_stream((2,), f32)
        ops.host_store(popxl.d2h_stream((2,), f32), ops.host_load(s) + 1.0)
    dev = popart.DeviceManager().createIpuModelDevice({"numIPUs": 1, "tilesPerIPU": 4})
    with pytest.raises(COMPILE_ERRORS, match="does not divide"):
        popxl.Session(ir, dev)
    ir3 = popxl.Ir(replication=3)  # PopXL asks for 2**ceil(log2(3)) = 4 IPUs
    with ir3.main_graph:
        ops.host_store(popxl.d2h_stream((2,), f32), ops.host_load(popxl.h2d_stream((2,), f32)))
    with pytest.raises(COMPILE_ERRORS, match="does not divide"):
        popxl.Session(ir3, "ipu_model")


@pytest.mark.parametrize("nht", [1, 3])
def test_replicated_streams_row_per_replica(nht):
    """Host arrays [T, R, *shape] (T omitted when 1): replica r reads row r of each entry."""
    r = 4
    ir = popxl.Ir(replication=r)
    ir.num_host_transfers = nht
    with ir.main_graph:
        s = popxl.h2d_stream((2, 3), f32, name="x")
        d = popxl.d2h_stream((2, 3), f32, name="y")

        def body():
            ops.host_store(d, ops.host_load(s) * 2.0)
        ops.repeat(ir.create_graph(body), nht)
    data = np.random.default_rng(0).random(((nht,) if nht > 1 else ()) + (r, 2, 3),
                                           dtype=np.float32)
    (out,), _ = _run(ir, {s: data}, [d])
    assert out.shape == data.shape
    np.testing.assert_array_equal(out, 2 * data)


def test_replicated_stream_wrong_replica_dim():
    ir, s, (d,) = _program(2, (3,), f32, lambda x: [x])
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(ValueError):
            session.run({s: np.zeros((3, 3), np.float32)})
        with pytest.raises(ValueError):
            session.run({s: np.zeros((3,), np.float32)})


def test_variables_per_replica():
    """Each replica updates its own copy; weights_to_host reads replica 0's (one group)."""
    r = 2
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        x = ops.host_load(popxl.h2d_stream((3,), f32, name="x"))
        v2 = ops.var_updates.accumulate_(v, x)
        ops.host_store(popxl.d2h_stream((3,), f32), v2 + 0.0)
    (s,) = ir.get_all_h2d_streams()
    (d,) = ir.get_all_d2h_streams()
    data = np.array([[1, 2, 3], [10, 20, 30]], np.float32)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({s: data})
        out2 = session.run({s: data})
    np.testing.assert_array_equal(out[d], data)
    np.testing.assert_array_equal(out2[d], 2 * data)
    np.testing.assert_array_equal(session.get_tensor_data(v), 2 * data[0])


# -- collectives against numpy -----------------------------------------------------------------
_replicas = st.sampled_from([1, 2, 4])


@given(_replicas, st.integers(1, 3), st.integers(1, 3), st.sampled_from(["concat", "new_axis"]),
       st.integers(0, 1))
def test_all_gather_matches_numpy(r, a, b, mode, axis):
    ir, s, (d,) = _program(r, (a, b), f32, lambda x: [
        coll.replicated_all_gather(x, axis=axis, output_shape=mode)])
    data = np.random.default_rng(a * 7 + b).random((r, a, b), dtype=np.float32)
    (out,), _ = _run(ir, {s: data if r > 1 else data[0]}, [d])
    if mode == "concat":
        want = np.concatenate(list(data), axis=axis)
    else:  # PopXL's wrapper: gather the axis-first flattening, reshape, move axis 0 to `axis`
        moved = np.moveaxis(data, 1 + axis, 1).reshape(-1)
        want = np.moveaxis(moved.reshape((r, a, b)), 0, axis)
    for row in _as_rows(out, r):
        np.testing.assert_array_equal(row, want)


_REDUCE = {"add": lambda x: x.sum(0), "mean": lambda x: x.mean(0), "mul": lambda x: x.mean(0),
           "min": lambda x: x.min(0), "max": lambda x: x.max(0),
           "square_add": lambda x: (x * x).sum(0)}


@given(_replicas, st.sampled_from(sorted(_REDUCE)), st.integers(1, 3))
def test_reduce_scatter_and_all_reduce_match_numpy(r, op, k):
    n = 4 * k
    ir, s, (d_rs, d_ar) = _program(r, (n,), f32, lambda x: [
        coll.replicated_reduce_scatter(x, op=op), coll.replicated_all_reduce(x, op=op)])
    data = np.random.default_rng(n).random((r, n), dtype=np.float32)
    (rs, ar), _ = _run(ir, {s: data if r > 1 else data[0]}, [d_rs, d_ar])
    want = _REDUCE[op](data.astype(np.float64))
    chunk = n // r
    for i, (row_rs, row_ar) in enumerate(zip(_as_rows(rs, r), _as_rows(ar, r))):
        np.testing.assert_allclose(row_rs, want[i * chunk:(i + 1) * chunk], rtol=1e-6)
        np.testing.assert_allclose(row_ar, want, rtol=1e-6)


def test_reduce_scatter_flattens_input():
    r = 2
    ir, s, (d,) = _program(r, (2, 3), f32, lambda x: [coll.replicated_reduce_scatter(x)])
    data = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)
    (out,), _ = _run(ir, {s: data}, [d])
    assert out.shape == (2, 3)
    np.testing.assert_array_equal(out.reshape(-1), data.sum(0).reshape(-1))


def test_all_reduce_in_place_modifies_input():
    r = 2
    ir, s, (d,) = _program(r, (3,), f32, lambda x: [
        coll.replicated_all_reduce_(x, op="max") + 0.0])
    data = np.array([[1, 5, 2], [4, 0, 3]], np.float32)
    (out,), _ = _run(ir, {s: data}, [d])
    np.testing.assert_array_equal(out, np.tile(data.max(0), (2, 1)))


def test_float16_add_rounds_once():
    r = 4
    ir, s, (d,) = _program(r, (2,), f16, lambda x: [coll.replicated_all_reduce(x)])
    data = np.array([[2048, 1], [1, 1], [1, 1], [1, 1]], np.float16)
    (out,), _ = _run(ir, {s: data}, [d])
    np.testing.assert_array_equal(out[0], np.float16(data.astype(np.float32).sum(0)))


@pytest.mark.parametrize("r", [1, 2, 4])
def test_replicated_slice_gives_replica_index(r):
    """The replica index without a replica-index op (reference §9)."""
    ir, s, (d,) = _program(r, (1,), f32, lambda x: [
        coll.replicated_slice(popxl.constant(np.arange(r, dtype=np.int32)))])
    (out,), _ = _run(ir, {s: np.zeros((r, 1) if r > 1 else (1,), np.float32)}, [d])
    assert np.shape(out) == ((r,) if r > 1 else ())
    np.testing.assert_array_equal(out, np.arange(r) if r > 1 else 0)


@given(st.sampled_from([2, 4]), st.integers(0, 1), st.integers(1, 2))
def test_replicated_slice_matches_numpy(r, axis, k):
    shape = (r * k, 3) if axis == 0 else (3, r * k)
    ir, s, (d,) = _program(r, shape, f32, lambda x: [coll.replicated_slice(x, axis=axis)])
    data = np.random.default_rng(k).random((r,) + shape, dtype=np.float32)
    (out,), _ = _run(ir, {s: data}, [d])
    for i in range(r):
        want = np.split(data[i], r, axis=axis)[i]
        np.testing.assert_array_equal(out[i], want.squeeze(axis) if k == 1 else want)


def test_collective_inside_repeat_in_lock_step():
    """A repeat body with an all-reduce: every replica meets at every iteration."""
    r = 4
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        s = popxl.h2d_stream((2,), f32)
        x = ops.host_load(s)

        def body(acc):
            return coll.replicated_all_reduce(acc, op="mean") + acc
        g = ir.create_graph(body, x)
        (y,) = ops.repeat(g, 3, x)
        d = popxl.d2h_stream((2,), f32)
        ops.host_store(d, y)
    data = np.random.default_rng(1).random((r, 2), dtype=np.float32)
    (out,), session = _run(ir, {s: data}, [d])
    want = data.astype(np.float64)
    for _ in range(3):
        want = want.mean(0) + want
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert len(session.profile.replicas) == r if hasattr(session.profile, "replicas") else True


# -- refusals ----------------------------------------------------------------------------------
def test_wrapper_refusals():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x = ops.host_load(popxl.h2d_stream((3, 2), f32))
        with pytest.raises(ValueError, match="Not a valid op"):
            coll.replicated_all_reduce(x, op="sum")
        with pytest.raises(ValueError, match="Axis should be an int"):
            coll.replicated_all_gather(x, axis=1.0)
        with pytest.raises(ValueError, match="equally divide"):
            coll.replicated_slice(x, axis=0)
        with pytest.raises(ValueError, match="output_shape"):
            coll.replicated_all_gather(x, output_shape="stack")


@pytest.mark.parametrize("build,match", [
    (lambda x: coll.replicated_all_reduce(x, op="and"), "logical"),
    (lambda x: coll.replicated_all_reduce(ops.cast(x, i32), op="mean"), "integer"),
    (lambda x: coll.replicated_all_reduce(ops.cast(x, popxl.bool)), "dtype bool"),
])
@emulator_only
def test_compile_refusals(build, match):
    ir, s, _ = _program(2, (3,), f32, lambda x: [build(x)])
    with pytest.raises(COMPILE_ERRORS, match=match):
        popxl.Session(ir, "ipu_model")


@emulator_only
def test_diverging_replicas_raise_not_hang():
    """A collective in a branch only replica 0 takes: the device would deadlock."""
    from popxl_flash.emulator.errors import PopartError
    r = 2
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        x = ops.host_load(popxl.h2d_stream((2,), f32))
        idx = coll.replicated_slice(popxl.constant(np.arange(r, dtype=np.int32)))
        cond = ops.equal(idx, popxl.constant(0, i32)).reshape((1,))
        then_g = ir.create_graph(lambda t: coll.replicated_all_reduce(t), x)
        else_g = ir.create_graph(lambda t: t + 1.0, x)
        (y,) = ops.conditional(cond, then_g, else_g, [x], [x])
        ops.host_store(popxl.d2h_stream((2,), f32), y)
    (s,) = ir.get_all_h2d_streams()
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(PopartError, match="same sequence of collectives"):
            session.run({s: np.zeros((r, 2), np.float32)})


# -- autodiff ----------------------------------------------------------------------------------
def test_all_gather_grad_is_local_slice():
    """ReplicatedAllGatherOp's grad op is a Local reduce-scatter (no sum over replicas)."""
    r = 2
    ir = popxl.Ir(replication=r)
    with ir.main_graph:
        g = ir.create_graph(lambda t: coll.replicated_all_gather(t), popxl.TensorSpec((3,), f32))
        info = popxl.transforms.autodiff(g)
        sx, sdy = popxl.h2d_stream((3,), f32), popxl.h2d_stream((6,), f32, name="dy")
        x, dy = ops.host_load(sx), ops.host_load(sdy)
        (dx,) = ops.call(info.graph, dy, inputs_dict=info.inputs_dict(ops.call_with_info(g, x)))
        d = popxl.d2h_stream((3,), f32)
        ops.host_store(d, dx)
    dys = np.arange(12, dtype=np.float32).reshape(2, 6)
    (out,), _ = _run(ir, {sx: np.zeros((2, 3), np.float32), sdy: dys}, [d])
    np.testing.assert_array_equal(out, np.stack([dys[0, :3], dys[1, 3:]]))


def test_reduce_scatter_add_has_no_grad():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        g = ir.create_graph(lambda t: coll.replicated_reduce_scatter(t),
                            popxl.TensorSpec((4,), f32))
        with pytest.raises(IR_ERRORS, match="Local"):
            popxl.transforms.autodiff(g)


# -- profile -----------------------------------------------------------------------------------
@emulator_only
def test_profile_per_replica_and_collective_bytes():
    r, n = 4, 8
    ir, s, (d,) = _program(r, (n,), f32, lambda x: [
        coll.replicated_all_reduce(coll.replicated_all_gather(x))])
    data = np.ones((r, n), np.float32)
    (_out,), session = _run(ir, {s: data}, [d])
    prof = session.profile
    assert len(prof.replicas) == r
    gather = (r - 1) * n * 4                 # (G-1) input sizes received
    reduce = 2 * (r - 1) * (r * n * 4 // r)  # ring reduce-scatter + all-gather
    assert [p.collective_bytes for p in prof.replicas] == [gather + reduce] * r
    assert prof.collective_bytes == r * (gather + reduce)
    assert prof.peak_live_bytes == max(p.peak_live_bytes for p in prof.replicas)


# -- replica groupings -------------------------------------------------------------------------
def _members(assignment):
    """Groups of a grouping as lists of replicas in rank order."""
    return [[r for r, g in enumerate(assignment) if g == k] for k in range(max(assignment) + 1)]


_GROUPINGS = [(1, 2), (2, 2), (1, 4), (4, 1), (1, 1), (2, 1)]  # (stride, group_size), R = 4


@pytest.mark.parametrize("stride,size", _GROUPINGS)
def test_collectives_with_groups_match_numpy(stride, size):
    """GCL's CONSECUTIVE comm group: replica r is in group r % s + s (r // (s G)), ranked by
    index (willow/src/replicagrouping.cpp, popx/op/collectives/collectivesx.cpp)."""
    r, n = 4, 8
    ir = popxl.Ir(replication=r)
    group = ir.replica_grouping(stride=stride, group_size=size)
    with ir.main_graph:
        s = popxl.h2d_stream((n,), f32)
        x = ops.host_load(s)
        outs = [coll.replicated_all_gather(x, group=group),
                coll.replicated_reduce_scatter(x, op="add", group=group),
                coll.replicated_all_reduce(x, op="max", group=group),
                coll.replicated_slice(x, group=group)]
        streams = []
        for t in outs:
            streams.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(streams[-1], t)
    data = np.random.default_rng(stride * 10 + size).random((r, n), dtype=np.float32)
    got, _ = _run(ir, {s: data}, streams)
    for members in _members(group.assignment):
        block = data[members]
        chunk = n // size
        for rank, rep in enumerate(members):
            np.testing.assert_array_equal(got[0][rep], block.reshape(-1))
            np.testing.assert_allclose(got[1][rep], block.sum(0)[rank * chunk:(rank + 1) * chunk],
                                       rtol=1e-6)
            np.testing.assert_array_equal(got[2][rep], block.max(0))
            np.testing.assert_array_equal(got[3][rep], data[rep][rank * chunk:(rank + 1) * chunk])


def test_replica_index_in_group():
    """replicated_slice of arange(G) with a group gives the rank in the group (reference §9)."""
    r = 4
    ir = popxl.Ir(replication=r)
    group = ir.replica_grouping(stride=2, group_size=2)  # groups {0, 2}, {1, 3}
    with ir.main_graph:
        ops.host_load(popxl.h2d_stream((1,), f32))
        idx = coll.replicated_slice(popxl.constant(np.arange(2, dtype=np.int32)), group=group)
        d = popxl.d2h_stream((), i32)
        ops.host_store(d, idx)
    (s,) = ir.get_all_h2d_streams()
    (out,), _ = _run(ir, {s: np.zeros((r, 1), np.float32)}, [d])
    np.testing.assert_array_equal(out, [0, 0, 1, 1])


def test_non_constant_grouping_refused_by_collectives():
    ir = popxl.Ir(replication=4)
    group = ir.replica_grouping_from_assignments([0, 1, 1, 0])
    with ir.main_graph:
        x = ops.host_load(popxl.h2d_stream((4,), f32))
        with pytest.raises(NotImplementedError, match="non-constant stride"):
            coll.replicated_all_reduce(x, group=group)


@pytest.mark.parametrize("stride,size", [(1, 1), (2, 2), (1, 2)])
def test_grouped_variables_per_replica(stride, size):
    """A variable with a replica grouping: host value [num_groups, *shape], each replica gets
    its group's row; one_per_group retrieval reads each group's first replica."""
    r = 4
    ir = popxl.Ir(replication=r)
    group = ir.replica_grouping(stride=stride, group_size=size)
    init = np.arange(group.num_groups * 3, dtype=np.float32).reshape(group.num_groups, 3)
    with ir.main_graph:
        v = popxl.variable(init, name="v", replica_grouping=group)
        assert v.shape == (3,) and v.shape_on_host == (group.num_groups, 3)
        idx = coll.replicated_slice(popxl.constant(np.arange(r, dtype=np.float32)))
        v2 = ops.var_updates.accumulate_(v, idx.reshape((1,)) + popxl.constant(
            np.zeros(3, np.float32)))
        d = popxl.d2h_stream((3,), f32)
        ops.host_store(d, v2 + 0.0)
    (out,), session = _run(ir, {}, [d])
    assignment = group.assignment
    want = np.stack([init[assignment[rep]] + rep for rep in range(r)])
    np.testing.assert_array_equal(out, want)
    firsts = [assignment.index(g) for g in range(group.num_groups)]
    np.testing.assert_array_equal(session.get_tensor_data(v), want[firsts])


@emulator_only
def test_error_in_one_replica_stops_the_others():
    """Replica 1 traps (floating-point checks) before a collective replica 0 waits at: the
    run raises the trap, never hangs."""
    import popxl_flash as pf
    r = 2
    ir, s, (d,) = _program(r, (2,), f32, lambda x: [coll.replicated_all_reduce(ops.exp(x))])
    pf.enable_floating_point_checks(ir)
    data = np.array([[0, 1], [1e30, 0]], np.float32)  # exp overflows on replica 1 only
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(FloatingPointError):
            session.run({s: data})


def test_non_constant_grouped_variable_per_replica():
    """assignment [0, 1, 1, 0]: replicas 0 and 3 share group 0's row, 1 and 2 group 1's; the
    host value read back is each group's first replica's (PopXL's to_device/to_host maps)."""
    r = 4
    ir = popxl.Ir(replication=r)
    group = ir.replica_grouping_from_assignments([0, 1, 1, 0])
    init = np.array([[1, 2, 3], [10, 20, 30]], np.float32)
    with ir.main_graph:
        v = popxl.variable(init, name="v", replica_grouping=group)
        idx = coll.replicated_slice(popxl.constant(np.arange(r, dtype=np.float32)))
        v2 = ops.var_updates.accumulate_(v, idx.reshape((1,)) + popxl.constant(
            np.zeros(3, np.float32)))
        d = popxl.d2h_stream((3,), f32)
        ops.host_store(d, v2 + 0.0)
    (out,), session = _run(ir, {}, [d])
    want = np.stack([init[g] + rep for rep, g in enumerate([0, 1, 1, 0])])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(session.get_tensor_data(v), want[[0, 1]])
