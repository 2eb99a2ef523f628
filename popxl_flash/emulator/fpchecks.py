"""Floating-point exception checks (``SessionOptions.enableFloatingPointChecks``).

On an IPU the option makes tiles trap on invalid operations, division by zero and overflow
(reference page 3.1). The emulator reads those rules conservatively, on every device:

* arithmetic ops (everything not listed below: add, sub, mul, div, exp, log, matmul, sums,
  softmax, casts, ...) trap when a float input holds an infinity or a NaN, or when a float
  output is not finite (overflow, x/0, log(0), 0*inf, inf-inf, ...);
* comparisons and max/min (``greater``, ``equal``, ``maximum``, max/min reductions)
  trap only on a NaN input;
* data movement (``where``, slices, reshapes, concat, dynamic slice/update, copies, ``init``
  including ``"undef"``, host IO (runtime steps, never wrapped), ``isnan``/``isinf``/``isfinite``) never traps, so selecting
  a constant ``-inf`` is clean.

A trap raises ``FloatingPointError`` naming the op kind, its graph and its first output.
"""
import numpy as np


#: Ops that only move or select data (or classify it): never trap.
MOVE = frozenset((
    "where", "init", "identity", "concat", "split", "slice", "slice_", "subsample",
    "reshape", "reshape_", "transpose", "transpose_",
    "detach", "detach_", "dynamic_slice", "dynamic_update", "dynamic_update_", "gather",
    "copy_var_update_", "accumulator_zero_",
    "isnan", "isinf", "isfinite",
    "logical_and", "logical_or", "logical_not"))
#: Ordered comparisons and selections by value: trap only on NaN.
COMPARE = frozenset(("greater", "equal", "maximum", "max", "min"))


def _is_float(a):
    return getattr(a, "dtype", None) is not None and a.dtype.kind == "f"


def _trap(op, why):
    out = op.outputs[0].id if op.outputs else "(no output)"
    raise FloatingPointError(f"floating-point exception in op {op.kind} of graph "
                             f"{op.graph.name} (output {out}): {why}")


def _check_inputs(op, arrays, nan_only):
    for pos, a in enumerate(arrays):
        if not _is_float(a):
            continue
        if nan_only:
            if np.isnan(a).any():
                _trap(op, f"input {pos} holds a NaN")
        elif not np.isfinite(a).all():
            _trap(op, f"input {pos} holds an infinity or a NaN (arithmetic with a non-finite "
                      "operand)")


def _check_outputs(op, result):
    results = result if isinstance(result, (tuple, list)) else (result,)
    for pos, r in enumerate(results):
        a = np.asarray(r)
        if _is_float(a) and not np.isfinite(a).all():
            kind = "invalid (NaN)" if np.isnan(a).any() else "overflow or division by zero"
            _trap(op, f"output {pos} is not finite: {kind}")


def checking(fn, op):
    """Wrap the numpy implementation of ``op`` so that it raises like an IPU trap."""
    if op.kind in MOVE:
        return fn
    nan_only = op.kind in COMPARE

    def checked(*arrays, **attrs):
        _check_inputs(op, arrays, nan_only)
        result = fn(*arrays, **attrs)
        if not nan_only:
            _check_outputs(op, result)
        return result
    return checked
