"""Rotary position embeddings (RoPE) in plain PopXL ops: :func:`apply_rotary`.

flash-attn's conventions (``flash_attn.layers.rotary.apply_rotary_emb``): ``x [B, L, H, D]``,
``cos``/``sin`` ``[Lro, R/2]`` tables (row ``p`` holds ``cos(p * theta_i)``,
``i < R/2``), ``R = 2 * cos.shape[1] <= D`` the rotary dimensions; the last ``D - R`` dims pass
through unchanged. Two pairings of the rotated dims::

    half-split (interleaved=False; GPT-NeoX, Llama, Hugging Face's rotate_half):
        pairs (x[i], x[i + R/2]):   out[i] = x[i] cos - x[i+R/2] sin,
                                    out[i + R/2] = x[i+R/2] cos + x[i] sin
    interleaved (interleaved=True; GPT-J, Hugging Face's rotate_every_two):
        pairs (x[2i], x[2i+1]):     out[2i] = x[2i] cos - x[2i+1] sin,
                                    out[2i+1] = x[2i+1] cos + x[2i] sin

The rotation is computed in float32 (the tables are cast to it) and the result cast back to
x's dtype. Every op is an ordinary differentiable PopXL op (slice, reshape, mul, add, concat,
cast), so ``popxl.transforms.autodiff`` and ``pf.autodiff`` differentiate it; the tables are
read with ``ops.slice`` (static positions) or ``ops.gather`` (run-time positions, which are
not differentiated: the tables are constants of the model). Run-time positions outside the
tables are clamped for the gather and their rows made NaN (:func:`guard_positions`,
:func:`poison_rows`): the IPU checks no gather index.
"""
import math
import numbers

import numpy as np

from popxl_flash.backend import popxl
from popxl_flash.plan.config import _check_int, check_bool
from popxl_flash.api.functional import check_tensors

ops = popxl.ops

__all__ = ["apply_rotary", "check_base", "check_tables", "rotary_tables", "table_rows"]


def rotary_tables(positions, rotary_dim, base=10000.0, dtype=np.float32):
    """Host tables ``(cos, sin)`` ``[positions, rotary_dim / 2]``: row ``p``, column ``i``
    holds ``cos(p * base**(-2i / rotary_dim))`` (the standard RoPE frequencies).

    Args:
        positions: the table rows (the longest sequence or cache). rotary_dim: even, ``>= 2``.
        base: the frequency base (10000 in GPT-J, GPT-NeoX and Llama): a finite real number
            ``> 0`` (``TypeError`` for a non-number, ``ValueError`` for ``base <= 0``, whose
            frequencies ``base**(-2i / rotary_dim)`` are NaN or infinite).

    Returns:
        ``(cos, sin)``: ``dtype`` arrays ``[positions, rotary_dim / 2]``.
    """
    positions = _check_int("positions", positions, low=1)
    rotary_dim = _check_int("rotary_dim", rotary_dim, low=2)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got rotary_dim={rotary_dim}")
    base = check_base(base)
    inv = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    phase = np.outer(np.arange(positions, dtype=np.float64), inv)
    return np.cos(phase).astype(dtype), np.sin(phase).astype(dtype)


def check_base(base, name="base"):
    """``base`` as a float: a finite real number ``> 0`` (bools and strings refused).

    Returns:
        The float.
    """
    value = base.item() if isinstance(base, np.generic) or (
        isinstance(base, np.ndarray) and base.ndim == 0) else base
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (the rotary frequency base, e.g. "
                        f"10000.0), got {name}={base!r} ({type(base).__name__})")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0 (the rotary frequency base, e.g. "
                         f"10000.0; the frequencies base**(-2i / rotary_dim) are NaN or "
                         f"infinite otherwise), got {name}={value!r}")
    return value


def check_tables(cos, sin, head_dim, name_cos="cos", name_sin="sin"):
    """Raise unless ``cos``, ``sin`` are float tensors of one shape ``[Lro, R/2]`` with
    ``2 <= R <= head_dim``.

    Returns:
        ``(Lro, R)``.
    """
    check_tensors(**{name_cos: cos, name_sin: sin})
    shape = tuple(cos.shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{name_cos} must have rank 2 [Lro, rotary_dim / 2], got shape {shape}")
    if tuple(sin.shape) != shape:
        raise ValueError(f"{name_sin} must have the shape of {name_cos} {shape}, got "
                         f"{name_sin} shape {tuple(sin.shape)}")
    for name, t in ((name_cos, cos), (name_sin, sin)):
        if t.dtype.name not in ("float16", "float32"):
            raise TypeError(f"{name} must be float16 or float32, got dtype {t.dtype.name}")
    if 2 * shape[1] > head_dim:
        raise ValueError(f"{name_cos} has {shape[1]} columns: rotary_dim = {2 * shape[1]} must "
                         f"be at most the head dim D={head_dim}")
    return shape[0], 2 * shape[1]


def table_rows(table, positions, rows):
    """The table rows at ``positions``, float32.

    Args:
        table: ``[Lro, R/2]``. positions: an int (rows ``positions .. positions + rows - 1``)
            or an int32 tensor (its shape + ``[R/2]``: one gathered row per position).
        rows: the sequence length (with an int offset).
    """
    if isinstance(positions, popxl.Tensor):
        out = ops.gather(table, positions, axis=0)
    else:
        out = ops.slice(table, start=[positions], stop=[positions + rows], axis=[0])
    return out if out.dtype == popxl.float32 else ops.cast(out, popxl.float32)


def _check_positions(positions, B, L, Lro):
    """``None`` -> 0; an int offset with ``offset + L <= Lro``; or an int32 tensor ``[L]`` or
    ``[B, L]`` (run time; values outside ``[0, Lro)`` give NaN rows, :func:`guard_positions`)."""
    if positions is None:
        positions = 0
    if isinstance(positions, popxl.Tensor):
        check_tensors(positions=positions)
        if positions.dtype.name != "int32":
            raise TypeError(f"positions must be an int32 tensor [L={L}] or [B={B}, L={L}], got "
                            f"dtype {positions.dtype.name}")
        if tuple(positions.shape) not in ((L,), (B, L)):
            raise ValueError(f"positions must have shape [L={L}] or [B={B}, L={L}], got shape "
                             f"{tuple(positions.shape)}")
        return positions
    offset = _check_int("positions", positions, low=0)
    if offset + L > Lro:
        raise ValueError(f"positions={offset} with L={L} rows reads table rows up to "
                         f"{offset + L - 1}, but cos/sin have Lro={Lro} rows")
    return offset


def rotate(x, cos_rows, sin_rows, interleaved):
    """Rotate ``x [..., L, H, D]`` with float32 table rows broadcastable to
    ``[..., L, 1, R/2]`` (already laid out by the caller). Returns x's shape and dtype."""
    D, half = x.shape[-1], cos_rows.shape[-1]
    R = 2 * half
    dtype = x.dtype
    xf = x if dtype == popxl.float32 else ops.cast(x, popxl.float32)
    lead = tuple(xf.shape[:-1])
    rot = xf if R == D else ops.slice(xf, start=[0], stop=[R], axis=[len(lead)])
    if interleaved:  # pairs (2i, 2i+1): [..., R/2, 2]
        pairs = rot.reshape(lead + (half, 2))
        even = ops.slice(pairs, start=[0], stop=[1], axis=[len(lead) + 1])
        odd = ops.slice(pairs, start=[1], stop=[2], axis=[len(lead) + 1])
        c = cos_rows.reshape(tuple(cos_rows.shape) + (1,))
        s = sin_rows.reshape(tuple(sin_rows.shape) + (1,))
        out = ops.concat([even * c - odd * s, odd * c + even * s], axis=len(lead) + 1)
        out = out.reshape(lead + (R,))
    else:  # pairs (i, i + R/2)
        first = ops.slice(rot, start=[0], stop=[half], axis=[len(lead)])
        second = ops.slice(rot, start=[half], stop=[R], axis=[len(lead)])
        out = ops.concat([first * cos_rows - second * sin_rows,
                          second * cos_rows + first * sin_rows], axis=len(lead))
    if R < D:
        out = ops.concat([out, ops.slice(xf, start=[R], stop=[D], axis=[len(lead)])],
                         axis=len(lead))
    return out if dtype == popxl.float32 else ops.cast(out, dtype)


def apply_rotary(x, cos, sin, *, interleaved=False, positions=None):
    """Rotary position embeddings on ``x [B, L, H, D]`` in plain PopXL ops (no custom op).

    Args:
        x: ``[B, L, H, D]`` float16 or float32 (flash-attn's layout; q or k of a layer).
        cos, sin: float16/float32 tensors ``[Lro, R/2]``, ``R <= D`` the rotated dims (the
            rest pass through); :func:`rotary_tables` makes the standard ones on the host.
        interleaved: ``False``: half-split pairs ``(i, i + R/2)`` (GPT-NeoX, Llama);
            ``True``: adjacent pairs ``(2i, 2i+1)`` (GPT-J). flash-attn's name and default.
        positions: the position of each row: ``None`` (rows ``0 .. L-1``), an int offset
            (rows ``p .. p + L - 1``, flash-attn's ``seqlen_offsets``; past the tables:
            ``ValueError``), or an int32 run-time tensor ``[L]`` or ``[B, L]`` with values in
            ``[0, Lro)``: a row whose position is outside (negative, or ``>= Lro``) comes out
            NaN (all of its heads and dims), an invalid operation that floating-point checks
            trap (scope ``positions_out_of_range``), as the KV cache's out-of-range
            ``cache_seqlens``; the other rows are unchanged.

    Returns:
        The rotated x, its shape and dtype (computed in float32).
    """
    check_tensors(x=x)
    shape = tuple(x.shape)
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"x must have rank 4 [B, L, H, D] with non-empty dims, got shape "
                         f"{shape}")
    if x.dtype.name not in ("float16", "float32"):
        raise TypeError(f"x must be float16 or float32, got dtype {x.dtype.name}")
    B, L, _, D = shape
    Lro, _ = check_tables(cos, sin, D)
    interleaved = check_bool("interleaved", interleaved)
    positions = _check_positions(positions, B, L, Lro)
    with popxl.name_scope("apply_rotary"):
        bad = None
        if isinstance(positions, popxl.Tensor):
            bad, positions = guard_positions(positions, Lro)
        c, s = (table_rows(t, positions, L) for t in (cos, sin))  # [(B,) L, R/2]
        lead = (B, L) if len(c.shape) == 3 else (1, L)
        c, s = (t.reshape(lead + (1, t.shape[-1])) for t in (c, s))
        out = rotate(x, c, s, interleaved)
        return out if bad is None else poison_rows(out, bad, lead)


def guard_positions(positions, rows):
    """Run-time positions outside ``[0, rows)`` (the IPU checks no gather index).

    Args:
        positions: int32 ``[L]`` or ``[B, L]``. rows: the tables' ``Lro``.

    Returns:
        ``(bad, clamped)``: bool, ``positions``' shape, where a position is out of range; the
        positions clamped into ``[0, rows)``, so the gather reads a table row (which
        :func:`poison_rows` then turns to NaN).
    """
    i32 = popxl.int32
    low, high = popxl.constant(np.int32(0), i32), popxl.constant(np.int32(rows - 1), i32)
    low_bad, high_bad = ops.greater(low, positions), ops.greater(positions, high)
    clamped = ops.where(low_bad, low, ops.where(high_bad, high, positions))
    return ops.logical_or(low_bad, high_bad), clamped


def poison_rows(out, bad, lead):
    """``out [B, L, H, D]`` NaN in the rows ``bad`` (bool ``[L]`` or ``[B, L]``), unchanged
    elsewhere.

    The NaN is ``sqrt(-1)``, an invalid operation: with floating-point checks on
    (:func:`popxl_flash.enable_floating_point_checks`) the run stops there (in the name scope
    ``positions_out_of_range``); without, the rows read NaN, never a plausible rotation (as the
    KV cache's out-of-range ``cache_seqlens``).

    Args:
        lead: ``(B, L)`` or ``(1, L)``, the leading dims ``bad`` broadcasts to.
    """
    f32 = popxl.float32
    with popxl.name_scope("positions_out_of_range"):  # what a trap's message names
        nan = ops.sqrt(ops.where(bad, popxl.constant(np.float32(-1.0), f32),
                                 popxl.constant(np.float32(0.0), f32)))
    add = nan if out.dtype == f32 else ops.cast(nan, out.dtype)
    return out + add.reshape(lead + (1, 1))
