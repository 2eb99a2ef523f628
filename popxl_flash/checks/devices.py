"""The one place that turns a device name into what ``popxl.Session`` is given.

Names (used by the harness, the demo, the benchmarks and the tests):

* ``"ipu_model"``: a full-size Mk2 IPU model, ``popart.DeviceManager().createIpuModelDevice(
  {"numIPUs": 1, "tilesPerIPU": 1472, "ipuVersion": "ipu2"})`` (1472 tiles x 624 KiB).
  ``popxl.Session(ir, "ipu_model")`` would give PopART's 4-tile model instead, whose times
  mean nothing for a real IPU. The IPU model never checks memory.
* ``"ipu_hw"``: a real IPU (``popxl.Session``'s own string; compilation fails when the graph
  does not fit).
* ``"cpu"``: Poplar's CPU device (one IPU's worth of graph, no tile memory).

On the emulator the same route builds the emulator's ``DeviceInfo``, which knows its tiles and
memory, so ``session.profile.fits_device`` says whether the run's peak would fit.
"""
import math

from popxl_flash.backend import BACKEND

NAMES = ("ipu_model", "ipu_hw", "cpu")
#: The full-size IPU model's options (Mk2: 1472 tiles of 624 KiB).
FULL_IPU_MODEL = {"numIPUs": 1, "tilesPerIPU": 1472, "ipuVersion": "ipu2"}


def popart_module():
    """Returns: PopART's Python module on the SDK, the emulator's stand-in otherwise."""
    if BACKEND == "popxl":
        import popart
        return popart
    from popxl_flash.emulator import popart
    return popart


def default_device():
    """Returns: ``"ipu_hw"`` when the Poplar SDK is the backend, else ``"ipu_model"``."""
    return "ipu_hw" if BACKEND == "popxl" else "ipu_model"


def session_device(name, replicas=1):
    """The ``device_desc`` for ``popxl.Session`` that ``name`` stands for.

    Args:
        name: one of :data:`NAMES`.
        replicas: the Ir's replication factor: the full-size model gets one IPU per replica,
            rounded up to a power of two as ``popxl.Session`` asks for (``"ipu_hw"`` and
            ``"cpu"`` are left to ``popxl.Session``, which sizes them itself).

    Returns:
        A ``DeviceInfo`` (full-size IPU model) or the device string.
    """
    if name not in NAMES:
        raise ValueError(f"device must be one of {NAMES}, got {name!r}")
    if name == "ipu_model":
        num_ipus = 2 ** math.ceil(math.log2(replicas))
        return popart_module().DeviceManager().createIpuModelDevice(
            dict(FULL_IPU_MODEL, numIPUs=num_ipus))
    return name
