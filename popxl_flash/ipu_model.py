"""The IPU time model: PopART's lowering (:mod:`popxl_flash.lowering`) priced at poplibs' rates.

Every figure this library calls *modelled* comes from one formula::

    cycles = compute_set_cycles * compute_sets
           + sum over dtypes of matmul_flops[dtype] / (tiles * matmul_flops_per_tile_cycle[dtype])
           + sum over rate keys of vector_work[key]  / (tiles * vector_rates[key])
           + bytes_copied                            / (tiles * copy_bytes_per_tile_cycle)
    seconds = cycles / clock_hz

*compute_sets*, *vector_work* (elements by rate key, :data:`popxl_flash.lowering.RATE_KEYS`)
and *bytes_copied* follow the lowering table per executed op, plus the copies at call, branch
and loop boundaries; *matmul_flops* count 2 per multiply-add. The emulator's run profile
measures them for any PopXL program (``RunProfile.work``); the planner predicts them for its
structures (:mod:`popxl_flash.plan.counts`).

The constants live in :class:`IpuConstants`; :data:`REFERENCE` holds the reference values, each
with its source. Until ``python -m popxl_flash.selfcheck --calibrate`` has run on an IPU they
are PopART's lowering priced at poplibs' cycle estimates, not measurements: :data:`BOX` is the
plausible range of each, and :func:`corners` its corners, over which the automatic choice is
kept near-best. A JSON file written by ``--calibrate`` overrides them: name it with the
environment variable :data:`CONSTANTS_ENV` (or pass it to :func:`load`).

This module imports only :mod:`popxl_flash.lowering`: the emulator and the planner both read it.
"""
import functools
import itertools
import json
import os
from dataclasses import asdict, dataclass, field, replace

from popxl_flash.lowering import RATE_KEYS

#: Environment variable naming a JSON file of fitted constants (``--calibrate`` writes it).
CONSTANTS_ENV = "POPXL_FLASH_IPU_CONSTANTS"


@dataclass(frozen=True)
class IpuConstants:
    """The constants of the model.

    Attributes:
        compute_set_cycles: cycles of one compute set with its sync and exchange: 350. An
            on-tile compute set measured on hardware costs 285-335 cycles (tessellate-ipu
            ``core/tile_interpreter_hw_primitives.py:110-115`` and its notebooks); poplibs'
            planners add 90 per sync and 100 per exchange (``lib/popnn/CTCLossPlan.cpp:309-351``).
        matmul_flops_per_tile_cycle: ``{dtype: FLOPs per tile-cycle}``: 128 float16 (GC200's
            250 TFLOP/s over 1472 tiles at 1.33 GHz; that peak is for half partials, and PopXL's
            default partials are float: ``python/popxl/python_files/ops/matmul.py:54-56``, so
            64 is in the box), 32 float32 (62.5 TFLOP/s).
        vector_rates: elements per tile-cycle by rate key: arithmetic float16 4/3, float32 2/3;
            transcendental float16 1.0, float32 1/3; cast 2 (poplibs
            ``lib/popops/popopsCycleEstimators.cpp:63-85``,
            ``lib/popops/PerformanceEstimation.cpp:287-311``; a hardware run in tessellate-ipu
            agrees for float32 add).
        copy_bytes_per_tile_cycle: 4: cross-tile exchange, 8 TB/s over 1472 tiles at 1.33 GHz.
        tiles: 1472 (GC200); clock_hz: 1.33 GHz (IPU-M2000); tile_memory_bytes: 624 KiB.
        source: where the values come from (``"reference"`` or a calibration file).
        calibrated: fitted on an IPU (``--calibrate``) rather than the reference values.
    """

    compute_set_cycles: float = 350.0
    matmul_flops_per_tile_cycle: dict = field(
        default_factory=lambda: {"float16": 128.0, "float32": 32.0})
    vector_rates: dict = field(default_factory=lambda: {
        "arithmetic.float16": 4 / 3, "arithmetic.float32": 2 / 3,
        "transcendental.float16": 1.0, "transcendental.float32": 1 / 3, "cast": 2.0})
    copy_bytes_per_tile_cycle: float = 4.0
    tiles: int = 1472
    clock_hz: float = 1.33e9
    tile_memory_bytes: int = 624 * 1024
    source: str = "reference"
    calibrated: bool = False

    @property
    def device_bytes(self) -> int:
        """In-processor memory of one IPU: tiles x tile memory."""
        return self.tiles * self.tile_memory_bytes


#: The reference constants (each attribute's source is stated above).
REFERENCE = IpuConstants()

#: The plausible box of the uncalibrated constants: compute-set cycles, a common factor on
#: the vector rates, the float16 matmul rate (64 with float partials) and the copy rate.
BOX = {"compute_set_cycles": (250.0, 600.0), "vector_scale": (0.5, 1.5),
       "matmul_float16": (64.0, 128.0), "copy_bytes_per_tile_cycle": (2.0, 8.0)}


def corners(constants=None):
    """The 16 corners of :data:`BOX` around ``constants`` (default :func:`current`).

    Returns:
        list of ``(label, IpuConstants)``.
    """
    c = constants or current()
    out = []
    for cs, vs, mm, cp in itertools.product(*BOX.values()):
        label = f"c_cs {cs:g}, vector x{vs:g}, float16 matmul {mm:g}, copies {cp:g}"
        out.append((label, replace(
            c, compute_set_cycles=cs, copy_bytes_per_tile_cycle=cp,
            vector_rates={k: r * vs for k, r in c.vector_rates.items()},
            matmul_flops_per_tile_cycle={**c.matmul_flops_per_tile_cycle, "float16": mm})))
    return out


@dataclass(frozen=True)
class WorkCounts:
    """Counted work the model prices (what the emulator's run profile measures).

    Attributes:
        compute_sets: executed compute sets.
        matmul_flops: ``{dtype: FLOPs}`` (2 per multiply-add).
        vector_work: ``{rate key: elements}`` (:data:`popxl_flash.lowering.RATE_KEYS`).
        bytes_copied: Copy programs' bytes: outplace views, op copies, boundary copies.
        ops: executed ops other than views, where a planner counts ops (0 otherwise; not
            priced: the compute sets are).
    """

    compute_sets: float = 0
    matmul_flops: dict = field(default_factory=dict)
    vector_work: dict = field(default_factory=dict)
    bytes_copied: float = 0
    ops: int = 0

    def __add__(self, other):
        return WorkCounts(self.compute_sets + other.compute_sets,
                          _add(self.matmul_flops, other.matmul_flops),
                          _add(self.vector_work, other.vector_work),
                          self.bytes_copied + other.bytes_copied, self.ops + other.ops)

    def scaled(self, times):
        """Returns: this work ``times`` times."""
        return WorkCounts(self.compute_sets * times,
                          {k: v * times for k, v in self.matmul_flops.items()},
                          {k: v * times for k, v in self.vector_work.items()},
                          self.bytes_copied * times, self.ops * times)

    @property
    def vector_elements(self):
        """Vector work summed over rate keys."""
        return sum(self.vector_work.values())


def _add(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


@dataclass(frozen=True)
class ModelledTime:
    """Modelled time of some counted work, by term (cycles) and in all.

    Attributes:
        compute_set_cycles, matmul_cycles, vector_cycles, copy_cycles: the four terms.
        clock_hz: to convert to seconds.
    """

    compute_set_cycles: float
    matmul_cycles: float
    vector_cycles: float
    copy_cycles: float
    clock_hz: float

    @property
    def cycles(self) -> float:
        return self.compute_set_cycles + self.matmul_cycles + self.vector_cycles + self.copy_cycles

    @property
    def seconds(self) -> float:
        return self.cycles / self.clock_hz

    def __add__(self, other):
        return ModelledTime(self.compute_set_cycles + other.compute_set_cycles,
                            self.matmul_cycles + other.matmul_cycles,
                            self.vector_cycles + other.vector_cycles,
                            self.copy_cycles + other.copy_cycles, self.clock_hz)

    def terms_text(self) -> str:
        """``"compute sets a us, matmul b us, vector c us, copies d us"`` (modelled)."""
        us = 1e6 / self.clock_hz
        return (f"compute sets {self.compute_set_cycles * us:.1f} us, matmul "
                f"{self.matmul_cycles * us:.1f} us, vector {self.vector_cycles * us:.1f} us, "
                f"copies {self.copy_cycles * us:.1f} us")


def time(work, constants=None) -> ModelledTime:
    """The model applied to ``work``.

    Args:
        work: a :class:`WorkCounts` (the emulator's ``RunProfile.work``, or the planner's).
        constants: :class:`IpuConstants` (default: :func:`current`).

    Returns:
        :class:`ModelledTime`.
    """
    c = constants or current()
    t = c.tiles
    return ModelledTime(
        compute_set_cycles=c.compute_set_cycles * work.compute_sets,
        matmul_cycles=sum(f / (t * c.matmul_flops_per_tile_cycle[_dtype(d)])
                          for d, f in work.matmul_flops.items()),
        vector_cycles=sum(n / (t * c.vector_rates[k]) for k, n in work.vector_work.items()),
        copy_cycles=work.bytes_copied / (t * c.copy_bytes_per_tile_cycle),
        clock_hz=c.clock_hz)


def _dtype(name):
    return "float16" if str(name) == "float16" else "float32"


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
    rates = data.get("vector_rates", {})
    if not isinstance(rates, dict) or set(rates) - set(RATE_KEYS):
        raise ValueError(f"{path}: vector_rates must map some of {list(RATE_KEYS)} to elements "
                         f"per tile-cycle, got {rates!r}")
    data["vector_rates"] = {**REFERENCE.vector_rates, **rates}
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
    return ("modelled (PopART's lowering priced at poplibs' estimates, not yet calibrated on an "
            "IPU: python -m popxl_flash.selfcheck --calibrate)")
