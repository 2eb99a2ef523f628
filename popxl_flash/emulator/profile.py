"""The run profile recorded by ``Session.run`` and the ``count_ops`` helper."""
from dataclasses import dataclass

from .ir import Graph, Ir


@dataclass
class RunProfile:
    """Exact counters of one ``Session.run``.

    Attributes:
        ops_executed: op instances executed (subgraph ops once per execution; call/repeat/
            conditional ops count once per execution themselves).
        matmul_flops: sum over executed matmuls of 2*M*N*K*batch.
        peak_live_bytes: largest total bytes of live tensor values (frame liveness; variables
            and constants live for the whole run; by-value subgraph inputs count as copies,
            and a caller value last read by the call is dead once copied in).
        const_bytes: bytes of variables and constants (included in peak_live_bytes).
        wall_seconds: wall-clock time of the run.
        loop_iterations: repeat-body executions, summed over every ``repeat`` executed (a
            nested repeat counts each of its iterations each time it runs).
    """

    ops_executed: int = 0
    matmul_flops: int = 0
    peak_live_bytes: int = 0
    const_bytes: int = 0
    wall_seconds: float = 0.0
    loop_iterations: int = 0


def count_ops(graph_or_ir):
    """Number of op records (emulator-only helper for benchmarks).

    Args:
        graph_or_ir: a Graph (its own ops) or an Ir (all its graphs).
    Returns:
        int.
    """
    if isinstance(graph_or_ir, Graph):
        return len(graph_or_ir._ops)
    if isinstance(graph_or_ir, Ir):
        return sum(len(g._ops) for g in graph_or_ir._graphs)
    raise TypeError(f"count_ops expects a Graph or an Ir, got {graph_or_ir!r}")
