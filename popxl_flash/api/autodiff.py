"""Flash attention inside autodiff-built layers: gradient-graph entries for PopXL's autodiff.

PopART cannot differentiate ``ops.repeat``, and flash's loop bodies modify tensors in place, so
``popxl.transforms.autodiff`` cannot differentiate a graph that calls a flash forward graph. It
can use a hand-written gradient for a called graph instead (``called_graphs_grad_info``). This
module builds those entries:

* every flash forward graph the layer calls (directly or through nested ``ops.call``) gets
  ``FlashAttentionGrad`` in stash mode with the forward's options. Its gradient graph takes
  ``FwdGrad(out)``, ``Fwd(q)``, ``Fwd(k)``, ``Fwd(v)``, ``Fwd(out)``, ``Fwd(lse)`` and returns
  ``FwdGrad(q)``, ``FwdGrad(k)``, ``FwdGrad(v)``; ``out`` and ``lse`` are forward outputs, so
  nothing needs stitching and every call site is unchanged. A forward with segment ids (and
  the varlen API's positions) has them as further int32 inputs: the gradient graph takes them
  as ``Fwd`` inputs too and returns no gradient for them (leave the layer's integer inputs,
  e.g. ``cu_seqlens``, out of ``grads_required``: PopART's autodiff cannot give them one);
* every graph below a flash forward graph (loop bodies, branches and, on the SDK, the repeat
  wrapper graphs) gets an entry too. Autodiff visits every graph reachable from the target and
  would try (and fail) to differentiate those; an entry makes it skip them, and only its graph
  id is ever looked at: such an entry is used only by a call site in a graph autodiff
  differentiates, and the flash forward graph that calls them is not differentiated. So they
  all share one empty gradient graph.

Flash forward graphs are recognised by the record the functional API keeps
(:mod:`popxl_flash.api.provenance`), so only graphs made by :func:`popxl_flash.flash_attention` (or
the functions that call it: the packed form, ``flash_attn_func``, ``flash_attn_varlen_func``)
are found; a hand-made ``ir.create_graph(FlashAttention(...), ...)`` is not.

Gradients through ``lse``: the hand-written backward takes no gradient of ``lse``. If ``lse`` (or
anything computed from it) reaches a tensor whose gradient is provided, PopART would silently
drop that part of the gradient; :func:`called_graphs_grad_info` raises ``ValueError`` instead.
It follows ``ops.call`` boundaries; a path through ``ops.repeat`` or ``ops.conditional`` is not
followed (autodiff cannot differentiate those anyway).

The entries are built the way popxl-addons builds them (``GradGraphInfo._from_pb`` with
``popart._internal.ir``); the emulator offers the same private names, so this code is the same
on both backends except for where ``_ir`` is imported from.
"""
from popxl_flash.api import provenance
from popxl_flash.backend import BACKEND, popxl
from popxl_flash.graph.backward import FlashAttentionGrad
from popxl_flash.graph.reachable import reachable_graphs

if BACKEND == "popxl":  # pragma: no cover - SDK only
    import popart._internal.ir as _ir
else:
    from popxl_flash.emulator import _internal_ir as _ir

_LSE_OUTPUT = 1  # FlashAttention.build returns (out, lse)


def called_graphs_grad_info(graph, grads_provided=None):
    """Gradient-graph entries for the flash attention graphs ``graph`` calls.

    Args:
        graph: the graph you will differentiate (e.g. a transformer layer): a ``popxl.Graph``
            or a popxl-addons ``GraphWithNamedArgs`` (its ``.graph`` is used).
        grads_provided: the tensors whose gradients you will provide to autodiff (default:
            ``graph.outputs``, as autodiff's default); used to refuse a gradient through lse.

    Returns:
        ``{popxl.Graph: GradGraphInfo}``: one entry per flash forward graph below ``graph``
        (``graph`` itself included if it is one) and one per graph below those. Pass it as
        ``popxl.transforms.autodiff(graph, called_graphs_grad_info=...)``.

    Raises:
        ValueError: a gradient would flow into a flash call's ``lse``.
    """
    graph = _as_graph(graph)
    if grads_provided is None:
        _check_not_differentiated(graph)
    provided = list(graph.outputs if grads_provided is None else grads_provided)
    flash = {}
    _find_flash_graphs(graph, flash, set())
    _check_no_lse_gradient(graph, {t.id for t in provided}, set())
    entries = {}
    for g in flash.values():
        entries[g] = _flash_grad_info(g)
        for d in reachable_graphs(g):
            entries.setdefault(d, _no_grad_info(d))
    return entries


def _as_graph(graph):
    """A ``popxl.Graph``, or the ``.graph`` of a popxl-addons ``GraphWithNamedArgs``."""
    inner = getattr(graph, "graph", None)
    if not isinstance(graph, popxl.Graph) and isinstance(inner, popxl.Graph):
        graph = inner
    if not isinstance(graph, popxl.Graph):
        raise TypeError(f"graph must be a popxl.Graph or a popxl-addons GraphWithNamedArgs, got "
                        f"{type(graph).__name__}")
    return graph


def autodiff(graph, **kwargs):
    """``popxl.transforms.autodiff`` with :func:`called_graphs_grad_info` merged in.

    Args:
        graph: the graph to differentiate.
        **kwargs: ``popxl.transforms.autodiff`` arguments (``grads_provided``,
            ``grads_required``, ``called_graphs_grad_info``, ``return_all_grad_graphs``);
            entries you pass in ``called_graphs_grad_info`` win over the generated ones.
            ``grads_required`` defaults to the graph's floating-point inputs (PopXL's default,
            every input, fails for integer inputs such as segment ids or ``cu_seqlens``,
            which have no gradient), except those whose only path to the provided gradients
            runs into a flash call's score-modifier inputs (ALiBi slopes, ``score_mod_inputs``:
            no gradient by design).

    Returns:
        What ``popxl.transforms.autodiff`` returns.

    Raises:
        ValueError: ``graph`` was already differentiated by this function (autodiff added the
            activations its gradient graph reads as outputs of ``graph``; differentiate each
            forward graph once and reuse the first result).
        TypeError: ``graph`` is not a ``popxl.Graph`` (e.g. ``None``, or a popxl-addons
            ``GraphWithNamedArgs``: differentiate its ``.graph``, or use ``addons.autodiff``).
    """
    if not isinstance(graph, popxl.Graph):
        hint = " (a popxl-addons GraphWithNamedArgs: pass its .graph, or use addons.autodiff)" \
            if isinstance(getattr(graph, "graph", None), popxl.Graph) else ""
        raise TypeError(f"graph must be a popxl.Graph{hint}, got graph={graph!r} "
                        f"({type(graph).__name__})")
    _check_not_differentiated(graph)
    n_outputs = len(graph.outputs)
    if kwargs.get("grads_required") is None:
        modifier_only = _modifier_only_inputs(graph, kwargs.get("grads_provided"))
        kwargs["grads_required"] = [t for t in graph.inputs if t.dtype.is_floating_point
                                    and t.id not in modifier_only]
    given = dict(kwargs.pop("called_graphs_grad_info", None) or {})
    entries = called_graphs_grad_info(graph, kwargs.get("grads_provided"))
    entries.update(given)
    result = popxl.transforms.autodiff(graph, called_graphs_grad_info=entries, **kwargs)
    provenance.ir_record(graph.ir).differentiated[graph.id] = n_outputs
    return result


def _check_not_differentiated(graph):
    """Refuse a graph :func:`autodiff` already differentiated (naming what autodiff did)."""
    before = provenance.ir_record(graph.ir).differentiated.get(graph.id)
    if before is not None:
        raise ValueError(
            f"graph {graph.id} was already differentiated by pf.autodiff: autodiff modifies the "
            f"forward graph in place (its outputs went from {before} to {len(graph.outputs)}: "
            "the activations the gradient graph reads, flash's out and lse among them, became "
            "outputs), so differentiating it again would not give its gradient. Differentiate "
            "each forward graph once and reuse the first result (its "
            "inputs_dict(call_info) wires every call site)")


def _find_flash_graphs(graph, found, seen):
    """Collect flash forward graphs at or below ``graph`` (not below a flash graph)."""
    if graph.id in seen:
        return
    seen.add(graph.id)
    if provenance.forward_record(graph) is not None:
        found[graph.id] = graph
        return
    for g in graph.called_graphs:
        _find_flash_graphs(g, found, seen)


def _check_no_lse_gradient(graph, loss_ids, seen):
    """Raise if a flash call's lse output reaches a tensor in ``loss_ids`` (tensor ids).

    Walks ``graph``'s ops backwards from the loss tensors, then into ``ops.call`` callees with
    the callee outputs whose call outputs were reached.
    """
    key = (graph.id, frozenset(loss_ids))
    if key in seen:
        return
    seen.add(key)
    pb_ops = graph._pb_graph.getOps()
    reach = _reaching(pb_ops, set(loss_ids))
    for op in pb_ops:
        if op.opType() != "Call":
            continue
        callee = popxl.Graph._from_pb(op.getCalledGraphs()[0])
        outs = [t.id for t in op.getOutputTensors()]
        record = provenance.forward_record(callee)
        if record is not None:
            if len(outs) > _LSE_OUTPUT and outs[_LSE_OUTPUT] in reach:
                raise ValueError(
                    f"a gradient flows into lse ({outs[_LSE_OUTPUT]}) of the flash_attention call "
                    f"of {callee.id} in {graph.id}: the flash backward takes no lse gradient, "
                    "so it would be dropped. Keep lse off the loss path (or use "
                    "popxl.ops.detach), or leave the tensors it reaches out of grads_provided"
                    + _differentiated_hint(graph, outs[_LSE_OUTPUT]))
            continue
        callee_outs = [t.id for t in callee.outputs]
        sub = {callee_outs[i] for i, t in enumerate(outs) if t in reach and i < len(callee_outs)}
        if sub:
            _check_no_lse_gradient(callee, sub, seen)


def _differentiated_hint(graph, lse_id):
    """A hint for an lse that is an output of ``graph``: autodiff may have made it one."""
    if lse_id not in {t.id for t in graph.outputs}:
        return ""
    return (f". lse is an output of {graph.id}: if {graph.id} was already differentiated, "
            "autodiff added it (with the other activations the gradient graph reads) as an "
            "output; differentiate each forward graph once and reuse the first result")


def _modifier_only_inputs(graph, grads_provided):
    """Ids of ``graph``'s inputs that reach the provided gradients only through the
    score-modifier inputs of flash calls in ``graph`` (no gradient flows there)."""
    provided = {t.id for t in (graph.outputs if grads_provided is None else grads_provided)}
    pb_ops = graph._pb_graph.getOps()
    every = _reaching(pb_ops, provided)
    through_qkv = _reaching(pb_ops, provided, flash_inputs=3)
    return {t.id for t in graph.inputs if t.id in every and t.id not in through_qkv}


def _flash_call_with_modifiers(op):
    """Whether a pb op calls a flash forward graph that has score-modifier inputs."""
    if op.opType() != "Call":
        return False
    record = provenance.forward_record(popxl.Graph._from_pb(op.getCalledGraphs()[0]))
    return record is not None and record.config is not None and record.config.mods is not None


def _reaching(pb_ops, targets, flash_inputs=None):
    """Tensor ids with a path to ``targets`` (reverse passes until nothing changes, so the
    order ``getOps`` returns does not matter); with ``flash_inputs``, a flash call with score
    modifiers passes the path on to its first ``flash_inputs`` inputs only (q, k, v)."""
    reach, changed = set(targets), True
    while changed:
        changed = False
        for op in reversed(pb_ops):
            ins = {t.id for t in op.getInputTensors()}
            if flash_inputs is not None and _flash_call_with_modifiers(op):
                ins = {t.id for t in op.getInputTensors()[:flash_inputs]}
            if not ins <= reach and any(t.id in reach for t in op.getOutputTensors()):
                reach |= ins
                changed = True
    return reach


def _flash_grad_info(fwd):
    """The ``FlashAttentionGrad`` (stash mode) entry of a flash forward graph (cached)."""
    rec = provenance.ir_record(fwd.ir)
    if fwd.id not in rec.grad_infos:
        ir = fwd.ir
        q, k, v, *segments = fwd.inputs  # segment ids (and positions): int32, no gradient
        out, lse = fwd.outputs[:2]
        record = provenance.forward_record(fwd)
        module = (record.grad_module() if record.grad_module is not None
                  else FlashAttentionGrad(**record.options))
        with ir.main_graph:
            grad = ir.create_graph(module, out.spec, q.spec, k.spec, v.spec, out.spec, lse.spec,
                                   *(t.spec for t in segments))
        Fwd, FwdGrad = _ir.ExpectedConnectionType.Fwd, _ir.ExpectedConnectionType.FwdGrad
        ins = [_ir.ExpectedConnection(out.id, FwdGrad)] + [
            _ir.ExpectedConnection(t.id, Fwd) for t in (q, k, v, out, lse, *segments)]
        outs = [_ir.ExpectedConnection(t.id, FwdGrad) for t in (q, k, v)]
        rec.grad_infos[fwd.id] = _grad_graph_info(ir, fwd, grad, ins, outs)
    return rec.grad_infos[fwd.id]


def _no_grad_info(graph):
    """An entry that only marks ``graph`` as handled (see the module docstring)."""
    rec = provenance.ir_record(graph.ir)
    if rec.no_grad_graph is None:
        rec.no_grad_graph = graph.ir.create_empty_graph("flash_attention_descendant")
    return _grad_graph_info(graph.ir, graph, rec.no_grad_graph, [], [])


def _grad_graph_info(ir, fwd, grad, ins, outs):
    bwd_info = _ir.BwdGraphInfo(grad._pb_graph.id, ins, outs)
    return popxl.transforms.GradGraphInfo._from_pb(ir._pb_ir, fwd._pb_graph, bwd_info)
