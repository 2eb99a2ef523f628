"""Emulator stand-ins for the few ``popart`` names a PopXL script uses next to ``popxl``.

On the SDK a full-size IPU model is asked for with::

    dev = popart.DeviceManager().createIpuModelDevice(
        {"numIPUs": 1, "tilesPerIPU": 1472, "ipuVersion": "ipu2"})
    session = popxl.Session(ir, dev)

This module accepts the same route (``from popxl_flash.emulator import popart``) and validates
the option keys as PopART's ``DevicexManager::createHostDevice`` does. Each ``DeviceInfo`` knows
its tile count and tile memory, which the run profile compares with the peak live bytes
(``RunProfile.fits_device``). It is an emulator-only module: it is not part of ``popxl``.

Also here: ``SessionOptions`` (the two options the library touches), reached on the SDK and on
the emulator alike through ``ir._pb_ir.getSessionOptions()``.
"""
import enum

from .errors import PopartError

#: Bytes of In-Processor memory per tile, by IPU version (Mk1 ipu1: 256 KiB; Mk2 ipu2 and
#: Bow ipu21: 624 KiB; Graphcore's IPU datasheets).
BYTES_PER_TILE = {"ipu1": 256 * 1024, "ipu2": 624 * 1024, "ipu21": 624 * 1024}
#: Tiles of one real IPU by version (what ``"ipu_hw"`` compiles for).
TILES_PER_IPU = {"ipu1": 1216, "ipu2": 1472, "ipu21": 1472}
#: PopART's ``defaultFewTiles``: the tile count of an IPU model without ``tilesPerIPU``.
DEFAULT_MODEL_TILES = 4
#: Poplar's default ``IPUModel`` version (SDK 3.x: Mk2). Not in PopART's source.
DEFAULT_MODEL_VERSION = "ipu2"
_MODEL_KEYS = ("numIPUs", "tilesPerIPU", "compileIPUCode", "ipuVersion")


class DeviceType(enum.Enum):
    """``popart.DeviceType`` (the kinds the emulator knows)."""
    IpuModel = 0
    Cpu = 1
    Ipu = 2


class DeviceInfo:
    """A device description (``popart.DeviceInfo``): type, IPUs, tiles and tile memory.

    Not constructed directly: use :class:`DeviceManager` or a ``popxl.Session`` device string.
    """

    def __init__(self, type_, num_ipus, tiles_per_ipu, ipu_version):
        self._type, self._num_ipus = type_, num_ipus
        self._tiles, self._version = tiles_per_ipu, ipu_version

    type = property(lambda self: self._type)
    numIpus = property(lambda self: self._num_ipus)
    tilesPerIPU = tilesPerIpu = property(lambda self: self._tiles)
    ipuVersion = property(lambda self: self._version)
    isAttached = property(lambda self: False)

    @property
    def memory_bytes(self):
        """Emulator-only: tile memory of one IPU in bytes, or ``None`` for the host CPU device.

        One IPU, whatever ``numIpus``: the emulator runs each replica on one IPU, so a
        replica's peak is to be compared with a single IPU's memory."""
        if self._type == DeviceType.Cpu:
            return None
        return self._tiles * BYTES_PER_TILE[self._version]

    def __repr__(self):
        return (f"Device(type={self._type.name} numIPUs={self._num_ipus} "
                f"tilesPerIPU={self._tiles} ipuVersion={self._version})")


def _int_option(options, key, default):
    # PopART stringifies every value (pybind dict -> std::map<string, string>) and parses ints
    # with std::stoi; keep to what parses cleanly.
    if key not in options:
        return default
    text = str(options[key])
    try:
        value = int(text)
    except ValueError:
        raise PopartError(f"IPU model option {key}={text!r} is not an integer") from None
    if value < 1:
        raise PopartError(f"IPU model option {key}={value} must be >= 1")
    return value


class DeviceManager:
    """``popart.DeviceManager()``: creates host-side devices."""

    def createCpuDevice(self):
        """Returns: the host CPU device (one IPU's worth of graph, no tile memory limit)."""
        return DeviceInfo(DeviceType.Cpu, 1, 1, DEFAULT_MODEL_VERSION)

    def createIpuModelDevice(self, options):
        """An IPU model (a simulator that does not check memory).

        Args:
            options: dict with keys among ``numIPUs``, ``tilesPerIPU`` (default 4),
                ``compileIPUCode``, ``ipuVersion`` (``ipu1``, ``ipu2``, ``ipu21``).

        Returns:
            DeviceInfo. Raises PopartError for any other key, as PopART does.
        """
        if not isinstance(options, dict):
            raise TypeError(f"createIpuModelDevice expects a dict, got {options!r}")
        bad = [k for k in options if str(k) not in _MODEL_KEYS]
        if bad:
            raise PopartError(f"Invalid option `{bad[0]}' passed to "
                              "DevicexManager::createHostDevice for device type IpuModel. "
                              f"Valid options are {list(_MODEL_KEYS)}")
        version = str(options.get("ipuVersion", DEFAULT_MODEL_VERSION))
        if version not in BYTES_PER_TILE:
            raise NotImplementedError(f"ipuVersion {version!r} is not supported by the emulator "
                                      f"(one of {sorted(BYTES_PER_TILE)})")
        return DeviceInfo(DeviceType.IpuModel, _int_option(options, "numIPUs", 1),
                          _int_option(options, "tilesPerIPU", DEFAULT_MODEL_TILES), version)

    def enumerateDevices(self, *args, **kwargs):
        raise NotImplementedError("the emulator has no IPU hardware to enumerate")


def ipu_hw_device(num_ipus):
    """Emulator-only: the device ``popxl.Session(ir, "ipu_hw")`` compiles for (Mk2)."""
    return DeviceInfo(DeviceType.Ipu, num_ipus, TILES_PER_IPU["ipu2"], "ipu2")


def version_string():
    """``popart.versionString()``: the PopART release the emulator follows."""
    return "3.4.0"


class SessionOptions:
    """The session options the library sets (``ir._pb_ir.getSessionOptions()``).

    Attributes:
        enableFloatingPointChecks: trap on invalid, divide-by-zero and overflow (on the
            emulator: raise ``FloatingPointError`` naming the op, on every device).
        enableStochasticRounding: accepted, ignored by the emulator.
    """

    __slots__ = ("enableFloatingPointChecks", "enableStochasticRounding")

    def __init__(self):
        self.enableFloatingPointChecks = False
        self.enableStochasticRounding = False
