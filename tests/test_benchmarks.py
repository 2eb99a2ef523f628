"""Smoke tests of the attention micro-benchmark CLI (``python -m benchmarks.attention``)."""
import json
import pathlib
import sys

import pytest

import popxl_flash as pf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks import attention, report  # noqa: E402

emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator",
                                   reason="profile counts are an emulator feature")

TINY = ["--seq-len", "32,64", "--head-dim", "8", "--chunks", "4x4", "--dtype", "float32"]


def _run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    assert attention.main(TINY + ["--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


@emulator_only
@pytest.mark.parametrize("pass_, expected", [("fwd", {"fwd"}), ("both", {"fwd", "bwd"})])
def test_cli_json_numbers(tmp_path, capsys, pass_, expected):
    result = _run(tmp_path, "--pass", pass_, "--mask", "causal,window:8,0")
    meta, rows = result["meta"], result["rows"]
    assert meta["backend"] == "emulator"
    assert "python -m benchmarks.attention --seq-len 32,64" in meta["command"]
    assert {"python", "numpy", "popxl_flash"} <= set(meta["versions"])
    assert {r["case"]["pass_"] for r in rows} == expected
    assert len(rows) == 2 * 2 * len(expected)  # L x mask x pass
    for row in rows:
        assert {"case", "planner", "flash", "naive", "ratios", "flops_check",
                "naive_executed_flops", "max_abs_diff"} <= set(row)
        assert {"seconds", "ops_executed", "matmul_flops", "peak_live_bytes",
                "graph_ops"} <= set(row["flash"])
        case, planner = row["case"], row["planner"]
        cfg = pf.AttentionConfig.from_shapes(*[(1, case["seq_len"], 8)] * 3, ("float32",) * 3,
                                             num_chunks_q=4, num_chunks_kv=4,
                                             causal=case["mask"] == "causal",
                                             window=(8, 0) if case["mask"] != "causal" else None)
        flops = (cfg.schedule.forward_flops(8, 1) if case["pass_"] == "fwd"
                 else cfg.schedule.backward_flops(8, 1, mode="stash"))
        assert row["flash"]["matmul_flops"] == planner["executed_flops"] == flops.executed
        assert row["flops_check"] is True
        assert row["naive"]["matmul_flops"] == row["naive_executed_flops"]
        # float32, L <= 64, D = 8, O(1) values: both sum <= 64 + 8 terms per output, so they
        # differ by at most ~4 * (n + c + D) * eps32 * max|.| ~ 5e-5 (see attention_utils).
        assert row["max_abs_diff"] < 1e-4 and row["values_check"] is True
        if case["seq_len"] == 64:
            assert row["ratios"]["memory"] > 1
    table = capsys.readouterr().out
    assert "exec/useful" in table and "mem naive/flash" in table


@emulator_only
def test_cli_markdown_and_no_naive(tmp_path):
    md = tmp_path / "bench.md"
    result = _run(tmp_path, "--pass", "fwd", "--seq-len", "32", "--no-naive",
                  "--markdown", str(md))
    assert "naive" not in result["rows"][0]
    text = md.read_text()
    assert "python -m benchmarks.attention" in text and "not IPU time" in text
    assert text.count("\n| fwd |") == 1


@emulator_only
@pytest.mark.skipif(not report.have_matplotlib(), reason="matplotlib (extra 'plot') not installed")
def test_cli_plot_writes_png(tmp_path):
    png = tmp_path / "bench.png"
    _run(tmp_path, "--pass", "fwd", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text, masks", [
    ("causal", ["causal"]),
    ("causal,none,window:64,0", ["causal", "none", "window:64,0"]),
    ("window:-1,16,causal", ["window:-1,16", "causal"]),
])
def test_mask_list(text, masks):
    assert attention._mask_list(text) == masks


@pytest.mark.parametrize("argv", [["--mask", "causual"], ["--chunks", "4by4"],
                                  ["--seq-len", "32", "--chunks", "64x64"],
                                  ["--dtype", "bfloat16"], ["--repeats", "0"]])
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        attention.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_sdk_report_marks_graphs_that_do_not_fit(tmp_path, monkeypatch, capsys):
    """The real-SDK path (emulated): a naive graph that fails to compile is reported, not fatal."""
    def naive_graph(case):
        def build(*tensors):
            raise RuntimeError("Out of memory on tile 0\nmore detail")
        return build

    monkeypatch.setattr(pf, "BACKEND", "popxl")
    monkeypatch.setattr(attention, "naive_graph", naive_graph)
    rows = _run(tmp_path, "--pass", "fwd", "--seq-len", "32", "--repeats", "2", "--warmup", "1",
                "--markdown", str(tmp_path / "sdk.md"))["rows"]
    assert rows[0]["naive"] == dict(fits=False, error="RuntimeError: Out of memory on tile 0")
    assert rows[0]["flash"]["fits"] and len(rows[0]["flash"]["run_seconds"]) == 2
    assert rows[0]["flash"]["tflops"] > 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "flash TFLOP/s" in out
    assert "not IPU time" not in (tmp_path / "sdk.md").read_text()


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_unwritable_output_fails_before_the_sweep(tmp_path, option, capsys, monkeypatch):
    """A bad output path is a usage error at once, not after minutes of measuring."""
    monkeypatch.setattr(attention, "measure", lambda *a: pytest.fail("the sweep started"))
    for path in (tmp_path / "missing" / "out", tmp_path):
        with pytest.raises(SystemExit) as exc:
            attention.main(TINY + [option, str(path)])
        assert exc.value.code == 2
        assert option in capsys.readouterr().err


@emulator_only
def test_cli_explain_and_new_columns(tmp_path, capsys):
    """--explain prints the cost model's candidates; the table counts iterations (== loop
    steps: visited blocks plus split blocks' second sub-blocks) and ops per block."""
    rows = _run(tmp_path, "--pass", "fwd", "--seq-len", "256", "--chunks", "auto",
                "--explain", "--no-naive")["rows"]
    out = capsys.readouterr().out
    assert "cost model: float32 causal L=256" in out and "chosen: " in out
    assert "iters" in out and "ops/block" in out
    flash, planner = rows[0]["flash"], rows[0]["planner"]
    assert flash["loop_iterations"] == planner["loop_steps"]


@emulator_only
def test_cli_explain_prints_each_table_once(tmp_path, capsys):
    """--pass both: the forward and backward cases of a shape share one cost-model table (it
    weighs both passes), so it is printed once per shape, not once per pass."""
    _run(tmp_path, "--pass", "both", "--seq-len", "128,256", "--chunks", "auto", "--explain",
         "--no-naive")
    out = capsys.readouterr().out
    for L in (128, 256):
        assert out.count(f"cost model: float32 causal L={L} ") == 1
    assert out.count("chosen: ") == 2


def test_packed_benchmark_row(tmp_path, capsys):
    """The packed-row benchmark: segment ids and varlen run at most 1.5x the work of the blocks
    that hold a visible pair (chunks of 16 over 4 sequences of about 21), less than one causal
    sequence over the row (which runs the planner's count), and the Markdown names the
    command."""
    from benchmarks import packed
    out = tmp_path / "packed.md"
    assert packed.main(["--seq-len", "96", "--num-seqs", "4", "--chunks", "6", "--head-dim",
                        "8", "--markdown", str(out)]) == 0
    text = out.read_text()
    assert "python -m benchmarks.packed --seq-len 96" in text
    _, cfg, rows = packed.measure(packed.parse_args(["--seq-len", "96", "--num-seqs", "4",
                                                     "--chunks", "6", "--head-dim", "8"]))
    if pf.BACKEND == "emulator":
        seg, varlen, whole = rows
        assert seg["blocks"] <= 1.5 * seg["needed_blocks"]
        assert varlen["blocks"] <= 1.5 * varlen["needed_blocks"]
        assert whole["matmul_flops"] == cfg.schedule.forward_flops(8, 2).executed  # H = 2
        assert seg["matmul_flops"] < whole["matmul_flops"]


def test_context_parallel_benchmark_rows(tmp_path):
    """The context-parallel benchmark: per-replica FLOPs halve with R and equal explain's,
    zigzag keeps replicas balanced, results match the whole-sequence reference, and the
    Markdown names the command."""
    from benchmarks import context_parallel
    out = tmp_path / "cp.md"
    argv = ["--seq-len", "64", "--head-dim", "8", "--heads", "2", "--replicas", "1,2",
            "--gather-steps", "1,2", "--dtype", "float32"]
    assert context_parallel.main(argv + ["--markdown", str(out)]) == 0
    text = out.read_text()
    assert "python -m benchmarks.context_parallel --seq-len 64" in text
    args = context_parallel.parse_args(argv)
    data = context_parallel._data(args)
    q, k, v, dout = (x.astype("float64") for x in data)
    refs = (pf.reference.attention(q, k, v, causal=True)[0],
            *pf.reference.attention_grad(dout, q, k, v, causal=True))
    rows = [context_parallel.run_case(args, data, refs, R, 1) for R in (1, 2)]
    for row in rows:
        assert row["err_fwd"] < 1e-5 and row["err_bwd"] < 1e-5
    if pf.BACKEND == "emulator":
        assert all(r["explain"] == "ok" and r["balance"] == 1 for r in rows)
        assert rows[1]["fwd_flops"] < rows[0]["fwd_flops"]
