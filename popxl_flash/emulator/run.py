"""Run an unmodified PopXL script, module or pytest suite on the emulator.

    python -m popxl_flash.emulator.run script.py [args...]
    python -m popxl_flash.emulator.run -m pytest [pytest args...]
    python -m popxl_flash.emulator.run -m package.module [args...]

First ``popxl_flash.emulator.install(standins=True)`` (the emulator as ``popxl``/``popart``,
stand-ins for ``popdist``, ``mpi4py.MPI`` and ``cppimport``), then the script runs as
``__main__`` with ``sys.argv`` set as Python would (its folder first on ``sys.path``), or the
module as ``python -m`` runs it (the current folder first on ``sys.path``). Python processes
the script starts install the emulator too (``installer.inherit``). Exit status: the
script's.
"""
import os
import runpy
import sys

from .installer import inherit, install

USAGE = "usage: python -m popxl_flash.emulator.run (script.py | -m module) [args...]"


def main(argv=None):
    """Args: argv: the arguments after ``run`` (default ``sys.argv[1:]``). Returns: None (the
    script's ``SystemExit`` propagates)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(USAGE)
    install(standins=True)
    inherit()
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module] + args
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
