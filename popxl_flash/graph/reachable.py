"""Counting graphs: every graph a graph calls, directly or through other graphs.

A flash call builds its module graph and the graphs below it (loop bodies, branches), once per
configuration and Ir (:mod:`popxl_flash.api.functional`). ``len(reachable_graphs(ir.main_graph))``
before and after a call counts the graphs it added; the walk uses only ``Graph.called_graphs``,
so it counts the same on the SDK and on the emulator.
"""


def reachable_graphs(graph):
    """Every graph ``graph`` calls, directly or not (``graph`` itself excluded).

    Args:
        graph: a ``popxl.Graph`` (e.g. ``ir.main_graph``, or a layer graph).

    Returns:
        list of ``popxl.Graph``, each once, in the order a depth-first walk meets them.
    """
    out, seen, stack = [], {graph.id}, list(reversed(graph.called_graphs))
    while stack:
        g = stack.pop()
        if g.id in seen:
            continue
        seen.add(g.id)
        out.append(g)
        stack.extend(reversed(g.called_graphs))
    return out
