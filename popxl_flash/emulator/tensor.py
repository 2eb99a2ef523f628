"""Tensor, Variable, Constant, TensorSpec and the host-value constructors."""
from collections.abc import Iterable, Mapping

import numpy as np

from . import dtypes
from ._internal_ir import PbTensor
from .context import gcg, gmg
from .errors import PopartError, UndefinedValue
from .tiles import tile_set_of

#: ``popxl.tensor.HostTensor``/``host_tensor_types`` (PopXL 3.4 ``python_files/tensor.py``;
#: PopXL adds ``torch.Tensor`` when torch is installed, which ``Iterable`` already matches).
ScalarType = int | float | bool
HostTensor = np.ndarray | Iterable
host_tensor_types = (np.ndarray, Iterable)
HostScalarTensor = ScalarType | HostTensor


class TensorSpec(Mapping):
    """Descriptor of a tensor: shape, dtype, meta_shape (usable as a create_graph placeholder)."""

    def __init__(self, shape, dtype, meta_shape=()):
        self.shape = shape
        self.dtype = dtype
        self.meta_shape = meta_shape

    def to_dict(self):
        return {"shape": self.shape, "dtype": self.dtype, "meta_shape": self.meta_shape}

    def to_tuple(self):
        return self.shape, self.dtype, self.meta_shape

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self):
        return 3

    def __getitem__(self, key):
        return self.to_dict()[key]

    def __hash__(self):
        return hash(self.to_tuple())

    def __repr__(self):
        return f"TensorSpec(shape={self.shape}, dtype={self.dtype}, meta_shape={self.meta_shape})"


def TensorByRef():  # noqa: N802 - PopXL name
    """Annotation marking a create_graph parameter as pass-by-reference (not callable)."""
    raise NotImplementedError("TensorByRef should only be used as an annotation.")


#: the op module Tensor's methods and operators call (``popxl.ops``): the op table sits a layer
#: above the tensors, so ``ops/__init__.py`` binds itself here when it is imported
#: (:func:`bind_ops`)
_OPS = {}


def bind_ops(module):
    """Args: module: the emulator's ``ops`` package, whose functions Tensor's methods and
    operators (``+``, ``@``, ``t[i]``, ``t.reshape``, ...) call from now on."""
    _OPS["ops"] = module


def _ops():
    return _OPS["ops"]


class Tensor:
    """A tensor of a graph (build-time handle; values exist only while a Session runs)."""

    __iter__ = None
    __contains__ = None
    __array_ufunc__ = None

    def __init__(self):
        raise RuntimeError("popxl.Tensor cannot be constructed directly.")

    @classmethod
    def _make(cls, graph, tid, name, dtype, shape, meta_shape=()):
        self = object.__new__(cls)
        self._graph, self._id, self._name = graph, tid, name
        self._dtype, self._shape, self._meta_shape = dtype, tuple(shape), tuple(meta_shape)
        self._nelms = int(np.prod(self._shape, dtype=np.int64))
        return self

    @classmethod
    def _from_pb_tensor(cls, pb_tensor):
        """Returns: the Tensor of an ``_internal_ir.PbTensor`` wrapper (``Tensor._pb_tensor``
        gives the wrapper), as PopXL's ``Tensor._from_pb_tensor``."""
        if not isinstance(pb_tensor, PbTensor):
            raise TypeError(f"Tensor._from_pb_tensor expects a tensor's _pb_tensor, got "
                            f"{pb_tensor!r}")
        return pb_tensor._tensor

    @property
    def _pb_tensor(self):
        return PbTensor(self)

    # -- properties ------------------------------------------------------------------------
    id = property(lambda self: self._id)
    name = property(lambda self: self._name)
    dtype = property(lambda self: self._dtype)
    shape = property(lambda self: self._shape)
    meta_shape = property(lambda self: self._meta_shape)
    rank = property(lambda self: len(self._shape))
    nelms = property(lambda self: self._nelms)
    ir = property(lambda self: self._graph.ir)
    ipu = property(lambda self: 0)
    @property
    def tile_set(self):
        """"compute" or "io" (PopART's introspection, ``tiles.tile_set_of``). Raises:
        UndefinedValue when neither is determined."""
        ts = tile_set_of(self)
        if ts == "undefined":
            raise UndefinedValue("Tensor's tile set is undefined.")
        return ts

    def _get_ipu_and_tile_set(self, raise_on_undefined_tile_set=True,
                              raise_on_undefined_ipu=True):
        """PopXL's private helper: ``(ipu, tile set)``; the emulator has IPU 0 only."""
        ts = tile_set_of(self)
        if raise_on_undefined_tile_set and ts == "undefined":
            raise UndefinedValue("Tensor's tile set is undefined.")
        return 0, ts

    @property
    def scope(self):
        return "" if self._graph is self._graph.ir.main_graph else self._graph.name

    @property
    def spec(self):
        return TensorSpec(self.shape, self.dtype, self.meta_shape)

    @property
    def _nbytes(self):
        """Emulator-only: bytes of the tensor's value."""
        return self._nelms * self._dtype.as_numpy().itemsize

    @property
    def T(self):  # noqa: N802
        return self.transpose()

    @property
    def T_(self):  # noqa: N802
        return self.transpose_()

    # -- methods ---------------------------------------------------------------------------
    def transpose(self, permutation=None):
        return _ops().transpose(self, permutation)

    def transpose_(self, permutation=None):
        return _ops().transpose_(self, permutation)

    def reshape(self, shape):
        return _ops().reshape(self, shape)

    def reshape_(self, shape):
        return _ops().reshape_(self, shape)

    def flatten(self):
        return _ops().flatten(self)

    def flatten_(self):
        return _ops().flatten_(self)

    def detach(self):
        return _ops().detach(self)

    def detach_(self):
        return _ops().detach_(self)

    def diag(self):
        raise NotImplementedError("Tensor.diag is not implemented by the emulator")

    def copy_to_ipu(self, *args, **kwargs):
        raise NotImplementedError("Tensor.copy_to_ipu is not implemented by the emulator")

    def strides(self, shape=None):
        """Byte strides of a C-ordered array of ``shape`` (default: the tensor's) in this
        dtype, as PopART's ``TensorInfo::strides``: ``()`` for a scalar, ``(itemsize,)`` for
        shape ``(0,)``, else products of the trailing sizes times the item size.

        Args:
            shape: sequence of ints or None. Returns: tuple of ints.
        """
        import operator
        if shape is None:
            shape = self.shape
        try:
            shape = [operator.index(d) for d in shape]
        except TypeError:
            raise TypeError(f"Tensor.strides: shape must be a sequence of ints, got "
                            f"{shape!r}") from None
        item = self.dtype.as_numpy().itemsize
        out = [item] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            out[i] = out[i + 1] * shape[i + 1]
        return tuple(out)

    @property
    def location_info(self):
        raise NotImplementedError("Tensor.location_info is not implemented by the emulator")

    @property
    def in_sync_with_ipu(self):
        raise NotImplementedError("Tensor.in_sync_with_ipu is not implemented by the emulator")

    def _ensure_tensor(self, value, dtype=None, raise_on_empty=True):
        if isinstance(value, Tensor):
            return value
        t = constant(value, self.dtype if dtype is None else dtype)
        if raise_on_empty and t.nelms == 0:
            raise ValueError("The value has 0 elements - this is most likely a mistake. "
                             f"Type: {type(value)}. Value: {value}")
        return t

    # -- dunders ---------------------------------------------------------------------------
    def __repr__(self):
        return f"{type(self).__name__}[{self.id} {self.dtype} {self.shape}]"

    def __hash__(self):
        return hash((self._id, id(self._graph.ir)))

    def __eq__(self, other):
        return (isinstance(other, Tensor) and self._id == other._id
                and self._graph.ir is other._graph.ir)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __len__(self):
        if not self._shape:
            raise ValueError("Tensor is a scalar and doesn't have a length.")
        return self._shape[0]

    def __add__(self, other):
        return _ops().add(self, self._ensure_tensor(other))

    def __radd__(self, other):
        return _ops().add(self._ensure_tensor(other), self)

    def __iadd__(self, other):
        _ops().add_(self, self._ensure_tensor(other))
        return self

    def __sub__(self, other):
        return _ops().sub(self, self._ensure_tensor(other))

    def __rsub__(self, other):
        return _ops().sub(self._ensure_tensor(other), self)

    def __mul__(self, other):
        return _ops().mul(self, self._ensure_tensor(other))

    def __rmul__(self, other):
        return _ops().mul(self._ensure_tensor(other), self)

    def __pow__(self, other):
        return _ops().pow(self, other)

    def __rpow__(self, other):
        return _ops().pow(constant(other), self)

    def __truediv__(self, other):
        return _ops().div(self, self._ensure_tensor(other))

    def __rtruediv__(self, other):
        return _ops().div(self._ensure_tensor(other), self)

    def __mod__(self, other):
        return _ops().fmod(self, self._ensure_tensor(other))

    def __rmod__(self, other):
        return _ops().fmod(self._ensure_tensor(other), self)

    def __neg__(self):
        return _ops().negate(self)

    def __matmul__(self, other):
        return _ops().matmul(self, self._ensure_tensor(other))

    def __rmatmul__(self, other):
        return _ops().matmul(self._ensure_tensor(other), self)

    def __and__(self, other):
        return _ops().logical_and(self, self._ensure_tensor(other))

    def __rand__(self, other):
        return _ops().logical_and(self._ensure_tensor(other), self)

    def __or__(self, other):
        return _ops().logical_or(self, self._ensure_tensor(other))

    def __ror__(self, other):
        return _ops().logical_or(self._ensure_tensor(other), self)

    def __invert__(self):
        return _ops().logical_not(self)

    def __getitem__(self, key):
        """Slice (int/slice/tuple), gather (int tensor/host ints) or mask (bool) like PopXL."""
        ops = _ops()
        if isinstance(key, (bool, str)):
            pass
        elif isinstance(key, (slice, int)) or (
                isinstance(key, tuple) and all(isinstance(e, (slice, int)) for e in key)):
            return _basic_index(self, (key,) if isinstance(key, (slice, int)) else key)
        elif isinstance(key, (Tensor, np.ndarray, Iterable)):
            if not isinstance(key, Tensor):
                key = constant(key)
            if key.dtype.is_int:
                return ops.gather(self, key)
            if key.dtype == dtypes.bool:
                return ops.where(condition=key, lhs=self, rhs=constant(0, dtype=self.dtype))
        raise TypeError("Only integers, slices (`:`), integer tensors and boolean tensors are "
                        f"valid indices. Not a valid Type: {type(key)}. Value: {key}.")


def _basic_index(t, key):
    """Lower ``t[key]`` to slice -> subsample -> squeeze exactly as PopXL does."""
    ops = _ops()
    start, stop, step, sub, ints = [], [], [], [], []
    for i, k in enumerate(key):
        if isinstance(k, int):
            start.append(k)
            stop.append(k + 1)
            step.append(1)
            sub.append(1)
            ints.append(i)
        else:
            start.append(k.start)
            stop.append(k.stop)
            step.append(None if k.step is None else max(-1, min(1, k.step)))
            sub.append(1 if k.step is None else abs(k.step))
    out = ops.slice(t, start, stop, step)
    if any(s != 1 for s in sub):
        out = ops.subsample(out, sub)
    if ints:
        out = ops.squeeze(out, axes=ints)
    return out


class Variable(Tensor):
    """A variable tensor of the main graph (device state kept by the Session).

    ``shape`` is the shape on one replica; the host value (``shape_on_host``) has an outer
    ``replica_grouping.num_groups`` dimension when there is more than one group (PopXL 3.4
    ``python_files/tensor.py``, PopART ``willow/src/variablesettings.cpp``).
    """

    @property
    def shape_on_host(self):
        groups = self._replica_grouping.num_groups
        return self.shape if groups == 1 else (groups, *self.shape)

    @property
    def shape_on_replica(self):
        return self.shape

    replica_grouping = property(lambda self: self._replica_grouping)
    retrieval_mode = property(lambda self: self._retrieval_mode)


class Constant(Tensor):
    """A constant tensor (data fixed at build time)."""


def _host_data(data, dtype, downcast, what):
    if isinstance(data, Tensor):
        raise TypeError(f"{what}: data must be a host value, not a Tensor ({data})")
    arr = dtypes.to_numpy(data, dtype, downcast)
    dt = dtypes.from_numpy(arr.dtype)  # 64-bit kept with downcast=False: Session() rejects it
    arr = np.array(arr, copy=True, order="C")
    arr.setflags(write=False)
    return arr, dt


def constant(data, dtype=None, name=None, downcast=True, log2_scale=None, nan_on_overflow=None):
    """Create a constant in the current graph.

    Args:
        data: host value. dtype: popxl dtype (numpy casting) or None (infer, 64->32-bit).
        name: tensor name. downcast: downcast 64-bit inferred types.
    Returns:
        Constant.
    """
    if log2_scale is not None or nan_on_overflow is not None:
        raise NotImplementedError("float8 constants are not implemented by the emulator")
    arr, dt = _host_data(data, dtype, downcast, "constant")
    g = gcg()
    t = g._new_tensor(Constant, name or "t", dt, arr.shape)
    t._data = arr
    return t


def variable(data, dtype=None, name=None, downcast=True, replica_grouping=None,
             retrieval_mode=None, log2_scale=None, nan_on_overflow=None):
    """Create a variable in the main graph.

    Args:
        data: initial host value. dtype/name/downcast: as ``constant``.
    Returns:
        Variable.
    """
    g = gcg()
    if g is not gmg():
        raise ValueError("You cannot initialise a variable tensor within a graph. It can only be "
                         "initialised within the main graph. Please create a graph input for this "
                         "variable (`popxl.graph_input`) or use a constant tensor.")
    for arg, val in (("log2_scale", log2_scale), ("nan_on_overflow", nan_on_overflow)):
        if val is not None:
            raise NotImplementedError(f"variable({arg}=...) is not implemented by the emulator")
    arr, dt = _host_data(data, dtype, downcast, "variable")
    if retrieval_mode not in (None, "one_per_group", "all_replicas"):
        raise ValueError(f"Invalid retrieval_mode: {retrieval_mode}")
    grouping = replica_grouping if replica_grouping else g.ir.replica_grouping()
    _check_tiles_replicas(g.ir.replication_factor, grouping.const_rg, name)
    if not grouping.is_const:
        arr = arr[grouping.to_device_map]  # PopXL stores the const_rg's groups (a copy)
        arr.setflags(write=False)
    t = g._new_tensor(Variable, name or "t", dt,
                      _shape_on_replica(arr.shape, grouping.const_rg.num_groups, name))
    t._data = arr
    t._replica_grouping, t._retrieval_mode = grouping, retrieval_mode or "one_per_group"
    return t


def _check_tiles_replicas(replicas, rg, name):
    """PopART's ``Tensors::addVarInitCore`` builds the C++ ``ReplicaGrouping(replicas, stride,
    group_size)`` (``VariableSettings::shapeOnReplica``) when the variable is created, and
    its constructor checks that ``stride * group_size`` divides the replicas
    (``willow/src/replicagrouping.cpp``, ``POPART_CHECK_EQ``: a ``popart::error``).
    Raises: PopartError."""
    if replicas % (rg.stride * rg.group_size):
        raise PopartError(f"variable {name}: the number of replicas in a `popart::ReplicaGrouping` "
                          "must be divisible by the product of the stride and the group size "
                          f"({replicas} replicas, stride {rg.stride}, group size "
                          f"{rg.group_size})")


def _shape_on_replica(shape, num_groups, name):
    """PopART's ``VariableSettings::shapeOnReplica``: with more than one group the host value's
    outer dimension must be the group count, and it is dropped on the replica."""
    if num_groups == 1:
        return shape
    if not shape or shape[0] != num_groups:
        raise PopartError(f"variable {name}: the host value's outer dimension "
                          f"({shape[0] if shape else 'none, a scalar'}) must be the number of "
                          f"replica groups ({num_groups})")
    return shape[1:]
