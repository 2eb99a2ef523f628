"""``python -m popxl_flash.selfcheck``: the fixed matrix passes, and a wrong result or an
exception makes it fail (exit 1) without stopping the other cases."""
import io
import subprocess
import sys

import numpy as np

from popxl_flash.checks import harness, selfcheck


def test_quick_matrix_passes_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "popxl_flash.checks.selfcheck", "--quick"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    quick = [c for c in selfcheck.CASES if c.quick]
    assert sum(line.startswith("PASS ") for line in lines) == len(quick)
    assert lines[-1] == f"selfcheck: {len(quick)} passed, 0 failed"


def test_matrix_covers_the_documented_space():
    cases = selfcheck.CASES
    assert {c.dtype for c in cases} == {"float16", "float32"}
    assert any(c.options.get("causal", True) for c in cases)
    assert any(not c.options.get("causal", True) and "window" not in c.options for c in cases)
    assert any("window" in c.options for c in cases)
    assert any(c.Lq != c.Lkv for c in cases)
    assert any(c.options.get("num_chunks_q") == c.Lq for c in cases)  # chunk length 1
    assert any(c.Lq % -(-c.Lq // c.options.get("num_chunks_q", -(-c.Lq // 128))) for c in cases)
    assert any(c.Lq > c.Lkv and c.options.get("causal", True) for c in cases)  # empty rows
    assert any(not c.quick and c.Lq >= 4096 for c in cases)


def test_wrong_result_fails(monkeypatch):
    """An error of 0.01 in one entry of out (or of dk) is far outside the 2x/3x rule for a float32
    case: FAIL, exit 1."""
    run_graph = harness.run_graph

    def perturbed(*args, **kwargs):
        result = run_graph(*args, **kwargs)
        result.outputs[which].flat[7] += 0.01
        return result
    monkeypatch.setattr(harness, "run_graph", perturbed)
    case = next(c for c in selfcheck.CASES if c.name == "non-causal-fp32")
    for which, name in ((0, "out"), (3, "dk")):
        buf = io.StringIO()
        assert selfcheck.run([case], "ipu_model", out=buf) == 1
        line = buf.getvalue().splitlines()[1]
        assert line.startswith("FAIL non-causal-fp32")
        ratio = float(line.split(f" {name}=")[1].split()[0])
        assert ratio > 1


def test_exception_is_reported_and_the_run_goes_on():
    bad = selfcheck.Case("bad", 1, 8, 8, 4, "float32", dict(num_chunks_q=9))
    good = selfcheck.Case("good", 1, 8, 8, 4, "float32", dict(causal=False))
    buf = io.StringIO()
    assert selfcheck.run([bad, good], "ipu_model", out=buf) == 1
    lines = buf.getvalue().splitlines()
    assert lines[1].startswith("FAIL bad") and "raised ValueError" in lines[1]
    assert lines[2].startswith("PASS good")
    assert lines[-1] == "selfcheck: 1 passed, 1 failed"


def test_check_case_ratios_are_finite():
    case = next(c for c in selfcheck.CASES if c.name == "chunk-length-1")
    ok, ratios, _ = selfcheck.check_case(case, "ipu_model")
    assert ok and set(ratios) == {"out", "lse", "dq", "dk", "dv"}
    assert all(np.isfinite(r) and r <= 1 for r in ratios.values())
