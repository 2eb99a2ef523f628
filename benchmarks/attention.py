"""Micro-benchmark: flash vs naive PopXL attention, forward and backward.

Run from the repository root::

    python -m benchmarks.attention --seq-len 512,1024,2048 --dtype float16 --mask causal,none \\
        --pass both --json out.json --markdown out.md --plot out.png

Every list option is a comma-separated sweep; the benchmark runs the cross product. For each case
it builds the flash graph and a naive PopXL attention graph (full score matrix) over the same data
in the same run. On the emulator it reports exact counts (matmul FLOPs, checked against the
planner; peak live bytes; ops executed; IR op count) and emulator wall time. On the Poplar SDK it
reports the mean time per ``session.run`` and achieved TFLOP/s, and whether naive attention fits.
"""
import argparse
import itertools
import os
import re
import sys

import numpy as np

import popxl_flash as pf
from benchmarks import report
from benchmarks.graphs import (Case, flash_graph, host_inputs, naive_flops, naive_graph,
                               naive_inputs)
from popxl_flash.checks import devices
from popxl_flash.plan.steps import loop_steps
from popxl_flash.plan.counts import pass_flops
from popxl_flash.checks.harness import run_graph

PASSES = {"fwd": ("fwd",), "bwd": ("bwd",), "both": ("fwd", "bwd")}
DTYPES = ("float16", "float32")
DEVICES = devices.NAMES
#: Largest accepted max|flash - naive| / max|naive| per dtype (flash and naive round differently).
VALUE_TOLERANCE = {"float16": 2e-2, "float32": 1e-4}
_MASK = re.compile(r"causal|none|window:-?\d+,-?\d+")


def _int_list(text):
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _dtype_list(text):
    values = text.split(",")
    bad = [v for v in values if v not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unsupported dtype {bad[0]!r}; expected {DTYPES}")
    return values


def _mask_list(text):
    """``causal``, ``none``, ``window:LEFT,RIGHT`` separated by commas."""
    masks = _MASK.findall(text)
    if ",".join(masks) != text:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of causal, none, window:LEFT,RIGHT; got {text!r}")
    return masks


def _chunks_list(text):
    """``auto`` or ``NQxNKV`` items separated by commas -> ``None`` or ``(nq, nkv)``."""
    chunks = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)x(\d+)", item)
        if item != "auto" and not match:
            raise argparse.ArgumentTypeError(f"expected 'auto' or NQxNKV (e.g. 8x8), got {item!r}")
        chunks.append(tuple(int(n) for n in match.groups()) if match else None)
    return chunks


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=_int_list, default="512,1024,2048", metavar="L,...",
                   help="sequence lengths, Lq = Lkv (default: %(default)s)")
    p.add_argument("--head-dim", type=_int_list, default="64", metavar="D,...",
                   help="head dimensions (default: %(default)s)")
    p.add_argument("--groups", type=_int_list, default="1", metavar="G,...",
                   help="G = batch x heads (default: %(default)s)")
    p.add_argument("--dtype", type=_dtype_list, default="float16", metavar="DTYPE,...",
                   help="float16 and/or float32 (default: %(default)s)")
    p.add_argument("--mask", type=_mask_list, default="causal", metavar="MASK,...",
                   help="causal, none, window:LEFT,RIGHT (a non-causal local window; -1 = "
                        "unbounded side) (default: %(default)s)")
    p.add_argument("--chunks", type=_chunks_list, default="auto", metavar="CHUNKS,...",
                   help="'auto' (the cost model's choice, see --explain) or NQxNKV chunk "
                        "counts, e.g. 8x8 (default: %(default)s)")
    p.add_argument("--pass", dest="passes", choices=PASSES, default="both",
                   help="forward, stash-mode backward, or both (default: %(default)s)")
    p.add_argument("--device", choices=DEVICES, default=devices.default_device(),
                   help="ipu_model is the full-size 1472-tile IPU model; the emulator's counts "
                        "do not depend on the device (default: ipu_hw with the Poplar SDK, "
                        "else ipu_model)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed runs first (default: 2 on the SDK, 0 on the emulator)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs averaged (default: 10 on the SDK, 1 on the emulator)")
    p.add_argument("--json", metavar="FILE",
                   help="write every number, the command line, backend and versions")
    p.add_argument("--markdown", metavar="FILE",
                   help="write the table as Markdown, with the command that produced it")
    p.add_argument("--plot", metavar="FILE", help="PNG: memory and FLOPs vs L (needs matplotlib)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive attention graphs")
    p.add_argument("--explain", action="store_true",
                   help="print the cost model's figures for every chunking it weighs, per case")
    args = p.parse_args(argv)
    for option in ("json", "markdown", "plot"):
        _check_output_path(p, option, getattr(args, option))
    emulator = pf.BACKEND == "emulator"
    args.warmup = (0 if emulator else 2) if args.warmup is None else args.warmup
    args.repeats = (1 if emulator else 10) if args.repeats is None else args.repeats
    if args.warmup < 0 or args.repeats < 1:
        p.error(f"need --warmup >= 0 and --repeats >= 1, got {args.warmup}, {args.repeats}")
    if args.plot and not report.have_matplotlib():
        p.error("--plot needs matplotlib, an optional extra: pip install -e .[plot]")
    args.cases = _cases(args, p)
    return args


def _check_output_path(parser, option, path):
    """Fail before the sweep (not after it) if an output file cannot be written."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"--{option} {path!r} is a directory; expected a file path")
    if not os.path.isdir(directory):
        parser.error(f"--{option} {path!r}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK) or (os.path.exists(path)
                                             and not os.access(path, os.W_OK)):
        parser.error(f"--{option} {path!r} is not writable")


def _cases(args, parser):
    """The cross product of the sweeps, each validated by the library's config up front."""
    cases = [Case(pass_, L, D, G, dtype, mask, chunks) for pass_, mask, dtype, D, G, chunks, L
             in itertools.product(PASSES[args.passes], args.mask, args.dtype, args.head_dim,
                                  args.groups, args.chunks, args.seq_len)]
    for case in cases:
        try:
            case.config()
        except (TypeError, ValueError) as err:
            parser.error(f"L={case.seq_len}, chunks={case.chunks}, mask={case.mask}: {err}")
    return cases


def planner_numbers(case):
    """Executed/useful FLOPs and the forward memory estimate, from the planner."""
    cfg = case.config()
    D, G, sched = case.head_dim, case.groups, cfg.schedule
    flops = (sched.forward_flops(D, G) if case.pass_ == "fwd"
             else sched.backward_flops(D, G, mode="stash"))
    mem = sched.memory_bytes(D, G, itemsize=np.dtype(case.dtype).itemsize)
    # as the pass runs them: a pass of one visited block runs it whole (counts.pass_flops)
    executed = pass_flops(sched, D, G, backward=case.pass_ != "fwd")
    return dict(num_chunks_q=cfg.num_chunks_q, num_chunks_kv=cfg.num_chunks_kv,
                chunk_q=cfg.chunk_q, chunk_kv=cfg.chunk_kv, visited_blocks=sched.visited_blocks,
                loop_steps=loop_steps(sched),
                executed_flops=executed,
                useful_flops=flops.useful, flop_ratio=executed / max(flops.useful, 1),
                est_flash_bytes=mem.flash, est_naive_bytes=mem.naive)


def explain(case):
    """The cost model's table for a case's chunking (chunks fixed when the case gives them)."""
    cfg = case.config()
    nq, nkv = case.chunks or (None, None)
    choice = pf.explain(case.seq_len, case.seq_len, head_dim=case.head_dim, groups=case.groups,
                        dtype=case.dtype, causal=case.causal, window=case.window,
                        num_chunks_q=nq, num_chunks_kv=nkv)
    assert (choice.chosen.chunk_q, choice.chosen.chunk_kv) == (cfg.chunk_q, cfg.chunk_kv)
    return choice.table()


def _side(run, useful_flops):
    """Numbers of one graph (flash or naive) from its :class:`RunResult`."""
    side = dict(seconds=run.seconds, run_seconds=run.run_seconds,
                tflops=useful_flops / run.seconds / 1e12, graph_ops=run.graph_ops)
    if run.profile is not None:
        side.update(ops_executed=run.profile.ops_executed,
                    matmul_flops=run.profile.matmul_flops,
                    peak_live_bytes=run.profile.peak_live_bytes,
                    loop_iterations=run.profile.loop_iterations,
                    bytes_copied=run.profile.bytes_copied,
                    bytes_copied_by_kind=dict(run.profile.bytes_copied_by_kind),
                    fits_device=run.profile.fits_device)
    return side


def _run(build, arrays, run_kw):
    """Run one graph; on the SDK a compile/memory failure is recorded as "does not fit".

    Returns:
        ``(RunResult or None, error message or None)``.
    """
    try:
        return run_graph(build, arrays, **run_kw), None
    except Exception as err:  # popart's exceptions derive from Exception only
        if pf.BACKEND == "emulator":
            raise
        first_line = str(err).splitlines()[0][:200] if str(err) else ""
        return None, f"{type(err).__name__}: {first_line}"


def _measure_side(build, arrays, run_kw, useful):
    run, error = _run(build, arrays, run_kw)
    side = dict(fits=run is not None, error=error)
    if run is not None:
        side.update(_side(run, useful))
    return run, side


def measure(case, args):
    """Run one case (flash, then naive) and return its row of numbers."""
    row = dict(case=dict(pass_=case.pass_, seq_len=case.seq_len, head_dim=case.head_dim,
                         groups=case.groups, dtype=case.dtype, mask=case.mask,
                         chunks=report.chunks_label(case.chunks)),
               planner=planner_numbers(case), naive_executed_flops=naive_flops(case))
    useful = row["planner"]["useful_flops"]
    arrays = host_inputs(case)
    run_kw = dict(device=args.device, warmup=args.warmup, repeats=args.repeats)
    flash, row["flash"] = _measure_side(flash_graph(case), arrays, run_kw, useful)
    if "matmul_flops" in row["flash"]:
        row["flops_check"] = row["flash"]["matmul_flops"] == row["planner"]["executed_flops"]
    if not args.no_naive:
        naive, row["naive"] = _measure_side(naive_graph(case), naive_inputs(case, arrays),
                                            run_kw, useful)
        if flash is not None and naive is not None:
            row.update(_agreement(case, flash.outputs, naive.outputs))
            row["ratios"] = _ratios(row)
    return row


def _agreement(case, flash_outputs, naive_outputs):
    """Largest absolute and relative (to max |naive|) differences between the outputs."""
    pairs = [(f.astype(np.float64), n.astype(np.float64))
             for f, n in zip(flash_outputs, naive_outputs)]
    abs_diff = max(float(np.abs(f - n).max()) for f, n in pairs)
    rel_diff = max(float(np.abs(f - n).max() / max(np.abs(n).max(), 1e-30)) for f, n in pairs)
    return dict(max_abs_diff=abs_diff, max_rel_diff=rel_diff,
                values_check=rel_diff <= VALUE_TOLERANCE[case.dtype])


def _ratios(row):
    """naive/flash ratios: how many times more memory / time naive attention takes."""
    flash, naive = row["flash"], row["naive"]
    ratios = dict(time=naive["seconds"] / flash["seconds"])
    if "peak_live_bytes" in flash:
        ratios["memory"] = naive["peak_live_bytes"] / flash["peak_live_bytes"]
    return ratios


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    progress = report.Progress(len(args.cases))
    rows, explained = [], set()
    for case in args.cases:
        shape = (f"{case.dtype} {case.mask} L={case.seq_len} D={case.head_dim}"
                 f" G={case.groups} chunks={report.chunks_label(case.chunks)}")
        # One table per shape: the cost model weighs forward and backward together, so the
        # fwd and bwd cases of a shape share it.
        if args.explain and shape not in explained:
            explained.add(shape)
            print(f"cost model: {shape}\n{explain(case)}\n")
        progress.step(f"{case.pass_} {shape}")
        rows.append(measure(case, args))
    progress.done()
    result = report.Result(argv, args.device, args.warmup, args.repeats, rows)
    print(report.text_table(result))
    report.write_outputs(result, json_file=args.json, markdown_file=args.markdown,
                         plot_file=args.plot)
    return _warn(rows)


def _warn(rows):
    """Warn on stderr about failed checks; return the exit status (1 if any failed)."""
    flops = sum(r.get("flops_check") is False for r in rows)
    values = sum(r.get("values_check") is False for r in rows)
    if flops:
        print(f"WARNING: {flops} case(s) ran a different number of matmul FLOPs than the "
              "planner counts (column 'check': flops!)", file=sys.stderr)
    if values:
        print(f"WARNING: {values} case(s) where flash and naive outputs disagree beyond "
              f"{VALUE_TOLERANCE} relative (column 'check': values!)", file=sys.stderr)
    return 1 if flops or values else 0


if __name__ == "__main__":
    raise SystemExit(main())
