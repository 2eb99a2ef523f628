"""Stand-in for the part of ``popart._internal.ir`` that PopXL code outside ``popxl`` uses.

popxl-addons and :mod:`popxl_flash.autodiff` build a ``GradGraphInfo`` for a hand-written
gradient graph the SDK's way::

    import popart._internal.ir as _ir          # here: popxl_flash.emulator._internal_ir
    ins = [_ir.ExpectedConnection(t.id, _ir.ExpectedConnectionType.FwdGrad), ...]
    info = popxl.transforms.GradGraphInfo._from_pb(
        ir._pb_ir, fwd._pb_graph, _ir.BwdGraphInfo(grad._pb_graph.id, ins, outs))

and walk graphs with ``graph._pb_graph.getOps()``, ``op.getCalledGraphs()``,
``op.getInputTensors()``/``getOutputTensors()`` and ``tensor.id``. This module offers exactly
that subset over the emulator's IR (``Ir._pb_ir`` and ``Graph._pb_graph`` return the wrappers
below), so such code runs unchanged on both backends except for where it imports ``_ir`` from.
It is emulator-private: nothing here is PopXL's public API.
"""
import enum
import types

from .errors import PopartError

#: Emulator op kind -> PopART ``Op::opType`` (ONNX-style names) for the kinds listed; any
#: other kind reports itself.
_OP_TYPES = {"call": "Call", "repeat": "Loop", "conditional": "If", "add": "Add", "sub": "Sub",
             "mul": "Mul", "div": "Div", "matmul": "MatMul", "group_norm": "GroupNormalization",
             "init": "Init", "host_load": "HostLoad", "host_store": "HostStore",
             "accumulate_": "Accumulate", "accumulate_square_": "Accumulate",
             "accumulate_mean_": "Accumulate", "accumulate_moving_average_": "Accumulate",
             "accumulate_moving_average_square_": "Accumulate",
             "accumulator_scale_": "AccumulatorScale", "accumulator_zero_": "AccumulatorScale",
             "copy_var_update_": "CopyVarUpdate", "transpose": "Transpose",
             "reshape": "Reshape", "cast": "Cast", "softmax": "Softmax", "exp": "Exp",
             "log": "Log", "sqrt": "Sqrt", "gather": "Gather", "identity": "Identity",
             "where": "Where", "concat": "Concat", "split": "Split", "slice": "Slice"}


#: PopART's pre-alias pattern passes the emulator models, run in order by
#: ``PbIr.applyPreAliasPatterns``: each ``fn(graph)`` rewrites op records of an emulator Graph.
#: Filled by the layers above that model ops such a pattern rewrites (``addons_ops``).
PRE_ALIAS_PATTERNS = []


class CollectiveOperator(enum.Enum):
    """``_ir.CollectiveOperator`` (``bindings/op/enums.cpp``)."""
    Add = 0
    Mean = 1
    Mul = 2
    Min = 3
    Max = 4
    LogicalAnd = 5
    LogicalOr = 6
    SquareAdd = 7
    Local = 8


#: the emulator's collective op names of each operator
COLLECTIVE_NAMES = {CollectiveOperator.Add: "add", CollectiveOperator.Mean: "mean",
                    CollectiveOperator.Min: "min", CollectiveOperator.Max: "max",
                    CollectiveOperator.LogicalAnd: "and", CollectiveOperator.LogicalOr: "or",
                    CollectiveOperator.SquareAdd: "square_add", CollectiveOperator.Local: "local"}


class ReplicaGrouping:
    """``popart.ReplicaGrouping`` (C++) as ``popxl.ReplicaGrouping._pb_replica_grouping``
    gives it: replicas, stride, group size (``willow/src/replicagrouping.cpp`` checks)."""

    def __init__(self, num_replicas, stride, group_size):
        if num_replicas % (stride * group_size):
            raise PopartError("The number of replicas in a `popart::ReplicaGrouping` must be "
                              "divisible by the product of the stride and the group size.")
        self._n, self._stride = num_replicas, stride if group_size > 1 else 1
        self._size = group_size

    def getNumReplicas(self):  # noqa: N802
        return self._n

    def getStride(self):  # noqa: N802
        return self._stride

    def getGroupSize(self):  # noqa: N802
        return self._size

    def getNumGroups(self):  # noqa: N802
        return self._n // self._size


class ExpectedConnectionType(enum.Enum):
    """``_ir.ExpectedConnectionType``."""
    Fwd = "Fwd"
    FwdGrad = "FwdGrad"


class ExpectedConnection:
    """``_ir.ExpectedConnection(fwdId, type)``: a gradient graph input/output's meaning."""

    def __init__(self, fwdId, type):  # noqa: A002, N803 - binding names
        if not isinstance(fwdId, str):
            raise TypeError(f"ExpectedConnection: fwdId must be a str, got {fwdId!r}")
        if not isinstance(type, ExpectedConnectionType):
            raise TypeError(f"ExpectedConnection: type must be an ExpectedConnectionType, got "
                            f"{type!r}")
        self.fwdId, self.type = fwdId, type

    def __eq__(self, other):
        return (isinstance(other, ExpectedConnection) and self.fwdId == other.fwdId
                and self.type == other.type)

    def __repr__(self):
        return f"ExpectedConnection({self.fwdId!r}, {self.type})"


class BwdGraphInfo:
    """``_ir.BwdGraphInfo(bwdGraphId, expectedInputs, expectedOutputs)``."""

    def __init__(self, bwdGraphId, expectedInputs, expectedOutputs):  # noqa: N803
        for name, conns in (("expectedInputs", expectedInputs),
                            ("expectedOutputs", expectedOutputs)):
            if not all(isinstance(c, ExpectedConnection) for c in conns):
                raise TypeError(f"BwdGraphInfo: {name} must be ExpectedConnections")
        self.bwdGraphId = GraphId._of(bwdGraphId)  # a GraphId (a str converts implicitly)
        if self.bwdGraphId is None:
            raise TypeError(f"BwdGraphInfo: bwdGraphId must be a GraphId, got {bwdGraphId!r}")
        self.expectedInputs = list(expectedInputs)
        self.expectedOutputs = list(expectedOutputs)


class TensorInfo:
    """``_ir.TensorInfo`` of a tensor (read-only): ``shape()``, ``nelms()``, ``rank()``."""

    def __init__(self, tensor):
        self._tensor = tensor

    def shape(self):
        return list(self._tensor.shape)

    def nelms(self):
        return self._tensor.nelms

    def rank(self):
        return self._tensor.rank


class PbTensor:
    """Wrapper of an emulator Tensor with the ``_ir.Tensor`` methods used: ``id``, ``info``,
    ``getGraph()``, ``hasProducer()``, ``getProducer()``."""

    def __init__(self, tensor):
        self._tensor = tensor

    id = property(lambda self: self._tensor.id)
    info = property(lambda self: TensorInfo(self._tensor))

    def getGraph(self):  # noqa: N802
        return PbGraph(self._tensor._graph)

    def _producer(self):
        for op in self._tensor._graph._ops:
            if any(o is self._tensor for o in op.outputs):
                return op
        return None

    def hasProducer(self):  # noqa: N802
        return self._producer() is not None

    def getProducer(self):  # noqa: N802
        op = self._producer()
        if op is None:
            raise PopartError(f"No producer for tensor {self.id} to return")
        return make_op(op)

    def __eq__(self, other):
        return isinstance(other, PbTensor) and other._tensor is self._tensor

    def __hash__(self):
        return id(self._tensor)


class PbOp:
    """Wrapper of an emulator op record with the ``_ir.Op`` methods used (``Op`` here); built
    by :func:`make_op` as the ``_ir.op`` class of its PopART op where one is listed."""

    def __init__(self, op):
        self._op = op

    id = property(lambda self: self._op.op_id)

    def __eq__(self, other):
        return isinstance(other, PbOp) and other._op is self._op

    def __hash__(self):
        return id(self._op)

    def opType(self):  # noqa: N802
        """Returns: "Call", "Loop", "If" or the emulator's op kind."""
        return _OP_TYPES.get(self._op.kind, self._op.kind)

    def getCalledGraphs(self):  # noqa: N802
        return [PbGraph(g) for g in self._op.subgraphs]

    def getGraph(self):  # noqa: N802
        return PbGraph(self._op.graph)

    def getInputTensors(self):  # noqa: N802
        return [PbTensor(t) for t in self._op.inputs]

    def getOutputTensors(self):  # noqa: N802
        return [PbTensor(t) for t in self._op.outputs]


class PbGraph:
    """Wrapper of an emulator Graph with the ``_ir.Graph`` methods used (``Graph._pb_graph``)."""

    def __init__(self, graph):
        self._graph = graph

    id = property(lambda self: GraphId(self._graph.id))

    def __eq__(self, other):
        return isinstance(other, PbGraph) and other._graph is self._graph

    def __hash__(self):
        return id(self._graph)

    def getOps(self):  # noqa: N802
        """Returns: the graph's ops in creation (a topological) order."""
        return [make_op(op) for op in self._graph._ops]

    def getOpSchedule(self, require_optimal=True):  # noqa: N802
        """Returns: the ops in an order respecting data and ``in_sequence`` dependencies (the
        emulator's creation order, one of PopART's valid schedules)."""
        return self.getOps()

    def getTensor(self, tensor_id):  # noqa: N802
        return PbTensor(self._graph.get_tensor(tensor_id))

    def getInputIds(self):  # noqa: N802
        return [t.id for t in self._graph._inputs]

    def getOutputIds(self):  # noqa: N802
        return [t.id for t in self._graph._outputs]

    def getInputId(self, index):  # noqa: N802
        return self._graph._inputs[index].id

    def getOutputId(self, index):  # noqa: N802
        return self._graph._outputs[index].id

    def getInputTensor(self, index):  # noqa: N802
        return PbTensor(self._graph._inputs[index])

    def getOutputTensor(self, index):  # noqa: N802
        return PbTensor(self._graph._outputs[index])

    def getInputIndex(self, tensor_id):  # noqa: N802
        return _index(self.getInputIds(), tensor_id, "input", self.id)

    def getOutputIndex(self, tensor_id):  # noqa: N802
        return _index(self.getOutputIds(), tensor_id, "output", self.id)

    def removeOutput(self, index_or_id):  # noqa: N802
        """``Graph::removeOutput``: by tensor id (PopartError when not an output) or by index.

        By index PopART erases ``graph_outputs.begin() + index`` unchecked; for an index at or
        past the end, libstdc++'s ``vector::erase`` removes the last output (undefined
        behaviour that popxl-addons' ``autodiff_with_accumulation`` relies on when it removes
        several outputs by their original, ascending indices); the emulator does the same.
        Call sites of the graph are not updated in PopART, so the emulator refuses a graph that
        is already called.
        """
        g = self._graph
        if any(g in op.subgraphs for other in g.ir._graphs for op in other._ops):
            raise NotImplementedError(f"removeOutput on graph {g.id}, which is already called "
                                      "(PopART leaves its call sites inconsistent)")
        g.ir._check_mutable()
        if isinstance(index_or_id, str):
            del g._outputs[self.getOutputIndex(index_or_id)]
        elif not g._outputs:
            raise PopartError(f"removeOutput: graph {g.id} has no outputs")
        elif index_or_id < len(g._outputs):
            del g._outputs[index_or_id]
        else:
            g._outputs.pop()

    def getCalledGraphs(self):  # noqa: N802
        return [PbGraph(g) for g in self._graph.called_graphs]

    def canBeRecursivelyAutodiffed(self):  # noqa: N802
        return self._graph._can_be_recursively_autodiffed

    def setCanBeRecursivelyAutodiffed(self, value):  # noqa: N802
        self._graph._can_be_recursively_autodiffed = bool(value)


class PbIr:
    """Wrapper of an emulator Ir with the ``_ir.Ir`` methods used: ``getGraph(id)``,
    ``getAllGraphs()``, ``getSessionOptions()``, ``getId()`` and the pattern passes (no-ops on
    the emulator: PopART's pre-alias and inplace patterns rewrite ops into equivalent ones, and
    the emulator computes the unrewritten ops)."""

    def __init__(self, ir):
        self._ir = ir

    def getId(self):  # noqa: N802
        return self._ir.id

    def getAllGraphs(self):  # noqa: N802
        return [PbGraph(g) for g in self._ir._graphs]

    def setPatterns(self, patterns):  # noqa: N802
        if not isinstance(patterns, Patterns):
            raise TypeError(f"setPatterns: expected a patterns.Patterns, got {patterns!r}")
        self._ir._patterns = patterns

    def applyPreAliasPatterns(self, graph):  # noqa: N802
        """PopART's pre-alias patterns on ``graph`` (a graph of this Ir): the emulator's ops
        are already in their final form except the modelled custom ops that
        ``OpToIdentityPattern`` replaces by identities (``addons_ops``, which registers that
        pass in :data:`PRE_ALIAS_PATTERNS`)."""
        self._check_graph(graph)
        for pattern in PRE_ALIAS_PATTERNS:
            pattern(graph._graph)

    def applyInplacePattern(self, graph):  # noqa: N802
        """No-op (see the class docstring); ``graph`` must be a graph of this Ir."""
        self._check_graph(graph)

    def _check_graph(self, graph):
        if not isinstance(graph, PbGraph) or graph._graph.ir is not self._ir:
            raise TypeError(f"expected a graph of this Ir (graph._pb_graph), got {graph!r}")

    def getSessionOptions(self):  # noqa: N802
        """Returns: the Ir's (mutable) SessionOptions, read when a Session compiles it."""
        return self._ir._session_options

    def getGraph(self, graph_id):  # noqa: N802
        for g in self._ir._graphs:
            if g.id == str(graph_id):
                return PbGraph(g)
        raise KeyError(f"No graph {graph_id!r} in {self._ir}")


def _index(ids, tensor_id, what, graph_id):
    if tensor_id not in ids:
        raise PopartError(f"Could not find {what} {tensor_id} in graph {graph_id}")
    return ids.index(tensor_id)


class Patterns:
    """``_ir.patterns.Patterns(level)``: a pattern set (recorded only)."""

    def __init__(self, level=None):
        if level is not None and not isinstance(level, PatternsLevel):
            raise TypeError(f"Patterns: expected a PatternsLevel, got {level!r}")
        # not a bound attribute in PopART (patterns/patterns.cpp): private here
        self._level = level if level is not None else PatternsLevel.Default


class PatternsLevel(enum.Enum):
    """``_ir.patterns.PatternsLevel``."""
    NoPatterns = 0
    Minimal = 1
    Default = 2
    All = 3


patterns = types.SimpleNamespace(Patterns=Patterns, PatternsLevel=PatternsLevel)


class ExecutionContext(enum.Enum):
    """``_ir.ExecutionContext`` (program fragments; the emulator runs ``Normal`` only)."""
    Normal = 0
    AccumulateOuterFragment = 1
    WeightsFromHostFragment = 2
    WeightsToHostFragment = 3
    OptimizerFromHostFragment = 4
    Subgraph = 5


class GraphId:
    """``_ir.GraphId`` (``bindings/graphid.cpp``): built from a str, ``str()``/``__str__``, ``==``,
    ``!=``, ``<`` and a hash; a str converts implicitly where a GraphId is expected (so
    ``GraphId("g") == "g"``). Not a str: it has none of str's methods."""

    def __init__(self, name):
        if not isinstance(name, str):
            raise TypeError(f"GraphId(): incompatible constructor arguments: {name!r}")
        self._name = name

    @staticmethod
    def _of(value):
        return value if isinstance(value, GraphId) else \
            GraphId(value) if isinstance(value, str) else None

    def str(self):
        return self._name

    def __str__(self):
        return self._name

    def __repr__(self):
        return f"GraphId({self._name!r})"

    def __eq__(self, other):
        other = GraphId._of(other)
        return NotImplemented if other is None else self._name == other._name

    def __ne__(self, other):
        other = GraphId._of(other)
        return NotImplemented if other is None else self._name != other._name

    def __lt__(self, other):
        other = GraphId._of(other)
        if other is None:
            return NotImplemented
        return self._name < other._name

    def __hash__(self):
        return hash(self._name)


Op, Graph, Tensor, Ir = PbOp, PbGraph, PbTensor, PbIr


def _op_class(name, base=PbOp):
    return type(name, (base,), {"__doc__": f"``_ir.op.{name}``."})


class TopoCons:
    """``_ir.TopoCons`` (annotation only; the emulator keeps topological constraints as op
    ``after`` lists)."""

    def __init__(self):
        raise NotImplementedError("_ir.TopoCons is not implemented by the emulator")


class _Region:
    """``_ir.view.Region`` (used for route_tensor's modified regions): not implemented."""

    def __init__(self, *args):
        raise NotImplementedError("_ir.view.Region is not implemented by the emulator")

    @staticmethod
    def getFull(shape):  # noqa: N802
        raise NotImplementedError("_ir.view.Region is not implemented by the emulator")

    getEmpty = getFull


view = types.SimpleNamespace(Region=_Region)

#: Emulator op kind -> PopART op class name (``_ir.op.<name>``), for isinstance checks.
_OP_CLASSES = {"call": "CallOp", "repeat": "LoopOp", "conditional": "IfOp", "init": "InitOp",
               "add": "AddOp", "sub": "SubtractOp", "mul": "MulOp", "div": "DivOp",
               "matmul": "MatMulOp", "add_": "AddLhsInplaceOp", "host_load": "HostLoadOp",
               "host_store": "HostStoreOp",
               **{k: "AccumulateOp" for k in ("accumulate_", "accumulate_square_",
                                              "accumulate_mean_", "accumulate_moving_average_",
                                              "accumulate_moving_average_square_")}}
_OP_CLASSES.update({"random_uniform": "RandomUniformOp", "random_normal": "RandomNormalOp",
                    "dropout": "DropoutOp", "modify_random_seed": "ModifyRandomSeedOp",
                    "split": "SplitOp", "gather": "GatherOp", "gelu": "GeluOp",
                    "gelu_": "GeluInplaceOp"})
_OP_CLASSES.update({
    "reshape": "ReshapeOp", "reshape_": "ReshapeInplaceOp", "transpose": "TransposeOp",
    "transpose_": "TransposeInplaceOp", "group_norm": "GroupNormOp",
    "group_norm_grad": "GroupNormGradOp", "softmax": "SoftmaxOp", "cast": "CastOp",
    "concat": "ConcatOp", "slice": "SliceOp", "slice_": "SliceInplaceOp",
    "identity": "IdentityOp", "where": "WhereOp", "exp": "ExpOp", "exp_": "ExpInplaceOp",
    "log": "LogOp", "sqrt": "SqrtOp", "tanh": "TanhOp", "relu": "ReluOp",
    "relu_": "ReluInplaceOp", "negate": "NegateOp", "abs": "AbsOp", "sin": "SinOp",
    "cos": "CosOp", "pow": "PowOp", "sum": "ReduceSumOp", "mean": "ReduceMeanOp",
    "max": "ReduceMaxOp", "min": "ReduceMinOp", "prod": "ReduceProdOp",
    "logsumexp": "ReduceLogSumExpOp", "maximum": "MaxOp",
    "greater": "GreaterOp", "equal": "EqualOp", "logical_and": "AndOp", "logical_or": "OrOp",
    "logical_not": "NotOp", "scaled_add": "ScaledAddOp", "scaled_add_": "ScaledAddLhsInplaceOp",
    "nll_loss": "NllOp", "nll_grad": "NllGradOp",
    "nll_loss_with_softmax_grad": "NlllWithSoftmaxGradDirectOp", "swish": "SwishOp",
    "swish_": "SwishInplaceOp", "gelu_grad": "GeluGradOp", "swish_grad": "SwishGradOp",
    "gather_grad": "GatherGradOp", "accumulator_scale_": "AccumulatorScaleOp",
    "accumulator_zero_": "AccumulatorZeroOp", "copy_var_update_": "CopyVarUpdateOp",
    "adam_updater": "AdamUpdaterOp", "increment_mod": "IncrementModOp",
    "increment_mod_": "IncrementModInplaceOp", "subsample": "SubsampleOp",
    "fmod": "FmodOp", "floor": "FloorOp", "ceil": "CeilOp", "sign": "SignOp",
    "isnan": "IsNaN", "isinf": "IsInf", "matmul": "MatMulOp", "detach": "DetachOp",
    "dropout": "DropoutOp"})
#: ``_ir.op.<namespace>``: the op headers in ``op/dynamic/`` and ``op/exchange/``
_NAMESPACED = {"dynamic_slice": ("dynamic", "DynamicSliceOp"),
               "dynamic_update": ("dynamic", "DynamicUpdateOp"),
               "dynamic_update_": ("dynamic", "DynamicUpdateInplaceOp"),
               "remote_load": ("exchange", "RemoteLoadOp"),
               "remote_load_": ("exchange", "RemoteLoadInplaceOp"),
               "remote_store": ("exchange", "RemoteStoreOp")}
_EXCHANGE = ("HostLoadOp", "HostStoreOp")
#: ``_ir.op.collectives``: PopART's ``op/collectives/`` headers, with their base classes
_COLLECTIVE_CLASSES = {"replicated_all_gather": "ReplicatedAllGatherOp",
                       "replicated_reduce_scatter": "ReplicatedReduceScatterOp",
                       "replicated_all_reduce": "ReplicatedAllReduceOp",
                       "replicated_all_reduce_": "ReplicatedAllReduceInplaceOp"}
_classes = {name: _op_class(name) for name in sorted(set(_OP_CLASSES.values()))}
for _name in ("IpuCopyOp", "MulLhsInplaceOp", "MulRhsInplaceOp"):
    _classes[_name] = _op_class(_name)
_collectives = {"CollectivesBaseOp": _op_class("CollectivesBaseOp")}
for _name in ("ReplicatedAllGatherOp", "ReplicatedReduceScatterOp", "ReplicatedAllReduceOp"):
    _collectives[_name] = _op_class(_name, _collectives["CollectivesBaseOp"])
_collectives["ReplicatedAllReduceInplaceOp"] = _op_class(
    "ReplicatedAllReduceInplaceOp", _collectives["ReplicatedAllReduceOp"])
for _name in ("CallOp", "LoopOp"):  # SubgraphOp::getCalledGraph
    _classes[_name].getCalledGraph = lambda self: PbGraph(self._op.subgraphs[0])
_classes["LoopOp"].getTripCountValue = lambda self: self._op.attrs["count"]
_spaces = {"dynamic": {}, "exchange": {n: _classes[n] for n in _EXCHANGE}}
for _space, _name in _NAMESPACED.values():
    _spaces[_space][_name] = _op_class(_name)
op = types.SimpleNamespace(**{n: c for n, c in _classes.items() if n not in _EXCHANGE},
                           exchange=types.SimpleNamespace(**_spaces["exchange"]),
                           dynamic=types.SimpleNamespace(**_spaces["dynamic"]),
                           collectives=types.SimpleNamespace(**_collectives))
del _name, _space


def make_op(record):
    """Returns: the ``_ir.Op`` wrapper of an emulator op record, of its ``_ir.op`` class."""
    if record.kind in _COLLECTIVE_CLASSES:
        return _collectives[_COLLECTIVE_CLASSES[record.kind]](record)
    if record.kind in _NAMESPACED:
        space, name = _NAMESPACED[record.kind]
        return _spaces[space][name](record)
    cls = _classes.get(_OP_CLASSES.get(record.kind), PbOp)
    return cls(record)
