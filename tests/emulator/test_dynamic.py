"""dynamic_slice / dynamic_update(_) (reference §5 "Dynamic slicing", §11.9)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import COMPILE_ERRORS, emulator_only, load, run, store
from popxl_flash import popxl

ops = popxl.ops
f32 = popxl.float32

T = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)


@st.composite
def slice_case(draw):
    axes = draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
    sizes = [draw(st.integers(1, T.shape[a])) for a in axes]
    starts = [draw(st.integers(0, T.shape[a] - s)) for a, s in zip(axes, sizes)]
    dtype = draw(st.sampled_from([np.uint32, np.int32]))
    return axes, sizes, np.array(starts, dtype)


def _expected_slice(t, axes, sizes, starts):
    key = [slice(None)] * t.ndim
    for a, s, i in zip(axes, sizes, starts):
        key[a] = slice(int(i), int(i) + s)
    return t[tuple(key)]


@given(case=slice_case())
def test_dynamic_slice_keeps_rank(case):
    """out = t[..., idx:idx+size, ...] on each listed axis; no squeeze."""
    axes, sizes, starts = case
    ir = popxl.Ir()
    feeds = {}
    with ir.main_graph:
        t = popxl.constant(T)
        idx = load(feeds, starts)
        y = ops.dynamic_slice(t, idx, axes, sizes, False)
        want_shape = list(T.shape)
        for a, s in zip(axes, sizes):
            want_shape[a] = s
        assert y.shape == tuple(want_shape)
    np.testing.assert_array_equal(run(ir, feeds, y), _expected_slice(T, axes, sizes, starts))


def test_docstring_example_is_start_plus_size():
    """index [1, 2], sizes [2, 4] on axes [0, 3] is t[1:3, :, :, 2:6] (not the docstring's 1:2, 2:4)."""
    t4 = np.arange(4 * 2 * 2 * 8, dtype=np.float32).reshape(4, 2, 2, 8)
    ir = popxl.Ir()
    with ir.main_graph:
        y = ops.dynamic_slice(popxl.constant(t4), popxl.constant(np.array([1, 2], np.uint32)), [0, 3], [2, 4],
                              True)
    np.testing.assert_array_equal(run(ir, None, y), t4[1:3, :, :, 2:6])


def test_dynamic_slice_index_shape_is_flattened():
    ir = popxl.Ir()
    with ir.main_graph:
        idx = popxl.constant(np.array([[1], [2]], np.int32))
        y = ops.dynamic_slice(popxl.constant(T), idx, [0, 2], [1, 3], False)
    np.testing.assert_array_equal(run(ir, None, y), T[1:2, :, 2:5])


@pytest.mark.parametrize("n_elems", [1, 3])
def test_dynamic_slice_index_needs_len_axes_elements(n_elems):
    """DynamicSliceBaseOp::setup (willow/src/op/dynamic/dynamicbase.cpp) does not look at the
    index; DynamicSliceOpx reshapes it to [len(axes)] (popx/op/dynamic/dynamicslicex.cpp), so
    the mismatch fails when the Session compiles."""
    ir = popxl.Ir()
    with ir.main_graph:
        idx = popxl.constant(np.zeros(n_elems, np.uint32))
        store(ops.dynamic_slice(popxl.constant(T), idx, [0, 1], [1, 1], False))
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_dynamic_slice_needs_all_five_arguments():
    ir = popxl.Ir()
    with ir.main_graph:
        idx = popxl.constant(np.zeros(1, np.uint32))
        with pytest.raises(TypeError):
            ops.dynamic_slice(popxl.constant(T), idx, [0], [1])


@emulator_only
@pytest.mark.parametrize(
    "starts, dtype", [([4], np.uint32), ([3], np.int32), ([-1], np.int32), ([100], np.uint32)]
)
def test_dynamic_slice_out_of_range_raises_on_emulator(starts, dtype):
    """Unspecified in PopXL (wraps on device); the emulator raises (design §2)."""
    ir = popxl.Ir()
    feeds = {}
    with ir.main_graph:
        idx = load(feeds, np.array(starts, dtype))
        store(ops.dynamic_slice(popxl.constant(T), idx, [0], [2], False))
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(Exception):
            session.run(feeds)


@emulator_only
@pytest.mark.parametrize("op", ["dynamic_update", "dynamic_update_"])
@pytest.mark.parametrize(
    "starts, dtype", [([4], np.uint32), ([3], np.int32), ([-1], np.int32), ([100], np.uint32)]
)
def test_dynamic_update_out_of_range_raises_on_emulator(op, starts, dtype):
    """Updates share dynamic_slice's start rule (one popops::dynamicUpdate lowering for the
    out-of-place and in-place ops, popx/op/dynamic/dynamicupdatex.cpp): a start with
    start + size > dim or start < 0 is unspecified on the device, so the emulator raises
    ``IndexError`` when the op runs, never clamps the start into range (a clamped update would
    write rows the program never named) and leaves the target unmodified."""
    upd = -np.ones((2, 5, 6), np.float32)
    ir = popxl.Ir()
    feeds = {}
    with ir.main_graph:
        v = popxl.variable(T, name="v")
        idx = load(feeds, np.array(starts, dtype))
        store(getattr(ops, op)(v, idx, popxl.constant(upd), [0], [2], False))
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(IndexError, match="out of range for axis 0 of size 4"):
            session.run(feeds)
        np.testing.assert_array_equal(session.get_tensor_data(v), T)


def test_dynamic_slice_driven_by_counter_in_repeat():
    """Sum of rows t[i] for i = 0..3, the counter carried by the loop (no loop index exposed)."""
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ir = popxl.Ir()
    with ir.main_graph:
        i0 = popxl.constant(np.uint32(0))
        acc0 = popxl.constant(np.zeros((1, 3), np.float32))
        tab = popxl.constant(table)

        def body(i, acc, t):
            row = ops.dynamic_slice(t, i, [0], [1], True)
            return ops.increment_mod(i, 1, 4), acc + row

        g = ir.create_graph(body, i0, acc0, tab)
        i_end, acc = ops.repeat(g, 6, i0, acc0, tab)
    ri, racc = run(ir, None, [i_end, acc])
    assert ri == 6 % 4
    np.testing.assert_array_equal(racc, (table.sum(0) + table[0] + table[1])[None])


def test_dynamic_update_returns_copy():
    upd = -np.ones((2, 5, 3), np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(T)
        idx = popxl.constant(np.array([1, 2], np.uint32))
        y = ops.dynamic_update(t, idx, popxl.constant(upd), [0, 2], [2, 3], False)
        assert y.shape == T.shape
    ry, rt = run(ir, None, [y, t])
    want = T.copy()
    want[1:3, :, 2:5] = upd
    np.testing.assert_array_equal(ry, want)
    np.testing.assert_array_equal(rt, T)  # input untouched


def test_dynamic_update_in_place_modifies_input():
    upd = -np.ones((1, 5, 6), np.float32)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        v = popxl.variable(T, name="v")
        idx = popxl.constant(np.array([3], np.int32))
        y = ops.dynamic_update_(v, idx, popxl.constant(upd), [0], [1], False)
        assert not (y == v)  # a new tensor aliasing v
        out_y, out_v = store(y), store(v)
    want = T.copy()
    want[3] = upd[0]
    with popxl.Session(ir, "ipu_model") as session:
        r = session.run()
        v_data = session.get_tensor_data(v)
    np.testing.assert_array_equal(r[out_y], want)
    np.testing.assert_array_equal(r[out_v], want)
    np.testing.assert_array_equal(v_data, want)


@pytest.mark.parametrize("upd_shape", [(2, 5, 2), (2, 5), (1, 5, 3)])
def test_dynamic_update_shape_mismatch_is_error(upd_shape):
    """DynamicBinaryBaseOp::setup takes t's info unchecked; popops::dynamicUpdate refuses the
    mismatched slice when the Session compiles (popx/op/dynamic/dynamicupdatex.cpp)."""
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(T)
        idx = popxl.constant(np.array([1, 2], np.uint32))
        upd = popxl.constant(np.zeros(upd_shape, np.float32))
        store(ops.dynamic_update(t, idx, upd, [0, 2], [2, 3], False))
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


def test_dynamic_update_accepts_update_without_the_leading_unit_axis():
    """DynamicUpdateOpx prepends a 1 to a t_update of rank one less than t
    (popx/op/dynamic/dynamicupdatex.cpp): [5, 3] updates a [1, 5, 3] slice."""
    upd = np.full((5, 3), -1.0, np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        idx = popxl.constant(np.array([1, 2], np.uint32))
        y = ops.dynamic_update(popxl.constant(T), idx, popxl.constant(upd), [0, 2], [1, 3], False)
    expected = T.copy()
    expected[1:2, :, 2:5] = upd
    np.testing.assert_array_equal(run(ir, None, y), expected)


# popart willow/src/op/dynamic/dynamicbase.cpp + python/popxl/python_files/ops/dynamic_slice.py:
# `axes`/`sizes` go to the pybind11-bound C++ constructor as std::vector<int64_t> (a float is
# rejected with TypeError) and `no_overlap` as a C++ bool (a str/list is rejected).
@pytest.mark.parametrize("kwargs", [dict(sizes=[1.5]), dict(axes=[0.0]),
                                    dict(no_overlap="yes"), dict(no_overlap=[True])])
def test_dynamic_slice_attribute_types_like_pybind(kwargs):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(np.ones((4, 3), np.float32))
        idx = popxl.constant([1])
        args = dict(axes=[0], sizes=[1], no_overlap=True)
        args.update(kwargs)
        with pytest.raises(TypeError):
            ops.dynamic_slice(t, idx, **args)
        with pytest.raises(TypeError):
            ops.dynamic_update(t, idx, popxl.constant(np.ones((1, 3), np.float32)), **args)
        # numpy ints and a numpy bool are accepted, like pybind11 does
        out = ops.dynamic_slice(t, idx, np.array([0]), [np.int64(2)], np.bool_(False))
        assert out.shape == (2, 3)
