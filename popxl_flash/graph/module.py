"""The shared home of the forward and backward ``popxl.Module`` classes.

Both take the same options, validate them with the inputs' specs into one
:class:`~popxl_flash.plan.config.AttentionConfig`, prepare the runtime segment inputs the same way
and run their pass as the loops of :class:`popxl_flash.graph.blocks.PassLoops`.
"""
from dataclasses import replace

import numpy as np

from popxl_flash.graph import blocks, score_mods, segments
from popxl_flash.backend import popxl
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.plan import steps
from popxl_flash.plan.schedule import PARTIAL


class AttentionModule(popxl.Module):
    """Options, configuration and loops shared by :class:`popxl_flash.FlashAttention` and
    :class:`popxl_flash.FlashAttentionGrad`.

    Args (constructor): ``num_chunks_q``, ``num_chunks_kv``, ``causal``, ``scale``, ``window``
    as :func:`popxl_flash.flash_attention`; ``mods``: ``None`` or the
    :class:`~popxl_flash.graph.score_mods.ScoreMods` of :func:`popxl_flash.graph.score_mods.options`
    (its inputs follow the segment inputs of ``build``: :func:`score_mods.split_inputs`);
    ``memory_budget`` as :func:`popxl_flash.flash_attention`; ``packing``: with segment ids,
    the :class:`popxl_flash.plan.packed.Packing` the automatic chunks are priced against
    (``None``: one sequence over the whole row; the varlen function passes its
    ``max_seqlen_*``); ``lean``: the memory-lean structure of looped passes (``None``: where
    the budget needs it; ``True``/``False``: always/never; :class:`AttentionConfig`).
    """

    def __init__(self, *, num_chunks_q=None, num_chunks_kv=None, causal=True, scale=None,
                 window=None, mods=None, memory_budget=None, packing=None, lean=None):
        self.options = dict(num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                            causal=causal, scale=scale, window=window, mods=mods,
                            memory_budget=memory_budget, packing=packing, lean=lean)

    def attention_config(self, q, k, v, segment_inputs=(), extras=()) -> AttentionConfig:
        """Validate q, k, v, the segment inputs' and the score-modifier inputs' specs against
        the options.

        Args:
            q, k, v: tensors or specs (``.shape``, ``.dtype``).
            segment_inputs: ``(q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                step_table)``, ``None`` where absent.
            extras: the score-modifier inputs (:func:`score_mods.split_inputs`).

        Returns:
            The :class:`AttentionConfig`.
        """
        options = {n: o for n, o in self.options.items() if n != "packing"}
        cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape,
                                          (q.dtype.name, k.dtype.name, v.dtype.name),
                                          **options)
        automatic = (self.options["num_chunks_q"] is None, self.options["num_chunks_kv"] is None)
        seg = (tuple(segment_inputs) + (None,) * 5)[:5]
        cfg = cfg.with_segments(*seg[:4], automatic=automatic,
                                memory_budget=self.options["memory_budget"],
                                packing=self.options["packing"], step_table=seg[4])
        return score_mods.check_extras(cfg, self.options["mods"], extras)

    @staticmethod
    def single_block(cfg):
        """Whether the pass is one block (one chunk each way, visited) without segment ids
        (:func:`popxl_flash.plan.steps.single_block`): then it is a straight line
        (:meth:`run_single`), no loop, no state."""
        return steps.single_block(cfg.schedule, cfg.segments is not None)

    @staticmethod
    def row_passes(cfg):
        """Whether the passes run as row passes (:func:`popxl_flash.plan.steps.row_passes`:
        the forward's straight-line passes, the backward's inline row steps); dropout's
        masks do not depend on the structure (:mod:`popxl_flash.graph.score_mods`)."""
        return steps.row_passes(cfg.schedule, cfg.segments is not None)

    @classmethod
    def lean_where_looped(cls, cfg, flag):
        """``cfg`` with its ``flag`` (``"lean_forward"``, ``"lean_backward"``) cleared unless the
        pass loops: one-block passes and row passes have no memory-lean structure."""
        if getattr(cfg, flag) and (cls.single_block(cfg) or cls.row_passes(cfg)):
            return replace(cfg, **{flag: False})
        return cfg

    @staticmethod
    def run_single(cfg, segment_inputs, extras, build):
        """The pass of one block (:meth:`single_block`): ``build(seg, extra, visible)`` on the
        whole (unpadded) tensors, with the block's modifier operands (static offsets 0) and
        its static pattern (``None`` for a full block; a split block runs whole).

        Returns:
            ``build``'s results.
        """
        sched = cfg.schedule
        visible = None
        if sched.kind[0, 0] == PARTIAL:
            pattern = sched.patterns[sched.pattern_id[0, 0]]
            visible = popxl.constant(np.ascontiguousarray(pattern[None]))  # [1, Lq, Lkv]
        extra = ()
        if cfg.mods is not None:
            extra = score_mods.step_operands(cfg, score_mods.prepare(cfg, extras),
                                             blocks.counter(0), blocks.counter(0),
                                             (cfg.q_len, cfg.kv_len))
        return build((), extra, visible)

    @staticmethod
    def run_rows(cfg, spec, operands, state, finish, extras=()):
        """The backward's row passes (:meth:`row_passes`): :func:`blocks.row_steps` in order,
        then ``finish`` on the state (as :meth:`run_pass`).

        Returns:
            ``finish``'s results.
        """
        prepared = [] if cfg.mods is None else score_mods.prepare(cfg, extras)
        with blocks.in_order():
            blocks.row_steps(spec, cfg, operands, state, prepared)
            with blocks.in_order(False):
                return finish(*state)

    @staticmethod
    def run_pass(cfg, spec, order, operands, state, segment_inputs, finish, extras=()):
        """Build and run a pass's loops, then ``finish`` on the state.

        Order matters only between the loops (each updates ``state`` in place) and the reads
        of ``state`` after them: those ops alone are put in sequence
        (:func:`popxl_flash.graph.blocks.in_order`; the reads are one unordered block after the
        loops). Everything else the scheduler may order freely.

        Args:
            cfg: the config; spec: the :class:`popxl_flash.graph.blocks.LoopSpec`; order: the
                step order within groups.
            operands, state: the padded read-only operands and the state tensors.
            segment_inputs: the module's segment inputs (``None`` where absent).
            finish: ``finish(*state) -> results``, the ops that read the state.
            extras: the module's score-modifier inputs (prepared once here,
                :func:`score_mods.prepare`).

        Returns:
            ``finish``'s results.
        """
        seg, classes = [], None
        if cfg.segments is not None and cfg.schedule.visited_blocks:
            seg, classes = segments.prepare(cfg, *segment_inputs)
        prepared = []
        if cfg.mods is not None and cfg.schedule.visited_blocks:
            prepared = score_mods.prepare(cfg, extras, segment_inputs)
        loops = blocks.PassLoops(spec, cfg, order, operands, state, seg, prepared)
        step_classes = loops.step_classes(classes)
        with blocks.in_order():
            loops.run(operands, state, seg, step_classes, prepared)
            with blocks.in_order(False):
                return finish(*state)
