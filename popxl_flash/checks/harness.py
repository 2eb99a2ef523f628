"""Run a PopXL main graph on host arrays: load, build, store, compile, time.

Shared by the demo, the benchmarks and the tests. Works on the real SDK and on the emulator (where
the session's run profile is returned too).
"""
import time
from dataclasses import dataclass
from typing import Optional

from popxl_flash.checks import devices
from popxl_flash.backend import BACKEND, popxl
from popxl_flash.api.fpchecks import enable_floating_point_checks

ops = popxl.ops


@dataclass
class RunResult:
    """Outcome of :func:`run_graph`.

    Attributes:
        outputs: host arrays of the graph outputs (last run).
        run_seconds: wall time of each timed ``session.run_with_outputs`` call.
        graph_ops: op count of the IR (emulator) or ``None``.
        profile: the emulator's run profile of the last run, or ``None`` on the real SDK.
    """
    outputs: list
    run_seconds: list
    graph_ops: Optional[int]
    profile: object

    @property
    def seconds(self) -> float:
        """Mean time per timed run."""
        return sum(self.run_seconds) / len(self.run_seconds)


def run_graph(build, arrays, *, device="ipu_model", warmup=0, repeats=1, fp_checks=False,
              replicas=1):
    """Build a main graph ``host_load -> build(...) -> host_store``, compile and time it.

    Args:
        build: ``f(*tensors) -> list of tensors``, called in the main graph with one host-loaded
            tensor per array.
        arrays: numpy arrays (their dtypes name the stream dtypes).
        device: a name of :data:`popxl_flash.checks.devices.NAMES` (``ipu_model`` is the full-size
            1472-tile model).
        warmup, repeats: untimed and timed runs.
        fp_checks: turn on floating-point exception traps
            (:func:`popxl_flash.enable_floating_point_checks`).
        replicas: the Ir's replication factor R; with R > 1 every array holds one row per
            replica (``[R, *shape]``, the stream gets ``shape``) and every output has the
            replica dimension first.

    Returns:
        :class:`RunResult`.

    ``warmup`` untimed runs, then the mean of ``repeats`` timed ``session.run_with_outputs``
    calls into host buffers allocated once (``session.run`` would allocate them every call).
    Compilation errors (e.g. out of tile memory on ``ipu_hw``) propagate from the
    ``popxl.Session`` constructor.
    """
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph:
        h2d = [popxl.h2d_stream(a.shape[1:] if replicas > 1 else a.shape,
                                getattr(popxl, a.dtype.name)) for a in arrays]
        outs = build(*[ops.host_load(s) for s in h2d])
        d2h = [popxl.d2h_stream(t.shape, t.dtype) for t in outs]
        for stream, t in zip(d2h, outs):
            ops.host_store(stream, t)
    graph_ops = None
    if BACKEND == "emulator":
        from popxl_flash.emulator import count_ops
        graph_ops = count_ops(ir)
    if fp_checks:
        enable_floating_point_checks(ir)
    inputs = dict(zip(h2d, arrays))
    session = popxl.Session(ir, devices.session_device(device, replicas))
    outputs = session.create_host_outputs()
    with session:
        for _ in range(warmup):
            session.run_with_outputs(inputs, outputs)
        run_seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            session.run_with_outputs(inputs, outputs)
            run_seconds.append(time.perf_counter() - start)
    return RunResult([outputs[s] for s in d2h], run_seconds, graph_ops,
                     getattr(session, "profile", None))
