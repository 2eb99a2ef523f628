"""In-place variable updates (``ops.var_updates``): accumulators and copies.

Float tensors update in float32 and round once to ``t``'s dtype; integer tensors (counters)
update in their own dtype.
"""
import numpy as np

from ..errors import PopartError
from ..registry import emit, register
from ..tensor import Tensor
from ..unsupported import stub
from ._common import F32, FLOATS, NUMERIC, require, scalar_value


def _rule(kind):
    def rule(t, *rest, **attrs):
        require(kind, t, NUMERIC)
        x = rest[0] if rest and kind not in ("accumulator_scale_",) else None
        if x is not None and x.shape != t.shape:
            raise PopartError(f"{kind}: {t.id} {t.shape} and {x.id} {x.shape} must have the same "
                              "shape (no broadcasting)")
        for s in rest[1 if x is not None else 0:]:
            if s.nelms != 1:
                raise PopartError(f"{kind}: factor tensor {s.id} must have one element")
        if t.dtype not in FLOATS and (kind not in ("accumulate_", "copy_var_update_",
                                                   "accumulator_zero_")
                                         or attrs.get("f", False) is not False):
            raise NotImplementedError(f"{kind} on {t.dtype.name} with a factor is not supported "
                                      "by the emulator")
        return [(t.shape, t.dtype)]
    return rule


def _factor(value, scales):
    return F32(value) if value is not None else F32(scales[0].reshape(()))


def _write(t, value):
    t[...] = value
    return t


def _accumulate(t, x, *s, f):
    if t.dtype.kind != "f":
        np.add(t, x.astype(t.dtype, copy=False), out=t)
        return t
    if f is False:
        return _write(t, t.astype(F32) + x.astype(F32))
    return _write(t, t.astype(F32) + _factor(f, s) * x.astype(F32))


def _accumulate_square(t, x, *s, f):
    return _write(t, t.astype(F32) + _factor(f, s) * np.square(x.astype(F32)))


def _accumulate_mean(t, x, *s, f):
    step = _factor(f, s)
    return _write(t, step / (step + 1) * t.astype(F32) + x.astype(F32) / (step + 1))


def _moving_average(t, x, *s, f):
    fac = _factor(f, s)
    return _write(t, fac * t.astype(F32) + (1 - fac) * x.astype(F32))


def _scale(t, *s, f):
    return _write(t, t.astype(F32) * _factor(f, s))


def _zero(t):
    t[...] = 0
    return t


def _copy(t, x):
    t[...] = x
    return t


_TABLE = {"accumulate_": _accumulate, "accumulate_square_": _accumulate_square,
          "accumulate_mean_": _accumulate_mean,
          "accumulate_moving_average_": _moving_average, "accumulator_scale_": _scale,
          "accumulator_zero_": _zero, "copy_var_update_": _copy}
for _kind, _impl in _TABLE.items():
    register(_kind, _rule(_kind), _impl, alias="modify")


def _emit(kind, t, X=None, f=False, fname="f"):  # noqa: N803
    tensors = {"t": t}
    if X is not None:
        tensors["X"] = X
    attrs = {}
    if f is not False:
        if isinstance(f, Tensor):
            tensors[fname] = f
            attrs["f"] = None
        elif f is None:
            attrs["f"] = False
        else:
            attrs["f"] = scalar_value(kind, fname, f)
    return emit(kind, tensors, attrs)[0]


def accumulate_(t, X, f=None):  # noqa: N803
    """In place ``t += f * X`` (or ``t += X``). Returns: tensor aliasing t."""
    return _emit("accumulate_", t, X, f)


def accumulate_square_(t, X, f=1.0):  # noqa: N803
    """In place ``t += f * X**2``. Returns: tensor aliasing t."""
    return _emit("accumulate_square_", t, X, f)


def accumulate_mean_(t, X, step):  # noqa: N803
    """In place ``t = step/(step+1) * t + X/(step+1)``. Returns: tensor aliasing t."""
    return _emit("accumulate_mean_", t, X, step, "step")


def accumulate_moving_average_(t, X, f):  # noqa: N803
    """In place ``t = f * t + (1 - f) * X``. Returns: tensor aliasing t."""
    return _emit("accumulate_moving_average_", t, X, f)


def accumulator_scale_(t, f):
    """In place ``t *= f``. Returns: tensor aliasing t."""
    return _emit("accumulator_scale_", t, None, f)


def accumulator_zero_(t):
    """In place ``t = 0``. Returns: tensor aliasing t."""
    return emit("accumulator_zero_", {"t": t})[0]


def copy_var_update_(t, X):  # noqa: N803
    """In place ``t = X`` (same shape). Returns: tensor aliasing t."""
    return emit("copy_var_update_", {"t": t, "X": X})[0]


for _name in ("sparse_accumulate_", "adam_updater", "lamb_updater", "adamax_updater",
              "adam_var_update", "accumulate_moving_average_square_"):
    globals()[_name] = stub(f"popxl.ops.var_updates.{_name}")
