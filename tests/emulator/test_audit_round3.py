"""Round-3 audit of the emulator's newer PopXL constructs against PopART sdk-release-3.4.

Each test names the PopART source that settles it: the popxl wrapper
(``python/popxl/python_files/**.py``), the op's ``setup()`` (``willow/src/op/**.cpp``: raises
when the op is built) or its lowering (``willow/src/popx/**``: raises when ``popxl.Session``
compiles the Ir).
"""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, emulator_only, run, run_fn, store
from popxl_flash import popxl

ops = popxl.ops
RNG = np.random.default_rng(3)
X = RNG.standard_normal((2, 3)).astype(np.float32)
Y = RNG.standard_normal((2, 3)).astype(np.float32)


def _fails_at_session(build):
    """``build()`` (returning a tensor) must build in a main graph; the Session must refuse."""
    ir = popxl.Ir()
    with ir.main_graph:
        store(build())
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


# --- scaled_add: ops/scaled_add.py (a Tensor ``a`` -> input 2 and attribute 1.0, a Tensor ``b``
# -> input 3); popx/op/scaledaddx.cpp ScaledAddOpx::compute ----------------------------------


def _scale(v):
    return popxl.constant(np.float32(v))


@pytest.mark.parametrize("b", [2.0, 1.0])
def test_scaled_add_tensor_a_with_float_b_fails_at_session(b):
    """compute(): 'Unsupported tensor scale0 with non-tensor scale1.'"""
    _fails_at_session(lambda: ops.scaled_add(popxl.constant(X), popxl.constant(Y),
                                             _scale(0.5), b))


def test_scaled_add_float_a_not_one_with_tensor_b_fails_at_session():
    """compute(): 'Unsupported scale0 {} with tensor scale1.' unless scale0 == 1."""
    _fails_at_session(lambda: ops.scaled_add(popxl.constant(X), popxl.constant(Y), 0.5,
                                             _scale(2.0)))


def test_scaled_add_in_place_float_a_not_one_with_tensor_b_fails_at_session():
    """ScaledAddLhsInplaceOpx shares compute()."""
    def build():
        x = popxl.variable(X)
        return ops.scaled_add_(x, popxl.constant(Y), 3.0, _scale(2.0))
    _fails_at_session(build)


def test_scaled_add_accepted_scale_combinations_compute():
    """The three forms the lowering supports: float/float, 1/tensor, tensor/tensor."""
    got = run_fn(lambda x, y: [ops.scaled_add(x, y, 0.5, -2.0),
                               ops.scaled_add(x, y, 1.0, _scale(-2.0)),
                               ops.scaled_add(x, y, _scale(0.5), _scale(-2.0))], X, Y)
    want = [0.5 * X - 2.0 * Y, X - 2.0 * Y, 0.5 * X - 2.0 * Y]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# --- random ops: ops/random.py, ops/random_seed.py, ops/utils.py; op/shapeorlike.cpp ---------


def _seed():
    return popxl.constant(np.array([7, 11], np.uint32))


@pytest.mark.parametrize("fn", [ops.random_uniform, ops.random_normal])
def test_random_dtype_none_is_float32(fn):
    """convert_optional_dtype(None) leaves the type unset; ShapeOrLikeOp::setupWithShape then
    defaults to FLOAT. Same values as an explicit float32."""
    a, b = run_fn(lambda s: [fn(s, (2, 3), dtype=None), fn(s, (2, 3))],
                  np.array([7, 11], np.uint32))
    assert a.dtype == np.float32 and a.shape == (2, 3)
    np.testing.assert_array_equal(a, b)


def test_split_random_seed_non_tensor_seed_is_type_error():
    """create_random_seed runs check_in_graph (TypeError for a non-Tensor) before its
    shape/dtype ValueError."""
    ir = popxl.Ir()
    with ir.main_graph, pytest.raises(TypeError, match="seed"):
        ops.split_random_seed(np.array([1, 2], np.uint32))


def test_split_random_seed_seed_of_other_graph_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        s = _seed()
    g = ir.create_empty_graph("g")
    with g, pytest.raises(ValueError, match="not in the current Graph"):
        ops.split_random_seed(s)


# --- autodiff through the random ops: willow/src/op/dropout.cpp (DropoutOp::getGradOps,
# DropoutGradOp reads the seed); RandomUniformOp, RandomNormalOp and ModifyRandomSeedOp keep
# Op::getGradOps (willow/src/op.cpp: none), so the gradient stops there ----------------------


def _grad_of(build, x, required=lambda g: [g.inputs[0]]):
    """Gradient of ``build(x, seed)`` w.r.t. x for dy = 1 (the seed a graph input)."""
    ir = popxl.Ir()
    with ir.main_graph:
        xs = [popxl.constant(x), _seed()]
        graph = ir.create_graph(build, *xs)
        info = popxl.transforms.autodiff(graph, grads_required=required(graph))
        call = ops.call_with_info(graph, *xs)
        dx, = ops.call(info.graph, popxl.constant(np.ones_like(x)),
                       inputs_dict=info.inputs_dict(call))
        mask = ops.dropout(popxl.constant(np.ones_like(x)), xs[1], 0.25)
    return run(ir, None, [dx, mask])


@emulator_only  # on the IPU two dropout ops share a mask only through their reference tensor
def test_dropout_gradient_is_dropout_of_dy_with_the_forward_mask():
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    dx, mask = _grad_of(lambda t, s: ops.dropout(t, s, 0.25), x)
    assert (mask == 0).any() and (mask != 0).any()
    np.testing.assert_array_equal(dx, mask)


def test_gradient_stops_at_random_ops():
    """x * u + n (u, n from the seed): d/dx = u; the seed needs no gradient rule."""
    x = RNG.standard_normal((3,)).astype(np.float32)

    def f(t, s):
        s1 = ops.split_random_seed(s, 1)[0]
        return t * ops.random_uniform(s1, (3,)) + ops.random_normal(s, (3,))
    dx, _ = _grad_of(f, x)
    u = run_fn(lambda s: ops.random_uniform(ops.split_random_seed(s, 1)[0], (3,)),
               np.array([7, 11], np.uint32))
    np.testing.assert_array_equal(dx, u)


def test_required_gradient_of_a_seed_is_unavailable():
    """No grad op produces the seed's gradient: backwardsgraphcreatorhelper.cpp 'Unable to
    provide required gradient output' (an IR error, not NotImplementedError)."""
    from conftest import IR_ERRORS
    ir = popxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda t, s: t * ops.random_normal(s, (3,)),
                                popxl.constant(np.ones(3, np.float32)), _seed())
        with pytest.raises(IR_ERRORS, match="Unable to provide required gradient"):
            popxl.transforms.autodiff(graph)


# --- popxl.session's type aliases: python_files/session.py (typing.Mapping aliases) -----------


def test_stream_buffer_maps_are_typing_aliases_not_dict():
    """``d2hStreamBufferMaps = Mapping[DeviceToHostStream, np.ndarray]``: a type hint only;
    calling it or an isinstance check raise TypeError (they worked with ``dict``)."""
    from popxl_flash.emulator.session import STREAM_BUFFER_MAPS
    assert set(STREAM_BUFFER_MAPS) == {"d2hStreamBufferMaps", "h2dStreamBufferMaps",
                                       "StreamBufferMaps"}
    for alias in STREAM_BUFFER_MAPS.values():
        with pytest.raises(TypeError):
            isinstance({}, alias)
    with pytest.raises(TypeError):
        STREAM_BUFFER_MAPS["d2hStreamBufferMaps"]()


# --- Session of an Ir without ops: python_files/session.py (_get_ipus_per_replica, called by
# _get_ipu_count when device_desc is a string; willow/src/graph.cpp getAllVirtualGraphIds) ----


def test_session_of_an_ir_without_ops_is_runtime_error():
    ir = popxl.Ir()
    with ir.main_graph:
        popxl.variable(np.ones(3, np.float32))  # a variable is no op
    with pytest.raises(RuntimeError, match="has no graphs"):
        popxl.Session(ir, "ipu_model")
    with pytest.raises(RuntimeError, match="has no graphs"):
        popxl.Session(popxl.Ir(), "cpu")


# --- install()'s op-file modules: python_files/ops/*.py, ops/var_updates/*.py, transforms/*.py
# hold only their own names (ops/__init__.py imports each name from its file) -----------------


@pytest.mark.parametrize("module, present, absent", [
    ("popxl.ops.add", ("add", "add_"), ("matmul", "dropout")),
    ("popxl.ops.random", ("random_uniform", "random_normal"), ("dropout", "split_random_seed")),
    ("popxl.ops.random_seed", ("split_random_seed",), ("random_uniform",)),
    ("popxl.ops.host_load", ("host_load", "init"), ("host_store",)),
    ("popxl.ops.var_updates.accumulate", ("accumulate_", "accumulator_zero_"),
     ("adam_updater",)),
    ("popxl.transforms.merge_exchange", ("merge_exchange", "io_tile_exchange"),
     ("decompose_sum",)),
    ("popxl.ops.collectives.replicated_reduce_scatter",
     ("replicated_reduce_scatter", "replicated_slice"), ("replicated_all_gather",)),
    ("popxl.ops.collectives.replicated_all_gather", ("replicated_all_gather",),
     ("replicated_slice",)),
])
def test_op_file_modules_hold_only_their_files_names(module, present, absent):
    from popxl_flash.emulator import installer
    mod = installer.MODULES[module]
    for name in present:
        getattr(mod, name)
    for name in absent:
        with pytest.raises(AttributeError):
            getattr(mod, name)


def test_collectives_file_modules_give_the_implemented_ops():
    """``from popxl.ops.collectives.replicated_all_gather import replicated_all_gather`` works in
    PopXL; the emulator's module was a stub raising NotImplementedError."""
    from popxl_flash.emulator import installer
    coll = installer.MODULES["popxl.ops.collectives"]
    mod = installer.MODULES["popxl.ops.collectives.replicated_all_gather"]
    assert mod.replicated_all_gather is coll.replicated_all_gather
    assert installer.MODULES["popxl.ops"].collectives.replicated_slice is coll.replicated_slice


# --- popxl.ops.utils.check_tensor_ipu_and_tile_set: python_files/ops/utils.py ----------------


def test_check_tensor_ipu_and_tile_set_needs_tensors():
    """No tensor: ``zip(*[])`` unpacked into three names (ValueError); a non-Tensor has no
    ``_get_ipu_and_tile_set`` (AttributeError); tensors of the emulator's one IPU pass."""
    from popxl_flash.emulator.utils import OPS_UTILS
    check = OPS_UTILS["check_tensor_ipu_and_tile_set"]
    with pytest.raises(ValueError):
        check()
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(X)
        with pytest.raises(AttributeError):
            check(t=t, y=np.ones(3))
        check(t=t, u=popxl.constant(Y))


def test_tensor_has_no_nbytes():
    """PopXL 3.4's Tensor (python_files/tensor.py) has no ``nbytes``."""
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(X)
    assert not hasattr(t, "nbytes")


def test_ir_stream_getters_return_sets():
    """Ir.get_all_h2d_streams / get_all_d2h_streams (python_files/ir.py) build sets: not
    indexable, no order."""
    ir = popxl.Ir()
    with ir.main_graph:
        s = popxl.h2d_stream((3,), popxl.float32)
        store(ops.host_load(s))
        popxl.h2d_stream((3,), popxl.float32)  # no host_load: not listed
    assert ir.get_all_h2d_streams() == {s}
    assert isinstance(ir.get_all_d2h_streams(), set)
    with pytest.raises(TypeError):
        ir.get_all_h2d_streams()[0]


# --- popart._internal.ir.GraphId: python/popart._internal.ir/bindings/graphid.cpp -----------


def test_graph_id_is_a_graph_id_not_a_str():
    """``Graph.id`` of the bindings is a GraphId: ``str()`` method, equality with GraphIds and
    (implicitly converted) strs, usable as a dict key; none of str's methods."""
    from popxl_flash.emulator import _internal_ir as _ir
    ir = popxl.Ir()
    g = ir.create_empty_graph("g")
    gid = g._pb_graph.id
    assert isinstance(gid, _ir.GraphId) and not isinstance(gid, str)
    assert gid.str() == str(gid) == g.id and gid == g.id and gid == _ir.GraphId(g.id)
    assert {gid: 1}[_ir.GraphId(g.id)] == 1
    assert not hasattr(gid, "startswith")
    with pytest.raises(TypeError):
        _ir.GraphId(3)
    info = _ir.BwdGraphInfo(gid, [], [])
    assert isinstance(info.bwdGraphId, _ir.GraphId)
    assert popxl.Graph._from_pb(ir._pb_ir.getGraph(info.bwdGraphId)) is g


# --- Session.write_variables_data: python_files/session.py --------------------------------------


def test_write_all_replicas_variable_of_groups_is_not_implemented_in_popxl():
    """PopXL raises NotImplementedError for a variable with retrieval_mode "all_replicas" and
    groups of more than one replica (the emulator wrote it)."""
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), retrieval_mode="all_replicas")
        ops.host_store(popxl.d2h_stream((3,), popxl.float32), v + 0.0)
    session = popxl.Session(ir, "ipu_model")
    with pytest.raises(NotImplementedError, match="all_replicas"):
        session.write_variable_data(v, np.ones(3, np.float32))


# --- __all__ of popxl and its packages: __init__.py.in, python_files/ops/__init__.py (floor,
# log2 and remote_code_load are imported but not listed), var_updates, collectives, transforms --


def test_all_lists_are_popxl_34s():
    ops_all = set(ops.__all__)
    assert {"floor", "log2", "remote_code_load"}.isdisjoint(ops_all)
    assert {"add", "collectives", "var_updates", "dropout", "tanh"} <= ops_all
    assert len(ops.__all__) == 128
    assert "replica_sharded_buffer" not in popxl.__all__ and "Ir" in popxl.__all__
    assert len(popxl.__all__) == 57
    assert len(ops.var_updates.__all__) == 13 and len(ops.collectives.__all__) == 11
    assert len(popxl.transforms.__all__) == 7
