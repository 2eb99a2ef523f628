"""Fused arithmetic: scaled_add(_), increment_mod(_)."""
import numpy as np

from .. import dtypes
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
from ..tensor import Tensor
from ._common import F32, FLOATS, NUMERIC, require, scalar_value


def _scaled_add_rule(x, y, *scales, a, b):
    require("scaled_add", x, FLOATS)
    require("scaled_add", y, FLOATS)
    for s in scales:
        require("scaled_add", s, FLOATS)
    return [(x.shape, x.dtype)]  # ScaledAddOp::setup: the output is X's info, nothing checked


def _check_scaled_add(op):
    # popops::scaledAddTo (willow/src/popx/op/scaledaddx.cpp) needs equal shapes and scalar
    # scale tensors: refused when the Session compiles.
    x, y, *scales = op.inputs
    if x.shape != y.shape:
        raise PopartError(f"{op.kind}: X {x.id} {x.shape} and Y {y.id} {y.shape} must have "
                          "the same shape (no broadcasting in popops::scaledAddTo)")
    for s in scales:
        if s.nelms != 1:
            raise PopartError(f"{op.kind}: scale tensor {s.id} must have one element")
    # ScaledAddOpx::compute: a tensor scale0 needs a tensor scale1; a tensor scale1 needs the
    # float scale0 to be 1 (PopXL sets it to 1.0 when ``a`` is a Tensor).
    a, b = op.attrs["a"], op.attrs["b"]
    if a is None and b is not None:
        raise PopartError(f"{op.kind}: Unsupported tensor scale0 with non-tensor scale1 ({b}).")
    if b is None and a is not None and F32(a) != F32(1.0):
        raise PopartError(f"{op.kind}: Unsupported scale0 {a} with tensor scale1.")


def _scaled_value(x, y, scales, a, b):
    it = iter(scales)
    fa = F32(a) if a is not None else F32(next(it).reshape(()))
    fb = F32(b) if b is not None else F32(next(it).reshape(()))
    if x.dtype == np.float32 and y.dtype == np.float32:
        return fa * x + fb * y
    return fa * x.astype(F32) + fb * y.astype(F32)


def _scaled_add(x, y, *scales, a, b):
    return _scaled_value(x, y, scales, a, b).astype(x.dtype, copy=False)


def _scaled_add_(x, y, *scales, a, b):
    x[...] = _scaled_value(x, y, scales, a, b)
    return x


register("scaled_add", _scaled_add_rule, _scaled_add)
register("scaled_add_", _scaled_add_rule, _scaled_add_, alias="modify")
COMPILE_CHECKS["scaled_add"] = COMPILE_CHECKS["scaled_add_"] = _check_scaled_add


def _scaled(kind, X, Y, a, b):
    tensors, attrs = {"X": X, "Y": Y}, {}
    for name, v in (("a", a), ("b", b)):
        if isinstance(v, Tensor):
            tensors[name] = v
            attrs[name] = None
        else:
            attrs[name] = scalar_value(kind, name, v)
    return emit(kind, tensors, attrs)[0]


def scaled_add(X, Y, a=1.0, b=1.0):  # noqa: N803 - PopXL names
    """Args: X, Y: same-shape float tensors. a, b: floats or one-element tensors.
    Returns: a*X + b*Y in X's dtype."""
    return _scaled("scaled_add", X, Y, a, b)


def scaled_add_(X, Y, a=1.0, b=1.0):  # noqa: N803
    """In place ``X = a*X + b*Y``. Returns: tensor aliasing X."""
    return _scaled("scaled_add_", X, Y, a, b)


def _incmod_rule(t, increment, modulus):
    require("increment_mod", t, NUMERIC)
    return [(t.shape, t.dtype)]  # IncrementModOp::setup checks nothing (op/incrementmod.cpp)


def _check_modulus(op):
    if op.attrs["modulus"] == 0:
        raise PopartError(f"{op.kind}: modulus converted to {op.inputs[0].dtype.name} is 0 "
                          "(remainder by zero is unspecified on the device)")


def _incmod(a, increment, modulus):
    return np.fmod(a + increment, modulus)


def _incmod_(a, increment, modulus):
    np.add(a, increment, out=a)
    np.fmod(a, modulus, out=a)
    return a


register("increment_mod", _incmod_rule, _incmod)
register("increment_mod_", _incmod_rule, _incmod_, alias="modify")
COMPILE_CHECKS["increment_mod"] = COMPILE_CHECKS["increment_mod_"] = _check_modulus


def _incmod_op(kind, t, increment, modulus):
    dt = t.dtype if isinstance(t, Tensor) else dtypes.float32
    npdt = dt.as_numpy()
    inc = np.array(scalar_value(kind, "increment", increment)).astype(npdt)[()]
    mod = np.array(scalar_value(kind, "modulus", modulus)).astype(npdt)[()]
    return emit(kind, {"t": t}, {"increment": inc, "modulus": mod})[0]


def increment_mod(t, increment, modulus):
    """Args: t: tensor. increment, modulus: numbers cast to t's dtype.
    Returns: (t + increment) C-fmod modulus."""
    return _incmod_op("increment_mod", t, increment, modulus)


def increment_mod_(t, increment, modulus):
    """In-place increment_mod. Returns: tensor aliasing t."""
    return _incmod_op("increment_mod_", t, increment, modulus)
