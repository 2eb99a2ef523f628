"""The policy for behaviour PopXL leaves unspecified at run time, by mode.

Some programs PopXL compiles and runs read values nothing defines: a remote-buffer entry no
program wrote, the index ``argmax`` returns for a row holding NaN. An IPU returns *something*;
which value is not specified. The emulator has two modes, one switch (:func:`set_strict`):

* **strict** (the default; ``install()`` and the emulator imported directly): every such case
  raises, as before, so this project's own code cannot come to rely on one.
* **choosing** (``install(standins=True)``, hence ``python -m popxl_flash.emulator.run`` and
  the pytest plugin, which run other people's PopXL code): each case takes the deterministic
  choice stated in :data:`CHOICES`, is counted in the run's
  ``RunProfile.unspecified_by_kind`` ({kind: occurrences}) and warns once per kind and
  process with :class:`UnspecifiedBehaviourWarning`, so the user sees what the script relied
  on.

The choices are the emulator's, not the device's: a result that depends on one may differ
on an IPU.
"""
import threading
import warnings

#: {kind: the deterministic choice taken in choosing mode}
CHOICES = {
    "remote_unwritten": "remote_load of a remote-buffer entry no program wrote reads zeros",
    "device_unwritten": "a program fragment reading a device value no run wrote yet reads "
                        "zeros",
    "argmax_nan": "argmax/argmin of a row holding NaN returns the first NaN's index",
    "argmax_tie": "argmax/argmin of a row with tied extremes returns the lowest tied index",
    "argmax_empty": "argmax/argmin over an empty axis returns 0",
    "dynamic_out_of_range": "dynamic_slice/dynamic_update with a start out of range clamps "
                            "the start into [0, dim - size]",
    "merged_exchange_order": "a store and a load of one remote-buffer entry merged into one "
                             "exchange without a data dependency run in creation order",
    "nll_label_out_of_range": "nll with a label outside [0, classes) that is not ignored "
                              "treats the row as ignored (it adds 0 to the loss and gets "
                              "a zero gradient; a mean divides by the kept rows when "
                              "ignore_index is set, by all rows otherwise)",
}

_STATE = {"strict": True}
_WARNED = set()
_LOCAL = threading.local()


class UnspecifiedBehaviourWarning(UserWarning):
    """A PopXL program relied on behaviour PopXL leaves unspecified; the emulator (choosing
    mode) took the choice the message states. Warned once per kind and process."""


def set_strict(strict):
    """The one switch: strict (raise on unspecified behaviour) or choosing (take the stated
    choice, count it, warn once per kind).

    Args:
        strict: bool.
    Returns:
        The previous setting (bool).
    Raises:
        TypeError: ``strict`` is not a bool.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"set_strict: strict must be a bool, got {strict!r}")
    previous, _STATE["strict"] = _STATE["strict"], strict
    return previous


def is_strict():
    """Returns: True in strict mode (the default)."""
    return _STATE["strict"]


def begin():
    """Start counting this thread's occurrences (one replica of one ``Session.run``).

    Returns:
        The dict {kind: occurrences} that :func:`occurred` fills from now on in this thread.
    """
    _LOCAL.counts = {}
    return _LOCAL.counts


def occurred(kind, error):
    """Unspecified behaviour of ``kind`` happened: raise ``error`` in strict mode, else count
    it and warn once per kind (the caller then takes ``CHOICES[kind]``).

    Args:
        kind: a key of :data:`CHOICES`.
        error: the exception strict mode raises (an instance).
    Raises:
        ``error`` in strict mode.
    """
    if _STATE["strict"]:
        raise error
    counts = getattr(_LOCAL, "counts", None)
    if counts is not None:
        counts[kind] = counts.get(kind, 0) + 1
    if kind not in _WARNED:
        _WARNED.add(kind)
        warnings.warn(UnspecifiedBehaviourWarning(
            f"{error} -- the emulator chose: {CHOICES[kind]} (counted in "
            f"RunProfile.unspecified_by_kind['{kind}']; warned once)"), stacklevel=2)
