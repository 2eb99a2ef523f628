"""Elementwise ops: binary arithmetic, unary math, comparison, logic, where, maximum, cast."""
import numpy as np

from .. import dtypes
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, emit, register
from ..tensor import Tensor, constant
from ._common import FLOATS, INTS, NUMERIC, broadcast, require, same_dtype


# -- binary arithmetic ---------------------------------------------------------------------
def _binary_rule(kind):
    def rule(a, b):
        dt = same_dtype(kind, a, b)
        require(kind, a, NUMERIC)
        return [(broadcast(kind, a, b), dt)]
    return rule


def _check_inplace_lhs(op):
    # AddLhsInplaceOp's setup gives the broadcast shape (ElementWiseBinaryBaseOp::setup); the
    # in-place lowering writes into lhs (popx/op/elementwisex.cpp), which must already have it.
    a, shape = op.inputs[0], op.outputs[0].shape
    if shape != a.shape:
        raise PopartError(f"{op.kind}: in-place lhs {a.id} has shape {a.shape} but the "
                          f"broadcast result has shape {shape}")


def _is_f32_scalar(t):
    return t.dtype == dtypes.float32 and t.nelms == 1


def _mul_rule(a, b):
    mixed = (a.dtype != b.dtype and (_is_f32_scalar(a) or a.dtype == dtypes.float16)
             and (_is_f32_scalar(b) or b.dtype == dtypes.float16))
    if mixed:
        return [(broadcast("mul", a, b), dtypes.float16)]
    return _binary_rule("mul")(a, b)


def _mul(a, b):
    if a.dtype != b.dtype:  # float16 x one-element float32: the scalar is cast to float16
        return np.multiply(a.astype(np.float16), b.astype(np.float16))
    return np.multiply(a, b)


def _div(a, b):
    if a.dtype.kind == "f":
        return np.divide(a, b)
    q = np.floor_divide(a, b)
    if a.dtype.kind == "i":  # C division truncates toward zero
        q = q + ((np.fmod(a, b) != 0) & ((a < 0) != (b < 0))).astype(a.dtype)
    return q


def _pow_rule(a, b):
    dt = same_dtype("pow", a, b)
    require("pow", a, NUMERIC)
    return [(broadcast("pow", a, b), dt)]


def _pow(a, e):
    if a.dtype.kind != "f" and (e < 0).any():
        raise ValueError("pow: negative integer exponents are unspecified on the device")
    return np.power(a, e)


def _add_(a, b):
    np.add(a, b, out=a)
    return a


register("add", _binary_rule("add"), np.add)
register("add_", _binary_rule("add"), _add_, alias="modify")
COMPILE_CHECKS["add_"] = _check_inplace_lhs
register("sub", _binary_rule("sub"), np.subtract)
register("mul", _mul_rule, _mul)
register("div", _binary_rule("div"), _div)
register("fmod", _binary_rule("fmod"), np.fmod)
register("pow", _pow_rule, _pow)


def _check2(lhs, rhs):
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if not isinstance(t, Tensor):
            raise TypeError(f"The input `{name}` is not a Tensor. Type: {type(t)}. Value: {t}.")


def add(lhs, rhs):
    """Args: lhs, rhs: tensors of one dtype (numpy broadcasting). Returns: lhs + rhs."""
    return emit("add", {"lhs": lhs, "rhs": rhs})[0]


def add_(lhs, rhs):
    """In place ``lhs += rhs``. Returns: a tensor aliasing the modified lhs."""
    return emit("add_", {"lhs": lhs, "rhs": rhs})[0]


def sub(lhs, rhs):
    """Args: lhs, rhs: tensors of one dtype. Returns: lhs - rhs."""
    return emit("sub", {"lhs": lhs, "rhs": rhs})[0]


def mul(lhs, rhs):
    """Args: lhs, rhs: one dtype, or float16 with a one-element float32. Returns: lhs * rhs."""
    return emit("mul", {"lhs": lhs, "rhs": rhs})[0]


def div(lhs, rhs):
    """Args: lhs, rhs: one dtype. Returns: lhs / rhs (integers: C division, truncating)."""
    return emit("div", {"lhs": lhs, "rhs": rhs})[0]


def fmod(lhs, rhs):
    """Args: lhs, rhs: one dtype. Returns: C fmod (sign of the dividend)."""
    return emit("fmod", {"lhs": lhs, "rhs": rhs})[0]


def pow(t, e):  # noqa: A001 - PopXL name
    """Args: t: tensor. e: tensor or scalar (constant with inferred dtype). Returns: t ** e."""
    if not isinstance(e, Tensor):
        e = constant(e)
    return emit("pow", {"t": t, "e": e})[0]


# -- unary -----------------------------------------------------------------------------------
def _unary_rule(kind, allowed, out_dtype=None):
    def rule(t):
        require(kind, t, allowed)
        return [(t.shape, out_dtype or t.dtype)]
    return rule


def _inplace_unary(fn):
    def impl(a):
        fn(a, out=a)
        return a
    return impl


def _relu(a):
    return np.maximum(a, np.zeros((), a.dtype))


def _relu_(a):
    np.maximum(a, np.zeros((), a.dtype), out=a)
    return a


SIGNED = FLOATS | {dtypes.int32}
_UNARY = {
    # kind: (impl, allowed dtypes, output dtype)
    "exp": (np.exp, FLOATS, None), "log": (np.log, FLOATS, None),
    "log2": (np.log2, FLOATS, None), "sqrt": (np.sqrt, FLOATS, None),
    "tanh": (np.tanh, FLOATS, None), "sin": (np.sin, FLOATS, None),
    "cos": (np.cos, FLOATS, None), "floor": (np.floor, FLOATS, None),
    "ceil": (np.ceil, FLOATS, None), "relu": (_relu, FLOATS, None),
    "negate": (np.negative, SIGNED, None), "abs": (np.abs, SIGNED, None),
    "sign": (np.sign, SIGNED, None),
    "isnan": (np.isnan, FLOATS, dtypes.bool), "isinf": (np.isinf, FLOATS, dtypes.bool),
    "isfinite": (np.isfinite, FLOATS, dtypes.bool),
}
for _kind, (_impl, _allowed, _out) in _UNARY.items():
    register(_kind, _unary_rule(_kind, _allowed, _out), _impl)
register("exp_", _unary_rule("exp_", FLOATS), _inplace_unary(np.exp), alias="modify")
register("relu_", _unary_rule("relu_", FLOATS), _relu_, alias="modify")


def _unary_op(kind):
    def op(t):
        return emit(kind, {"t": t})[0]
    op.__name__ = kind
    op.__doc__ = f"Elementwise ``{kind}``.\n\nArgs:\n    t: Tensor.\nReturns:\n    Tensor."
    return op


exp, log, log2, sqrt, tanh, sin, cos = map(_unary_op, ("exp", "log", "log2", "sqrt", "tanh",
                                                        "sin", "cos"))
floor, ceil, relu, negate, abs, sign = map(_unary_op, ("floor", "ceil", "relu", "negate",  # noqa
                                                        "abs", "sign"))
isnan, isinf, isfinite, exp_, relu_ = map(_unary_op, ("isnan", "isinf", "isfinite", "exp_",
                                                      "relu_"))


# -- comparison / logic / selection ----------------------------------------------------------
def _compare_rule(kind):
    def rule(a, b):
        # BinaryComparisonOp::setup (willow/src/op/elementwise.cpp) broadcasts the shapes only
        return [(broadcast(kind, a, b), dtypes.bool)]
    return rule


def _check_compare_dtypes(op):
    same_dtype(f"{op.kind} (Poplar lowering)", *op.inputs)


def _logic_rule(kind):
    def rule(*ts):
        for t in ts:
            if t.dtype != dtypes.bool:
                raise PopartError(f"{kind}: input {t.id} must be bool")
        return [(broadcast(kind, *ts), dtypes.bool)]
    return rule


register("greater", _compare_rule("greater"), np.greater)
register("equal", _compare_rule("equal"), np.equal)
COMPILE_CHECKS["greater"] = COMPILE_CHECKS["equal"] = _check_compare_dtypes
register("logical_and", _logic_rule("logical_and"), np.logical_and)
register("logical_or", _logic_rule("logical_or"), np.logical_or)
register("logical_not", _logic_rule("logical_not"), np.logical_not)


def greater(input, other):  # noqa: A002 - PopXL name
    """Returns: bool tensor ``input > other`` (broadcast, equal dtypes)."""
    return emit("greater", {"input": input, "other": other})[0]


def equal(lhs, rhs):
    """Returns: bool tensor ``lhs == rhs`` (broadcast, equal dtypes)."""
    return emit("equal", {"lhs": lhs, "rhs": rhs})[0]


def _to_bool(name, t):
    if not isinstance(t, Tensor):
        raise TypeError(f"The input `{name}` is not a Tensor. Type: {type(t)}. Value: {t}.")
    return t if t.dtype == dtypes.bool else cast(t, dtypes.bool)


def logical_and(lhs, rhs):
    """Returns: ``lhs and rhs`` (inputs cast to bool if needed)."""
    _check2(lhs, rhs)
    return emit("logical_and", {"lhs": _to_bool("lhs", lhs), "rhs": _to_bool("rhs", rhs)})[0]


def logical_or(lhs, rhs):
    """Returns: ``lhs or rhs`` (inputs cast to bool if needed)."""
    _check2(lhs, rhs)
    return emit("logical_or", {"lhs": _to_bool("lhs", lhs), "rhs": _to_bool("rhs", rhs)})[0]


def logical_not(t):
    """Returns: ``not t`` (input cast to bool if needed)."""
    return emit("logical_not", {"t": _to_bool("t", t)})[0]


def _where_rule(c, a, b):
    same_dtype("where", a, b)
    return [(broadcast("where", c, a, b), a.dtype)]


register("where", _where_rule, np.where)


def where(condition, lhs, rhs):
    """Args: condition (cast to bool), lhs, rhs (same dtype). Returns: broadcast selection."""
    _check2(lhs, rhs)
    cond = _to_bool("condition", condition)
    return emit("where", {"condition": cond, "lhs": lhs, "rhs": rhs})[0]


def _maximum_rule(*ts):
    if not ts:
        raise PopartError("maximum: needs at least one input")
    for t in ts[1:]:
        if t.shape != ts[0].shape or t.dtype != ts[0].dtype:
            raise PopartError("maximum: all inputs must have identical shape and dtype (ONNX "
                              f"opset-6 Max): {ts[0].id} {ts[0].shape} {ts[0].dtype.name} vs "
                              f"{t.id} {t.shape} {t.dtype.name}")
    require("maximum", ts[0], NUMERIC)
    return [(ts[0].shape, ts[0].dtype)]


def _maximum(*arrays):
    out = arrays[0].copy()
    for a in arrays[1:]:
        np.maximum(out, a, out=out)
    return out


register("maximum", _maximum_rule, _maximum)


def maximum(*ts):
    """Args: ts: tensors of identical shape and dtype. Returns: their elementwise max."""
    return emit("maximum", {f"ts_{i}": t for i, t in enumerate(ts)})[0]


# -- cast ------------------------------------------------------------------------------------
def _cast_rule(t, data_type):
    dtypes.check_device(data_type, "cast")
    return [(t.shape, data_type)]


def _cast(a, data_type):
    return a.astype(data_type.as_numpy())


register("cast", _cast_rule, _cast)


def cast(t, data_type):
    """Args: t: Tensor. data_type: target popxl dtype (float8 -> TypeError). Returns: Tensor."""
    if data_type in dtypes.FLOAT8:
        raise TypeError(f"Data type {data_type} not supported for cast, please consider "
                        "pow2scale_cast_to_fp8 or pow2scale_cast_from_fp8")
    return emit("cast", {"t": t}, {"data_type": data_type})[0]


_ = INTS
