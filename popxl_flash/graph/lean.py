"""The memory-lean backward's loops: dk and dv accumulated one kv piece at a time.

FlashAttention-2's backward runs kv-major and keeps, besides its inputs and outputs, the float32
``dq`` accumulator, the row statistics and one block. The looped backward of
:mod:`popxl_flash.graph.backward` keeps float32 ``[dv; dk]`` for the whole kv length as well; its
lean structure (``AttentionConfig.lean_backward``) cuts the kv chunks into pieces
(:func:`popxl_flash.plan.steps.lean_pieces`, at most 8) and, for each piece in turn::

    acc = 0                                     float32 [2, Gk, piece rows, D]  ([dv; dk])
    for each step group (steps.step_groups, kv-major):
      the group's steps in this piece           (consecutive in kv-major order)
        repeat n x group_body                   # the group's one body graph, counter from
                                                # the piece's first step; acc sliced at the
                                                # step's row within the piece (a table column)
        (one step: inline, static offsets)
    dv_piece, dk_piece = acc, acc[1] * scale, cast   # the piece's rows of dk and dv
    dk, dv = the pieces joined (views)

Each group keeps one body graph, so the graph grows with the pieces (at most 8), not with L.
Graph code: it runs inside the backward module's graph and uses only the documented PopXL API.
"""
from dataclasses import dataclass
import numpy as np

from popxl_flash.backend import popxl
from popxl_flash.graph import blocks
from popxl_flash.plan import steps

ops = popxl.ops


@dataclass(frozen=True, eq=False)
class PieceGroup:
    """A kv-major :class:`~popxl_flash.plan.steps.StepGroup` as the lean backward runs it: the
    same steps, and each step's first kv row within its piece's accumulator (the step table's
    last column, :func:`popxl_flash.graph.blocks._step_table`).

    Attributes:
        group: the step group; kv_piece_row: ``int32[V]``.
    """

    group: object
    kv_piece_row: np.ndarray

    def __getattr__(self, name):  # rows, cols, masked, q_row, kv_row, patterns, ...
        return getattr(self.group, name)

    def step_pattern(self, step):
        """The static pattern of one step: a bool ``[1, rows, cols]`` constant of the current
        graph (``None`` for an unmasked group)."""
        if not self.group.masked:
            return None
        return popxl.constant(np.ascontiguousarray(
            self.group.patterns[self.group.pattern_id[step]][None]))


class PieceLoops:
    """The lean backward's loop bodies (one per step group of more than one step) and their
    runs per kv piece.

    Create before the ops that need ordering (as :class:`popxl_flash.graph.blocks.PassLoops`),
    then :meth:`run_piece` per kv piece inside :func:`popxl_flash.graph.blocks.in_order`.

    Args:
        spec: the backward's lean :class:`popxl_flash.graph.blocks.LoopSpec` (state ``dq`` on q
            rows, the piece accumulator on ``"kvp"`` rows).
        cfg: the :class:`AttentionConfig` (no segment ids).
        operands: the read-only operands (specs used).
        state: ``dq`` and one piece's accumulator (tensors or specs: shapes and dtypes
            used).
        extras: with score modifiers, their prepared tensors (specs used).
    """

    def __init__(self, spec, cfg, operands, state, extras=()):
        self.spec, self.cfg = spec, cfg
        sched = cfg.schedule
        self.groups = [PieceGroup(g, steps.lean_piece_offsets(g, sched.nkv, sched.chunk_kv))
                       for g in steps.step_groups(sched, "kv_major")]
        self.ranges = [steps.lean_step_ranges(g, sched.nkv) for g in self.groups]
        ir = popxl.gcg().ir
        state_specs = tuple((t.shape, t.dtype) for t in state)
        extra_specs = tuple((t.shape, t.dtype) for t in extras)
        self.graphs = [
            ir.create_graph(blocks.group_body, spec, cfg, g, state_specs, (), extra_specs,
                            popxl.TensorSpec((1,), popxl.int32), *[t.spec for t in operands])
            if any(b - a > 1 for a, b in r) else None
            for g, r in zip(self.groups, self.ranges)]

    def run_piece(self, piece, operands, state, extras=()):
        """The steps of kv piece ``piece``: per group, one ``repeat`` of its body from the
        piece's first step (or the one step inline), updating ``state`` in place."""
        for g, graph, r in zip(self.groups, self.graphs, self.ranges):
            start, stop = r[piece]
            if stop - start == 1:
                blocks.block_step(self.spec, self.cfg, g, operands, state, int(g.q_row[start]),
                                  int(g.kv_row[start]), g.step_pattern(start), extras=extras,
                                  kv_piece_offset=int(g.kv_piece_row[start]))
            elif stop > start:
                ops.repeat(graph, stop - start, blocks.counter(start), *operands, *state,
                           *extras)


def piece_rows(cfg):
    """Rows of one kv piece's accumulator (every piece's: the last may hold padding)."""
    c0, c1 = steps.lean_pieces(cfg.num_chunks_kv)[0]
    return (c1 - c0) * cfg.chunk_kv
