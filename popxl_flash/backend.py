"""Pick the PopXL module the library builds graphs with.

``POPXL_FLASH_BACKEND`` selects it:

* ``auto`` (default): the real ``popxl`` from the Poplar SDK when it imports, else the bundled
  CPU emulator :mod:`popxl_flash.emulator.popxl`;
* ``popxl``: the real SDK, or an ``ImportError`` saying how to get it;
* ``emulator``: always the emulator, even where the SDK is installed.

Library modules import popxl only through :data:`popxl` here, so the same code and the same tests
run on an IPU, on the IPU model, and on the emulator.
"""
import importlib
import os

ENV_VAR = "POPXL_FLASH_BACKEND"
CHOICES = ("auto", "popxl", "emulator")


def _select(choice):
    """Return ``(module, name)`` for a backend choice (one of :data:`CHOICES`)."""
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r} is not supported; expected one of {CHOICES}")
    if choice in ("auto", "popxl"):
        try:
            mod = importlib.import_module("popxl")
            if mod.__name__ == "popxl_flash.emulator.popxl":  # popxl_flash.emulator.install()
                return mod, "emulator"
            return mod, "popxl"
        except ImportError as err:
            if choice == "popxl":
                raise ImportError(
                    f"{ENV_VAR}=popxl asks for the Poplar SDK's popxl module, which cannot be "
                    "imported here. Enable the Poplar SDK (source its enable script and install "
                    f"its popxl wheel), or set {ENV_VAR}=emulator to use the bundled CPU emulator."
                ) from err
    return importlib.import_module("popxl_flash.emulator.popxl"), "emulator"


popxl, BACKEND = _select(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto")
