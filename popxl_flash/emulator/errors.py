"""Exception types of the PopXL emulator."""


class PopartError(Exception):
    """An IR/compile error, as ``popart.popart_exception`` (derives from ``Exception``)."""


class UndefinedValue(Exception):
    """``popxl.errors.UndefinedValue``: a tensor attribute (ipu, tile set) that is not set."""
