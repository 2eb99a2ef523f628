"""Helpers of ``tests/graphcore``: Graphcore's public PopXL code as a test suite, run
unmodified on the emulator through ``python -m popxl_flash.emulator.run`` (tutorials) and the
pytest plugin (model tests).

Needs, as environment variables (like ``POPXL_ADDONS_PATH`` for ``tests/addons``):

* ``GRAPHCORE_EXAMPLES_PATH``: an extracted graphcore/examples tree (sdk-release-3.4);
* ``POPXL_ADDONS_PATH``: a popxl-addons checkout (sdk-release-3.4), put on ``PYTHONPATH``;
* for the model tests also ``EXAMPLES_UTILS_PATH``: a graphcore/examples-utils checkout (the
  models import ``examples_utils``, which is not on PyPI), and torch, transformers,
  simple-parsing (see the emulator README, "Graphcore's examples").

Without them every test here is skipped with the reason. Each script or suite runs in its own
interpreter (``subprocess``), as Graphcore's own tests run them.
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHIMS = os.path.join(HERE, "shims")


def env_path(name):
    """The directory named by environment variable ``name``, or None."""
    value = os.environ.get(name, "").strip()
    return value if value and os.path.isdir(value) else None


def require_paths(*names):
    """Skip the test unless every environment variable in ``names`` names a directory.
    Returns: their values."""
    paths = [env_path(n) for n in names]
    missing = [n for n, p in zip(names, paths) if p is None]
    if missing:
        pytest.skip(f"set {', '.join(missing)} to run Graphcore's code on the emulator")
    return paths


def run_emulated(args, cwd, python_path, timeout):
    """Run ``python -m popxl_flash.emulator.run *args`` in ``cwd`` with ``python_path``
    prepended to ``PYTHONPATH`` and this interpreter's folder to ``PATH`` (the suites' tests
    start ``python3 script.py``: it must be this interpreter, as in the virtual environment
    Graphcore's tests run in). Returns: CompletedProcess (text output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(list(python_path) + [ROOT, env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.setdefault("TQDM_DISABLE", "1")
    return subprocess.run([sys.executable, "-m", "popxl_flash.emulator.run", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
