"""Tests against real popxl-addons, run on the emulator.

They need a checkout of graphcore/popxl-addons (branch ``sdk-release-3.4``) named by the
environment variable ``POPXL_ADDONS_PATH`` (its root goes on ``sys.path``) and popxl-addons'
own Python dependencies (``scipy``, ``more_itertools``, ``gitpython``); without the variable the
directory is skipped, as the PyTorch tests skip without torch. ``popxl_flash.emulator.install(
standins=True)`` makes ``import popxl`` the emulator (when the SDK is importable the SDK is used
instead) and gives ``mpi4py``, ``popdist`` and ``cppimport`` their packaged stand-ins
(``popxl_flash/emulator/standins.py``).
"""
import os
import sys

import pytest

_PATH = os.environ.get("POPXL_ADDONS_PATH", "").strip()


collect_ignore = ["emulator_plugin.py"]


if _PATH:
    if not os.path.isdir(os.path.join(_PATH, "popxl_addons")):
        raise pytest.UsageError(f"POPXL_ADDONS_PATH={_PATH!r} is not a popxl-addons checkout "
                                "(no popxl_addons/ folder)")
    sys.path.insert(0, _PATH)
    from popxl_flash import emulator  # noqa: E402

    emulator.install(standins=True)
    emulator.set_strict(True)  # this project's tests refuse unspecified behaviour
