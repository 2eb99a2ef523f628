"""What the functional API created, per Ir: flash forward graphs and the tensors they produced.

The autodiff glue (:mod:`popxl_flash.api.autodiff`) recognises a flash forward graph by this record,
never by its name; :func:`popxl_flash.flash_attention_grad` uses the output record to refuse an
``out``/``lse`` produced with other options. Records are keyed by the Ir (weakly: they go away
with it) and by graph / tensor id, which works the same on the SDK and on the emulator.

A call's record also holds its run-time inputs (ALiBi slopes, dropout seed, ``score_mod_inputs``,
segment ids and positions, or the tensors they came from) by the names of the API the user
called, so a stash-mode backward refuses other run-time tensors than the forward's, naming the
argument (:func:`popxl_flash.api.functional.check_stash_options`).

What cannot be recorded: a tensor is only known as the very tensor ``flash_attention``
returned, in the graph that called it. A tensor that went through another op, a graph boundary
(e.g. passed as an input to a separately built backward graph) or came from the host or another
Ir is unknown here, and no option check happens for it.
"""
import weakref
from dataclasses import dataclass, field, replace
from typing import Dict, Optional

from popxl_flash.plan.config import AttentionConfig


@dataclass(frozen=True)
class ForwardRecord:
    """One flash forward graph or one call of it.

    Attributes:
        options: the ``FlashAttention`` constructor options (to build the matching backward).
        config: the validated configuration of the call (``None`` for other attention forwards).
        call: a per-Ir call counter (tells two calls of one cached graph apart).
        grad_module: for graphs of other attention forwards (context parallelism): a
            callable returning the backward module whose graph autodiff uses, with
            ``build(dout, *graph inputs, *graph outputs)``; ``None`` for flash graphs.
        api: the public function the user called (for messages).
        inputs: ``{argument name: tensor id}`` of the call's run-time inputs, by the names of
            ``api`` (slopes, seed, ``score_mod_inputs[i]``, segment ids, positions).
    """
    options: dict
    config: Optional[AttentionConfig]
    call: int = -1
    grad_module: object = None
    api: str = "flash_attention"
    inputs: dict = field(default_factory=dict)

    def attention_options(self):
        """The options that change the result (:func:`attention_options`)."""
        return attention_options(self.config)


def attention_options(config):
    """The options of a configuration that change the result: ``causal``, ``scale`` and
    ``window``; with score modifiers also those (``mods``). Not the chunks, even with
    dropout: its keep mask is a function of (seed, g, row, column) alone."""
    options = dict(causal=config.causal, scale=config.scale, window=config.window)
    mods = config.mods
    if mods is not None:
        options["mods"] = mods
    return options


@dataclass
class _IrRecord:
    graphs: Dict[str, ForwardRecord] = field(default_factory=dict)
    outputs: Dict[str, ForwardRecord] = field(default_factory=dict)
    grad_infos: Dict[str, object] = field(default_factory=dict)
    calls: int = 0
    no_grad_graph: object = None
    differentiated: Dict[str, int] = field(default_factory=dict)  # graph id -> outputs before


_RECORDS = weakref.WeakKeyDictionary()


def ir_record(ir) -> _IrRecord:
    """Returns: the (mutable) record of ``ir``, created on first use."""
    rec = _RECORDS.get(ir)
    if rec is None:
        rec = _RECORDS[ir] = _IrRecord()
    return rec


def tensor_ids(tensors):
    """``{name: tensor id}`` of ``{name: tensor}`` (``None`` values left out)."""
    return {name: t.id for name, t in tensors.items() if t is not None}


def record_forward(graph, options, config, outputs, inputs=None):
    """Record a call of the flash forward graph ``graph`` and the tensors it returned.

    Args:
        graph: the ``FlashAttention`` module graph. options: its constructor options.
        config: the call's ``AttentionConfig``. outputs: the call's ``(out, lse)``.
        inputs: ``{name: tensor}``, the call's run-time inputs (:class:`ForwardRecord`).
    """
    rec = ir_record(graph.ir)
    rec.calls += 1
    call = ForwardRecord(dict(options), config, rec.calls, inputs=tensor_ids(inputs or {}))
    rec.graphs.setdefault(graph.id, ForwardRecord(dict(options), config))
    for t in outputs:
        rec.outputs[t.id] = call


def record_alias(tensor, source, api=None, inputs=None):
    """Record ``tensor`` (a layout change of ``source``, e.g. ``flash_attn_func``'s ``[B, L, H,
    D]`` out) as produced by the call that produced ``source`` (no-op if that is unknown).

    Args:
        api, inputs: the calling function's name and its run-time inputs ``{name: tensor}``
            by its own names (they replace the core call's), or ``None`` to keep the core's.
    """
    rec = ir_record(tensor.ir)
    if source.id in rec.outputs:
        call = rec.outputs[source.id]
        if api is not None:
            call = replace(call, api=api)
        if inputs is not None:
            call = replace(call, inputs=tensor_ids(inputs))
        rec.outputs[tensor.id] = call


def record_graph(graph, grad_module, config=None):
    """Record an attention forward graph that is not a ``FlashAttention`` graph (its inputs
    ``(q, k, v, ...)``, its outputs ``(out, lse)``), with the factory of its backward module.

    Args:
        graph: the forward graph. grad_module: callable returning the backward module.
        config: an ``AttentionConfig`` whose ``mods`` tell :mod:`popxl_flash.api.autodiff` which
            inputs after q, k, v are score-modifier inputs (no gradient); ``None`` without.
    """
    rec = ir_record(graph.ir)
    rec.graphs.setdefault(graph.id, ForwardRecord({}, config, grad_module=grad_module))


def forward_record(graph) -> Optional[ForwardRecord]:
    """Returns: the record of ``graph`` if it is a flash forward graph, else ``None``."""
    rec = _RECORDS.get(graph.ir)
    return None if rec is None else rec.graphs.get(graph.id)


def output_record(tensor) -> Optional[ForwardRecord]:
    """Returns: the record of the ``flash_attention`` call that returned ``tensor``, or None."""
    rec = _RECORDS.get(tensor.ir)
    return None if rec is None else rec.outputs.get(tensor.id)
