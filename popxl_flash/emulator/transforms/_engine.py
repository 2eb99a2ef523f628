"""The autodiff engine: PopART's ``Autodiff::apply`` (GradGrowerGraph) over the emulator IR.

For the target graph and every graph reachable from it (children first), unless
``called_graphs_grad_info`` has an entry for it:

1. refuse modifying ops and graphs marked not recursively differentiable;
2. mark the ops and tensors on a path to the provided gradients (PopART's ``toLoss``);
3. decide, in reverse op order, which ops grow gradient ops: an op on the path grows them when
   every one of its outputs on the path has a gradient (provided, or at least one edge from a
   consumer); an op that cannot fails, and its inputs get no edge from it;
4. emit gradient ops only where they lead to a required gradient (what PopART's pruning
   leaves), summing the edge gradients of each tensor;
5. make the forward tensors the gradient ops read inputs of the gradient graph (``Fwd``, sorted
   by forward tensor id, after the ``FwdGrad`` inputs) and stitch them: each one that is
   neither a forward input nor output becomes a new forward output, and every ``ops.call`` of
   the forward graph gets the extra output.

In-place views follow PopART (:mod:`..grads`): ``concat_`` has ``concat``'s grad ops,
``reshape_``/``transpose_``/``detach_`` none, ``slice_``'s getGradOps throws
(``PopartInternalError`` when the op can grow grad ops).

Differences from PopART, all refusals: recompute stitching (a graph that needs stitching but is
also called by ``ops.repeat``/``ops.conditional``), gradients through ``ops.conditional``,
and ops without a rule in :mod:`..grads` raise ``NotImplementedError``; an
``ops.repeat`` whose input needs a gradient raises ``PopartError`` (PopART's LoopOp has no grad op
and the gradient would silently miss that path).
"""
from collections import defaultdict

from .. import _internal_ir as _ir
from .. import grads as _grads
from .. import ops
from ..errors import PopartError, PopartInternalError
from ..tensor import Tensor
from .grad_info import GradGraphInfo

_FWD, _GRAD = _ir.ExpectedConnectionType.Fwd, _ir.ExpectedConnectionType.FwdGrad


def differentiate(target, provided, required, infos):
    """Run autodiff; see the module docstring.

    Args:
        target: Graph. provided, required: lists of tensors of ``target``.
        infos: ``{Graph: GradGraphInfo}`` given by the caller.
    Returns:
        ``{Graph: GradGraphInfo}`` (the caller's entries plus every graph differentiated).
    """
    ir = target.ir
    ir._check_mutable()
    if target is ir.main_graph:
        raise NotImplementedError("autodiff of the main graph is not supported by the emulator")
    for what, ts in (("grads_provided", provided), ("grads_required", required)):
        for t in ts:
            if not isinstance(t, Tensor) or t._graph is not target:
                raise PopartError(f"[Autodiff] {what}: {t!r} is not a tensor of {target.id}")
    if len({id(t) for t in provided}) != len(provided):
        raise PopartError(f"[Autodiff] grads_provided lists a tensor twice: {provided}")
    result = dict(infos)
    for g in _graph_schedule(target):
        if g in result:
            continue
        _check_differentiable(g, target)
        top = g is target
        info = _Builder(g, provided if top else None, required if top else None,
                        result).build()
        _stitch(g, info)
        result[g] = info
    return result


def _graph_schedule(target):
    """Graphs reachable from ``target`` (itself included), children before parents."""
    order, seen = [], set()

    def visit(g):
        seen.add(id(g))
        for op in g._ops:
            for sub in op.subgraphs:
                if id(sub) not in seen:
                    visit(sub)
        order.append(g)
    visit(target)
    return order


def _check_differentiable(g, target):
    for op in g._ops:
        if op.modifies:
            raise PopartError(f"The graph {g.id} contains a modifying op: {op}. Autodiff cannot "
                              "be used on graphs with inplace modifying ops.")
    if not g._can_be_recursively_autodiffed and g is not target:
        raise PopartError(f"The graph contains a call to another graph {g.id} which has been "
                          "marked as unsafe to autodiff. Please provide a gradient graph via "
                          "`called_graphs_grad_info` in PopXL or `FwdGraphToBwdGraphInfo` in "
                          "C++.")


def _call_sites(graph):
    return [op for g in graph.ir._graphs for op in g._ops if graph in op.subgraphs]


def _stitch(fwd, info):
    """Make internal ``Fwd`` tensors forward outputs, also at every call site."""
    outs, ins = {id(t) for t in fwd.outputs}, {id(t) for t in fwd.inputs}
    extra = [t for t in info.inputs if id(t) not in outs and id(t) not in ins]
    extra = list({id(t): t for t in extra}.values())
    if not extra:
        return
    sites = _call_sites(fwd)
    others = [op for op in sites if op.kind != "call"]
    if others:
        raise NotImplementedError(
            f"autodiff: stitching {fwd.id} needs {[t.id for t in extra]} as new outputs, but "
            f"the graph is also used by {others}; PopART would recompute them in the gradient "
            "graph (RecomputeStitcher), which the emulator does not implement. Give the graph "
            "a called_graphs_grad_info entry or call it with ops.call only.")
    for t in extra:
        fwd._outputs.append(t)
        for op in sites:
            new = op.graph._new_tensor(Tensor, t.name, t.dtype, t.shape, t.meta_shape)
            op.outputs = op.outputs + (new,)


class _Ctx:
    """What a gradient rule sees of one forward op (see :mod:`..grads`)."""

    def __init__(self, builder, op, dys):
        self.op, self._b, self._dys, self.cache = op, builder, dys, {}

    def x(self, i):
        return self._b.fwd_value(self.op.inputs[i])

    def y(self, j):
        return self._b.fwd_value(self.op.outputs[j])

    def dy(self, j):
        if self._dys[j] is None:  # output off the loss path: PopART's grad op input is unset
            raise PopartError(f"No input found for input {j} of the grad op of {self.op}, but "
                              "input is not optional: output "
                              f"{self.op.outputs[j].id} has no gradient")
        return self._dys[j]


class _Builder:
    """Builds the gradient graph of one forward graph."""

    def __init__(self, fwd, provided, required, infos):
        self.fwd, self.infos = fwd, infos
        self.explicit_provided = provided is not None
        self.provided = list(fwd.outputs if provided is None else provided)
        self.required = None if required is None else list(required)
        self.ops = list(fwd._ops)

    # -- analysis ---------------------------------------------------------------------------
    def _to_loss(self):
        producer = {id(t): op for op in self.ops for t in op.outputs}
        tl_t = {id(t) for t in self.provided}
        tl_op = set()
        frontier = [producer[id(t)] for t in self.provided if id(t) in producer]
        tl_op.update(id(op) for op in frontier)
        while frontier:
            op = frontier.pop()
            for t in op.inputs:
                tl_t.add(id(t))
                p = producer.get(id(t))
                if p is not None and id(p) not in tl_op:
                    tl_op.add(id(p))
                    frontier.append(p)
        return tl_t, tl_op

    def produces(self, op):
        """Input positions whose gradient the op's grad ops output (PopART's view)."""
        if op.kind == "call":
            callee = op.attrs["graph"]
            info = self.infos[callee]
            ids = {ec._pb_ec.fwdId for ec in info.expected_outputs
                   if ec._pb_ec.type == _GRAD}
            return [i for i, t in enumerate(callee.inputs) if t.id in ids]
        if op.kind in _grads.RULES:
            return list(_grads.RULES[op.kind][0](op))
        if op.kind in _grads.NO_GRAD or op.kind == "repeat":
            return []
        return list(range(len(op.inputs)))  # unknown: refused when a gradient is needed

    def _analyse(self):
        self.tl_t, tl_op = self._to_loss()
        provided = {id(t) for t in self.provided}
        edges = defaultdict(int)
        self.grows = set()
        for op in reversed(self.ops):
            if id(op) not in tl_op:
                continue
            outs = [t for t in op.outputs if id(t) in self.tl_t]
            if all(id(t) in provided or edges[id(t)] for t in outs):
                self.grows.add(id(op))
                for i in self.produces(op):
                    edges[id(op.inputs[i])] += 1
        self.avail = lambda t: id(t) in provided or edges[id(t)] > 0
        seeds = self.fwd.inputs if self.required is None else self.required
        self.needed = {id(t) for t in seeds}
        for op in self.ops:
            if id(op) in self.grows and any(id(op.inputs[i]) in self.needed
                                            for i in self.produces(op)):
                self.needed.update(id(t) for t in op.outputs if id(t) in self.tl_t)

    # -- gradient graph -----------------------------------------------------------------------
    def fwd_value(self, t):
        """The gradient-graph input standing for forward tensor ``t`` (made on first use)."""
        if id(t) not in self.fwd_inputs:
            self.fwd_inputs[id(t)] = (t, self.bwd._new_tensor(Tensor, t.name, t.dtype, t.shape,
                                                              t.meta_shape))
        return self.fwd_inputs[id(t)][1]

    def grad_of(self, t):
        """The summed gradient of forward tensor ``t`` in the gradient graph."""
        if id(t) in self.sums:
            return self.sums[id(t)]
        parts = list(self.edges[id(t)])
        if id(t) in self.grad_inputs:
            self.used_grad_inputs.add(id(t))
            parts.insert(0, self.grad_inputs[id(t)])
        if not parts:
            raise PopartError(f"[Autodiff] no gradient for {t.id}")
        g = parts[0]
        for p in parts[1:]:
            g = g + p
        self.sums[id(t)] = g
        return g

    def build(self):
        self._analyse()
        ir = self.fwd.ir
        self.bwd = ir.create_empty_graph(f"{self.fwd.name}_bwd")
        self.fwd_inputs, self.edges, self.sums = {}, defaultdict(list), {}
        self.used_grad_inputs = set()
        with self.bwd:
            self.grad_inputs = {id(t): self.bwd._new_tensor(Tensor, "Gradient___" + t.name,
                                                            t.dtype, t.shape, t.meta_shape)
                                for t in self.provided}
            for op in reversed(self.ops):
                if id(op) in self.grows:
                    self._grow(op)
            outputs, expected_out = self._outputs()
        return self._finish(outputs, expected_out)

    def _grow(self, op):
        if op.kind in _grads.RAISES:  # PopART calls getGradOps on every op it can grow
            raise PopartInternalError(_grads.RAISES[op.kind].format(op=op))
        need = [i for i in self.produces(op) if id(op.inputs[i]) in self.needed]
        if op.kind == "repeat" and any(id(t) in self.needed for t in op.inputs):
            raise PopartError(f"[Autodiff] {op} (ops.repeat of {op.attrs['graph'].id}) is on the "
                              "gradient path but ops.repeat is not differentiable (LoopOp has "
                              "no grad op): autodiff the body and repeat its gradient graph")
        if not need:
            return
        dys = [self.grad_of(t) if id(t) in self.tl_t else None for t in op.outputs]
        if op.kind == "call":
            self._grow_call(op, dys)
            return
        if op.kind not in _grads.RULES:
            raise NotImplementedError(f"autodiff: the emulator has no gradient rule for {op} "
                                      f"(kind '{op.kind}') on the gradient path")
        ctx = _Ctx(self, op, dys)
        for i in need:
            g = _grads.RULES[op.kind][1](ctx, i)
            src = op.inputs[i]
            if (g.shape, g.dtype) != (src.shape, src.dtype):
                raise AssertionError(f"gradient rule of {op.kind} gave {g.dtype.name}"
                                     f"{g.shape} for {src.dtype.name}{src.shape}")
            self.edges[id(src)].append(g)

    def _grow_call(self, op, dys):
        callee = op.attrs["graph"]
        info = self.infos[callee]
        grad_graph = info.graph
        where = (f"[Autodiff] While trying to produce the grad op for {op} (gradient graph "
                 f"{grad_graph.id})")
        if len(info.expected_inputs) != len(grad_graph.inputs) or \
                len(info.expected_outputs) != len(grad_graph.outputs):
            raise PopartError(f"{where}: the GradGraphInfo lists {len(info.expected_inputs)} "
                              f"inputs / {len(info.expected_outputs)} outputs but the graph has "
                              f"{len(grad_graph.inputs)} / {len(grad_graph.outputs)}")
        args = []
        for k, ec in enumerate(info.expected_inputs):
            t = _resolve(callee, ec, where)
            kind = ec._pb_ec.type
            if t in callee.outputs:
                parent = op.outputs[callee.outputs.index(t)]
                if kind == _FWD:
                    args.append(self.fwd_value(parent))
                elif id(parent) in self.tl_t:
                    args.append(dys[callee.outputs.index(t)])
                else:
                    raise PopartError(f"No input found for input {k} of {op} (CallGradOp of "
                                      f"{callee.id}), but input is not optional: no gradient of "
                                      f"{parent.id} reaches it (FwdGrad of {t.id})")
            elif kind == _FWD and t in callee.inputs:
                args.append(self.fwd_value(op.inputs[callee.inputs.index(t)]))
            else:
                raise PopartError(f"{where}: input {k} is associated with "
                                  f"{ec._pb_ec.type.name}({t.id}), which is not an input or "
                                  f"output of {callee.id} as that connection type needs")
        targets = []
        for k, ec in enumerate(info.expected_outputs):
            t = _resolve(callee, ec, where)
            if ec._pb_ec.type != _GRAD or t not in callee.inputs:
                raise PopartError(f"{where}: output {k} must be the gradient (FwdGrad) of an "
                                  f"input of {callee.id}, got {ec._pb_ec.type.name}({t.id})")
            targets.append(op.inputs[callee.inputs.index(t)])
        outs = ops.call(grad_graph, *args)
        for src, g in zip(targets, outs):
            self.edges[id(src)].append(g)

    def _outputs(self):
        if self.required is None:
            wanted = [t for t in self.fwd.inputs if self.avail(t)]
        else:
            wanted = self.required
            for t in wanted:
                if not self.avail(t):
                    raise PopartError(f"[Autodiff] Unable to provide required gradient output "
                                      f"for fwd id '{t.id}' in bwd graph {self.bwd.id}")
        return [self.grad_of(t) for t in wanted], [_ir.ExpectedConnection(t.id, _GRAD)
                                                  for t in wanted]

    def _finish(self, outputs, expected_out):
        bwd, inputs, expected_in = self.bwd, [], []
        for t in self.provided:
            g = self.grad_inputs[id(t)]
            if self.explicit_provided or id(t) in self.used_grad_inputs:
                inputs.append(g)
                expected_in.append(_ir.ExpectedConnection(t.id, _GRAD))
            else:
                del bwd._tensors[g.id]  # pruned: an unused gradient of an output
        for t, placeholder in sorted(self.fwd_inputs.values(), key=lambda p: p[0].id):
            inputs.append(placeholder)
            expected_in.append(_ir.ExpectedConnection(t.id, _FWD))
        bwd._inputs, bwd._outputs = inputs, list(outputs)
        ir = self.fwd.ir
        return GradGraphInfo._from_pb(ir._pb_ir, self.fwd._pb_graph,
                                      _ir.BwdGraphInfo(bwd.id, expected_in, expected_out))


def _resolve(callee, ec, where):
    try:
        return callee.get_tensor(ec._pb_ec.fwdId)
    except KeyError:
        raise PopartError(f"{where}: {ec._pb_ec.fwdId!r} is not a tensor of {callee.id}") \
            from None
