"""``python -m popxl_flash.selfcheck --copies``: lowering copies, PopART's log vs the copy model.

The emulator counts the copies Poplar's lowering makes at call, repeat and conditional
boundaries with a model of PopART's rules (``popxl_flash/emulator/copies.py``). This check
compiles one forward and one stash-mode backward (:data:`CASE`) and prints:

* on the emulator: the model alone, one row per boundary site and kind (bytes per execution,
  executions, total), from the run profile's ``copy_sites``;
* on the Poplar SDK: for each pass, a child process compiles the graph on the device (the IPU
  model compiles the same program) with PopART's log configured (``POPART_LOG_CONFIG``: module
  ``opx`` at TRACE, ``devicex`` at DEBUG; ``POPART_LOG_DEST``: a file), and the parent reads
  which boundaries were copied, aliased or skipped, in bytes; then a second child prints the
  emulator model for the same graph (``POPXL_FLASH_BACKEND=emulator``).

The log lines read (PopART sdk-release-3.4): ``[CallOpx] Copying|Aliasing|Skipping ... input``,
``... output``, ``... modified input`` (``willow/src/popx/op/callx.cpp``; LoopOpx logs its copy
back of modified inputs with the same prefix), ``[LoopOpx] explicit input / implicit input /
output -> explicit input / output -> output ... copied|skipped|aliased``
(``willow/src/popx/op/loopx.cpp``) and ``[AliasZeroCopy] PostIRAliases`` (``willow/src/
aliaszerocopy.cpp``). ``IfOpx`` logs nothing: it copies every input and output of the taken
branch (``willow/src/popx/op/ifx.cpp``), and LoopOpx's per-iteration copies of the body outputs
into their clones have no log line either; those rows come from the rules. The SDK path has not
been run on a Graphcore machine by the authors: the log formats are read from the source.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import devices, harness
from popxl_flash.backend import popxl

ops = popxl.ops


@dataclass(frozen=True)
class CopyCase:
    """The graphs compared: ``G`` groups, ``L`` tokens, head dim ``D``, ``chunk``-row chunks."""
    G: int = 2
    L: int = 512
    D: int = 64
    dtype: str = "float16"
    chunk: int = 128
    causal: bool = True

    @property
    def options(self):
        n = self.L // self.chunk
        return dict(num_chunks_q=n, num_chunks_kv=n, causal=self.causal)

    def schedule(self):
        """The pass's :class:`~popxl_flash.plan.schedule.BlockSchedule`."""
        n = self.L // self.chunk
        return pf.plan(self.L, self.L, -(-self.L // n), -(-self.L // n), causal=self.causal)

    def describe(self):
        n = self.L // self.chunk
        return (f"G={self.G} L={self.L} D={self.D} {self.dtype} "
                f"{'causal' if self.causal else 'non-causal'}, {n}x{n} chunks of {self.chunk}")


CASE = CopyCase()
PASSES = ("forward", "backward")

#: PopART log lines of lowering copies: (regex, boundary kind or None for "by tensor id",
#: action group). Group 1 is the tensor whose size is the copy's (source or destination: same).
_LINES = (
    (r"\[CallOpx\] (Copying|Aliasing) input (\S+)->(\S+)", "call"),
    (r"\[CallOpx\] (Skipping) copy input (\S+)->(\S+)", "call"),
    (r"\[CallOpx\] (Copying|Aliasing) output (\S+)->(\S+)", "call"),
    (r"\[CallOpx\] (Skipping) output (\S+)->(\S+)", "call"),
    (r"\[CallOpx\] (Copying) modified input (\S+)->(\S+)", None),
    (r"\[CallOpx\] (Skipping) copy modified input (\S+)->(\S+)", None),
    (r"\[LoopOpx\] explicit input (\S+) -> output (\S+) (copied|skipped)", "loop_in_out"),
    (r"\[LoopOpx\] implicit input (\S+) -> implicit input (\S+) (copied|skipped|aliased)",
     "loop_in_out"),
    (r"\[LoopOpx\] output (\S+) -> explicit input (\S+) (copied|skipped)", "loop_carried"),
    (r"\[LoopOpx\] output (\S+) -> output (\S+) (copied|skipped)", "loop_in_out"),
)
_ACTIONS = {"Copying": "copied", "Aliasing": "aliased", "Skipping": "skipped"}
_WRAPPER = "__loop_wrapper"


def build(pass_, case=CASE):
    """``(build function, host arrays)`` of one pass for :func:`harness.run_graph`."""
    rng = np.random.default_rng(0)
    shape = (case.G, case.L, case.D)
    q, k, v, dout = (rng.standard_normal(shape).astype(case.dtype) for _ in range(4))
    if pass_ == "forward":
        return (lambda q, k, v: list(pf.flash_attention(q, k, v, return_lse=True,
                                                        **case.options))), [q, k, v]
    out, lse = pf.reference.attention(q, k, v, causal=case.causal)
    arrays = [dout, q, k, v, out.astype(case.dtype), lse.astype(np.float32)]
    return (lambda do, q, k, v, o, l: list(pf.flash_attention_grad(do, q, k, v, o, l,
                                                                   **case.options))), arrays


# -- the emulator model -------------------------------------------------------------------
def model_rows(pass_, case=CASE):
    """Run one pass on the emulator. Returns: ``(rows, profile)``, rows
    ``(site, kind, bytes per execution, executions)`` sorted by total bytes, largest first."""
    fn, arrays = build(pass_, case)
    prof = harness.run_graph(fn, arrays).profile
    rows = [(site, kind, nbytes, n) for (site, kind, nbytes), n in prof.copy_sites.items()]
    rows.sort(key=lambda r: (-r[2] * r[3], r[0], r[1]))
    return rows, prof


def print_model(pass_, case=CASE, out=None):
    """Print the emulator model's table of one pass (to ``out``, default stdout)."""
    out = sys.stdout if out is None else out
    rows, prof = model_rows(pass_, case)
    blocks = max(case.schedule().visited_blocks, 1)
    print(f"emulator model, {pass_} ({case.describe()}), {blocks} visited blocks in "
          f"{prof.loop_iterations} loop steps:", file=out)
    print(f"  {'boundary':44} {'kind':13} {'bytes/exec':>11} {'count':>7} {'total':>12}",
          file=out)
    for site, kind, nbytes, n in rows:
        print(f"  {site[:44]:44} {kind:13} {nbytes:>11} {n:>7} {nbytes * n:>12}", file=out)
    kinds = ", ".join(f"{k} {v}" for k, v in prof.bytes_copied_by_kind.items())
    print(f"  total {prof.bytes_copied} bytes ({prof.bytes_copied / blocks:,.1f} bytes per "
          f"visited block); by kind: {kinds}", file=out)


# -- the SDK: PopART's log --------------------------------------------------------------------
def log_records(text, sizes):
    """PopART's lowering-copy log lines, one record each.

    Args:
        text: the log. sizes: ``{tensor id: bytes}``.
    Returns:
        list of ``(kind, action, source id, destination id, bytes)``, action ``copied``,
        ``aliased`` or ``skipped``.
    """
    records = []
    for line in text.splitlines():
        for pattern, kind in _LINES:
            m = re.search(pattern, line)
            if not m:
                continue
            groups = m.groups()
            if pattern.startswith(r"\[CallOpx\]"):
                action, src, dst = _ACTIONS[groups[0]], groups[1], groups[2]
            else:
                src, dst, action = groups
            if kind is None:  # copy back of a modified input: CallOpx, or LoopOpx's wrapper
                kind = "loop_in_out" if _WRAPPER in src and _WRAPPER not in dst else "call"
            records.append((kind, action, src, dst, sizes.get(src, sizes.get(dst, 0))))
            break
    return records


def parse_log(text, sizes):
    """Tally of :func:`log_records`: ``{(kind, action): [lines, bytes]}``."""
    tally = defaultdict(lambda: [0, 0])
    for kind, action, _, _, nbytes in log_records(text, sizes):
        tally[(kind, action)][0] += 1
        tally[(kind, action)][1] += nbytes
    return dict(tally)


def model_per_execution(rows):
    """``{kind: bytes}`` of the model's rows summed once per site (bytes per execution of each
    boundary's program, as PopART's log describes them)."""
    per_kind = defaultdict(int)
    for _, kind, nbytes, _ in rows:
        per_kind[kind] += nbytes
    return dict(per_kind)


def compare(tally, model, out):
    """Print PopART's copied bytes per kind (from its log) next to the model's, per execution
    of each boundary."""
    print(f"  {'kind':13} {'PopART copied':>14} {'model':>12}  note", file=out)
    notes = {"branch": "IfOpx logs nothing: always every input and output",
             "loop_carried": "PopART logs only the clone -> input half (the model: both)",
             "loop_control": "not logged (iterator and condition)"}
    for kind in ("call", "loop_in_out", "loop_carried", "branch", "loop_control"):
        logged = tally.get((kind, "copied"), [0, 0])[1]
        print(f"  {kind:13} {logged:>14} {model.get(kind, 0):>12}  {notes.get(kind, '')}",
              file=out)


def _graph_sizes(ir):
    """``{tensor id: bytes}`` over every graph reachable from the main graph."""
    sizes, todo, seen = {}, [ir.main_graph], set()
    while todo:
        g = todo.pop()
        if g.id in seen:
            continue
        seen.add(g.id)
        for t in g.tensors:
            sizes[t.id] = int(t.nelms) * np.dtype(t.dtype.as_numpy()).itemsize
        todo.extend(g.called_graphs)
    return sizes


def compile_child(pass_, device, sizes_path):
    """Child process (SDK): build and compile one pass, write the tensor sizes as JSON."""
    fn, arrays = build(pass_)
    ir = popxl.Ir()
    with ir.main_graph:
        streams = [popxl.h2d_stream(a.shape, getattr(popxl, a.dtype.name)) for a in arrays]
        outs = fn(*[ops.host_load(s) for s in streams])
        for t in outs:
            ops.host_store(popxl.d2h_stream(t.shape, t.dtype), t)
    with open(sizes_path, "w") as f:
        json.dump(_graph_sizes(ir), f)
    popxl.Session(ir, devices.session_device(device))  # compiles: lowering logs its copies


def _log_config(directory):
    path = os.path.join(directory, "popart_log_config.json")
    levels = {"opx": "TRACE", "devicex": "DEBUG"}
    # The docs name modules plainly; logging.cpp looks them up as "popart:<module>": give both.
    levels.update({f"popart:{k}": v for k, v in list(levels.items())})
    with open(path, "w") as f:
        json.dump(levels, f)
    return path


def sdk_pass(pass_, device, out=None):
    """Compile one pass in a child process with PopART's log on; print the tally, the copied
    tensors, and PopART's copied bytes per kind next to the emulator model of the same graph
    (second child), then the model's table. Returns: 0, or a child's exit status."""
    out = sys.stdout if out is None else out
    with tempfile.TemporaryDirectory() as tmp:
        log, sizes_path = os.path.join(tmp, "popart.log"), os.path.join(tmp, "sizes.json")
        env = dict(os.environ, POPART_LOG_CONFIG=_log_config(tmp), POPART_LOG_DEST=log,
                   POPART_LOG_LEVEL="WARN")
        proc = subprocess.run([sys.executable, "-m", "popxl_flash.checks.copycheck", "compile",
                               pass_, device, sizes_path], env=env)
        if proc.returncode:
            print(f"{pass_}: compiling on {device} failed (exit {proc.returncode})", file=out)
            return proc.returncode
        with open(sizes_path) as f:
            sizes = json.load(f)
        with open(log) as f:
            text = f.read()
    records = log_records(text, sizes)
    tally = parse_log(text, sizes)
    aliases = sum("[AliasZeroCopy] PostIRAliases" in line for line in text.splitlines())
    print(f"PopART lowering, {pass_} ({CASE.describe()}) on {device}: each boundary is lowered "
          f"once; {aliases} [AliasZeroCopy] PostIRAliases lines", file=out)
    print(f"  {'kind':13} {'action':8} {'lines':>6} {'bytes':>12}", file=out)
    for (kind, action), (n, nbytes) in sorted(tally.items()):
        print(f"  {kind:13} {action:8} {n:>6} {nbytes:>12}", file=out)
    print("  copied:", file=out)
    for kind, action, src, dst, nbytes in records:
        if action == "copied":
            print(f"    {kind:13} {src} -> {dst} ({nbytes} bytes)", file=out)
    env = dict(os.environ, POPXL_FLASH_BACKEND="emulator")
    child = subprocess.run([sys.executable, "-m", "popxl_flash.checks.copycheck", "model-json", pass_],
                           env=env, capture_output=True, text=True)
    if child.returncode:
        print(f"  emulator model failed: {child.stderr.strip()}", file=out)
        return child.returncode
    rows = [tuple(r) for r in json.loads(child.stdout)]
    print("  bytes per execution of each boundary's program, PopART vs the model:", file=out)
    compare(tally, model_per_execution(rows), out)
    table = subprocess.run([sys.executable, "-m", "popxl_flash.checks.copycheck", "model", pass_],
                           env=env, capture_output=True, text=True)
    print(table.stdout.rstrip(), file=out)
    return table.returncode


def run(device, out=None):
    """``selfcheck --copies``, printing to ``out`` (default stdout). Returns: exit status (0
    unless a compile failed)."""
    out = sys.stdout if out is None else out
    print(f"popxl_flash selfcheck --copies: backend {pf.BACKEND}, device {device}", file=out)
    if pf.BACKEND == "emulator":
        for pass_ in PASSES:
            print_model(pass_, out=out)
        print("(the emulator's model of PopART's rules, popxl_flash/emulator/copies.py; run "
              "this on a machine with the Poplar SDK to compare with PopART's own decisions)",
              file=out)
        return 0
    return max(sdk_pass(pass_, device, out) for pass_ in PASSES)


def main(argv=None):
    """Child entry points: ``compile PASS DEVICE SIZES_JSON`` (SDK), ``model PASS`` (table),
    ``model-json PASS`` (the model's rows as JSON)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"] and len(argv) == 4 and argv[1] in PASSES:
        compile_child(argv[1], argv[2], argv[3])
        return 0
    if argv[:1] == ["model"] and len(argv) == 2 and argv[1] in PASSES:
        print_model(argv[1])
        return 0
    if argv[:1] == ["model-json"] and len(argv) == 2 and argv[1] in PASSES:
        print(json.dumps(model_rows(argv[1])[0]))
        return 0
    print("usage: python -m popxl_flash.checks.copycheck compile {forward,backward} DEVICE SIZES_JSON"
          " | model {forward,backward} | model-json {forward,backward}  (run by python -m "
          "popxl_flash.checks.selfcheck --copies)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
