"""pytest plugin: run popxl-addons' own tests against the emulator.

Usage (from this repository's root, with a popxl-addons sdk-release-3.4 checkout)::

    POPXL_ADDONS_PATH=<checkout> PYTHONPATH=tests/addons python -m pytest -p emulator_plugin \\
        -c <checkout>/pytest.ini --rootdir <checkout> <checkout>/tests/unit

Loading the plugin puts the checkout on ``sys.path``, installs the ``mpi4py``/``popdist``/
``cppimport`` stand-ins (``standins.py``) and ``popxl_flash.emulator.install()``. The tests
that need what the emulator does not model are skipped with the reason listed in
:data:`OUT_OF_SCOPE` (mirrored in ``popxl_flash/emulator/README.md``); all others run.
"""
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATH = os.environ.get("POPXL_ADDONS_PATH", "").strip()
if not _PATH:
    raise pytest.UsageError("emulator_plugin: set POPXL_ADDONS_PATH to a popxl-addons checkout")
sys.path[:0] = [_PATH, _HERE]
from standins import install_standins  # noqa: E402

install_standins()
from popxl_flash import emulator  # noqa: E402

emulator.install()

#: {test id fragment (file or file::test): why the emulator cannot run it}.
OUT_OF_SCOPE = {}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for key, reason in OUT_OF_SCOPE.items():
            if key in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"out of the emulator's scope: {reason}"))
                break
