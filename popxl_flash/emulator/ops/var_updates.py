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


def _moving_average_square(t, x, *s, f):
    fac = _factor(f, s)
    return _write(t, fac * t.astype(F32) + (1 - fac) * np.square(x.astype(F32)))


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
          "accumulate_moving_average_": _moving_average,
          "accumulate_moving_average_square_": _moving_average_square,
          "accumulator_scale_": _scale,
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


def accumulate_moving_average_square_(t, X, f):  # noqa: N803
    """In place ``t = f * t + (1 - f) * X**2`` (AccumulationType::MovingAverageSquare).
    Returns: tensor aliasing t."""
    return _emit("accumulate_moving_average_square_", t, X, f)


def accumulator_scale_(t, f):
    """In place ``t *= f``. Returns: tensor aliasing t."""
    return _emit("accumulator_scale_", t, None, f)


def accumulator_zero_(t):
    """In place ``t = 0``. Returns: tensor aliasing t."""
    return emit("accumulator_zero_", {"t": t})[0]


def copy_var_update_(t, X):  # noqa: N803
    """In place ``t = X`` (same shape). Returns: tensor aliasing t."""
    return emit("copy_var_update_", {"t": t, "X": X})[0]


for _name in ("sparse_accumulate_", "lamb_updater", "adamax_updater", "adam_var_update"):
    globals()[_name] = stub(f"popxl.ops.var_updates.{_name}")


# -- adam_updater ----------------------------------------------------------------------------
#: AdamUpdaterOp's inputs in index order (``ops/var_updates/adam_updater.py``)
_ADAM_INPUTS = ("weight", "m", "v", "time_step", "weight_decay", "beta1", "beta2", "epsilon")


def _adam_rule(*tensors, names, consts):
    ts = dict(zip(names, tensors))
    for key in ("m", "v"):
        require("adam_updater", ts[key], FLOATS)
    if ts["m"].shape != ts["v"].shape:
        raise PopartError(f"adam_updater: first and second order {ts['m'].shape} and "
                          f"{ts['v'].shape} differ")
    out = ts.get("weight", ts["m"])
    return [(out.shape, out.dtype)]


def _adam(*arrays, names, consts):
    """AdamUpdaterOpx: the step is incremented in place first; with a step (Adam mode)
    ``mc = m / (1 - b1**t)``, ``vc = v / (1 - b2**t)``, else ``mc, vc = m, v``; the updater is
    ``mc / (sqrt(vc) + eps) (+ wd * w)``, computed in float32, in the weight's dtype (m's
    without a weight)."""
    a = dict(consts, **{n: x for n, x in zip(names, arrays)})
    val = {k: F32(np.asarray(v, F32).reshape(())) if k in _ADAM_INPUTS[4:] else v
           for k, v in a.items()}
    m, v = val["m"].astype(F32), val["v"].astype(F32)
    if "time_step" in val:
        step = val["time_step"]
        step[...] = step + 1
        t = F32(np.asarray(step, F32).reshape(()))
        m = m / (F32(1) - val["beta1"] ** t)
        v = v / (F32(1) - val["beta2"] ** t)
    upd = m / (np.sqrt(v) + val["epsilon"])
    if "weight" in val and val.get("weight_decay", F32(0)) != 0:
        upd = upd + val["weight_decay"] * val["weight"].astype(F32)
    out = val["weight"] if "weight" in val else val["m"]
    return upd.astype(out.dtype)


register("adam_updater", _adam_rule, _adam)


def _weight_decay_is_required(wd):
    return isinstance(wd, Tensor) or (wd is not None and wd != 0.0)


def adam_updater(acc_first_order, acc_second_order, weight=None, time_step=None,
                 weight_decay=None, beta1=None, beta2=None, epsilon=1e-07):
    """The Adam updater term for a weight (PopXL 3.4 signature); ``time_step`` (enables bias
    correction, needs ``beta1`` and ``beta2``) is incremented by 1 in place.

    Raises:
        ValueError: weight decay without ``weight``; ``time_step`` without both betas.
    Returns:
        Tensor: ``mc / (sqrt(vc) + eps) + wd * w``.
    """
    for name, t in (("acc_first_order", acc_first_order), ("acc_second_order", acc_second_order),
                    ("time_step", time_step)):
        if t is not None and not isinstance(t, Tensor):  # PopXL reads ``.id``
            raise AttributeError(f"adam_updater: {name} must be a Tensor, got {t!r}")
    required = _weight_decay_is_required(weight_decay)
    if required and weight is None:
        raise ValueError("Weight decay requires weight to not be None.")
    if time_step is not None and (beta1 is None or beta2 is None):
        raise ValueError("Bias correction requires both beta1 and beta2 to not be None.")
    given = {"weight": weight if required else None, "m": acc_first_order,
             "v": acc_second_order, "time_step": time_step, "weight_decay": weight_decay,
             "beta1": beta1 if time_step is not None else None,
             "beta2": beta2 if time_step is not None else None, "epsilon": epsilon}
    tensors = {k: x for k, x in given.items() if isinstance(x, Tensor)}
    consts = {k: scalar_value("adam_updater", k, x) for k, x in given.items()
              if x is not None and not isinstance(x, Tensor)}
    names = tuple(tensors)
    modifies = (names.index("time_step"),) if "time_step" in tensors else ()
    return emit("adam_updater", tensors, {"names": names, "consts": consts},
                names=["Updater"], modifies=modifies)[0]
