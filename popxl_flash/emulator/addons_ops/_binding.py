"""What the modelled C++ bindings share: creating an emulator op from ``createOpInGraph``'s
arguments, and the returned op handle (``outTensor``, ``getGraph``)."""
from .._internal_ir import PbGraph, PbTensor
from ..context import pop_graph, push_graph
from ..errors import PopartError
from ..registry import emit


class CustomOp:
    """The op ``createOpInGraph`` returns: PopART's ``Op`` as the binding exposes it."""

    def __init__(self, record):
        self._op = record

    def outTensor(self, index):  # noqa: N802 - the binding's name
        """Returns: output ``index`` as ``popart._internal.ir`` tensor (``_pb_tensor``)."""
        return PbTensor(self._op.outputs[index])

    def getGraph(self):  # noqa: N802
        return PbGraph(self._op.graph)

    id = property(lambda self: self._op.op_id)


def create(pb_graph, kind, inputs, outputs, attrs):
    """Create op ``kind`` in the graph of ``pb_graph`` (``Graph._pb_graph``).

    Args:
        inputs: {index: tensor id} (contiguous from 0). outputs: {index: requested name}.
        attrs: the op's attributes (checked by its shape rule, as PopART's ``setup``).
    Returns:
        CustomOp.
    """
    graph = pb_graph._graph
    if sorted(inputs) != list(range(len(inputs))):
        raise PopartError(f"{kind}: inputs at indices {sorted(inputs)}; expected 0..n-1")
    tensors = {f"in{i}": graph._tensors[inputs[i]] for i in sorted(inputs)}
    names = [str(outputs[i]) for i in sorted(outputs)]
    push_graph(graph)
    try:
        emit(kind, tensors, attrs, names=names)
    finally:
        pop_graph()
    return CustomOp(graph._ops[-1])


def grouping_of(pb_grouping):
    """``(num_replicas, stride, group_size)`` of a ``ReplicaGrouping._pb_replica_grouping``."""
    return (pb_grouping.getNumReplicas(), pb_grouping.getStride(), pb_grouping.getGroupSize())
