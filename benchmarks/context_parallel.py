"""Benchmark: context parallelism, one sequence over R = 1, 2, 4, 8 replicas.

Run from the repository root::

    python -m benchmarks.context_parallel --markdown docs/context-parallel.md

For every replica count R (and every K/V gather round count S that divides L / R) the
sequence's q, k, v are laid out by ``pf.context_parallel.shard`` and
``pf.context_parallel_attention`` runs in a replicated Ir (forward; with ``--pass both`` also
``context_parallel_attention_grad`` in stash mode). On the emulator the table gives each
replica's exact counts: executed matmul FLOPs (largest and smallest replica: the balance),
peak live bytes, bytes received from the collectives, and the check that the unsharded
results match the float64 reference on the whole sequence and that the FLOPs equal
``pf.context_parallel.explain``'s. Emulator wall time is not IPU time (the replicas run as
threads on the host's cores).
"""
import argparse
import sys

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import devices
from popxl_flash.api.context_parallel import explain, shard, unshard
from popxl_flash.checks.harness import run_graph

MiB = 2 ** 20


def _data(args):
    rng = np.random.default_rng(args.seed)
    L, D, H, Hk = args.seq_len, args.head_dim, args.heads, args.kv_heads or args.heads
    q = rng.standard_normal((H, L, D)).astype(args.dtype)
    k, v = (rng.standard_normal((Hk, L, D)).astype(args.dtype) for _ in range(2))
    dout = rng.standard_normal((H, L, D)).astype(args.dtype)
    return q, k, v, dout


def _rel(got, ref):
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


def _replica_stats(profile):
    reps = profile.replicas or (profile,)
    flops = [p.matmul_flops for p in reps]
    return dict(flops_max=max(flops), flops_min=min(flops),
                peak=max(p.peak_live_bytes for p in reps),
                moved=max(p.collective_bytes for p in reps))


def run_case(args, data, refs, R, S):
    """Forward (and backward) at R replicas and S gather rounds; returns a table row."""
    q, k, v, dout = data
    layout = args.layout
    opts = dict(layout=layout, kv_gather_steps=S, causal=args.causal)

    def lay(x):
        return shard(x, R, layout) if R > 1 else x

    def back(x):
        return unshard(x, layout) if R > 1 else x

    fwd = run_graph(lambda q, k, v: list(pf.context_parallel_attention(
        q, k, v, return_lse=True, **opts)), [lay(x) for x in (q, k, v)], device=args.device,
        warmup=args.warmup, repeats=args.repeats, replicas=R)
    cost = explain(args.seq_len, R, head_dim=args.head_dim, groups=args.heads,
                   kv_groups=args.kv_heads, dtype=args.dtype, causal=args.causal, layout=layout,
                   kv_gather_steps=S)
    plan = cost.plan
    row = dict(R=R, S=S, rows=args.seq_len // R, t_fwd=fwd.seconds * 1e3,
               plan=f"{plan.chunk_q} x {plan.chunk_kv}" + (", split" if plan.split else "")
               + (", tables" if plan.tables else ""), modelled=cost.seconds * 1e6,
               err_fwd=_rel(back(fwd.outputs[0]), refs[0]))
    if fwd.profile is not None:
        stats = _replica_stats(fwd.profile)
        row.update(fwd_flops=stats["flops_max"] / 1e9,
                   balance=stats["flops_max"] / max(1, stats["flops_min"]),
                   fwd_peak=stats["peak"] / MiB, gathered=stats["moved"] / MiB,
                   explain="ok" if [p.matmul_flops for p in fwd.profile.replicas or
                                    (fwd.profile,)] == list(cost.flops) else "differs")
    if args.pass_ == "both":
        def grad(do, q, k, v):
            out, lse = pf.context_parallel_attention(q, k, v, return_lse=True, **opts)
            return list(pf.context_parallel_attention_grad(do, q, k, v, out, lse, **opts))
        bwd = run_graph(grad, [lay(x) for x in (dout, q, k, v)], device=args.device,
                        warmup=args.warmup, repeats=args.repeats, replicas=R)
        row.update(t_bwd=bwd.seconds * 1e3,
                   err_bwd=max(_rel(back(g), r) for g, r in zip(bwd.outputs, refs[1:])))
        if bwd.profile is not None:
            stats = _replica_stats(bwd.profile)
            row.update(bwd_flops=stats["flops_max"] / 1e9, bwd_peak=stats["peak"] / MiB,
                       bwd_moved=stats["moved"] / MiB)
    return row


COLUMNS = [("R", "R", "{}"), ("rounds S", "S", "{}"), ("rows / replica", "rows", "{}"),
           ("chunks, split, step tables (chosen)", "plan", "{}"),
           ("modelled fwd+bwd us / replica", "modelled", "{:,.0f}"),
           ("fwd GFLOP / replica (max)", "fwd_flops", "{:.4f}"),
           ("max/min replica FLOPs", "balance", "{:.3f}"),
           ("fwd peak MiB / replica", "fwd_peak", "{:.2f}"),
           ("gathered MiB / replica", "gathered", "{:.2f}"),
           ("= explain", "explain", "{}"),
           ("fwd+bwd GFLOP / replica", "bwd_flops", "{:.4f}"),
           ("fwd+bwd peak MiB / replica", "bwd_peak", "{:.2f}"),
           ("fwd+bwd collective MiB / replica", "bwd_moved", "{:.2f}"),
           ("fwd rel err", "err_fwd", "{:.1e}"), ("bwd rel err", "err_bwd", "{:.1e}"),
           ("t fwd ms", "t_fwd", "{:.0f}"), ("t fwd+bwd ms", "t_bwd", "{:.0f}")]


def markdown(argv, args, rows):
    """The table as Markdown, with the command and the set-up."""
    head = [c for c in COLUMNS if any(c[1] in r for r in rows)]
    kv = args.kv_heads or args.heads
    lines = [f"# Context parallelism ({pf.BACKEND}, {args.device})", "",
             "Generated by `python -m benchmarks.context_parallel " + " ".join(argv) +
             "`; do not edit.", "",
             f"One sequence of L = {args.seq_len} tokens, H = {args.heads} query heads, "
             f"{kv} K/V heads, D = {args.head_dim}, {args.dtype}, "
             f"{'causal' if args.causal else 'no mask'}, layout {args.layout}, split over R "
             "replicas (`pf.context_parallel_attention`; backward: "
             "`context_parallel_attention_grad` in stash mode, after the forward). Per-replica "
             "figures are the largest replica's, measured by the emulator; errors are max |x - "
             "ref| / max |ref| of the unsharded results against the float64 reference on the "
             "whole sequence. \"= explain\": every replica's executed FLOPs equal "
             "`pf.context_parallel.explain`'s. The chunks, the split and the per-replica step "
             "tables are the plan's choice by modelled time within the default memory_budget "
             "(the rounds S given); \"modelled\" is explain's forward + backward time, "
             "reference IPU constants. Emulator wall time is not IPU time.", "",
             "A replica's forward peak holds its q, k, v (and out) shards, one round's gathered "
             "K/V (plus the transient reshape/transpose copies of PopXL's all-gather wrapper), "
             "with S > 1 the float32 accumulator of the output shard, and flash's block working "
             "set, which does not shrink with R; the backward adds each round's float32 dk/dv "
             "of the gathered columns and a float32 dq. See the user guide's memory "
             "arithmetic.", "",
             "| " + " | ".join(c[0] for c in head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[key]) if key in r else "" for _, key, fmt
                                       in head) + " |")
    return "\n".join(lines) + "\n"


def _ints(text):
    """A comma-separated list of positive ints (argparse type)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") \
            from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048, help="sequence length L (default 2048)")
    p.add_argument("--heads", type=int, default=4, help="query heads H (default 4)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="K/V heads, a divisor of H (default: H)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D (default 64)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="dtype of q, k, v (default float16)")
    p.add_argument("--replicas", type=_ints, default=[1, 2, 4, 8],
                   help="comma-separated replica counts (default 1,2,4,8)")
    p.add_argument("--gather-steps", type=_ints, default=[1, 4],
                   help="comma-separated K/V gather round counts; those not dividing L / R are "
                        "left out (default 1,4)")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag",
                   help="how the sequence is laid out over the replicas (default zigzag)")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="no mask (default: causal)")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "both"), default="both",
                   help="fwd, or both (forward then the stash-mode backward; default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data (default 0)")
    p.add_argument("--device", choices=devices.NAMES, default=devices.default_device(),
                   help="PopXL device (default: ipu_hw with the Poplar SDK, else ipu_model)")
    p.add_argument("--warmup", type=int, default=0, help="untimed runs first (default 0)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs averaged (default 1)")
    p.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    args = p.parse_args(argv)
    if min(args.seq_len, args.heads, args.head_dim, args.repeats) < 1 or args.warmup < 0:
        p.error("need --seq-len, --heads, --head-dim, --repeats >= 1 and --warmup >= 0")
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        p.error(f"--kv-heads must divide --heads={args.heads}, got {args.kv_heads}")
    per = 2 if args.layout == "zigzag" else 1
    bad = [R for R in args.replicas if args.seq_len % (per * R)]
    if bad:
        p.error(f"--seq-len {args.seq_len} must be divisible by {per} x each of --replicas "
                f"(not {bad})")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    data = _data(args)
    q, k, v, dout = (x.astype(np.float64) for x in data)
    refs = (pf.reference.attention(q, k, v, causal=args.causal)[0],
            *pf.reference.attention_grad(dout, q, k, v, causal=args.causal))
    rows = []
    for R in args.replicas:
        for S in args.gather_steps:
            if (args.seq_len // R) % S == 0:
                rows.append(run_case(args, data, refs, R, S))
    text = markdown(argv, args, rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
