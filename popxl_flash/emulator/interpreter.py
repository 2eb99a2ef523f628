"""The evaluator: runs a graph's plan over a slot environment, recursing for subgraphs.

It also keeps the run profile counters: ops executed (and executions per graph, from which
the per-kind counts follow), matmul FLOPs, live bytes and their peak, bytes copied at subgraph
boundaries.
"""
import numpy as np

from popxl_flash import ipu_model as _ipu, lowering as _lowering

from .copies import KINDS
from .plan import MULTI, PLAIN
from .profile import WORK_INPUT, op_work
from .registry import FLOPS

_ndarray, _asarray = np.ndarray, np.asarray


class Runtime:
    """State of one ``Session.run``: stream buffers and profile counters.

    Args:
        h2d: {stream: array (num_host_transfers, *shape)}. d2h: same for outputs (written).
        base_bytes: bytes live for the whole run (variables and constants).
    """

    def __init__(self, h2d, d2h, base_bytes):
        self.h2d, self.d2h = h2d, d2h
        self.loads = dict.fromkeys(h2d, 0)
        self.stores = dict.fromkeys(d2h, 0)
        self.live = self.peak = base_bytes
        self.ops = self.flops = self.copied = 0
        self.copied_by_kind = dict.fromkeys(KINDS, 0)  # lowering copies by boundary kind
        self.copy_sites = {}  # (site, kind, bytes per execution) -> executions
        self.iterations = 0  # repeat-body executions
        self.graph_runs = {}  # id(graph) -> [graph, executions] (ops_by_kind/elements_by_kind)
        # Replication (see replication.py): this replica's index, the rendezvous where the
        # replicas meet at collectives, bytes this replica received from collectives.
        self.replica, self.rendezvous, self.collective_bytes = 0, None, 0
        # Remote buffers (remote.py): this replica's storage {(buffer id, entry): array}, kept
        # by the Session across runs, and the bytes loaded from and stored to it.
        self.remote, self.remote_loaded, self.remote_stored = {}, 0, 0
        self.merged = {}  # merged exchanges: {group: {op id: entry}} (remote.py)

    def by_kind(self):
        """Returns: (ops_by_kind, elements_by_kind, work_by_kind): {op kind: executions}, {op
        kind: output elements summed over executions}, {op kind: WorkCounts priced by the
        lowering table}, over every graph frame this run executed (``repeat``'s per-iteration
        compute sets included)."""
        ops, elements, work = {}, {}, {}
        for graph, runs in self.graph_runs.values():
            for op in graph._ops:
                if op.context != "Normal":  # the main graph's other programs' ops
                    continue
                kind = op.kind
                ops[kind] = ops.get(kind, 0) + runs
                pos = WORK_INPUT.get(kind)
                n = sum(t.nelms for t in op.outputs) if pos is None else op.inputs[pos].nelms
                elements[kind] = elements.get(kind, 0) + runs * n
                flops = FLOPS[kind](op) if kind in FLOPS else 0
                w, copy_kind = op_work(op, flops)
                w = w.scaled(runs)
                work[kind] = work[kind] + w if kind in work else w
                if w.bytes_copied:
                    self.add_copies(copy_kind, w.bytes_copied, f"{kind} {graph.name}")
        if self.iterations:
            low = _lowering.row("repeat")
            loop = _ipu.WorkCounts(compute_sets=low.per_iteration * self.iterations)
            work["repeat"] = work["repeat"] + loop if "repeat" in work else loop
        return ops, elements, work

    def meet(self, op, value, combine):
        """Exchange ``value`` with the other replicas at collective ``op``.

        Args:
            op: the collective's op record. value: this replica's input.
            combine: fn([input per replica]) -> [output per replica].
        Returns:
            This replica's output.
        """
        if self.rendezvous is None:
            return combine([value])[0]
        return self.rendezvous.meet(self.replica, op, value, combine)

    def add_copies(self, kind, nbytes, site, times=1):
        """Count ``times`` executions of ``nbytes`` lowering copies of boundary ``kind``
        (copies.KINDS) at ``site`` (a label: boundary and graph name)."""
        self.copied += times * nbytes
        self.copied_by_kind[kind] += times * nbytes
        key = (site, kind, nbytes)
        self.copy_sites[key] = self.copy_sites.get(key, 0) + times

    def load(self, stream):
        """Returns: a copy of the stream's next buffer entry (wrapping)."""
        buf = self.h2d[stream]
        i = self.loads[stream]
        self.loads[stream] = i + 1
        return buf[i % len(buf)].copy()

    def store(self, stream, value):
        """Write ``value`` into the stream's next buffer entry (wrapping)."""
        buf = self.d2h[stream]
        i = self.stores[stream]
        self.stores[stream] = i + 1
        buf[i % len(buf)] = value

    def run_graph(self, plan, inputs):
        """Run a subgraph frame. Args: plan, inputs (arrays). Returns: list of output arrays."""
        env = plan.template[:]
        for s, v in zip(plan.in_slots, inputs):
            env[s] = v
        return self.run_env(plan, env)

    def run_env(self, plan, env):
        """Execute ``plan`` over a prepared environment. Returns: list of output arrays."""
        base = self.live
        live = base + plan.in_bytes
        if live > self.peak:
            self.peak = live
        live -= plan.entry_free_bytes
        for s in plan.entry_free:
            env[s] = None
        for fn, ins, outs, attrs, code, alloc, freed, free, data, sync in plan.steps:
            if code == PLAIN:
                r = fn(*[env[i] for i in ins], **attrs)
                env[outs[0]] = r if r.__class__ is _ndarray else _asarray(r)
            elif code == MULTI:
                for s, r in zip(outs, fn(*[env[i] for i in ins], **attrs)):
                    env[s] = r
            else:
                release, entry = attrs  # see plan._entry_accounting
                if live + entry > self.peak:
                    self.peak = live + entry
                self.live = live - release
                for s, r in zip(outs, fn(self, data, [env[i] for i in ins])):
                    env[s] = r
            if sync is not None:  # views computed as copies follow a write (plan._sync)
                sync(env)
            live += alloc
            if live > self.peak:
                self.peak = live
            if free:
                live -= freed
                for s in free:
                    env[s] = None
        self.ops += plan.n_ops
        self.flops += plan.flops
        run = self.graph_runs.get(id(plan.graph))
        if run is None:
            self.graph_runs[id(plan.graph)] = [plan.graph, 1]
        else:
            run[1] += 1
        out = [env[s].copy() if c else env[s] for s, c in zip(plan.out_slots, plan.copy_out)]
        self.live = base
        return out
