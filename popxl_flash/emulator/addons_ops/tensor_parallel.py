"""popxl-addons' tensor-parallel collectives (``ops/replicated_all_reduce_TP``,
``ops/replicated_strided_collectives``):

* ``ReplicatedAllReduceTPOp`` (a ReplicatedAllReduceOp): ``setup`` refuses any operator but Add;
  the grad op is the same op with ``identicalInputs`` and ``identicalGradInputs`` swapped;
  with ``identicalInputs`` the op is an identity that PopART's ``OpToIdentityPattern`` (in the
  pre-alias patterns) must replace before the Session is built (the Opx throws otherwise);
  otherwise it sums over the group.
* ``ReplicatedAllReduceStridedOp``: the same with a (stride, group size) group, operators Add
  and Mean.
* ``ReplicatedAllGatherStridedOp``: a 1-D output of ``group_size * nelms`` (the group's
  flattened inputs in rank order); no grad op.
* ``ReplicatedReduceScatterStridedOp``: ``ceil(nelms / group_size)`` elements, rank k keeps
  chunk k of the reduction (Add, Mean), optionally replica-sharded (meta shape = the input's
  shape); no grad op.

A (stride, group size) group puts replica r in group ``r % s + s * (r // (s * G))``, as
PopXL's ReplicaGrouping. Values, lock step and bytes moved are the emulator's collectives'
(``ops/collectives.py``).
"""
from .. import _internal_ir as _ir
from .. import grads
from ..errors import PopartError
from ..ops import collectives as coll
from ..registry import COMPILE_CHECKS, PREPARE, emit, register
from ._binding import create, grouping_of

_ALL_REDUCE = "addons_replicated_all_reduce"
_GATHER = "addons_replicated_all_gather_strided"
_SCATTER = "addons_replicated_reduce_scatter_strided"
_CPP = {"add": "Add", "mean": "Mean"}


# -- all-reduce (TP and strided) ---------------------------------------------------------------
def _all_reduce_rule(t, grouping, op, identical_inputs, identical_grad_inputs, name,
                     allowed):
    if op not in allowed:
        names = " and ".join(f"CollectiveOperator::{_CPP[a]}" for a in allowed)
        raise PopartError(f"Cannot create {name}Op op. {names}: the only collective operators "
                          "that are currently implemented.")
    if grouping[1] == 0 or grouping[2] == 0:
        raise PopartError(f"Cannot create {name} op stride and group size must be > 0.")
    return [(t.shape, t.dtype)]


def _run_all_reduce(rt, op, args):
    if op.attrs["identical_inputs"]:  # replaced by an identity (checked at compile)
        return [args[0].copy()]
    value = rt.meet(op, args[0], lambda values: coll._COMBINE["replicated_all_reduce"](op.attrs, values))
    rt.collective_bytes += coll._moved_bytes(op)
    return [value]


def _check_all_reduce(op):
    if op.attrs["identical_inputs"] and not op.attrs.get("replaced_by_identity"):
        raise PopartError("You need to run the `OpToIdentityPattern` pattern before running "
                          f"the IR ({op.attrs['name']}Op {op.inputs[0].id}).")
    _check_group(op)


def _check_group(op):
    n, stride, size = op.attrs["grouping"]
    if n != op.graph.ir.replication_factor or n % (stride * size):
        raise PopartError(f"{op.attrs['name']} {op.inputs[0].id}: group (stride {stride}, size "
                          f"{size}) does not partition the {op.graph.ir.replication_factor} "
                          "replicas")


def _all_reduce_grad(ctx, i):
    """The grad op: the same op with the identical-inputs flags swapped; an op the pattern
    already replaced is an IdentityOp, whose gradient is the identity."""
    a = dict(ctx.op.attrs)
    if a.pop("replaced_by_identity", False):
        return ctx.dy(0)
    a["identical_inputs"], a["identical_grad_inputs"] = \
        a["identical_grad_inputs"], a["identical_inputs"]
    return emit(_ALL_REDUCE, {"in0": ctx.dy(0)}, a, names=[a["name"] + "_grad_out"])[0]


register(_ALL_REDUCE, _all_reduce_rule, _run_all_reduce, runtime=True)
PREPARE[_ALL_REDUCE] = lambda op, plan_of: op
COMPILE_CHECKS[_ALL_REDUCE] = _check_all_reduce
grads.RULES[_ALL_REDUCE] = (lambda op: (0,), _all_reduce_grad)


def apply_op_to_identity(graph):
    """PopART's ``OpToIdentityPattern`` on ``graph``'s all-reduce ops with identical inputs
    (``canBeReplacedByIdentity``), as ``Ir.applyPreAliasPatterns(graph)`` runs it."""
    for op in graph._ops:
        if op.kind == _ALL_REDUCE and op.attrs["identical_inputs"]:
            op.attrs["replaced_by_identity"] = True


_ir.PRE_ALIAS_PATTERNS.append(apply_op_to_identity)  # Ir.applyPreAliasPatterns runs it


class ReplicatedAllReduceTPOp:
    """``replicated_all_reduce_TP_binding.ReplicatedAllReduceTPOp``."""

    @staticmethod
    def createOpInGraph(graph, inputs, outputs, op, group, identicalInputs,  # noqa: N802,N803
                        identicalGradInputs, settings):
        """Returns: the created op (``outTensor(0)``: the result)."""
        attrs = {"grouping": grouping_of(group), "op": coll.collective_name(op),
                 "identical_inputs": bool(identicalInputs),
                 "identical_grad_inputs": bool(identicalGradInputs),
                 "name": "ReplicatedAllReduceTP", "allowed": ("add",)}
        return create(graph, _ALL_REDUCE, inputs, outputs, attrs)


class ReplicatedAllReduceStridedOp:
    """``replicated_all_reduce_strided_binding.ReplicatedAllReduceStridedOp``."""

    @staticmethod
    def createOpInGraph(graph, inputs, outputs, op, stride, groupSize,  # noqa: N802,N803
                        identicalInputs, identicalGradInputs, settings):
        attrs = {"grouping": _strided(graph, stride, groupSize),
                 "op": coll.collective_name(op), "identical_inputs": bool(identicalInputs),
                 "identical_grad_inputs": bool(identicalGradInputs),
                 "name": "ReplicatedAllReduceStrided", "allowed": ("add", "mean")}
        return create(graph, _ALL_REDUCE, inputs, outputs, attrs)


def _strided(pb_graph, stride, size):
    return (pb_graph._graph.ir.replication_factor, int(stride), int(size))


# -- strided all-gather and reduce-scatter ------------------------------------------------------
def _gather_rule(t, grouping, name):
    if grouping[1] <= 0 or grouping[2] <= 0:
        raise PopartError("Cannot create ReplicatedAllGatherStrided op stride and group size "
                          "must be > 0.")
    return [((grouping[2] * t.nelms,), t.dtype)]


def _run_gather(rt, op, args):
    attrs = {"grouping": op.attrs["grouping"], "shape": op.outputs[0].shape}
    value = rt.meet(op, args[0], lambda values: coll._COMBINE["replicated_all_gather"](attrs, values))
    rt.collective_bytes += (op.attrs["grouping"][2] - 1) * op.inputs[0]._nbytes
    return [value]


def _scatter_rule(t, grouping, op, rts, name):
    if op not in ("add", "mean"):
        raise PopartError("Cannot create ReplicatedReduceScatterStridedOp op. "
                          "CollectiveOperator::Add and CollectiveOperator::Mean are the only "
                          "collective operators that are currently implemented.")
    if grouping[1] <= 0 or grouping[2] <= 0:
        raise PopartError("Cannot create ReplicatedAllGatherStrided op stride and group size "
                          "must be > 0.")
    return [((-(-t.nelms // grouping[2]),), t.dtype)]


def _run_scatter(rt, op, args):
    value = rt.meet(op, args[0], lambda values: coll._COMBINE["replicated_reduce_scatter"](op.attrs, values))
    rt.collective_bytes += (op.attrs["grouping"][2] - 1) * op.outputs[0]._nbytes
    return [value]


for _kind, _rule, _impl in ((_GATHER, _gather_rule, _run_gather),
                            (_SCATTER, _scatter_rule, _run_scatter)):
    register(_kind, _rule, _impl, runtime=True)
    PREPARE[_kind] = lambda op, plan_of: op
    COMPILE_CHECKS[_kind] = _check_group
grads.NO_GRAD = grads.NO_GRAD | {_GATHER, _SCATTER}  # no getGradOps: the gradient stops


class ReplicatedAllGatherStridedOp:
    """``replicated_all_gather_strided_binding.ReplicatedAllGatherStridedOp``."""

    @staticmethod
    def createOpInGraph(graph, inputs, outputs, stride, groupSize, settings):  # noqa: N802,N803
        attrs = {"grouping": _strided(graph, stride, groupSize),
                 "name": "ReplicatedAllGatherStrided"}
        return create(graph, _GATHER, inputs, outputs, attrs)


class ReplicatedReduceScatterStridedOp:
    """``replicated_reduce_scatter_strided_binding.ReplicatedReduceScatterStridedOp``."""

    @staticmethod
    def createOpInGraph(graph, inputs, outputs, op, stride, groupSize,  # noqa: N802,N803
                        configureOutputForReplicatedTensorSharding, settings):
        rts = bool(configureOutputForReplicatedTensorSharding)
        attrs = {"grouping": _strided(graph, stride, groupSize),
                 "op": coll.collective_name(op), "rts": rts,
                 "name": "ReplicatedReduceScatterStrided"}
        created = create(graph, _SCATTER, inputs, outputs, attrs)
        if rts:
            created._op.outputs[0]._meta_shape = tuple(created._op.inputs[0].shape)
        return created
