"""The runner (``python -m popxl_flash.emulator.run``), the pytest plugin
(``-p popxl_flash.emulator.pytest_plugin``) and the packaged stand-ins
(``install(standins=True)``). Each case runs in a fresh interpreter."""
import os
import subprocess
import sys
import textwrap

import pytest

import popxl_flash

if popxl_flash.BACKEND != "emulator":
    pytest.skip("installs the emulator as popxl", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
import numpy as np
import popxl, popdist, cppimport.import_hook  # noqa: F401
from mpi4py import MPI
ir = popxl.Ir()
with ir.main_graph:
    x = popxl.constant(np.arange(3, dtype=np.float32))
    s = popxl.d2h_stream(x.shape, x.dtype)
    popxl.ops.host_store(s, x * 2.0)
with popxl.Session(ir, "ipu_model") as session:
    out = session.run()[s]
print("args", sys.argv[1:], "out", out.tolist(), "instances", popdist.getNumInstances())
"""


def _python(args, tmp_path, extra_path=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [extra_path, ROOT])))
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)


def test_runner_runs_an_unmodified_popxl_script(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    res = _python(["-m", "popxl_flash.emulator.run", "script.py", "--flag", "3"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "args ['--flag', '3'] out [0.0, 2.0, 4.0] instances 1" in res.stdout


def test_runner_propagates_the_scripts_exit_status(tmp_path):
    (tmp_path / "fail.py").write_text("import popxl\nraise SystemExit(3)\n")
    assert _python(["-m", "popxl_flash.emulator.run", "fail.py"], tmp_path).returncode == 3
    assert _python(["-m", "popxl_flash.emulator.run"], tmp_path).returncode != 0


def test_runner_and_plugin_run_a_pytest_suite(tmp_path):
    test = "import popxl\n\ndef test_it():\n    assert popxl.Ir().replication_factor == 1\n"
    (tmp_path / "test_suite.py").write_text(test)
    for args in (["-m", "popxl_flash.emulator.run", "-m", "pytest", "-q", "test_suite.py"],
                 ["-m", "pytest", "-q", "-p", "popxl_flash.emulator.pytest_plugin",
                  "test_suite.py"]):
        res = _python(args + ["-p", "no:cacheprovider"], tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "1 passed" in res.stdout


def test_stand_in_replaces_an_mpi4py_that_cannot_load(tmp_path):
    """PyPI's mpi4py without an MPI library raises when ``mpi4py.MPI`` is imported: the
    stand-in takes its place; a working popdist is kept."""
    pkg = tmp_path / "site" / "mpi4py"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "MPI.py").write_text("raise RuntimeError('cannot load MPI library')\n")
    (tmp_path / "site" / "popdist.py").write_text(
        "def getNumInstances():\n    return 7\n")
    code = textwrap.dedent("""
        from popxl_flash import emulator
        emulator.install(standins=True)
        from mpi4py import MPI
        import popdist
        try:
            MPI.COMM_WORLD.Barrier()
        except RuntimeError as e:
            print("stand-in:", "stand-in" in str(e))
        print("popdist", popdist.getNumInstances())
    """)
    res = _python(["-c", code], tmp_path, extra_path=str(tmp_path / "site"))
    assert res.returncode == 0, res.stderr
    assert "stand-in: True" in res.stdout and "popdist 7" in res.stdout


def test_processes_a_script_starts_run_on_the_emulator_too(tmp_path):
    """Graphcore's execution tests start ``python3 train.py``: with the runner, that child
    imports the emulator as popxl as well."""
    (tmp_path / "child.py").write_text("import popxl, popdist\nprint('child', popxl.__name__)\n")
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        "print(subprocess.run([sys.executable, 'child.py'], capture_output=True, text=True,"
        " check=True).stdout)\n")
    res = _python(["-m", "popxl_flash.emulator.run", "parent.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "child popxl_flash.emulator.popxl" in res.stdout


def test_children_given_the_parents_sys_path_as_pythonpath_run_on_the_emulator(tmp_path):
    """Graphcore's execution tests start children with ``PYTHONPATH=":".join(sys.path)``."""
    (tmp_path / "child.py").write_text("import popxl\nprint('child', popxl.__name__)\n")
    (tmp_path / "test_parent.py").write_text(
        "import os, subprocess, sys\n"
        "def test_child():\n"
        "    env = dict(os.environ, PYTHONPATH=':'.join(sys.path))\n"
        "    out = subprocess.run([sys.executable, 'child.py'], env=env, capture_output=True,"
        " text=True, check=True).stdout\n"
        "    assert 'child popxl_flash.emulator.popxl' in out\n")
    res = _python(["-m", "pytest", "-q", "-p", "popxl_flash.emulator.pytest_plugin",
                   "-p", "no:cacheprovider", "test_parent.py"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
