"""Neural-network ops: gelu (popnn's tanh approximation) and group_norm / layer_norm.

PopART semantics: ``gelu(x) = 0.5 x (1 + tanh(0.7978845608 (x + 0.044715 x^3)))``.
``group_norm(t, weight, bias, num_groups, eps)`` treats axis 0 as the batch and axis 1 as the
channels; each (batch row, channel group) is normalised over its channels and all remaining
axes with the biased variance, then scaled and shifted per channel. It has three outputs, as
PopART's GroupNormOp: the result, and the hidden ``mean`` and ``inv_std_dev`` (``[N * groups]``),
which autodiff reads. ``layer_norm`` is ``group_norm`` with one group, so a per-token layer norm
needs a 2-D ``[tokens, hidden]`` input.

float16 inputs compute in float32 and round once (as the other float16 reductions here). The
gradient kernels (``gelu_grad``, ``group_norm_grad``) are op kinds only autodiff emits.
"""
import numpy as np

from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
from ._common import F32, FLOATS, require, scalar_value

_GELU_C = 0.7978845608028654  # sqrt(2 / pi)
_GELU_A = 0.044715


def _gelu(a):
    x = a.astype(F32, copy=False)
    return (0.5 * x * (1.0 + np.tanh(F32(_GELU_C) * (x + F32(_GELU_A) * x * x * x)))).astype(
        a.dtype, copy=False)


def _gelu_(a):
    a[...] = _gelu(a)
    return a


def _gelu_grad(dy, a):
    x = a.astype(F32, copy=False)
    u = F32(_GELU_C) * (x + F32(_GELU_A) * x * x * x)
    th = np.tanh(u)
    du = F32(_GELU_C) * (1.0 + F32(3 * _GELU_A) * x * x)
    d = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du
    return (dy.astype(F32, copy=False) * d).astype(a.dtype, copy=False)


def _gelu_rule(kind):
    def rule(t):
        require(kind, t, FLOATS)
        return [(t.shape, t.dtype)]
    return rule


def _activation(kind, impl, impl_, grad, doc):
    """Register ``kind``, its in-place form ``kind_`` and ``kind_grad`` (float tensors).
    Returns: the two public builders ``(kind, kind_)``."""
    register(kind, _gelu_rule(kind), impl)
    register(kind + "_", _gelu_rule(kind + "_"), impl_, alias="modify")
    register(kind + "_grad", lambda dy, t: [(t.shape, t.dtype)], grad)

    def build(t):
        return emit(kind, {"t": t})[0]

    def build_(t):
        return emit(kind + "_", {"t": t})[0]
    build.__name__, build_.__name__ = kind, kind + "_"
    build.__doc__ = f"{doc} Args: t: float tensor. Returns: Tensor."
    build_.__doc__ = f"In-place {kind}. Returns: a tensor aliasing t."
    return build, build_


gelu, gelu_ = _activation("gelu", _gelu, _gelu_, _gelu_grad,
                          "GELU, tanh approximation (popnn).")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _swish(a):
    """``x * sigmoid(x)`` (PopART SwishOp, ``popops::NonLinearityType::SWISH``), in float32."""
    x = a.astype(np.float32)
    return (x * _sigmoid(x)).astype(a.dtype)


def _swish_(a):
    a[...] = _swish(a)
    return a


def _swish_grad(dy, t):
    """SwishGradOp: ``dy * (s + x s (1 - s))`` with ``s = sigmoid(x)``."""
    x = t.astype(np.float32)
    s = _sigmoid(x)
    return (dy.astype(np.float32) * (s + x * s * (1 - s))).astype(t.dtype)


swish, swish_ = _activation("swish", _swish, _swish_, _swish_grad, "Swish ``x * sigmoid(x)``.")


def _group_norm_rule(t, weight, bias, num_groups, eps):
    """``GroupNormOp::setup`` (``willow/src/op/groupnorm.cpp``) only reads ``dim(0)`` (an IR
    error for a scalar); the other requirements are the lowering's (``_check_group_norm``)."""
    require("group_norm", t, FLOATS)
    if t.rank < 1:
        raise PopartError(f"group_norm: Invalid input dimension 0, tensor of rank 0 ({t.id})")
    stats = ((t.shape[0] * num_groups,), t.dtype)
    return [(t.shape, t.dtype), stats, stats]


def _check_group_norm(op):
    """At Session(): what PopLibs' group norm needs (channels on axis 1, one weight and bias
    value per channel in the input's dtype, groups dividing the channels)."""
    t, weight, bias = op.inputs
    num_groups = op.attrs["num_groups"]
    if t.rank < 2:
        raise PopartError(f"group_norm: input {t.id} must have rank >= 2 (axis 0 batch, axis 1 "
                          f"channels), got shape {t.shape}")
    channels = t.shape[1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p.shape != (channels,) or p.dtype != t.dtype:
            raise PopartError(f"group_norm: {name} {p.id} must be {t.dtype.name}[{channels}] "
                              f"(one value per channel, axis 1 of {t.shape}), got "
                              f"{p.dtype.name}{list(p.shape)}")
    if num_groups < 1 or channels % num_groups:
        raise PopartError(f"group_norm: num_groups={num_groups} must divide the {channels} "
                          "channels")


def _grouped(a, num_groups):
    """``[N, C, ...] -> [N * groups, C / groups * prod(...)]`` float32."""
    return a.astype(F32, copy=False).reshape(a.shape[0] * num_groups, -1)


def _per_channel(p, shape, num_groups):
    """Broadcast a ``[C]`` parameter to the grouped layout of ``shape``."""
    full = np.broadcast_to(p.astype(F32).reshape((1, shape[1]) + (1,) * (len(shape) - 2)),
                           shape)
    return full.reshape(shape[0] * num_groups, -1)


def _group_norm(a, weight, bias, num_groups, eps):
    x = _grouped(a, num_groups)
    mean = x.mean(axis=1)
    inv_std = 1.0 / np.sqrt(((x - mean[:, None]) ** 2).mean(axis=1) + F32(eps))
    y = (x - mean[:, None]) * inv_std[:, None]
    y = y * _per_channel(weight, a.shape, num_groups) + _per_channel(bias, a.shape, num_groups)
    dt = a.dtype
    return y.reshape(a.shape).astype(dt), mean.astype(dt), inv_std.astype(dt)


def _group_norm_grad_rule(dy, t, weight, mean, inv_std, num_groups):
    return [(t.shape, t.dtype), (weight.shape, weight.dtype), (weight.shape, weight.dtype)]


def _channel_sum(v, shape):
    """Sum a grouped-layout array back to ``[C]`` (over batch and trailing axes)."""
    axes = (0,) + tuple(range(2, len(shape)))
    return v.reshape(shape).sum(axis=axes)


def _group_norm_grad(dy, a, weight, mean, inv_std, num_groups):
    x, g = _grouped(a, num_groups), _grouped(dy, num_groups)
    xhat = (x - mean.astype(F32)[:, None]) * inv_std.astype(F32)[:, None]
    gw = g * _per_channel(weight, a.shape, num_groups)  # dL/dxhat
    dx = inv_std.astype(F32)[:, None] * (gw - gw.mean(axis=1, keepdims=True)
                                         - xhat * (gw * xhat).mean(axis=1, keepdims=True))
    dweight = _channel_sum(g * xhat, a.shape)
    dbias = _channel_sum(g, a.shape)
    dt = a.dtype
    return dx.reshape(a.shape).astype(dt), dweight.astype(dt), dbias.astype(dt)


register("group_norm", _group_norm_rule, _group_norm, multi=True)
COMPILE_CHECKS["group_norm"] = _check_group_norm
register("group_norm_grad", _group_norm_grad_rule, _group_norm_grad, multi=True)


def group_norm(t, weight, bias, num_groups, eps=1e-5):
    """Group normalisation (PopART GroupNormOp, see the module docstring).

    Args:
        t: ``[N, C, ...]`` float tensor. weight, bias: ``[C]``, t's dtype.
        num_groups: int dividing C. eps: variance epsilon.
    Returns:
        The normalised tensor (t's shape and dtype).
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)):
        raise TypeError(f"group_norm: `num_groups` must be an int, got {num_groups!r}")
    eps = scalar_value("group_norm", "eps", eps)
    return emit("group_norm", {"t": t, "weight": weight, "bias": bias},
                {"num_groups": int(num_groups), "eps": eps},
                names=["group_norm_out", "group_norm_mean", "group_norm_inv_std_dev"])[0]


def layer_norm(t, weight, bias, eps=1e-5):
    """``group_norm(t, weight, bias, num_groups=1, eps)``: each row of axis 0 is normalised
    over all other axes; weight and bias are per channel (axis 1). Use a 2-D
    ``[tokens, hidden]`` input for a per-token layer norm.

    Returns:
        The normalised tensor.
    """
    return group_norm(t, weight, bias, num_groups=1, eps=eps)
