"""pytest plugin: run an unmodified PopXL test suite on the emulator.

    python -m pytest -p popxl_flash.emulator.pytest_plugin <tests>

Loading the plugin (before pytest collects anything) calls
``popxl_flash.emulator.install(standins=True)``: ``import popxl``/``import popart`` give the
emulator, and ``popdist``, ``mpi4py.MPI`` and ``cppimport`` get their stand-ins where needed
(``standins.py``); Python processes the tests start (``subprocess``) install them too. When a
real PopXL is importable nothing is changed and the suite runs on the SDK.
"""
from .installer import inherit, install

INSTALLED = install(standins=True)
if INSTALLED:
    inherit()  # Python processes the tests start run on the emulator too


def pytest_report_header(config):
    """One header line saying which PopXL the run uses."""
    return "popxl: " + ("popxl_flash emulator (install(standins=True))" if INSTALLED
                        else "the SDK's (a real popxl is importable)")
