"""Host-side models against the emulator's counts where the other tests leave gaps: the
context-parallel explain with chunk lengths that do not divide each other and in float16, and
the decode structure choice as a rule (the least modelled time among the candidates that fit
the memory budget, each the model's own evaluation).
"""
import math

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import random_qkv
from popxl_flash.api import context_parallel as cp
from popxl_flash.api import kvcache
from test_context_parallel import run_cp, run_cp_grad

emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator run profile")


@emulator_only
@pytest.mark.parametrize("R,layout,steps,chunks,causal,dtype", [
    (2, "contiguous", 1, (3, 4), True, "float32"),   # chunks of 16 q rows, 24 kv columns
    (2, "zigzag", 1, (4, 3), False, "float32"),      # 12 and 32
    (2, "zigzag", 2, (3, 2), True, "float16"),       # 16 and 24, two rounds, float16
    (4, "contiguous", 1, (1, 2), True, "float16"),
])
def test_context_parallel_explain_is_exact(R, layout, steps, chunks, causal, dtype):
    """FLOPs per replica and collective bytes (gathered, and in the backward also
    reduce-scattered) of pf.context_parallel.explain are the emulator's, with chunk lengths
    that do not divide each other and in float16 (2-byte elements gathered, float32 dk/dv
    scattered)."""
    G, Gk, L, D = 2, 1, 96, 8
    q, k, v = random_qkv(np.random.default_rng(3), G, L, L, D, dtype, kv_groups=Gk)
    nq, nkv = chunks
    _, _, session = run_cp(q, k, v, R, layout, kv_gather_steps=steps, causal=causal,
                           num_chunks_q=nq, num_chunks_kv=nkv)
    cost = cp.explain(L, R, head_dim=D, groups=G, kv_groups=Gk, dtype=dtype, causal=causal,
                      layout=layout, kv_gather_steps=steps, num_chunks_q=nq, num_chunks_kv=nkv)
    reps = session.profile.replicas
    assert [p.matmul_flops for p in reps] == list(cost.flops)
    assert [p.collective_bytes for p in reps] == [cost.gathered_bytes] * R
    # the stash backward gathers K/V again and reduce-scatters float32 dk/dv
    dout = np.random.default_rng(4).standard_normal(q.shape).astype(dtype)
    _, grad_session = run_cp_grad(dout, q, k, v, R, layout, kv_gather_steps=steps,
                                  causal=causal, num_chunks_q=nq, num_chunks_kv=nkv)
    backward = [p.collective_bytes for p in grad_session.profile.replicas]
    assert backward == [2 * cost.gathered_bytes + cost.scattered_bytes] * R


@pytest.mark.parametrize("B,Lq,Lc,Hq,Hkv,D,mods", [
    (2, 1, 4096, 4, 2, 64, {}), (1, 1, 512, 8, 1, 128, {}), (4, 4, 2048, 4, 4, 64,
                                                             dict(alibi=True)),
    (2, 32, 1024, 4, 2, 64, {}), (1, 1, 100, 2, 2, 16, dict(softcap=True)),
    (1, 16, 4096, 32, 4, 64, {}),
])
def test_decode_choice_is_the_least_modelled_time(B, Lq, Lc, Hq, Hkv, D, mods):
    """The automatic structure is a candidate the choice evaluated, each candidate's figures
    are the model's (kvcache.evaluate), and it has the least modelled time among the
    candidates that fit the memory budget (the default one, and one that excludes the
    fastest candidate)."""
    dims = kvcache.Dims(B, Lq, Lc, Lq, Hq, Hkv, D)
    budgets = [None]
    for budget in budgets:
        choice = kvcache.decode_choice(B, Lq, Lc, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                                       memory_budget=budget, **mods)
        assert choice.chosen in choice.candidates and len(choice.candidates) >= 1
        for c in choice.candidates:
            again = kvcache.evaluate(dims, c.splits, c.chunk_kv, straight=c.straight,
                                     memory_budget=budget, **mods)
            assert (again.seconds, again.flops, again.ops, again.memory_bytes, again.fits) == \
                (c.seconds, c.flops, c.ops, c.memory_bytes, c.fits)
        fitting = [c for c in choice.candidates if c.fits]
        assert choice.chosen.fits
        assert choice.chosen.seconds == min(c.seconds for c in fitting)
        if budget is None:
            others = [c.memory_bytes for c in fitting if c is not choice.chosen
                      and c.memory_bytes < choice.chosen.memory_bytes]
            if others:  # a budget the chosen one misses, some other one meets
                budgets.append(max(others))
    if Lq == 16:  # the large straight-line score matrix: a budget below it picks a loop
        assert len(budgets) == 2 and not choice.chosen.straight
    if Lq == 1 and Lc >= 1024:  # several structures were weighed
        assert len({(c.structure, c.splits, c.chunk_kv) for c in choice.candidates}) > 1
