"""Demo: flash attention in a PopXL graph on random data, checked against numpy.

Run with ``python -m popxl_flash.demo`` (or the ``popxl-flash-demo`` script). It builds a PopXL
main graph that loads q, k, v from the host, calls :func:`popxl_flash.flash_attention`, runs it,
and prints the max error against the float64 reference and the activation memory saved against a
naive PopXL attention (measured peak on the emulator; the planner's estimate on an IPU). With no
``memory_budget`` the call holds at most twice its own inputs' and outputs' bytes plus 4 MiB
beyond them, and at most 1/8 of naive attention's working set
(:func:`popxl_flash.plan.memory.default_budget`): O(L), never the L x L scores.
"""
import argparse
import numpy as np

import popxl_flash as pf
from popxl_flash.checks import cli, devices
from popxl_flash import popxl
from popxl_flash.checks.harness import run_graph
from popxl_flash.checks.naive import naive_attention

ops = popxl.ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=cli.positive_int, default=2,
                        help="G = batch x heads (default: %(default)s)")
    parser.add_argument("--seq-len", type=cli.positive_int, default=2048,
                        help="sequence length L of q, k and v (default: %(default)s)")
    parser.add_argument("--head-dim", type=cli.positive_int, default=64,
                        help="head dimension D (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16",
                        help="dtype of q, k, v and out (default: %(default)s)")
    parser.add_argument("--device", default="ipu_model", choices=devices.NAMES,
                        help="ipu_model (full-size 1472-tile model), ipu_hw or cpu "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    G, L, D = args.groups, args.seq_len, args.head_dim
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((G, L, D)).astype(args.dtype) for _ in range(3))

    flash = run_graph(lambda q, k, v: [pf.flash_attention(q, k, v)], [q, k, v],
                      device=args.device)
    naive = run_graph(lambda q, k, v: [naive_attention(q, k, v)], [q, k, v], device=args.device)
    ref, _ = pf.reference.attention(q, k, v)
    err_flash, err_naive = (float(np.abs(r.outputs[0].astype(np.float64) - ref).max())
                            for r in (flash, naive))
    print(f"backend: {pf.BACKEND}; q, k, v: [{G}, {L}, {D}] {args.dtype}, causal")
    print(f"max |flash - float64 reference| = {err_flash:.3e} "
          f"(naive {args.dtype} attention: {err_naive:.3e})")
    if pf.BACKEND == "emulator":
        f_bytes = flash.profile.peak_live_bytes
        n_bytes = naive.profile.peak_live_bytes
        how = "peak live bytes measured by the emulator"
    else:
        cfg = pf.AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (args.dtype,) * 3)
        est = cfg.schedule.memory_bytes(D, G, itemsize=q.itemsize)
        f_bytes, n_bytes, how = est.flash, est.naive, "planner estimate of activation bytes"
    print(f"memory: flash {f_bytes / 2**20:.2f} MiB vs naive {n_bytes / 2**20:.2f} MiB "
          f"-> {n_bytes / f_bytes:.1f}x less ({how})")
    if pf.BACKEND == "emulator":
        _print_extra(flash, naive, [q, k, v], args.dtype)
    if pf.BACKEND == "emulator" and flash.profile.device_bytes is not None:
        print(f"{args.device} tile memory {flash.profile.device_bytes / 2**20:.0f} MiB: flash "
              f"fits: {flash.profile.fits_device}, naive fits: {naive.profile.fits_device} "
              "(peak live bytes only; the IPU model itself never checks memory)")
    print(f"run time on this backend: flash {flash.seconds:.3f} s, naive {naive.seconds:.3f} s")
    return 0


def _print_extra(flash, naive, arrays, dtype):
    """The bytes each call holds beyond its own inputs and outputs (what ``memory_budget``
    bounds), and flash's default budget for this call."""
    from popxl_flash.plan import memory
    io = sum(a.nbytes for a in arrays)
    f_extra = flash.profile.peak_live_bytes - io - sum(o.nbytes for o in flash.outputs)
    n_extra = naive.profile.peak_live_bytes - io - sum(o.nbytes for o in naive.outputs)
    G, L, D = arrays[0].shape
    budget = memory.default_budget(groups=G, kv_groups=arrays[1].shape[0], q_len=L,
                                   kv_len=arrays[1].shape[1], head_dim=D, dtype=dtype,
                                   backward=False)
    print(f"beyond inputs and outputs: flash {f_extra / 2**20:.2f} MiB vs naive "
          f"{n_extra / 2**20:.2f} MiB -> {n_extra / max(f_extra, 1):.1f}x less (the default "
          f"memory_budget of this forward: {budget / 2**20:.2f} MiB: 2 x its inputs and outputs "
          "+ 4 MiB, at most 1/8 of naive attention's working set)")


if __name__ == "__main__":
    raise SystemExit(main())
