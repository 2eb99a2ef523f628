"""The IR: Ir, Graph, op records, graph inputs/outputs, create_graph, Module, host streams."""
import inspect
from typing import List, Tuple

import numpy as np

from . import context, dtypes, tiles
from ._internal_ir import PbGraph, PbIr
from .context import gcg
from .popart import POPXL_IR, SessionOptions
from .replica_grouping import ReplicaGrouping
from .tensor import Constant, Tensor, TensorByRef, TensorSpec, Variable


class Op:
    """One op record: kind, input tensors, static attributes, output tensors.

    ``alias``: None, "modify" (in place on input 0) or "view" (output aliases input 0 unchanged).
    ``modifies``: input positions whose parent storage the op writes (in-place, by-ref calls).
    ``after``: indices of ops that must run first (in_sequence topological constraints).
    ``context``: the program fragment it runs in (``context.FRAGMENTS``; "Normal": the main
    program, or a subgraph's). ``tile_set``: "compute" or "io" (``tiles.py``).
    """

    __slots__ = ("kind", "inputs", "attrs", "outputs", "graph", "index", "alias", "modifies",
                 "after", "subgraphs", "flops", "op_id", "context", "tile_set")

    def __init__(self, kind, inputs, attrs, graph, alias=None, modifies=(), subgraphs=()):
        self.kind, self.inputs, self.attrs, self.graph = kind, tuple(inputs), attrs, graph
        self.alias, self.modifies, self.subgraphs = alias, tuple(modifies), tuple(subgraphs)
        self.outputs, self.after, self.flops, self.index = (), [], 0, -1
        self.op_id = -1  # Ir-wide, from 100 in creation order (PopART's Ir::opsCounter)
        self.context = "Normal"
        self.tile_set = None  # set when added to a graph (tiles.current() unless preset)

    def __repr__(self):
        return f"Op[{self.kind} #{self.index} in {self.graph.name}]"


class Graph:
    """A PopXL graph (create with ``Ir.create_graph`` / ``create_empty_graph``)."""

    def __init__(self):
        raise TypeError("popxl.Graph cannot be constructed directly; use Ir.create_graph.")

    @classmethod
    def _create(cls, ir, name):
        self = object.__new__(cls)
        self._ir, self._name = ir, name
        self._inputs, self._outputs, self._ops = [], [], []
        self._tensors = {}
        self._producers = {}  # tensor id -> the op that outputs it
        self._by_ref_inputs = set()
        self._can_be_recursively_autodiffed = True
        ir._graphs.append(self)
        return self

    @classmethod
    def _from_pb(cls, pb_graph):
        """Returns: the Graph of an ``_internal_ir.PbGraph`` wrapper (as ``popxl.Graph``)."""
        return pb_graph._graph

    @property
    def _pb_graph(self):
        """Emulator stand-in of PopXL's ``Graph._pb_graph`` (see ``_internal_ir``)."""
        return PbGraph(self)

    name = property(lambda self: self._name)
    id = property(lambda self: self._name)
    ir = property(lambda self: self._ir)
    main_graph = property(lambda self: self._ir.main_graph)
    inputs = property(lambda self: tuple(self._inputs))
    outputs = property(lambda self: tuple(self._outputs))
    tensors = property(lambda self: tuple(self._tensors.values()))

    @property
    def inputs_by_name(self):
        return {t.name: t for t in self._inputs}

    @property
    def variables(self):
        return tuple(t for t in self._tensors.values() if isinstance(t, Variable))

    @property
    def constants(self):
        return tuple(t for t in self._tensors.values() if isinstance(t, Constant))

    @property
    def called_graphs(self):
        seen = {}
        for op in self._ops:
            for g in op.subgraphs:
                seen[id(g)] = g
        return tuple(seen.values())

    def get_tensor(self, tensor_id):
        """Args: tensor_id: a tensor id of this graph. Returns: the Tensor."""
        return self._tensors[tensor_id]

    def __contains__(self, value):
        if not isinstance(value, Tensor):
            raise TypeError(f"Value must be of type popxl.Tensor. Value: {value}. "
                            f"Type: {type(value)}")
        return value._graph is self

    def __eq__(self, other):
        if not isinstance(other, Graph):
            raise TypeError(f"Value must be of type popxl.Graph. Value: {other}. "
                            f"Type: {type(other)}")
        return self is other

    def __hash__(self):
        return hash((self._name, id(self._ir)))

    def __repr__(self):
        return f"Graph[id={self.id} name={self.name}]"

    def __enter__(self):
        context.push_graph(self)
        return self

    def __exit__(self, *exc):
        context.pop_graph()
        return False

    # -- internal --------------------------------------------------------------------------
    def _create_tensor_id(self, name):
        """PopXL's id request for a tensor a binding creates: on the emulator the name itself
        (name scopes and uniqueness are applied when the op creates the tensor)."""
        return name

    def _new_tensor(self, cls, name, dtype, shape, meta_shape=()):
        self._ir._check_mutable()
        name = context.scoped(name)
        tid = name if self is self._ir.main_graph else f"{self._name}/{name}"
        if tid in self._tensors:
            self._ir._uid += 1
            tid = f"{tid}__t{self._ir._uid}"
            name = tid if self is self._ir.main_graph else tid[len(self._name) + 1:]
        t = cls._make(self, tid, name, dtype, shape, meta_shape)
        self._tensors[tid] = t
        return t

    def _add_op(self, op, out_specs, out_names):
        op.context = context.op_context(self)
        if op.tile_set is None:
            op.tile_set = tiles.current()
        if op.tile_set == "io":
            self._ir._uses_io_tiles = True
        op.index = len(self._ops)
        op.op_id, self._ir._op_counter = self._ir._op_counter, self._ir._op_counter + 1
        outs = []
        for (shape, dt), nm in zip(out_specs, out_names):
            outs.append(self._new_tensor(Tensor, nm, dt, shape))
        op.outputs = tuple(outs)
        for t in outs:
            self._producers[t.id] = op
        for sg in op.subgraphs:
            self._ir._call_sites.setdefault(id(sg), []).append(op)
        self._ops.append(op)
        context.op_created(op)
        return op


class Ir:
    """A PopXL IR: a main graph plus subgraphs, host streams and run settings.

    Args:
        replication: replication factor (int >= 1); "popdist" is not supported.
    """

    def __init__(self, replication=1):
        if replication == "popdist":
            raise NotImplementedError("Ir(replication='popdist') is not supported by the emulator")
        self._graphs, self._names, self._uid = [], {}, 0
        self._h2d, self._d2h = [], []
        self._num_host_transfers, self._prepared = 1, False
        self._replication = 1
        self._session_options = SessionOptions()  # read when a Session compiles the Ir
        self._remote_buffers = {}  # remote buffer id -> RemoteBuffer (remote.py)
        self._call_sites = {}  # id(graph) -> the call/repeat/conditional ops calling it
        self._uses_io_tiles = False  # whether any op is on the IO tiles (tiles.py)
        for name, value in POPXL_IR.items():  # what PopXL's Ir() sets
            setattr(self._session_options, name, value)
        self.replication_factor = replication
        Ir._count += 1
        self._id = Ir._count  # PopXL: the PopART Ir's getId(), unique per process
        self._op_counter = 100  # PopART's Ir::opsCounter starts at 100 (willow ir.hpp)
        self._main = Graph._create(self, "main")

    main_graph = property(lambda self: self._main)
    @property
    def _pb_ir(self):
        """Emulator stand-in of PopXL's private handle to the PopART IR: ``getGraph(id)`` (see
        ``_internal_ir``) and ``getSessionOptions()`` (read when a Session compiles the Ir)."""
        return PbIr(self)

    @property
    def num_host_transfers(self):
        return self._num_host_transfers

    @num_host_transfers.setter
    def num_host_transfers(self, value):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"num_host_transfers must be an int >= 1, got {value!r}")
        self._check_mutable()
        self._num_host_transfers = int(value)

    @property
    def replication_factor(self):
        return self._replication

    @replication_factor.setter
    def replication_factor(self, value):
        if self._prepared:
            raise RuntimeError("Cannot set replication_factor after a Session prepared the Ir")
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"replication_factor must be an int >= 1, got {value!r}")
        self._replication = int(value)
        if value > 1:  # PopXL's setter
            self._session_options.enableReplicatedGraphs = True
        self._session_options.replicatedGraphCount = int(value)

    instance_replication_factor = property(lambda self: self._replication)

    def _check_mutable(self):
        if self._prepared:
            raise RuntimeError("The Ir was compiled by a popxl.Session and must not be modified "
                               "afterwards (emulator rule).")

    def _create_name(self, base):
        n = self._names.get(base, 0)
        self._names[base] = n + 1
        return f"{base}_subgraph({n})"

    def create_empty_graph(self, name=None):
        """Args: name: graph name. Returns: a new empty Graph."""
        self._check_mutable()
        return Graph._create(self, self._create_name(name or "graph"))

    def create_graph(self, fn, *args, **kwargs):
        """Trace ``fn`` (callable or Module) into a new subgraph; see the reference §1.

        Args:
            fn: function or ``popxl.Module``. args/kwargs: bound to ``fn``'s signature; tensors and
                TensorSpecs (also in lists/tuples/*args/**kwargs) become graph inputs.
        Returns:
            The new Graph.
        """
        return _create_graph(self, fn, args, kwargs)

    def get_all_h2d_streams(self):
        """Returns: the set of h2d streams used by a host_load (a ``set``, as PopXL 3.4)."""
        return {s for s in self._h2d if s._used}

    def get_all_d2h_streams(self):
        """Returns: the set of d2h streams used by a host_store (a ``set``, as PopXL 3.4)."""
        return {s for s in self._d2h if s._used}

    _count = 0
    id = property(lambda self: self._id)

    def __hash__(self):
        return hash(self._id)

    def __eq__(self, value):
        """As PopXL 3.4 (``python_files/ir.py``): comparing with a non-Ir raises TypeError (so
        ``ir == None`` raises; test identity with ``is``)."""
        if not isinstance(value, Ir):
            raise TypeError(f"Value must be of type popxl.Ir. Type: {type(value)}. "
                            f"Value: {value}.")
        return self._id == value._id

    def replica_grouping(self, stride=1, group_size=None):
        """Args: stride: offset between the replicas of a group. group_size: replicas per group
        (default ``replication_factor // stride``). Returns: a ``popxl.ReplicaGrouping``."""
        return ReplicaGrouping._from_params(self, stride=stride, group_size=group_size)

    def replica_grouping_from_assignments(self, assignment):
        """Args: assignment: group index of every replica. Returns: a ReplicaGrouping."""
        return ReplicaGrouping._from_assignment(self, assignment)

    def __repr__(self):
        return f"Ir[id={self._id}]"


class Module:
    """Base class whose instances trace ``build`` in ``Ir.create_graph``."""

    def __call__(self, *args, **kwargs):
        return self.build(*args, **kwargs)

    def build(self, *args, **kwargs):
        raise NotImplementedError("Module.build must be overridden")


def graph_input(shape, dtype, name=None, by_ref=False, meta_shape=None):
    """Append an input to the current graph.

    Args:
        shape: iterable of ints. dtype: popxl dtype. name: tensor name. by_ref: pass by reference.
        meta_shape: optional meta shape.
    Returns:
        The input Tensor.
    """
    g = gcg()
    if g is g.ir.main_graph:
        raise NotImplementedError("graph_input in the main graph is not supported by the emulator")
    dtypes.check_device(dtype, f"graph_input {name}")
    shape = dtypes.check_shape(shape, f"graph_input {name}")
    t = g._new_tensor(Tensor, name or "t", dtype, shape, tuple(meta_shape or ()))
    g._inputs.append(t)
    if by_ref:
        g._by_ref_inputs.add(t)
    return t


def graph_output(t):
    """Mark ``t`` (a tensor of the current graph) as the graph's next output.

    Args:
        t: Tensor.
    """
    g = gcg()
    check_in_graph(g, t=t)
    if g is g.ir.main_graph:
        raise NotImplementedError("graph_output in the main graph is not supported by the emulator")
    g._outputs.append(t)


def check_in_graph(graph, **tensors):
    """Raise TypeError for non-tensors and ValueError for tensors not in ``graph``."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"The input `{name}` is not a Tensor. Type: {type(t)}. Value: {t}.")
        if t._graph is not graph:
            raise ValueError(f"The input tensor `{name}` ({t.id}) is not in the current Graph "
                             f"{graph.name}.")


def _is_by_ref(hint, kind, container):
    if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) or not container:
        return hint is TensorByRef
    return hint == List[TensorByRef] or hint == Tuple[TensorByRef]


def _bind_container(name, arg, by_ref):
    items = arg.items() if isinstance(arg, dict) else [(f"{name}_{i}", a) for i, a in
                                                      enumerate(arg)]
    sub, has_tensor = {}, False
    for i, (sub_name, sub_arg) in enumerate(items):
        is_t = isinstance(sub_arg, (Tensor, TensorSpec))
        if i > 0 and is_t != has_tensor:
            raise TypeError(f"A {type(arg)} argument can't contain a mixture of Tensors and other "
                            f"types. Arg name: {name}. Value: {arg}")
        if is_t:
            has_tensor = True
            sub[sub_name] = graph_input(sub_arg.shape, sub_arg.dtype, sub_name, by_ref=by_ref,
                                        meta_shape=sub_arg.meta_shape)
    if not has_tensor:
        return arg
    return sub if isinstance(arg, dict) else list(sub.values())


def _create_graph(ir, fn, args, kwargs):
    if isinstance(fn, Module):
        qualname, func = type(fn).__qualname__, fn.build
    elif callable(fn) and hasattr(fn, "__qualname__"):
        qualname, func = fn.__qualname__, fn
    else:
        raise TypeError("Callable `fn` must be either a function or a class that extends "
                        "popxl.Module")
    sig = inspect.signature(func, follow_wrapped=True)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError("The arguments, `args` and `kwargs`, do not match the signature of the "
                         f"function `fn`: {e}") from e
    bound.apply_defaults()
    graph = ir.create_empty_graph(qualname)
    with graph:
        arguments = bound.arguments
        for name, arg in list(arguments.items()):
            param = sig.parameters[name]
            if isinstance(arg, (Tensor, TensorSpec)):
                arguments[name] = graph_input(arg.shape, arg.dtype, name,
                                              by_ref=param.annotation is TensorByRef,
                                              meta_shape=arg.meta_shape)
            elif isinstance(arg, (tuple, list, dict)):
                var = param.kind in (inspect.Parameter.VAR_POSITIONAL,
                                     inspect.Parameter.VAR_KEYWORD)
                if isinstance(arg, dict) and not var:
                    continue
                by_ref = _is_by_ref(param.annotation, param.kind, not var)
                arguments[name] = _bind_container(name, arg, by_ref)
        outputs = fn(*bound.args, **bound.kwargs)
        _mark_outputs(outputs)
    return graph


def _mark_outputs(outputs):
    from collections.abc import Iterable
    ok = outputs is None or isinstance(outputs, Tensor) or (
        isinstance(outputs, Iterable) and all(isinstance(e, Tensor) for e in outputs))
    if not ok:
        raise ValueError("Output of subgraph must be None, a Tensor or an iterable of Tensors. "
                         f"Output type: {type(outputs)}. Value {outputs}")
    if outputs is None:
        outputs = []
    elif isinstance(outputs, Tensor):
        outputs = [outputs]
    for out in outputs:
        graph_output(out)


class _Stream:
    """A host stream registered on the main graph (hashable by identity)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("Streams are created with popxl.h2d_stream / popxl.d2h_stream")

    @classmethod
    def _make(cls, ir, shape, dtype, name):
        self = object.__new__(cls)
        self._ir, self._shape, self._dtype = ir, dtypes.check_shape(shape, name), dtype
        self._used = False
        ir._uid += 1
        self._id = f"{name}__s{ir._uid}"
        return self

    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._dtype)
    tensor_id = property(lambda self: self._id)
    spec = property(lambda self: TensorSpec(self._shape, self._dtype))

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other

    def __repr__(self):
        return f"{type(self).__name__}[{self._id} {self._dtype} {self._shape}]"


Stream = _Stream  # popxl.streams.Stream, the base class


class HostToDeviceStream(_Stream):
    """A host-to-device stream."""


class DeviceToHostStream(_Stream):
    """A device-to-host stream."""


def _stream(cls, registry, kind, shape, dtype, name):
    ir = context.gir()
    ir._check_mutable()
    dtypes.check_device(dtype, f"{kind} {name}")
    s = cls._make(ir, shape, dtype, name or kind)
    getattr(ir, registry).append(s)
    return s


def h2d_stream(shape, dtype, name=None):
    """Args: shape, dtype, name. Returns: a HostToDeviceStream of the current Ir."""
    return _stream(HostToDeviceStream, "_h2d", "h2d_stream", shape, dtype, name)


def d2h_stream(shape, dtype, name=None):
    """Args: shape, dtype, name. Returns: a DeviceToHostStream of the current Ir."""
    return _stream(DeviceToHostStream, "_d2h", "d2h_stream", shape, dtype, name)
