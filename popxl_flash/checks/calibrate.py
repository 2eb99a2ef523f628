"""``python -m popxl_flash.selfcheck --calibrate``: fit the reference model's constants on an
IPU (:mod:`popxl_flash.plan.ipu_time`) and write them to a JSON file.

Micro-graphs, each run in a ``repeat`` of :data:`REPEATS` iterations and timed by the host
around ``session.run`` (fewest of :data:`TIMINGS` runs):

* **supersteps**: ``N`` dependent small elementwise ops (``[1472]`` float32, one element per
  tile) for several ``N``: the slope of time over ``N`` is one op's superstep cost;
* **vector elements**: one elementwise op on ``[E]`` float32 for several ``E``: the slope over
  ``E`` is the vector rate;
* **matmul FLOPs**: one ``[G, M, K] @ [G, K, N]`` matmul per dtype for several sizes: the
  slope over FLOPs is the matmul rate.

The fit is a least-squares line per micro-graph family; ``bytes_copied`` keeps its reference
value (no PopXL construct copies a controlled number of bytes without other work). On the
emulator (no device time) the command prints what it would measure and writes nothing.
This code follows the PopXL API and has not yet run on a Graphcore machine: its first run
there is its test.
"""
import dataclasses
import time

import numpy as np

from popxl_flash.backend import BACKEND, popxl
from popxl_flash.checks import devices
from popxl_flash.plan import ipu_time

ops = popxl.ops

REPEATS = 100
TIMINGS = 5
SUPERSTEP_COUNTS = (8, 16, 32, 64)
VECTOR_SIZES = (2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22)
MATMUL_SIZES = (256, 512, 1024, 2048)


def _elementwise_chain(n, size):
    """Body: ``n`` dependent ``x = x * 1.0001`` on float32 ``[size]``."""
    def body(x):
        for _ in range(n):
            x = x * 1.0001
        return x
    return body, [((size,), popxl.float32)]


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
        f"  supersteps: {SUPERSTEP_COUNTS} dependent elementwise ops on float32 [1472]",
        f"  vector elements: one elementwise op on float32 of sizes {VECTOR_SIZES}",
        f"  matmul FLOPs: square float16 and float32 matmuls of sizes {MATMUL_SIZES}",
        "  then least-squares slopes -> superstep_cycles, vector_elements_per_tile_cycle, "
        "matmul_flops_per_tile_cycle (bytes copied keeps its reference value)"])


def calibrate(device, output):
    """Measure, fit and write the constants; returns the :class:`IpuConstants`."""
    ref = ipu_time.REFERENCE
    clock, tiles = ref.clock_hz, ref.tiles
    step_s = [_time_repeat(*_elementwise_chain(n, tiles), device) for n in SUPERSTEP_COUNTS]
    superstep = _slope(SUPERSTEP_COUNTS, step_s) * clock
    vec_s = [_time_repeat(*_elementwise_chain(1, e), device) for e in VECTOR_SIZES]
    vector = 1.0 / (_slope(VECTOR_SIZES, vec_s) * clock * tiles)
    rates = {}
    for name in ("float16", "float32"):
        dtype = getattr(popxl, name)
        mm_s = [_time_repeat(*_matmul(n, dtype), device) for n in MATMUL_SIZES]
        flops = [2 * n ** 3 for n in MATMUL_SIZES]
        rates[name] = 1.0 / (_slope(flops, mm_s) * clock * tiles)
    fitted = dataclasses.replace(ref, superstep_cycles=superstep,
                                 vector_elements_per_tile_cycle=vector,
                                 matmul_flops_per_tile_cycle=rates, source=str(output),
                                 calibrated=True)
    ipu_time.save(output, fitted)
    return fitted


def run(device, output, out=None):
    """The command: calibrate on the SDK, explain on the emulator. Returns the exit code."""
    import sys
    out = out or sys.stdout
    print(plan_text(), file=out)
    if BACKEND == "emulator":
        print("calibrate: the emulator has no device time; nothing measured, nothing written. "
              f"On an IPU this writes {output}; then set {ipu_time.CONSTANTS_ENV}={output} "
              "so that every modelled figure uses the fitted constants.", file=out)
        return 0
    fitted = calibrate(device, output)
    print(f"calibrate: wrote {output}: superstep {fitted.superstep_cycles:.0f} cycles, vector "
          f"{fitted.vector_elements_per_tile_cycle:.2f} elements/tile-cycle, matmul "
          f"{fitted.matmul_flops_per_tile_cycle}; set {ipu_time.CONSTANTS_ENV}={output}", file=out)
    return 0
