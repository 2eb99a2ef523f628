"""popxl-addons' ``GradReduceSquareAddOp`` (``ops/grad_reduce_square_add/
grad_reduce_square_add_binding.cpp``): the scaled sum of squares of a tensor, as
``popops::reduce(x.flatten(), FLOAT, {0}, {SQUARE_ADD, false, scale})``.

Inputs ``t`` (any shape) and the scale (a scalar; popxl-addons passes ``1 / loss_scaling**2``);
output a float32 scalar ``scale * sum(t**2)``, the squares accumulated in float32 (PopLibs'
reduction order is not documented: numpy's pairwise sum). No grad op (the C++ op defines none,
so the gradient stops there).
"""
import numpy as np

from .. import dtypes, grads
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, register
from ._binding import create

_KIND = "addons_grad_reduce_square_add"


def _rule(t, scale):
    return [((), dtypes.float32)]


def _impl(t, scale):
    x = np.asarray(t, np.float32).reshape(-1)
    s = np.float32(np.asarray(scale, np.float32).reshape(-1)[0])
    return np.asarray(s * np.sum(x * x, dtype=np.float32), np.float32)


def _check(op):
    """What the Opx's ``popops::reduce`` needs: a float input and a one-element float scale."""
    t, scale = op.inputs
    if t.dtype.name not in ("float16", "float32") or scale.dtype.name not in ("float16",
                                                                              "float32"):
        raise PopartError(f"GradReduceSquareAddOp {t.id}: float input and scale needed (got "
                          f"{t.dtype.name}, {scale.dtype.name})")
    if scale.nelms != 1:
        raise PopartError(f"GradReduceSquareAddOp {t.id}: the scale must be one element, got "
                          f"{list(scale.shape)}")


register(_KIND, _rule, _impl)
COMPILE_CHECKS[_KIND] = _check
grads.NO_GRAD = grads.NO_GRAD | {_KIND}


class GradReduceSquareAddOp:
    """``grad_reduce_square_add_binding.GradReduceSquareAddOp``."""

    @staticmethod
    def createOpInGraph(graph, inputs, outputs, settings):  # noqa: N802
        """Returns: the created op (``outTensor(0)``: the float32 scalar)."""
        return create(graph, _KIND, inputs, outputs, {})
