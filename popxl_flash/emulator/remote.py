"""Remote buffers (PopXL 3.4 ``remote_buffer.py``, ``ops/remote_load.py``,
``ops/remote_store.py``, ``tensor.py`` ``remote_variable``): host-side storage of the emulated
device, one per replica, kept by the Session across runs.

A ``RemoteBuffer`` holds ``entries`` tensors of one shape and dtype; ids count from 1 per Ir.
``remote_store(buffer, offset, t)`` writes entry ``offset`` of this replica's storage,
``remote_load(buffer, offset)`` reads it into a new tensor, ``remote_load_(buffer, offset, t)``
into ``t``. ``offset``: an int (a uint32 constant) or a uint32 tensor of one element; an
offset outside ``[0, entries)`` raises IndexError when the op runs, and so does loading an entry
nothing wrote (remote memory is uninitialised: unspecified; the choosing mode of
``unspecified.py`` reads zeros instead). A ``remote_variable`` lives in
its buffer's entry: ``weights_from_host`` writes it there, ``weights_to_host`` reads it back;
used directly by an op it is refused when the Session compiles (PopART keeps it off chip).
The run profile counts the bytes each replica loads and stores (``remote_bytes_loaded``,
``remote_bytes_stored``).
"""
import numpy as np

from . import dtypes, unspecified
from ._internal_ir import ExecutionContext
from .context import _execution_context, gcg, gmg
from .errors import PopartError
from .registry import COMPILE_CHECKS, PREPARE, emit, register
from .tensor import Tensor, _host_data, constant, variable


class RemoteBuffer:
    """``popxl.RemoteBuffer(tensor_shape, tensor_dtype, entries)`` of the current Ir."""

    def __init__(self, tensor_shape, tensor_dtype, entries):
        if entries < 1:
            raise ValueError(f"Entries must be a non-zero, positive integer. Got {entries}")
        ir = gcg().ir
        self._ir, self._meta_shape = ir, ()
        buffers = ir._remote_buffers
        self._remote_buffer_id = max(buffers, default=0) + 1
        buffers[self._remote_buffer_id] = self
        self._shape, self._dtype = tuple(tensor_shape), tensor_dtype
        self.set_remote_buffer_info(tensor_dtype, tensor_shape, entries)

    def set_remote_buffer_info(self, tensor_dtype, tensor_shape, entries):
        """Set the buffer's tensor type, shape and number of entries."""
        if not isinstance(tensor_dtype, dtypes.dtype):
            raise AttributeError(f"tensor_dtype must be a popxl dtype, got {tensor_dtype!r}")
        self._ir._check_mutable()
        self._shape, self._dtype, self._entries = tuple(tensor_shape), tensor_dtype, entries

    def validate_tensor_matches_buffer(self, t, num_shards=1):
        """Raises: ValueError unless ``t`` has the buffer's shape (meta shape when sharded)
        and dtype."""
        shape = self._shape if num_shards == 1 else self.meta_shape
        if t.shape != shape or t.dtype != self._dtype:
            raise ValueError(f"Tensor {t.id} does not match buffer.\nExisting remote buffer has "
                             f"shape={shape} and dtype={self._dtype}.\nThe tensor has "
                             f"shape={t.shape}, dtype={t.dtype}.")

    remote_buffer_id = property(lambda self: self._remote_buffer_id)
    tensor_shape = property(lambda self: self._shape)
    tensor_dtype = property(lambda self: self._dtype)
    nbytes = property(lambda self: self._entries * int(np.prod(self._shape, dtype=np.int64))
                      * self._dtype.as_numpy().itemsize)

    @property
    def entries(self):
        """The number of tensors the buffer holds (settable, positive)."""
        return self._entries

    @entries.setter
    def entries(self, entries):
        if entries < 1:
            raise ValueError(f"Entries must be a non-zero, positive integer. Got {entries}")
        self.set_remote_buffer_info(self._dtype, self._shape, entries)

    @property
    def meta_shape(self):
        return self._meta_shape

    @meta_shape.setter
    def meta_shape(self, shape):
        self._meta_shape = tuple(shape)

    def __hash__(self):
        return hash((id(self._ir), self._remote_buffer_id))

    def __repr__(self):
        return (f"RemoteBuffer(id={self._remote_buffer_id}, shape={self._shape}, "
                f"dtype={self._dtype}, entries={self._entries})")


def remote_buffer(tensor_shape, tensor_dtype, entries=1):
    """Returns: a new RemoteBuffer of the current Ir."""
    return RemoteBuffer(tensor_shape, tensor_dtype, entries)


# -- ops -----------------------------------------------------------------------------------------
def _offset(offset):
    if isinstance(offset, Tensor):
        return offset
    return constant(offset, dtypes.uint32, name="offset")


def _load_rule(offset, buffer):
    return [(buffer.tensor_shape, buffer.tensor_dtype)]


def _load_into_rule(t, offset, buffer):
    return [(t.shape, t.dtype)]


def _store_rule(t, offset, buffer):
    return []


def _entry(op, offset):
    buffer = op.attrs["buffer"]
    k = int(np.asarray(offset).reshape(-1)[0])
    if not 0 <= k < buffer.entries:
        raise IndexError(f"{op.kind}: offset {k} outside the {buffer.entries} entries of "
                         f"remote buffer {buffer.remote_buffer_id}")
    return (buffer.remote_buffer_id, k)


def _read(rt, op, offset):
    key = _entry(op, offset)
    if key not in rt.remote:
        unspecified.occurred("remote_unwritten", RuntimeError(
            f"{op.kind}: entry {key[1]} of remote buffer {key[0]} was never written (remote "
            "memory is uninitialised: unspecified)"))
        buffer = op.attrs["buffer"]
        value = np.zeros(buffer.tensor_shape, buffer.tensor_dtype.as_numpy())
    else:
        value = rt.remote[key]
    rt.remote_loaded += value.nbytes
    return value


def _check_merged(rt, op, key):
    """A merged exchange (transforms/merge_exchange.py): an unordered store and load of one
    entry in one execution raise (strict mode; the choosing mode runs them in creation
    order)."""
    token, first, unordered = op.attrs["merged"]
    log = rt.merged.setdefault(token, {})
    if first:
        log.clear()
    for other in unordered:
        if log.get(other) == key:
            unspecified.occurred("merged_exchange_order", RuntimeError(
                f"{op.kind}: entry {key[1]} of remote buffer {key[0]} is also accessed by an op "
                "merged into the same exchange (merge_exchange) with no data dependency: their "
                "order is not specified"))
            break
    log[op.op_id] = key


def _run(rt, op, args):
    if "merged" in op.attrs:
        _check_merged(rt, op, _entry(op, args[1] if op.kind == "remote_store" else args[-1]))
    if op.kind == "remote_store":
        t, offset = args
        rt.remote[_entry(op, offset)] = np.array(t, copy=True)
        rt.remote_stored += t.nbytes
        return []
    if op.kind == "remote_load_":
        t, offset = args
        t[...] = _read(rt, op, offset)
        return [t]
    return [_read(rt, op, args[0]).copy()]


def _check(op):
    offset = op.inputs[-1]
    # Poplar's remote-buffer Copy takes an integer offset tensor: PopXL's own int offsets
    # are uint32 constants, PopART's tests pass int32 constants (popxl.constant(0)) and
    # popxl-addons' remote graphs an int32 graph input
    if offset.dtype not in (dtypes.uint32, dtypes.int32) or offset.nelms != 1:
        raise PopartError(f"{op.kind}: offset {offset.id} must be one int32 or uint32 element, "
                          f"got {offset.dtype.name} {list(offset.shape)}")
    if op.attrs["buffer"]._ir is not op.graph.ir:
        raise PopartError(f"{op.kind}: remote buffer of another Ir")


register("remote_load", _load_rule, _run, runtime=True)
register("remote_load_", _load_into_rule, _run, alias="modify", runtime=True)
register("remote_store", _store_rule, _run, runtime=True)
for _kind in ("remote_load", "remote_load_", "remote_store"):
    PREPARE[_kind] = lambda op, plan_of: op
    COMPILE_CHECKS[_kind] = _check


def _check_buffer(remote_buffer):
    if not isinstance(remote_buffer, RemoteBuffer):
        raise AttributeError(f"expected a popxl.RemoteBuffer, got {remote_buffer!r}")


def remote_load(remote_buffer, offset, name=None):
    """Load entry ``offset`` of ``remote_buffer``. Returns: a new Tensor (the buffer's meta
    shape)."""
    _check_buffer(remote_buffer)
    offset = _offset(offset)
    name = name or f"id_{remote_buffer.remote_buffer_id}_offset_{offset.name}"
    out = emit("remote_load", {"offset": offset}, {"buffer": remote_buffer},
               names=[name + "_remote_loaded"])[0]
    out._meta_shape = tuple(remote_buffer.meta_shape)
    return out


def remote_load_(remote_buffer, offset, t):
    """Load entry ``offset`` of ``remote_buffer`` into ``t`` in place. Returns: ``t``'s
    alias."""
    _check_buffer(remote_buffer)
    offset = _offset(offset)
    remote_buffer.validate_tensor_matches_buffer(t)
    return emit("remote_load_", {"t": t, "offset": offset}, {"buffer": remote_buffer},
                names=["remote_load_inplace_out"])[0]


def remote_store(remote_buffer, offset, t):
    """Store ``t`` into entry ``offset`` of ``remote_buffer``. Returns: None."""
    _check_buffer(remote_buffer)
    offset = _offset(offset)
    remote_buffer.validate_tensor_matches_buffer(t)
    emit("remote_store", {"t": t, "offset": offset}, {"buffer": remote_buffer})


def remote_variable(data, remote_buffer, offset=0, dtype=None, name=None, downcast=True,
                    replica_grouping=None, retrieval_mode="one_per_group", log2_scale=None,
                    nan_on_overflow=None):
    """A Variable stored off chip in entry ``offset`` of ``remote_buffer`` (``variable``'s
    arguments otherwise). Returns: Variable."""
    var = variable(data, dtype, name, downcast, replica_grouping, retrieval_mode,
                   log2_scale=log2_scale, nan_on_overflow=nan_on_overflow)
    _check_buffer(remote_buffer)
    var._remote = (remote_buffer, int(offset))
    return var


# -- replicated tensor sharding (PopXL 3.4 ``tensor.py``: ``replica_sharded_buffer``,
# ``remote_replica_sharded_variable``, ``replica_sharded_variable``) ------------------------
def replica_sharded_buffer(shape, dtype, replica_grouping=None, shard_over=None, entries=1):
    """A RemoteBuffer of one shard of a tensor of ``shape`` sharded over ``shard_over``
    members of each replica group (default: the whole group): shape
    ``(ceil(nelms / shard_over),)``, meta shape the tensor's (``shape`` without the groups
    dimension when the grouping has several groups). Raises: ValueError as PopXL."""
    g = gcg()
    replica_grouping = replica_grouping if replica_grouping else g.ir.replica_grouping()
    replica_grouping = replica_grouping.const_rg
    group_size = replica_grouping.group_size
    shard_over = shard_over if shard_over is not None else group_size
    if shard_over > group_size:
        raise ValueError(f"The sharding group size ({shard_over}) must be less than or equal to "
                         f"the replica group size ({group_size}).")
    if group_size % shard_over != 0:
        raise ValueError(f"The replica group size ({group_size}) must be divisible by the "
                         f"sharding group size ({shard_over}).")
    tensor_shape = tuple(shape[1 if replica_grouping.num_groups > 1 else 0:])
    nelms = int(np.prod(tensor_shape, dtype=np.int64))
    buffer = remote_buffer((-(nelms // -shard_over),), dtype, entries)
    buffer.meta_shape = tensor_shape
    buffer._shard_over = shard_over
    return buffer


def remote_replica_sharded_variable(data, remote_buffer, offset=0, dtype=None, name=None,
                                    downcast=True, replica_grouping=None,
                                    retrieval_mode="one_per_group", log2_scale=None,
                                    nan_on_overflow=None):
    """A remote variable whose value each replica holds one shard of in ``remote_buffer``:
    the group's value flattened, zero padded to ``shard_over`` buffer shapes, chunk k on the
    k-th replica of each ``shard_over`` consecutive members of the group (see
    :func:`shard_of`). Raises: ValueError without replication or for a buffer meta shape
    already set to another shape, as PopXL."""
    rf = gcg().ir.replication_factor
    if rf <= 1:
        raise ValueError(f"The IR's global replication factor is {rf}. It must be greater than "
                         "1 to create a replica sharded variable.")
    arr, _ = _host_data(data, dtype, downcast, "remote_replica_sharded_variable")
    grouped = replica_grouping is not None and replica_grouping.num_groups > 1
    required = tuple(arr.shape[1:] if grouped else arr.shape)
    if remote_buffer.meta_shape == ():
        remote_buffer.meta_shape = required
    elif remote_buffer.meta_shape != required:
        raise ValueError(f"Cannot use RemoteBuffer[id={remote_buffer.remote_buffer_id}] for "
                         f"replica sharded variable of shape {required}. The buffer's meta_shape "
                         f"has already been set to: {remote_buffer.meta_shape}.")
    var = remote_variable(data, remote_buffer, offset, dtype, name, downcast, replica_grouping,
                          retrieval_mode, log2_scale, nan_on_overflow)
    var._sharded = True
    return var


def replica_sharded_variable(data, dtype=None, name=None, downcast=True, replica_grouping=None,
                             shard_over=None, retrieval_mode="one_per_group", log2_scale=None,
                             nan_on_overflow=None):
    """A replica-sharded variable kept on chip: its remote variable (for the Session's
    get/set) and the shard, loaded in the weights-from-host program and stored back in the
    weights-to-host program (PopXL's construction). Returns: (Variable, shard Tensor)."""
    arr, dt = _host_data(data, dtype, downcast, "replica_sharded_variable")
    buffer = replica_sharded_buffer(arr.shape, dt, replica_grouping, shard_over)
    var = remote_replica_sharded_variable(data, buffer, 0, dtype, name, downcast,
                                          replica_grouping, retrieval_mode, log2_scale,
                                          nan_on_overflow)
    with gmg():
        with _execution_context(ExecutionContext.WeightsFromHostFragment):
            shard = remote_load(buffer, 0, var.name + "_rts")
        with _execution_context(ExecutionContext.WeightsToHostFragment):
            remote_store(buffer, 0, shard)
    return var, shard


def shard_count(var):
    """How many replicas share one copy of sharded remote variable ``var``: the buffer's
    ``shard_over`` (``replica_sharded_buffer``), else the variable's replica group size."""
    buffer = var._remote[0]
    return getattr(buffer, "_shard_over", None) or var.replica_grouping.const_rg.group_size


def shard_of(var, value, replica):
    """Replica ``replica``'s shard of ``value`` (its group's value of sharded ``var``)."""
    k, (length,) = shard_count(var), var._remote[0].tensor_shape
    flat = np.zeros(k * length, value.dtype)
    flat[:value.size] = value.reshape(-1)
    return flat[_shard_rank(var, replica) * length:][:length].copy()


def gather_shards(var, shards, replica):
    """The value of sharded ``var`` that ``replica``'s shard group holds, from the replicas'
    shards (``shards[r]``)."""
    members = _shard_members(var, replica)
    flat = np.concatenate([shards[r] for r in members])
    meta = var._remote[0].meta_shape
    return flat[:int(np.prod(meta, dtype=np.int64))].reshape(meta)


def _shard_members(var, replica):
    """The replicas of ``replica``'s shard group in shard order: ``shard_count`` consecutive
    members (by rank) of its replica group."""
    rg = var.replica_grouping.const_rg
    group = [r for r, a in enumerate(rg.assignment) if a == rg.assignment[replica]]
    k = shard_count(var)
    start = group.index(replica) // k * k
    return group[start:start + k]


def _shard_rank(var, replica):
    return _shard_members(var, replica).index(replica)


def check_remote_variables(ir):
    """Session compile: a remote variable read by an op (it is off chip), a variable and its
    buffer that differ, or two variables in one entry raise PopartError."""
    seen = {}
    for v in ir.main_graph.variables:
        loc = getattr(v, "_remote", None)
        if loc is None:
            continue
        buffer, offset = loc
        if getattr(v, "_sharded", False):
            buffer.validate_tensor_matches_buffer(v, num_shards=shard_count(v))
            k, (length,) = shard_count(v), buffer.tensor_shape
            if -(v.nelms // -k) != length:
                raise NotImplementedError(
                    f"replica sharded variable {v.id}: its buffer holds {length} elements, not "
                    f"a 1/{k} shard of its {v.nelms} (the emulator shards over the replica "
                    "group or replica_sharded_buffer's shard_over)")
        else:
            buffer.validate_tensor_matches_buffer(v)
        if not 0 <= offset < buffer.entries:
            raise PopartError(f"remote variable {v.id}: offset {offset} outside the "
                              f"{buffer.entries} entries of its buffer")
        if (buffer.remote_buffer_id, offset) in seen:
            raise PopartError(f"remote variables {seen[(buffer.remote_buffer_id, offset)]} and "
                              f"{v.id} share an entry of remote buffer {buffer.remote_buffer_id}")
        seen[(buffer.remote_buffer_id, offset)] = v.id
    for g in _graphs(ir):
        for op in g._ops:
            for t in op.inputs:
                if getattr(t, "_remote", None) is not None:
                    raise PopartError(f"{op.kind} reads remote variable {t.id}: it is stored "
                                      "off chip; remote_load it first")


def _graphs(ir):
    seen, todo = {}, [ir.main_graph]
    while todo:
        g = todo.pop()
        if id(g) in seen:
            continue
        seen[id(g)] = g
        for op in g._ops:
            todo.extend(op.subgraphs)
            todo.extend(v for k, v in op.attrs.items() if k in ("then", "else"))
    return list(seen.values())
