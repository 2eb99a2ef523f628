"""Helpers shared by the PopXL-surface tests.

The tests are written against :data:`popxl_flash.popxl` (real PopXL or the emulator), so the same
checks run on a Graphcore machine and here. Rule numbers in comments (``§11.4``) refer to the
"Gotchas" section of ``shared/docs/popxl-api-reference.md``.

* :data:`IR_ERRORS` -- what an "IR error" (``popart_exception`` in the SDK) is raised as.
* :data:`COMPILE_ERRORS` -- what ``popxl.Session(...)`` raises for a compile-time error (the page
  names no type, so any exception; the tests check *when* it is raised).
* :func:`load` / :func:`run` -- feed host arrays and fetch results with little boilerplate.
* :data:`emulator_only` -- skip marker for checks of emulator-only behaviour (profile, raising on
  what PopXL leaves unspecified).
"""
import numpy as np
import pytest

import popxl_flash
from popxl_flash import popxl

if popxl_flash.BACKEND == "emulator":
    from popxl_flash.emulator.errors import PopartError

    IR_ERRORS = PopartError
else:  # the SDK's popart_exception derives from Exception only
    IR_ERRORS = Exception

COMPILE_ERRORS = Exception

emulator_only = pytest.mark.skipif(
    popxl_flash.BACKEND != "emulator", reason="checks emulator-only behaviour"
)

DEVICE = "ipu_model"

_NP_TO_POPXL = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.int32): "int32",
    np.dtype(np.uint32): "uint32",
    np.dtype(np.bool_): "bool",
}


def pdtype(np_dtype):
    """The popxl dtype for a numpy dtype (float16/float32/int32/uint32/bool)."""
    return getattr(popxl, _NP_TO_POPXL[np.dtype(np_dtype)])


def load(feeds, array, name=None):
    """Inside the main graph: ``host_load`` a fresh h2d stream for ``array``.

    Records ``{stream: array}`` in ``feeds`` (a dict passed on to :func:`run`) and returns the
    loaded tensor.
    """
    array = np.asarray(array)
    stream = popxl.h2d_stream(array.shape, pdtype(array.dtype), name=name)
    feeds[stream] = array
    return popxl.ops.host_load(stream, name=name)


def store(t, name=None):
    """Inside the main graph: ``host_store`` ``t`` to a fresh d2h stream; returns the stream."""
    stream = popxl.d2h_stream(t.shape, t.dtype, name=name)
    popxl.ops.host_store(stream, t)
    return stream


def run(ir, inputs=None, outputs=(), device=DEVICE):
    """Run ``ir`` once and return the fetched arrays.

    ``inputs``: ``{h2d_stream: array}`` (e.g. filled by :func:`load`). ``outputs``: a main-graph
    Tensor or d2h stream, or a sequence of them; Tensors get a ``host_store`` here (before the
    Session compiles the Ir). Returns one array for a single output, else a list in order.
    """
    single = not isinstance(outputs, (list, tuple))
    outs = [outputs] if single else list(outputs)
    streams = []
    for o in outs:
        if isinstance(o, popxl.Tensor):
            with ir.main_graph:
                streams.append(store(o))
        else:
            streams.append(o)
    with popxl.Session(ir, device) as session:
        result = session.run(dict(inputs or {}))
    arrays = [result[s] for s in streams]
    return arrays[0] if single else arrays


def run_fn(fn, *arrays):
    """Build a main graph: constants for ``arrays``, ``fn(*tensors)`` -> Tensor(s); run it."""
    ir = popxl.Ir()
    with ir.main_graph:
        ts = [popxl.constant(a) for a in arrays]
        out = fn(*ts)
    return run(ir, None, list(out) if isinstance(out, (list, tuple)) else out)
