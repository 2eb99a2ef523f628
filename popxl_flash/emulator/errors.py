"""Exception types of the PopXL emulator."""


class PopartError(Exception):
    """An IR/compile error, as ``popart.popart_exception`` (derives from ``Exception``)."""


class PopartInternalError(PopartError):
    """``popart.popart_internal_exception`` (a ``popart_exception``)."""


class PopartRuntimeError(PopartError):
    """``popart.popart_runtime_error`` (a ``popart_exception``)."""


class PoplibsError(Exception):
    """``popart.poplibs_exception``: registered on its own, not a ``popart_exception``
    (``python/popart/popart_core/popart.cpp``)."""


class PoplarError(Exception):
    """``popart.poplar_exception``: registered on its own, not a ``popart_exception``."""


class PoplarRuntimeError(PoplarError):
    """``popart.poplar_runtime_error`` (a ``poplar_exception``)."""


class UndefinedValue(Exception):
    """``popxl.errors.UndefinedValue``: a tensor attribute (ipu, tile set) that is not set."""
