"""Shape ops: reshape, transpose, squeeze, concat, slice, subsample, split, gather, detach.

Out-of-place results are fresh arrays (PopART's outplace ``reshape``/``transpose``/``slice``/
``concat`` each ``cloneNcopy`` their output: ``willow/src/popx/op/reshapex.cpp``,
``transposex.cpp``, ``slicex.cpp``, ``concatx.cpp``). The ``*_`` variants are views: their
output aliases the input (``concat_``: every input), registered with ``alias="view"``; the
alias model is :mod:`..views`, the run-time coherence of views numpy cannot express
(``concat_``, a reshape of a non-contiguous source) is ``plan._sync``.
"""
import builtins
from collections.abc import Iterable

import numpy as np

from .. import dtypes
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
from ..tensor import Tensor
from ._common import INTS, int_vector, norm_axis

INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
_pyslice = builtins.slice


def _copy(fn):
    def impl(a, **attrs):
        return np.array(fn(a, **attrs), copy=True)
    return impl


def _register_pair(kind, rule, fn):
    """Register ``kind`` (a copy) and ``kind_`` (a view: ``fn``'s numpy view when numpy can
    express it, such as a transpose, a slice or a reshape of a contiguous source, else a copy
    that the plan keeps in step with its source, ``plan._sync``)."""
    register(kind, rule, _copy(fn))
    register(kind + "_", rule, fn, alias="view")


def _tensor_arg(name, t):
    if not isinstance(t, Tensor):
        raise TypeError(f"The input `{name}` is not a Tensor. Type: {type(t)}. Value: {t}.")


# -- reshape ---------------------------------------------------------------------------------
def _reshape_rule(t, shape):
    if int(np.prod(shape, dtype=np.int64)) != t.nelms:
        raise PopartError(f"reshape: cannot reshape {t.id} of shape {t.shape} ({t.nelms} "
                          f"elements) to {shape}")
    return [(shape, t.dtype)]


_register_pair("reshape", _reshape_rule, lambda a, shape: a.reshape(shape))


def _reshape_shape(t, shape):
    if not isinstance(shape, (tuple, list)):
        # PopXL's ops/reshape.py iterates the shape, then calls `shape.count(0)`
        if not isinstance(shape, Iterable):
            raise TypeError(f"reshape: shape must be a tuple or list of ints, got {shape!r}")
        raise AttributeError(f"'{type(shape).__name__}' object has no attribute 'count' "
                             "(reshape: shape must be a tuple or list of ints)")
    shape = list(int_vector("reshape", "shape", shape))
    if any(s < -1 for s in shape) or shape.count(0) > 0:
        raise ValueError(f"Invalid shape value in reshape. Must be '>0' or '-1'. Provided {shape}.")
    if shape.count(-1) > 1:
        raise ValueError(f"Reshape shape can contain at most one '-1' value. Provided {shape}.")
    known = int(np.prod(np.abs(shape), dtype=np.int64))
    nelms = t.nelms if isinstance(t, Tensor) else 0
    return tuple(s if s > 0 else nelms // known for s in shape)


def reshape(t, shape):
    """Args: t: Tensor. shape: tuple/list (entries > 0 or one -1). Returns: reshaped copy."""
    _tensor_arg("t", t)
    return emit("reshape", {"t": t}, {"shape": _reshape_shape(t, shape)})[0]


def reshape_(t, shape):
    """In-place (aliasing) reshape. Returns: tensor aliasing t."""
    _tensor_arg("t", t)
    return emit("reshape_", {"t": t}, {"shape": _reshape_shape(t, shape)})[0]


def flatten(t):
    """Returns: ``reshape(t, (-1,))``."""
    return reshape(t, (-1,))


def flatten_(t):
    """Returns: ``reshape_(t, (-1,))``."""
    return reshape_(t, (-1,))


def squeeze(t, axes=None):
    """Args: t: Tensor. axes: size-1 axes to remove (None: all size-1 axes). Returns: Tensor."""
    _tensor_arg("t", t)
    shape = t.shape
    if axes is None:
        new = [d for d in shape if d != 1]
    else:
        axes = sorted(a + t.rank if a < 0 else a for a in axes)
        if len(axes) > len(set(axes)):
            raise ValueError("Axes contains duplicates")
        new = list(shape)
        for i in axes[::-1]:
            if i > len(new) - 1:
                raise ValueError(f"Can't squeeze axis '{i}' as tensor has rank '{len(new)}'")
            if shape[i] != 1:
                raise ValueError(f"Can't squeeze axis '{i}' as length of axis is >1: {shape[i]}")
            del new[i]
    return reshape(t, new)


# -- transpose -------------------------------------------------------------------------------
def _transpose_rule(t, permutation):
    # TransposeBaseOp::setup (willow/src/op/transpose.cpp): the length must equal the rank;
    # entries index the shape unchecked (a negative one is undefined: refused here).
    if len(permutation) != t.rank:
        raise PopartError(f"transpose: permutation {permutation} has length {len(permutation)},"
                          f" the input rank is {t.rank}")
    if any(p < 0 for p in permutation):
        raise PopartError(f"transpose: negative entries in {permutation} are undefined in "
                          "PopART (use non-negative axes)")
    return [(tuple(t.shape[p] for p in permutation), t.dtype)]


def _check_permutation(op):
    perm = op.attrs["permutation"]
    if sorted(perm) != list(range(len(perm))):
        raise PopartError(f"transpose: {perm} is not a permutation (PopART's setup accepts "
                          "it; Poplar's dimShuffle does not)")


_register_pair("transpose", _transpose_rule, lambda a, permutation: a.transpose(permutation))
COMPILE_CHECKS["transpose"] = COMPILE_CHECKS["transpose_"] = _check_permutation


def _perm(t, permutation):
    _tensor_arg("t", t)
    if permutation is None:
        permutation = tuple(reversed(range(t.rank)))
    permutation = int_vector("transpose", "permutation", permutation)
    if not permutation:  # an empty permutation is PopART's default: reverse (setDefaultPerm)
        permutation = tuple(reversed(range(t.rank)))
    if any(p >= t.rank for p in permutation):
        raise ValueError(f"Values in permutation must be less than the tensor's rank {t.rank}. "
                         f"Found {tuple(p for p in permutation if p >= t.rank)}")
    return permutation


def transpose(t, permutation=None):
    """Args: t: Tensor. permutation: axes order (default reversed). Returns: transposed copy."""
    return emit("transpose", {"t": t}, {"permutation": _perm(t, permutation)})[0]


def transpose_(t, permutation=None):
    """In-place (aliasing) transpose. Returns: tensor aliasing t."""
    return emit("transpose_", {"t": t}, {"permutation": _perm(t, permutation)})[0]


# -- detach / identity -----------------------------------------------------------------------
_register_pair("detach", lambda t: [(t.shape, t.dtype)], lambda a: a)
register("identity", lambda t: [(t.shape, t.dtype)], _copy(lambda a: a))


def detach(t):
    """Returns: a copy of t that blocks autodiff."""
    return emit("detach", {"t": t})[0]


def detach_(t):
    """Returns: an alias of t that blocks autodiff."""
    return emit("detach_", {"t": t})[0]


def identity(t, output_name=None):
    """Returns: a copy of t."""
    return emit("identity", {"t": t}, names=[output_name] if output_name else None)[0]


rename = identity  # PopXL's ops/identity.py


# -- concat / split ----------------------------------------------------------------------------
def _concat_rule(*ts, axis):
    if not ts:
        raise PopartError("concat: needs at least one input")
    rank = ts[0].rank
    ax = norm_axis("concat", axis, rank)
    for t in ts:
        if t.rank != rank or any(d != e for i, (d, e) in enumerate(zip(t.shape, ts[0].shape))
                                 if i != ax):
            raise PopartError(f"concat: shapes {[u.shape for u in ts]} do not match off axis {ax}")
    shape = list(ts[0].shape)
    shape[ax] = sum(t.shape[ax] for t in ts)
    return [(tuple(shape), ts[0].dtype)]


def _concat(*arrays, axis):
    return np.concatenate(arrays, axis=axis)


register("concat", _concat_rule, _concat)


def concat(ts, axis=0):
    """Args: ts: tensors of one dtype. axis: concat axis (negative ok). Returns: Tensor."""
    ts = list(ts)
    if len({t.dtype for t in ts if isinstance(t, Tensor)}) > 1:
        raise TypeError("All inputs to a concat operation must have the same type: "
                        f"{[t.dtype for t in ts]}")
    return emit("concat", {f"ts_{i}": t for i, t in enumerate(ts)}, {"axis": axis})[0]


register("concat_", _concat_rule, _concat, alias="view")


def concat_(ts, axis=0):
    """``ops.concat_``: concat whose output aliases every input (ConcatInplaceOp): a write
    through the output reaches the inputs and a write to an input is seen by the output.
    Returns: Tensor."""
    ts = list(ts)
    if len({t.dtype for t in ts if isinstance(t, Tensor)}) > 1:
        raise TypeError("All inputs to a concat operation must have the same type: "
                        f"{[t.dtype for t in ts]}")
    return emit("concat_", {f"ts_{i}": t for i, t in enumerate(ts)}, {"axis": axis},
                names=["concat_out"])[0]


def _split_rule(t, axis, splits):
    # SplitOp::setup (willow/src/op/split.cpp): axis in [0, rank), sizes summing to the axis
    if not 0 <= axis < t.rank:
        raise PopartError(f"split: axis {axis} is out of range for tensor with {t.rank} dims")
    if sum(splits) != t.shape[axis] or any(s < 0 for s in splits):
        raise PopartError(f"split: sizes {splits} do not partition axis {axis} of {t.shape}")
    return [(t.shape[:axis] + (s,) + t.shape[axis + 1:], t.dtype) for s in splits]


def _check_split_sizes(op):
    if any(s == 0 for s in op.attrs["splits"]):
        raise PopartError(f"split: zero-size parts {list(op.attrs['splits'])} (accepted by "
                          "SplitOp::setup; empty tensors on the device are not specified)")


def _split(a, axis, splits):
    return tuple(np.array(p, copy=True) for p in np.split(a, np.cumsum(splits)[:-1], axis=axis))


register("split", _split_rule, _split, multi=True)
COMPILE_CHECKS["split"] = _check_split_sizes


def split(t, splits, axis=0):
    """Args: t: Tensor. splits: number of equal parts or list of sizes. axis: split axis.
    Returns: list of Tensors."""
    _tensor_arg("t", t)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"split: axis must be an int, got {axis!r}")
    axis = int(axis) + t.rank if axis < 0 else int(axis)  # PopXL's handle_negative_axis
    if isinstance(splits, int):  # PopXL indexes the Python shape tuple (IndexError, wrapping)
        if t.shape[axis] % splits != 0:
            raise ValueError(f"Split {splits} does not equally divide tensor axis {axis} of "
                             f"length {t.shape[axis]}.")
        splits = [t.shape[axis] // splits] * splits
    splits = int_vector("split", "splits", splits)
    return list(emit("split", {"t": t}, {"axis": axis, "splits": splits}))


# -- slice / subsample -------------------------------------------------------------------------
def _norm_index(index, dim, flip):
    index = min(index, dim)
    index = max(index, -dim - 1 if flip else -dim)
    return index + dim if index < 0 else index


def _slices(t, start, stop, step, axis, inverted_ok=False):
    """PopART BaseSliceOp::getSlices: returns [(axis, begin, end, flip)]. ``inverted_ok``:
    keep bounds with end < begin (``slice_``: PopART builds the op and refuses it when the
    Session builds its alias regions, :func:`_check_slice_bounds`)."""
    out = []
    for s, e, st, ax in zip(start, stop, step, axis):
        if ax < 0 or ax >= t.rank:
            raise PopartError(f"slice: axis {ax} invalid for rank {t.rank}")
        if st == 0:
            raise PopartError(f"slice: step 0 on axis {ax}")
        dim, flip = t.shape[ax], st < 0
        b, en = _norm_index(s, dim, flip), _norm_index(e, dim, flip)
        if flip:
            b, en = en + 1, b + 1
        if en < b and not inverted_ok:
            raise ValueError(f"slice of {t.id} axis {ax}: start {s} / stop {e} give inverted "
                             f"bounds [{b}, {en}); PopART computes length {b - en} and reads "
                             "unspecified data (negative integer indices are broken in PopXL)")
        out.append((ax, b, en, flip))
    return tuple(out)


def _slice_rule(t, slices, steps):
    # BaseSliceOp::createOutInfo (willow/src/op/slice.cpp): ceil(len / |step|)
    shape = list(t.shape)
    for (ax, b, e, _), st in zip(slices, steps):
        shape[ax] = -(-abs(e - b) // abs(st))  # PopART: ceil(abs(len / step))
    return [(tuple(shape), t.dtype)]


def _check_unit_steps(op):
    # BaseSliceOp::growAliasModel refuses |step| != 1 ("Please enable pattern
    # Slice2SliceSubsample first"); the alias model is built when the Session prepares the Ir.
    bad = [st for st in op.attrs["steps"] if abs(st) != 1]
    if bad:
        raise PopartError(f"{op.kind}: only steps of 1 or -1 are supported, got {bad} "
                          "(use subsample)")


def _slice_view(a, slices, steps):
    key = [_pyslice(None)] * a.ndim
    for ax, b, e, _ in slices:
        key[ax] = _pyslice(b, e)
    flips = tuple(ax for ax, _, _, flip in slices if flip)
    out = a[tuple(key)]
    return np.flip(out, axis=flips) if flips else out


def _check_slice_bounds(op):
    # SliceInplaceOp::aliases -> BaseSliceOp::getFullInRegion builds a view::Region from the
    # slice bounds; Region::checks (willow/src/region.cpp) throws popart::error when a lower
    # bound exceeds the upper one. The alias map is built when the Session lowers the Ir.
    _check_unit_steps(op)
    for ax, b, e, _ in op.attrs["slices"]:
        if b > e:
            raise PopartError(f"lower bound {b}, is greater than upper bound {e}, in "
                              f"Region::checks for dimension {ax} ({op.kind} "
                              f"{op.outputs[0].id})")


_register_pair("slice", _slice_rule, _slice_view)
COMPILE_CHECKS["slice"] = _check_unit_steps
COMPILE_CHECKS["slice_"] = _check_slice_bounds


def _process_slice_args(start, stop, step, axis):
    start, stop, step, axis = ([v] if isinstance(v, int) else v for v in (start, stop, step, axis))
    n = None
    for k, v in dict(start=start, stop=stop, step=step, axis=axis).items():
        if v is not None:
            if n is None:
                n = len(v)
            elif n != len(v):
                raise ValueError(f"All inputs must have same length. `{k}` has length "
                                 f"{len(v)} != {n}.")
    step = [1] * n if step is None else [1 if e is None else e for e in step]
    axis = list(range(n)) if axis is None else list(axis)
    start = [(0 if st > 0 else -1) if s is None else s
             for s, st in zip(start or [None] * n, step)]
    stop = [(INT_MAX if st > 0 else INT_MIN) if e is None else e
            for e, st in zip(stop or [None] * n, step)]
    return start, stop, step, axis


def _slice_op(kind, t, start, stop, step, axis):
    _tensor_arg("t", t)
    if start is None and stop is None and step is None:
        return t
    args = [int_vector(kind, name, v) for name, v in
            zip(("start", "stop", "step", "axis"), _process_slice_args(start, stop, step, axis))]
    slices = _slices(t, *args, inverted_ok=kind == "slice_")
    return emit(kind, {"t": t}, {"slices": slices, "steps": args[2]})[0]


def slice(t, start=None, stop=None, step=None, axis=None):  # noqa: A001 - PopXL name
    """ONNX-style slice (steps +-1). Args: ints or lists; axis defaults to 0..k-1.
    Returns: a copy (or ``t`` itself when start, stop and step are all None)."""
    return _slice_op("slice", t, start, stop, step, axis)


def slice_(t, start=None, stop=None, step=None, axis=None):
    """In-place (aliasing) slice. Returns: tensor aliasing part of t."""
    return _slice_op("slice_", t, start, stop, step, axis)


def _subsample_rule(t, strides):
    if any(s < 1 for s in strides):
        raise PopartError(f"subsample: strides must be >= 1, got {strides}")
    return [(tuple(-(-d // s) for d, s in zip(t.shape, strides)), t.dtype)]


register("subsample", _subsample_rule,
         _copy(lambda a, strides: a[tuple(np.s_[::s] for s in strides)]))


def subsample(t, strides):
    """Args: t: Tensor. strides: int or list (padded with 1s). Returns: every k-th element."""
    _tensor_arg("t", t)
    if isinstance(strides, tuple) and len(strides) < t.rank:
        # PopXL pads with ``strides += [1] * k``, which a tuple refuses
        raise TypeError('can only concatenate tuple (not "list") to tuple (subsample strides '
                        "shorter than the rank must be a list)")
    strides = list(int_vector("subsample", "strides",
                              [strides] if isinstance(strides, int) else strides))
    if len(strides) < t.rank:
        strides += [1] * (t.rank - len(strides))
    elif len(strides) > t.rank:
        raise ValueError("The length of subsample `strides` must not be greater than the rank of "
                         "the input tensor.")
    return emit("subsample", {"t": t}, {"strides": tuple(strides)})[0]


# -- gather ----------------------------------------------------------------------------------
def _gather_rule(t, indices, axis, zero_OOR):  # noqa: N803
    ax = norm_axis("gather", axis, t.rank)
    return [(t.shape[:ax] + indices.shape + t.shape[ax + 1:], t.dtype)]


def _gather(a, idx, axis, zero_OOR):  # noqa: N803
    axis = axis + a.ndim if axis < 0 else axis
    dim = a.shape[axis]
    bad = (idx < 0) | (idx >= dim)
    if not bad.any():
        return np.take(a, idx, axis=axis)
    if not zero_OOR:
        raise IndexError(f"gather: index out of range for axis {axis} of size {dim} "
                         "(undefined on device; use zero_OOR=True)")
    out = np.take(a, np.where(bad, 0, idx), axis=axis)
    mask = bad.reshape((1,) * axis + idx.shape + (1,) * (a.ndim - axis - 1))
    return np.where(mask, np.zeros((), a.dtype), out)


def _check_gather_indices(op):
    # GatherOp::setup does not look at the index dtype; GatherOpx reinterprets the indices as
    # unsigned ints (willow/src/popx/op/gatherx.cpp): non-integer indices give garbage.
    indices = op.inputs[1]
    if indices.dtype not in INTS:
        raise PopartError(f"gather: indices {indices.id} must be int32 or uint32, got "
                          f"{indices.dtype.name} (reinterpreted as unsigned by the lowering)")


register("gather", _gather_rule, _gather)
COMPILE_CHECKS["gather"] = _check_gather_indices


def _gather_grad(dy, idx, axis, shape):
    axis = axis + len(shape) if axis < 0 else axis
    out = np.zeros(shape, np.float32)
    keep = (idx >= 0) & (idx < shape[axis])
    moved = np.moveaxis(out, axis, 0)
    g = np.moveaxis(dy.astype(np.float32).reshape(
        shape[:axis] + idx.shape + shape[axis + 1:]), list(range(axis, axis + idx.ndim)),
        list(range(idx.ndim)))
    np.add.at(moved, idx[keep], g[keep])
    return out.astype(dy.dtype)


register("gather_grad", lambda dy, idx, axis, shape: [(tuple(shape), dy.dtype)], _gather_grad)


def gather(t, indices, axis=0, available_memory_proportion=None, zero_OOR=False):  # noqa: N803
    """Args: t: Tensor. indices: int tensor. axis: gather axis. zero_OOR: zero out-of-range.
    Returns: numpy ``take`` result (out of range without zero_OOR raises IndexError at run)."""
    return emit("gather", {"t": t, "indices": indices},
                {"axis": axis, "zero_OOR": bool(zero_OOR)})[0]


_ = dtypes
