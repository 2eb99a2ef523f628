"""Graphcore's PopXL tutorials 1-3 (graphcore/examples ``tutorials/tutorials/popxl``), each
script run unmodified on the emulator, checked as Graphcore's own tests check them (exit
status 0, "Accuracy on test set" above 90 %).

MNIST cannot be downloaded here (no network) and torchvision is not installed: the scripts
get the stand-in of ``shims/torchvision`` (a synthetic, learnable MNIST-shaped data set of
6,000 training and 1,000 test images), so the accuracies are on that data set.
"""
import os
import re

import pytest

from graphcore_run import SHIMS, require_paths, run_emulated

TUTORIALS = "tutorials/tutorials/popxl"
SCRIPTS = [("1_basic_concepts", "mnist_template.py"), ("1_basic_concepts", "mnist.py"),
           ("2_custom_optimiser", "mnist_template.py"), ("2_custom_optimiser", "mnist.py"),
           ("3_data_parallelism", "mnist.py")]


@pytest.mark.parametrize("folder,script", SCRIPTS, ids=[f"{f}/{s}" for f, s in SCRIPTS])
def test_tutorial_trains_to_completion(folder, script):
    examples, addons = require_paths("GRAPHCORE_EXAMPLES_PATH", "POPXL_ADDONS_PATH")
    pytest.importorskip("torch")
    cwd = os.path.join(examples, TUTORIALS, folder)
    res = run_emulated([script], cwd, [SHIMS, addons], timeout=3600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = re.findall(r"Accuracy on test set: ([\d.]+)", res.stdout)
    assert found, res.stdout[-3000:]
    assert float(found[-1]) > 90
