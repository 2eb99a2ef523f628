"""The model tests of Graphcore's PopXL BERT, T5, GPT-J, Llama and Dolly (graphcore/examples
``nlp/<model>/popxl/tests``), run unmodified on the emulator with the pytest plugin, each
suite in its own interpreter. A suite passes here when at least the tests the emulator README
lists as passing ("Graphcore's examples") pass, so a regression in the emulator fails it.

The models' configuration dataclasses use mutable defaults that Python 3.11 refuses, and they
import ``examples_utils`` (graphcore/examples-utils, not on PyPI), torch and transformers: the
suites are skipped on Python 3.11 or later, or without ``EXAMPLES_UTILS_PATH``.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET

import pytest

from graphcore_run import require_paths, run_emulated

#: tests of each suite that pass on the emulator (the README says why the others do not)
EXPECTED = {}


def _outcomes(junit):
    """{test id: "passed" | "failed" | "skipped"} from a junit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = ("failed" if kinds & {"failure", "error"} else
                     "skipped" if "skipped" in kinds else "passed")
    return out


@pytest.mark.parametrize("model", ["bert", "t5", "gpt_j", "llama", "dolly"])
def test_model_suite(model, tmp_path):
    if sys.version_info >= (3, 11):
        pytest.skip("the models' config dataclasses have mutable defaults (Python < 3.11)")
    examples, addons, utils = require_paths("GRAPHCORE_EXAMPLES_PATH", "POPXL_ADDONS_PATH",
                                            "EXAMPLES_UTILS_PATH")
    for module in ("torch", "transformers", "simple_parsing"):
        pytest.importorskip(module)
    cwd = os.path.join(examples, "nlp", model, "popxl")
    junit = tmp_path / "junit.xml"
    res = run_emulated(["-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
                        "tests"], cwd, [cwd, os.path.join(examples, "utils"), addons, utils],
                       timeout=3600)
    assert junit.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    outcomes = _outcomes(junit)
    passed = {t for t, o in outcomes.items() if o == "passed"}
    summary = re.findall(r"\d+ (?:passed|failed|error|skipped)", res.stdout)
    missing = sorted(EXPECTED.get(model, set()) - passed)
    assert not missing, f"{model}: {summary}; expected to pass but did not: {missing}"
