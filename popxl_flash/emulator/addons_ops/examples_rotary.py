"""The ``RotaryPosEmbedOp`` that Graphcore's examples ship with their Dolly and Llama PopXL
models (``nlp/{dolly,llama}/popxl/modelling/rotary_pos_embed/rotary_pos_embed{,x}.cpp``,
sdk-release-3.4; the two copies are identical). Its files, binding and Python builder have
popxl-addons' names, and its ``setup`` and grad op are popxl-addons', but its forward Opx
rotates the two contiguous halves of the rotated features ("rotate half", the layout of
Hugging Face's GPT-NeoX and Llama) instead of interleaved pairs:

* inputs ``x [batch, seq, heads, hh]``, ``sin``, ``cos`` ``[1 or batch, seq, rotary_dim / 2]``;
  attribute ``rotary_dim`` (even; ranks 4 and 3), as popxl-addons' op;
* forward (``rotateTensor``): of the first ``rotary_dim`` features (all of them when
  ``rotary_dim`` is not less than ``hh``: the Opx slices only then), ``x1`` the first half,
  ``x2`` the second, ``y1 = x1 cos - x2 sin``, ``y2 = x2 cos + x1 sin``, ``[y1, y2]``; the
  other features pass through;
* grad op (``RotaryPosEmbedGradOpx``, ``rotateGradTensor``, unchanged from popxl-addons): the
  incoming gradient's first ``rotary_dim`` features taken as interleaved (real, imaginary)
  pairs and rotated by the opposite angle. That is the transpose of popxl-addons' interleaved
  forward, not of this op's: the C++ grad op computes it, so the model does (the examples use
  the op for inference only);
* Poplar lowering: ``popops::map`` broadcasts the tables (expanded with a heads axis) against
  the halves; a table shape that does not broadcast to the halves' shape, or a table dtype
  other than ``x``'s, fails there (raised when the Session compiles).

The cppimport stand-in gives this model only for these exact sources (see
:func:`popxl_flash.emulator.addons_ops.binding`).
"""
import numpy as np

from ..registry import COMPILE_CHECKS, register
from .rotary import _rule, check_lowering, op_class, rotate

_KIND, _GRAD = "examples_rotary_pos_embed", "examples_rotary_pos_embed_grad"


def rotate_half(x, sin, cos, rotary_dim):
    """The forward on arrays. Returns: array like ``x``."""
    x = np.asarray(x)
    part = x if rotary_dim >= x.shape[3] else x[..., :rotary_dim]
    h = part.shape[3] // 2
    x1, x2 = part[..., :h], part[..., h:2 * h]
    s = np.asarray(sin)[:, :, None, :]  # [b|1, seq, 1 (heads), rotary_dim / 2]
    c = np.asarray(cos)[:, :, None, :]
    out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=3).astype(x.dtype)
    return np.concatenate([out, x[..., part.shape[3]:]], axis=3)


def _grad_rotate(dy, sin, cos, rotary_dim):
    return rotate(dy, sin, cos, min(rotary_dim, np.shape(dy)[3]), -1.0)


register(_KIND, _rule, rotate_half)
register(_GRAD, _rule, _grad_rotate)
COMPILE_CHECKS[_KIND] = COMPILE_CHECKS[_GRAD] = check_lowering


RotaryPosEmbedOp = op_class(_KIND, _GRAD, "``rotary_pos_embed_binding.RotaryPosEmbedOp`` of "
                            "Graphcore's Dolly and Llama examples.")
