"""The remaining differences from PopXL 3.4, each settled from its source
(graphcore/popart sdk-release-3.4, ``python/popxl/python_files/``)."""
import numpy as np
import pytest

import popxl_flash
from popxl_flash import popxl

if popxl_flash.BACKEND != "emulator":
    pytest.skip("checks the emulator against PopXL's source", allow_module_level=True)


# -- dtype class API (dtypes.py) ------------------------------------------------------------
def test_dtype_cannot_be_constructed():
    with pytest.raises(TypeError):
        popxl.dtype()


@pytest.mark.parametrize("value,expected", [
    ("float16", "float16"), (float, "float32"), (bool, "bool"), (int, "int64"),
    (np.float64, "float64"), (np.dtype("int32"), "int32"), (np.zeros(2, np.uint8), "uint8"),
    ("complex64", "complex64"), ("half", "float16")])
def test_as_dtype(value, expected):
    assert popxl.dtype.as_dtype(value) is popxl.dtype.from_name(expected)


@pytest.mark.parametrize("value", ["floaty", object(), [1, 2]])
def test_as_dtype_refuses_with_value_error(value):
    """Nothing matches: not a name, Python type, numpy dtype or array (``"half"`` above is
    found by ``np.dtype("half")``, not as a PopXL name)."""
    with pytest.raises(ValueError):
        popxl.dtype.as_dtype(value)


def test_from_name_and_flags():
    assert popxl.dtype.from_name("float32") is popxl.float32 is popxl.float
    with pytest.raises(ValueError):
        popxl.dtype.from_name("double")
    assert popxl.complex64.is_complex and not popxl.complex64.is_floating_point
    assert not popxl.float16.is_complex and popxl.float16.is_floating_point
    assert popxl.uint32.is_int and not popxl.uint32.is_signed
    assert repr(popxl.int8) == "popxl.dtypes.int8"


def test_float8_numpy_type_is_the_structured_byte():
    assert popxl.float8_143.as_numpy() == np.dtype([("float8_143", "u1")])
    assert popxl.float8_152.as_numpy().itemsize == 1


def test_as_torch():
    torch = pytest.importorskip("torch")
    assert popxl.float16.as_torch() is torch.float16
    assert popxl.dtype.as_dtype(torch.int32) is popxl.int32
    assert popxl.dtype.as_dtype(torch.zeros(1)) is popxl.float32
    with pytest.raises(TypeError):
        popxl.uint32.as_torch()


# -- Ir equality (ir.py) -----------------------------------------------------------------------
def test_ir_equality_with_a_non_ir_raises_type_error():
    """PopXL's ``Ir.__eq__`` raises TypeError for any non-Ir, so ``ir == None`` raises; ``is``
    and ``in`` on a list of Irs (which compares Irs only) work."""
    ir = popxl.Ir()
    with pytest.raises(TypeError):
        ir == None  # noqa: E711, B015
    with pytest.raises(TypeError):
        ir != 1  # noqa: B015
    assert ir == ir and not ir == popxl.Ir() and ir in [popxl.Ir(), ir]
    assert {ir: 1}[ir] == 1 and repr(ir) == f"Ir[id={ir.id}]"


# -- Tensor.strides (tensor.py -> willow/include/popart/tensorinfo.hpp TensorInfo::strides) -----
@pytest.mark.parametrize("dtype,shape,arg,expected", [
    (popxl.float32, (2, 3, 4), None, (48, 16, 4)), (popxl.float16, (5,), None, (2,)),
    (popxl.int32, (), None, ()), (popxl.float32, (2, 3), (0,), (4,)),
    (popxl.float16, (2, 3), [4, 0, 2], (0, 4, 2)), (popxl.bool, (3, 2), None, (2, 1))])
def test_tensor_strides(dtype, shape, arg, expected):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(np.zeros(shape), dtype)
    assert t.strides(arg) == expected
    if arg is None and shape:
        assert t.strides() == np.zeros(shape, dtype.as_numpy()).strides


def test_tensor_strides_shape_must_be_ints():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(np.zeros(2, np.float32))
    with pytest.raises(TypeError):
        t.strides([1.5])


# -- call-site index maps (ops/call.py CallSiteInfo) -----------------------------------------
def test_call_site_index_maps_and_parent_to_graph():
    """PopXL names the maps ``graph_to_parent_input_index`` etc. (a CallOp's indices coincide)
    and ``parent_to_graph`` looks only at the call's inputs (ValueError for an output)."""
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a, b: a * b, popxl.TensorSpec((2,), popxl.float32),
                            popxl.TensorSpec((2,), popxl.float32))
        x = popxl.constant(np.ones(2, np.float32))
        y = popxl.constant(np.ones(2, np.float32))
        info = popxl.ops.call_with_info(g, x, y)
    for name in ("graph_to_parent_input_index", "parent_to_graph_input_index",
                 "graph_to_parent_output_index", "parent_to_graph_output_index"):
        assert getattr(info, name)(1) == 1
    assert not hasattr(info, "subgraph_in_to_op_in_index")
    assert info.parent_to_graph(y) is g.inputs[1]
    assert info.graph_to_parent(g.outputs[0]) is info.outputs[0]
    with pytest.raises(ValueError):
        info.parent_to_graph(info.outputs[0])


# -- zero-size operands ------------------------------------------------------------------------
def _run_one(shape, fn):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros(shape, np.float32))
        y = fn(x)
        s = popxl.d2h_stream(y.shape, y.dtype)
        popxl.ops.host_store(s, y)
    with popxl.Session(ir) as sess:
        return sess.run()[s]


@pytest.mark.parametrize("shape,axis", [((0, 3), 0), ((0, 3), 1), ((3, 0), 1), ((3, 0), 0)])
def test_softmax_of_an_empty_tensor_is_empty(shape, axis):
    """Nothing to normalise: an empty result of the input's shape (no numpy error)."""
    assert _run_one(shape, lambda x: popxl.ops.softmax(x, axis)).shape == shape


@pytest.mark.parametrize("kind,expected", [("sum", 0.0), ("prod", 1.0)])
def test_sum_and_prod_over_zero_elements_give_the_identity(kind, expected):
    out = _run_one((0, 3), lambda x: getattr(popxl.ops, kind)(x, [0]))
    np.testing.assert_array_equal(out, np.full(3, expected, np.float32))


@pytest.mark.parametrize("kind", ["max", "min", "mean"])
def test_max_min_mean_over_zero_elements_are_refused_at_session(kind):
    """PopART lowers these to PopLibs' reduce with no empty special case: unspecified by its
    source, so the emulator refuses when the Session compiles (an empty output still runs)."""
    from popxl_flash.emulator import PopartError
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((0, 3), np.float32))
        getattr(popxl.ops, kind)(x, [0])
    with pytest.raises(PopartError):
        popxl.Session(ir)
    assert _run_one((0, 3), lambda x: getattr(popxl.ops, kind)(x, [1])).shape == (0,)


def test_zero_size_elementwise_and_matmul_run():
    """A zero dimension outside the operands' overlap broadcasts (PopART's ``npOut``); inside
    it is refused (``test_fidelity_round4.py``)."""
    assert _run_one((0, 3), lambda x: x + 1.0).shape == (0, 3)
    out = _run_one((0, 3), lambda x: x @ popxl.constant(np.ones((3, 2), np.float32)))
    assert out.shape == (0, 2)


# -- popxl.utils (utils.py) --------------------------------------------------------------------
def test_table_to_string_matches_the_docstring_example():
    rows = [["num", "foo", "name"], [3, "aaab", "args"], [4, "barrrr", "kwargs"],
            [3, "me", "inspect"], [-1, "who", "popxl"]]
    underline = "-" * 23 + "\n"  # as long as the header line, its newline included
    expected = ("num | foo    | name   \n" + underline +
                "3   | aaab   | args   \n"
                "4   | barrrr | kwargs \n"
                "3   | me     | inspect\n"
                "-1  | who    | popxl  \n")
    assert popxl.utils.table_to_string(rows) == expected
    assert popxl.utils.table_to_string(rows[:1], header=True) == "num | foo | name\n"


@pytest.mark.parametrize("data,kwargs,dtype", [
    ([1.0, 2.0], {}, np.float32), ([1, 2], {}, np.int32), ([1, 2], {"downcast": False}, np.int64),
    (np.arange(3, dtype=np.float64), {"dtype": None}, np.float32),
    ([1, 2], {"dtype": "f16"}, np.float16), (True, {}, np.bool_)])
def test_to_numpy(data, kwargs, dtype):
    if kwargs.get("dtype") == "f16":
        kwargs = {"dtype": popxl.float16}
    out = popxl.utils.to_numpy(data, **kwargs)
    assert out.dtype == dtype and out.flags.c_contiguous


def test_to_numpy_copy_and_memmap_rules(tmp_path):
    a = np.ones(3, np.float32)
    assert popxl.utils.to_numpy(a, copy=False) is a
    assert popxl.utils.to_numpy(a) is not a
    m = np.memmap(tmp_path / "m", np.float32, "w+", shape=(3,))
    assert popxl.utils.to_numpy(m, copy=False) is m
    with pytest.raises(ValueError):
        popxl.utils.to_numpy(m, popxl.float16)
    m64 = np.memmap(tmp_path / "d", np.float64, "w+", shape=(3,))
    with pytest.raises(ValueError):
        popxl.utils.to_numpy(m64)
    with pytest.raises(RuntimeError):
        popxl.utils.to_numpy(a, log2_scale=1)
