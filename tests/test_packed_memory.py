"""The packed and context-parallel memory bounds against the emulator (issue 32): never below
the peak beyond a call's inputs and outputs, and at most 1.2x it plus 1 MiB.

* Packed passes (segment ids, varlen positions): :func:`popxl_flash.plan.packed.pass_bytes`,
  the op-by-op walk of the segment-id graph, over drawn shapes, chunkings, packings, masks,
  padding, grouped-query, both dtypes, forward and backward.
* Context parallelism: :func:`popxl_flash.plan.context_parallel.replica_bytes` over drawn
  replica counts, layouts, rounds, the split and chunkings, every replica's forward and
  (stash-mode) backward.
"""
import numpy as np
from hypothesis import given, settings, strategies as st

from popxl_flash.api import context_parallel as cp
from popxl_flash.plan import context_parallel as pcp
from popxl_flash.plan import packed, schedule
from attention_utils import random_qkv
from test_context_parallel import run_cp
from test_context_parallel_plan import _run_stashed_grad
from test_forward import emulator_only
from test_memory_model import TIGHT, TIGHT_FLOOR
from test_packed_choice import _model, _run

pytestmark = emulator_only


@st.composite
def packed_cases(draw):
    L = draw(st.integers(16, 400))
    doc = draw(st.integers(3, 2 * L))
    ids = np.arange(L) // doc
    if draw(st.booleans()):
        ids[L - draw(st.integers(1, L - 1)):] = -1  # padding rows at the end
    positions = draw(st.booleans())
    ends = np.minimum((ids + 1) * doc, L)
    side = st.integers(-1, 120)
    G, Gk = draw(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2), (8, 2)]))
    return dict(L=L, G=G, Gk=Gk, D=draw(st.sampled_from([16, 32, 64, 128])),
                dtype=draw(st.sampled_from(["float16", "float32"])),
                nq=draw(st.integers(1, 6)), nkv=draw(st.integers(1, 6)),
                causal=draw(st.booleans()),
                window=draw(st.one_of(st.none(), st.tuples(side, side))),
                ids=ids, pos=(np.arange(L) - ends) if positions else None,
                backward=draw(st.booleans()), seed=0)


@settings(max_examples=40, deadline=None)
@given(packed_cases())
def test_packed_bound_is_an_upper_bound_and_tight(case):
    _, measured, _ = _run(case)
    sched, _, seg, _ = _model(case)
    bound = packed.pass_bytes(sched, segments=seg, groups=case["G"], kv_groups=case["Gk"],
                              head_dim=case["D"], dtype=case["dtype"],
                              backward=case["backward"])
    assert measured <= bound <= TIGHT * measured + TIGHT_FLOOR, (measured, bound)


def test_packed_choice_prices_the_walk():
    """The packed choice's memory figures are :func:`packed.pass_bytes` of its schedule."""
    seg = packed.SegmentConfig(1, 1, True)
    c = packed.evaluate(512, 512, 128, 128, head_dim=64, groups=4, dtype="float16",
                        causal=True, window=(-1, -1), segments=seg)
    sched = schedule.plan(512, 512, 128, 128, causal=False, window=(-1, -1))
    for backward, mem in ((False, c.memory_forward), (True, c.memory_backward)):
        assert mem == packed.pass_bytes(sched, groups=4, head_dim=64, dtype="float16",
                                        backward=backward, segments=seg, kv_groups=4)


@st.composite
def cp_cases(draw):
    R = draw(st.sampled_from([2, 4]))
    layout = draw(st.sampled_from(cp.LAYOUTS))
    per = draw(st.sampled_from([32, 64, 128])) * (2 if layout == "zigzag" else 1)
    G, Gk = draw(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2)]))
    steps = draw(st.sampled_from([None, 1, 2, 4]))
    return dict(R=R, layout=layout, G=G, Gk=Gk, L=R * per,
                D=draw(st.sampled_from([32, 64, 128])),
                dtype=draw(st.sampled_from(["float16", "float32"])),
                causal=draw(st.booleans()),
                window=draw(st.one_of(st.none(), st.tuples(st.integers(-1, 200),
                                                           st.integers(-1, 40)))),
                steps=steps, split=draw(st.sampled_from([None, False, True])))


def _cp_measured(c):
    """Every replica's peak beyond its inputs and outputs, forward and backward, and the
    plan."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, c["G"], c["L"], c["L"], c["D"], np.dtype(c["dtype"]), c["Gk"])
    options = dict(kv_gather_steps=c["steps"], split=c["split"], causal=c["causal"],
                   window=c["window"])
    _, _, session = run_cp(q, k, v, c["R"], c["layout"], **options)
    io = (2 * q.nbytes + k.nbytes + v.nbytes + 4 * c["G"] * c["L"]) // c["R"]
    fwd = [p.peak_live_bytes - io for p in session.profile.replicas]
    out = rng.standard_normal(q.shape).astype(c["dtype"])
    lse = rng.standard_normal((c["G"], c["L"])).astype(np.float32)
    bwd = _run_stashed_grad(dict(dout=out.copy(), q=q, k=k, v=v, out=out, lse=lse), c["R"],
                            c["layout"], **options)
    plan = cp.explain(c["L"], c["R"], head_dim=c["D"], groups=c["G"], kv_groups=c["Gk"],
                      dtype=c["dtype"], layout=c["layout"], kv_gather_steps=c["steps"],
                      **{n: options[n] for n in ("split", "causal", "window")}).plan
    return fwd, bwd, plan


@settings(max_examples=10, deadline=None)
@given(cp_cases())
def test_context_parallel_bound_is_an_upper_bound_and_tight(c):
    fwd, bwd, plan = _cp_measured(c)
    for backward, measured in ((False, fwd), (True, bwd)):
        bound = pcp.replica_bytes(plan, backward)
        assert max(measured) <= bound <= TIGHT * max(measured) + TIGHT_FLOOR, (
            backward, measured, bound)
