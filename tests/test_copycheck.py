"""``python -m popxl_flash.selfcheck --copies`` (popxl_flash.checks.copycheck): the emulator path prints
the copy model of one forward and one backward; the SDK path's log parser classifies PopART's
lowering lines (formats from callx.cpp / loopx.cpp, sdk-release-3.4)."""
import io
import subprocess
import sys

import pytest

import popxl_flash as pf
from popxl_flash.checks import copycheck
from popxl_flash.plan import steps
from popxl_flash.emulator.copies import LOOP_CONTROL_ONCE, LOOP_CONTROL_STEP

emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator copy model")


@emulator_only
def test_cli_prints_the_model_of_both_passes():
    proc = subprocess.run([sys.executable, "-m", "popxl_flash.checks.selfcheck", "--copies"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "emulator model, forward" in text and "emulator model, backward" in text
    assert text.count("  total ") == 2


@emulator_only
def test_model_rows_add_up_to_the_profile():
    """Every row is (site, kind, bytes per execution, executions); the rows sum to the profile's
    bytes_copied and, per kind, to bytes_copied_by_kind; the printed total is the profile's."""
    for pass_ in copycheck.PASSES:
        rows, prof = copycheck.model_rows(pass_)
        assert sum(nbytes * n for _, _, nbytes, n in rows) == prof.bytes_copied > 0
        for kind, total in prof.bytes_copied_by_kind.items():
            assert sum(b * n for _, k, b, n in rows if k == kind) == total
        assert prof.loop_iterations == sum(n for site, kind, b, n in rows
                                           if kind == "loop_control" and b == 6)
        buf = io.StringIO()
        copycheck.print_model(pass_, out=buf)
        assert f"total {prof.bytes_copied} bytes" in buf.getvalue()


def test_parse_log_classifies_popart_lowering_lines():
    """Lines as PopART 3.4 formats them (a spdlog prefix before the message); sizes by id."""
    prefix = "2026-01-01T00:00:00.000000Z popart:opx 123.456 T: "
    lines = [
        "[CallOpx] Copying input x->body/x",
        "[CallOpx] Aliasing input q->body/q",
        "[CallOpx] Skipping copy input k->body/k (tensor not read in subgraph)",
        "[CallOpx] Copying output body/y->y",
        "[CallOpx] Aliasing output body/z->z",
        "[CallOpx] Copying modified input body/o->w__loop_wrapper/o",   # the wrapper's call
        "[CallOpx] Skipping copy modified input w__loop_wrapper/o->o",  # LoopOpx, aliased
        "[CallOpx] Copying modified input w__loop_wrapper/l->l",        # LoopOpx, copied
        "[LoopOpx] explicit input m -> output w__loop_wrapper/m copied (aliased: 0)",
        "[LoopOpx] implicit input q -> implicit input w__loop_wrapper/q aliased",
        "[LoopOpx] implicit input l -> implicit input w__loop_wrapper/l copied",
        "[LoopOpx] output w__loop_wrapper/m -> explicit input w__loop_wrapper/m0 copied "
        "(aliased: 0)",
        "[LoopOpx] output w__loop_wrapper/m -> output m_out copied (aliased: 0)",
        "[AliasZeroCopy] PostIRAliases: q aliases to [w__loop_wrapper/q]",
        "unrelated line",
    ]
    sizes = {"x": 10, "q": 20, "k": 30, "body/y": 40, "body/z": 50, "body/o": 60,
             "w__loop_wrapper/o": 60, "w__loop_wrapper/l": 70, "m": 8, "l": 70,
             "w__loop_wrapper/m": 8}
    tally = copycheck.parse_log("\n".join(prefix + line for line in lines), sizes)
    assert tally == {
        ("call", "copied"): [3, 10 + 40 + 60],
        ("call", "aliased"): [2, 20 + 50],
        ("call", "skipped"): [1, 30],
        ("loop_in_out", "skipped"): [1, 60],
        ("loop_in_out", "copied"): [4, 70 + 8 + 70 + 8],
        ("loop_in_out", "aliased"): [1, 20],
        ("loop_carried", "copied"): [1, 8],
    }


@emulator_only
def test_child_entry_points(capsys):
    """The SDK path's second child (``model PASS``) prints the model table; a bad call is a
    usage error (exit 2)."""
    assert copycheck.main(["model", "backward"]) == 0
    assert "emulator model, backward" in capsys.readouterr().out
    assert copycheck.main(["model", "sideways"]) == 2
    assert "usage:" in capsys.readouterr().err


@emulator_only
def test_comparison_sums_the_model_once_per_site(capsys):
    """The SDK path compares PopART's copied bytes per kind (one lowered program per boundary)
    with the model's bytes per execution summed once per site: its JSON child gives the rows."""
    assert copycheck.main(["model-json", "forward"]) == 0
    rows = [tuple(r) for r in __import__("json").loads(capsys.readouterr().out)]
    assert rows == [tuple(r) for r in copycheck.model_rows("forward")[0]]
    per_kind = copycheck.model_per_execution(rows)
    # LoopOpx's control copies: once per repeat and once per iteration, two rows per repeat
    # site; the forward runs one repeat per step group (causal 4 x 4: full blocks, and the
    # diagonal's two sub-block shapes)
    loops = len(steps.step_groups(copycheck.CASE.schedule(), "q_major"))
    assert loops == 3
    assert per_kind["loop_control"] == loops * (LOOP_CONTROL_ONCE + LOOP_CONTROL_STEP) == 24
    buf = io.StringIO()
    copycheck.compare({("call", "copied"): [2, 1000]}, per_kind, buf)
    call_line = next(line for line in buf.getvalue().splitlines() if line.split()[0] == "call")
    assert call_line.split()[1:3] == ["1000", str(per_kind.get("call", 0))]


@emulator_only
def test_sdk_path_with_a_stand_in_compile(monkeypatch):
    """The SDK path's plumbing with the compile child replaced (no SDK here): PopART's log is
    configured through POPART_LOG_CONFIG (opx at TRACE) and POPART_LOG_DEST, its lines are
    tallied with the sizes the child wrote, and the model children run on the emulator."""
    import json
    real_run = subprocess.run
    seen = {}

    def fake_run(cmd, env=None, **kw):
        if cmd[3] != "compile":
            assert env["POPXL_FLASH_BACKEND"] == "emulator"
            return real_run(cmd, env=env, **kw)
        with open(env["POPART_LOG_CONFIG"]) as f:
            seen["config"] = json.load(f)
        with open(cmd[6], "w") as f:
            json.dump({"x": 100, "body/x": 100}, f)
        with open(env["POPART_LOG_DEST"], "w") as f:
            f.write("T: [CallOpx] Copying input x->body/x\n")
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(copycheck.subprocess, "run", fake_run)
    buf = io.StringIO()
    assert copycheck.sdk_pass("forward", "ipu_model", out=buf) == 0
    assert seen["config"]["opx"] == seen["config"]["popart:opx"] == "TRACE"
    text = buf.getvalue()
    assert "call          x -> body/x (100 bytes)" in text
    call_line = next(line for line in text.splitlines() if line.split()[:1] == ["call"]
                     and len(line.split()) >= 3 and line.split()[1] == "100")
    assert call_line
    assert "emulator model, forward" in text
