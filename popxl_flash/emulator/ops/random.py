"""Random ops: ``random_uniform``, ``random_normal``, ``dropout``, ``split_random_seed``.

Signatures and refusals follow PopXL 3.4 (``ops/random.py``, ``ops/dropout.py``,
``ops/random_seed.py``; ``willow/src/op/randombase.cpp``, ``dropoutbase.cpp``,
``modifyrandomseed.cpp``; lowerings ``popx/op/randomuniformx.cpp``, ``dropoutx.cpp``,
``modifyrandomseedx.cpp``). A seed is a uint32 ``[2]`` tensor.

The values are a deterministic function of the seed's value, the op and its static attributes
(the emulator's own generator, numpy's ``default_rng`` keyed by the seed words): the same seed
gives the same values in any graph, a different seed different values. They are *not* the IPU's
bits (poprand's generator is not modelled); code may rely only on what holds on the IPU too:
same seed, same op, same shape -> same values (the lowerings map their outputs linearly,
independent of the graph).

``split_random_seed(seed, n)`` is PopXL's: ``n`` seeds ``create_random_seed(seed, i)``, where
PopART's ModifyRandomSeed keeps the first word and replaces the second by a random int32 drawn
from the seed ``[L, R + i]``, cast to uint32. ``create_random_seed`` itself is not a public
``popxl.ops`` name in 3.4 (``ops/__init__.py`` imports only ``split_random_seed``); it is
reachable as ``popxl.ops.random_seed.create_random_seed``, as in PopXL.
"""
import numpy as np

from .. import dtypes
from ..context import gcg
from ..errors import PopartError
from ..ir import check_in_graph
from ..registry import COMPILE_CHECKS, emit, register
from ..tensor import constant
from ._common import FLOATS, int_vector, scalar_value

_U32 = 1 << 32


def _rng(seed, salt):
    """The emulator's generator for a seed value ``[L, R]`` and an op salt (int)."""
    words = [int(w) for w in np.asarray(seed, np.uint32).reshape(2)]
    return np.random.default_rng([words[0], words[1], salt])


#: Salts separating the streams of the op kinds (same seed, different op -> unrelated values).
_SALT = {"random_uniform": 1, "random_normal": 2, "dropout": 3, "modify_random_seed": 4}


def uniform_values(seed, shape):
    """The emulator's uniform ``[0, 1)`` float64 samples for a seed value (``random_uniform``
    and ``dropout`` draw from it). Args: seed: uint32 ``[2]`` array; shape: tuple."""
    return _rng(seed, _SALT["random_uniform"]).random(shape)


def _check_seed(op):
    """The lowerings hand the seed to poprand, which takes two uint32 words."""
    seed = op.inputs[-1]
    if seed.dtype != dtypes.uint32 or seed.shape != (2,):
        raise PopartError(f"{op.kind}: seed tensor {seed.id} must be uint32 [2] (poprand), got "
                          f"{seed.dtype.name} {list(seed.shape)}")


# -- random_uniform / random_normal -----------------------------------------------------------
def _random_rule(seed, shape, a, b, dtype):
    return [(shape, dtype)]  # ShapeOrLikeOp::setupWithShape takes any dtype


def _random_uniform(seed, shape, a, b, dtype):
    if dtype == dtypes.int32:  # poprand's integer uniform: [low, high], both included
        return _rng(seed, _SALT["random_uniform"]).integers(int(a), int(b), size=shape,
                                                            endpoint=True).astype(np.int32)
    u = uniform_values(seed, shape)
    return (a + (b - a) * u).astype(dtype.as_numpy())


def _random_normal(seed, shape, a, b, dtype):
    z = _rng(seed, _SALT["random_normal"]).standard_normal(shape)
    return (a + b * z).astype(dtype.as_numpy())


def _check_random(op):
    """The lowering hands the output type to poprand: ``uniform`` takes float16, float32 and
    int32 (integral bounds, ``low <= high``: other bounds are unspecified here), ``normal``
    float16 and float32 only."""
    _check_seed(op)
    dtype, a, b = op.attrs["dtype"], op.attrs["a"], op.attrs["b"]
    allowed = FLOATS | ({dtypes.int32} if op.kind == "random_uniform" else set())
    if dtype not in allowed:
        raise PopartError(f"{op.kind}: poprand does not generate {dtype.name} (allowed: "
                          f"{sorted(d.name for d in allowed)})")
    if dtype == dtypes.int32 and not (float(a).is_integer() and float(b).is_integer()
                                      and a <= b):
        raise PopartError(f"{op.kind}: int32 bounds must be integral with low <= high, got "
                          f"[{a}, {b}] (unspecified otherwise)")


register("random_uniform", _random_rule, _random_uniform)
register("random_normal", _random_rule, _random_normal)
COMPILE_CHECKS["random_uniform"] = COMPILE_CHECKS["random_normal"] = _check_random


def _random(kind, seed_tensor, shape, a, b, dtype):
    if dtype is None:  # convert_optional_dtype -> unset; ShapeOrLikeOp::setupWithShape: FLOAT
        dtype = dtypes.float32
    if not isinstance(dtype, dtypes.dtype):
        raise AttributeError(f"{kind}: dtype must be a popxl dtype, got {dtype!r}")
    shape = dtypes.check_shape(int_vector(kind, "shape", shape), kind)
    a, b = scalar_value(kind, "low/mean", a), scalar_value(kind, "high/std", b)
    return emit(kind, {"seed_tensor": seed_tensor},
                {"shape": shape, "a": a, "b": b, "dtype": dtype}, names=[f"{kind}_out"])[0]


def random_uniform(seed_tensor, shape, low=0.0, high=1.0, dtype=dtypes.float32):
    """Uniform samples in ``[low, high)``.

    Args:
        seed_tensor: uint32 ``[2]`` (checked when the Session compiles, as poprand does).
        shape: output shape. low, high: floats. dtype: float16, float32 or int32 (None:
            float32; others refused when the Session compiles, as poprand does).

    Returns:
        Tensor of ``shape``: a deterministic function of the seed's value (module docstring);
        int32: integers in ``[low, high]``.
    """
    return _random("random_uniform", seed_tensor, shape, low, high, dtype)


def random_normal(seed_tensor, shape, mean=0.0, std=1.0, dtype=dtypes.float32):
    """Normal samples. Args: as :func:`random_uniform` with ``mean``, ``std``. Returns: Tensor."""
    return _random("random_normal", seed_tensor, shape, mean, std, dtype)


# -- dropout ------------------------------------------------------------------------------------
def _dropout_rule(t, seed, p):
    return [(t.shape, t.dtype)]  # DropoutOp::setup copies the input's info


def keep_mask(seed, shape, p):
    """The emulator's dropout keep mask: ``uniform_values(seed, shape) >= p`` (bool)."""
    return uniform_values(seed, shape) >= p


def _dropout(a, seed, p):
    if p == 0.0:  # PopART replaces ratio-0 dropout by the identity (OpToIdentity pattern)
        return a.copy()
    keep = keep_mask(seed, a.shape, p)
    scaled = a.astype(np.float32) * np.float32(1.0 / (1.0 - p))
    return np.where(keep, scaled, 0).astype(a.dtype)


def _check_ratio(op):
    """Seed, input type (poprand's dropout takes float16/float32) and ratio, as the lowering
    sees them."""
    _check_seed(op)
    if op.inputs[0].dtype not in FLOATS:
        raise PopartError(f"dropout of {op.inputs[0].id}: poprand::dropout takes float16 or "
                          f"float32, got {op.inputs[0].dtype.name}")
    p = op.attrs["p"]
    if not 0.0 <= p < 1.0:  # popxl's DropoutOp bypasses validateRatioAttribute: lowering's call
        raise PopartError(f"dropout: ratio value {p} is not valid. Please use a value in the "
                          "interval [0,1)")


register("dropout", _dropout_rule, _dropout)
COMPILE_CHECKS["dropout"] = _check_ratio


def dropout(t, seed_tensor, p):
    """Zero each element of ``t`` with probability ``p``, scale the rest by ``1 / (1 - p)``.

    Args:
        t: float16/float32 tensor. seed_tensor: uint32 ``[2]``. p: float in ``[0, 1)``
            (outside: error when the Session compiles).

    Returns:
        Tensor like ``t``; the keep mask is :func:`keep_mask` of the seed's value.
    """
    p = scalar_value("dropout", "p", p)
    return emit("dropout", {"t": t, "seed_tensor": seed_tensor}, {"p": p},
                names=["dropout_out"])[0]


# -- seeds --------------------------------------------------------------------------------------
def _modify_rule(seed, modifier):
    if seed.dtype != dtypes.uint32 or seed.shape != (2,):
        raise PopartError(f"Expected {seed.id} to be a tensor of type uint32 [2] (found "
                          f"{seed.dtype.name} {list(seed.shape)})")
    if modifier.dtype != dtypes.uint32 or modifier.shape != ():
        raise PopartError(f"Expected {modifier.id} to be a tensor of type uint32 [] (found "
                          f"{modifier.dtype.name} {list(modifier.shape)})")
    return [((2,), dtypes.uint32)]


def _modify(seed, modifier):
    left, right = int(seed[0]), int(seed[1])
    meta = np.array([left, (right + int(modifier)) % _U32], np.uint32)
    drawn = _rng(meta, _SALT["modify_random_seed"]).integers(-2 ** 31, 2 ** 31)
    return np.array([left, int(drawn) % _U32], np.uint32)


register("modify_random_seed", _modify_rule, _modify)


def _create_random_seed(seed, modifier):
    """PopXL's ``popxl.ops.random_seed.create_random_seed`` (not a public ``ops`` name in 3.4):
    a ModifyRandomSeed of ``seed`` (uint32 ``[2]``, else ValueError) by ``modifier`` (uint32
    scalar tensor, checked by the op's setup)."""
    check_in_graph(gcg(), seed=seed, modifier=modifier)  # before the shape check, as PopXL
    if seed.shape != (2,) or seed.dtype != dtypes.uint32:
        raise ValueError(f"seed Tensor must be shape=(2,) dtype=uint32. Provided {seed}")
    return emit("modify_random_seed", {"seed": seed, "modifier": modifier},
                names=["modified_seed"])[0]


def split_random_seed(seed, n=2):
    """``n`` new seeds from ``seed`` (uint32 ``[2]``, else ``ValueError``), as PopXL: seed
    ``i`` is ``create_random_seed(seed, constant(i, uint32))``.

    Returns:
        tuple of ``n`` uint32 ``[2]`` tensors.
    """
    return tuple(_create_random_seed(seed, constant(i, dtypes.uint32)) for i in range(n))
