"""The planner's face of the IPU time model (numpy only).

The model, its constants, the plausible box and the calibration file live in
:mod:`popxl_flash.ipu_model` (below both the planner and the emulator, priced by PopART's
lowering table :mod:`popxl_flash.lowering`); this module re-exports them for the planner and
adds :func:`time` for its counts and :func:`from_ops` for the planners whose counts are still
op counts.
"""
from popxl_flash import ipu_model as _model
from popxl_flash.ipu_model import (BOX, CONSTANTS_ENV, REFERENCE, IpuConstants, ModelledTime,  # noqa: F401
                                   WorkCounts, corners, current, label, load, save)

#: Compute sets per executed op other than views, for the planners that still count ops
#: (packed steps, the KV cache's loops, context parallelism's merges): the mean over the
#: fitted flash steps (about 35 compute sets over 25 ops per looped block step; an estimate).
CS_PER_OP = 1.4


def work_of(counts):
    """``counts`` as :class:`WorkCounts` (a ``PassCounts`` has ``.work``)."""
    return getattr(counts, "work", counts)


def time(counts, dtype=None, constants=None) -> ModelledTime:
    """Modelled time of a :class:`WorkCounts` or a ``PassCounts`` (``dtype`` unused: the work
    carries its matmuls' dtypes)."""
    return _model.time(work_of(counts), constants)


def from_ops(ops, matmul_flops, vector_elements, bytes_copied=0, dtype="float16"):
    """Work counted as executed ops (other than views), matmul FLOPs and output elements: the
    ops priced at :data:`CS_PER_OP` compute sets each and the elements at the float32
    arithmetic rate (the planners not yet fitted to the lowering table; an estimate).

    Returns:
        :class:`WorkCounts`.
    """
    return WorkCounts(compute_sets=ops * CS_PER_OP, matmul_flops={dtype: matmul_flops},
                      vector_work={"arithmetic.float32": vector_elements},
                      bytes_copied=bytes_copied, ops=ops)
