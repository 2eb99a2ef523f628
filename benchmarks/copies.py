"""Lowering copies per visited block, by boundary kind (emulator run profile).

    python -m benchmarks.copies [--seq-len 2048,4096] [--groups 2] [--head-dim 64]
                                [--chunk-rows 128] [--mask causal]

Runs the library's forward and stash-mode backward (the benchmark's graphs,
:mod:`benchmarks.graphs`) on the emulator with ``num_chunks = L / chunk_rows`` and prints
``profile.bytes_copied`` and ``profile.bytes_copied_by_kind`` in bytes per visited block (the
schedule's; the loops run one step per block and two per split block: ``iters``). The copy
model is the emulator's (``popxl_flash/emulator/copies.py``); on a Graphcore machine
``python -m popxl_flash.selfcheck --copies`` reads what PopART actually aliased and copied.
"""
import argparse
import sys

import popxl_flash as pf
from benchmarks.attention import _int_list, _mask_list
from benchmarks.graphs import Case, flash_graph, host_inputs
from popxl_flash.checks.harness import run_graph


def per_block(case):
    """Returns: ``(visited blocks, bytes copied per block, {kind: bytes per block},
    loop iterations)``. The divisor is the schedule's visited blocks, not the loop iterations:
    a split block runs as two steps, and its copies are the block's."""
    run = run_graph(flash_graph(case), host_inputs(case))
    prof = run.profile
    blocks = case.config().schedule.visited_blocks
    kinds = {k: v / blocks for k, v in prof.bytes_copied_by_kind.items()}
    return blocks, prof.bytes_copied / blocks, kinds, prof.loop_iterations


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.copies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=_int_list, default="2048,4096", metavar="L,...")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    p.add_argument("--chunk-rows", type=int, default=128)
    p.add_argument("--mask", type=_mask_list, default="causal", metavar="MASK")
    args = p.parse_args(argv)
    if pf.BACKEND != "emulator":
        p.error("the per-block copy figures come from the emulator's run profile; on the SDK "
                "run python -m popxl_flash.selfcheck --copies")
    kinds = None
    for L in args.seq_len:
        if L % args.chunk_rows:
            p.error(f"--seq-len {L} is not a multiple of --chunk-rows {args.chunk_rows}")
        n = L // args.chunk_rows
        for pass_ in ("fwd", "bwd"):
            case = Case(pass_, L, args.head_dim, args.groups, args.dtype, args.mask[0], (n, n))
            blocks, total, by_kind, iters = per_block(case)
            if kinds is None:
                kinds = list(by_kind)
                print(f"{'pass':4} {'L':>5} {'blocks':>6} {'iters':>6} {'B/block':>10} "
                      + " ".join(f"{k:>12}" for k in kinds))
            print(f"{pass_:4} {L:>5} {blocks:>6} {iters:>6} {total:>10.1f} "
                  + " ".join(f"{by_kind[k]:>12.1f}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
