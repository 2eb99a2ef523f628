"""Build-time context: the graph stack, in_sequence topological constraints, name scopes."""
from collections import defaultdict
from contextlib import contextmanager

from . import tiles
from ._internal_ir import ExecutionContext

_graphs = []
_state = {"in_sequence": None, "previous": defaultdict(list), "scopes": [], "ipu": 0}


def push_graph(g):
    """Args: g: Graph to make current (all graphs on the stack must share one Ir)."""
    if _graphs and _graphs[0].ir is not g.ir:
        raise RuntimeError("Trying to a create a context manager nested in another context, "
                           "when the previous context's Ir is different.")
    _graphs.append(g)


def pop_graph():
    """Returns: the graph popped from the stack."""
    return _graphs.pop()


def _require():
    if not _graphs:
        raise RuntimeError("Trying to access a graph, but no graph has been selected. Hint - try "
                           "performing the operations in a context manager (for example "
                           "`with graph_instance:`) or inside a function that's called by "
                           "`popxl.Ir().create_graph()`")


def gcg():
    """Returns: the current (innermost) graph; RuntimeError without a context."""
    _require()
    return _graphs[-1]


def gmg():
    """Returns: the main graph of the current Ir; RuntimeError without a context."""
    _require()
    return _graphs[-1].ir.main_graph


def gir():
    """Returns: the Ir of the current graph; RuntimeError without a context."""
    _require()
    return _graphs[-1].ir


get_current_graph, get_main_graph, get_ir = gcg, gmg, gir


@contextmanager
def in_sequence(mode=True):
    """Force creation-order execution of the ops created inside (PopXL semantics).

    Args:
        mode: True (sequence), False (unordered block, one unit of an outer True block) or "pass";
            another value raises ``ValueError`` when an op is created inside (as PopXL).
    """
    if mode is None:
        raise TypeError("`None` cannot be passed to `in_sequence`. Try `False` instead.")
    if mode == "pass":
        mode = None
    # another mode (1, "yes") is accepted here and refused when an op is created inside
    # (PopXL's Context._add_in_sequence_topocons), as in PopXL
    prev = _state["in_sequence"]
    _set_in_sequence(mode)
    try:
        yield mode
    finally:
        _set_in_sequence(prev)


def _set_in_sequence(mode):
    if mode is None:
        _state["previous"].clear()
    _state["in_sequence"] = mode


def op_created(op):
    """Add PopXL's in_sequence topological constraints for a newly created op.

    Args:
        op: the new op record (its ``after`` list receives indices of ops that must run first).
    """
    mode = _state["in_sequence"]
    if mode is None:
        return
    if not isinstance(mode, bool):  # raised after the op is in the graph, as in PopXL
        raise ValueError(f"`in_sequence` mode not understood: {mode}. "
                         "Must be one of `True`, `False`, `'pass'`.")
    # PopXL keys the previous ops by (graph, execution context): each program fragment has its
    # own sequence
    prev = _state["previous"][(id(op.graph), op.context)]
    if mode:
        op.after.extend(i for i in prev if i >= 0)
        prev.clear()
    elif prev:
        if prev[0] >= 0:
            op.after.append(prev[0])
    else:
        prev.append(-1)
    prev.append(op.index)


@contextmanager
def name_scope(name):
    """Prefix ``name + "/"`` to the ids of tensors created inside (PopXL semantics).

    Args:
        name: the scope, a str; scopes nest as ``outer/inner``.

    Yields:
        The list of active scopes, innermost last, as PopXL does.

    As in PopXL 3.3/3.4, the scope is popped only on a normal exit: an exception raised inside
    leaves it pushed (PopXL's context manager has no ``finally``).
    """
    _state["scopes"].append(name)  # a non-str fails when a tensor is named, as in PopXL
    yield list(_state["scopes"])
    _state["scopes"].pop()


def scoped(name):
    """Args: name: a tensor name. Returns: it prefixed by the active name scopes."""
    return "/".join([*_state["scopes"], name])


@contextmanager
def ipu(ipu):
    """Place ops on an IPU; the emulator has one IPU (index 0)."""
    if ipu != 0:
        raise NotImplementedError(f"popxl.ipu({ipu}): the emulator has a single IPU (0)")
    yield ipu


def io_tiles():
    """``popxl.io_tiles()``: ops created inside run on the IO tiles (``tiles.py``)."""
    return tiles.io_tiles()


# -- popxl.context's object API (PopXL 3.4 ``python_files/context.py``) ----------------------
class Context:
    """``popxl.context.Context``: the build state, one instance (``get_current_context()``).

    A view over this module's graph stack, name scopes and ``in_sequence`` state, with the
    attributes third-party PopXL code reads: ``graph``, ``main_graph``, ``ir``, ``ipu_id``,
    ``io_tile_set``, ``name_scopes``, ``push/pop_name_scope``, ``push/pop_graph`` and
    ``in_sequence``. ``_debug_context_frame_offset`` is kept as PopXL keeps it (the emulator
    records no debug info); ``_execution_context`` (an ``_ir.ExecutionContext``) is each new
    op's program fragment (:func:`_execution_context`).
    """

    def __init__(self):
        self._debug_context_frame_offset = 0
        self._execution_context = ExecutionContext.Normal

    graph = property(lambda self: gcg())

    @property
    def main_graph(self):
        if not _graphs:
            raise RuntimeError("Trying to access the main_graph, but no graph has been selected.")
        return _graphs[0].main_graph

    @property
    def ir(self):
        if not _graphs:
            raise RuntimeError("Trying to access the ir, but no graph has been selected.")
        return _graphs[0].ir

    ipu_id = property(lambda self: _state["ipu"])
    @property
    def io_tile_set(self):
        return tiles._state["io"]

    @property
    def _io_tile_set(self):
        return self.io_tile_set

    @_io_tile_set.setter
    def _io_tile_set(self, value):
        tiles._state["io"] = bool(value)
    name_scopes = property(lambda self: list(_state["scopes"]))

    def push_name_scope(self, name):
        _state["scopes"].append(name)

    def pop_name_scope(self):
        return _state["scopes"].pop()

    def push_graph(self, g):
        push_graph(g)

    def pop_graph(self):
        return pop_graph()

    def _get_op_settings(self, name):
        """The settings PopXL hands to ops it creates through the C++ bindings: on the
        emulator an opaque record (graph, name scopes, the name) that the modelled custom ops
        (``addons_ops``) accept; PopART ops created through bindings are not available."""
        return OpSettings(self.graph, tuple(_state["scopes"]), name)

    def _op_created(self, op):
        """PopXL's hook after a binding created ``op`` (in-sequence constraints): the
        emulator's op creation already applied them, so nothing is left to do."""

    @property
    def in_sequence(self):
        return _state["in_sequence"]

    @in_sequence.setter
    def in_sequence(self, enabled):
        _set_in_sequence(enabled)

    @in_sequence.deleter
    def in_sequence(self):
        raise AttributeError("Cannot delete in_sequence. Set to 'False' instead.")


_CONTEXT = Context()


def get_current_context():
    """Returns: the (single) build ``Context``, as ``popxl.context.get_current_context``."""
    return _CONTEXT


@contextmanager
def debug_context_frame_offset(i):
    """``popxl.context.debug_context_frame_offset``: shift the source frame debug info names
    (usable as a decorator; the offset grows by ``i + 1`` while active, as in PopXL)."""
    _CONTEXT._debug_context_frame_offset += i + 1
    yield _CONTEXT._debug_context_frame_offset
    _CONTEXT._debug_context_frame_offset -= i + 1


def op_debug_context(name):
    """``popxl.context.op_debug_context``: decorator naming an op-building function's debug
    context (``@op_debug_context`` or ``@op_debug_context("name")``). The emulator keeps no
    debug info, so the wrapper only calls the function."""
    import functools

    def outer(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapper

    if callable(name):
        return outer(name)
    return outer


@contextmanager
def _execution_context(execution_context):
    """PopXL's private ``_execution_context`` (``context.py``): ops built inside go to another
    program than the main one. In the main graph the emulator runs
    ``WeightsFromHostFragment`` ops in ``Session.weights_from_host`` (after the weights are
    written) and ``WeightsToHostFragment`` ops in ``weights_to_host`` (before they are read),
    as PopART's ``weightsFromHost``/``weightsToHost`` programs; other fragments, and fragment
    ops in subgraphs, raise ``NotImplementedError`` when an op is created (see
    :func:`op_context`). As in PopXL, nothing restores the previous context when the body
    raises."""
    ctx = get_current_context()
    prev = ctx._execution_context
    ctx._execution_context = execution_context
    yield execution_context
    ctx._execution_context = prev


#: the program fragments the emulator runs, in PopART's schedule order (its scheduler bins:
#: weights-from-host ops first, then the main program's, then weights-to-host)
FRAGMENTS = ("WeightsFromHostFragment", "Normal", "WeightsToHostFragment")


def op_context(graph):
    """The execution context name of an op created now in ``graph`` (from
    ``Context._execution_context``). Raises: NotImplementedError for a fragment the emulator
    does not run, or a fragment op outside the main graph."""
    ec = _CONTEXT._execution_context
    name = getattr(ec, "name", ec)
    if name not in FRAGMENTS:
        raise NotImplementedError(f"ops in execution context {ec!r} are not implemented by the "
                                  "emulator (it runs Normal, WeightsFromHostFragment and "
                                  "WeightsToHostFragment ops of the main graph)")
    if name != "Normal" and graph is not graph.ir.main_graph:
        raise NotImplementedError(f"an op of execution context {ec!r} in subgraph {graph.name}: "
                                  "the emulator runs program fragments of the main graph only")
    return name


class OpSettings:
    """Stand-in of ``_ir.Op.Settings`` from ``Context._get_op_settings``."""

    def __init__(self, graph, scopes, name):
        self.graph, self.scopes, self.name = graph, scopes, name

    def __repr__(self):
        return f"OpSettings({self.name!r} in {self.graph})"
