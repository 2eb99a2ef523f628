"""Graph construction: create_graph binding, inputs/outputs, contexts (reference §1, §11.2)."""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, emulator_only, run
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32


def test_main_graph_is_stable():
    ir = popxl.Ir()
    assert ir.main_graph is ir.main_graph or ir.main_graph == ir.main_graph


def test_graph_not_constructible():
    with pytest.raises(TypeError):
        popxl.Graph()


def test_graph_eq_non_graph_is_type_error():
    ir = popxl.Ir()
    with pytest.raises(TypeError):
        _ = ir.main_graph == 3


@pytest.mark.parametrize("helper", ["gcg", "gmg", "gir"])
def test_context_helpers_need_a_context(helper):
    with pytest.raises(RuntimeError):
        getattr(popxl, helper)()


def test_context_helpers_inside_nested_graphs():
    ir = popxl.Ir()
    main = ir.main_graph
    with main:
        assert popxl.gcg() == main
        sub = ir.create_empty_graph("sub")
        with sub:
            assert popxl.gcg() == sub
            assert popxl.gmg() == main
            assert popxl.gir() is ir or popxl.gir() == ir
        assert popxl.gcg() == main


def test_graphs_of_two_irs_cannot_be_nested():
    ir1, ir2 = popxl.Ir(), popxl.Ir()
    with pytest.raises(RuntimeError):
        with ir1.main_graph:
            with ir2.main_graph:
                pass


def test_create_graph_binds_tensors_as_inputs_with_parent_spec():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.zeros((2, 3), np.float32))
        n = popxl.constant(np.zeros((4,), np.int32))
        seen = {}

        def fn(a, b, scale=2.0):
            seen["a_in_sub"] = a in popxl.gcg()
            seen["scale"] = scale
            return a

        g = ir.create_graph(fn, x, n)
    assert len(g.inputs) == 2
    assert g.inputs[0].shape == (2, 3) and g.inputs[0].dtype == f32
    assert g.inputs[1].shape == (4,) and g.inputs[1].dtype == popxl.int32
    assert g.inputs[0].name == "a"
    assert seen == {"a_in_sub": True, "scale": 2.0}  # default applied, non-tensor passed through
    assert not (g.inputs[0] == x)  # the subgraph's own tensor, not the parent's


def test_create_graph_signature_mismatch_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.zeros(3, np.float32))
        with pytest.raises(ValueError):
            ir.create_graph(lambda a: a, x, x)


def test_input_order_follows_signature_not_kwarg_order_then_graph_inputs():
    ir = popxl.Ir()
    with ir.main_graph:
        ta = popxl.constant(np.zeros((2,), np.float32))
        tb = popxl.constant(np.zeros((3,), np.float32))

        def fn(a, b):
            extra = popxl.graph_input((5,), f32, "extra")
            extra2 = popxl.graph_input((6,), popxl.int32, "extra2")
            return a, b, extra, extra2

        g = ir.create_graph(fn, b=tb, a=ta)
    assert [t.shape for t in g.inputs] == [(2,), (3,), (5,), (6,)]
    assert [t.shape for t in g.outputs] == [(2,), (3,), (5,), (6,)]


def test_list_argument_gives_one_input_per_element():
    ir = popxl.Ir()
    with ir.main_graph:
        t1 = popxl.constant(np.ones(3, np.float32))
        t2 = popxl.constant(np.full(3, 2.0, np.float32))

        def fn(xs):
            assert isinstance(xs, (list, tuple)) and len(xs) == 2
            return xs[0] + xs[1]

        g = ir.create_graph(fn, [t1, t2])
        assert len(g.inputs) == 2
        (y,) = ops.call(g, t1, t2)
    np.testing.assert_array_equal(run(ir, None, y), np.full(3, 3.0, np.float32))


def test_mixing_tensors_and_non_tensors_in_a_container_is_type_error():
    ir = popxl.Ir()
    with ir.main_graph:
        t1 = popxl.constant(np.ones(3, np.float32))
        with pytest.raises(TypeError):
            ir.create_graph(lambda xs: xs[0], [t1, 2.0])


def test_tensor_spec_placeholder():
    spec = popxl.TensorSpec((2, 3), f32)
    assert hash(spec) == hash(popxl.TensorSpec((2, 3), f32))
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a: a * 2.0, spec)
        assert g.inputs[0].shape == (2, 3) and g.inputs[0].dtype == f32
        x = popxl.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
        assert x.spec == spec
        (y,) = ops.call(g, x)
    np.testing.assert_array_equal(run(ir, None, y), np.arange(6, dtype=np.float32).reshape(2, 3) * 2)


def test_tensor_spec_is_a_mapping_for_graph_input():
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_empty_graph("g")
        with g:
            t = popxl.graph_input(**popxl.TensorSpec((4,), popxl.int32))
            popxl.graph_output(t)
    assert g.inputs[0].shape == (4,) and g.inputs[0].dtype == popxl.int32


def test_outputs_none_tensor_tuple_and_input_passthrough():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        g0 = ir.create_graph(lambda a: None, x)
        g1 = ir.create_graph(lambda a: a, x)  # returning an input directly is allowed
        g2 = ir.create_graph(lambda a: (a + 1.0, a), x)
        assert ops.call(g0, x) == ()
        (y1,) = ops.call(g1, x)
        y2, y3 = ops.call(g2, x)
    assert len(g0.outputs) == 0 and len(g1.outputs) == 1 and len(g2.outputs) == 2
    r1, r2, r3 = run(ir, None, [y1, y2, y3])
    np.testing.assert_array_equal(r1, np.ones(3, np.float32))
    np.testing.assert_array_equal(r2, np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(r3, np.ones(3, np.float32))


@pytest.mark.parametrize("bad", [3, "x", 1.5])
def test_returning_non_tensor_is_value_error(bad):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        with pytest.raises(ValueError):
            ir.create_graph(lambda a: bad, x)
        with pytest.raises(ValueError):
            ir.create_graph(lambda a: (a, bad), x)


def test_graph_output_of_foreign_tensor_is_value_error():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        g = ir.create_empty_graph("g")
        with g:
            with pytest.raises(ValueError):
                popxl.graph_output(x)


def test_no_implicit_capture_of_parent_tensor():
    """§11.2: a parent tensor used inside a subgraph is a ValueError."""
    ir = popxl.Ir()
    with ir.main_graph:
        p = popxl.constant(np.ones(3, np.float32))
        x = popxl.constant(np.ones(3, np.float32))
        with pytest.raises(ValueError):
            ir.create_graph(lambda a: a + p, x)
        with pytest.raises(ValueError):
            ir.create_graph(lambda a: ops.mul(a, p), x)


def test_parent_variable_is_not_captured_either():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.ones(3, np.float32))
        x = popxl.constant(np.ones(3, np.float32))
        with pytest.raises(ValueError):
            ir.create_graph(lambda a: a + v, x)


def test_scalars_and_arrays_inside_fn_become_subgraph_constants():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.arange(3, dtype=np.float32))

        def fn(a):
            c = popxl.constant(np.array([10.0, 20.0, 30.0], np.float32))
            return a * 2.0 + c + np.array([1.0, 1.0, 1.0], np.float32)

        g = ir.create_graph(fn, x)
        (y,) = ops.call(g, x)
    np.testing.assert_array_equal(run(ir, None, y), np.array([11.0, 23.0, 35.0], np.float32))


def test_variables_only_in_main_graph():
    """§11.2: popxl.variable inside a subgraph is a ValueError."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))

        def fn(a):
            return a + popxl.variable(np.ones(3, np.float32))

        with pytest.raises(ValueError):
            ir.create_graph(fn, x)
        g = ir.create_empty_graph("g")
        with g:
            with pytest.raises(ValueError):
                popxl.variable(np.zeros(2, np.float32))


def test_init_is_allowed_in_subgraphs():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        g = ir.create_graph(lambda a: a + ops.init((3,), f32, "z", "zero"), x)
        (y,) = ops.call(g, x)
    np.testing.assert_array_equal(run(ir, None, y), np.ones(3, np.float32))


def test_graph_names_are_uniquified():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))

        def body(a):
            return a

        g1 = ir.create_graph(body, x)
        g2 = ir.create_graph(body, x)
    assert g1.name != g2.name
    assert "body" in g1.name


def test_module_build_is_traced_and_extra_inputs_bound_by_dict():
    class Scale(popxl.Module):
        def build(self, x):
            self.w = popxl.graph_input(x.shape, x.dtype, "w")
            return x * self.w

    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.array([1.0, 2.0, 3.0], np.float32))
        w = popxl.variable(np.array([2.0, 3.0, 4.0], np.float32))
        m = Scale()
        g = ir.create_graph(m, x)
        assert [t.shape for t in g.inputs] == [(3,), (3,)]
        (y,) = ops.call(g, x, inputs_dict={m.w: w})
    np.testing.assert_array_equal(run(ir, None, y), np.array([2.0, 6.0, 12.0], np.float32))


def test_empty_graph_with_explicit_inputs_and_outputs():
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_empty_graph("sq")
        with g:
            a = popxl.graph_input((2,), f32, "a")
            popxl.graph_output(a * a)
        (y,) = ops.call(g, popxl.constant(np.array([3.0, -2.0], np.float32)))
    np.testing.assert_array_equal(run(ir, None, y), np.array([9.0, 4.0], np.float32))


@emulator_only
def test_unimplemented_features_raise_not_implemented():
    """Collectives between the IPUs of one replica (``all_reduce``: the emulator has one IPU
    per replica) are outside the emulator's subset: using them raises NotImplementedError
    (never a silent wrong result). (Replicated collectives: see test_replication.py; autodiff:
    test_emulator_autodiff.py.)"""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones(3, np.float32))
        with pytest.raises(NotImplementedError):
            ops.collectives.all_reduce([x])


# python/popxl/python_files/ops/init.py, tensor.py graph_input, streams.py: the shape becomes a
# C++ TensorInfo via pybind11 (std::vector<int64_t>: floats -> TypeError). Negative sizes are not
# checked by PopART (willow/src/tensorinfo.cpp) and give no meaningful tensor: the emulator raises.
@emulator_only
def test_user_shapes_validated():
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(TypeError):
            ops.init((2.0,), f32)
        with pytest.raises(ValueError):
            ops.init((-2,), f32)
        with pytest.raises(ValueError):
            popxl.h2d_stream((-1,), f32)
        with pytest.raises(ValueError):
            popxl.d2h_stream((3, -1), f32)
        g = ir.create_empty_graph("g")
        with g:
            with pytest.raises(TypeError):
                popxl.graph_input((2.5,), f32)
        assert ops.init((np.int64(2),), f32).shape == (2,)


def test_downcast_false_keeps_64_bit_host_dtype_until_compile():
    """Reference §2: ``downcast=False`` keeps 64-bit dtypes. Building is fine; the device has no
    64-bit types, so compiling the Ir fails."""
    ir = popxl.Ir()
    with ir.main_graph:
        c = popxl.constant(np.zeros(3), downcast=False)
        v = popxl.variable(np.zeros(3, np.int64), downcast=False)
        assert c.dtype == popxl.float64 and v.dtype == popxl.int64
        assert popxl.constant(np.zeros(3)).dtype == popxl.float32  # default downcast
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_name_scope_prefixes_tensor_ids():
    """``popxl.name_scope`` (popart python/popxl context.py, graph.py ``_create_tensor_id``):
    ``name = "/".join(scopes + [name])``; in a subgraph the id also gets the graph's prefix;
    the context manager yields the active scopes."""
    ir = popxl.Ir()
    with ir.main_graph:
        with popxl.name_scope("outer") as scopes:
            assert list(scopes) == ["outer"]
            with popxl.name_scope("inner") as scopes:
                assert list(scopes) == ["outer", "inner"]
                a = popxl.variable(np.zeros(2, np.float32), name="a")
                b = a + 1
            c = ops.init((2,), f32, name="c")

            def body(x):
                return x * 2
            g = ir.create_graph(body, a)
            (d,) = ops.call(g, a)
        e = popxl.constant(1.0, name="e")
    assert (a.id, c.id, e.id) == ("outer/inner/a", "outer/c", "e")
    assert b.id.startswith("outer/inner/") and d.id.startswith("outer/")
    (x,) = g.inputs
    assert x.id == f"{g.name}/outer/x" and x.name == "outer/x"


@emulator_only
def test_name_scope_not_popped_on_error():
    """PopXL 3.3/3.4's ``name_scope`` has no ``finally``: an exception inside leaves the scope
    pushed (the emulator does the same; cleaned up here through the emulator's state)."""
    from popxl_flash.emulator import context
    depth = len(context._state["scopes"])
    with pytest.raises(KeyError):
        with popxl.name_scope("broken"):
            raise KeyError("x")
    try:
        assert context._state["scopes"][depth:] == ["broken"]
    finally:
        del context._state["scopes"][depth:]
