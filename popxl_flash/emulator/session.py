"""``popxl.Session`` for the emulator: compile (checks + plans), device state, runs."""
import math
import numbers
import time
from collections.abc import Iterable

import numpy as np

from . import dtypes, unspecified
from .errors import PopartError
from .interpreter import Runtime
from .plan import build_plans
from .popart import DeviceInfo, DeviceManager, ipu_hw_device
from .profile import RunProfile
from .remote import check_remote_variables, gather_shards, shard_of
from .replication import run_replicas
from .tiles import check_io_tiles
from .tensor import Constant, Variable

DEVICES = ("ipu_hw", "ipu_model", "cpu")

def _stream_buffer_maps():
    """``popxl.session``'s type aliases of run()'s output and input maps (``typing.Mapping``
    aliases in PopXL 3.4's ``session.py``: not callable, not usable with ``isinstance``)."""
    from typing import Mapping, Union

    from .ir import DeviceToHostStream, HostToDeviceStream
    host_scalar_tensor = Union[int, float, bool, np.ndarray, Iterable]  # tensor.HostScalarTensor
    d2h = Mapping[DeviceToHostStream, np.ndarray]
    h2d = Mapping[HostToDeviceStream, host_scalar_tensor]
    return {"d2hStreamBufferMaps": d2h, "h2dStreamBufferMaps": h2d,
            "StreamBufferMaps": Union[h2d, d2h]}


STREAM_BUFFER_MAPS = _stream_buffer_maps()


class Session:
    """Compile ``ir`` and run it on the emulated device.

    Args:
        ir: the Ir (must not be modified afterwards).
        device_desc: "cpu" (default), "ipu_model" (PopART's 4-tile model), "ipu_hw" (a Mk2
            IPU, 1472 tiles) or a ``DeviceInfo`` from ``popxl_flash.emulator.popart``.
        weights_to_host_on_exit: copy variables to host when leaving the outermost context.

    With ``ir._pb_ir.getSessionOptions().enableFloatingPointChecks`` set before construction,
    every op that overflows, divides by zero or gives an invalid result raises
    ``FloatingPointError`` (see the emulator README).
    """

    def __init__(self, ir, device_desc="cpu", weights_to_host_on_exit=True):
        self._device = _device_info(device_desc, ir)  # the DeviceInfo, as in PopXL
        check_io_tiles(ir, ir._graphs, self._device.tilesPerIPU)
        _check_variable_groupings(ir)
        check_remote_variables(ir)
        self._ir, self.weights_to_host_on_exit = ir, weights_to_host_on_exit
        fp_checks = bool(ir._pb_ir.getSessionOptions().enableFloatingPointChecks)
        self._main, plans = build_plans(ir, fp_checks=fp_checks)
        self._const_bytes = sum(p.const_bytes for p in plans.values())
        ir._prepared = True
        self._vars = list(ir.main_graph.variables)
        self._host = {v: np.array(v._data, copy=True) for v in self._vars}
        self._on_device, self._depth, self._host_in_sync = {}, 0, True
        self._all_replicas = {}
        self._remote = [{} for _ in range(ir.replication_factor)]  # remote buffer storage
        # device values one program leaves for a later one (Plan.carried), per replica
        self._carried = [{} for _ in range(ir.replication_factor)]
        self.profile = None

    ir = property(lambda self: self._ir)
    is_attached = property(lambda self: self._depth > 0)

    def expected_inputs(self):
        """Returns: the h2d streams a run needs."""
        return self._ir.get_all_h2d_streams()

    # -- context ---------------------------------------------------------------------------
    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self.weights_from_host()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._depth == 1 and exc_type is None and self.weights_to_host_on_exit:
            self.weights_to_host()
        self._depth -= 1
        return False

    def _assert_attached(self):
        if not self.is_attached:
            raise ValueError("Must be attached to device before calling a runtime function. Put "
                             "the call inside a `Session` context, for example `with session: "
                             "session.run()`.")

    # -- weights -----------------------------------------------------------------------------
    def weights_from_host(self):
        """Copy all host variable values to the device: every replica gets its own copy, of
        its group's row for a variable with several replica groups. Then the main graph's
        ``WeightsFromHostFragment`` ops run (PopART's weightsFromHost program)."""
        self._assert_attached()
        self._replica_vars = [{v: _replica_value(v, a, r) for v, a in self._host.items()}
                              for r in range(self._ir.replication_factor)]
        self._on_device = self._replica_vars[0]
        for replica, values in enumerate(self._replica_vars):  # remote variables: off chip
            for v, value in values.items():
                if getattr(v, "_remote", None) is not None:
                    buffer, offset = v._remote
                    value = shard_of(v, value, replica) if getattr(v, "_sharded", False) \
                        else value.copy()
                    self._remote[replica][(buffer.remote_buffer_id, offset)] = value
        self._run_fragment("WeightsFromHostFragment")
        self._host_in_sync = True

    def weights_to_host(self):
        """Run the main graph's ``WeightsToHostFragment`` ops, then copy all device variable
        values to the host (PopART's weightsToHost program): PopXL's "one_per_group"
        retrieval (the first replica of each group; one group of all replicas: replica 0's
        value)."""
        self._assert_attached()
        self._run_fragment("WeightsToHostFragment")
        for replica, values in enumerate(self._replica_vars):  # remote variables: off chip
            for v in values:
                if getattr(v, "_remote", None) is not None:
                    buffer, offset = v._remote
                    key = (buffer.remote_buffer_id, offset)
                    values[v] = gather_shards(v, [rem[key] for rem in self._remote], replica) \
                        if getattr(v, "_sharded", False) else self._remote[replica][key]
        self._host = {v: _host_value(v, self._replica_vars) for v in self._on_device}
        self._all_replicas = {v: np.stack([rv[v] for rv in self._replica_vars])
                              for v in self._on_device if _returns_all_replicas(v)}
        self._host_in_sync = True

    def get_tensor_data(self, tensor):
        """Args: tensor: Variable or Constant. Returns: its value (numpy copy)."""
        return self.get_tensors_data([tensor])[tensor]

    def get_tensors_data(self, tensors):
        """Args: tensors: Variables/Constants. Returns: {tensor: numpy copy}."""
        tensors = list(tensors)
        for t in tensors:
            if not isinstance(t, (Constant, Variable)):
                raise TypeError(f"{t} is not of type Constant or Variable. get_tensor_data is "
                                "not supported for this type.")
        if any(isinstance(t, Variable) for t in tensors) and self.is_attached \
                and not self._host_in_sync:
            self.weights_to_host()
        return {t: self._all_replica_values(t) if _returns_all_replicas(t)
                else _user_value(t, self._host[t]) if isinstance(t, Variable)
                else np.array(t._data, copy=True) for t in tensors}

    def _all_replica_values(self, var):
        """``"all_replicas"`` retrieval of a grouped variable: ``[replication_factor, ...]``,
        row r replica r's value as the last ``weights_to_host`` read it (PopXL's
        ``readWeights``; before any, each replica's initial value)."""
        if var in self._all_replicas:
            return np.array(self._all_replicas[var], copy=True)
        return np.stack([_replica_value(var, self._host[var], r)
                         for r in range(self._ir.replication_factor)])

    def write_variable_data(self, tensor, data):
        """Args: tensor: Variable. data: array of exactly ``tensor.dtype`` and shape."""
        self.write_variables_data({tensor: data})

    def write_variables_data(self, tensors):
        """Write host values (pushed to the device at once when attached, like PopXL: all host
        weights are sent)."""
        for t, data in tensors.items():
            if not isinstance(t, Variable) or t not in self._host:
                raise TypeError(f"Tensor {getattr(t, 'id', t)} is not of type Variable (of this "
                                "Ir). write_variable_data is not supported for this type.")
            if isinstance(data, numbers.Number):
                data = np.array(data).astype(t.dtype.as_numpy())
            if not isinstance(data, np.ndarray) or data.dtype != t.dtype.as_numpy():
                raise TypeError(f"The dtype of the input array {getattr(data, 'dtype', type(data))}"
                                f" must match the equivalent type of the tensor {t.id} : "
                                f"{t.dtype}")
            if data.shape != t.shape_on_host:
                raise ValueError(f"The shape of the input array {data.shape} must match the "
                                 f"shape of the tensor {t.id} : {t.shape}")
            if t.retrieval_mode == "all_replicas" and t.replica_grouping.group_size > 1:
                raise NotImplementedError(f'Copying to tensor {t.id} with "all_replicas" '
                                          "retreval mode is not yet supported.")  # PopXL's text
            if not t.replica_grouping.is_const:  # PopXL stores the const grouping's groups
                data = data[t.replica_grouping.to_device_map]
            self._host[t] = np.array(data, copy=True, order="C")
        if self.is_attached:
            self.weights_from_host()

    # -- running ---------------------------------------------------------------------------
    def create_host_outputs(self):
        """Returns: {d2h stream: empty array of the full output shape}."""
        return {s: np.empty(self._full_shape(s), s.dtype.as_numpy())
                for s in self._ir.get_all_d2h_streams()}

    def run(self, inputs=None, downcast_inputs=True):
        """Run the main graph once.

        Args:
            inputs: {h2d stream: array}, exactly the streams used by host_load.
            downcast_inputs: convert 64-bit host arrays to 32-bit first.
        Returns:
            {d2h stream: array of shape (num_host_transfers?, *stream.shape)}.
        """
        self._assert_attached()
        outputs = self.create_host_outputs()
        self.run_with_outputs(inputs, outputs, downcast_inputs)
        return outputs

    def run_with_outputs(self, inputs=None, outputs=None, downcast_inputs=True):
        """Run, writing results into the given output arrays (see ``run``).

        Each output array must have the stream's full shape (PopXL's ``_verify_io_shape``:
        ``ValueError`` otherwise). A d2h entry the run never writes keeps the array's previous
        contents (PopXL leaves it unspecified and raises nothing)."""
        self._assert_attached()
        h2d = self._prepare_inputs(inputs or {}, downcast_inputs)
        outputs = outputs or {}
        _check_keys(outputs, self._ir.get_all_d2h_streams(), "output")
        for s, arr in outputs.items():
            self._verify_io_shape(s, arr)
        d2h = {s: _d2h_buffer(s, outputs[s], self._full_shape(s, always=True)) for s in outputs}
        t0 = time.perf_counter()
        replicas = self._ir.replication_factor
        runtimes = run_replicas(replicas, lambda r, rdv: self._run_replica(h2d, d2h, r, rdv))
        self._host_in_sync = False
        for s in d2h:
            if not np.may_share_memory(d2h[s], outputs[s]):
                _entries(outputs[s], self._ir.num_host_transfers)[...] = \
                    d2h[s].reshape(_entries(outputs[s], self._ir.num_host_transfers).shape)
        seconds = time.perf_counter() - t0
        profiles = [RunProfile(rt.ops, rt.flops, rt.peak, self._const_bytes, seconds, rt.copied,
                               self._device.memory_bytes, loop_iterations=rt.iterations,
                               bytes_copied_by_kind=dict(rt.copied_by_kind),
                               copy_sites=dict(rt.copy_sites),
                               collective_bytes=rt.collective_bytes,
                               remote_bytes_loaded=rt.remote_loaded,
                               remote_bytes_stored=rt.remote_stored,
                               unspecified_by_kind=dict(rt.unspecified)) for rt in runtimes]
        for p, rt in zip(profiles, runtimes):
            p.ops_by_kind, p.elements_by_kind, p.work_by_kind = rt.by_kind()
            p.bytes_copied, p.bytes_copied_by_kind = rt.copied, dict(rt.copied_by_kind)
            p.copy_sites = dict(rt.copy_sites)
        self.profile = profiles[0] if replicas == 1 else RunProfile.of_replicas(profiles)

    def _full_input_shape(self, shape):
        """PopXL's helper: ``shape`` with the ``num_host_transfers`` and replication dims in
        front (each only when > 1)."""
        nht, reps = self._ir.num_host_transfers, self._ir.replication_factor
        return ((nht,) if nht > 1 else ()) + ((reps,) if reps > 1 else ()) + tuple(shape)

    def _verify_io_shape(self, stream, arr):
        """PopXL's check of one run array: at least ``num_host_transfers`` entries, the
        replication dim, then the stream's shape (an array of ones only squeezed to ``()``
        passes too). Raises: ValueError."""
        kind = "input" if stream in self._ir.get_all_h2d_streams() else "output"
        nht, reps = self._ir.num_host_transfers, self._ir.replication_factor
        shape = np.shape(arr)
        repl_index = data_index = int(nht > 1)
        if nht > 1 and (not shape or shape[0] < nht):
            raise ValueError(f"Dimension 0 ({shape[0] if shape else None}) for the array "
                             f"provided for {kind} stream {stream.tensor_id} is not large "
                             f"enough.\nIt should be at least of size num_host_transfers = {nht}")
        if reps > 1:
            data_index += 1
            if len(shape) <= repl_index or shape[repl_index] != reps:
                raise ValueError(f"Dimension {repl_index} for the array provided for {kind} "
                                 f"stream {stream.tensor_id} is the wrong size.\nIt should be "
                                 f"of size replication_factor = {reps}")
        if np.squeeze(arr).shape[data_index:] == ():
            return
        if shape[data_index:] != stream.shape:
            raise ValueError(f"Shape mismatch for {kind} stream {stream.tensor_id}:\nStream "
                             f"shape = {stream.shape}, therefore expected full global batch "
                             f"shape {self._full_input_shape(stream.shape)}. Got array shape = "
                             f"{shape}")

    def _run_replica(self, h2d, d2h, replica, rendezvous):
        """Run the main graph as replica ``replica`` (its rows of the stream buffers, its
        variables). Returns: its Runtime (profile counters)."""
        if self._ir.replication_factor > 1:
            h2d = {s: a[:, replica] for s, a in h2d.items()}
            d2h = {s: a[:, replica] for s, a in d2h.items()}
        rt = Runtime(h2d, d2h, self._const_bytes)
        rt.replica, rt.rendezvous, rt.remote = replica, rendezvous, self._remote[replica]
        rt.unspecified = unspecified.begin()  # this thread's count (RunProfile field)
        env = self._env(replica)
        with np.errstate(all="ignore"):
            rt.run_env(self._main, env)
        self._keep(replica, env, "Normal")
        return rt

    def _env(self, replica):
        """A main-graph environment for ``replica``: constants, its variables and the values
        earlier programs left on the device."""
        env = self._main.template[:]
        for slot, var in self._main.var_slots:
            env[slot] = self._replica_vars[replica][var]
        for slot, value in self._carried[replica].items():
            env[slot] = value
        return env

    def _keep(self, replica, env, fragment):
        """Keep the values ``fragment`` wrote that a later program reads."""
        for slot, producer in self._main.carried.items():
            if producer == fragment and env[slot] is not None:
                self._carried[replica][slot] = env[slot]

    def _run_fragment(self, name):
        """Run the main graph's ops of program fragment ``name`` on every replica (nothing
        when it has none). Raises: RuntimeError when it reads a value the main program
        writes and no run has written it yet (device memory not written: unspecified; the
        choosing mode of ``unspecified.py`` reads zeros instead)."""
        plan = self._main.fragments.get(name)
        if plan is None or not plan.steps:
            return
        reads = {i for st in plan.steps for i in st[1]}
        tensors = list(self._main.graph._tensors.values())  # the plan's slot order
        unwritten = [tensors[s].id for s, f in self._main.carried.items()
                     if f == "Normal" and s in reads and s not in self._carried[0]]
        if unwritten:
            unspecified.occurred("device_unwritten", RuntimeError(
                f"{name} reads {unwritten}, which the main program writes, before any run "
                "wrote them (unspecified device memory)"))
            for slot, f in self._main.carried.items():
                if f == "Normal" and slot in reads and slot not in self._carried[0]:
                    t = tensors[slot]
                    for carried in self._carried:
                        carried[slot] = np.zeros(t.shape, t.dtype.as_numpy())

        def one(replica, rendezvous):
            rt = Runtime({}, {}, self._const_bytes)
            rt.replica, rt.rendezvous, rt.remote = replica, rendezvous, self._remote[replica]
            env = self._env(replica)
            with np.errstate(all="ignore"):
                rt.run_env(plan, env)
            self._keep(replica, env, name)
            return rt

        run_replicas(self._ir.replication_factor, one)

    def _full_shape(self, stream, always=False):
        """``(num_host_transfers, replicas, *stream.shape)``, the first two dims left out when
        1 (unless ``always``)."""
        nht, reps = self._ir.num_host_transfers, self._ir.replication_factor
        return ((nht,) if nht > 1 or always else ()) + \
            ((reps,) if reps > 1 else ()) + stream.shape

    def _prepare_inputs(self, inputs, downcast):
        arrays = {s: _host_array(a, downcast) for s, a in inputs.items()}
        _check_keys(arrays, self._ir.get_all_h2d_streams(), "input")
        nht = self._ir.num_host_transfers
        out = {}
        for s, arr in arrays.items():
            full = self._full_shape(s)
            lead = len(full) - len(s.shape)
            scalar_ok = arr.size == int(np.prod(full)) and arr.squeeze().shape[lead:] == ()
            if nht > 1 and arr.ndim == len(full) and arr.shape[1:] == full[1:] and \
                    arr.shape[0] > nht:
                arr = arr[:nht]  # PopXL accepts more entries than transfers; it reads the first
            if arr.shape != full and not scalar_ok:
                raise ValueError(f"Shape mismatch for input stream {s.tensor_id}:\nStream shape "
                                 f"= {s.shape}, therefore expected full global batch shape "
                                 f"{full}. Got array shape = {arr.shape}")
            if arr.dtype != s.dtype.as_numpy():
                if arr.dtype == np.int64 and s.dtype == dtypes.int32:
                    arr = arr.astype(np.int32)
                else:
                    raise PopartError(f"Type discrepancy for tensor {s.tensor_id}: stream is "
                                      f"{s.dtype.name}, array is {arr.dtype}")
            out[s] = arr.reshape(self._full_shape(s, always=True))
        return out


def _check_variable_groupings(ir):
    """PopART's C++ ``ReplicaGrouping(numReplicas, stride, groupSize)``, built for each
    variable's settings when the Session prepares the weights, requires the replicas to be
    divisible by ``stride * group_size`` (``willow/src/replicagrouping.cpp``); PopXL's Python
    grouping does not check it. ``variable()`` checks it first, when the variable is created
    (``tensor._check_tiles_replicas``); this catches a replication factor changed since.
    Raises: PopartError."""
    n = ir.replication_factor
    for v in ir.main_graph.variables:
        rg = v.replica_grouping.const_rg
        if n % (rg.stride * rg.group_size):
            raise PopartError(f"variable {v.id}: the number of replicas in a "
                              "`popart::ReplicaGrouping` must be divisible by the product of "
                              f"the stride and the group size ({n} replicas, stride "
                              f"{rg.stride}, group size {rg.group_size})")


def _replica_value(var, host, replica):
    """Replica ``replica``'s copy of ``var`` from its host value (groups of the constant-stride
    grouping PopXL stores, ``const_rg``)."""
    rg = var.replica_grouping.const_rg
    if rg.num_groups == 1:
        return np.array(host, copy=True)
    return np.array(host[rg.assignment[replica]], copy=True)


def _host_value(var, replica_vars):
    """The host value of ``var`` from the replicas' copies ("one_per_group": the first replica
    of each group of the constant-stride grouping)."""
    rg = var.replica_grouping.const_rg
    if rg.num_groups == 1:
        return np.array(replica_vars[0][var], copy=True)
    firsts = [rg.assignment.index(g) for g in range(rg.num_groups)]
    return np.stack([replica_vars[r][var] for r in firsts])


def _returns_all_replicas(t):
    """Whether ``get_tensor_data`` gives every replica's value of ``t`` (PopXL: a Variable
    with ``retrieval_mode="all_replicas"`` and groups of more than one replica)."""
    return isinstance(t, Variable) and t.retrieval_mode == "all_replicas" and \
        t.replica_grouping.group_size > 1


def _user_value(var, host):
    """The value ``get_tensor_data`` returns: the stored groups mapped back to the variable's
    own (possibly non-constant) grouping, as PopXL's ``to_host_map``."""
    if not var.replica_grouping.is_const:
        host = host[var.replica_grouping.to_host_map]
    return np.array(host, copy=True)


def _host_array(data, downcast):
    """The input as a numpy array: the caller's own array when no conversion is needed (it is
    only read: ``host_load`` copies each entry it loads), else a converted copy."""
    if isinstance(data, np.ndarray) and data.dtype.kind in "biuf" and \
            not (downcast and data.dtype in dtypes._DOWNCAST):
        return data
    return dtypes.to_numpy(data, downcast=downcast)


def _entries(out, nht):
    """The part of a (verified) output array a run writes: its first ``nht`` entries when it
    has more (PopXL accepts a longer leading dim), else all of it."""
    return out[:nht] if nht > 1 and out.shape[0] > nht else out


def _d2h_buffer(stream, out, shape):
    """Where ``host_store`` writes: the caller's output array itself when it is a C-contiguous
    array of the stream's dtype and size (no staging copy), else a new buffer holding its
    current contents (entries a run does not write keep them).
    ``shape``: ``(num_host_transfers, [replicas,] *stream.shape)``."""
    if not isinstance(out, np.ndarray) or out.dtype != stream.dtype.as_numpy():
        raise TypeError(f"output array for d2h stream {stream.tensor_id}: a numpy array of "
                        f"{stream.dtype.as_numpy()} is needed (StepIO writes the raw device "
                        f"bytes), got {getattr(out, 'dtype', type(out))}")
    part = _entries(out, shape[0])
    if part.size != int(np.prod(shape)):
        raise RuntimeError(f"output array for d2h stream {stream.tensor_id}: {part.size} "
                           f"elements for {int(np.prod(shape))} (a shape of ones PopXL's check "
                           "lets through; what StepIO writes then is unspecified)")
    if part.flags.c_contiguous:
        return part.reshape(shape)
    return np.array(part, copy=True).reshape(shape)


def _check_keys(given, expected, what):
    if set(given) != set(expected):
        unexpected = {str(s) for s in set(given) - set(expected)}
        missing = {str(s) for s in set(expected) - set(given)}
        raise ValueError(f"Unexpected/Missing {what}.\n  Unexpected: {unexpected}\n  "
                         f"Missing: {missing}")


def _device_info(device_desc, ir):
    """The DeviceInfo ``device_desc`` names (PopXL's ``_to_device_info``)."""
    if not isinstance(device_desc, DeviceInfo) and not ir.main_graph._ops:
        # Session._get_ipus_per_replica (session.py) counts the virtual graphs of the ops of the
        # graphs left after removeIsolatedGraphs (main and what it calls): none without an op
        raise RuntimeError(f"The Ir {ir.id} has no graphs. The graphs may have all been "
                           "optimised to nothing, try adding more operations to your graphs.")
    if not isinstance(device_desc, (str, DeviceInfo)):
        raise NotImplementedError(f"device_desc {device_desc!r} is not supported by the emulator "
                                  f"(use one of {DEVICES} or a popart DeviceInfo)")
    if isinstance(device_desc, str) and device_desc not in DEVICES:
        raise ValueError(f"device_desc must be one of {DEVICES}, got {device_desc!r}")
    replicas = ir.replication_factor
    # PopXL's Session._get_ipu_count: 2 ** ceil(log2(ipus per replica x replicas)); the
    # emulator's graphs use one IPU per replica (popxl.ipu(0) only).
    num_ipus = 2 ** math.ceil(math.log2(replicas))
    if isinstance(device_desc, DeviceInfo):
        if device_desc.numIpus % replicas:
            # poplar::Graph(target, replication_factor(R)) splits the target's IPUs evenly
            raise PopartError(f"replication_factor {replicas} does not divide the device's "
                              f"{device_desc.numIpus} IPUs")
        return device_desc
    if device_desc == "cpu":
        if num_ipus > 1:
            raise ValueError(f"For a cpu device, multiple devices (provided: {num_ipus}) are "
                             "not supported.")
        return DeviceManager().createCpuDevice()
    if num_ipus % replicas:
        raise PopartError(f"replication_factor {replicas} does not divide the {num_ipus} IPUs "
                          "PopXL requests (a power of two)")
    if device_desc == "ipu_model":
        return DeviceManager().createIpuModelDevice({"numIPUs": num_ipus})
    return ipu_hw_device(num_ipus)
