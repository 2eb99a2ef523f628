"""Emulator stand-ins for the few ``popart`` names a PopXL script uses next to ``popxl``.

On the SDK a full-size IPU model is asked for with::

    dev = popart.DeviceManager().createIpuModelDevice(
        {"numIPUs": 1, "tilesPerIPU": 1472, "ipuVersion": "ipu2"})
    session = popxl.Session(ir, dev)

This module accepts the same route (``from popxl_flash.emulator import popart``) and validates
the option keys as PopART's ``DevicexManager::createHostDevice`` does. Each ``DeviceInfo`` knows
its tile count and tile memory, which the run profile compares with the peak live bytes
(``RunProfile.fits_device``). It is an emulator-only module: it is not part of ``popxl``.

Also here: ``SessionOptions`` (PopART's fields; the emulator acts on the floating-point-check
option only), reached on the SDK and on the emulator alike through
``ir._pb_ir.getSessionOptions()``.
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


class Unmodelled:
    """A structured session option the emulator does not model (an enum or settings struct
    such as ``executionPhaseSettings``): it can be stored back; reading its fields raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotImplementedError(f"SessionOptions.{self._name}.{attr} is not modelled by the "
                                  "PopXL emulator")

    def __repr__(self):
        return f"<unmodelled SessionOptions.{self._name}>"


#: PopART 3.4's ``SessionOptions`` fields as bound in ``popart_core/popart.cpp``, with the
#: defaults of ``sessionoptions.hpp`` (``Unmodelled`` for enums and settings structs).
_PLAIN = {
    "logDir": "", "exportPoplarComputationGraph": False, "exportPoplarVertexGraph": False,
    "instrumentWithHardwareCycleCounter": False, "disableGradAccumulationTensorStreams": False,
    "disableOptimizerStateTensorStreams": False, "enableOutlining": True,
    "enableOutliningCopyCostPruning": True, "outlineThreshold": 1.0,
    "outlineSequenceBreakCost": 10000.0, "accumulationFactor": 1,
    "enableGradientAccumulation": False, "enableNonStableSoftmax": False,
    "enablePipelining": False, "mergeVarUpdateMemThreshold": 1000000,
    "rearrangeAnchorsOnHost": True, "rearrangeStreamsOnHost": False, "numIOTiles": 0,
    "explicitRecomputation": False, "aliasZeroCopy": False, "enablePrefetchDatastreams": True,
    "defaultBufferingDepth": 1, "defaultPrefetchBufferingDepth": 1, "bufferingDepthMap": {},
    "prefetchBufferingDepthMap": {}, "virtualGraphSplitRatios": [],
    "enableReplicatedGraphs": False, "replicatedGraphCount": 1, "compileEngine": True,
    "_engineOptions": {}, "_convolutionOptions": {}, "_lstmOptions": {}, "_matmulOptions": {},
    "_reportOptions": {}, "_gclOptions": {}, "dotOpNames": False, "separateCallOpPdfs": True,
    "finalDotOp": 10000, "firstDotOp": 0, "constantWeights": True,
    "cachePath": "session_cache", "enableEngineCaching": False, "enableVariablesCaching": True,
    "enableFloatingPointChecks": False, "enableStochasticRounding": False,
    "_enableRngStateManagement": False, "enableFullyConnectedPass": True,
    "partialsTypeMatMuls": "", "enableStableNorm": False,
    "groupNormStridedChannelGrouping": False, "customCodelets": [], "updatableNamedBuffers": [],
    "customCodeletCompileFlags": "", "kahnTieBreaker": "greedy", "timeLimitScheduler": 1e9,
    "swapLimitScheduler": 1000000, "transitiveClosureOptimizationThreshold": 100000,
    "decomposeGradSum": False, "serializedPoprithmsShiftGraphsDir": "",
    "serializedPoprithmsAnnealGraphsDir": "", "enableDistributedReplicatedGraphs": False,
    "globalReplicationFactor": 1, "globalReplicaOffset": 0, "groupHostSync": False,
    "strictOpVersions": True, "opxAliasChecking": False, "opxModifyChecking": False,
    "_tensorLocationSettingsOverride": {}, "enableLoadAndOffloadRNGState": False,
    "useHostCopyOps": False, "enableEfficientOverlapIOTopoCons": False,
    "enableSupportedDataTypeCasting": True, "enableExplicitMainLoops": False,
    "enableMergeExchange": True, "ensureFp32LossScaleTensor": False, "delayVarUpdates": True,
    "scheduleNonWeightUpdateGradientConsumersEarly": False, "dotChecks": set(),
    "enableInplaceAmbiguityChecking": False, "createImplicitPipeliningFwdOnlyProgram": False,
    "throwIfLog2ScaleTensorNotInRange": True, "enableConstantFoldingOfMultipleConsumers": True,
    "useLoopCandidateCreator": False, "stashAllTensorsInferencePipeline": False,
}
_STRUCTURED = (
    "syntheticDataMode", "hardwareInstrumentations", "accumulationAndReplicationReductionType",
    "meanAccumulationAndReplicationReductionStrategy", "subgraphCopyingStrategy",
    "autoRecomputation", "mergeVarUpdate", "executionPhaseSettings", "experimentalSettings",
    "batchSerializationSettings", "virtualGraphMode", "activationTensorLocationSettings",
    "weightTensorLocationSettings", "optimizerStateTensorLocationSettings",
    "accumulatorTensorLocationSettings", "accumulateOuterFragmentSettings",
    "automaticLossScalingSettings", "replicatedCollectivesSettings")
#: the Python properties PopART adds over the ``_``-prefixed dictionaries (``__init__.py.in``)
_DICT_PROPERTIES = {"engineOptions": "_engineOptions", "convolutionOptions": "_convolutionOptions",
                    "lstmOptions": "_lstmOptions", "matmulOptions": "_matmulOptions",
                    "reportOptions": "_reportOptions", "gclOptions": "_gclOptions",
                    "updatableBuffers": "_updatableNamedBuffers",
                    "tensorLocationSettingsOverride": "_tensorLocationSettingsOverride"}
#: the fields the emulator acts on; every other one is stored and has no effect
MODELLED = ("enableFloatingPointChecks",)
#: what PopXL's ``Ir()`` sets (``python_files/ir.py``)
POPXL_IR = {"useHostCopyOps": True, "aliasZeroCopy": True, "enableExplicitMainLoops": True,
            "explicitRecomputation": True, "enableInplaceAmbiguityChecking": True,
            "enableVariablesCaching": False, "decomposeGradSum": True}


class _OptionsDict(dict):
    """PopART's ``DictWrapper``: an item set on the returned dict is written back."""

    def __init__(self, update, *args):
        self._update = update
        super().__init__(*args)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._update(dict(self))


def _dict_property(field):
    def get(opts):
        return _OptionsDict(lambda v: setattr(opts, field, v), getattr(opts, field))

    def put(opts, value):
        setattr(opts, field, dict(value))
    return property(get, put)


class SessionOptions:
    """``popart.SessionOptions``: PopART 3.4's fields with their defaults (an unknown name
    raises AttributeError, as pybind11's class does). Only ``MODELLED`` fields change what the
    emulator does: ``enableFloatingPointChecks`` (trap on invalid, divide-by-zero and overflow:
    ``FloatingPointError`` naming the op, on every device). The others (``numIOTiles``,
    ``partialsTypeMatMuls``, ``engineOptions``, ``enableStochasticRounding``, ...) are stored
    and ignored; enums and settings structs are ``Unmodelled`` placeholders."""

    __slots__ = tuple(_PLAIN) + _STRUCTURED

    def __init__(self):
        for name, value in _PLAIN.items():
            setattr(self, name, value.copy() if hasattr(value, "copy") else value)
        for name in _STRUCTURED:
            setattr(self, name, Unmodelled(name))

    def getGlobalReplicationFactor(self):  # noqa: N802
        """Returns: the global replication factor (``globalReplicationFactor`` when distributed
        replicated graphs are on, else ``replicatedGraphCount``)."""
        if self.enableDistributedReplicatedGraphs:
            return self.globalReplicationFactor
        return self.replicatedGraphCount if self.enableReplicatedGraphs else 1


for _prop, _field in _DICT_PROPERTIES.items():
    setattr(SessionOptions, _prop, _dict_property(_field))
del _prop, _field