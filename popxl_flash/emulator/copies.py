"""The lowering-copy model: which subgraph-boundary copies Poplar's lowering makes, in bytes.

PopXL's ``Ir()`` sets PopART's session option ``aliasZeroCopy`` (``python/popxl/python_files/
ir.py``). Lowering then copies at subgraph boundaries as follows (PopART sdk-release-3.4):

* **call** (``CallOpx``, ``willow/src/popx/op/callx.cpp``): an input is copied in, and a
  modified (by-ref) input copied back, unless AliasZeroCopy aliased the parent tensor with the
  callee's input. ``AliasZeroCopy::checkSubgraphInputCompatible`` (``willow/src/
  aliaszerocopy.cpp``) aliases when ``!conflict && (!overlapping || !modified)``: the callee
  does not modify the input, or the parent's storage is not live while the callee runs (it
  is when a tensor of that storage is used before and after the call, or when another input
  of the same call shares it and was aliased into the callee first: AliasZeroCopy takes a
  graph's inputs by bytes, then index, largest first); ``conflict``: another call site binds
  a different parent that is live at the same time.
  An output is copied unless ``checkSubgraphOutputCompatible`` aliases it (its liveness does
  not overlap the call output's). Copies of values nobody reads afterwards are dead code
  (``AliasZeroCopy::disableDeadCodeNodes``).
* **repeat** = ``LoopOp`` over a wrapper graph that calls the body (``python/popxl/
  python_files/ops/repeat.py``); ``LoopOpx::grow`` (``willow/src/popx/op/loopx.cpp``): once
  per repeat, the carried initial values into the body-output clones, the implicit inputs
  into the wrapper (unless aliased) and, after the loop, the clones into the op outputs and
  the modified implicit inputs back (unless aliased); every iteration, the clones into the
  carried inputs (unless the body never reads them), the iterator, the wrapper's CallOp (the
  call rules above) and every body output into its clone (no AliasZeroCopy check).
* **conditional** (``IfOpx``, ``willow/src/popx/op/ifx.cpp``): ``IfOp`` is not a
  ``SubgraphOp`` (``willow/include/popart/op/if.hpp``), so AliasZeroCopy never aliases its
  branches: every input and output of the taken branch is copied on every execution, at every
  nesting level.
* **constants** are always live for AliasZeroCopy (``getLivenessIntervals``): a constant
  parent overlaps everything, so it is copied wherever the callee modifies it, and a constant
  graph output is copied out.

Approximations (stated in the emulator README, "Lowering copies"): liveness is computed per
graph at op granularity in the graph's creation order (the emulator's schedule), a tensor's
storage being live from its first use (producer, or graph entry) to its last use, graph outputs
and by-ref inputs being used at graph exit; AliasZeroCopy's global schedule, which unrolls a
loop body twice, is reduced to its consequences: a loop-invariant input the body reads is live
across every iteration's call, a by-ref one is re-produced by the copy back (so not live
across), a carried one is dead after the call. Call sites of one graph in different parent
graphs conflict only when one parent is a constant or variable. Regions are whole tensors.
"""
from collections import defaultdict

from .tensor import Constant, Variable
from .views import Aliases  # noqa: F401 - the storage groups; imported from here too

#: Kinds of ``RunProfile.bytes_copied_by_kind``: the boundary kinds, then ``"view"`` (outplace
#: views' cloneNcopy) and ``"op"`` (ops' own copies), both from the lowering table.
KINDS = ("call", "branch", "loop_carried", "loop_in_out", "loop_control", "view", "op")
#: LoopOpx's own copies: per iteration the int32 iterator into the body, and the bool condition
#: output (the wrapper's body output 0) into its clone and back into its input; once per repeat
#: ``true`` into the condition's clone and ``false`` into the exit flag.
ITERATOR_BYTES, COND_BYTES = 4, 1
LOOP_CONTROL_ONCE, LOOP_CONTROL_STEP = 2 * COND_BYTES, ITERATOR_BYTES + 2 * COND_BYTES


class Liveness:
    """Op-granularity liveness of one graph's storage, in schedule (creation) order.

    A tensor is used by the ops it is an input or output of; graph outputs and by-ref inputs
    are also used at graph exit (index ``len(ops)``: the caller's copy out / copy back reads
    them), graph inputs, constants and variables exist from entry (index -1).
    """

    def __init__(self, graph):
        self.graph, self.al = graph, Aliases(graph)
        ops = graph._ops
        self.end = len(ops)
        self.first, self.last = {}, {}  # id(tensor) -> first / last use index
        self.members = defaultdict(list)  # id(storage root) -> tensors sharing it
        self.reads, self.modified = set(), set()  # storage roots read / modified by some op
        produced = {id(t) for op in ops for t in op.outputs}
        for t in graph._tensors.values():
            self.members[id(self.al.find(t))].append(t)
            if id(t) not in produced:  # graph input, constant, variable: exists from entry
                self.first[id(t)] = -1
        for k, op in enumerate(ops):
            for pos, t in enumerate(op.inputs):
                self._use(t, k)
                self.reads.add(id(self.al.find(t)))
                if pos in op.modifies:
                    self.modified.add(id(self.al.find(t)))
            for t in op.outputs:
                self._use(t, k)
        for t in list(graph._outputs) + list(graph._by_ref_inputs):
            self._use(t, self.end)
            self.reads.add(id(self.al.find(t)))

    def _use(self, t, k):
        self.first.setdefault(id(t), k)
        self.last[id(t)] = max(self.last.get(id(t), k), k)

    def root(self, t):
        return self.al.find(t)

    def is_read(self, t):
        """Whether some op (or the graph's exit) reads ``t``'s storage."""
        return id(self.al.find(t)) in self.reads

    def is_modified(self, t):
        """Whether some op writes ``t``'s storage in place (or passes it on by reference)."""
        return id(self.al.find(t)) in self.modified

    def used_after(self, k, t):
        """Whether ``t``'s storage is used after op ``k``."""
        return any(self.last.get(id(m), -1) > k for m in self.members[id(self.al.find(t))])

    def live_across(self, k, t, by_ref=False):
        """Whether ``t``'s storage is live while op ``k``'s callee runs (AliasZeroCopy's
        ``overlapping``): a constant always, a variable unless re-produced by the copy back,
        otherwise some tensor of the storage used both before (or at) and after ``k``; with
        ``by_ref`` ``t`` itself does not count (the copy back re-produces it after the call).
        """
        root = self.al.find(t)
        if isinstance(root, Constant) or (isinstance(root, Variable) and not by_ref):
            return True
        return any(self.first.get(id(m), self.end + 1) <= k < self.last.get(id(m), -1)
                   for m in self.members[id(root)] if not (by_ref and m is t))


class CopyModel:
    """The lowering copies of every call, repeat and conditional of an Ir (module docstring).

    ``aliased(graph)``: per graph input, whether AliasZeroCopy shares it with the parent at its
    call sites (calls and repeats' wrapper calls). ``call_bytes``/``repeat_bytes``/
    ``branch_bytes``: the copies of one execution of a site.
    """

    def __init__(self, ir):
        self._live = {}
        self._sites = defaultdict(list)  # id(callee) -> [(kind, parent graph, op)]
        self._branches = set()
        for g in ir._graphs:
            for op in g._ops:
                if op.kind in ("call", "repeat"):
                    self._sites[id(op.attrs["graph"])].append((op.kind, g, op))
                elif op.kind == "conditional":
                    self._branches.update((id(op.attrs["then"]), id(op.attrs["else"])))
        self._aliased = {}

    def live(self, graph):
        """Returns: the graph's :class:`Liveness` (cached)."""
        if id(graph) not in self._live:
            self._live[id(graph)] = Liveness(graph)
        return self._live[id(graph)]

    # -- AliasZeroCopy decisions -------------------------------------------------------------
    def aliased(self, graph):
        """Returns: tuple of bools, one per input of ``graph``: shared with the parent tensor at
        its call sites (never for a graph used as a conditional branch: IfOpx copies)."""
        if id(graph) not in self._aliased:
            sites = self._sites.get(id(graph), [])
            live = self.live(graph)
            flags = []
            for i, s in enumerate(graph._inputs):
                if id(graph) in self._branches or not sites:
                    flags.append(False)
                    continue
                overlapping = any(self._site_live_across(site, i) for site in sites)
                flags.append(not self._conflict(sites, i)
                             and not (overlapping and live.is_modified(s)))
            self._aliased[id(graph)] = tuple(flags)
        return self._aliased[id(graph)]

    def _site_live_across(self, site, i):
        kind, parent, op = site
        by_ref = i in op.modifies
        if kind == "call":
            return (self.live(parent).live_across(op.index, op.inputs[i], by_ref)
                    or self._sibling_reader(parent, op, i, first=True))
        # The wrapper graph's input of a repeat: a carried one is dead after the wrapper's call
        # (the next iteration reads the clone); an invariant one is read again by the next
        # iteration's call, unless the copy back re-produces it (by-ref) -- and unless it shares
        # storage, through the loop's aliases, with another invariant input the body reads.
        if i < len(op.attrs["graph"]._outputs):
            return False
        if not by_ref:
            return True
        return self.loop_aliased(parent, op, i) and self._sibling_reader(parent, op, i,
                                                                          loop=True)

    def _sibling_reader(self, parent, op, i, first=False, loop=False):
        """Whether another input of ``op`` shares input ``i``'s storage in ``parent``, is read
        by the callee and not modified there (so AliasZeroCopy aliases it into the callee, where
        it is live while the callee runs). ``first``: only one AliasZeroCopy processes before
        input ``i`` (larger bytes, then larger index: its priority order), whose alias then
        makes ``i``'s storage overlap the callee. ``loop``: the repeat's wrapper inputs, which
        only a by-ref body input modifies."""
        graph, lp = op.attrs["graph"], self.live(parent)
        live, root = self.live(graph), lp.root(op.inputs[i])
        key = (graph._inputs[i]._nbytes, i)
        for j, t in enumerate(op.inputs):
            s = graph._inputs[j]
            modified = j in op.modifies if loop else live.is_modified(s)
            if j == i or lp.root(t) is not root or not live.is_read(s) or modified:
                continue
            if not first or (s._nbytes, j) > key:
                return True
        return False

    def _conflict(self, sites, i):
        """AliasZeroCopy's ``conflict``: call sites bind input ``i`` to different storage that is
        live at the same time (sites in one graph: one parent live across the other's site)."""
        for a, (ka, ga, oa) in enumerate(sites):
            for kb, gb, ob in sites[a + 1:]:
                if ka == "repeat" or kb == "repeat":
                    pa = pb = None  # each repeat's wrapper graph has its own input tensor
                else:
                    pa, pb = oa.inputs[i], ob.inputs[i]
                if ga is gb and pa is not None:
                    la = self.live(ga)
                    if la.root(pa) is la.root(pb):
                        continue
                    if la.live_across(ob.index, pa) or la.live_across(oa.index, pb):
                        return True
                elif any(isinstance(p, (Constant, Variable)) for p in (pa, pb)):
                    return True
        return False

    def shared(self, graph):
        """Returns: per input of ``graph``, whether its storage is the parent's at every site
        (aliased; for a repeat body also aliased into the wrapper, and not loop-carried: a
        carried input is the loop's own buffer). For the run profile's live bytes."""
        flags = list(self.aliased(graph))
        for kind, parent, op in self._sites.get(id(graph), []):
            if kind == "repeat":
                n = len(graph._outputs)
                for i in range(len(flags)):
                    flags[i] = flags[i] and i >= n and self.loop_aliased(parent, op, i)
        return tuple(flags)

    def loop_aliased(self, parent, op, i):
        """Whether a repeat's invariant input ``i`` is aliased into the wrapper graph (one call
        site: no conflict; modified when the body takes it by reference)."""
        by_ref = i in op.modifies
        return not (by_ref and (self.live(parent).live_across(op.index, op.inputs[i], by_ref)
                                or self._sibling_reader(parent, op, i, first=True,
                                                        loop=True)))

    # -- bytes per execution ---------------------------------------------------------------
    def call_bytes(self, parent, op):
        """Bytes CallOpx copies per execution of call ``op`` in ``parent`` (kind "call")."""
        graph = op.attrs["graph"]
        lp = self.live(parent)
        copied = self._input_bytes(graph, op, lambda i: lp.used_after(op.index, op.inputs[i]))
        live_after = [lp.used_after(op.index, op.inputs[i]) for i in range(len(op.inputs))]
        used = [lp.used_after(op.index, o) for o in op.outputs]
        return copied + self._output_bytes(graph, op, live_after, used)

    def inner_call_bytes(self, op):
        """Bytes the wrapper graph's CallOp copies per iteration of repeat ``op``."""
        graph = op.attrs["graph"]
        n = len(graph._outputs)
        copied = self._input_bytes(graph, op, lambda i: True)
        live_after = [i >= n for i in range(len(op.inputs))]  # invariant: the next iteration
        return copied + self._output_bytes(graph, op, live_after, [True] * n)

    def _input_bytes(self, graph, op, back_needed):
        live, aliased, total = self.live(graph), self.aliased(graph), 0
        for i, s in enumerate(graph._inputs):
            if aliased[i] or not live.is_read(s):
                continue  # shared, or CopyInput/CopyModified dead (the callee never reads it)
            total += s._nbytes
            if i in op.modifies and back_needed(i):
                total += s._nbytes
        return total

    def _output_bytes(self, graph, op, live_after, used):
        """Outputs AliasZeroCopy cannot alias with the call's outputs: a constant or variable
        (always live), a second output of one storage, and an input's storage that is aliased
        with a parent live after the call (or copied back there)."""
        live, aliased = self.live(graph), self.aliased(graph)
        roots = {id(live.root(s)): i for i, s in enumerate(graph._inputs)}
        seen, total = set(), 0
        for j, o in enumerate(graph._outputs):
            root = live.root(o)
            if not used[j]:
                seen.add(id(root))
                continue  # CopyOutput dead
            i = roots.get(id(root))
            if id(root) in seen or isinstance(root, (Constant, Variable)):
                total += o._nbytes
            elif i is not None and (i in op.modifies or (aliased[i] and live_after[i])):
                total += o._nbytes
            seen.add(id(root))
        return total

    def repeat_bytes(self, parent, op):
        """Returns: ``(once, per_iteration)`` dicts of bytes by kind for repeat ``op``."""
        graph = op.attrs["graph"]
        live, lp, n = self.live(graph), self.live(parent), len(graph._outputs)
        once = dict.fromkeys(("loop_in_out", "loop_control"), 0)
        step = dict.fromkeys(("loop_carried", "loop_control", "call"), 0)
        once["loop_control"] = LOOP_CONTROL_ONCE
        for i, s in enumerate(graph._inputs):
            read = live.is_read(s)
            if i < n:  # carried: initial value into the clone, clone back into the input
                if read or lp.used_after(op.index, op.outputs[i]):
                    once["loop_in_out"] += s._nbytes
                if i in op.modifies:  # by-ref: the body input copied back into the parent
                    once["loop_in_out"] += s._nbytes
                if read:
                    step["loop_carried"] += s._nbytes
            elif read and not self.loop_aliased(parent, op, i):
                once["loop_in_out"] += s._nbytes
                if i in op.modifies and lp.used_after(op.index, op.inputs[i]):
                    once["loop_in_out"] += s._nbytes
        for j, o in enumerate(graph._outputs):
            step["loop_carried"] += o._nbytes  # body output into its clone, every iteration
            if lp.used_after(op.index, op.outputs[j]):
                once["loop_in_out"] += o._nbytes  # clone into the op output, after the loop
        step["loop_control"] = LOOP_CONTROL_STEP
        step["call"] = self.inner_call_bytes(op)
        return once, step

    @staticmethod
    def branch_bytes(graph):
        """Bytes IfOpx copies when ``graph``'s branch is taken: all its inputs and outputs."""
        return sum(t._nbytes for t in graph._inputs) + sum(t._nbytes for t in graph._outputs)
