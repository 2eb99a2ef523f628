"""IO tiles (PopXL 3.4 ``context.py`` ``io_tiles``, ``ops/io_tile_copy.py``,
``ops/utils.py`` ``check_tensor_ipu_and_tile_set``; PopART ``tensor.cpp``
``getVirtualGraphIdAndTileSetUnsafe``, ``op/subgraph.cpp``, ``popx/irlowering.cpp``).

Ops created inside ``popxl.io_tiles()`` run on the IPU's IO tiles (their settings' tile set),
the others on the compute tiles. A tensor's tile set is found as PopART's introspection finds
it (:func:`tile_set_of`): its producer's (a call's or repeat's output: the called graph's
output tensor's), else for a graph input its call sites' inputs', else its consumers' (a call
consumer: the called graph's input tensor's); of several, compute before IO; none: undefined.
The PopXL op wrappers that call ``check_tensor_ipu_and_tile_set`` (:data:`CHECKED`) refuse
inputs on different tile sets with its ``ValueError``; ``ops.io_tile_copy`` moves a tensor to
the other tile set. Values are not changed by where they live. When the Session compiles, an
op on IO tiles needs ``numIOTiles`` > 0 (PopART: "No IO tile graph"), and a non-zero
``numIOTiles`` must be even, at least 32 and fewer than the IPU's tiles.
"""
from contextlib import contextmanager

from .errors import PopartError

_state = {"io": False}

#: emulator op kinds whose PopXL wrapper calls ``check_tensor_ipu_and_tile_set`` on all its
#: tensor inputs (PopXL 3.4 ``ops/*.py``, ``ops/var_updates/*.py``; the collectives, host and
#: remote IO, call, repeat and conditional do not check)
CHECKED = frozenset((
    "abs", "add", "add_", "argmax", "argmin", "concat", "concat_", "cos", "div", "dropout",
    "dynamic_slice", "dynamic_update", "dynamic_update_", "equal", "fmod", "gather",
    "tied_gather", "greater", "group_norm", "logical_and", "logical_or", "matmul", "max",
    "maximum", "mul", "nll_loss", "nll_loss_with_softmax_grad", "pow", "modify_random_seed",
    "scaled_add", "scaled_add_", "sin", "sub", "subsample", "swish", "swish_", "where",
    # ops/var_updates/*.py
    "accumulate_", "accumulate_square_", "accumulate_mean_", "accumulate_moving_average_",
    "accumulate_moving_average_square_", "accumulator_scale_", "adam_updater",
    "copy_var_update_",
))


@contextmanager
def io_tiles():
    """``popxl.io_tiles()``: ops created inside run on the IO tiles (as PopXL, the previous
    setting is not restored when the body raises)."""
    prev = _state["io"]
    _state["io"] = True
    yield
    _state["io"] = prev


def current():
    """The tile set of an op created now: "io" or "compute"."""
    return "io" if _state["io"] else "compute"


_ORDER = {"compute": 0, "io": 1, "undefined": 2}


def tile_set_of(t, visited=None):
    """The tile set of tensor ``t`` as PopART's introspection gives it ("compute", "io" or
    "undefined")."""
    visited = set() if visited is None else visited
    g = t._graph
    found = []
    p = g._producers.get(t.id)
    if p is not None:
        if id(p) not in visited:
            visited.add(id(p))
            found.append(_out_placement(p, p.outputs.index(t), visited))
    elif t in g._inputs:
        index = g._inputs.index(t)
        for site in g.ir._call_sites.get(id(g), []):
            if id(site) in visited:
                continue
            visited.add(id(site))
            pos = _site_input(site, g, index)
            found.append(tile_set_of(site.inputs[pos], visited) if pos is not None
                         else site.tile_set)
    if not [f for f in found if f != "undefined"]:
        for op in g._ops:
            if id(op) in visited or not any(x is t for x in op.inputs):
                continue
            visited.add(id(op))
            pos = next(i for i, x in enumerate(op.inputs) if x is t)
            found.append(_in_placement(op, pos, visited))
    return min(found, key=_ORDER.get) if found else "undefined"


def _called(op):
    return op.attrs["graph"] if op.kind in ("call", "repeat") else None


def _site_input(site, graph, index):
    """The position of ``site``'s input bound to input ``index`` of ``graph``."""
    if site.kind in ("call", "repeat"):
        return index if index < len(site.inputs) else None
    n_then = site.attrs["n_then"]
    return 1 + index if graph is site.attrs["then"] else 1 + n_then + index


def _out_placement(op, index, visited):
    graph = _called(op)
    if graph is None or index >= len(graph.outputs):
        return op.tile_set
    inner = graph.outputs[index]
    found = [tile_set_of(inner, visited)]
    if inner in graph._inputs:
        pos = graph._inputs.index(inner)
        if pos < len(op.inputs):
            found.append(tile_set_of(op.inputs[pos], visited))
    return min(found, key=_ORDER.get)


def _in_placement(op, index, visited):
    if op.kind == "io_tile_copy":  # IoTileCopyOp reads from the other tile set
        return "io" if op.tile_set == "compute" else "compute"
    graph = _called(op)
    if graph is None or index >= len(graph.inputs):
        return op.tile_set
    inner = graph.inputs[index]
    found = [tile_set_of(inner, visited)]
    if not any(any(x is inner for x in o.inputs) for o in graph._ops) and \
            inner in graph._outputs:
        pos = graph._outputs.index(inner)
        if pos < len(op.outputs):
            found.append(tile_set_of(op.outputs[pos], visited))
    return min(found, key=_ORDER.get)


def check_tile_sets(kind, tensors):
    """PopXL's ``check_tensor_ipu_and_tile_set`` for an op of ``kind`` in :data:`CHECKED`.
    Raises: ValueError."""
    if kind in CHECKED:
        check_same_tile_set(tensors)


def check_same_tile_set(tensors):
    """``{name: Tensor}`` on one tile set (undefined tile sets are skipped). Raises:
    ValueError with PopXL's message."""
    if not any(t._graph.ir._uses_io_tiles for t in tensors.values()):
        return  # no op on IO tiles: every defined tile set is the compute tiles
    named = [(name, tile_set_of(t)) for name, t in tensors.items()]
    named = [(n, s) for n, s in named if s != "undefined"]
    for name, s in named[1:]:
        if s != named[0][1]:
            raise ValueError(f"The input tensors `{named[0][0]}` and `{name}` are located on "
                             f"different tile sets: {named[0][1]} != {s}.")


def check_io_tiles(ir, graphs, tiles_per_ipu):
    """Session compile: ops on IO tiles need IO tiles; a non-zero ``numIOTiles`` must be valid
    (``IrLowering``). Raises: PopartError."""
    n = int(ir._pb_ir.getSessionOptions().numIOTiles)
    if n > 0:
        if n < 32 or n % 2:
            raise PopartError(f"{n} is an invalid number of IO tiles. Number of IO tiles must be "
                              "an even number and >= 32.")
        if tiles_per_ipu is not None and n >= tiles_per_ipu:
            raise PopartError(f"Tiles per IPU {tiles_per_ipu} should exceed number of IO tiles "
                              f"{n}.")
        return
    for g in graphs:
        for op in g._ops:
            if op.tile_set == "io":
                raise PopartError(f"No IO tile graph for index 0 ({op} is on IO tiles and the "
                                  "session options' numIOTiles is 0)")
