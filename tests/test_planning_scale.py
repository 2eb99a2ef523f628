"""Planning at long lengths: O(blocks) host memory and time, and the lazily built patterns.

The planner returns a key per distinct pattern, and the step groups and row passes their
keys and closed-form bounds; the dense cells are built only when read (by the graph code).
Here the lazily built cells are held equal to the eager, per-element ones (the dense way,
``planner_oracle``) on drawn shapes, the cost model is held to build none, and
``pf.explain`` at 131072 tokens to a bounded host memory and time.
"""
import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from planner_oracle import eager_row_passes, eager_step_groups
from test_schedule import SMALL, plan_args

from popxl_flash.plan import costmodel, schedule, steps
from popxl_flash.plan.schedule import plan

GROUP_ARRAYS = ("q_row", "kv_row", "q_chunk", "kv_chunk", "pattern_id", "patterns")


def _plan(args):
    lq, lkv, chunk_q, chunk_kv, causal, window = args
    return plan(lq, lkv, chunk_q, chunk_kv, causal=causal, window=window)


def _assert_array(got, want, name):
    if want is None:
        assert got is None, name
        return
    assert (got.dtype, got.shape) == (want.dtype, want.shape), name
    np.testing.assert_array_equal(got, want, err_msg=name)
    assert not got.flags.writeable, name


@given(plan_args(), st.sampled_from(schedule.ORDERS))
def test_step_groups_equal_eager(args, order):
    """Vectorised step groups from the pattern keys == sub-blocks sliced out of the dense
    patterns, deduplicated by bytes: shapes, order, tables, ids and (lazily built) cells."""
    s = _plan(args)
    got, want = steps.step_groups(s, order), eager_step_groups(s, order)
    assert [(g.rows, g.cols, g.masked) for g in got] == \
        [(w["rows"], w["cols"], w["masked"]) for w in want]
    for g, w in zip(got, want):
        assert g.num_patterns == (0 if w["patterns"] is None else w["patterns"].shape[0])
        for name in GROUP_ARRAYS:
            _assert_array(getattr(g, name), w[name], f"{order} {g.rows}x{g.cols} {name}")
    assert sum(g.cells for g in got) == s.executed_elements


@st.composite
def row_pass_args(draw, max_len=300):
    """(Lq, Lkv, chunk_q, causal, window): one kv chunk, 1 to 9 q chunks."""
    lq = draw(st.integers(1, max_len))
    lkv = draw(st.integers(1, max_len))
    chunk_q = draw(st.integers(-(-lq // 9), lq))
    side = st.integers(-1, SMALL) | st.integers(-1, max(lq, lkv) + 2)
    return lq, lkv, chunk_q, draw(st.booleans()), draw(st.none() | st.tuples(side, side))


@given(row_pass_args())
def test_row_passes_equal_eager(args):
    """Closed-form row passes == the dense visibility cut by q chunk: rows, columns seen,
    pattern and seen rows (built lazily) and the byte counts read without building them."""
    lq, lkv, chunk_q, causal, window = args
    s = plan(lq, lkv, chunk_q, lkv, causal=causal, window=window)
    got = steps.row_pass_plan(s)
    want = eager_row_passes(lq, lkv, chunk_q, causal, window)
    assert len(got) == len(want) == s.nq
    for p, w in zip(got, want):
        assert (p.rows, p.cols) == (w["rows"], w["cols"])
        assert p.masked == (w["pattern"] is not None)
        assert p.all_seen == (w["seen"] is None)
        assert p.pattern_nbytes == (0 if w["pattern"] is None else w["pattern"].nbytes)
        assert p.seen_nbytes == (0 if w["seen"] is None else w["seen"].nbytes)
        _assert_array(p.pattern, w["pattern"], f"{p.rows} pattern")
        _assert_array(p.seen, w["seen"], f"{p.rows} seen")


@given(plan_args())
def test_lazy_schedule_arrays_match_their_counts(args):
    """``pattern(i)`` is ``patterns[i]``; the counts the cost model reads instead of the
    arrays (``num_patterns``, ``patterns_nbytes``, ``num_empty_rows``) are theirs."""
    s = _plan(args)
    assert s.patterns_nbytes == s.patterns.nbytes
    assert s.num_patterns == s.patterns.shape[0]
    for i in range(s.num_patterns):
        np.testing.assert_array_equal(s.pattern(i), s.patterns[i])
    assert s.num_empty_rows == s.empty_rows.size
    assert s.empty_rows_before <= s.empty_rows_from <= s.Lq


def test_pattern_id_out_of_range_is_a_value_error():
    s = plan(8, 8, 4, 4)
    try:
        s.pattern(s.num_patterns)
    except ValueError as error:
        assert f"pattern_id={s.num_patterns}" in str(error)
    else:
        raise AssertionError("pattern(P) did not raise")


def test_the_choice_builds_no_pattern_cells():
    """Every candidate of a choice (a huge budget: all are planned) is counted without
    building a dense pattern, an empty-row array or a row pass's cells (the caches are
    cleared first: a graph built earlier in the session may have read a schedule's cells)."""
    for cache in (schedule._plan_cached, steps._groups_cached, steps.row_pass_plan,
                  costmodel.choose):
        cache.cache_clear()
    for kwargs in (dict(causal=True), dict(causal=False, window=(40, 3)),
                   dict(causal=True, window=(100, -1))):
        for lq, lkv in ((4096, 4096), (512, 4096), (4096, 1000)):
            choice = costmodel.choose(lq, lkv, head_dim=64, groups=2, dtype="float16",
                                      memory_budget=2**50, **kwargs)
            for c in choice.candidates + (choice.seed,):
                s = plan(lq, lkv, c.chunk_q, c.chunk_kv, **kwargs)
                built = [name for name in ("patterns", "empty_rows") if name in vars(s)]
                for order in schedule.ORDERS:
                    built += [f"{order} group" for g in steps.step_groups(s, order)
                              if "patterns" in vars(g)]
                if steps.row_passes(s):
                    built += [f"row pass {p.rows}" for p in steps.row_pass_plan(s)
                              if {"pattern", "seen"} & set(vars(p))]
                assert not built, (lq, lkv, kwargs, c.chunk_q, c.chunk_kv, built)


#: Host memory the 131072-token explain may use (address space: the child is killed above
#: it, as it was at 24 GB before planning was O(blocks)), and a wall-time bound generous for a
#: loaded 2-core CI machine (it takes well under 5 s there).
SCALE_ADDRESS_SPACE = 3 << 29  # 1.5 GiB
SCALE_SECONDS = 120.0
SCALE_CALLS = textwrap.dedent("""
    import json, resource, sys, time
    import popxl_flash as pf
    start = time.perf_counter()
    chosen = []
    for lq, lkv, kwargs in [(131072, 131072, {}), (131072, 131072, {"causal": False}),
                            (131072, 131072, {"window": (4096, 0)}),
                            (131072, 65536, {"causal": False, "window": (1000, 1000)}),
                            (2048, 131072, {}),
                            (131072, 131072, {"memory_budget": 2**50})]:
        c = pf.explain(lq, lkv, head_dim=128, groups=8, **kwargs).chosen
        chosen.append([c.chunk_q, c.chunk_kv])
    json.dump({"chosen": chosen, "seconds": time.perf_counter() - start}, sys.stdout)
""")


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (SCALE_ADDRESS_SPACE, SCALE_ADDRESS_SPACE))


def test_explain_at_131072_tokens_in_bounded_host_memory_and_time():
    """``pf.explain`` at L = 131072, G = 8, D = 128 (causal, non-causal, a window, Lq != Lkv,
    every candidate planned under a huge budget) in a child process whose address space is
    capped at 1.5 GiB, within :data:`SCALE_SECONDS`."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SCALE_CALLS], capture_output=True, text=True,
                          preexec_fn=_limit_address_space, env=env, timeout=2 * SCALE_SECONDS)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert elapsed < SCALE_SECONDS, result
    assert len(result["chosen"]) == 6
