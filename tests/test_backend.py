"""Backend selection by POPXL_FLASH_BACKEND (checked in fresh interpreters: it runs at import)."""
import os
import subprocess
import sys

import pytest

def _real_popxl_importable():
    """Whether a fresh interpreter (the one the tests below start) finds a ``popxl``: asked
    there, because in this process the emulator may stand in for it (``tests/addons``'
    conftest installs it as ``popxl`` when ``POPXL_ADDONS_PATH`` is set)."""
    result = subprocess.run([sys.executable, "-c", "import importlib.util; "
                             "print(importlib.util.find_spec('popxl') is not None)"],
                            capture_output=True, text=True, check=True)
    return result.stdout.strip() == "True"


HAVE_POPXL = _real_popxl_importable()


def _import_with(value):
    env = dict(os.environ, POPXL_FLASH_BACKEND=value)
    return subprocess.run([sys.executable, "-c", "import popxl_flash as pf; print(pf.BACKEND)"],
                          env=env, capture_output=True, text=True)


def test_emulator_forced():
    result = _import_with("emulator")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "emulator"


def test_auto_picks_what_is_importable():
    result = _import_with("auto")
    assert result.stdout.strip() == ("popxl" if HAVE_POPXL else "emulator"), result.stderr


@pytest.mark.skipif(HAVE_POPXL, reason="the real SDK is installed")
def test_popxl_requested_but_absent_is_import_error():
    result = _import_with("popxl")
    assert result.returncode != 0
    assert "ImportError: POPXL_FLASH_BACKEND=popxl" in result.stderr


def test_unknown_backend_is_value_error():
    result = _import_with("ipu9000")
    assert "ValueError: POPXL_FLASH_BACKEND='ipu9000' is not supported" in result.stderr


def test_emulator_is_the_module_in_use():
    import popxl_flash as pf
    if pf.BACKEND == "emulator":
        from popxl_flash.emulator import popxl
        assert pf.popxl is popxl
