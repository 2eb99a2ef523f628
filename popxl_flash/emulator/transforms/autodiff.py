"""``popxl.transforms.autodiff`` and its result types (``grad_info.py``), as in PopXL 3.3/3.4.

``GradGraphInfo`` has no public constructor (``TypeError``); it is made by :func:`autodiff` or,
for a hand-written gradient graph, with ``GradGraphInfo._from_pb(ir._pb_ir, fwd._pb_graph,
_ir.BwdGraphInfo(grad._pb_graph.id, ins, outs))`` where ``_ir`` is
:mod:`popxl_flash.emulator._internal_ir` (``popart._internal.ir`` on the SDK).
"""
from ..ir import Graph
from ._engine import differentiate
from .grad_info import ExpectedConnection, ExpectedConnectionType, GradGraphInfo

__all__ = ["ExpectedConnection", "ExpectedConnectionType", "GradGraphInfo", "autodiff"]


def autodiff(graph, grads_provided=None, grads_required=None, called_graphs_grad_info=None,
             return_all_grad_graphs=False):
    """Differentiate ``graph`` (PopXL semantics, reference section 7).

    Mutates the forward graphs: forward tensors the gradient graphs read become extra outputs,
    and every existing ``ops.call`` of such a graph gets the extra outputs. Called subgraphs
    are differentiated first unless ``called_graphs_grad_info`` has an entry for them (every
    graph reachable from ``graph`` is visited; an entry skips one graph, not its descendants).

    Args:
        graph: the forward graph.
        grads_provided: outputs whose gradients the gradient graph takes (default all outputs).
        grads_required: tensors whose gradients it returns (default all inputs).
        called_graphs_grad_info: ``{Graph: GradGraphInfo}`` to use for calls of those graphs.
        return_all_grad_graphs: return ``{Graph: GradGraphInfo}`` for every graph involved.

    Returns:
        GradGraphInfo of ``graph`` (or the dict).
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"autodiff: graph must be a popxl.Graph, got {graph!r}")
    provided = list(graph.outputs if grads_provided is None else grads_provided)
    required = list(graph.inputs if grads_required is None else grads_required)
    infos = dict(called_graphs_grad_info or {})
    for g, info in infos.items():
        if not isinstance(g, Graph) or not isinstance(info, GradGraphInfo):
            raise TypeError("called_graphs_grad_info must map popxl.Graph to GradGraphInfo, "
                            f"got {g!r}: {info!r}")
    result = differentiate(graph, provided, required, infos)
    return result if return_all_grad_graphs else result[graph]
