"""The result types of ``popxl.transforms.autodiff``, as in PopXL 3.3/3.4: ``GradGraphInfo``
and its ``ExpectedConnection(Type)``s (:mod:`.autodiff` and the engine, :mod:`._engine`, make
them).

``GradGraphInfo`` has no public constructor (``TypeError``); it is made by ``autodiff`` or,
for a hand-written gradient graph, with ``GradGraphInfo._from_pb(ir._pb_ir, fwd._pb_graph,
_ir.BwdGraphInfo(grad._pb_graph.id, ins, outs))`` where ``_ir`` is
:mod:`popxl_flash.emulator._internal_ir` (``popart._internal.ir`` on the SDK).
"""
from enum import Enum

from .. import _internal_ir as _ir
from ..ir import Graph


class ExpectedConnectionType(Enum):
    """Whether a gradient-graph input/output is a forward tensor or its gradient."""
    Fwd = "Fwd"
    FwdGrad = "FwdGrad"

    @classmethod
    def _from_pb(cls, type_):
        return cls.Fwd if type_ == _ir.ExpectedConnectionType.Fwd else cls.FwdGrad


class ExpectedConnection:
    """A gradient-graph input/output: ``fwd_tensor`` and ``connection_type``."""

    def __init__(self):
        raise TypeError("ExpectedConnection should not be constructed directly. Use "
                        "ExpectedConnection._from_pb instead.")

    @classmethod
    def _from_pb(cls, fwd_graph, pb_ec):
        self = super().__new__(cls)
        self._fwd_graph, self._pb_ec = fwd_graph, pb_ec
        return self

    @property
    def fwd_tensor(self):
        """The forward-graph tensor this connection refers to."""
        return self._fwd_graph._graph.get_tensor(self._pb_ec.fwdId)

    @property
    def connection_type(self):
        """``ExpectedConnectionType.Fwd`` or ``FwdGrad``."""
        return ExpectedConnectionType._from_pb(self._pb_ec.type)

    def __repr__(self):
        return f"({self.connection_type}, {self.fwd_tensor})"


class GradGraphInfo:
    """The result of :func:`autodiff` for one forward graph.

    ``graph``: the gradient graph; ``forward_graph``; ``expected_inputs``/``expected_outputs``:
    one ``ExpectedConnection`` per gradient-graph input/output, in order.
    """

    def __init__(self):
        raise TypeError("GradGraphInfo should not be constructed directly. Use "
                        "GradGraphInfo._from_pb instead.")

    @classmethod
    def _from_pb(cls, ir, fwd_graph, _pb_bwd_info):
        """Args: ir: ``Ir._pb_ir``. fwd_graph: ``Graph._pb_graph``. _pb_bwd_info:
        ``_internal_ir.BwdGraphInfo``. Returns: GradGraphInfo."""
        if not isinstance(ir, _ir.PbIr) or not isinstance(fwd_graph, _ir.PbGraph):
            raise TypeError("GradGraphInfo._from_pb expects (ir._pb_ir, graph._pb_graph, "
                            "BwdGraphInfo)")
        if not isinstance(_pb_bwd_info, _ir.BwdGraphInfo):
            raise TypeError(f"Expected a BwdGraphInfo, got {_pb_bwd_info!r}")
        self = super().__new__(cls)
        self._ir, self._fwd_graph, self._pb_bwd_info = ir, fwd_graph, _pb_bwd_info
        self._expected_inputs = [ExpectedConnection._from_pb(fwd_graph, e)
                                 for e in _pb_bwd_info.expectedInputs]
        self._expected_outputs = [ExpectedConnection._from_pb(fwd_graph, e)
                                  for e in _pb_bwd_info.expectedOutputs]
        return self

    @property
    def graph(self):
        """The gradient graph."""
        return Graph._from_pb(self._ir.getGraph(self._pb_bwd_info.bwdGraphId))

    @property
    def forward_graph(self):
        """The forward graph."""
        return Graph._from_pb(self._fwd_graph)

    expected_inputs = property(lambda self: tuple(self._expected_inputs))
    expected_outputs = property(lambda self: tuple(self._expected_outputs))

    @property
    def inputs(self):
        """The forward tensors of ``expected_inputs``."""
        return tuple(ec.fwd_tensor for ec in self._expected_inputs)

    @property
    def outputs(self):
        """The forward tensors of ``expected_outputs``."""
        return tuple(ec.fwd_tensor for ec in self._expected_outputs)

    def inputs_dict(self, fwd_call_info):
        """Map the ``Fwd`` inputs of the gradient graph to tensors of a forward call site.

        Args:
            fwd_call_info: ``CallSiteInfo`` of a call of ``forward_graph``.
        Returns:
            ``{gradient-graph input: parent tensor}`` (``FwdGrad`` inputs are not included).
        """
        if fwd_call_info.called_graph != self.forward_graph:
            raise TypeError("The called graph does not match the graph that was "
                            "differentiated.")
        grad_inputs = self.graph.inputs
        return {grad_inputs[idx]: fwd_call_info.graph_to_parent(ec.fwd_tensor)
                for idx, ec in enumerate(self._expected_inputs)
                if ec.connection_type == ExpectedConnectionType.Fwd}

    def fwd_graph_ins_to_grad_parent_outs(self, grad_call_info):
        """Returns: ``{forward-graph input: gradient output at the grad call site}``."""
        outs = self.graph.outputs
        return {t: grad_call_info.graph_to_parent(outs[idx])
                for idx, t in enumerate(self.outputs)}

    def fwd_parent_ins_to_grad_parent_outs(self, fwd_call_info, grad_call_info):
        """Returns: ``{parent input of the forward call: gradient output of the grad call}``."""
        outs = self.graph.outputs
        return {fwd_call_info.graph_to_parent(t): grad_call_info.graph_to_parent(outs[idx])
                for idx, t in enumerate(self.outputs)}

    def __repr__(self):
        ins = "".join(f"    {ec!r}\n" for ec in self.expected_inputs)
        outs = "".join(f"    {ec!r}\n" for ec in self.expected_outputs)
        return (f"GradGraphInfo[\n  graph={self.graph.id}\n  expected_inputs=[\n{ins}  ]\n"
                f"  expected_outputs=[\n{outs}  ]\n]")
