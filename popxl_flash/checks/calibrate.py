"""``python -m popxl_flash.selfcheck --calibrate``: fit the IPU time model's constants on an
IPU (:mod:`popxl_flash.ipu_model`) and write them to a JSON file.

Micro-graphs, each run in a ``repeat`` of :data:`REPEATS` iterations and timed by the host
around ``session.run`` (fewest of :data:`TIMINGS` runs):

* **compute sets**: ``N`` dependent small elementwise ops (``[1472]`` float32, one element per
  tile: one compute set each by the lowering table) for several ``N``: the slope of time over
  ``N`` is one compute set's cost;
* **vector rates**: one op of each rate key (float16 and float32 ``mul``, ``exp``, a cast) on
  ``[E]`` for several ``E``: the slope over ``E`` is that key's rate;
* **matmul FLOPs**: one ``[M, K] @ [K, N]`` matmul per dtype (float partials, PopXL's
  default) for several sizes: the slope over FLOPs is the matmul rate;
* **copies**: one outplace ``transpose`` (a Copy program of its output under PopXL) of
  ``[E]``-element tensors: the slope over bytes is the copy rate.

The fit is a least-squares line per micro-graph family. On the emulator (no device time) the
command prints what it would measure and writes nothing. This code follows the PopXL API and
has not yet run on a Graphcore machine: its first run there is its test.
"""
import dataclasses
import time

import numpy as np

from popxl_flash.backend import BACKEND, popxl
from popxl_flash.checks import devices
from popxl_flash import ipu_model

ops = popxl.ops

REPEATS = 100
TIMINGS = 5
COMPUTE_SET_COUNTS = (8, 16, 32, 64)
VECTOR_SIZES = (2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22)
MATMUL_SIZES = (256, 512, 1024, 2048)
#: Per vector-rate key: (input dtype name, op on the carried tensor keeping its dtype).
RATE_OPS = {
    "arithmetic.float16": ("float16", lambda x: x * 1.0001),
    "arithmetic.float32": ("float32", lambda x: x * 1.0001),
    "transcendental.float16": ("float16", lambda x: ops.exp(x * 0.0)),
    "transcendental.float32": ("float32", lambda x: ops.exp(x * 0.0)),
    "cast": ("float32", lambda x: ops.cast(ops.cast(x, popxl.float16), popxl.float32)),
}


def _elementwise_chain(n, size, dtype_name="float32", fn=lambda x: x * 1.0001):
    """Body: ``n`` dependent ``x = fn(x)`` on ``[size]`` of ``dtype_name``."""
    def body(x):
        for _ in range(n):
            x = fn(x)
        return x
    return body, [((size,), getattr(popxl, dtype_name))]


def _copy(size):
    """Body: an outplace transpose of ``[2, size / 2]`` float32 and back (two Copy programs)."""
    def body(x):
        return ops.transpose(ops.transpose(x))
    return body, [((2, size // 2), popxl.float32)]


def _matmul(size, dtype):
    """Body: ``a = (a @ b) / size`` on ``[size, size]`` (the carried ``a`` keeps its dtype, and
    with all-ones inputs its values: no overflow over the repeat)."""
    def body(a, b):
        return ops.matmul(a, b) * (1.0 / size)
    return body, [((size, size), dtype), ((size, size), dtype)]


def _time_repeat(body, specs, device):
    """Seconds per repeat iteration of ``body`` (fewest of :data:`TIMINGS`)."""
    ir = popxl.Ir()
    with ir.main_graph:
        inputs = [popxl.variable(np.ones(shape, dtype.as_numpy()), dtype) for shape, dtype in specs]
        graph = ir.create_graph(body, *[x.spec for x in inputs])
        ops.repeat(graph, REPEATS, *inputs)
    session = popxl.Session(ir, devices.session_device(device))
    best = float("inf")
    with session:
        session.run({})
        for _ in range(TIMINGS):
            start = time.perf_counter()
            session.run({})
            best = min(best, time.perf_counter() - start)
    return best / REPEATS


def _slope(xs, ys):
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def plan_text():
    """What the calibration measures (printed on the emulator)."""
    return "\n".join([
        "calibrate: micro-graphs, each in a repeat of %d iterations:" % REPEATS,
        f"  compute sets: {COMPUTE_SET_COUNTS} dependent elementwise ops on float32 [1472]",
        f"  vector rates: one op per rate key ({', '.join(RATE_OPS)}) of sizes {VECTOR_SIZES}",
        f"  matmul FLOPs: square float16 and float32 matmuls of sizes {MATMUL_SIZES}",
        f"  copies: outplace transposes of float32 tensors of sizes {VECTOR_SIZES}",
        "  then least-squares slopes -> compute_set_cycles, vector_rates, "
        "matmul_flops_per_tile_cycle, copy_bytes_per_tile_cycle"])


def calibrate(device, output):
    """Measure, fit and write the constants; returns the :class:`IpuConstants`."""
    ref = ipu_model.REFERENCE
    clock, tiles = ref.clock_hz, ref.tiles
    step_s = [_time_repeat(*_elementwise_chain(n, tiles), device) for n in COMPUTE_SET_COUNTS]
    compute_set = _slope(COMPUTE_SET_COUNTS, step_s) * clock
    vector = {}
    for key, (dtype_name, fn) in RATE_OPS.items():
        vec_s = [_time_repeat(*_elementwise_chain(1, e, dtype_name, fn), device)
                 for e in VECTOR_SIZES]
        elements = 2 if key == "cast" else 1  # two casts per element
        vector[key] = elements / (_slope(VECTOR_SIZES, vec_s) * clock * tiles)
    copy_s = [_time_repeat(*_copy(e), device) for e in VECTOR_SIZES]
    copy = 2 * 4 / (_slope(VECTOR_SIZES, copy_s) * clock * tiles)
    rates = {}
    for name in ("float16", "float32"):
        dtype = getattr(popxl, name)
        mm_s = [_time_repeat(*_matmul(n, dtype), device) for n in MATMUL_SIZES]
        flops = [2 * n ** 3 for n in MATMUL_SIZES]
        rates[name] = 1.0 / (_slope(flops, mm_s) * clock * tiles)
    fitted = dataclasses.replace(ref, compute_set_cycles=compute_set, vector_rates=vector,
                                 matmul_flops_per_tile_cycle=rates,
                                 copy_bytes_per_tile_cycle=copy, source=str(output),
                                 calibrated=True)
    ipu_model.save(output, fitted)
    return fitted


def run(device, output, out=None):
    """The command: calibrate on the SDK, explain on the emulator. Returns the exit code."""
    import sys
    out = out or sys.stdout
    print(plan_text(), file=out)
    if BACKEND == "emulator":
        print("calibrate: the emulator has no device time; nothing measured, nothing written. "
              f"On an IPU this writes {output}; then set {ipu_model.CONSTANTS_ENV}={output} "
              "so that every modelled figure uses the fitted constants.", file=out)
        return 0
    fitted = calibrate(device, output)
    print(f"calibrate: wrote {output}: compute set {fitted.compute_set_cycles:.0f} cycles, "
          f"vector rates {fitted.vector_rates}, matmul {fitted.matmul_flops_per_tile_cycle}, "
          f"copies {fitted.copy_bytes_per_tile_cycle:.2f} B/tile-cycle; set "
          f"{ipu_model.CONSTANTS_ENV}={output}", file=out)
    return 0
