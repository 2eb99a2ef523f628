"""popxl-addons' ``RotaryPosEmbedOp`` (``ops/rotary_pos_embed/rotary_pos_embed{,x}.cpp``).

Inputs ``x [batch, seq, heads, hh]``, ``sin``, ``cos`` ``[1 or batch, seq, rotary_dim / 2]``;
attribute ``rotary_dim`` (even: the constructor and ``setup`` refuse odd values; ``setup``
refuses ranks other than 4 and 3). The first ``rotary_dim`` features are taken as interleaved
(real, imaginary) pairs and rotated by the angle whose sine and cosine the tables hold for
that sequence position: ``y_re = x_re cos - x_im sin``, ``y_im = x_im cos + x_re sin``; the
other features pass through. The grad op (``RotaryPosEmbedGradOp``, reading the tables) rotates
the incoming gradient by the opposite angle. When the Session compiles, the Opx's slicing and
``popops::map`` refuse (:func:`check_lowering`) an odd number of features to rotate, tables
that do not broadcast to the rotated pairs and tables of a dtype other than ``x``'s.
"""
import numpy as np

from .. import grads
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
from ._binding import create

_KIND, _GRAD = "addons_rotary_pos_embed", "addons_rotary_pos_embed_grad"


def _rule(x, sin, cos, rotary_dim):
    if x.rank != 4:
        raise PopartError("RotaryPosEmbedOp::setup x should have rank 4 (batch, heads, seq, hh)")
    if sin.rank != 3 or cos.rank != 3:
        raise PopartError("RotaryPosEmbedOp::setup trig functions should have rank 3 "
                          "(1 or batch, seq, hh/2)")
    if rotary_dim % 2:
        raise PopartError("RotaryPosEmbedOp::setup rotary dim must be a multiple of 2")
    return [(x.shape, x.dtype)]


def rotate(x, sin, cos, rotary_dim, sign=1.0):
    """The rotation on arrays (``sign`` -1: the grad op's opposite angle). Returns: array like
    ``x``."""
    x = np.asarray(x)
    part = x[..., :rotary_dim]
    pairs = part.reshape(*part.shape[:-1], rotary_dim // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    s = (sign * np.asarray(sin))[:, :, None, :]  # [b|1, seq, 1 (heads), rotary_dim / 2]
    c = np.asarray(cos)[:, :, None, :]
    out = np.stack([re * c - im * s, im * c + re * s], axis=-1).astype(x.dtype)
    return np.concatenate([out.reshape(part.shape), x[..., rotary_dim:]], axis=-1)


def check_lowering(op):
    """What Poplar refuses when either Opx (this op's or popxl-addons', whose grow has the
    same slicing and ``popops::map`` calls) grows: an odd number of features to rotate (all
    ``hh`` of them when ``rotary_dim >= hh``), tables that do not broadcast to the rotated
    halves or pairs ``[b, seq, heads, rotary_dim / 2]``, tables of a dtype other than ``x``'s."""
    x, sin, cos = op.inputs
    part = x.shape[3] if op.attrs["rotary_dim"] >= x.shape[3] else op.attrs["rotary_dim"]
    if part % 2:
        raise PopartError(f"{op.kind}: an odd number ({part}) of features to rotate: they "
                          "do not split into halves or pairs (Poplar lowering)")
    half = (*x.shape[:3], part // 2)
    for name, t in (("sin", sin), ("cos", cos)):
        if t.dtype != x.dtype:
            raise PopartError(f"{op.kind}: {name} is {t.dtype}, x is {x.dtype}: popops::map "
                              "needs operands of one type (Poplar lowering)")
        table = (t.shape[0], t.shape[1], 1, t.shape[2])
        try:
            shape = np.broadcast_shapes(half, table)
        except ValueError:
            shape = None
        if shape != half:
            raise PopartError(f"{op.kind}: {name} of shape {tuple(t.shape)} does not broadcast "
                              f"to the rotated halves {half} (Poplar lowering)")


register(_KIND, _rule, lambda x, sin, cos, rotary_dim: rotate(x, sin, cos, rotary_dim))
register(_GRAD, _rule, lambda dy, sin, cos, rotary_dim: rotate(dy, sin, cos, rotary_dim, -1.0))
COMPILE_CHECKS[_KIND] = COMPILE_CHECKS[_GRAD] = check_lowering


def op_class(kind, grad_kind, doc):
    """A ``RotaryPosEmbedOp`` binding class for the model registered as ``kind`` (its grad op
    ``grad_kind``), with the autodiff rule: the grad op reads the gradient and the forward's
    tables (``In``)."""
    def grad(ctx, i):
        return emit(grad_kind, {"in0": ctx.dy(0), "in1": ctx.x(1), "in2": ctx.x(2)},
                    dict(ctx.op.attrs), names=["t_rotated_grad"])[0]
    grads.RULES[kind] = (lambda op: (0,), grad)

    def create_op_in_graph(graph, inputs, outputs, rotary_dim, settings):
        """Returns: the created op (``outTensor(0)``: the rotated tensor)."""
        if int(rotary_dim) % 2:
            raise PopartError("RotaryPosEmbedOp::RotaryPosEmbedOp rotary_dim must be a "
                              "multiple of 2")
        return create(graph, kind, inputs, outputs, {"rotary_dim": int(rotary_dim)})
    return type("RotaryPosEmbedOp", (), {"__doc__": doc,
                                         "createOpInGraph": staticmethod(create_op_in_graph)})


RotaryPosEmbedOp = op_class(_KIND, _GRAD, "``rotary_pos_embed_binding.RotaryPosEmbedOp``.")
