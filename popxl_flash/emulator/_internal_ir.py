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

_OP_TYPES = {"call": "Call", "repeat": "Loop", "conditional": "If"}


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
        self.bwdGraphId = str(bwdGraphId)
        self.expectedInputs = list(expectedInputs)
        self.expectedOutputs = list(expectedOutputs)


class PbTensor:
    """Wrapper of an emulator Tensor with the ``_ir.Tensor`` attributes used: ``id``."""

    def __init__(self, tensor):
        self._tensor = tensor

    id = property(lambda self: self._tensor.id)


class PbOp:
    """Wrapper of an emulator op record with the ``_ir.Op`` methods used."""

    def __init__(self, op):
        self._op = op

    def opType(self):  # noqa: N802
        """Returns: "Call", "Loop", "If" or the emulator's op kind."""
        return _OP_TYPES.get(self._op.kind, self._op.kind)

    def getCalledGraphs(self):  # noqa: N802
        return [PbGraph(g) for g in self._op.subgraphs]

    def getInputTensors(self):  # noqa: N802
        return [PbTensor(t) for t in self._op.inputs]

    def getOutputTensors(self):  # noqa: N802
        return [PbTensor(t) for t in self._op.outputs]


class PbGraph:
    """Wrapper of an emulator Graph with the ``_ir.Graph`` methods used (``Graph._pb_graph``)."""

    def __init__(self, graph):
        self._graph = graph

    id = property(lambda self: self._graph.id)

    def getOps(self):  # noqa: N802
        """Returns: the graph's ops in creation (a topological) order."""
        return [PbOp(op) for op in self._graph._ops]

    def getCalledGraphs(self):  # noqa: N802
        return [PbGraph(g) for g in self._graph.called_graphs]

    def canBeRecursivelyAutodiffed(self):  # noqa: N802
        return self._graph._can_be_recursively_autodiffed

    def setCanBeRecursivelyAutodiffed(self, value):  # noqa: N802
        self._graph._can_be_recursively_autodiffed = bool(value)


class PbIr:
    """Wrapper of an emulator Ir with the ``_ir.Ir`` methods used: ``getGraph(id)`` and
    ``getSessionOptions()``."""

    def __init__(self, ir):
        self._ir = ir

    def getSessionOptions(self):  # noqa: N802
        """Returns: the Ir's (mutable) SessionOptions, read when a Session compiles it."""
        return self._ir._session_options

    def getGraph(self, graph_id):  # noqa: N802
        for g in self._ir._graphs:
            if g.id == str(graph_id):
                return PbGraph(g)
        raise KeyError(f"No graph {graph_id!r} in {self._ir}")
