"""Subgraph calls: call, repeat, conditional (and their ``*_with_info`` forms)."""
import copy
import numbers
from collections.abc import Iterable

from .. import dtypes
from ..context import gcg
from ..errors import PopartError
from ..ir import Graph, check_in_graph
from ..registry import COMPILE_CHECKS, PREPARE, emit, register
from ..tensor import Tensor


# -- input binding (shared by call/repeat/conditional) ---------------------------------------
def _flatten(inputs):
    flat = []
    for x in ([] if inputs is None else inputs):
        if isinstance(x, Iterable) and not isinstance(x, str):
            flat.extend(x)
        else:
            flat.append(x)
    return flat


def _bind_inputs(check_inputs, parent, graph, what, inputs, inputs_dict):
    """Match positional inputs and ``inputs_dict`` to ``graph``'s inputs like PopXL.

    Returns: list of parent tensors in graph-input order.
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"Expected a popxl.Graph for the {what} graph, got {graph!r}")
    if graph.ir is not parent.ir:
        raise ValueError(f"The {what} graph {graph} belongs to another Ir")
    inputs, inputs_dict = _flatten(inputs), dict(inputs_dict or {})
    g_inputs = graph.inputs
    if len(inputs) > len(g_inputs):
        raise ValueError(f"Too many inputs have been provided to the {what} graph. "
                         f"{len(inputs)} > {len(g_inputs)}. For graph: {graph}")
    for t in inputs:
        if isinstance(t, Tensor) and t not in parent:
            raise ValueError(f'Parent input tensor "{t}" is not in parent graph "{parent}".')
    bound = {}
    for i, value in enumerate(inputs):
        bound[i] = _coerce(g_inputs[i], value, f'Input at position "{i}"', what)
    for g_t, value in inputs_dict.items():
        check_in_graph(graph, graph_tensor=g_t)
        if isinstance(value, Tensor) and value not in parent:
            raise ValueError(f'The parent input tensor "{value}" is not in the parent graph '
                             f"({parent}).")
        if g_t not in g_inputs:  # PopXL's _pb_graph.getInputIndex (Graph::getInputIndex)
            raise PopartError(f"Could not find input tensor '{g_t.id}'")
        idx = g_inputs.index(g_t)
        if idx < len(inputs):
            raise ValueError(f"Graph input tensor is specified twice for the {what} graph, in "
                             f"`inputs_dict` and positionally in `inputs`: {g_t}")
        bound[idx] = _coerce(g_t, value, f'Input "{g_t}"', what)
    if len(bound) < len(g_inputs):
        missing = [t.id for i, t in enumerate(g_inputs) if i not in bound]
        if check_inputs:
            raise ValueError(f"Not enough inputs have been provided for the {what} graph "
                             f"({graph}). Missing inputs: {missing}")
        raise NotImplementedError(f"check_inputs=False with unconnected inputs {missing} is not "
                                  "supported by the emulator")
    return [bound[i] for i in range(len(g_inputs))]


def _coerce(graph_tensor, value, where, what):
    if isinstance(value, Tensor):
        return value
    try:
        return graph_tensor._ensure_tensor(value)
    except ValueError:
        raise TypeError(f"{where} could not be coerced into a tensor for the {what} graph: "
                        f"Type {type(value)}. Value: {value}") from None


def _check_specs(kind, graph, parents):
    for g_t, p_t in zip(graph.inputs, parents):
        if (g_t.shape, g_t.dtype, g_t.meta_shape) != (p_t.shape, p_t.dtype, p_t.meta_shape):
            raise PopartError(f"{kind}: parent tensor {p_t.id} {p_t.dtype.name}{list(p_t.shape)}"
                              f" (meta shape {list(p_t.meta_shape)}) does not match graph input "
                              f"{g_t.id} {g_t.dtype.name}{list(g_t.shape)} (meta shape "
                              f"{list(g_t.meta_shape)}) (no casting/broadcasting at call "
                              "boundaries)")


def _meta_shapes(outs, graph_outputs):
    """A call's, repeat's or conditional's outputs take the (then-)graph outputs' whole tensor
    info, meta shape included (PopART's ``CallOp``/``LoopOp``/``IfOp::setup``)."""
    for o, g_o in zip(outs, graph_outputs):
        o._meta_shape = tuple(g_o.meta_shape)


def _out_rule(graph, count=None):
    outs = graph.outputs if count is None else graph.outputs[:count]
    return [(o.shape, o.dtype) for o in outs]


def _by_ref_positions(graph):
    return [i for i, t in enumerate(graph.inputs) if t in graph._by_ref_inputs]


def _check_by_ref_unique(kind, parents, by_ref):
    """PopXL marks each by-ref input's parent modified by looking up *one* op input index for
    that parent tensor (``CallSiteInfo.set_parent_input_modified`` -> ``Op::inIndex``,
    ``willow/src/op.cpp``): a parent bound to a by-ref input and to any other input raises."""
    for i in by_ref:
        if sum(p is parents[i] for p in parents) > 1:
            raise PopartError(f"Tensor {parents[i].id} is an input of {kind} at more than one "
                              "index (it feeds a by-ref graph input)")


#: Inputs PopXL adds to the repeat wrapper graph before the user's (``ops/repeat.py``).
_WRAPPER_INPUTS = ("Iterator___", "LoopCond___")


def _check_repeat_wrapper_ids(graph, parents):
    """``ops.repeat`` adds one wrapper-graph input per bound input, named after the parent
    tensor (``ops/repeat.py`` ``_setup_inputs``); a second input with the same id fails in
    ``Tensors::insert`` (``willow/src/tensors.cpp``): one parent tensor for two inputs raises."""
    seen = set(_WRAPPER_INPUTS)
    for p in parents:
        if p.name in seen:
            raise PopartError(f"tensor {graph.id}__loop_wrapper/{p.name} already in M (repeat: "
                              f"parent tensor {p.id} is given for more than one input; pass "
                              "distinct tensors)")
        seen.add(p.name)


# -- CallSiteInfo ------------------------------------------------------------------------------
class CallSiteInfo:
    """Info about a call site: called graph, parent inputs/outputs and the mappings."""

    def __init__(self, op):
        self._op = op

    called_graph = property(lambda self: self._op.attrs["graph"])
    inputs = property(lambda self: self._op.inputs)
    outputs = property(lambda self: self._op.outputs)

    def parent_input(self, idx):
        """Args: idx: graph input index. Returns: the parent tensor bound to it."""
        return self._op.inputs[idx]

    def parent_output(self, idx):
        """Args: idx: graph output index. Returns: the parent output tensor."""
        return self._op.outputs[idx]

    def graph_to_parent(self, graph_tensor):
        """Args: graph_tensor: graph input or output. Returns: the matching parent tensor."""
        g = self.called_graph
        if graph_tensor in g.inputs:
            return self._op.inputs[g.inputs.index(graph_tensor)]
        if graph_tensor in g.outputs:
            return self._op.outputs[g.outputs.index(graph_tensor)]
        raise ValueError(f"{graph_tensor} is not an input or output of {g}")

    def parent_to_graph(self, parent_tensor):
        """Args: parent_tensor: a call input (PopXL looks at inputs only; the first index a
        tensor is bound to wins). Returns: the graph input bound to it."""
        g = self.called_graph
        for idx, t in enumerate(self._op.inputs):
            if t is parent_tensor:
                return g.inputs[idx]
        raise ValueError(f"Tensor {getattr(parent_tensor, 'name', parent_tensor)} is not a "
                         "parent graph input of the call site.")

    # PopXL 3.4 ``ops/call.py``: a CallOp's subgraph and op indices coincide.
    def graph_to_parent_input_index(self, idx):
        """Args: idx: graph input index. Returns: the call's input index."""
        return idx

    def parent_to_graph_input_index(self, idx):
        """Args: idx: call input index. Returns: the graph input index."""
        return idx

    def graph_to_parent_output_index(self, idx):
        """Args: idx: graph output index. Returns: the call's output index."""
        return idx

    def parent_to_graph_output_index(self, idx):
        """Args: idx: call output index. Returns: the graph output index."""
        return idx

    def set_parent_input_modified(self, parent_tensor, infer_modified_regions=False):
        """Mark the call's input ``parent_tensor`` modified: what the called graph writes into
        that input in place reaches the parent tensor (CallOpx copies a modified input back).
        ``infer_modified_regions`` (only the regions the callee's ops modify) gives the same
        values. Raises: PopartError unless ``parent_tensor`` is an input at exactly one index
        (``Op::inIndex``)."""
        op = self._op
        if op.graph.ir._prepared:
            raise RuntimeError("the Ir was compiled by a Session; it cannot change any more")
        indices = [i for i, t in enumerate(op.inputs) if t is parent_tensor]
        name = getattr(parent_tensor, "id", parent_tensor)
        if not indices:
            raise PopartError(f"Cannot find input index of tensor {name} for {op}")
        if len(indices) > 1:
            raise PopartError(f"Tensor {name} is an input of {op} at more than one index")
        op.modifies = tuple(sorted(set(op.modifies) | set(indices)))


class _WrapperSiteInfo(CallSiteInfo):
    """Site info whose PopXL form describes an internal wrapper op: only outputs are exposed."""

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: PopXL exposes its internal wrapper op "
                                  "here; the emulator only supports `outputs` and "
                                  "`parent_output(i)`")

    inputs = property(_unsupported)
    parent_input = graph_to_parent = parent_to_graph = _unsupported
    set_parent_input_modified = _unsupported
    graph_to_parent_input_index = parent_to_graph_input_index = _unsupported
    graph_to_parent_output_index = parent_to_graph_output_index = _unsupported


class RepeatSiteInfo(_WrapperSiteInfo):
    """Site info of a repeat (PopXL: the LoopOp around a wrapper graph)."""

    called_graph = property(_WrapperSiteInfo._unsupported)


class ConditionalSiteInfo(_WrapperSiteInfo):
    """Site info of a conditional; ``called_graph`` is ``(then_branch, else_branch)``."""

    called_graph = property(lambda self: (self._op.attrs["then"], self._op.attrs["else"]))


# -- call ---------------------------------------------------------------------------------------
def _call_rule(*parents, graph):
    _check_specs("call", graph, parents)
    return _out_rule(graph)


def _run_call(rt, plan, args):
    rt.add_copies("call", plan.call_copies, f"call {plan.graph.name}")
    return rt.run_graph(plan, [a.copy() if c else a for a, c in zip(args, plan.copy_in)])


register("call", _call_rule, _run_call, runtime=True)
def _prepare_call(op, plan_of):
    """The callee's plan; inputs the call site marks modified beyond the graph's by-ref ones
    (``set_parent_input_modified``) are passed without a copy, so in-place writes reach the
    parent."""
    plan = plan_of(op.attrs["graph"])
    extra = set(op.modifies) - set(_by_ref_positions(op.attrs["graph"]))
    if extra:
        plan = copy.copy(plan)
        plan.copy_in = [c and i not in extra for i, c in enumerate(plan.copy_in)]
    return plan


PREPARE["call"] = _prepare_call


def call_with_info(graph, *inputs, inputs_dict=None, check_inputs=True):
    """Call ``graph`` with inputs bound like PopXL (positional, flattened, + inputs_dict).

    Returns: CallSiteInfo.
    """
    parent = gcg()
    parents = _bind_inputs(check_inputs, parent, graph, "called", inputs, inputs_dict)
    if graph is parent:
        raise PopartError(f"call: graph {graph} cannot call itself")
    _check_by_ref_unique("call", parents, _by_ref_positions(graph))
    tensors = {f"input_{i}": t for i, t in enumerate(parents)}
    outs = emit("call", tensors, {"graph": graph}, names=[o.name for o in graph.outputs],
                modifies=_by_ref_positions(graph), subgraphs=(graph,))
    _meta_shapes(outs, graph.outputs)
    return CallSiteInfo(parent._ops[-1])


def call(graph, *inputs, inputs_dict=None):
    """Returns: tuple of the call's outputs (graph output order)."""
    return call_with_info(graph, *inputs, inputs_dict=inputs_dict).outputs


# -- repeat -------------------------------------------------------------------------------------
def _repeat_rule(*parents, graph, count):
    _check_specs("repeat", graph, parents)
    return _out_rule(graph, len(graph.outputs))


def _run_repeat(rt, plan, args):
    n = plan.n_outputs
    count = plan.repeat_count
    site = f"repeat {plan.graph.name}"
    for kind, nbytes in plan.loop_once.items():  # copies.py: CopyModel.repeat_bytes
        rt.add_copies(kind, nbytes, site)
    for kind, nbytes in plan.loop_step.items():
        rt.add_copies(kind, nbytes, site, count)
    if count == 0:
        return [a.copy() for a in args[:n]]
    vals = list(args)
    rt.live += plan.all_out_bytes  # LoopOpx's clones of the carried values
    rt.iterations += count
    for _ in range(count):
        ins = [a.copy() if c else a for a, c in zip(vals, plan.copy_in)]
        vals[:n] = rt.run_graph(plan, ins)
    rt.live -= plan.all_out_bytes
    return _copy_back_carried(plan, args, ins, vals[:n])


def _copy_back_carried(plan, args, last_inputs, outputs):
    """LoopOpx::copyModifiedBodyInputsToOpInputs for by-ref loop-carried inputs: after the
    loop, the body input as the last iteration left it is copied into the parent tensor; the
    op outputs stay the body output clones (own arrays). Returns: the op outputs."""
    carried = [i for i in _by_ref_positions(plan.graph) if i < len(outputs)]
    for i in carried:
        if last_inputs[i] is not args[i]:
            args[i][...] = last_inputs[i]
    return [o.copy() if any(o is args[i] for i in carried) else o for o in outputs]


def _check_repeat(op):
    """Compile-time check of a repeat: each carried output matches its input (LoopOp); a
    by-ref carried input of a zero-trip loop is refused (LoopOpx copies back a body input
    no iteration wrote: unspecified)."""
    body = op.attrs["graph"]
    carried = [body.inputs[i].id for i in op.modifies if i < len(body.outputs)]
    if carried and op.attrs["count"] == 0:
        raise PopartError(f"repeat of {body.name} with repeat_count 0: by-ref loop-carried "
                          f"inputs {carried} would be copied back from body inputs no "
                          "iteration wrote (unspecified on the device)")
    for i, (o, x) in enumerate(zip(body.outputs, body.inputs)):
        if (o.shape, o.dtype) != (x.shape, x.dtype):
            raise PopartError(f"repeat of {body.name}: output {i} {o.dtype.name}"
                              f"{list(o.shape)} does not match loop-carried input {i} "
                              f"{x.dtype.name}{list(x.shape)}")


register("repeat", _repeat_rule, _run_repeat, runtime=True)
COMPILE_CHECKS["repeat"] = _check_repeat


def _prepare_repeat(op, plan_of):
    return plan_of(op.attrs["graph"]).with_repeat(op.attrs["count"])


PREPARE["repeat"] = _prepare_repeat


def repeat_with_info(graph, repeat_count, *inputs, inputs_dict=None, check_inputs=True):
    """Repeat ``graph`` ``repeat_count`` times; inputs 0..N-1 are loop-carried (N = outputs).

    Returns: RepeatSiteInfo (``outputs``: the N last-iteration outputs).
    """
    if not isinstance(repeat_count, numbers.Integral) or isinstance(repeat_count, bool):
        raise TypeError(f"repeat_count must be a Python int, got {repeat_count!r}")
    if repeat_count < 0:
        raise ValueError(f"Repeat count must be >= 0. Repeat count: {repeat_count}. "
                         f"Graph: {graph}")
    n_in, n_out = len(graph.inputs), len(graph.outputs)
    if n_in < n_out:
        raise ValueError(f"To repeat the subgraph ({graph.id}) the number of inputs must be "
                         f"greater than or equal to the number of outputs. {n_in} < {n_out}")
    parent = gcg()
    parents = _bind_inputs(check_inputs, parent, graph, "called", inputs, inputs_dict)
    if graph is parent:
        raise PopartError(f"repeat: graph {graph} cannot call itself")
    _check_repeat_wrapper_ids(graph, parents)
    by_ref = _by_ref_positions(graph)
    tensors = {f"input_{i}": t for i, t in enumerate(parents)}
    outs = emit("repeat", tensors, {"graph": graph, "count": int(repeat_count)},
                names=[o.name for o in graph.outputs], modifies=by_ref, subgraphs=(graph,))
    _meta_shapes(outs, graph.outputs)
    return RepeatSiteInfo(parent._ops[-1])


def repeat(graph, repeat_count, *inputs, inputs_dict=None):
    """Returns: tuple of the N last-iteration outputs."""
    return repeat_with_info(graph, repeat_count, *inputs, inputs_dict=inputs_dict).outputs


# -- conditional ----------------------------------------------------------------------------
def _cond_rule(cond, *parents, then, n_then, **kw):
    g_else = kw["else"]
    _check_specs("conditional then_branch", then, parents[:n_then])
    _check_specs("conditional else_branch", g_else, parents[n_then:])
    return _out_rule(then)


def _run_cond(rt, data, args):
    then_plan, else_plan, n_then = data
    if args[0].reshape(-1)[0]:
        plan, ins = then_plan, args[1:1 + n_then]
    else:
        plan, ins = else_plan, args[1 + n_then:]
    rt.add_copies("branch", plan.branch_copies, f"branch {plan.graph.name}")
    return rt.run_graph(plan, [a.copy() if c else a for a, c in zip(ins, plan.copy_in)])


def _check_cond(op):
    """Compile-time checks of a conditional (``Session()``)."""
    then, other = op.attrs["then"], op.attrs["else"]
    # An op-less branch graph has no program fragments, and IfOpx calls the branch's fragments
    # directly (willow/src/popx/op/ifx.cpp, PopPrograms::scopeFragments in popprograms.cpp).
    for g in (then, other):
        if not g._ops:
            raise PopartError(f"There are no scope fragments for subgraph '{g.id}' (an "
                              "ops.conditional branch needs at least one op; e.g. return "
                              "ops.identity(x))")
    for i, (a, b) in enumerate(zip(then.outputs, other.outputs)):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise PopartError(f"conditional: else_branch output {i} {b.dtype.name}"
                              f"{list(b.shape)} does not match then_branch output "
                              f"{a.dtype.name}{list(a.shape)}")
    # IfOp::setup (willow/src/op/if.cpp) does not look at `cond`; IfOpx reshapes it to a scalar
    # for poplar::program::If (willow/src/popx/op/ifx.cpp): more than one element fails there,
    # and a non-bool predicate is not what PopXL documents: both refused at compile time.
    cond = op.inputs[0]
    if cond.dtype != dtypes.bool or cond.nelms != 1:
        raise PopartError(f"conditional: cond {cond.id} must be a bool tensor with one element, "
                          f"got {cond.dtype.name}{list(cond.shape)}")


register("conditional", _cond_rule, _run_cond, runtime=True)
COMPILE_CHECKS["conditional"] = _check_cond
PREPARE["conditional"] = lambda op, plan_of: (plan_of(op.attrs["then"]),
                                              plan_of(op.attrs["else"]), op.attrs["n_then"])


def conditional_with_info(cond, then_branch, else_branch, then_inputs=None, else_inputs=None,
                          then_inputs_dict=None, else_inputs_dict=None, check_inputs=True):
    """Run ``then_branch`` if ``cond`` (one-element bool) else ``else_branch``.

    Returns: ConditionalSiteInfo.
    """
    parent = gcg()
    then_all = _bind_inputs(check_inputs, parent, then_branch, "then_branch", then_inputs,
                            then_inputs_dict)
    else_all = _bind_inputs(check_inputs, parent, else_branch, "else_branch", else_inputs,
                            else_inputs_dict)
    if len(then_branch.outputs) != len(else_branch.outputs):
        raise ValueError("`then_branch` graph and `else_branch` graph must have the same number "
                         f"of outputs: {len(then_branch.outputs)} != {len(else_branch.outputs)}")
    for name, g in (("then_branch", then_branch), ("else_branch", else_branch)):
        if g is parent:
            raise PopartError(f"conditional: {name} cannot be the calling graph")
        if g._by_ref_inputs:
            raise NotImplementedError(f"TensorByRef is not implemented for the conditional op. "
                                      f"You cannot call this input to the {name} graph by ref: "
                                      f"{next(iter(g._by_ref_inputs))}")
    tensors = {"cond": cond}
    tensors.update({f"then_{i}": t for i, t in enumerate(then_all)})
    tensors.update({f"else_{i}": t for i, t in enumerate(else_all)})
    names = [f"{a.name}_or_{b.name}" for a, b in zip(then_branch.outputs, else_branch.outputs)]
    outs = emit("conditional", tensors, {"then": then_branch, "else": else_branch,
                                                "n_then": len(then_all)},
                names=names, subgraphs=(then_branch, else_branch))
    _meta_shapes(outs, then_branch.outputs)
    return ConditionalSiteInfo(parent._ops[-1])


def conditional(cond, then_branch, else_branch, then_inputs=None, else_inputs=None,
                then_inputs_dict=None, else_inputs_dict=None):
    """Returns: tuple of the taken branch's outputs."""
    return conditional_with_info(cond, then_branch, else_branch, then_inputs, else_inputs,
                                 then_inputs_dict, else_inputs_dict).outputs
