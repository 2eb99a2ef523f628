"""Grouped-query / multi-query attention in the core: cost figures against multi-head attention.

Correctness (forward and backward against the float64 reference, which repeats k/v groups in the
oracle only) is covered by the properties of ``test_forward.py`` and ``test_backward.py``, whose
cases draw ``Gk | G``, and by ``test_flash_attn_interface.py`` for ``(Hq, Hkv)`` pairs. Here: k/v
are never materialised per q group (peak live bytes and bytes copied below MHA's for the same
q), the executed matmul FLOPs are exactly MHA's, and grouped-query attention adds only reshape
views to the graph.
"""
from collections import Counter

import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash.plan import memory
from popxl_flash import popxl
from popxl_flash.plan.config import AttentionConfig

from attention_utils import random_qkv, run_flash, run_graph
from test_forward import emulator_only

G, L, D = 8, 512, 32
CHUNKS = dict(num_chunks_q=4, num_chunks_kv=4)


def _runs(kv_groups, dtype):
    """Forward and stash-mode backward runs for q ``[G, L, D]`` and k/v ``[Gk, L, D]``."""
    rng = np.random.default_rng(kv_groups)
    q, k, v = random_qkv(rng, G, L, L, D, dtype, kv_groups)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse, fwd = run_flash(q, k, v, **CHUNKS)
    _, bwd = run_graph(lambda do, q, k, v, o, l: pf.flash_attention_grad(
        do, q, k, v, o, l, **CHUNKS), [dout, q, k, v, out, lse])
    return fwd.profile, bwd.profile


@emulator_only
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_memory_below_multi_head_and_flops_equal(dtype):
    """Gk in {2, 1} against Gk = G = 8, causal L = 512:

    * executed matmul FLOPs equal MHA's, exactly the planner's count for G q groups (forward
      and backward);
    * peak live bytes are lower by at least the k/v bytes saved, ``2 (G - Gk) L D itemsize``:
      k and v are resident for the whole loop (loop-invariant inputs), every other tensor of
      the grouped-query run is at most as large as its multi-head counterpart (the fold is a
      view), and the k/v blocks each step reads are ``[Gk, ckv, D]``;
    * bytes copied at call, conditional and repeat boundaries are not higher: the loops read
      k/v and their blocks in place (no conditional to copy them into), so only the state and
      the step counter cross boundaries, and their size does not depend on Gk.
    """
    cfg = AttentionConfig.from_shapes((G, L, D), (G, L, D), (G, L, D), (dtype,) * 3, **CHUNKS)
    mha_fwd, mha_bwd = _runs(G, dtype)
    assert mha_fwd.matmul_flops == cfg.schedule.forward_flops(D, G).executed
    assert mha_bwd.matmul_flops == cfg.schedule.backward_flops(D, G, mode="stash").executed
    for kv_groups in (2, 1):
        fwd, bwd = _runs(kv_groups, dtype)
        assert fwd.matmul_flops == mha_fwd.matmul_flops
        assert bwd.matmul_flops == mha_bwd.matmul_flops
        saved = 2 * (G - kv_groups) * L * D * np.dtype(dtype).itemsize
        assert fwd.peak_live_bytes <= mha_fwd.peak_live_bytes - saved, (kv_groups, fwd, mha_fwd)
        assert bwd.peak_live_bytes <= mha_bwd.peak_live_bytes - saved, (kv_groups, bwd, mha_bwd)
        assert fwd.bytes_copied <= mha_fwd.bytes_copied, (kv_groups, fwd, mha_fwd)
        assert bwd.bytes_copied <= mha_bwd.bytes_copied, (kv_groups, bwd, mha_bwd)


def _op_kinds(build):
    """Op kinds of every graph of an Ir built by ``build()`` in its main graph (emulator
    internals: the IR's op records)."""
    ir = popxl.Ir()
    with ir.main_graph:
        build()
    return Counter(op.kind for graph in ir._graphs for op in graph._ops)


@emulator_only
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_grouped_query_adds_only_reshapes(grad):
    """Folding the q groups into the matmul rows is views only: the graph for Gk < G has the
    ops of Gk = G plus ``reshape_`` views (PopXL turns in-placing off, so an outplace
    ``reshape`` would be a Copy program: ``reshapex.cpp:27``), and nothing else (no per-head
    copies, tiles or concats of k/v)."""
    def build(kv_groups):
        def fn():
            q = popxl.variable(np.zeros((4, 40, 8), np.float32))
            kv = popxl.variable(np.zeros((kv_groups, 40, 8), np.float32))
            if grad:
                pf.flash_attention_grad(q, q, kv, kv, **CHUNKS)
            else:
                pf.flash_attention(q, kv, kv, **CHUNKS)
        return fn
    mha, gqa = _op_kinds(build(4)), _op_kinds(build(1))
    extra = gqa - mha
    assert set(extra) == {"reshape_"} and not mha - gqa, (extra, mha - gqa)


def test_cost_model_and_memory_estimate_count_kv_groups():
    """The chunk-choice model and the analytic memory estimate take Gk: FLOPs and iterations
    stay those of G q groups, while the k/v terms shrink by G / Gk (at least the float32 dk, dv
    state in the backward's memory bound; exactly k, v in the memory estimate). Bytes
    copied are the loops' step counters alone (PopART's rules: k/v are read in place), equal
    for both."""
    Lq, Lkv, dtype, item = 300, 500, "float16", 2
    mha = pf.explain(Lq, Lkv, head_dim=D, groups=G, dtype=dtype, num_chunks_q=3, num_chunks_kv=4)
    mqa = pf.explain(Lq, Lkv, head_dim=D, groups=G, dtype=dtype, num_chunks_q=3, num_chunks_kv=4,
                     kv_groups=1)
    a, b = mha.chosen, mqa.chosen
    assert (a.forward_flops, a.backward_flops, a.iterations) == (
        b.forward_flops, b.backward_flops, b.iterations)
    lkv = 4 * 125  # padded Lkv
    sched = AttentionConfig.from_shapes((G, Lq, D), (G, Lkv, D), (G, Lkv, D), (dtype,) * 3,
                                        num_chunks_q=3, num_chunks_kv=4).schedule
    bounds = [memory.flash_bytes(sched, groups=G, kv_groups=gk, head_dim=D, dtype=dtype,
                                 backward=True, steps=a.backward.iterations) for gk in (G, 1)]
    # the float32 [dv; dk] state (padded) less the outputs' dk, dv: Gk groups' rows each
    assert bounds[0] - bounds[1] >= (G - 1) * 2 * (lkv * 4 - Lkv * item) * D
    assert a.memory_backward > b.memory_backward
    assert b.forward.boundary_bytes == a.forward.boundary_bytes
    assert b.backward.boundary_bytes == a.backward.boundary_bytes
    # the steps' dynamic slices of [k; v] copy Gk groups' rows
    assert b.forward.bytes_copied < a.forward.bytes_copied
    sched = AttentionConfig.from_shapes((G, Lq, D), (1, Lkv, D), (1, Lkv, D), (dtype,) * 3,
                                        num_chunks_q=3, num_chunks_kv=4).schedule
    est_mha, est_mqa = (sched.memory_bytes(D, G, itemsize=item, kv_groups=gk) for gk in (G, 1))
    assert est_mha == sched.memory_bytes(D, G, itemsize=item)
    assert est_mha.flash - est_mqa.flash == (G - 1) * 2 * Lkv * D * item
    with pytest.raises(ValueError, match="kv_groups must divide groups=8, got kv_groups=3"):
        sched.memory_bytes(D, G, kv_groups=3)
    with pytest.raises(ValueError, match="kv_groups must divide groups=8, got kv_groups=3"):
        pf.explain(Lq, Lkv, head_dim=D, groups=G, kv_groups=3)  # pf.explain's own argument


@emulator_only
def test_fold_is_no_op_for_multi_head():
    """Multi-head graphs are unchanged by grouped-query support: with Gk = G the fold and unfold
    return their input and create no op; with Gk < G each is one reshape view that stacks the q
    groups sharing a kv group as row blocks ([G, rows, X] -> [Gk, r * rows, X])."""
    from popxl_flash.graph import blocks
    from popxl_flash.emulator import count_ops

    def config(kv_groups):
        return AttentionConfig.from_shapes((4, 6, 2), (kv_groups, 5, 2), (kv_groups, 5, 2),
                                           ("float32",) * 3, num_chunks_q=2, num_chunks_kv=1)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2))
        before = count_ops(ir)
        mha = config(4)
        assert blocks.fold_heads(mha, t) is t and blocks.unfold_heads(mha, t) is t
        assert count_ops(ir) == before
        folded = blocks.fold_heads(config(2), t)
        assert folded.shape == (2, 6, 2) and count_ops(ir) == before + 1
        assert blocks.unfold_heads(config(2), folded).shape == (4, 3, 2)
        assert count_ops(ir) == before + 2
