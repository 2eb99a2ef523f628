"""Dynamic slicing: dynamic_slice, dynamic_update, dynamic_update_.

Out-of-range starts (start < 0 or start + size > dim) are unspecified on the device; the
emulator raises ``IndexError`` when the op executes (strict mode; the choosing mode clamps the
start, see ``unspecified.py``). PopART's setup checks almost nothing
(``willow/src/op/dynamic/dynamicbase.cpp``); what the lowering needs (an index with one
element per axis, sizes in range, a matching update) is checked when the Session compiles. The
lowering casts the index to unsigned (``popops::cast`` in ``popx/op/dynamic/dynamicslicex.cpp``
and ``dynamicupdatex.cpp``), so a float index works and truncates toward zero.
"""
import numbers

import numpy as np

from .. import unspecified
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
from ._common import FLOATS, INTS, int_vector


def _slice_shape(t, axes, sizes):
    """``DynamicSliceBaseOp::createOutInfo`` (willow/src/op/dynamic/dynamicbase.cpp): ``t``'s
    shape with ``shape[axes[i]] = sizes[i]``. Axes out of range index the shape unchecked
    (undefined) and sizes shorter than axes are read past their end: refused here."""
    if len(sizes) != len(axes):
        raise PopartError(f"dynamic slice: {len(axes)} axes but {len(sizes)} sizes")
    if any(a < 0 or a >= t.rank for a in axes):
        raise PopartError(f"dynamic slice: invalid axes {axes} for rank {t.rank}")
    shape = list(t.shape)
    for a, s in zip(axes, sizes):
        shape[a] = s
    return tuple(shape)


def _ds_rule(t, index, axes, sizes):
    return [(_slice_shape(t, axes, sizes), t.dtype)]


def _du_rule(t, index, upd, axes, sizes):
    _slice_shape(t, axes, sizes)
    return [(t.shape, t.dtype)]  # DynamicBinaryBaseOp::setup: the output is t's info


def _check_slice(op):
    """What the lowering (dynamicslicex.cpp / dynamicupdatex.cpp, popops::dynamicSlice and
    dynamicUpdate) rejects or leaves unspecified; raised when the Session compiles."""
    t, index = op.inputs[:2]
    axes, sizes = op.attrs["axes"], op.attrs["sizes"]
    if index.dtype not in INTS | FLOATS:
        raise PopartError(f"dynamic slice: index {index.id} must be an integer or float tensor, "
                          f"got {index.dtype.name} (the lowering casts it to unsigned)")
    if index.nelms != len(axes):
        raise PopartError(f"dynamic slice: index {index.id} has {index.nelms} elements but "
                          f"{len(axes)} axes were given (reshaped to [{len(axes)}])")
    if len(set(axes)) != len(axes):
        raise PopartError(f"dynamic slice: repeated axes {axes}")
    for a, s in zip(axes, sizes):
        if not 1 <= s <= t.shape[a]:
            raise PopartError(f"dynamic slice: size {s} invalid for axis {a} of {t.shape}")


def _check_update(op):
    _check_slice(op)
    t, upd = op.inputs[0], op.inputs[2]
    shape = _slice_shape(t, op.attrs["axes"], op.attrs["sizes"])
    # DynamicUpdateOpx prepends a 1 to a t_update of lower rank than t
    fits = upd.shape == shape or (upd.rank + 1 == t.rank and (1,) + upd.shape == shape)
    if not fits or upd.dtype != t.dtype:
        raise PopartError(f"dynamic_update: t_update {upd.id} {upd.shape} {upd.dtype.name} must "
                          f"equal the slice {shape} {t.dtype.name}")


def _key(a, index, axes, sizes):
    key = [slice(None)] * a.ndim
    for i, (ax, size) in enumerate(zip(axes, sizes)):
        start = int(index.flat[i])  # a float index truncates, as popops::cast to unsigned
        if start < 0 or start + size > a.shape[ax]:
            unspecified.occurred("dynamic_out_of_range", IndexError(
                f"dynamic slice: start {start} + size {size} out of range for axis {ax} of "
                f"size {a.shape[ax]} (unspecified on device)"))
            start = min(max(start, 0), a.shape[ax] - size)
        key[ax] = slice(start, start + size)
    return tuple(key)


def _ds(a, index, axes, sizes):
    return a[_key(a, index, axes, sizes)].copy()


def _du(a, index, upd, axes, sizes):
    out = a.copy()
    key = _key(a, index, axes, sizes)
    out[key] = upd.reshape(out[key].shape)
    return out


def _du_(a, index, upd, axes, sizes):
    key = _key(a, index, axes, sizes)
    a[key] = upd.reshape(a[key].shape)
    return a


register("dynamic_slice", _ds_rule, _ds)
register("dynamic_update", _du_rule, _du)
register("dynamic_update_", _du_rule, _du_, alias="modify")
COMPILE_CHECKS["dynamic_slice"] = _check_slice
COMPILE_CHECKS["dynamic_update"] = COMPILE_CHECKS["dynamic_update_"] = _check_update


def _attrs(axes, sizes, no_overlap):
    # PopXL passes these to the pybind11-bound C++ constructor: ``axes``/``sizes`` are
    # ``std::vector<int64_t>`` (floats rejected, numpy ints accepted) and ``no_overlap`` is a
    # ``bool`` (True/False/None or a number; str, list, Tensor ... rejected) -> TypeError.
    if not (no_overlap is None or isinstance(no_overlap, (numbers.Number, np.bool_))):
        raise TypeError(f"dynamic slice: `no_overlap` must be a bool, got {no_overlap!r}")
    return {"axes": int_vector("dynamic slice", "axes", axes),
            "sizes": int_vector("dynamic slice", "sizes", sizes)}


def dynamic_slice(t, index, axes, sizes, no_overlap):
    """Args: t: Tensor. index: int tensor with len(axes) starts. axes, sizes: lists.
    no_overlap: hint. Returns: copy of the slice (rank kept)."""
    return emit("dynamic_slice", {"t": t, "index": index}, _attrs(axes, sizes, no_overlap))[0]


def dynamic_update(t, index, t_update, axes, sizes, no_overlap):
    """Returns: copy of t with the slice at ``index`` replaced by t_update."""
    return emit("dynamic_update", {"t": t, "index": index, "t_update": t_update},
                _attrs(axes, sizes, no_overlap))[0]


def dynamic_update_(t, index, t_update, axes, sizes, no_overlap):
    """In-place dynamic_update. Returns: tensor aliasing t."""
    return emit("dynamic_update_", {"t": t, "index": index, "t_update": t_update},
                _attrs(axes, sizes, no_overlap))[0]

