"""The run profile recorded by ``Session.run`` and the ``count_ops`` helper.

Besides exact counters, the profile prices every executed op by PopART's lowering
(:mod:`popxl_flash.lowering`): compute sets, vector work by rate key, bytes copied (outplace
views under ``copied_by_kind["view"]``, op copies such as softmax's clone or a dynamic slice
under ``"op"``), and the modelled time of :mod:`popxl_flash.ipu_model`, by term and by op kind.
Any PopXL program, not only attention: a script run on the emulator reads what an IPU would
spend on it (modelled).
"""
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from popxl_flash import ipu_model, lowering

from .ir import Graph, Ir

#: Outplace view kinds: under PopXL (in-placing off) each is a Copy program of its output
#: (``cloneNcopy``); their ``_`` forms are views and cost nothing (:mod:`popxl_flash.lowering`).
VIEW_KINDS = frozenset(("reshape", "transpose", "slice", "concat", "detach", "split",
                        "identity", "subsample"))
#: Kinds whose work is one input's elements, not their output's: an in-place dynamic update
#: writes its update (input 2) into the tensor it returns.
WORK_INPUT = {"dynamic_update_": 2}
_FLOAT = ("float16", "float32")
#: Re-indexing kinds, outplace or not (``ops_excluding_views`` leaves them out).
_RESHAPING = frozenset(("reshape", "reshape_", "transpose", "transpose_", "detach", "detach_",
                        "slice", "slice_"))


def _op_dtype(op):
    """The dtype an op's vector rate follows: its first floating input's, else its output's."""
    for t in op.inputs:
        if t.dtype.name in _FLOAT:
            return t.dtype.name
    return op.outputs[0].dtype.name if op.outputs else "float32"


def op_work(op, flops=0):
    """One execution of ``op`` priced by the lowering table.

    Args:
        op: an op record. flops: its matmul FLOPs (``registry.FLOPS``).
    Returns:
        ``(WorkCounts, copy kind)``: the copy kind is ``"view"`` for outplace views, ``"op"``
        for other ops' copies.
    """
    low = lowering.row(op.kind)
    if not low.priced:
        return ipu_model.WorkCounts(), "op"
    sizes = {"output": lambda: sum(t.nelms for t in op.outputs),
             "input": lambda: op.inputs[0].nelms,
             "update": lambda: op.inputs[2].nelms}
    nbytes = {"output": lambda: sum(t._nbytes for t in op.outputs),
              "input": lambda: op.inputs[0]._nbytes,
              "update": lambda: op.inputs[2]._nbytes,
              "base_update": lambda: op.inputs[0]._nbytes + op.inputs[2]._nbytes}
    work = {}
    if low.work is not None:
        work[lowering.rate_key(low.rate, _op_dtype(op))] = low.factor * sizes[low.work]()
    mm = {_op_dtype(op): flops} if flops else {}
    copied = nbytes[low.copied]() if low.copied else 0
    return (ipu_model.WorkCounts(low.compute_sets, mm, work, copied),
            "view" if op.kind in VIEW_KINDS else "op")


@dataclass
class RunProfile:
    """Exact counters of one ``Session.run``.

    Attributes:
        ops_executed: op instances executed (subgraph ops once per execution; call/repeat/
            conditional ops count once per execution themselves).
        matmul_flops: sum over executed matmuls of 2*M*N*K*batch.
        peak_live_bytes: largest total bytes of live tensor values (frame liveness; variables
            and constants live for the whole run; subgraph inputs the lowering copies count
            as copies (by-value inputs, and by-ref inputs the callee modifies), repeat carries
            hold a second buffer (LoopOpx's clones), and a caller value last read by the call
            is dead once copied in).
        const_bytes: bytes of variables and constants (included in peak_live_bytes).
        wall_seconds: wall-clock time of the run.
        bytes_copied: bytes moved by Copy programs: the copies Poplar's lowering makes at call,
            conditional and repeat boundaries (CallOpx, IfOpx, LoopOpx with PopXL's
            AliasZeroCopy; model in ``copies.py`` and the emulator README, "Lowering copies"),
            outplace views' ``cloneNcopy`` and ops' own copies (the lowering table).
        device_bytes: tile memory of the session's device (tiles x bytes per tile), ``None``
            for the ``cpu`` device.
        loop_iterations: repeat-body executions, summed over every ``repeat`` executed (a
            nested repeat counts each of its iterations each time it runs).
        bytes_copied_by_kind: ``bytes_copied`` by boundary kind: ``"call"`` (CallOpx, also the
            call inside every repeat iteration), ``"branch"`` (IfOpx), ``"loop_carried"``
            (carried values through LoopOpx's clones, every iteration), ``"loop_in_out"``
            (once per repeat: initial values in, invariant inputs in and back, results out),
            ``"loop_control"`` (LoopOpx's iterator and condition copies), ``"view"`` (outplace
            reshape, transpose, slice, concat, ...: a Copy program of the output under PopXL)
            and ``"op"`` (ops' own copies: softmax's clone of its input, dynamic slices and
            updates, gathers, collectives); sums to ``bytes_copied``. Also ``copied_by_kind``.
        copy_sites: ``{(site, kind, bytes per execution): executions}``, ``site`` naming the
            boundary and its graph (``"call G"``, ``"repeat G"`` per repeat and per
            iteration, ``"branch G"`` for the taken branch G); executions times bytes summed
            over the entries is ``bytes_copied``.
        collective_bytes: bytes received over the IPU links by the replicated collectives
            (ring schedule; see ``ops/collectives.py``).
        ops_by_kind: ``{op kind: executions}`` summed over the run (sums to
            ``ops_executed``).
        elements_by_kind: ``{op kind: output elements}``: each executed op's output elements
            (all outputs; the update's for ``dynamic_update_``, ``WORK_INPUT``), summed over
            executions.
        work_by_kind: ``{op kind: WorkCounts}``: each kind's executions priced by the lowering
            table (compute sets, matmul FLOPs, vector work, bytes copied; ``repeat``'s per
            iteration compute sets included), summed over executions.
        remote_bytes_loaded, remote_bytes_stored: bytes moved from and to remote buffers
            (``remote_load``/``remote_store``; see ``remote.py``).
        unspecified_by_kind: ``{kind: occurrences}`` of behaviour PopXL leaves unspecified
            that the run relied on, in the emulator's choosing mode (``unspecified.py``; kinds
            and the choice taken: ``unspecified.CHOICES``); empty in strict mode, which
            raises instead.
        replicas: with replication (R > 1), each replica's own profile (replica r at index
            r); the fields above then sum the replicas' counters, except
            ``peak_live_bytes`` (the largest replica's: each replica is an IPU of its own).
            Empty without replication.
    """

    ops_executed: int = 0
    matmul_flops: int = 0
    peak_live_bytes: int = 0
    const_bytes: int = 0
    wall_seconds: float = 0.0
    bytes_copied: int = 0
    device_bytes: Optional[int] = None
    loop_iterations: int = 0
    bytes_copied_by_kind: dict = field(default_factory=dict)
    copy_sites: dict = field(default_factory=dict)
    collective_bytes: int = 0
    ops_by_kind: dict = field(default_factory=dict)
    elements_by_kind: dict = field(default_factory=dict)
    work_by_kind: dict = field(default_factory=dict)
    remote_bytes_loaded: int = 0
    remote_bytes_stored: int = 0
    unspecified_by_kind: dict = field(default_factory=dict)
    replicas: Tuple["RunProfile", ...] = field(default=(), repr=False)

    @classmethod
    def of_replicas(cls, profiles):
        """Args: profiles: one RunProfile per replica. Returns: their combined profile
        (sums, peak the largest; ``replicas`` holds them)."""
        first = profiles[0]
        total = {name: sum(getattr(p, name) for p in profiles)
                 for name in ("ops_executed", "matmul_flops", "bytes_copied", "loop_iterations",
                              "collective_bytes", "remote_bytes_loaded", "remote_bytes_stored")}
        for name in ("bytes_copied_by_kind", "copy_sites", "ops_by_kind", "elements_by_kind",
                     "work_by_kind", "unspecified_by_kind"):
            summed = {}
            for p in profiles:
                for key, value in getattr(p, name).items():
                    summed[key] = summed[key] + value if key in summed else value
            total[name] = summed
        return replace(first, peak_live_bytes=max(p.peak_live_bytes for p in profiles),
                       replicas=tuple(profiles), **total)

    @property
    def copied_by_kind(self):
        """``bytes_copied_by_kind`` (the design's name): boundary kinds, ``"view"``, ``"op"``."""
        return self.bytes_copied_by_kind

    @property
    def boundary_copied_by_kind(self):
        """The copies at call, branch and loop boundaries by kind (``copies.py``'s model)."""
        return {k: v for k, v in self.bytes_copied_by_kind.items() if k not in ("view", "op")}

    @property
    def boundary_bytes_copied(self):
        """Bytes of the copies at call, branch and loop boundaries."""
        return sum(self.boundary_copied_by_kind.values())

    @property
    def work(self):
        """The run's :class:`popxl_flash.ipu_model.WorkCounts`: ``work_by_kind`` summed, plus
        the boundary copies."""
        total = ipu_model.WorkCounts()
        for w in self.work_by_kind.values():
            total = total + w
        return total + ipu_model.WorkCounts(bytes_copied=self.boundary_bytes_copied)

    @property
    def ops_excluding_views(self):
        """Executed ops other than re-indexing ones (reshape, transpose, detach, static slice,
        outplace or ``_``): the op count
        that the planners still counting ops predict (packed dispatch, the KV cache's passes,
        context parallelism's graph). Not priced: :attr:`compute_sets` is."""
        return sum(n for kind, n in self.ops_by_kind.items() if kind not in _RESHAPING)

    @property
    def compute_sets(self):
        """Executed compute sets, by the lowering table (a loop iteration's included)."""
        return sum(w.compute_sets for w in self.work_by_kind.values())

    @property
    def vector_elements(self):
        """Vector work (elements, all rate keys) by the lowering table, summed over executions."""
        return sum(w.vector_elements for w in self.work_by_kind.values())

    def modelled(self, constants=None):
        """Modelled IPU time of the run (:func:`popxl_flash.ipu_model.time`).

        Args:
            constants: :class:`popxl_flash.ipu_model.IpuConstants` (default: the current ones).
        Returns:
            :class:`popxl_flash.ipu_model.ModelledTime`, by term.
        """
        return ipu_model.time(self.work, constants)

    def modelled_by_kind(self, constants=None):
        """Modelled time by op kind, plus ``"boundary copies"`` (call, branch, loop copies).

        Returns:
            ``{kind: ModelledTime}``.
        """
        out = {k: ipu_model.time(w, constants) for k, w in self.work_by_kind.items()}
        out["boundary copies"] = ipu_model.time(
            ipu_model.WorkCounts(bytes_copied=self.boundary_bytes_copied), constants)
        return out

    @property
    def fits_device(self):
        """Whether ``peak_live_bytes <= device_bytes`` (``None`` on the ``cpu`` device).

        A necessary condition only: Poplar also needs tile memory for code, exchange buffers
        and uneven tile mappings. The IPU model never checks memory (an overrun goes unnoticed
        there); on hardware an overrun fails at compilation.
        """
        if self.device_bytes is None:
            return None
        return self.peak_live_bytes <= self.device_bytes


def count_ops(graph_or_ir):
    """Number of op records (emulator-only helper for benchmarks).

    Args:
        graph_or_ir: a Graph (its own ops) or an Ir (all its graphs).
    Returns:
        int.
    """
    if isinstance(graph_or_ir, Graph):
        return len(graph_or_ir._ops)
    if isinstance(graph_or_ir, Ir):
        return sum(len(g._ops) for g in graph_or_ir._graphs)
    raise TypeError(f"count_ops expects a Graph or an Ir, got {graph_or_ir!r}")
