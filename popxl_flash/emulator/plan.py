"""Compile step of a Session: checks PopXL defers to compile time and builds execution plans.

Each graph gets one ``Plan``: slot-indexed environment template, a list of step tuples
``(fn, in_slots, out_slots, attrs, code, alloc_bytes, freed_bytes, free_slots, data, sync)``
and the liveness/copy facts the interpreter and the run profile need. Built once per Session.

Storage is per alias group (:class:`.views.Aliases`): views allocate nothing, a group is freed
after the last use of any member and frees the bytes its owners allocated. ``sync`` (None for
most steps) keeps views numpy cannot express (``concat_``, a reshape of a non-contiguous
source; computed as copies) coherent with their sources after a step that modifies their
group: see :func:`_sync_step`.
"""
import copy
import functools
from collections import defaultdict

import numpy as np

from . import dtypes
from .context import FRAGMENTS
from .copies import Aliases as _Aliases, CopyModel
from .errors import PopartError
from .fpchecks import checking
from .registry import COMPILE_CHECKS, FLOPS, IMPLS, MULTI_OUTPUT, PREPARE, RUNTIME
from .tensor import Constant, Variable

PLAIN, MULTI, CONTROL = 0, 1, 2


class Plan:
    """Execution plan of one graph (see module docstring)."""

    def __init__(self, graph):
        self.graph = graph
        self.template, self.steps = [], []
        self.in_slots, self.out_slots, self.copy_in, self.copy_out = [], [], [], []
        self.var_slots, self.entry_free = [], []
        self.in_bytes = self.entry_free_bytes = self.flops = 0
        self.n_ops, self.n_outputs, self.repeat_count = 0, len(graph.outputs), None
        self.const_bytes = 0
        # Lowering copies (copies.py): IfOpx's when this graph is a taken branch; per execution
        # of a call site / per repeat and per iteration of a repeat site (set by with_copies).
        self.branch_copies = self.all_out_bytes = 0
        self.call_copies, self.loop_once, self.loop_step = 0, {}, {}
        self.shared_in = ()  # inputs whose storage is the caller's (AliasZeroCopy)
        # The main graph's program fragments (context.FRAGMENTS): {name: Plan running that
        # fragment's steps} when any op is outside "Normal" (``steps`` then holds the Normal
        # ones), and the slots of tensors that one program produces and a later one reads,
        # whose device values outlive the program ({slot: fragment that produces it}).
        self.fragments, self.carried = {}, {}

    def with_repeat(self, count):
        """Returns: a shallow copy carrying the repeat trip count."""
        p = copy.copy(self)
        p.repeat_count = count
        return p

    def with_copies(self, call=0, once=None, step=None):
        """Returns: a shallow copy carrying one site's lowering copies (bytes: ``call`` per
        call; ``once``/``step``: by kind, per repeat and per iteration)."""
        p = copy.copy(self)
        p.call_copies, p.loop_once, p.loop_step = call, once or {}, step or {}
        return p


def build_plans(ir, fp_checks=False):
    """Check and plan every graph reachable from the main graph.

    Args:
        fp_checks: wrap every op so that floating-point exceptions raise (see fpchecks.py).
    Returns:
        (main plan, {id(graph): plan}).
    """
    plans, building, model = {}, set(), CopyModel(ir)
    # A repeat body's loop-invariant inputs (index >= N outputs) are read by every iteration:
    # their storage lives for the whole loop, not only until their last read in one iteration.
    # (Plans are per graph: a graph that is also called or branched to keeps the plain rule.)
    sites = [op for g in ir._graphs for op in g._ops if op.subgraphs]
    other = {id(s) for op in sites if op.kind != "repeat" for s in op.subgraphs}
    invariant_from = {id(op.attrs["graph"]): len(op.attrs["graph"].outputs) for op in sites
                      if op.kind == "repeat" and id(op.attrs["graph"]) not in other}

    def plan_of(g):
        if id(g) in plans:
            return plans[id(g)]
        if id(g) in building:
            raise PopartError(f"graph {g.name} calls itself (recursion is not allowed)")
        building.add(id(g))
        plans[id(g)] = _build(g, plan_of, fp_checks, model, invariant_from.get(id(g)))
        building.discard(id(g))
        return plans[id(g)]

    return plan_of(ir.main_graph), plans


def _check_device_dtypes(g):
    """PopXL builds host-typed (e.g. ``downcast=False`` float64) constants and variables; the
    device cannot hold them, so compiling fails."""
    for t in g._tensors.values():
        if t.dtype not in dtypes.DEVICE:
            raise PopartError(f"{t.id} has dtype {t.dtype.name}, which the IPU does not support "
                              "(device dtypes: bool, int32, uint32, float16, float32)")


def _build(g, plan_of, fp_checks, model, invariant_from=None):
    _check_device_dtypes(g)
    for op in g._ops:
        if op.kind in COMPILE_CHECKS:
            COMPILE_CHECKS[op.kind](op)
    bins = _fragment_bins(g)
    order = sorted(g._ops, key=lambda op: bins[op.index]) if bins else g._ops
    al = _Aliases(g)
    check_ambiguity(g, al, bins)
    plan = Plan(g)
    tensors = list(g._tensors.values())
    slot = {id(t): i for i, t in enumerate(tensors)}
    plan.template = [None] * len(tensors)
    pinned = {id(al.find(t)) for t in _pinned(g, tensors, plan, slot)}
    modified = _modified_roots(g, al, pinned)
    last, members = _liveness(order, g, al, slot)
    out_roots = {id(al.find(o)) for o in g._outputs}
    plan.shared_in = model.shared(g)
    _plan_inputs(g, plan, slot, al, modified, last, out_roots)
    _plan_outputs(g, plan, slot, al, pinned)
    plan.branch_copies = model.branch_bytes(g)
    held = set(pinned)  # storage no step frees: pinned, a repeat body's invariant inputs, and
    if invariant_from is not None:  # inputs sharing the caller's storage (the caller frees them)
        held.update(id(al.find(t)) for t in g._inputs[invariant_from:])
    held.update(id(al.find(t)) for t, s in zip(g._inputs, plan.shared_in) if s)
    if bins:  # and what one program fragment leaves for a later one
        held.update(_carry(plan, g, order, bins, al, slot, members, pinned))
    steps = []
    copying = any(op.kind in _COPYING_VIEWS for op in order)
    for k, op in enumerate(order):
        step = _step(op, k, slot, al, held, last, members, out_roots, plan_of, model)
        step += (_sync_step(op, order[:k], slot, al) if copying and op.modifies else None,)
        if fp_checks and step[4] != CONTROL:  # a control op's callee ops check themselves
            step = (checking(step[0], op),) + step[1:]
        steps.append(step)
    if not bins:
        plan.steps, plan.n_ops = steps, len(g._ops)
        plan.flops = sum(FLOPS[op.kind](op) for op in g._ops if op.kind in FLOPS)
        return plan
    for b, name in enumerate(FRAGMENTS):
        part = [op for op in order if bins[op.index] == b]
        frag = copy.copy(plan)
        frag.steps = [st for st, op in zip(steps, order) if bins[op.index] == b]
        frag.n_ops = len(part)
        frag.flops = sum(FLOPS[op.kind](op) for op in part if op.kind in FLOPS)
        frag.fragments = {}
        plan.fragments[name] = frag
    normal = plan.fragments["Normal"]
    plan.steps, plan.n_ops, plan.flops = normal.steps, normal.n_ops, normal.flops
    return plan


def _fragment_bins(g):
    """The program fragment of each op of ``g`` as an index into ``context.FRAGMENTS`` (by op
    index), or None when every op is "Normal". PopART's scheduler puts each fragment's ops in
    a bin, weights-from-host first, weights-to-host last (``ShiftGraphGrower::
    annotateExecutionContext``): an op reading a tensor of a later bin, or constrained after an
    op of one, cannot be scheduled. Raises: PopartError for that; NotImplementedError for host
    streams in a fragment."""
    bins = [FRAGMENTS.index(op.context) for op in g._ops]
    if all(b == 1 for b in bins):
        return None
    producer = {id(t): op for op in g._ops for t in op.outputs}
    for op in g._ops:
        if bins[op.index] != 1 and op.kind in ("host_load", "host_store"):
            raise NotImplementedError(f"{op} in {op.context}: host streams in a program "
                                      "fragment are not implemented by the emulator")
        before = [producer.get(id(t)) for t in op.inputs] + [g._ops[i] for i in op.after]
        for p in before:
            if p is not None and bins[p.index] > bins[op.index]:
                raise PopartError(f"{op} ({op.context}) must run after {p} ({p.context}), "
                                  "which PopART schedules in a later program fragment: no "
                                  "schedule satisfies both")
    return bins


def _carry(plan, g, order, bins, al, slot, members, pinned):
    """Record in ``plan.carried`` the slots of the (non-pinned) storage that ops of more than
    one program fragment use: its value stays on the device from the program that writes it
    to the later ones that read it (PopART's liveness keeps a tensor used across fragments
    live). Returns: those storage roots."""
    used = defaultdict(set)
    first = {}
    for op in order:
        for t in op.inputs + op.outputs:
            rid = id(al.find(t))
            used[rid].add(bins[op.index])
            first.setdefault(rid, op.context)
    roots = {rid for rid, b in used.items() if len(b) > 1 and rid not in pinned}
    for rid in roots:
        for s in members[rid]:
            plan.carried[s] = first[rid]
    return roots


def _pinned(g, tensors, plan, slot):
    """Storage not managed by frame liveness: constants, variables, by-ref inputs.
    Returns: those tensors (a storage group holding one is pinned as a whole)."""
    pinned = []
    for t in tensors:
        if isinstance(t, Constant):
            plan.template[slot[id(t)]] = t._data
            plan.const_bytes += t._nbytes
            pinned.append(t)
        elif isinstance(t, Variable):
            plan.var_slots.append((slot[id(t)], t))
            plan.const_bytes += t._nbytes
            pinned.append(t)
    pinned.extend(g._by_ref_inputs)
    return pinned


def _modified_roots(g, al, pinned):
    modified = set()
    for op in g._ops:
        for pos in op.modifies:
            root = al.find(op.inputs[pos])
            for owner in al.owners(root):  # a concat_ may join a constant to other storage
                if isinstance(owner, Constant) and al.overlap(owner, op.inputs[pos]):
                    raise NotImplementedError(f"{op.kind} modifies constant {owner.id} (or a "
                                              "view of it) in place; not supported by the "
                                              "emulator")
            modified.add(id(root))
    return modified


def _liveness(order, g, al, slot):
    last, members = {}, defaultdict(list)
    for t in g._tensors.values():
        members[id(al.find(t))].append(slot[id(t)])
    for k, op in enumerate(order):
        for t in op.inputs + op.outputs:
            last[id(al.find(t))] = k
    return last, members


def _plan_inputs(g, plan, slot, al, modified, last, out_roots):
    """Input slots, numeric copies (a by-value input the callee modifies, or a view of it
    does, gets its own array) and live-byte facts: an input not sharing the caller's storage
    is the callee's buffer (``in_bytes``); a by-value one whose storage group nobody uses is
    freed at entry."""
    for t, shared in zip(g._inputs, plan.shared_in):
        by_ref = t in g._by_ref_inputs
        root = id(al.find(t))
        plan.in_slots.append(slot[id(t)])
        plan.copy_in.append(not by_ref and root in modified)
        if shared:
            continue
        plan.in_bytes += t._nbytes
        if by_ref:
            continue
        if root not in last and root not in out_roots:
            plan.entry_free.append(slot[id(t)])
            plan.entry_free_bytes += t._nbytes


def _plan_outputs(g, plan, slot, al, pinned):
    """Output slots; an output is copied out when its storage group holds pinned storage, a
    graph input (a ``concat_`` may join an input to local storage) or an earlier output."""
    seen, inputs = set(), {id(al.find(t)) for t in g._inputs}
    for o in g._outputs:
        root = id(al.find(o))
        plan.out_slots.append(slot[id(o)])
        plan.copy_out.append(root in pinned or root in inputs or root in seen)
        plan.all_out_bytes += o._nbytes
        seen.add(root)


def _step(op, k, slot, al, held, last, members, out_roots, plan_of, model):
    """One step tuple of a plan but its ``sync`` (module docstring). ``held``: storage roots
    no step frees (pinned storage, and a repeat body's loop-invariant inputs)."""
    alloc = 0 if op.alias else sum(t._nbytes for t in op.outputs)
    freed, free = 0, []
    roots = {id(al.find(t)): al.find(t) for t in op.inputs + op.outputs}
    for rid, root in roots.items():
        if last[rid] == k and rid not in held and rid not in out_roots:
            freed += al.nbytes(root)
            free.extend(members[rid])
    ins = tuple(slot[id(t)] for t in op.inputs)
    outs = tuple(slot[id(t)] for t in op.outputs)
    if op.kind in RUNTIME:
        data = _with_copies(op, PREPARE[op.kind](op, plan_of), model)
        code, attrs = CONTROL, _entry_accounting(op, data, al, last, k, held, out_roots)
    else:
        code, data, attrs = (MULTI if op.kind in MULTI_OUTPUT else PLAIN), None, op.attrs
    return (IMPLS[op.kind], ins, outs, attrs, code, alloc, freed, tuple(free), data)


def _with_copies(op, data, model):
    """Attach the site's lowering copies (copies.py) to a call's or repeat's plan."""
    if op.kind == "call":
        return data.with_copies(call=model.call_bytes(op.graph, op))
    if op.kind == "repeat":
        once, step = model.repeat_bytes(op.graph, op)
        return data.with_copies(once=once, step=step)
    return data


def _entry_accounting(op, data, al, last, k, pinned, out_roots):
    """``(release, entry)`` bytes of a call/repeat/conditional step, for the run profile.

    ``entry``: the callee frame's input copies (the larger branch of a conditional), counted on
    top of everything the caller holds at the moment of the copy. ``release``: the caller's
    values that are passed by value and read for the last time by this op. They are dead once
    copied in, so they do not count while the callee runs (liveness as on the IPU: a tensor's
    memory is free after its last read, and a call reads its inputs when it copies them).
    Values passed by reference stay: they are the callee's storage. A call or repeat input the
    callee does not modify and the caller reads for the last time shares one buffer with the
    callee's input (AliasZeroCopy), so it is not counted twice at entry; a conditional copies
    every input (IfOpx never aliases). An input sharing the caller's storage (AliasZeroCopy,
    ``Plan.shared_in``) is neither in ``entry`` nor released: it is one buffer, freed by the
    caller after the call.
    """
    if op.kind not in ("call", "repeat", "conditional"):
        return 0, 0  # host IO and other runtime ops run no callee frame
    plans = data[:2] if op.kind == "conditional" else (data,)
    entry = max(p.in_bytes for p in plans)
    by_ref = {id(al.find(op.inputs[pos])) for pos in op.modifies}
    shared = set()
    if op.kind != "conditional":  # the condition is op input 0; branch inputs are never shared
        shared = {id(al.find(t)) for t, s in zip(op.inputs, data.shared_in) if s}
    release = {}
    for t in op.inputs:
        rid = id(al.find(t))
        if last[rid] == k and rid not in pinned and rid not in out_roots and rid not in by_ref \
                and rid not in shared:
            release[rid] = al.nbytes(al.find(t))
    return sum(release.values()), entry


def check_ambiguity(g, al, bins=None):
    """Raise PopartError for a read/modify (or modify/modify) pair of aliased storage that no
    data dependency, ``in_sequence`` constraint or program fragment (``bins``, by op index:
    an earlier fragment's ops run first) orders (PopXL's inplacing ambiguity check).

    Aliasing is per element (poprithms ``Graph::containsAmbiguity`` over ``allAliases``, in
    ``memory/inplace/graph.cpp``; :meth:`.views.Aliases.overlap`): a modifier of one ``slice_``
    region and a reader of a disjoint region are not ambiguous. Every op reads its inputs,
    view ops included: PopART grows a view as a view change then an alias gate, and a gate is
    not a pure view (``readingConsumers``); a slice reads only its region
    (:meth:`.views.Aliases.read_elements`).

    A modifier is an op input that is modified *and* aliases an output: PopART's alias model
    (``Op::growAliasModelMulti``) adds a modifying edge only there. A call or repeat that
    updates a by-ref input has no input-output alias (PopXL never sets the CallOp's alias
    map), nor has ``adam_updater``'s in-place step, so those count as readers only."""
    ops = g._ops
    producer = {id(t): k for k, op in enumerate(ops) for t in op.outputs}
    anc, lower = [], [0] * len(FRAGMENTS)
    for b in range(len(FRAGMENTS)):
        for k, op in enumerate(ops):
            if bins is not None and bins[k] < b:
                lower[b] |= 1 << k
    for op in ops:
        a = lower[bins[op.index]] if bins is not None else 0
        for p in [producer.get(id(t)) for t in op.inputs] + op.after:
            if p is not None:
                a |= anc[p] | (1 << p)
        anc.append(a)
    readers, modifiers = defaultdict(list), defaultdict(list)
    for k, op in enumerate(ops):
        for pos, t in enumerate(op.inputs):
            root = id(al.find(t))
            if pos in op.modifies and op.alias == "modify":
                modifiers[root].append((k, t))
            readers[root].append((k, t, pos))
    for root, mods in modifiers.items():
        for m, t0 in mods:
            for k, t1, pos in readers[root]:
                if k != m and not ((anc[m] >> k) & 1 or (anc[k] >> m) & 1) \
                        and al.overlap(t0, t1, al.read_elements(ops[k], pos)):
                    raise PopartError(
                        f"Inplacing ambiguity detected in graph {g.name}. The tensor {t0.id} is "
                        f"modified by {ops[m]}, and the tensor {t1.id}, which is an alias of "
                        f"{t0.id}, is used by the consuming op {ops[k]}. There is no order "
                        "constraint, explicit or implicit, between these 2 Ops. Use "
                        "popxl.in_sequence() or a data dependency.")


_COPYING_VIEWS = ("concat_", "reshape_")  # views numpy may have to compute as copies


def _sync_step(op, before, slot, al):
    """The ``sync`` of ``op``'s step: None unless ``op`` modifies (in place, or through a call
    or repeat by reference) a storage group in which an earlier op (``before``) made a view
    numpy may compute as a copy (``_COPYING_VIEWS``).

    Returns: fn(env) making every such copy hold its source's values again (PopART's views
    are one storage: a write through any alias is seen by every other): :func:`_sync`."""
    if not op.modifies:
        return None
    groups = {id(al.find(op.inputs[p])) for p in op.modifies}
    in_group = [v for v in before if v.alias and id(al.find(v.outputs[0])) in groups]
    down = tuple((v.kind, tuple(slot[id(t)] for t in v.inputs), slot[id(v.outputs[0])], v.attrs)
                 for v in in_group if v.alias == "view" and v.kind in _COPYING_VIEWS)
    if not down:
        return None
    up = {slot[id(v.outputs[0])]: (v.kind, tuple(slot[id(t)] for t in
                                                 (v.inputs if v.alias == "view" else v.inputs[:1])),
                                   v.attrs) for v in in_group}
    targets = tuple(slot[id(op.inputs[p])] for p in op.modifies)
    return functools.partial(_sync, up, targets, down)


def _copied(kind, out, arrays):
    """Whether view ``kind``'s output array ``out`` is a copy of its input ``arrays``."""
    return kind == "concat_" or not np.may_share_memory(out, arrays[0])


def _scatter(kind, out, arrays, attrs):
    """Write a copied view's values back into its inputs (the inverse of the view)."""
    if kind == "reshape_":
        arrays[0][...] = out.reshape(arrays[0].shape)
        return
    bounds = np.cumsum([a.shape[attrs["axis"]] for a in arrays])
    for a, part in zip(arrays, np.split(out, bounds[:-1], axis=attrs["axis"])):
        if a.flags.writeable:  # a constant (read-only): no op writes it (_modified_roots)
            a[...] = part


def _sync(up, targets, down, env):
    """After a step wrote the tensors in slots ``targets``: walk from them up through the view
    and in-place ops that made them (``up``: {out slot: (kind, source slots, attrs)}),
    writing each copied view back into its sources, then recompute every copied view of the
    group (``down``, in schedule order) from its now current sources."""
    stack, seen = list(targets), set()
    while stack:
        s = stack.pop()
        if s in seen or s not in up or env[s] is None:
            continue
        seen.add(s)
        kind, ins, attrs = up[s]
        arrays = [env[i] for i in ins]
        if any(a is None for a in arrays):  # not in this program fragment's environment
            continue
        if kind in _COPYING_VIEWS and _copied(kind, env[s], arrays):
            _scatter(kind, env[s], arrays, attrs)
        stack.extend(ins)
    for kind, ins, o, attrs in down:
        out, arrays = env[o], [env[i] for i in ins]
        if out is not None and all(a is not None for a in arrays) and _copied(kind, out, arrays):
            out[...] = IMPLS[kind](*arrays, **attrs)
