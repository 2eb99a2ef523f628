"""The run profile recorded by ``Session.run`` and the ``count_ops`` helper."""
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from .ir import Graph, Ir

#: Pure view kinds: ops that only re-index their input (reshape, transpose, detach and static
#: slice, aliasing or not; ``squeeze`` and ``flatten`` build reshapes). On an IPU they are
#: tensor expressions, not programs: no superstep, no vector work.
VIEW_KINDS = frozenset(("reshape", "reshape_", "transpose", "transpose_", "detach", "detach_",
                        "slice", "slice_"))
#: Kinds whose work is one input's elements, not their output's: an in-place dynamic update
#: writes its update (input 2) into the tensor it returns.
WORK_INPUT = {"dynamic_update_": 2}
#: Kinds executed but doing no vector work of their own: views, matmuls (their work is
#: ``matmul_flops``), subgraph ops (their work is their callee's ops; their copies are
#: ``bytes_copied``), host IO and the replicated collectives (streams and links).
NON_VECTOR_KINDS = VIEW_KINDS | frozenset((
    "matmul", "call", "repeat", "conditional", "host_load", "host_store",
    "replicated_all_gather", "replicated_reduce_scatter", "replicated_all_reduce",
    "replicated_all_reduce_"))


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
        bytes_copied: bytes moved by the copies Poplar's lowering makes at call, conditional
            and repeat boundaries (CallOpx, IfOpx, LoopOpx with PopXL's AliasZeroCopy; model in
            ``copies.py`` and the emulator README, "Lowering copies").
        device_bytes: tile memory of the session's device (tiles x bytes per tile), ``None``
            for the ``cpu`` device.
        loop_iterations: repeat-body executions, summed over every ``repeat`` executed (a
            nested repeat counts each of its iterations each time it runs).
        bytes_copied_by_kind: ``bytes_copied`` by boundary kind: ``"call"`` (CallOpx, also the
            call inside every repeat iteration), ``"branch"`` (IfOpx), ``"loop_carried"``
            (carried values through LoopOpx's clones, every iteration), ``"loop_in_out"``
            (once per repeat: initial values in, invariant inputs in and back, results out),
            ``"loop_control"`` (LoopOpx's iterator and condition copies); sums to
            ``bytes_copied``.
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
                     "unspecified_by_kind"):
            summed = {}
            for p in profiles:
                for key, value in getattr(p, name).items():
                    summed[key] = summed.get(key, 0) + value
            total[name] = summed
        return replace(first, peak_live_bytes=max(p.peak_live_bytes for p in profiles),
                       replicas=tuple(profiles), **total)

    @property
    def supersteps(self):
        """Executed ops other than pure views (``VIEW_KINDS``): on an IPU each is at least one
        bulk-synchronous superstep."""
        return sum(n for kind, n in self.ops_by_kind.items() if kind not in VIEW_KINDS)

    @property
    def vector_elements(self):
        """Output elements of the executed compute ops other than matmuls and views (kinds
        not in ``NON_VECTOR_KINDS``), summed over executions."""
        return sum(n for kind, n in self.elements_by_kind.items()
                   if kind not in NON_VECTOR_KINDS)

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
