"""``popxl.transforms.merge_exchange`` (PopXL 3.4 ``transforms/merge_exchange.py``, PopART
``willow/src/transforms/mergeexchange.cpp``).

PopXL collects the ops created in the current graph inside the context and applies PopART's
MergeExchange transform to them: runs of remote loads/stores and host loads/stores that the
schedule allows to be merged become one ``MultiExchangeOp`` whose exchanges run together. The
values the exchanges move are the same; what changes is that the merged ops lose the
topological constraints between them (``insertMultiExchange`` strips them), so their order
is no longer defined. The emulator keeps the ops as they are (it runs them in creation
order) and refuses, when the context closes, what the merge leaves unspecified: a store to
and a load from the same remote buffer among the mergeable ops with no data dependency
between them (their order in the merged exchange is not specified).
"""
from contextlib import contextmanager

from ..context import gcg

#: the exchange ops MergeExchange merges (``isMergeableOp``)
MERGEABLE = ("remote_load", "remote_load_", "remote_store", "host_load", "host_store")


@contextmanager
def merge_exchange():
    """Merge the exchanges of the ops created in the current graph inside (see the module
    docstring). Raises (when the context closes): NotImplementedError for a store and a load
    of one remote buffer that nothing but the order of creation orders."""
    graph = gcg()
    start = len(graph._ops)
    yield
    check_merged(graph, graph._ops[start:])


def check_merged(graph, created):
    """Refuse what merging ``created`` (ops of ``graph``) leaves unspecified (module
    docstring)."""
    exchanges = [op for op in created if op.kind in MERGEABLE]
    by_buffer = {}
    for op in exchanges:
        if op.kind.startswith("remote"):
            by_buffer.setdefault(op.attrs["buffer"].remote_buffer_id, []).append(op)
    producer = {id(t): op for op in graph._ops for t in op.outputs}
    for ops in by_buffer.values():
        stores = [op for op in ops if op.kind == "remote_store"]
        loads = [op for op in ops if op.kind != "remote_store"]
        for st in stores:
            for ld in loads:
                if not (_depends(ld, st, producer) or _depends(st, ld, producer)):
                    raise NotImplementedError(
                        f"merge_exchange: {st} and {ld} store to and load from remote buffer "
                        f"{st.attrs['buffer'].remote_buffer_id} with no data dependency: merged "
                        "into one exchange, their order is not specified")


def _depends(op, on, producer):
    """Whether ``op`` reads, through data edges, an output of ``on``."""
    seen, stack = set(), list(op.inputs)
    while stack:
        t = stack.pop()
        p = producer.get(id(t))
        if p is None or id(p) in seen:
            continue
        if p is on:
            return True
        seen.add(id(p))
        stack.extend(p.inputs)
    return False
