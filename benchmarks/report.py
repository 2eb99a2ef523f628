"""Output of the attention benchmark: progress bar, text and Markdown tables, JSON, plot."""
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass

import numpy as np

import popxl_flash as pf

MiB = 2.0 ** 20
MODULE = "benchmarks.attention"
#: Environment variables that change numpy's (hence the emulator's) threading; recorded.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def chunks_label(chunks):
    return "auto" if chunks is None else f"{chunks[0]}x{chunks[1]}"


def have_matplotlib():
    return importlib.util.find_spec("matplotlib") is not None


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total, width=24, stream=sys.stderr):
        self.total, self.width, self.stream = total, width, stream
        self.count, self.start = 0, time.perf_counter()
        self.tty = stream.isatty()

    def _write(self, label, count):
        filled = self.width * count // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (f"[{bar}] {count}/{self.total} {time.perf_counter() - self.start:6.1f}s "
                f"{label}")
        self.stream.write(f"\r\033[K{line}" if self.tty else line + "\n")
        self.stream.flush()

    def step(self, label):
        """Announce the step about to run."""
        self._write(label, self.count)
        self.count += 1

    def done(self):
        self._write("done", self.count)
        if self.tty:
            self.stream.write("\n")


@dataclass
class Result:
    """A finished sweep: how it was run and one row of numbers per case."""
    argv: list
    device: str
    warmup: int
    repeats: int
    rows: list

    @property
    def command(self):
        """The command line, prefixed by the threading variables that were set."""
        env = [f"{var}={os.environ[var]}" for var in THREAD_VARS if var in os.environ]
        return shlex.join(env + ["python", "-m", MODULE] + list(self.argv))

    def meta(self):
        return dict(command=self.command, backend=pf.BACKEND, device=self.device,
                    warmup=self.warmup, repeats=self.repeats, versions=versions())


def versions():
    found = dict(python=platform.python_version(), numpy=np.__version__,
                 popxl_flash=pf.__version__, platform=platform.platform(), cpus=os.cpu_count())
    found.update({var: os.environ[var] for var in THREAD_VARS if var in os.environ})
    if pf.BACKEND == "popxl":
        found["popxl"] = getattr(pf.popxl, "__version__", "unknown")
        try:
            import popart
            found["popart"] = popart.versionString()
        except Exception:  # version lookup only; never fail a benchmark on it
            pass
    return found


# ---- columns ------------------------------------------------------------------------------

def _get(row, *keys):
    for key in keys:
        if not isinstance(row, dict) or row.get(key) is None:
            return None
        row = row[key]
    return row


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _chunks(row):
    p = row["planner"]
    auto = " auto" if row["case"]["chunks"] == "auto" else ""
    return f"{p['num_chunks_q']}x{p['num_chunks_kv']}{auto}"


def _check(row):
    """"ok", or which checks failed ("-" when nothing could be checked)."""
    checks = {"flops!": row.get("flops_check"), "values!": row.get("values_check")}
    failed = [name for name, ok in checks.items() if ok is False]
    if failed:
        return " ".join(failed)
    return "ok" if any(ok for ok in checks.values()) else "-"


def _fits(side, fn):
    """``fn(row)``, or "does not fit" when that graph failed to compile (SDK only)."""
    return lambda row: "does not fit" if _get(row, side, "fits") is False else fn(row)


def _ms(side):
    return lambda row: _fmt(_get(row, side, "seconds") and row[side]["seconds"] * 1e3, ".4g")


CASE_COLUMNS = [
    ("pass", "fwd = forward; bwd = stash-mode backward (out and lse are inputs)",
     lambda r: r["case"]["pass_"]),
    ("dtype", "dtype of q, k, v", lambda r: r["case"]["dtype"]),
    ("mask", "causal, none, or window:LEFT,RIGHT", lambda r: r["case"]["mask"]),
    ("L", "sequence length, Lq = Lkv", lambda r: str(r["case"]["seq_len"])),
    ("D", "head dimension", lambda r: str(r["case"]["head_dim"])),
    ("G", "groups = batch x heads", lambda r: str(r["case"]["groups"])),
    ("chunks", "q x kv chunk counts used (auto: the cost model's choice)", _chunks),
    ("blocks", "visited blocks (loop iterations per pass: one per block, two per split block)",
     lambda r: _fmt(r["planner"].get("visited_blocks"), "d")),
    ("exec GFLOP", "matmul FLOPs flash executes (every visited block, whole)",
     lambda r: _fmt(r["planner"]["executed_flops"] / 1e9, ".4g")),
    ("useful GFLOP", "matmul FLOPs on visible (query, key) pairs only",
     lambda r: _fmt(r["planner"]["useful_flops"] / 1e9, ".4g")),
    ("exec/useful", "flash's wasted-work ratio (1 = none: every executed FLOP is useful)",
     lambda r: _fmt(r["planner"]["flop_ratio"], ".3f")),
    ("naive GFLOP", "matmul FLOPs naive attention executes: 4DL^2G fwd, 10DL^2G bwd",
     lambda r: _fmt(r["naive_executed_flops"] / 1e9, ".4g")),
]

CHECK_COLUMNS = [
    ("check", "ok, or flops! if the emulator's measured matmul FLOPs differ from the planner's "
     "executed count, values! if flash and naive outputs disagree (see max rel diff)", _check),
    ("max rel diff", "max |flash - naive| / max |naive| over the outputs (out; dq, dk, dv)",
     lambda r: _fmt(r.get("max_rel_diff"), ".1e")),
]

EMULATOR_COLUMNS = [
    ("peak flash MiB", "peak live bytes of the flash graph, measured by the emulator",
     lambda r: _fmt(_get(r, "flash", "peak_live_bytes") and r["flash"]["peak_live_bytes"] / MiB,
                    ".3f")),
    ("peak naive MiB", "peak live bytes of the naive graph (full [G, L, L] scores)",
     lambda r: _fmt(_get(r, "naive", "peak_live_bytes") and r["naive"]["peak_live_bytes"] / MiB,
                    ".3f")),
    ("mem naive/flash", "how many times more memory naive attention needs",
     lambda r: _fmt(_get(r, "ratios", "memory"), ".1f")),
    ("ops exec", "ops the flash graph executed (loop bodies counted per iteration)",
     lambda r: _fmt(_get(r, "flash", "ops_executed"), "d")),
    ("iters", "loop iterations the flash graph executed (emulator profile)",
     lambda r: _fmt(_get(r, "flash", "loop_iterations"), "d")),
    ("ops/block", "ops executed per visited block",
     lambda r: _fmt(_per_block(r, "ops_executed"), ".1f")),
    ("graph ops flash/naive", "ops in the IR (count_ops): flash, naive",
     lambda r: "/".join(_fmt(_get(r, side, "graph_ops"), "d") for side in ("flash", "naive"))),
    ("t flash ms", "emulator wall time per flash session.run, mean of the timed runs "
     "(NOT IPU time)", _ms("flash")),
    ("t naive ms", "emulator wall time per naive session.run (same process, same inputs)",
     _ms("naive")),
    ("t naive/flash", "naive time / flash time (> 1: flash faster on the emulator)",
     lambda r: _fmt(_get(r, "ratios", "time"), ".2f")),
]

SDK_COLUMNS = [
    ("t flash ms", "mean time per flash session.run after warm-up (host transfers included), "
     "or 'does not fit' (compile or out-of-memory error)", _fits("flash", _ms("flash"))),
    ("flash TFLOP/s", "useful FLOPs / flash time",
     _fits("flash", lambda r: _fmt(_get(r, "flash", "tflops"), ".3f"))),
    ("t naive ms", "mean time per naive session.run, or 'does not fit'",
     _fits("naive", _ms("naive"))),
    ("naive TFLOP/s", "useful FLOPs / naive time",
     _fits("naive", lambda r: _fmt(_get(r, "naive", "tflops"), ".3f"))),
    ("t naive/flash", "naive time / flash time (> 1: flash faster)",
     lambda r: _fmt(_get(r, "ratios", "time"), ".2f")),
    ("est mem naive/flash", "planner's estimate of forward activation bytes, naive / flash",
     lambda r: _fmt(r["planner"]["est_naive_bytes"] / r["planner"]["est_flash_bytes"], ".1f")),
]


BYTES_COPIED_COLUMNS = [
    ("KiB copied/block", "bytes copied at call/conditional/repeat boundaries (emulator "
     "profile's bytes_copied) per visited block",
     lambda r: _fmt(_per_block(r, "bytes_copied") and _per_block(r, "bytes_copied") / 1024,
                    ".1f")),
]


def _per_block(row, key):
    value, blocks = _get(row, "flash", key), row["planner"].get("visited_blocks")
    return None if value is None or not blocks else value / blocks


def columns(rows=()):
    """The table's columns; the bytes-copied one only when some profile reports it."""
    if pf.BACKEND != "emulator":
        return CASE_COLUMNS + CHECK_COLUMNS + SDK_COLUMNS
    copied = any(_get(r, "flash", "bytes_copied") is not None for r in rows)
    return CASE_COLUMNS + CHECK_COLUMNS + EMULATOR_COLUMNS + (BYTES_COPIED_COLUMNS if copied
                                                              else [])


def _cells(result):
    cols = columns(result.rows)
    return [c[0] for c in cols], [[c[2](row) for c in cols] for row in result.rows]


def text_table(result):
    """A fixed-width table for the terminal."""
    header, body = _cells(result)
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in body]
    return "\n".join(lines)


def markdown(result):
    """The table as Markdown, with the command that produced it and a column legend."""
    header, body = _cells(result)
    meta = result.meta()
    versions_text = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    emulator = pf.BACKEND == "emulator"
    lines = [
        "# Attention micro-benchmarks",
        "",
        "<!-- Generated by benchmarks/attention.py; do not edit by hand: rerun the command. -->",
        "",
        "Generated by (from the repository root):",
        "",
        "```sh",
        result.command,
        "```",
        "",
        f"Backend: `{meta['backend']}` (device `{result.device}`; {result.warmup} warm-up, "
        f"{result.repeats} timed run(s) per graph). Versions: {versions_text}.",
        "",
        "Each row runs the flash graph (`popxl_flash.flash_attention`, or "
        "`flash_attention_grad` in stash mode) and a naive PopXL attention graph that "
        "materialises the full `[G, L, L]` score matrix (backward: `dV = P^T dO`, "
        "`dP = dO V^T`, `dS = P (dP - rowsum(dO O))`, `dQ = scale dS K`, "
        "`dK = scale dS^T Q`) on the same inputs, in the same process.",
        "",
    ]
    if emulator:
        lines += [
            "**Emulator wall time is not IPU time.** The CPU emulator interprets the graph op "
            "by op with numpy, so loop overhead dominates small blocks; only the counts "
            "(FLOPs, bytes, ops) carry over to the IPU. Use `--device ipu_hw` with the "
            "Poplar SDK for real timings. On a shared machine, pin numpy to one thread "
            "(`OPENBLAS_NUM_THREADS=1`, recorded in the command above when set): multi-threaded "
            "BLAS under CPU contention makes emulator timings swing by several times.",
            "",
            "At small L the flash graph's fixed costs (padded copies of q, k, v, a float32 "
            "score block per chunk pair, accumulators, schedule tables) can exceed the naive "
            "score matrix, so the memory ratio can be below 1 there; it grows linearly with L.",
            "",
        ]
    lines += ["Columns:", ""]
    lines += [f"- **{name}**: {text}" for name, text, _ in columns(result.rows)]
    lines += ["", "| " + " | ".join(header) + " |",
              "|" + "|".join(":---" if i < 3 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    return "\n".join(lines) + "\n"


def to_json(result):
    return json.dumps(dict(meta=result.meta(), rows=result.rows), indent=1)


# ---- plot ---------------------------------------------------------------------------------

def _series(rows):
    """Rows grouped by everything but L (labelled by the fields that vary), sorted by L."""
    fields = [f for f in ("pass_", "dtype", "mask", "head_dim", "groups", "chunks")
              if len({r["case"][f] for r in rows}) > 1]
    groups = {}
    for row in rows:
        c = row["case"]
        key = " ".join(f"{f[0].upper()}={c[f]}" if f in ("head_dim", "groups") else str(c[f])
                       for f in fields)
        groups.setdefault(key, []).append(row)
    return {k: sorted(v, key=lambda r: r["case"]["seq_len"]) for k, v in groups.items()}


def _memory(row, side):
    """Measured peak (emulator) or the planner's estimate (SDK; forward estimate)."""
    measured = _get(row, side, "peak_live_bytes")
    if measured is not None:
        return measured
    return row["planner"]["est_flash_bytes" if side == "flash" else "est_naive_bytes"]


_MARKERS = "osD^v<>ph*"


def plot(result, path):
    """Three panels vs L (log 2): peak memory and executed matmul FLOPs, flash (solid) vs naive
    (dashed), and the naive/flash ratios (memory solid, time dotted) on their own panel.

    Series that coincide (e.g. the forward and backward memory of one mask) stay visible:
    every series has its own marker, and markers are hollow.
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    fig, (ax_mem, ax_flops, ax_ratio) = plt.subplots(1, 3, figsize=(18, 7))
    emulator = pf.BACKEND == "emulator"
    lengths = sorted({r["case"]["seq_len"] for r in result.rows})
    for index, (label, rows) in enumerate(_series(result.rows).items()):
        style = dict(color=f"C{index % 10}", marker=_MARKERS[index % len(_MARKERS)],
                     markerfacecolor="none", markersize=7)
        L = [r["case"]["seq_len"] for r in rows]
        name = f" {label}" if label else ""
        ax_mem.plot(L, [_memory(r, "flash") / MiB for r in rows], "-", label=f"flash{name}",
                    **style)
        ax_flops.plot(L, [r["planner"]["executed_flops"] for r in rows], "-",
                      label=f"flash{name}", **style)
        ax_flops.plot(L, [r["naive_executed_flops"] for r in rows], "--", alpha=0.6,
                      label=f"naive{name}", **style)
        if "naive" in rows[0] or not emulator:
            ax_mem.plot(L, [_memory(r, "naive") / MiB for r in rows], "--", alpha=0.6,
                        label=f"naive{name}", **style)
        memory = [_get(r, "ratios", "memory") for r in rows]
        if not emulator and any(m is None for m in memory):
            memory = [r["planner"]["est_naive_bytes"] / r["planner"]["est_flash_bytes"]
                      for r in rows]
        if any(m is not None for m in memory):
            ax_ratio.plot(L, [m if m is not None else float("nan") for m in memory], "-",
                          label=f"memory{name}", **style)
        times = [_get(r, "ratios", "time") for r in rows]
        if any(t is not None for t in times):
            ax_ratio.plot(L, [t if t is not None else float("nan") for t in times], ":",
                          label=f"time{name}", **style)
    ax_mem.set_title("peak live memory" + (" (emulator)" if emulator else " (planner estimate)"))
    ax_mem.set_ylabel("MiB")
    ax_flops.set_title("executed matmul FLOPs")
    ax_flops.set_ylabel("FLOP")
    ax_ratio.set_title("naive / flash" + (" (time: emulator wall time)" if emulator else ""))
    ax_ratio.set_ylabel("ratio (> 1: flash better)")
    ax_ratio.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (ax_mem, ax_flops, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(lengths))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("sequence length L")
        ax.grid(True, which="both", alpha=0.3)
        # below the axes: a legend inside would cover points of the series it names
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14),
                  ncol=2 + len(ax.get_lines()) // 8)
    ax_ratio.yaxis.set_major_formatter(ScalarFormatter())
    fig.suptitle(f"popxl_flash vs naive attention ({pf.BACKEND})")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_outputs(result, *, json_file=None, markdown_file=None, plot_file=None):
    if json_file:
        with open(json_file, "w") as f:
            f.write(to_json(result) + "\n")
    if markdown_file:
        with open(markdown_file, "w") as f:
            f.write(markdown(result))
    if plot_file:
        plot(result, plot_file)
