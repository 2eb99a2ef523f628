"""Audit of the emulator against PopART sdk-release-3.4's source, fourth round: constructs
the emulator refused although PopXL accepts them, or accepted although PopXL refuses them.

Each test is written against ``popxl_flash.popxl`` and runs unchanged on the SDK; the source
that settles it is named in the docstring.
"""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, IR_ERRORS, run, store
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32


# -- Session.run_with_outputs ------------------------------------------------------------------
def _one_output_ir(nht=1):
    ir = popxl.Ir()
    ir.num_host_transfers = nht
    with ir.main_graph:
        x = popxl.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
        s = store(x + 1.0)
    return ir, s


def test_run_with_outputs_refuses_an_array_of_the_right_size_but_wrong_shape():
    """``Session._verify_io_shape`` (``python_files/session.py``) compares the array's data
    dims with the stream shape: ValueError, before anything runs."""
    ir, s = _one_output_ir()
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(ValueError, match="Shape mismatch"):
            session.run_with_outputs({}, {s: np.zeros((3, 2), np.float32)})
        out = np.zeros((2, 3), np.float32)
        session.run_with_outputs({}, {s: out})
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3) + 1)


def test_run_with_outputs_refuses_too_few_host_transfers():
    """Dimension 0 must be at least ``num_host_transfers`` (``_verify_io_shape``)."""
    ir = popxl.Ir()
    ir.num_host_transfers = 2
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        s = popxl.d2h_stream(x.shape, f32)
        ops.host_store(s, x)
        ops.host_store(s, x + 1.0)
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(ValueError, match="not large enough"):
            session.run_with_outputs({}, {s: np.zeros((1, 3), np.float32)})
        out = np.zeros((2, 3), np.float32)
        session.run_with_outputs({}, {s: out})
    np.testing.assert_array_equal(out, [[1, 1, 1], [2, 2, 2]])


def test_unwritten_d2h_entry_is_not_an_error():
    """PopXL checks no count of ``host_store``s: a run that writes fewer entries than
    ``num_host_transfers`` completes (the unwritten entries are unspecified)."""
    ir = popxl.Ir()
    ir.num_host_transfers = 2
    with ir.main_graph:
        x = popxl.constant(np.full(3, 7.0, np.float32))
        s = popxl.d2h_stream(x.shape, f32)
        ops.host_store(s, x)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
    np.testing.assert_array_equal(out[0], [7, 7, 7])


# -- inplacing ambiguity -----------------------------------------------------------------------
def _updating_graph(ir):
    g = ir.create_empty_graph("upd")
    with g:
        v = popxl.graph_input((3,), f32, "v", by_ref=True)
        ops.var_updates.accumulate_(v, popxl.constant(np.ones(3, np.float32)))
    return g


def test_two_unordered_by_ref_calls_updating_one_variable_compile():
    """``Op::growAliasModelMulti`` (``willow/src/op.cpp``) adds a modifying edge only for an
    input that aliases an output; PopXL's CallOp has no input-output alias, so two by-ref
    calls with no order between them are not an inplacing ambiguity."""
    ir = popxl.Ir()
    g = _updating_graph(ir)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        ops.call(g, v)
        ops.call(g, v)
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        np.testing.assert_array_equal(session.get_tensor_data(v), [2, 2, 2])


def test_in_place_op_and_unordered_reader_stay_ambiguous():
    """An in-place op's input 0 aliases its output: still a modifier."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32), name="x")
        y = x * 2.0
        ops.add_(x, popxl.constant(np.float32(1.0)))
        store(y)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


# -- repeat: by-ref loop-carried input ----------------------------------------------------------
def test_by_ref_loop_carried_input_is_copied_back():
    """``ops/repeat.py`` marks a by-ref carried input modified (full region);
    ``LoopOpx::copyModifiedBodyInputsToOpInputs`` copies the body input, as the last iteration
    left it, back into the parent tensor."""
    ir = popxl.Ir()
    body = ir.create_empty_graph("body")
    with body:
        x = popxl.graph_input((3,), f32, "x", by_ref=True)
        x1 = ops.var_updates.accumulate_(x, popxl.constant(np.ones(3, np.float32)))
        popxl.graph_output(x1 * 2.0)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        (out,) = ops.repeat(body, 3, v)
        s = store(out)
    with popxl.Session(ir, "ipu_model") as session:
        r = session.run()[s]
        got = session.get_tensor_data(v)
    # iteration inputs 0 -> 2 -> 6; each adds 1 in place: the last input ends at 7
    np.testing.assert_array_equal(got, [7, 7, 7])
    np.testing.assert_array_equal(r, [14, 14, 14])


# -- CallSiteInfo.set_parent_input_modified ----------------------------------------------------
def test_set_parent_input_modified_makes_in_place_writes_reach_the_parent():
    """``CallSiteInfo.set_parent_input_modified`` (``ops/call.py``) adds the input to the
    CallOp's modified map; ``CallOpx`` copies it back after the call."""
    ir = popxl.Ir()
    g = ir.create_empty_graph("g")
    with g:
        x = popxl.graph_input((3,), f32, "x")
        ops.var_updates.accumulate_(x, popxl.constant(np.ones(3, np.float32)))
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        w = popxl.variable(np.zeros(3, np.float32), name="w")
        info = ops.call_with_info(g, v)
        info.set_parent_input_modified(v)
        ops.call(g, w)  # by value: w keeps its value
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        np.testing.assert_array_equal(session.get_tensor_data(v), [1, 1, 1])
        np.testing.assert_array_equal(session.get_tensor_data(w), [0, 0, 0])


def test_set_parent_input_modified_of_a_non_input_raises():
    """``Op::inIndex``: "Cannot find input index"."""
    ir = popxl.Ir()
    g = ir.create_empty_graph("g")
    with g:
        x = popxl.graph_input((3,), f32, "x")
        popxl.graph_output(x + 1.0)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        other = popxl.variable(np.zeros(3, np.float32), name="other")
        info = ops.call_with_info(g, v)
        with pytest.raises(IR_ERRORS):
            info.set_parent_input_modified(other)


# -- random seeds (host helpers) and random ops ------------------------------------------------
def test_create_seeds_is_host_code_with_popxls_shape_and_words():
    """``python_files/random_seed.py``: uint64 draws of ``default_rng(seed + offset)`` split
    into (high, low) uint32 words, shape ``[bps, gaf, replicas, 2]`` squeezed."""
    seeds = popxl.create_seeds(5, offset=1, batches_per_step=3, replicas=2)
    assert seeds.dtype == np.uint32 and seeds.shape == (3, 2, 2)
    draws = np.random.default_rng(6).integers(0, 2 ** 64 - 1, endpoint=True, dtype="uint64",
                                              size=6)
    words = [(int(d) >> 32, int(d) & 0xFFFFFFFF) for d in draws]
    np.testing.assert_array_equal(seeds.reshape(6, 2), np.array(words, np.uint32))
    assert popxl.create_seeds(1).shape == (2,)


def test_random_seed_word_helpers():
    two_uint32_to_uint64 = popxl.random_seed.two_uint32_to_uint64
    uint64_to_two_uint32 = popxl.random_seed.uint64_to_two_uint32
    assert uint64_to_two_uint32(2 ** 40 + 7) == (2 ** 8, 7)
    assert two_uint32_to_uint64(2 ** 8, 7) == 2 ** 40 + 7
    with pytest.raises(ValueError):
        uint64_to_two_uint32(-1)
    with pytest.raises(ValueError):
        two_uint32_to_uint64(2 ** 32, 0)


def test_create_random_seed_from_its_module():
    """``popxl.ops.random_seed.create_random_seed`` exists (not in ``popxl.ops``); two
    modifiers give two seeds that keep word 0."""
    create_random_seed = popxl.ops.random_seed.create_random_seed
    ir = popxl.Ir()
    with ir.main_graph:
        seed = popxl.constant(np.array([3, 4], np.uint32))
        a = create_random_seed(seed, popxl.constant(0, popxl.uint32))
        b = create_random_seed(seed, popxl.constant(1, popxl.uint32))
        with pytest.raises(ValueError):
            create_random_seed(popxl.constant(np.array([1, 2, 3], np.uint32)),
                               popxl.constant(0, popxl.uint32))
    ra, rb = run(ir, None, [a, b])
    assert ra[0] == rb[0] == 3 and ra[1] != rb[1]


def test_random_uniform_int32_gives_integers_in_the_closed_range():
    """``RandomUniformOp`` takes any output type (``setupWithShape``); poprand's uniform
    generates int32 in ``[low, high]``."""
    ir = popxl.Ir()
    with ir.main_graph:
        seed = popxl.constant(np.array([1, 2], np.uint32))
        x = ops.random_uniform(seed, (2000,), low=-2, high=3, dtype=popxl.int32)
    r = run(ir, None, x)
    assert r.dtype == np.int32 and set(np.unique(r)) == {-2, -1, 0, 1, 2, 3}


def test_random_normal_int32_and_dropout_of_int_build_and_fail_at_session():
    """Op setup accepts them (``setupWithShape``, ``DropoutOp::setup``); poprand's normal and
    dropout take float types only: the lowering refuses."""
    for build in (lambda s: ops.random_normal(s, (3,), dtype=popxl.int32),
                  lambda s: ops.dropout(popxl.constant(np.arange(3, dtype=np.int32)), s, 0.5)):
        ir = popxl.Ir()
        with ir.main_graph:
            store(build(popxl.constant(np.array([1, 2], np.uint32))))
        with pytest.raises(COMPILE_ERRORS):
            popxl.Session(ir, "ipu_model")


# -- collectives and replica groupings ---------------------------------------------------------
coll = ops.collectives


def _replica_index_program(replicas, collective):
    """Each replica's variable holds its replica index (``[R, 1]`` with groups of one);
    ``collective(x)`` is stored."""
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.arange(replicas, dtype=np.int32)[:, None],
                           replica_grouping=ir.replica_grouping(1, 1))
        s = store(collective(x, ir))
    with popxl.Session(ir, "ipu_model") as session:
        return session.run()[s]


@pytest.mark.parametrize("stride,size", [(1, 2), (1, 4), (2, 2), (4, 2), (1, 8)])
def test_reduce_scatter_of_fewer_elements_than_replicas(stride, size):
    """PopART's ``tests/integration/popxl/test_replica_grouping.py``: a one-element
    reduce-scatter gives the group's first replica the group's sum, every other replica 0."""
    out = _replica_index_program(8, lambda x, ir: coll.replicated_reduce_scatter(
        x, "add", group=ir.replica_grouping(stride, size)))
    assignment = popxl.Ir(replication=8).replica_grouping(stride, size).assignment
    for r in range(8):
        members = [q for q in range(8) if assignment[q] == assignment[r]]
        assert out[r].tolist() == ([sum(members)] if r == members[0] else [0])


def test_rts_reduce_scatter_builds_with_its_meta_shape_and_gathers_back():
    """``ReplicatedReduceScatterOp::setup`` gives an RTS output the input's shape as meta shape;
    an all-gather with ``output_shape="auto"`` then restores that shape."""
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x = popxl.variable(np.arange(9, dtype=np.float32).reshape(3, 3))
        y = coll.replicated_reduce_scatter(
            x, "add", configure_output_for_replicated_tensor_sharding=True)
        assert y.shape == (5,) and y.meta_shape == (3, 3)  # 9 elements: the last chunk padded
        z = coll.replicated_all_gather(y)
        assert z.shape == (3, 3)
        s = store(z)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
    np.testing.assert_array_equal(out[0], 2 * np.arange(9).reshape(3, 3))
    np.testing.assert_array_equal(out[1], out[0])


def test_grouping_that_no_longer_tiles_the_replicas_is_refused_at_session():
    """A grouping that tiles the replicas when the variable is created (else PopART refuses it
    then: ``test_fidelity_round4.py``), after ``replication_factor`` changed: PopART's C++
    ``ReplicaGrouping`` refuses it when the Session prepares the weights."""
    ir = popxl.Ir(replication=3)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), replica_grouping=ir.replica_grouping(1, 3))
        store(v + 1.0)
    ir.replication_factor = 4
    with pytest.raises(COMPILE_ERRORS, match="divisible by the product"):
        popxl.Session(ir, "ipu_model")


def test_all_replicas_retrieval_of_a_grouped_variable():
    """``Session.get_tensors_data``: ``"all_replicas"`` with groups of more than one replica
    reads every replica's weights, ``[replication_factor, ...]``."""
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        v = popxl.variable(np.zeros((2, 3), np.float32), retrieval_mode="all_replicas",
                           replica_grouping=ir.replica_grouping(2, 2))
        idx = coll.replicated_slice(popxl.constant(np.arange(4, dtype=np.float32)))
        ops.var_updates.accumulate_(v, idx.reshape((1,)) * popxl.constant(np.ones(3, np.float32)))
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
        got = session.get_tensor_data(v)
    assert got.shape == (4, 3)
    # row r: replica r's own copy, which added its replica index
    np.testing.assert_array_equal(got, np.repeat(np.arange(4, dtype=np.float32)[:, None], 3, 1))


# -- names -------------------------------------------------------------------------------------
def test_version_and_type_aliases():
    """``popxl/__init__.py.in`` sets ``__version__``; ``python_files/tensor.py`` defines the
    host type aliases."""
    assert isinstance(popxl.__version__, str) and popxl.__version__.split(".")[0].isdigit()
    for name in ("TensorLike", "ScalarType", "HostTensor", "HostScalarTensor",
                 "host_tensor_types"):
        assert hasattr(popxl.tensor, name)


def test_to_collective_op_maps_names_to_collective_operators():
    """``ops/collectives/collectives.py``: ``OP_MAP`` and ``to_collective_op`` ("mul" is Mean
    in 3.4); an unknown name is ValueError."""
    to_op = popxl.ops.collectives.collectives.to_collective_op
    assert to_op("mul") == to_op("mean")
    assert to_op("add") != to_op("mean")
    assert str(to_op("add")).endswith("Add")
    with pytest.raises(ValueError):
        to_op("sum")
