"""PopXL graph helpers shared by the forward and backward modules.

They slice chunks by loop counters, look a block up in the planner's tables, fetch its mask
pattern and dispatch the block to its full or partial branch graph. Everything here is graph
code: it runs inside the graph context of the module being built and uses only the documented
PopXL API.
"""
import numpy as np

from popxl_flash.backend import popxl
from popxl_flash.schedule import FULL, PARTIAL

ops = popxl.ops

#: Score given to masked elements when taking the running max, and the initial running max
#: ``m_i``: the lowest float32, so every finite score of a visible element ranks above it.
#: Finite on purpose: ``exp(m_old - m_new)`` is 1 or 0, never ``exp(-inf + inf) = NaN``, while a
#: row has seen nothing, and masked probabilities are then zeroed with ``where`` rather than
#: relying on it.
MASKED_SCORE = float(np.finfo(np.float32).min)

#: dtype of the loop counters and table entries.
INDEX_DTYPE = np.int32


def float32():
    """The backend's float32 dtype (statistics and accumulators are always float32)."""
    return popxl.float32


def counter(value=0):
    """A loop counter constant ``[1]`` int32 in the current graph."""
    return popxl.constant(np.array([value], dtype=INDEX_DTYPE))


def pad_rows(t, padded_len):
    """Pad axis 1 of ``t [G, L, D]`` with zeros to ``[G, padded_len, D]`` (no-op if equal)."""
    G, L, D = t.shape
    if padded_len == L:
        return t
    zeros = ops.init((G, padded_len - L, D), t.dtype, init_type="zero")
    return ops.concat([t, zeros], axis=1)


def unpad_rows(t, length):
    """Keep the first ``length`` entries of axis 1 of ``t`` (no-op if already that long)."""
    if t.shape[1] == length:
        return t
    return ops.slice(t, start=[0], stop=[length], axis=[1])


def chunk(t, index, chunk_len):
    """``t[:, index*chunk_len : (index+1)*chunk_len]`` for a counter ``index [1]``.

    Args:
        t: ``[G, L_pad, ...]``.
        index: int32 ``[1]`` chunk index.
        chunk_len: rows per chunk.

    Returns:
        ``[G, chunk_len, ...]``.
    """
    return ops.dynamic_slice(t, index * chunk_len, axes=[1], sizes=[chunk_len], no_overlap=True)


def update_chunk_(t, index, value, chunk_len):
    """Write ``value`` into chunk ``index`` of axis 1 of ``t`` in place; returns the alias.

    Only for the library's own accumulators (``out``, ``lse``, ``dq``, ``dk``, ``dv``), which
    enter the loops by reference and are read after them under ``in_sequence``.
    """
    return ops.dynamic_update_(t, index * chunk_len, value, axes=[1], sizes=[chunk_len],
                               no_overlap=True)


class BlockTables:
    """An inner loop's ``kind``/``pattern_id``/``index`` tables as constants of one graph.

    Create inside the graph that looks blocks up (the constants belong to that graph, so they
    are not copied through loop boundaries).

    Args:
        loop: the schedule's :class:`popxl_flash.schedule.InnerLoop` for this loop nest.
    """

    def __init__(self, loop):
        self.kind = popxl.constant(loop.kind.astype(INDEX_DTYPE))  # [n_outer, T]
        self.pattern_id = popxl.constant(loop.pattern_id)  # [n_outer, T]
        self.index = popxl.constant(loop.index)  # [n_outer, T]

    def lookup(self, outer, t):
        """Entries of iteration ``t`` of outer chunk ``outer`` (counters ``[1]``).

        Returns:
            ``(full, partial, pattern_id, inner)``: bool ``()`` flags (a skip block has both
            False), the int32 ``[1]`` pattern id (-1 unless partial) and the int32 ``[1]`` inner
            chunk index.
        """
        idx = ops.concat([outer, t], axis=0)  # [2]

        def entry(table):
            return ops.dynamic_slice(table, idx, axes=[0, 1], sizes=[1, 1], no_overlap=True)

        kind = entry(self.kind).reshape(())
        full = ops.equal(kind, popxl.constant(np.array(FULL, dtype=INDEX_DTYPE)))
        partial = ops.equal(kind, popxl.constant(np.array(PARTIAL, dtype=INDEX_DTYPE)))
        return full, partial, entry(self.pattern_id).reshape((1,)), entry(self.index).reshape((1,))


def block_mask(schedule, pattern_id):
    """The visibility pattern of a partial block, from a pattern table made a constant here.

    Args:
        schedule: the block schedule (its ``patterns [P, cq, ckv]`` become a constant).
        pattern_id: int32 ``[1]``.

    Returns:
        bool ``[1, cq, ckv]`` (True = visible), broadcasting over groups.
    """
    patterns = popxl.constant(np.ascontiguousarray(schedule.patterns))  # [P, cq, ckv]
    return ops.dynamic_slice(patterns, pattern_id, axes=[0], sizes=[1], no_overlap=True)


def _full_block(update, cfg, *tensors):
    """Branch body: ``update`` on a fully visible block."""
    return update(cfg, *tensors)


def _partial_block(update, cfg, *tensors):
    """Branch body: ``update`` masked by the block's pattern (the last input is its id)."""
    *tensors, pattern_id = tensors
    return update(cfg, *tensors, visible=block_mask(cfg.schedule, pattern_id))


def _pass_block(*state):
    """Branch body: the block is not of this kind; the state passes through unchanged.

    One ``ops.identity`` per tensor: a branch graph without ops cannot be lowered by PopART.
    """
    return tuple(ops.identity(t) for t in state)


class BlockGraphs:
    """The branch graphs of one block step: ``full``, ``partial`` (None if the schedule has no
    partial block) and ``passthrough``.

    ``update(cfg, *state, *operands, visible=None) -> new state`` is the block's work; it is
    traced once unmasked and once masked.
    """

    def __init__(self, cfg, update, state_specs, operand_specs):
        ir = popxl.gcg().ir
        self.passthrough = ir.create_graph(_pass_block, *state_specs)
        self.full = ir.create_graph(_full_block, update, cfg, *state_specs, *operand_specs)
        self.partial = None
        if cfg.schedule.partial_blocks:
            pid_spec = popxl.TensorSpec((1,), popxl.int32)
            self.partial = ir.create_graph(_partial_block, update, cfg, *state_specs,
                                           *operand_specs, pid_spec)

    def step(self, full, partial, pattern_id, state, operands):
        """Apply one block to ``state``: full, masked, or not at all (skip).

        Two one-level conditionals (rather than nested ones) keep one graph frame, and so one
        copy of the operands, between the loop body and the block's work. A skip block takes
        the passthrough branch of both: no matmul runs.

        Args:
            full, partial, pattern_id: from :meth:`BlockTables.lookup`.
            state, operands: tensors passed to the block update (state is also the result).

        Returns:
            The new state tensors (a tuple).
        """
        state = ops.conditional(full, self.full, self.passthrough,
                                then_inputs=[*state, *operands], else_inputs=list(state))
        if self.partial is not None:
            state = ops.conditional(partial, self.partial, self.passthrough,
                                    then_inputs=[*state, *operands, pattern_id],
                                    else_inputs=list(state))
        return state


def scores(cfg, q_i, k_j):
    """``scale * q_i k_j^T`` in float32.

    Args:
        q_i: ``[G, cq, D]``; k_j: ``[G, ckv, D]`` (input dtype).

    Returns:
        float32 ``[G, cq, ckv]``.
    """
    f32 = float32()
    s = ops.matmul(q_i, k_j.transpose((0, 2, 1)), output_type=f32, partials_type=f32)
    return s * cfg.scale


def to_input_dtype(cfg, t):
    """Cast a float32 tensor to the attention's input dtype (no op for float32)."""
    return t if cfg.dtype == "float32" else ops.cast(t, getattr(popxl, cfg.dtype))


def to_float32(t):
    """Cast an input-dtype tensor to float32 (no op when it already is)."""
    return t if t.dtype == popxl.float32 else ops.cast(t, popxl.float32)


def scalar(value, dtype):
    """A rank-0 constant of ``dtype`` in the current graph."""
    return popxl.constant(value, dtype=dtype)
