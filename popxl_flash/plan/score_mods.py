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
                        f"*inputs) or None, got {type(score_mod).__name__}")
    if num_mod_inputs and score_mod is None:
        raise ValueError(f"score_mod_inputs given ({num_mod_inputs} tensors) without a "
                         "score_mod")
    mods = ScoreMods(softcap, bool(alibi), score_mod, int(num_mod_inputs), dropout)
    return mods if mods != ScoreMods() else None
