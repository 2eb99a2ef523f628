"""Fit the planner's pass-work coefficients to the emulator's priced profile.

``python -m popxl_flash.checks.fit_work [--cases N] [--seed S]`` builds forward and stash-mode
backward passes of ``pf.flash_attention`` on the emulator over drawn shapes, chunkings, masks,
grouped-query groupings, scales and both dtypes; prices each run by PopART's lowering (the run
profile's compute sets, vector work by rate key and views' and ops' copies); lists each pass's
parts with :func:`popxl_flash.plan.counts.pass_records`; and solves, per pass direction, dtype
and metric, the least-squares coefficients of every (part, shape term). It writes them to
:data:`popxl_flash.plan.counts.WORK_FILE` and prints the largest residual (0 up to rounding when
the parts describe the graphs). Rerun it whenever the graph code changes; ``tests/test_counts.py``
then holds the predictions to the emulator on other shapes.

Emulator only (the profile is the emulator's).
"""
import argparse
import json
import sys

import numpy as np

from popxl_flash.lowering import RATE_KEYS
from popxl_flash.plan import counts, schedule
from popxl_flash.plan.config import AttentionConfig


def _profile_metrics(profile):
    """``{metric: value}`` of a run profile (:data:`popxl_flash.plan.counts.METRICS`), and
    the exact counts the planner computes itself: ``boundary`` copies, ``matmul_flops``,
    ``iterations``."""
    w = profile.work
    out = {"compute_sets": profile.compute_sets,
           "copied": profile.copied_by_kind["view"] + profile.copied_by_kind["op"],
           "boundary": profile.boundary_bytes_copied, "matmul_flops": profile.matmul_flops,
           "iterations": profile.loop_iterations,
           "ops": profile.ops_excluding_views - sum(profile.ops_by_kind.get(k, 0)
                                                   for k in ("host_load", "host_store"))}
    out.update({k: w.vector_work.get(k, 0) for k in RATE_KEYS})
    return out


def _two_passes(forward, backward, arrays):
    """Priced metrics of ``forward`` and of ``forward`` then ``backward`` minus it."""
    from popxl_flash.checks import harness
    q, k, v = arrays
    fwd = harness.run_graph(lambda q, k, v: list(forward(q, k, v)), [q, k, v]).profile
    both = harness.run_graph(lambda do, q, k, v: list(backward(do, q, k, v)),
                             [q, q, k, v]).profile
    forward, total = _profile_metrics(fwd), _profile_metrics(both)
    return forward, {m: total[m] - forward[m] for m in total}


def _arrays(G, Gk, Lq, Lkv, D, dtype):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((G, Lq, D)).astype(dtype)
    k, v = (rng.standard_normal((Gk, Lkv, D)).astype(dtype) for _ in range(2))
    return q, k, v


def measure(G, Gk, Lq, Lkv, D, dtype, options):
    """The priced metrics of one flash forward pass and one stash-mode backward pass on the
    emulator.

    Returns:
        ``(forward, backward)``, each ``{metric: value}``.
    """
    import popxl_flash as pf
    from popxl_flash.backend import popxl

    def call(module, *inputs):  # the modules (which take ``lean``), as the functions call them
        return list(popxl.ops.call(popxl.gcg().ir.create_graph(module, *inputs), *inputs))

    def forward(q, k, v):
        return call(pf.FlashAttention(**options), q, k, v)

    def backward(do, q, k, v):
        out, lse = forward(q, k, v)
        return call(pf.FlashAttentionGrad(**options), do, q, k, v, out, lse)

    return _two_passes(forward, backward, _arrays(G, Gk, Lq, Lkv, D, dtype))


def measure_naive(G, Lq, Lkv, D, dtype, options):
    """The priced metrics of naive attention's forward and backward (given ``out``)."""
    from popxl_flash.checks import naive

    def backward(do, q, k, v):
        out = naive.naive_attention(q, k, v, **options)
        return naive.naive_attention_grad(do, q, k, v, out, **options)

    return _two_passes(lambda q, k, v: [naive.naive_attention(q, k, v, **options)], backward,
                       _arrays(G, G, Lq, Lkv, D, dtype))


def draw_case(rng):
    """One drawn case ``(G, Gk, Lq, Lkv, D, dtype, options)`` (the structures the planner
    can pick, small enough to run in a fraction of a second)."""
    r = int(rng.choice([1, 1, 2, 3]))
    Gk = int(rng.integers(1, 3))
    Lq, Lkv = (int(rng.choice([rng.integers(1, 5), rng.integers(1, 24), rng.integers(24, 90)]))
               for _ in range(2))
    D = int(rng.choice([1, 3, 4, 8, 16]))
    dtype = str(rng.choice(["float16", "float32"]))
    nq = int(rng.integers(1, min(Lq, 6) + 1))
    nkv = int(rng.choice([1, rng.integers(1, min(Lkv, 6) + 1)]))
    window = [None, (4, 0), (10, 3), (-1, 6), (0, 0)][int(rng.integers(0, 5))]
    options = dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=bool(rng.integers(0, 2)),
                   window=window)
    if rng.random() < 0.3:
        options["scale"] = float(rng.choice([0.5, 0.3, 1.0, 0.125]))
    if rng.random() < 0.35:  # the memory-lean structures
        options["lean"] = True
    return Gk * r, Gk, Lq, Lkv, D, dtype, options


def draw_naive_case(rng):
    """One drawn naive-attention case ``(G, Lq, Lkv, D, dtype, options)``."""
    G, Lq, Lkv = (int(rng.integers(1, n)) for n in (5, 60, 60))
    D = int(rng.choice([1, 3, 4, 8, 16]))
    dtype = str(rng.choice(["float16", "float32"]))
    window = [None, (4, 0), (-1, 6)][int(rng.integers(0, 3))]
    return G, Lq, Lkv, D, dtype, dict(causal=bool(rng.integers(0, 2)), window=window)


def naive_records_of(G, Lq, Lkv, D, dtype, options):
    """The planner's records of a drawn naive case."""
    from popxl_flash.checks.reference import visibility
    from popxl_flash.plan import baselines
    masked = not visibility(Lq, Lkv, **options).all()
    return baselines.naive_records(groups=G, q_len=Lq, kv_len=Lkv, head_dim=D, masked=masked)


def records_of(G, Gk, Lq, Lkv, D, dtype, options, backward):
    """The planner's records of a drawn case's pass."""
    shape, kv_shape = (G, Lq, D), (Gk, Lkv, D)
    cfg = AttentionConfig.from_shapes(shape, kv_shape, kv_shape, (dtype,) * 3, **options)
    sched = schedule.plan(Lq, Lkv, cfg.chunk_q, cfg.chunk_kv, causal=cfg.causal,
                          window=cfg.window)
    return counts.pass_records(sched, head_dim=D, groups=G, kv_groups=Gk, backward=backward,
                               scale=options.get("scale"),
                               lean=cfg.lean_backward if backward else cfg.lean_forward)


def solve(rows):
    """Least-squares coefficients of one fit.

    Args:
        rows: ``[(records, {metric: measured})]``.
    Returns:
        ``({entry: {metric: {term: coef}}}, largest residual)``.
    """
    columns = sorted({(e, t) for records, _ in rows for e, terms in records for t in terms})
    index = {c: i for i, c in enumerate(columns)}
    A = np.zeros((len(rows), len(columns)))
    for r, (records, _) in enumerate(rows):
        for e, terms in records:
            for t, value in terms.items():
                A[r, index[e, t]] += value
    norm = np.maximum(np.abs(A).max(axis=0), 1.0)
    table, worst = {}, 0.0
    constant = np.array([t == "1" for _, t in columns])
    for metric in counts.METRICS:
        b = np.array([m[metric] for _, m in rows], float)
        use = constant if metric in counts.CONSTANT_METRICS else np.ones_like(constant)
        x = np.zeros(len(columns))
        x[use] = np.linalg.lstsq(A[:, use] / norm[use], b, rcond=None)[0] / norm[use]
        x = np.where(np.abs(x - np.round(x)) < 1e-6, np.round(x), np.round(x, 9))
        worst = max(worst, float(np.max(np.abs(A @ x - b) / np.maximum(np.abs(b), 1.0))))
        for (e, t), c in zip(columns, x):
            if c:
                table.setdefault(e, {}).setdefault(metric, {})[t] = float(c)
    return table, worst


def fit(cases, seed=0, out=sys.stdout):
    """Measure ``cases`` drawn flash cases (and a quarter as many naive ones) and fit every
    family, direction, dtype (and grouping). Returns the table."""
    rng = np.random.default_rng(seed)
    rows = {}
    for _ in range(cases):
        case = draw_case(rng)
        forward, backward = measure(*case)
        G, Gk, dtype = case[0], case[1], case[5]
        for is_bwd, measured in ((False, forward), (True, backward)):
            key = counts.fit_key("flash", is_bwd, dtype, Gk < G)
            rows.setdefault(key, []).append((records_of(*case, is_bwd), measured))
    for _ in range(max(cases // 4, 40)):
        case = draw_naive_case(rng)
        forward, backward = measure_naive(*case)
        for is_bwd, measured in ((False, forward), (True, backward)):
            key = counts.fit_key("naive", is_bwd, case[4])
            rows.setdefault(key, []).append((naive_records_of(*case), measured))
    table = {}
    for key in sorted(rows):
        table[key], worst = solve(rows[key])
        print(f"fit_work: {key}: {len(rows[key])} passes, largest relative residual "
              f"{worst:.2e}", file=out)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m popxl_flash.checks.fit_work",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    table = fit(args.cases, args.seed)
    with open(counts.WORK_FILE, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"fit_work: wrote {counts.WORK_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
