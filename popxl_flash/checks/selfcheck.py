"""Hardware self-check: ``python -m popxl_flash.selfcheck [--device D] [--quick]``.

Runs a fixed matrix of forward and backward cases through the public API on the active backend
(the Poplar SDK's ``popxl`` when it imports, else the emulator), checks every result against the
float64 reference under the test suite's tolerance rule (:mod:`popxl_flash.checks.tolerance`: 2x the
naive same-precision error for the forward, 3x for the backward, plus a reasoned floor), prints
one line per case and a summary, and exits non-zero if any case fails. A case that raises (for
example a compile error on the SDK) is reported as failed with the exception, and the run goes
on with the next case.

The matrix covers float16 and float32; causal, non-causal and windowed masks; ``Lq != Lkv``;
padded tail chunks; chunk length 1; rows that see no key (causal with ``Lq > Lkv``, a narrow
window); a large softmax scale; grouped- and multi-query attention (k/v with fewer groups than
q); packed sequences with padding (segment ids, causal and windowed); and, without
``--quick``, two long sequences (causal, and a 512-token window).

``--copies`` runs :mod:`popxl_flash.checks.copycheck` instead: the lowering copies of one forward and
one backward as PopART decides them (its log, on the SDK) next to the emulator's model.
"""
import argparse
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import devices, harness, tolerance
from popxl_flash.plan.config import AttentionConfig

@dataclass(frozen=True)
class Case:
    """One self-check case: shapes, dtype and the options of ``flash_attention`` (``Gk``: the
    groups of k and v, ``None`` for G)."""
    name: str
    G: int
    Lq: int
    Lkv: int
    D: int
    dtype: str
    options: dict = field(default_factory=dict)
    quick: bool = True
    Gk: Optional[int] = None
    packing: Optional[tuple] = None  # sequence lengths packed into Lq = Lkv; the rest padding

    @property
    def kv_groups(self):
        return self.G if self.Gk is None else self.Gk

    def describe(self):
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        groups = f"G={self.G}" + (f" Gk={self.Gk}" if self.Gk is not None else "")
        packed = f" packed {list(self.packing)}" if self.packing else ""
        return (f"{self.name}: {self.dtype} {groups} Lq={self.Lq} Lkv={self.Lkv} D={self.D}"
                + packed + (f" ({opts})" if opts else ""))

    def segment_ids(self):
        """int32 ``[1, L]`` ids of :attr:`packing` (-1 on padding), or ``None``."""
        if self.packing is None:
            return None
        ids = np.repeat(np.arange(len(self.packing)), self.packing)
        return np.pad(ids, (0, self.Lq - len(ids)), constant_values=-1).astype(np.int32)[None]


#: The fixed matrix. ``quick=False`` cases run only without ``--quick``.
CASES = (
    Case("causal", 2, 256, 256, 64, "float16", dict(causal=True)),
    Case("causal-fp32", 2, 256, 256, 64, "float32", dict(causal=True)),
    Case("non-causal-tails", 2, 113, 203, 32, "float16", dict(causal=False)),
    Case("non-causal-fp32", 1, 130, 70, 16, "float32",
         dict(causal=False, num_chunks_q=3, num_chunks_kv=2)),
    Case("window", 2, 300, 300, 32, "float32",
         dict(causal=False, window=(48, 16), num_chunks_q=3, num_chunks_kv=5)),
    Case("narrow-window-empty-rows", 2, 90, 40, 16, "float16",
         dict(causal=False, window=(0, 0), num_chunks_q=4, num_chunks_kv=3)),
    Case("causal-lq>lkv-empty-rows", 2, 200, 77, 32, "float16",
         dict(causal=True, num_chunks_q=7, num_chunks_kv=4)),
    Case("row-passes-empty-chunk", 2, 200, 77, 32, "float16",
         dict(causal=True, num_chunks_q=4, num_chunks_kv=1)),
    Case("chunk-length-1", 1, 12, 9, 8, "float32",
         dict(causal=True, num_chunks_q=12, num_chunks_kv=9)),
    Case("single-query", 3, 1, 97, 64, "float16", dict(causal=False)),
    Case("large-scale", 2, 64, 64, 16, "float32", dict(causal=True, scale=8.0)),
    Case("grouped-query", 8, 160, 160, 32, "float16", dict(causal=True), Gk=2),
    Case("multi-query-window-tails", 4, 70, 103, 16, "float32",
         dict(causal=False, window=(20, 5), num_chunks_q=3, num_chunks_kv=4), Gk=1),
    Case("packed-causal-padding", 2, 200, 200, 32, "float16",
         dict(causal=True, num_chunks_q=5, num_chunks_kv=5), packing=(37, 80, 5, 60)),
    Case("packed-window-fp32", 2, 150, 150, 16, "float32",
         dict(causal=True, window=(20, 0), num_chunks_q=6, num_chunks_kv=4), packing=(70, 1, 64)),
    Case("long-causal", 2, 4096, 4096, 64, "float16", dict(causal=True), quick=False),
    Case("long-window", 1, 4096, 4096, 128, "float16",
         dict(causal=True, window=(512, 0)), quick=False),
)


def _inputs(case, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.G, case.Lq, case.D)).astype(case.dtype)
    k = rng.standard_normal((case.kv_groups, case.Lkv, case.D)).astype(case.dtype)
    v = rng.standard_normal((case.kv_groups, case.Lkv, case.D)).astype(case.dtype)
    dout = rng.standard_normal((case.G, case.Lq, case.D)).astype(case.dtype)
    return q, k, v, dout


def _build(options):
    def build(q, k, v, dout, *ids):
        segs = dict(q_segment_ids=ids[0], kv_segment_ids=ids[0]) if ids else {}
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **options, **segs)
        dq, dk, dv = pf.flash_attention_grad(dout, q, k, v, out, lse, **options, **segs)
        return [out, lse, dq, dk, dv]
    return build


def check_case(case, device, seed=0, fp_checks=True):
    """Run one case (forward and stash-mode backward in one graph) and check it.

    Args:
        case: a :class:`Case`. device: a name of :data:`popxl_flash.checks.devices.NAMES`.
        seed: data seed. fp_checks: run with floating-point traps on
            (:func:`popxl_flash.enable_floating_point_checks`; they trap on ``ipu_hw`` and in
            the emulator).

    Returns:
        ``(ok, ratios, seconds)``: ``ratios`` maps each checked quantity to error / bound (<= 1
        passes) or to a string naming a failed exact property.
    """
    q, k, v, dout = _inputs(case, seed)
    ids = case.segment_ids()
    result = harness.run_graph(_build(case.options), [q, k, v, dout] + ([ids] if ids is not None
                                                                         else []),
                               device=device, fp_checks=fp_checks)
    out, lse, dq, dk, dv = result.outputs
    mask = {key: case.options.get(key, default)
            for key, default in (("causal", True), ("scale", None), ("window", None))}
    if ids is not None:
        mask.update(q_segment_ids=ids, kv_segment_ids=ids)
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (case.dtype,) * 3,
                                      **case.options)
    ratios = _check_forward(case, cfg, (q, k, v), out, lse, mask)
    ratios.update(_check_backward(case, cfg, (q, k, v, dout), (dq, dk, dv), mask))
    ok = all(not isinstance(r, str) and r <= 1.0 for r in ratios.values())
    return ok, ratios, result.seconds


def _ratio(x, naive, ref, **rule):
    bound = tolerance.rule_bound(naive, ref, **rule)
    err = tolerance.max_err(x, ref)
    return err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))


def _check_forward(case, cfg, qkv, out, lse, mask):
    q, k, v = qkv
    ref_out, ref_lse = pf.reference.attention(q, k, v, **mask)
    naive_out, _ = tolerance.naive_attention(q, k, v, **mask)
    _, naive32_lse = tolerance.naive_attention(*(a.astype(np.float32) for a in qkv), **mask)
    empty = np.isneginf(ref_lse)
    steps = cfg.num_chunks_kv + cfg.chunk_kv + case.D
    ratios = {}
    if not (np.isfinite(out).all() and not np.isnan(lse).any()):
        ratios["out/lse finite"] = "NaN or inf in out, or NaN in lse"
    elif not (np.array_equal(np.isneginf(lse), empty) and (out[empty] == 0).all()):
        ratios["empty rows"] = "rows that see no key must give out 0 and lse -inf"
    ratios["out"] = _ratio(out, naive_out, ref_out, factor=2, dtype=case.dtype,
                           accum_steps=steps, magnitude=float(np.abs(v).max()),
                           parity=tolerance.probability_rounding_floor(q, k, v, **mask))
    ratios["lse"] = _ratio(lse, naive32_lse, ref_lse, factor=2, dtype="float32",
                           accum_steps=steps,
                           magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))
    return ratios


def _check_backward(case, cfg, tensors, grads, mask):
    q, k, v, dout = tensors
    refs = pf.reference.attention_grad(dout, q, k, v, **mask)
    naives = tolerance.naive_attention_grad(dout, q, k, v, **mask)
    mags, stash = tolerance.grad_bounds(dout, q, k, v, dtype=case.dtype, **mask)
    steps = tolerance.gradient_accum_steps(cfg)
    ratios = {}
    for name, g, ref, naive, mag, extra, n in zip(("dq", "dk", "dv"), grads, refs, naives,
                                                  mags, stash, steps):
        if not np.isfinite(g).all():
            ratios[name + " finite"] = "NaN or inf in the gradient"
        ratios[name] = _ratio(g, naive, ref, factor=3, dtype=case.dtype, accum_steps=n,
                              magnitude=mag, extra_floor=extra,
                              parity=tolerance.gradient_rounding_parity(mag, case.dtype))
    return ratios


def _format(ratios):
    return " ".join(f"{k}={v:.3g}" if not isinstance(v, str) else f"{k}: {v}"
                    for k, v in ratios.items())


def run(cases, device, out=sys.stdout, fp_checks=True):
    """Check ``cases`` on ``device``, printing one line each and a summary.

    Args:
        cases: :class:`Case` list. device: a device name. out: where to print.
        fp_checks: as :func:`check_case`.

    Returns:
        The number of failed cases.
    """
    traps = "on" if fp_checks else "off"
    print(f"popxl_flash selfcheck: backend {pf.BACKEND}, device {device}, {len(cases)} cases, "
          f"floating-point traps {traps} (figures are error / allowed error; <= 1 passes)",
          file=out)
    failed = 0
    for case in cases:
        start = time.perf_counter()
        try:
            ok, ratios, _ = check_case(case, device, fp_checks=fp_checks)
            detail = _format(ratios)
        except Exception as err:  # report and go on: every case is a finding on new hardware
            ok, detail = False, f"raised {type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {case.describe()}  {detail}  "
              f"[{time.perf_counter() - start:.1f} s]", file=out)
    print(f"selfcheck: {len(cases) - failed} passed, {failed} failed", file=out)
    return failed


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m popxl_flash.selfcheck",
        description="Check flash attention's forward and backward against the float64 "
                    "reference on the active PopXL backend.")
    parser.add_argument("--device", choices=devices.NAMES, default=devices.default_device(),
                        help="ipu_hw (a real IPU), ipu_model (the full-size 1472-tile IPU "
                             "model) or cpu (default: ipu_hw with the Poplar SDK, else "
                             "ipu_model)")
    parser.add_argument("--quick", action="store_true",
                        help="skip the long-sequence cases (seconds instead of minutes)")
    parser.add_argument("--no-fp-checks", action="store_true",
                        help="run without the floating-point traps (on by default: an "
                             "overflow, division by zero or invalid operation fails the case)")
    parser.add_argument("--copies", action="store_true",
                        help="instead of the matrix: the lowering copies of one forward and one "
                             "backward, PopART's decisions (read from its log, SDK only) next "
                             "to the emulator's model (popxl_flash.checks.copycheck)")
    parser.add_argument("--calibrate", action="store_true",
                        help="instead of the matrix: time micro-graphs on the device and write "
                             "the cost model's fitted IPU constants (popxl_flash.checks."
                             "calibrate); on the emulator, print what it would measure")
    parser.add_argument("--output", default="ipu-constants.json",
                        help="with --calibrate: the JSON file to write (default "
                             "ipu-constants.json)")
    args = parser.parse_args(argv)
    if args.calibrate:
        from popxl_flash.checks import calibrate
        return calibrate.run(args.device, args.output)
    if args.copies:
        from popxl_flash.checks import copycheck
        return copycheck.run(args.device)
    cases = [c for c in CASES if c.quick or not args.quick]
    return 1 if run(cases, args.device, fp_checks=not args.no_fp_checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
