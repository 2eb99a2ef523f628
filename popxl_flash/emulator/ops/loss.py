"""Negative log likelihood: ``ops.nll_loss`` (NllOp, its grad op NllGradOp) and
``ops.nll_loss_with_softmax_grad`` (NlllWithSoftmaxGradDirectOp), as PopART sdk-release-3.4
computes them (``willow/src/op/nll.cpp``, ``op/softmax.cpp``, ``popx/op/nllx.cpp``,
``popx/op/softmaxx.cpp``).

``probs [..., C]`` are flattened to ``[N, C]`` and the labels to ``[N]``; ``p`` is each row's
probability at its label (one-hot dot product). Loss per row: ``-log(max(p, eps))``
(``eps`` 1e-7 for float32, 6.104e-5 for float16; ``log_prob=True``: ``-p``; the fused op:
``-log(p + 1e-7)``), rows whose label is ``ignore_index`` masked to 0; ``"none"`` keeps the
rows (label shape), ``"sum"`` sums them, ``"mean"`` divides the sum by N (with an ignore index:
by the number of kept rows, at least 1). Gradients (dx of the fused op: ``probs - onehot``;
NllGradOp: ``-onehot / max(p, 1e-10 or 6.104e-5)``, or ``-onehot`` for log-probabilities),
masked, times the incoming loss gradient, and for ``"mean"`` divided by ``probs.shape[0]``
without an ignore index (the lowering scales the gradient reshaped to probs' shape, so for
probs of rank > 2 that is the leading dimension, not N) or by the kept rows with one.
A label outside ``[0, C)`` that is not the ignore index raises IndexError when the op runs
(one-hot encoding of it is unspecified; the choosing mode of ``unspecified.py`` treats the row
as ignored).
"""
import numpy as np

from .. import dtypes, unspecified
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
from ..tensor import Tensor, constant
from ._common import F32, FLOATS

_REDUCTIONS = ("mean", "sum", "none")


def _reduction(reduction):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


def _check_labels(kind, probs, labels):
    """NllOp::setup: labels have all but the last dimension of probs, an integer type."""
    if probs.rank == 0:
        raise PopartError(f"Invalid shape for prob tensor ({probs.shape}) in Op {kind}.")
    if labels.shape != probs.shape[:-1]:
        raise PopartError(f"The label tensor ({labels.shape}) must have shape "
                          f"{probs.shape[:-1]} to match all but the final dimension of the "
                          f"probabilities tensor ({probs.shape}) in Op {kind}.")
    if labels.dtype not in (dtypes.int32, dtypes.uint32):
        raise PopartError(f"Expected the label tensor of {kind} to be an integer data type, "
                          f"not {labels.dtype.name}.")
    if probs.dtype not in FLOATS:
        raise NotImplementedError(f"{kind} of {probs.dtype.name} probabilities")


def _loss_shape(labels, reduction):
    return labels.shape if reduction == "none" else ()


def _rows(probs, labels, ignore_index):
    """``(probs [N, C] float32, one-hot [N, C], kept mask [N])``; raises IndexError for a
    label out of range that is not ignored."""
    p2 = probs.reshape(-1, probs.shape[-1]).astype(F32)
    lab = labels.reshape(-1).astype(np.int64)
    keep = np.ones(lab.shape, bool) if ignore_index is None else lab != ignore_index
    bad = keep & ((lab < 0) | (lab >= p2.shape[1]))
    if bad.any():
        unspecified.occurred("nll_label_out_of_range", IndexError(
            f"nll: label {int(lab[bad][0])} outside [0, {p2.shape[1]}) (one-hot encoding "
            "unspecified on the device)"))
        keep = keep & ~bad
    onehot = np.zeros_like(p2)
    rows = np.nonzero(keep)[0]
    onehot[rows, lab[rows]] = 1.0
    return p2, onehot, keep


def _reduce_loss(per_row, keep, labels, reduction, dtype, has_ignore):
    per_row = np.where(keep, per_row, F32(0))
    if reduction == "none":
        return (-per_row).reshape(labels.shape).astype(dtype)
    total = -per_row.sum(dtype=F32)
    if reduction == "mean":
        total = total / (F32(max(int(keep.sum()), 1)) if has_ignore else F32(keep.size))
    return np.asarray(total, dtype)


def _mean_divisor(probs_shape, keep, has_ignore):
    return F32(max(int(keep.sum()), 1)) if has_ignore else F32(probs_shape[0])


def _scale_grad(g, keep, loss_grad, probs, reduction, has_ignore):
    g = np.where(keep[:, None], g, F32(0)).reshape(probs.shape)
    scale = np.asarray(loss_grad, F32)
    scale = scale.reshape(scale.shape + (1,) * (g.ndim - scale.ndim))
    if reduction == "mean":
        scale = scale / _mean_divisor(probs.shape, keep, has_ignore)
    return (g * scale).astype(probs.dtype)


# -- nll_loss ------------------------------------------------------------------------------------
def _nll_rule(probs, labels, ignore_index, reduction, log_prob):
    _check_labels("Nll", probs, labels)
    return [(_loss_shape(labels, reduction), probs.dtype)]


def _nll(probs, labels, ignore_index, reduction, log_prob):
    p2, onehot, keep = _rows(probs, labels, ignore_index)
    picked = (onehot * p2).sum(axis=1)
    eps = F32(6.104e-05 if probs.dtype == np.float16 else 1e-7)
    per_row = picked if log_prob else np.log(np.maximum(picked, eps))
    return _reduce_loss(per_row, keep, labels, reduction, probs.dtype, ignore_index is not None)


def _nll_grad_rule(dy, probs, labels, ignore_index, reduction, log_prob):
    return [(probs.shape, probs.dtype)]


def _nll_grad(dy, probs, labels, ignore_index, reduction, log_prob):
    p2, onehot, keep = _rows(probs, labels, ignore_index)
    eps = F32(6.104e-05 if probs.dtype == np.float16 else 1e-10)
    g = -onehot if log_prob else -onehot / np.maximum(p2, eps)
    return _scale_grad(g, keep, dy, probs, reduction, ignore_index is not None)


register("nll_loss", _nll_rule, _nll)
register("nll_grad", _nll_grad_rule, _nll_grad)


def _ignore(ignore_index):
    if ignore_index is None:
        return None
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
    return int(ignore_index)


def nll_loss(probs, labels, ignore_index=None, reduction="mean", log_prob=False):
    """Negative log likelihood of ``probs`` (e.g. a softmax output) at ``labels``.

    Args:
        probs: float Tensor ``[..., C]``. labels: int Tensor ``[...]``.
        ignore_index: label value that contributes nothing. reduction: "mean", "sum", "none".
        log_prob: ``probs`` are log-probabilities.
    Returns:
        The loss (scalar, or the labels' shape for "none").
    """
    return emit("nll_loss", {"probs": probs, "labels": labels},
                {"ignore_index": _ignore(ignore_index), "reduction": _reduction(reduction),
                 "log_prob": bool(log_prob)}, names=["loss"])[0]


# -- nll_loss_with_softmax_grad ------------------------------------------------------------------
def _direct_rule(probs, labels, loss_grad, ignore_index, reduction):
    return [(_loss_shape(labels, reduction), probs.dtype), (probs.shape, probs.dtype)]


def _direct(probs, labels, loss_grad, ignore_index, reduction):
    p2, onehot, keep = _rows(probs, labels, ignore_index)
    dx = _scale_grad(p2 - onehot, keep, loss_grad, probs, reduction, ignore_index is not None)
    per_row = np.log((onehot * p2).sum(axis=1) + F32(1e-7))
    loss = _reduce_loss(per_row, keep, labels, reduction, probs.dtype, ignore_index is not None)
    return loss, dx


def _check_direct(op):
    """NlllWithSoftmaxGradDirectOp::setup does not check the labels; the lowering flattens
    them (``label.flatten()``) for the one-hot encoding of the flattened probs rows, so they
    need one integer per row, in any shape."""
    probs, labels = op.inputs[0], op.inputs[1]
    rows = probs.nelms // probs.shape[-1] if probs.rank and probs.shape[-1] else 0
    if probs.rank == 0 or labels.nelms != rows:
        raise PopartError(f"NlllWithSoftmaxGradDirect: {labels.nelms} labels {labels.shape} for "
                          f"{rows} rows of probs {probs.shape}")
    if labels.dtype not in (dtypes.int32, dtypes.uint32):
        raise PopartError(f"NlllWithSoftmaxGradDirect: labels must be integers, not "
                          f"{labels.dtype.name}")


register("nll_loss_with_softmax_grad", _direct_rule, _direct, multi=True)


def nll_loss_with_softmax_grad(probs, labels, loss_grad=1, ignore_index=None, reduction="mean"):
    """The loss of :func:`nll_loss` with ``probs = softmax(x)`` and its gradient ``dE/dx``.

    Args:
        probs: softmax output ``[..., C]``. labels: int ``[...]``. loss_grad: ``dE/dl`` (float
            or Tensor; a float becomes a float32 constant). ignore_index, reduction: as
            :func:`nll_loss`.
    Returns:
        ``(loss, dx)``.
    """
    if not isinstance(loss_grad, Tensor):
        loss_grad = constant(loss_grad, dtypes.float32)
    loss, dx = emit("nll_loss_with_softmax_grad",
                    {"probs": probs, "labels": labels, "loss_grad": loss_grad},
                    {"ignore_index": _ignore(ignore_index), "reduction": _reduction(reduction)},
                    names=["loss", "dx"])
    return loss, dx


COMPILE_CHECKS["nll_loss_with_softmax_grad"] = _check_direct
