"""The reference model of IPU time, and its constants (numpy only).

Every figure this library calls *modelled* comes from one formula::

    cycles = SUPERSTEP_CYCLES * supersteps
           + matmul_flops    / (TILES * MATMUL_FLOPS_PER_TILE_CYCLE[dtype])
           + vector_elements / (TILES * VECTOR_ELEMENTS_PER_TILE_CYCLE)
           + bytes_copied    / (TILES * COPY_BYTES_PER_TILE_CYCLE)
    seconds = cycles / CLOCK_HZ

*supersteps* are the ops executed other than pure views (the emulator's
``RunProfile.supersteps``), *vector_elements* the output elements of the executed compute ops
other than matmuls (``RunProfile.vector_elements``), *matmul_flops* 2 per multiply-add,
*bytes_copied* the lowering copies at call, loop and branch boundaries.

The constants live in :class:`IpuConstants`; :data:`REFERENCE` holds the reference values, each
stated with its source or labelled an assumption. A JSON file written by
``python -m popxl_flash.selfcheck --calibrate`` on an IPU overrides them: name it with the
environment variable :data:`CONSTANTS_ENV` (or pass it to :func:`load`). Until an IPU has run
the calibration, every printed modelled time says so (:func:`label`).
"""
import functools
import json
import os
from dataclasses import asdict, dataclass, field, replace

#: Environment variable naming a JSON file of fitted constants (``--calibrate`` writes it).
CONSTANTS_ENV = "POPXL_FLASH_IPU_CONSTANTS"


@dataclass(frozen=True)
class IpuConstants:
    """The constants of the reference model.

    Attributes:
        superstep_cycles: cycles of one executed op (assumption: every op is at least one
            bulk-synchronous superstep: compute set, chip-wide sync, exchange; ~0.75 us).
        matmul_flops_per_tile_cycle: ``{dtype: FLOPs per tile-cycle}``: GC200 peak 250 TFLOP/s
            float16 and 62.5 TFLOP/s float32 (Graphcore's Colossus Mk2 announcement), divided
            by tiles and clock: 128 and 32 (float32 accumulation in both).
        vector_elements_per_tile_cycle: output elements of an elementwise or reduce op per
            tile-cycle (assumption: a 64-bit vector unit, two float32 per cycle, times two
            for paired issue; float16 counted as float32: the elementwise work here is float32).
        copy_bytes_per_tile_cycle: bytes a tile copies per cycle (assumption: 64-bit load +
            store; the GC200's 47.5 TB/s memory bandwidth is ~24 B per tile-cycle).
        tiles: 1472 (GC200 datasheet); clock_hz: 1.33 GHz (IPU-M2000 datasheet).
        tile_memory_bytes: 624 KiB per tile (GC200 datasheet, ~900 MB in all).
        source: where the values come from (``"reference"`` or a calibration file).
        calibrated: fitted on an IPU (``--calibrate``) rather than the reference values.
    """

    superstep_cycles: float = 1000.0
    matmul_flops_per_tile_cycle: dict = field(
        default_factory=lambda: {"float16": 128.0, "float32": 32.0})
    vector_elements_per_tile_cycle: float = 4.0
    copy_bytes_per_tile_cycle: float = 8.0
    tiles: int = 1472
    clock_hz: float = 1.33e9
    tile_memory_bytes: int = 624 * 1024
    source: str = "reference"
    calibrated: bool = False

    @property
    def device_bytes(self) -> int:
        """In-processor memory of one IPU: tiles x tile memory."""
        return self.tiles * self.tile_memory_bytes


#: The reference constants (each attribute's source or assumption is stated above).
REFERENCE = IpuConstants()


@dataclass(frozen=True)
class WorkCounts:
    """Counted work the model prices (what the emulator's run profile measures).

    Attributes:
        supersteps: ops executed other than pure views.
        matmul_flops: 2 per multiply-add.
        vector_elements: output elements of the executed compute ops other than matmuls.
        bytes_copied: lowering copies at call, loop and branch boundaries.
    """

    supersteps: int
    matmul_flops: int
    vector_elements: int
    bytes_copied: int = 0

    def __add__(self, other):
        return WorkCounts(self.supersteps + other.supersteps,
                          self.matmul_flops + other.matmul_flops,
                          self.vector_elements + other.vector_elements,
                          self.bytes_copied + other.bytes_copied)


@dataclass(frozen=True)
class ModelledTime:
    """Modelled time of some counted work, by term (cycles) and in all.

    Attributes:
        superstep_cycles, matmul_cycles, vector_cycles, copy_cycles: the four terms.
        clock_hz: to convert to seconds.
    """

    superstep_cycles: float
    matmul_cycles: float
    vector_cycles: float
    copy_cycles: float
    clock_hz: float

    @property
    def cycles(self) -> float:
        return self.superstep_cycles + self.matmul_cycles + self.vector_cycles + self.copy_cycles

    @property
    def seconds(self) -> float:
        return self.cycles / self.clock_hz

    def __add__(self, other):
        return ModelledTime(self.superstep_cycles + other.superstep_cycles,
                            self.matmul_cycles + other.matmul_cycles,
                            self.vector_cycles + other.vector_cycles,
                            self.copy_cycles + other.copy_cycles, self.clock_hz)


def time(counts, dtype, constants=None) -> ModelledTime:
    """The reference model applied to ``counts``.

    Args:
        counts: anything with ``supersteps``, ``matmul_flops``, ``vector_elements`` and
            ``bytes_copied`` (a :class:`popxl_flash.plan.counts.PassCounts`, or the emulator's
            ``RunProfile``).
        dtype: ``"float16"`` or ``"float32"`` (the matmuls' input dtype).
        constants: :class:`IpuConstants` (default: :func:`constants`).

    Returns:
        :class:`ModelledTime`.
    """
    c = constants or current()
    return ModelledTime(
        superstep_cycles=c.superstep_cycles * counts.supersteps,
        matmul_cycles=counts.matmul_flops / (c.tiles * c.matmul_flops_per_tile_cycle[dtype]),
        vector_cycles=counts.vector_elements / (c.tiles * c.vector_elements_per_tile_cycle),
        copy_cycles=counts.bytes_copied / (c.tiles * c.copy_bytes_per_tile_cycle),
        clock_hz=c.clock_hz)


def load(path) -> IpuConstants:
    """Constants from a JSON file (keys: :class:`IpuConstants`' attributes; missing ones keep
    the reference values; unknown keys raise ``ValueError``)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of IPU constants, got "
                         f"{type(data).__name__}")
    known = set(asdict(REFERENCE))
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown IPU constants {sorted(unknown)}; expected some of "
                         f"{sorted(known)}")
    data.setdefault("source", os.path.basename(str(path)))
    data.setdefault("calibrated", True)
    return replace(REFERENCE, **data)


def save(path, constants):
    """Write ``constants`` as JSON (what :func:`load` reads)."""
    with open(path, "w") as f:
        json.dump(asdict(constants), f, indent=2, sort_keys=True)
        f.write("\n")


@functools.lru_cache(maxsize=8)
def _from_env(path):
    return load(path) if path else REFERENCE


def current() -> IpuConstants:
    """The constants in use: the file named by :data:`CONSTANTS_ENV`, else :data:`REFERENCE`."""
    return _from_env(os.environ.get(CONSTANTS_ENV, "").strip())


def label(constants=None) -> str:
    """How to label a modelled figure: which constants it used and whether an IPU fitted them."""
    c = constants or current()
    if c.calibrated:
        return f"modelled (IPU constants calibrated: {c.source})"
    return ("modelled (reference IPU constants, not yet calibrated on an IPU: "
            "python -m popxl_flash.selfcheck --calibrate)")
