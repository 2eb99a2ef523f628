"""Exception types of the PopXL emulator."""


class PopartError(Exception):
    """An IR/compile error, as ``popart.popart_exception`` (derives from ``Exception``)."""
