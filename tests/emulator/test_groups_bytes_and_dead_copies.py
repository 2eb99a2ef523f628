"""Replica groupings on 8 replicas with the members written out by hand (GCL's CONSECUTIVE
comm group: replica r is in group ``r % s + s (r // (s G))``, ranked by index), the collective
bytes of each collective kind and with groups, and a call's copy back that is dead because
nothing reads its by-ref input after the call.
"""
import numpy as np
import pytest

from conftest import emulator_only
from popxl_flash import popxl

ops = popxl.ops
coll = ops.collectives
f32 = popxl.float32
R, N = 8, 8

#: (stride, group size) -> the groups of 8 replicas, in rank order, worked out by hand.
GROUPS_OF_8 = {
    (2, 4): [[0, 2, 4, 6], [1, 3, 5, 7]],
    (2, 2): [[0, 2], [1, 3], [4, 6], [5, 7]],
    (4, 2): [[0, 4], [1, 5], [2, 6], [3, 7]],
    (1, 4): [[0, 1, 2, 3], [4, 5, 6, 7]],
    (1, 8): [list(range(8))],
}


def _run_collectives(stride, size, build):
    ir = popxl.Ir(replication=R)
    group = ir.replica_grouping(stride=stride, group_size=size)
    with ir.main_graph:
        s = popxl.h2d_stream((N,), f32)
        outs = build(ops.host_load(s), group)
        streams = []
        for t in outs:
            streams.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(streams[-1], t)
    data = (np.arange(R * N, dtype=np.float32).reshape(R, N) + 1) ** 1.5
    with popxl.Session(ir, "ipu_model") as session:
        res = session.run({s: data})
    return [res[t] for t in streams], data, session.profile


@pytest.mark.parametrize("stride,size", list(GROUPS_OF_8))
def test_collectives_reduce_over_the_hand_written_groups(stride, size):
    (gathered, scattered, reduced), data, _ = _run_collectives(stride, size, lambda x, g: [
        coll.replicated_all_gather(x, group=g),
        coll.replicated_reduce_scatter(x, op="add", group=g),
        coll.replicated_all_reduce(x, op="add", group=g)])
    chunk = N // size
    for members in GROUPS_OF_8[(stride, size)]:
        total = data[members].sum(0)
        for rank, rep in enumerate(members):
            np.testing.assert_array_equal(gathered[rep], data[members].reshape(-1))
            np.testing.assert_allclose(reduced[rep], total, rtol=1e-6)
            np.testing.assert_allclose(scattered[rep], total[rank * chunk:(rank + 1) * chunk],
                                       rtol=1e-6)


@emulator_only
@pytest.mark.parametrize("stride,size", [(2, 4), (1, 8), (4, 2)])
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "slice"])
def test_collective_bytes_per_kind(stride, size, kind):
    """Bytes one replica receives under a ring schedule: all-gather (G-1) input sizes,
    reduce-scatter (G-1) output chunks, all-reduce twice the reduce-scatter's, a Local slice
    nothing."""
    build = {"all_gather": lambda x, g: [coll.replicated_all_gather(x, group=g)],
             "reduce_scatter": lambda x, g: [coll.replicated_reduce_scatter(x, op="add",
                                                                            group=g)],
             "all_reduce": lambda x, g: [coll.replicated_all_reduce(x, op="add", group=g)],
             "slice": lambda x, g: [coll.replicated_slice(x, group=g)]}[kind]
    _, _, profile = _run_collectives(stride, size, build)
    chunk_bytes = 4 * N // size
    want = {"all_gather": (size - 1) * 4 * N, "reduce_scatter": (size - 1) * chunk_bytes,
            "all_reduce": 2 * (size - 1) * chunk_bytes, "slice": 0}[kind]
    assert [p.collective_bytes for p in profile.replicas] == [want] * R


# -- a dead copy back ---------------------------------------------------------------------------
B = 4 * 64


def _inc(a: popxl.TensorByRef):
    ops.add_(a, popxl.constant(np.float32(1.0)))


@emulator_only
@pytest.mark.parametrize("read_after", [False, True])
def test_copy_back_of_a_by_ref_input_nobody_reads_after_is_dead(read_after):
    """One by-ref graph called from main on a variable and from another graph h on h's input:
    the call sites conflict (a variable parent), so both copy in (B each). h's input is
    modified by the inner call; read afterwards in h, it is also copied back (B); not read,
    the copy back is dead code (AliasZeroCopy::disableDeadCodeNodes): 2B or 3B in all."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = ops.init((64,), f32, init_type="zero")
        w = popxl.variable(np.zeros(64, np.float32))
        g = ir.create_graph(_inc, x)

        def h(a, b):
            ops.call(g, a)
            return (a + b) if read_after else b * 3.0
        hg = ir.create_graph(h, x, x)
        ops.call(g, w)
        y = ops.call(hg, x, x + 1.0)[0]
        s = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(s, y)
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        profile = session.profile
    assert profile.bytes_copied == (3 * B if read_after else 2 * B)
    assert profile.bytes_copied_by_kind["call"] == profile.bytes_copied
