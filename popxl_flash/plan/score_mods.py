"""The static options of the score modifiers and dropout (:class:`ScoreMods`, part of the
configuration and the graph cache key) and their validation (:func:`options`). Numpy only;
the graph code is :mod:`popxl_flash.graph.score_mods`."""
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np


@dataclass(frozen=True)
class ScoreMods:
    """The static part of the score modifiers of one attention call (hashable: part of the
    configuration and the graph cache key; ``score_mod`` by identity).

    Attributes:
        softcap: ``> 0`` caps the scores (``softcap * tanh(s / softcap)``); 0 = off.
        alibi: ALiBi slopes are given (float32 ``[G]`` runtime input).
        score_mod: ``None`` or the user's function (module docstring).
        num_mod_inputs: how many ``score_mod_inputs`` tensors it takes.
        dropout: dropout probability in ``[0, 1)`` (a seed input when ``> 0``).
        mod_input_specs: ``((shape, dtype name), ...)`` of the score_mod inputs (set when the
            inputs are validated, :func:`check_extras`).
        dropout_positions: the keep mask hashes the varlen position inputs (context
            parallelism's global positions) instead of the row and column indices.
    """
    softcap: float = 0.0
    alibi: bool = False
    score_mod: Optional[Callable] = None
    num_mod_inputs: int = 0
    dropout: float = 0.0
    mod_input_specs: tuple = ()
    dropout_positions: bool = False

    @property
    def num_inputs(self):
        """Extra module inputs: slopes, seed, then the score_mod inputs."""
        return int(self.alibi) + int(self.dropout > 0) + self.num_mod_inputs

    @property
    def positions(self):
        """Whether blocks need their q/kv positions (ALiBi, score_mod)."""
        return self.alibi or self.score_mod is not None


def _real(name, value, low, high, high_open):
    """``value`` as a float in ``[low, high]`` (``high`` excluded if ``high_open``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise TypeError(f"{name} must be a real number, got {name}={value!r} "
                        f"({type(value).__name__})")
    value = float(value)
    ok = low <= value and (value < high if high_open else value <= high)
    if not np.isfinite(value) or not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name} must be in [{low}, {high}{bracket}, got {name}={value}")
    return value


def options(softcap=0.0, alibi=False, score_mod=None, num_mod_inputs=0, dropout=0.0):
    """Validate the static options; ``None`` when every feature is off (today's graphs).

    Returns:
        :class:`ScoreMods` or ``None``.
    """
    softcap = _real("softcap", 0.0 if softcap is None else softcap, 0.0,
                    float(np.finfo(np.float32).max), False)
    dropout = _real("dropout", 0.0 if dropout is None else dropout, 0.0, 1.0, True)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a callable score_mod(score, g, q_idx, kv_idx, "
                        f"*inputs) or None, got score_mod={score_mod!r} "
                        f"({type(score_mod).__name__})")
    if num_mod_inputs and score_mod is None:
        raise ValueError(f"score_mod_inputs given ({num_mod_inputs} tensors) without a "
                         "score_mod")
    mods = ScoreMods(softcap, bool(alibi), score_mod, int(num_mod_inputs), dropout)
    return mods if mods != ScoreMods() else None


# -- the dropout keep mask, in numpy --------------------------------------------------------------
#: Odd multipliers of the keep-mask hash (the golden ratio's and murmur3's constants).
HASH_ROW, HASH_COL, HASH_GROUP = 0x9E3779B1, 0x85EBCA77, 0x632BE5AB


def _hash_round(x):
    """``x (2x + 1)`` rotated by 16 bits, uint32 wrapping (numpy arrays wrap silently)."""
    y = x * (x * np.uint32(2) + np.uint32(1))
    return y // np.uint32(1 << 16) + y * np.uint32(1 << 16)


def keep_threshold(p):
    """``T = round(p * 2**32)`` within ``[1, 2**32 - 1]``: a hash ``y`` keeps iff ``y >= T``."""
    return min(max(int(round(p * 2.0 ** 32)), 1), 2 ** 32 - 1)


def keep_mask(seed, groups, rows, cols, p):
    """The dropout keep mask the graphs compute (:mod:`popxl_flash.graph.score_mods`), in numpy:
    a function of (seed, g, row, column) alone.

    Args:
        seed: uint32 ``[2]``. groups: G. rows, cols: global row and column indices (1-D,
            non-negative). p: the dropout probability.

    Returns:
        bool ``[G, len(rows), len(cols)]``.
    """
    u32 = np.uint32
    s0, s1 = (u32(w) for w in np.asarray(seed, u32).reshape(2))
    r = (np.asarray(rows, np.uint64).ravel() * HASH_ROW % 2 ** 32).astype(u32)
    c = (np.asarray(cols, np.uint64).ravel() * HASH_COL % 2 ** 32).astype(u32)
    g = (np.arange(groups, dtype=np.uint64) * HASH_GROUP % 2 ** 32).astype(u32)
    a = _hash_round(_hash_round(r[None, :, None] + s0) + s1 + g[:, None, None])  # [G, n, 1]
    b = _hash_round(_hash_round(c[None, None, :] + s0) + s1)  # [1, 1, m]
    y = (a + b) * (a * u32(2) + u32(1) + b * u32(2))
    return y >= u32(keep_threshold(p))
