"""Benchmark: one decode step over a KV cache at several fills, flash vs naive attention.

Run from the repository root::

    python -m benchmarks.kvcache --markdown docs/benchmarks.md

A decode step (``Lq = Lnew = 1``) of ``pf.flash_attn_with_kvcache`` writes one row per batch
row into a cache of ``Lcache`` rows and attends to the filled prefix. Every batch row holds
``fill x Lcache`` rows after the write. Graphs: the automatic structure, one kv loop with short
chunks, split-KV, and naive attention over the whole cache (the same in-place write, then the
full ``[B*Hkv, r, Lcache]`` score matrix with a run-time length mask, ``ops.softmax``, ``@ v``:
what a PopXL user writes without this library). On the emulator the table gives exact counts:
executed matmul FLOPs (and their ratio to the FLOPs of the filled rows alone), ops executed,
loop iterations, peak live bytes. On the Poplar SDK it gives the time per run.

With ``--markdown FILE`` the table replaces the section between the ``kvcache`` markers of
``FILE`` (appended if absent), leaving the rest of the file as it is; rerun it after
regenerating ``docs/benchmarks.md`` with ``benchmarks.attention``.
"""
import argparse
import sys

import numpy as np

import popxl_flash as pf
from benchmarks import sections
from popxl_flash.checks import devices
from popxl_flash.api import kvcache
from popxl_flash import popxl
from popxl_flash.checks.harness import run_graph

ops = popxl.ops

BEGIN, END = "<!-- kvcache: begin -->", "<!-- kvcache: end -->"


def naive_decode(q, kc, vc, kn, vn, seqlens):
    """Naive attention over the whole cache after the same in-place write: ``[B, 1, Hq, D]``."""
    B, Lq, Hq, D = q.shape
    _, Lc, Hkv, _ = kc.shape
    r = Hq // Hkv
    kc = kvcache.write_rows_(kc, kn, seqlens)
    vc = kvcache.write_rows_(vc, vn, seqlens)
    qg = q.reshape((B, Hkv, r, D)).reshape((B * Hkv, r, D))  # Lq = 1
    kg, vg = (c.transpose((0, 2, 1, 3)).reshape((B * Hkv, Lc, D)) for c in (kc, vc))
    s = ops.matmul(qg, kg.transpose((0, 2, 1)), output_type=popxl.float32) * float(D ** -0.5)
    n = seqlens.reshape((B, 1, 1, 1)) + popxl.constant(np.int32(Lq))
    valid = ops.greater(n, popxl.constant(np.arange(Lc, dtype=np.int32).reshape(1, 1, 1, Lc)))
    s = ops.where(valid, s.reshape((B, Hkv, r, Lc)),
                  popxl.constant(float(np.finfo(np.float32).min), dtype=popxl.float32))
    p = ops.cast(ops.softmax(s, axis=-1), q.dtype).reshape((B * Hkv, r, Lc))
    return ops.matmul(p, vg).reshape((B, 1, Hq, D))


def graphs(args):
    """``{label: build}``: the structures compared."""
    auto = kvcache.explain(args.batch, 1, args.cache_len, q_heads=args.heads,
                           kv_heads=args.kv_heads, head_dim=args.head_dim,
                           dtype=args.dtype).chosen
    short = -(-args.cache_len // 64)

    def flash(**options):
        return lambda *t: [pf.flash_attn_with_kvcache(*t[:5], cache_seqlens=t[5], causal=True,
                                                      **options)]
    return auto, {
        (f"flash auto ({auto.structure})" if auto.straight else
         f"flash auto (splits {auto.splits}, chunk {auto.chunk_kv})"): flash(),
        "flash one loop, chunk 64": flash(num_splits=1, num_chunks_kv=short),
        f"flash split-KV {args.splits} x chunk 64": flash(num_splits=args.splits,
                                                          num_chunks_kv=short),
        "naive over the cache": lambda *t: [naive_decode(*t)],
    }


def measure(args):
    """Run every graph at every fill; returns ``(auto, rows)``."""
    B, Lc, Hq, Hkv, D = args.batch, args.cache_len, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(args.seed)
    q = rng.standard_normal((B, 1, Hq, D)).astype(args.dtype)
    kc, vc = (rng.standard_normal((B, Lc, Hkv, D)).astype(args.dtype) for _ in range(2))
    kn, vn = (rng.standard_normal((B, 1, Hkv, D)).astype(args.dtype) for _ in range(2))
    auto, builds = graphs(args)
    row_flops = 4 * B * Hq * D  # q k^T and p v of one cache row, one query
    rows = []
    for fill in args.fills:
        filled = max(1, round(fill * Lc))
        seqlens = np.full(B, filled - 1, np.int32)
        for label, build in builds.items():
            run = run_graph(build, [q, kc, vc, kn, vn, seqlens], device=args.device,
                            warmup=args.warmup, repeats=args.repeats)
            row = dict(graph=label, fill=f"{fill:.0%} ({filled})", seconds=run.seconds,
                       graph_ops=run.graph_ops)
            if run.profile is not None:
                row.update(matmul_flops=run.profile.matmul_flops,
                           flop_ratio=run.profile.matmul_flops / (filled * row_flops),
                           ops_executed=run.profile.ops_executed,
                           iterations=run.profile.loop_iterations,
                           peak_live_bytes=run.profile.peak_live_bytes)
            rows.append(row)
    return auto, rows


COLUMNS = [("fill (rows)", "fill", "{}"), ("graph", "graph", "{}"),
           ("matmul FLOPs", "matmul_flops", "{:,}"),
           ("/ FLOPs of the filled rows", "flop_ratio", "{:.2f}"),
           ("ops executed", "ops_executed", "{:,}"), ("loop iterations", "iterations", "{}"),
           ("peak live bytes", "peak_live_bytes", "{:,}"), ("run s", "seconds", "{:.4f}")]


def markdown(argv, args, auto, rows):
    """The section as Markdown, between the markers."""
    head = [c for c in COLUMNS if any(c[1] in r for r in rows)]
    lines = [BEGIN, "", f"## KV cache: one decode step ({pf.BACKEND}, {args.device})", "",
             "Generated by `python -m benchmarks.kvcache " + " ".join(argv) + "`; do not edit "
             "(rerun it after regenerating this file with `benchmarks.attention`, which "
             "rewrites the file).", "",
             f"`pf.flash_attn_with_kvcache`, Lq = Lnew = 1, B = {args.batch}, Hq = {args.heads}, "
             f"Hkv = {args.kv_heads}, D = {args.head_dim}, Lcache = {args.cache_len}, "
             f"{args.dtype}, causal; every batch row holds the given rows after the write. "
             + (f"The automatic structure is the straight-line pass (one pass over the whole "
                "cache, no loop, {auto.ops[0]} supersteps modelled). " if auto.straight else
                f"The automatic structure is num_splits={auto.splits} with chunks of "
                f"{auto.chunk_kv} rows ({auto.steps} loop iterations). ")
             + "Naive attention and the straight-line pass compute scores over the whole cache "
             "whatever the fill; the loops skip chunks beyond every row's length (no matmul).",
             "",
             "| " + " | ".join(c[0] for c in head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[key]) if key in r else "" for _, key, fmt
                                       in head) + " |")
    return "\n".join(lines + ["", END]) + "\n"


def update_section(path, section):
    """Replace this benchmark's marked section of ``path`` (or append it)."""
    sections.update_section(path, section, BEGIN, END)


def _fills(text):
    values = [float(v) for v in text.split(",")]
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions in (0, 1], got {text!r}")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kvcache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-len", type=int, default=4096, help="Lcache (default: 4096)")
    p.add_argument("--fills", type=_fills, default=[0.1, 0.5, 1.0],
                   help="comma-separated cache fills after the write (default: 0.1,0.5,1)")
    p.add_argument("--batch", type=int, default=2, help="batch B (default: 2)")
    p.add_argument("--heads", type=int, default=8, help="query heads Hq (default: 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="cache heads Hkv (default: 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D (default: 64)")
    p.add_argument("--splits", type=int, default=4,
                   help="parts of the split-KV graph (default: 4)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="dtype of q and the caches (default: float16)")
    p.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    p.add_argument("--device", choices=devices.NAMES, default=devices.default_device(),
                   help="PopXL device (default: ipu_hw with the Poplar SDK, else ipu_model)")
    p.add_argument("--warmup", type=int, default=0, help="untimed runs first (default: 0)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs averaged (default: 1)")
    p.add_argument("--markdown", default=None,
                   help="update the KV cache section of this Markdown file (else print it)")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    auto, rows = measure(args)
    section = markdown(argv, args, auto, rows)
    if args.markdown:
        update_section(args.markdown, section)
    else:
        sys.stdout.write(section)
    return rows


if __name__ == "__main__":
    main()
