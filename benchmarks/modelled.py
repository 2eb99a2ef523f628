"""Benchmark: modelled IPU time of shapes from real models, flash vs naive vs the seed's rule.

Run from the repository root::

    python -m benchmarks.modelled --markdown docs/modelled.md

Prefill (forward and stash backward, float16, batch 1, one IPU's heads): for each model shape
the automatic choice under the default ``memory_budget``, the seed's 256-row chunk rule and
naive attention, priced by PopART's lowering (``popxl_flash/lowering.py``, priced by
``popxl_flash/ipu_model.py``) from their counted work: ``plan/counts.py``'s pass work and
``plan/baselines.py``'s naive work, both fitted to and held to the emulator's priced profile by
the tests. Decode (one new token over a filled cache): the emulator runs
``flash_attn_with_kvcache``'s automatic structure and a naive cached attention
(``benchmarks.kvcache.naive_decode``) and its run profile prices them (compute sets, matmul
FLOPs, vector work, bytes copied). Every time is **modelled** with the constants printed in the
header (PopART's lowering at poplibs' estimates until ``python -m popxl_flash.selfcheck
--calibrate`` has run on an IPU); none is measured on an IPU.
"""
import argparse
import sys

import numpy as np

import popxl_flash as pf
from benchmarks.kvcache import naive_decode
from popxl_flash.checks.harness import run_graph
from popxl_flash.plan import ipu_time, memory

#: (name, heads, head dim, L, causal): the attention of one layer, batch 1.
PREFILL = (
    ("nanoGPT (the seed's demo)", 24, 64, 1024, True),
    ("GPT-J 6B", 16, 256, 2048, True),
    ("Llama-2 7B, 8 heads per IPU", 8, 128, 4096, True),
    ("Llama-2 7B, 32 heads on one IPU", 32, 128, 4096, True),
    ("BERT-large", 16, 64, 512, False),
    ("long: 16K", 8, 128, 16384, True),
    ("long: 32K", 4, 128, 32768, True),
)
#: (name, q heads, kv heads, head dim, cache rows): one decode step, batch 1.
DECODE = (
    ("nanoGPT", 24, 24, 64, 1024),
    ("GPT-J 6B", 16, 16, 256, 2048),
    ("Llama-2 7B, 8 heads per IPU", 8, 8, 128, 4096),
    ("Llama-2 7B, 32 heads", 32, 32, 128, 4096),
)

MiB = 2.0 ** 20


def _us(t):
    return f"{t.seconds * 1e6:,.1f}"


def _terms(t):
    """Compute set / matmul / vector / copy shares of a modelled time, in microseconds."""
    c = t.clock_hz / 1e6
    return (f"{t.compute_set_cycles / c:,.1f} / {t.matmul_cycles / c:,.1f} / "
            f"{t.vector_cycles / c:,.1f} / {t.copy_cycles / c:,.1f}")


def prefill_rows():
    """One row per shape and structure."""
    rows = []
    for name, heads, D, L, causal in PREFILL:
        choice = pf.explain(L, L, head_dim=D, groups=heads, causal=causal)
        entries = [(f"flash {choice.chosen.structure}", choice.chosen),
                   ("seed's 256-row rule", choice.seed), ("naive", choice.naive)]
        for label, c in entries:
            rows.append(dict(
                shape=f"{name}: G={heads}, D={D}, L={L}{'' if causal else ', non-causal'}",
                structure=label, forward=_us(c.time_forward), backward=_us(c.time_backward),
                total=f"{c.seconds * 1e6:,.1f}", terms=_terms(c.time_forward + c.time_backward),
                compute_sets=f"{c.forward.compute_sets:,.0f} / {c.backward.compute_sets:,.0f}",
                memory=f"{c.memory_forward / MiB:,.1f} / {c.memory_backward / MiB:,.1f}",
                fits="yes" if c.fits else "NO"))
    return rows


def _decode_profile(build, Hq, Hkv, D, Lc, fill=0.5):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, Hq, D)).astype(np.float16)
    kc, vc = (rng.standard_normal((1, Lc, Hkv, D)).astype(np.float16) for _ in range(2))
    kn, vn = (rng.standard_normal((1, 1, Hkv, D)).astype(np.float16) for _ in range(2))
    seqlens = np.full(1, max(1, round(fill * Lc)) - 1, np.int32)
    return run_graph(build, [q, kc, vc, kn, vn, seqlens]).profile


def decode_rows():
    rows = []
    flash = lambda *t: [pf.flash_attn_with_kvcache(*t[:5], cache_seqlens=t[5], causal=True)]  # noqa: E731
    loop = lambda *t: [pf.flash_attn_with_kvcache(*t[:5], cache_seqlens=t[5], causal=True,  # noqa: E731
                                                  num_splits=1, num_chunks_kv=t[1].shape[1] // 256)]
    naive = lambda *t: [naive_decode(*t)]  # noqa: E731
    for name, Hq, Hkv, D, Lc in DECODE:
        auto = pf.kvcache.explain(1, 1, Lc, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                                  causal=True).chosen
        for label, build in ((f"flash (automatic: {auto.structure})", flash),
                             ("flash, one kv loop of 256-row chunks", loop),
                             ("naive over the cache", naive)):
            prof = _decode_profile(build, Hq, Hkv, D, Lc)  # host transfers are not priced
            t = prof.modelled()
            rows.append(dict(shape=f"{name}: Hq={Hq}, Hkv={Hkv}, D={D}, cache {Lc}, half full",
                             structure=label, compute_sets=f"{prof.compute_sets:,}",
                             total=_us(t), terms=_terms(t)))
    return rows


def table(rows, columns):
    head = "| " + " | ".join(title for title, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = ["| " + " | ".join(str(r[key]) for _, key in columns) + " |" for r in rows]
    return "\n".join([head, rule] + body)


def markdown(decode=True):
    """The page (``decode=False``: without the decode table, which runs the emulator)."""
    c = ipu_time.current()
    lines = [
        "# Modelled IPU time of real models' attention",
        "",
        "Generated by `python -m benchmarks.modelled --markdown docs/modelled.md`. Every time is "
        f"**{ipu_time.label(c)}**: `cycles = {c.compute_set_cycles:g} x compute sets + matmul "
        f"FLOPs / ({c.tiles} x {c.matmul_flops_per_tile_cycle['float16']:g}) + sum of vector "
        f"work / ({c.tiles} x rate) + bytes copied / ({c.tiles} x "
        f"{c.copy_bytes_per_tile_cycle:g})` at {c.clock_hz / 1e9:g} GHz, rates (elements per "
        "tile-cycle) " + ", ".join(f"{k} {v:.3g}" for k, v in c.vector_rates.items()) + "; "
        "compute sets, vector work and copies per op as PopART lowers it "
        "(`popxl_flash/lowering.py`, each row with its source). Batch 1, float16, "
        "default `memory_budget` (per pass, twice the pass's own inputs' and outputs' bytes "
        f"plus {memory.DEFAULT_FIXED_BYTES // MiB} MiB beyond them).",
        "",
        "## Prefill and training: forward and stash backward",
        "",
        "Counted work from the pass counts and naive counts the tests hold to the emulator; "
        "memory is the model's upper bound of the bytes beyond inputs and outputs. Terms: "
        "compute sets / matmul / vector / copies, forward + backward, µs.",
        "",
        table(prefill_rows(), [("shape", "shape"), ("structure", "structure"),
                               ("forward µs", "forward"), ("backward µs", "backward"),
                               ("total µs", "total"), ("terms µs", "terms"),
                               ("compute sets f / b", "compute_sets"),
                               ("MiB f / b", "memory"), ("fits", "fits")]),
        "",
        "## Decode: one new token, cache half full",
        "",
        "Measured on the emulator (its run profile priced by the lowering table: compute "
        "sets, matmul FLOPs, vector work, bytes copied; host transfers are not priced). The "
        "automatic structure is the straight-line pass (one pass over the whole cache); the kv "
        "loop of 256-row chunks is what the automatic choice ran before (matmul FLOPs "
        "following the fill, a few dozen compute sets per chunk).",
        "",
        table(decode_rows() if decode else [], [("shape", "shape"), ("structure", "structure"),
                              ("compute sets", "compute_sets"), ("modelled µs", "total"),
                              ("terms µs", "terms")]),
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.modelled", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--markdown", help="write the tables to this file (else print them)")
    p.add_argument("--no-decode", action="store_true",
                   help="skip the decode table (it runs the emulator)")
    args = p.parse_args(argv)
    text = markdown(decode=not args.no_decode)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
