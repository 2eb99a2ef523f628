"""``popxl.ops.collectives``: the cross-replica collectives of PopXL 3.4.

Three primitive op kinds, as PopART's IR has them (``willow/src/op/collectives/``):

* ``replicated_all_gather`` (ReplicatedAllGatherOp): the group's inputs, flattened and
  concatenated in group-rank order, reshaped to the output shape the wrapper gives.
* ``replicated_reduce_scatter`` (ReplicatedReduceScatterOp): a 1-D output of
  ``ceil(nelms / group_size)`` elements; group rank k gets the k-th chunk of the reduction of
  the group's flattened inputs (``Local``: of its own input, no reduction).
* ``replicated_all_reduce`` / ``replicated_all_reduce_`` (in place): the reduction, same shape.

The public functions compose them with transposes and reshapes exactly as PopXL's wrappers
(``python/popxl/python_files/ops/collectives/*.py``) do, so shapes, autodiff and refusals come
out the same. A ``ReplicaGrouping`` (stride s, group size G) puts replica r in group
``r % s + s * (r // (s * G))`` at rank ``(r - first replica of the group) / s``
(``willow/src/replicagrouping.cpp``; GCL's CONSECUTIVE comm group, ``collectivesx.cpp``).

Replicas execute in lock step (``replication.py``); each collective also counts the bytes a
replica receives over the IPU links under a ring schedule (run profile ``collective_bytes``):
all-gather ``(G-1)`` input sizes, reduce-scatter ``(G-1)`` output chunks, all-reduce twice
that (reduce-scatter then all-gather), a ``Local`` slice nothing.
"""
import numpy as np

from .. import dtypes
from .._internal_ir import COLLECTIVE_NAMES
from ..context import gcg
from ..errors import PopartError
from ..ir import check_in_graph
from ..registry import COMPILE_CHECKS, PREPARE, emit, register

#: PopXL's ``OP_MAP`` (3.4): note "mul" is Mean there (a table bug, kept).
OP_MAP = {"add": "add", "mean": "mean", "mul": "mean", "min": "min", "max": "max",
          "and": "and", "or": "or", "square_add": "square_add"}
#: ``OpDefinition::DataTypes T`` of the three ops.
_DTYPES = frozenset((dtypes.float32, dtypes.float16, dtypes.int32, dtypes.uint32))


def _to_collective_op(op):
    """The emulator's name of collective ``op`` (ValueError for an unknown name, as PopXL)."""
    try:
        return OP_MAP[op]
    except KeyError:
        raise ValueError(f"Not a valid op: {op}. Must choose from: "
                         f"{', '.join(OP_MAP.keys())}") from None


def to_collective_op(op):
    """``popxl.ops.collectives.collectives.to_collective_op``: the ``_ir.CollectiveOperator``
    of ``op`` ("mul" gives Mean, as PopXL 3.4's table). Raises: ValueError."""
    name = _to_collective_op(op)
    return next(k for k, v in COLLECTIVE_NAMES.items() if v == name)


def collective_name(operator):
    """The emulator's collective name of an ``_ir.CollectiveOperator`` (custom ops get one
    from PopXL code). Raises: ValueError for Mul (PopXL maps no name to it)."""
    if operator not in COLLECTIVE_NAMES:
        raise ValueError(f"collective operator {operator} is not modelled by the emulator")
    return COLLECTIVE_NAMES[operator]


# -- groups ------------------------------------------------------------------------------------
def _grouping(group):
    """``(num_replicas, stride, group_size)`` of ``group`` (None: all replicas), as PopXL's
    ``group._pb_replica_grouping`` gives it to the op."""
    ir = gcg().ir
    if group is None:
        r = ir.replication_factor
        return (r, 1, r)
    if not getattr(group, "is_const", True):
        raise NotImplementedError(
            "This ReplicaGrouping has a non-constant stride and has no PopART C++ "
            "representation. You can't use this ReplicaGrouping with GCL ops. ")
    n = len(group.assignment)
    stride, size = int(group.stride), int(group.group_size)
    if size == 1:
        stride = 1
    if n % (stride * size):
        raise ValueError("The number of replicas in a `popart::ReplicaGrouping` must be "
                         "divisible by the product of the stride and the group size.")
    return (n, stride, size)


def groups_of(grouping):
    """Args: grouping: (num_replicas, stride, group_size). Returns: list of groups, each the
    list of its replicas in rank order."""
    n, stride, size = grouping
    groups = {}
    for r in range(n):
        g = r % stride + stride * (r // (stride * size))
        groups.setdefault(g, []).append(r)
    return [groups[g] for g in sorted(groups)]


# -- reductions --------------------------------------------------------------------------------
def _reduce(values, op):
    """Elementwise reduction of equal-shape arrays in rank order (float16 accumulates in float32
    and rounds once)."""
    dt = values[0].dtype
    if op in ("min", "max"):
        fn = np.minimum if op == "min" else np.maximum
        out = values[0]
        for v in values[1:]:
            out = fn(out, v)
        return np.array(out, dt)
    acc = np.float32 if dt == np.float16 else dt.type
    terms = [v.astype(acc) for v in values]
    if op == "square_add":
        terms = [t * t for t in terms]
    out = terms[0].copy()
    for t in terms[1:]:
        out += t
    if op == "mean":
        out = out / acc(len(values))
    return out.astype(dt)


def _all_gather(attrs, values):
    out = [None] * len(values)
    for members in groups_of(attrs["grouping"]):
        full = np.concatenate([values[r].reshape(-1) for r in members])
        # a meta-shape gather drops the reduce-scatter's zero padding
        full = full[:int(np.prod(attrs["shape"], dtype=np.int64))].reshape(attrs["shape"])
        for r in members:
            out[r] = full.copy()
    return out


def _padded(value, size):
    """``value`` flattened and zero-padded to ``size`` elements (GCL pads the last chunk of a
    reduce-scatter whose element count the group does not divide)."""
    flat = value.reshape(-1)
    if flat.size == size:
        return flat
    return np.concatenate([flat, np.zeros(size - flat.size, flat.dtype)])


def _reduce_scatter(attrs, values):
    out = [None] * len(values)
    op = attrs["op"]
    for members in groups_of(attrs["grouping"]):
        chunk = -(-values[members[0]].size // len(members))
        padded = [_padded(values[r], chunk * len(members)) for r in members]
        if op != "local":
            red = _reduce(padded, op)
        for k, r in enumerate(members):
            src = padded[k] if op == "local" else red
            out[r] = np.array(src[k * chunk:(k + 1) * chunk], copy=True)
    return out


def _all_reduce(attrs, values):
    out = [None] * len(values)
    for members in groups_of(attrs["grouping"]):
        red = _reduce([values[r] for r in members], attrs["op"])
        for r in members:
            out[r] = red.copy()
    return out


_COMBINE = {"replicated_all_gather": _all_gather,
            "replicated_reduce_scatter": _reduce_scatter,
            "replicated_all_reduce": _all_reduce, "replicated_all_reduce_": _all_reduce}


def _moved_bytes(op):
    """Bytes one replica receives for ``op`` under a ring schedule (module docstring)."""
    size = op.attrs["grouping"][2]
    if op.kind == "replicated_all_gather":
        return (size - 1) * op.inputs[0]._nbytes
    if op.kind == "replicated_reduce_scatter":
        return 0 if op.attrs["op"] == "local" else (size - 1) * op.outputs[0]._nbytes
    chunk = -(-op.inputs[0]._nbytes // size)
    return 2 * (size - 1) * chunk


def _run(rt, data, args):
    op, combine, moved = data
    value = rt.meet(op, args[0], lambda values: combine(op.attrs, values))
    rt.collective_bytes += moved
    if op.kind == "replicated_all_reduce_":
        args[0][...] = value
        return [args[0]]
    return [value]


def _prepare(op, plan_of):
    return (op, _COMBINE[op.kind], _moved_bytes(op))


def _same_rule(t, grouping, op):
    return [(t.shape, t.dtype)]


def _gather_rule(t, grouping, shape):
    return [(tuple(shape), t.dtype)]


def _scatter_rule(t, grouping, op):
    return [((-(-t.nelms // grouping[2]),), t.dtype)]


register("replicated_all_gather", _gather_rule, _run, runtime=True)
register("replicated_reduce_scatter", _scatter_rule, _run, runtime=True)
register("replicated_all_reduce", _same_rule, _run, runtime=True)
register("replicated_all_reduce_", _same_rule, _run, alias="modify", runtime=True)
for _kind in _COMBINE:
    PREPARE[_kind] = _prepare


def _compile_check(op):
    """What PopART builds but the lowering (GCL) refuses or leaves unspecified."""
    t = op.inputs[0]
    n, _, size = op.attrs["grouping"]
    ir = op.graph.ir
    if n != ir.replication_factor:
        raise PopartError(f"{op.kind} {t.id}: its replica grouping is for {n} replicas but the "
                          f"Ir has replication_factor {ir.replication_factor}")
    if t.dtype not in _DTYPES:
        raise PopartError(f"{op.kind} {t.id}: dtype {t.dtype.name} is not one of the op's "
                          "types (float32, float16, int32, uint32)")
    kind = op.attrs.get("op")
    if kind in ("and", "or"):
        raise PopartError(f"{op.kind} {t.id}: logical '{kind}' on a {t.dtype.name} tensor is "
                          "left unspecified by GCL (the op's types are numeric)")
    if kind in ("mean", "square_add") and t.dtype in (dtypes.int32, dtypes.uint32):
        raise PopartError(f"{op.kind} {t.id}: '{kind}' of an integer tensor is unspecified "
                          "(rounding of the device's mean/square is not documented)")
    if op.kind == "replicated_all_gather" and \
            int(np.prod(op.outputs[0].shape, dtype=np.int64)) > size * t.nelms:
        raise PopartError(f"{op.kind} {t.id}: output shape {op.outputs[0].shape} does not hold "
                          f"{size} x {t.nelms} gathered elements (the lowering reshapes to it)")


for _kind in _COMBINE:
    COMPILE_CHECKS[_kind] = _compile_check


# -- PopXL's wrappers (ops/collectives/collectives.py) -----------------------------------------
def _rearrange_input(t, axis):
    if axis > 0:
        permutation = list(range(len(t.shape)))
        permutation.pop(axis)
        permutation.insert(0, axis)
        t = t.transpose(permutation)
    preshape = list(t.shape)
    return t.flatten(), preshape


def _rearrange_output(y, new_shape, axis):
    y = y.reshape(new_shape)
    if axis > 0:
        permutation = list(range(len(y.shape)))
        permutation.pop(0)
        permutation.insert(axis, 0)
        y = y.transpose(permutation)
    return y


def replicated_all_gather(t, axis=0, group=None, output_shape="auto"):
    """Gather ``t`` from every replica of ``group`` (PopXL 3.4 signature).

    Args:
        t: Tensor. axis: concat axis ("concat"). group: ReplicaGrouping (default: all).
        output_shape: "new_axis" ``(G, *t.shape)``, "concat" (concat on ``axis``),
            "meta_shape" (a replica-sharded ``t``: the shards, in group-rank order, fill
            ``t.meta_shape``), "auto".
    Returns:
        The gathered Tensor (identical on the replicas of a group).
    """
    g = gcg()
    check_in_graph(g, t=t)
    grouping = _grouping(group)
    if not isinstance(axis, int):
        raise ValueError(f"Axis should be an int. Type: {type(axis)}. Value: {axis}")
    if output_shape == "auto":
        output_shape = "meta_shape" if t.meta_shape else "concat"
    if output_shape == "meta_shape":  # the shard is gathered as is into the meta shape
        return emit("replicated_all_gather", {"t": t},
                    {"grouping": grouping, "shape": tuple(t.meta_shape)},
                    names=[t.name + "_all_gathered"])[0]
    t_input, concat_shape = _rearrange_input(t, axis)
    concat_shape[0] *= grouping[2]
    if output_shape == "new_axis":
        new_shape = (grouping[2], *t.shape)
    elif output_shape == "concat":
        new_shape = concat_shape
    else:
        raise ValueError("output_shape must equal one of 'new_axis', 'concat', 'meta_shape', "
                         f"'auto'. Value: {output_shape}")
    out = emit("replicated_all_gather", {"t": t_input},
               {"grouping": grouping, "shape": tuple(new_shape)},
               names=[t_input.name + "_all_gathered"])[0]
    return _rearrange_output(out, new_shape, axis)


def _reduce_scatter(t, op, group, rts, suffix):
    """The ReplicatedReduceScatterOp; ``rts``: its output is a replica-sharded tensor whose
    meta shape is the input's shape (``ReplicatedReduceScatterOp::setup``)."""
    check_in_graph(gcg(), t=t)
    grouping = _grouping(group)
    out = emit("replicated_reduce_scatter", {"t": t}, {"grouping": grouping, "op": op},
               names=[t.name + suffix])[0]
    if rts:
        out._meta_shape = tuple(t.shape)
    return out


def replicated_reduce_scatter(t, op="add", group=None,
                              configure_output_for_replicated_tensor_sharding=False):
    """Reduce ``t`` over the replicas of ``group``; group rank k keeps the k-th 1/G of the
    flattened result.

    Args:
        t: Tensor (flattened). op: "add", "mean", "mul" (= mean in 3.4), "min", "max", "and",
            "or", "square_add". group: ReplicaGrouping (default: all replicas).
        configure_output_for_replicated_tensor_sharding: the output is a replica-sharded
            tensor with meta shape ``t.shape`` (shards in the flattened order: see README).
    Returns:
        1-D Tensor of ``ceil(t.nelms / G)`` elements.
    """
    return _reduce_scatter(t, _to_collective_op(op), group,
                           configure_output_for_replicated_tensor_sharding, "_reduce_scattered")


def replica_sharded_slice(t, group=None):
    """Group rank k keeps the k-th chunk of its own flattened ``t`` (zero-padded), as a
    replica-sharded tensor with meta shape ``t.shape`` (a Local reduce-scatter with RTS)."""
    return _reduce_scatter(t, "local", group, True, "_sharded_slice")


def replicated_slice(t, axis=0, group=None):
    """Group rank k takes the k-th of G equal slices of ``t`` along ``axis`` (an axis of
    length G is dropped, as PopXL's wrapper does).

    Args:
        t: Tensor. axis: int. group: ReplicaGrouping (default: all replicas).
    Returns:
        Tensor.
    """
    grouping = _grouping(group)
    size = grouping[2]
    if t.shape[axis] % size != 0:
        raise ValueError(f"Replicated slice must equally divide axis. Axis size: "
                         f"{t.shape[axis]}. Replica group size: {size}")
    t_re, new_shape = _rearrange_input(t, axis)
    if t.shape[axis] / size == 1:
        new_shape.pop(0)
    else:
        new_shape[0] //= size
    out = _reduce_scatter(t_re, "local", group, False, "_replicated_slice")
    return _rearrange_output(out, new_shape, axis)


def _all_reduce(kind, t, op, group):
    check_in_graph(gcg(), t=t)
    op = _to_collective_op(op)
    grouping = _grouping(group)
    return emit(kind, {"t": t}, {"grouping": grouping, "op": op},
                names=[t.name + "_all_reduce"])[0]


def replicated_all_reduce(t, op="add", group=None):
    """Args: t: Tensor. op: as ``replicated_reduce_scatter``. group: ReplicaGrouping.
    Returns: the reduction over the group's replicas (same shape)."""
    return _all_reduce("replicated_all_reduce", t, op, group)


def replicated_all_reduce_(t, op="add", group=None):
    """In-place ``replicated_all_reduce`` on ``t``. Returns: Tensor aliasing ``t``."""
    return _all_reduce("replicated_all_reduce_", t, op, group)
