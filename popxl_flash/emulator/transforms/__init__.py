"""``popxl.transforms`` for the emulator: ``autodiff`` and its result types.

``decompose_sum`` is PopART's DecomposeSum pass: it rewrites autodiff's variadic gradient
sums into trees of two-input adds. The emulator's autodiff already builds its gradient sums
from two-input adds, so the pass changes nothing here and returns the graph.
``merge_exchange`` (``merge_exchange.py``) keeps the exchange ops and refuses what merging
them leaves unspecified; ``io_tile_exchange`` is ``io_tiles``, ``merge_exchange`` and
``in_sequence(False)`` with PopXL's check that one op remains.
"""
from .autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo, autodiff
from .merge_exchange import io_tile_exchange, merge_exchange



def decompose_sum(graph):
    """Decompose the gradient sums of ``graph`` (already two-input adds on the emulator).

    Args:
        graph: a popxl Graph (anything else: AttributeError, as PopXL reads ``_pb_graph``).
    Returns:
        ``graph``.
    """
    graph._pb_graph  # noqa: B018 - PopXL's first use of its argument
    return graph



__all__ = ["ExpectedConnectionType", "ExpectedConnection", "GradGraphInfo", "autodiff",
           "merge_exchange", "io_tile_exchange", "decompose_sum"]
