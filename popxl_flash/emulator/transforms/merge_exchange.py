"""``popxl.transforms.merge_exchange`` (PopXL 3.4 ``transforms/merge_exchange.py``, PopART
``willow/src/transforms/mergeexchange.cpp``).

PopXL collects the ops created in the current graph inside the context and applies PopART's
MergeExchange transform to them: runs of remote loads/stores and host loads/stores that the
schedule allows to be merged become one ``MultiExchangeOp`` whose exchanges run together. The
values the exchanges move are the same; what changes is that the merged ops lose the
topological constraints between them (``insertMultiExchange`` strips them), so their order
is no longer defined. The emulator keeps the ops as they are (it runs them in creation
order) and refuses what the merge leaves unspecified: a store to and a load from the same
entry of a remote buffer, in one execution, by two merged ops with no data dependency between
them (RuntimeError when the second runs).
"""
from contextlib import contextmanager

from ..context import gcg, in_sequence
from ..tiles import io_tiles

#: the exchange ops MergeExchange merges (``isMergeableOp``)
MERGEABLE = ("remote_load", "remote_load_", "remote_store", "host_load", "host_store")


@contextmanager
def merge_exchange():
    """Merge the exchanges of the ops created in the current graph inside (see the module
    docstring)."""
    graph = gcg()
    start = len(graph._ops)
    yield
    check_merged(graph, graph._ops[start:])


def check_merged(graph, created):
    """Mark the remote loads and stores among ``created`` (ops of ``graph``) that merging
    leaves unordered: a store and a load of one buffer with no data dependency between them.
    When such a pair touches the same entry in one execution of the graph, the op that runs
    second raises RuntimeError (remote.py: their order in the merged exchange is not
    specified); different entries are fine."""
    exchanges = [op for op in created if op.kind in MERGEABLE and op.kind.startswith("remote")]
    if not exchanges:
        return
    producer = {id(t): op for op in graph._ops for t in op.outputs}
    token = object()
    for op in exchanges:
        unordered = set()
        for other in exchanges:
            if other is op or (other.kind == "remote_store") == (op.kind == "remote_store"):
                continue
            if other.attrs["buffer"] is not op.attrs["buffer"]:
                continue
            if not (_depends(op, other, producer) or _depends(other, op, producer)):
                unordered.add(other.op_id)
        op.attrs["merged"] = (token, op is exchanges[0], frozenset(unordered))


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


@contextmanager
def io_tile_exchange(verify_overlap=True):
    """``popxl.transforms.io_tile_exchange``: ``io_tiles()``, ``merge_exchange()`` and
    ``in_sequence(False)`` together. With ``verify_overlap``, RuntimeError (PopXL's) when more
    than one op of the current graph created inside (init ops aside) would remain after the
    merge: the exchange ops created inside merge into one unless one reads another's output
    (MergeExchange then starts another), every other op remains."""
    graph = gcg()
    start = len(graph._ops)
    with io_tiles(), merge_exchange(), in_sequence(False):
        yield
    if verify_overlap:
        created = [op for op in graph._ops[start:] if op.kind != "init"]
        remaining = [op for op in created if op.kind not in MERGEABLE]
        producer = {id(t): op for op in graph._ops for t in op.outputs}
        groups = []
        for op in created:
            if op.kind not in MERGEABLE:
                continue
            if not groups or any(_depends(op, other, producer) for other in groups[-1]):
                groups.append([])
            groups[-1].append(op)
        remaining += [group[0] for group in groups]  # each group: one (merged) op
        if len(remaining) > 1:
            names = "\n   ".join(repr(op) for op in remaining)
            raise RuntimeError("More than one Op remained after `io_tile_exchange`. This will "
                               "prevent overlap with following compute. Remaining Ops:"
                               f"\n   {names}")
