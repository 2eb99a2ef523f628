"""Context parallelism (pf.context_parallel_attention): a sequence split across replicas.

Unsharded outputs, lse and gradients equal single-replica attention on the whole sequence
(tolerance rule of popxl_flash/checks/tolerance.py), per-replica work and memory, host helpers,
argument checks.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash import popxl
from popxl_flash.api import context_parallel as cp

from attention_utils import (DEVICE, assert_grads_within_rule, assert_within_rule,
                             naive_attention, random_qkv, run_flash)

ops = popxl.ops


def _streams(arrays, replicas):
    """One h2d stream per host array, of one replica's shard shape; returns the loaded tensors."""
    streams, tensors = [], []
    for name, x in arrays.items():
        shape = (x.shape[0], x.shape[1] // replicas, x.shape[2])
        dtype = {"float16": popxl.float16, "float32": popxl.float32}[x.dtype.name]
        s = popxl.h2d_stream(shape, dtype, name=name)
        streams.append(s)
        tensors.append(ops.host_load(s))
    return streams, tensors


def _shared_streams(arrays):
    """One h2d stream per host array of its own shape (every replica reads the same)."""
    streams = [popxl.h2d_stream(x.shape, getattr(popxl, x.dtype.name), name=name)
               for name, x in arrays.items()]
    return streams, [ops.host_load(s) for s in streams]


def _run(build, arrays, replicas, layout, shared=None):
    """Build a replicated main graph (fp checks on) from whole-sequence host arrays (and
    ``shared`` arrays every replica reads whole, passed to ``build`` after them), feed
    their shards, run, and unshard the outputs. Returns: (outputs, session)."""
    shared = shared or {}
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph:
        streams, tensors = _streams(arrays, replicas)
        shared_streams, shared_tensors = _shared_streams(shared)
        outs = []
        for t in build(*tensors, *shared_tensors):
            d = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(d, t)
            outs.append(d)
    pf.enable_floating_point_checks(ir)
    feeds = {s: cp.shard(x, replicas, layout) if replicas > 1 else x
             for s, x in zip(streams, arrays.values())}
    feeds.update({s: np.stack([x] * replicas) if replicas > 1 else x
                  for s, x in zip(shared_streams, shared.values())})
    with popxl.Session(ir, DEVICE) as session:
        res = session.run(feeds)
    return [cp.unshard(res[d], layout) if replicas > 1 else res[d] for d in outs], session


def run_cp(q, k, v, replicas, layout="zigzag", **options):
    (out, lse), session = _run(
        lambda q, k, v: cp.context_parallel_attention(q, k, v, layout=layout, return_lse=True,
                                                      **options),
        dict(q=q, k=k, v=v), replicas, layout)
    return out, lse, session


def run_cp_grad(dout, q, k, v, replicas, layout="zigzag", stash=True, **options):
    def build(do, q, k, v):
        out, lse = (cp.context_parallel_attention(q, k, v, layout=layout, return_lse=True,
                                                  **options) if stash else (None, None))
        return cp.context_parallel_attention_grad(do, q, k, v, out, lse, layout=layout,
                                                  **options)
    return _run(build, dict(dout=dout, q=q, k=k, v=v), replicas, layout)


@st.composite
def cp_cases(draw, max_dim=8):
    R = draw(st.sampled_from([1, 2, 4]))
    layout = draw(st.sampled_from(cp.LAYOUTS))
    per = draw(st.integers(1, 4)) * (2 if layout == "zigzag" else 1)  # rows per replica
    G = draw(st.integers(1, 3))
    Gk = draw(st.sampled_from([d for d in range(G, 0, -1) if G % d == 0]))
    steps = draw(st.sampled_from([s for s in (1, 2, per) if per % s == 0]))
    side = st.one_of(st.none(), st.integers(-1, 6))
    return dict(R=R, layout=layout, shape=(G, R * per, draw(st.integers(1, max_dim))),
                kv_groups=Gk, steps=steps, causal=draw(st.booleans()),
                window=draw(st.one_of(st.none(), st.tuples(side, side))),
                dtype=draw(st.sampled_from(["float32", "float16"])),
                seed=draw(st.integers(0, 2**31 - 1)))


def _mask(case):
    return dict(causal=case["causal"], scale=None, window=case["window"])


def check_forward(case, **options):
    """The forward of ``case`` (``options``: more context-parallel options, e.g. ``split``)
    against the whole sequence under the tolerance rule."""
    G, L, D = case["shape"]
    dtype, mask = case["dtype"], _mask(case)
    q, k, v = random_qkv(np.random.default_rng(case["seed"]), G, L, L, D, dtype,
                         case["kv_groups"])
    out, lse, session = run_cp(q, k, v, case["R"], case["layout"],
                               kv_gather_steps=case["steps"], **mask, **options)
    ref_out, ref_lse = pf.reference.attention(q, k, v, **mask)
    naive_out, _ = naive_attention(q, k, v, **mask)
    assert out.dtype == np.dtype(dtype) and out.shape == q.shape and lse.shape == (G, L)
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (out[empty] == 0).all() and np.isfinite(out).all()
    steps = case["steps"] * (L + 1) + L + D  # chunk steps, merges, block sums
    assert_within_rule("out", out, naive_out, ref_out, factor=2, dtype=dtype,
                       accum_steps=steps, magnitude=float(np.abs(v).max()))
    _, naive32_lse = naive_attention(*(a.astype(np.float32) for a in (q, k, v)), **mask)
    assert_within_rule("lse", lse, naive32_lse, ref_lse, factor=2, dtype="float32",
                       accum_steps=steps, magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))
    return out, lse, session


@given(cp_cases())
def test_forward_matches_whole_sequence(case):
    check_forward(case)


@given(cp_cases(max_dim=6))
def test_backward_matches_whole_sequence(case):
    check_backward(case)


def check_backward(case, **options):
    """The gradients of ``case`` (``options`` as :func:`check_forward`) under the rule."""
    G, L, D = case["shape"]
    dtype, mask = case["dtype"], _mask(case)
    rng = np.random.default_rng(case["seed"])
    q, k, v = random_qkv(rng, G, L, L, D, dtype, case["kv_groups"])
    dout = rng.standard_normal(q.shape).astype(dtype)
    grads, _ = run_cp_grad(dout, q, k, v, case["R"], case["layout"],
                           stash=bool(case["seed"] % 2), kv_gather_steps=case["steps"], **mask,
                           **options)
    for g, like in zip(grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
    assert_grads_within_rule(grads, dout, q, k, v, dtype=dtype,
                             steps=case["steps"] * (L + 1) + G * L + D, **mask)


@pytest.mark.parametrize("causal,window", [(True, None), (False, (3, 5))])
def test_one_replica_equals_flash_attention(causal, window):
    q, k, v = random_qkv(np.random.default_rng(3), 2, 24, 24, 8, np.float32, kv_groups=1)
    out, lse, _ = run_cp(q, k, v, 1, kv_gather_steps=1, causal=causal, window=window)
    f_out, f_lse, _ = run_flash(q, k, v, causal=causal, window=window)
    np.testing.assert_allclose(out, f_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(lse, f_lse, atol=1e-6, rtol=0)


@pytest.mark.parametrize("R,layout,steps", [(2, "zigzag", 1), (4, "zigzag", 2),
                                            (4, "contiguous", 4)])
def test_float32_within_1e6_of_flash(R, layout, steps):
    """float32: the unsharded result equals single-replica flash on the whole sequence."""
    q, k, v = random_qkv(np.random.default_rng(R), 4, 64, 64, 16, np.float32, kv_groups=2)
    out, lse, _ = run_cp(q, k, v, R, layout, kv_gather_steps=steps)
    f_out, f_lse, _ = run_flash(q, k, v, causal=True)
    np.testing.assert_allclose(out, f_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(lse, f_lse, atol=2e-6, rtol=0)


def test_autodiff_of_a_layer_graph():
    """pf.autodiff uses the context-parallel backward for the call inside a layer graph."""
    R, layout = 4, "zigzag"
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 2, 32, 32, 4, np.float32, kv_groups=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)

    def build(do, q, k, v):
        def layer(q, k, v):
            return cp.context_parallel_attention(q, k, v, layout=layout,
                                                 kv_gather_steps=2) * 3.0
        graph = popxl.gir().create_graph(layer, q, k, v)
        info = pf.autodiff(graph)
        call = ops.call_with_info(graph, q, k, v)
        return ops.call(info.graph, do, inputs_dict=info.inputs_dict(call))
    grads, _ = _run(build, dict(dout=dout, q=q, k=k, v=v), R, layout)
    refs = pf.reference.attention_grad(3 * dout, q, k, v, causal=True)
    for g, ref in zip(grads, refs):
        np.testing.assert_allclose(g, ref, atol=5e-6, rtol=0)


# -- work and memory per replica ---------------------------------------------------------------
def _replica_flops(profile):
    return [p.matmul_flops for p in profile.replicas]


def test_zigzag_balances_causal_flops():
    q, k, v = random_qkv(np.random.default_rng(0), 2, 128, 128, 8, np.float32)
    _, _, zig = run_cp(q, k, v, 4, "zigzag", kv_gather_steps=1)
    _, _, contiguous = run_cp(q, k, v, 4, "contiguous", kv_gather_steps=1)
    flops = _replica_flops(zig.profile)
    assert max(flops) <= 1.05 * min(flops), flops
    # the contiguous layout gives the last replica R times the first one's causal work
    flops = _replica_flops(contiguous.profile)
    assert max(flops) >= 3 * min(flops), flops


@pytest.mark.parametrize("G,L,D,dtype", [(4, 512, 32, np.float32), (4, 1024, 64, np.float16)])
def test_peak_bytes_fall_with_replicas(G, L, D, dtype):
    """R = 4 with kv_gather_steps=4 peaks below half of one replica holding everything (the
    context-parallel call at R = 1, and flash_attention)."""
    q, k, v = random_qkv(np.random.default_rng(0), G, L, L, D, dtype)
    peaks = {}
    for R, steps in ((1, 1), (2, 1), (4, 4)):
        _, _, session = run_cp(q, k, v, R, "zigzag", kv_gather_steps=steps)
        prof = session.profile
        peaks[R] = max(p.peak_live_bytes for p in prof.replicas) if prof.replicas else \
            prof.peak_live_bytes
    assert peaks[4] < peaks[2] < peaks[1]
    assert peaks[4] < peaks[1] / 2, peaks
    _, _, flash = run_flash(q, k, v, causal=True)
    assert peaks[4] < flash.profile.peak_live_bytes / 2, (peaks, flash.profile.peak_live_bytes)


def test_gather_steps_cut_gathered_bytes_not_totals():
    """S rounds gather the same bytes in total (each round 1/S); the peak falls."""
    q, k, v = random_qkv(np.random.default_rng(1), 2, 256, 256, 16, np.float32)
    sessions = {s: run_cp(q, k, v, 4, "zigzag", kv_gather_steps=s)[2] for s in (1, 4)}
    moved = {s: [p.collective_bytes for p in sess.profile.replicas]
             for s, sess in sessions.items()}
    assert moved[1] == moved[4]
    peak = {s: sess.profile.peak_live_bytes for s, sess in sessions.items()}
    assert peak[4] < peak[1]


def test_float16_in_rule_with_rounds():
    case = dict(R=4, layout="zigzag", shape=(2, 64, 16), kv_groups=1, steps=4, causal=True,
                window=None, dtype="float16", seed=11)
    check_forward(case)


# -- host helpers ------------------------------------------------------------------------------
@given(st.sampled_from([1, 2, 3, 4]), st.sampled_from(cp.LAYOUTS), st.integers(1, 3),
       st.integers(0, 2))
def test_shard_unshard_round_trip(R, layout, per, axis):
    L = R * per * (2 if layout == "zigzag" else 1)
    shape = [2, 3, 2]
    shape[axis] = L
    x = np.arange(np.prod(shape)).reshape(shape)
    shards = cp.shard(x, R, layout, axis=axis)
    assert shards.shape[0] == R and shards.shape[1 + axis] == L // R
    np.testing.assert_array_equal(cp.unshard(shards, layout, axis=axis), x)


def test_zigzag_positions():
    np.testing.assert_array_equal(cp.positions(8, 2, "zigzag"),
                                  [[0, 1, 6, 7], [2, 3, 4, 5]])
    np.testing.assert_array_equal(cp.positions(8, 2, "contiguous"),
                                  [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_choose_gather_steps_from_budget():
    # 2 (K and V) x Gk 8 x R 4 x 1024 rows x D 128 x 2 bytes = 16 MiB gathered in one round
    assert cp.choose_gather_steps(1024, 4, 8, 128, 2, budget=16 * 2**20) == 1
    assert cp.choose_gather_steps(1024, 4, 8, 128, 2, budget=4 * 2**20) == 4
    assert cp.choose_gather_steps(1000, 4, 8, 128, 2, budget=3 * 2**20) == 8


# -- argument checks ---------------------------------------------------------------------------
def _build_cp(q_shape=(2, 8, 4), k_shape=(2, 8, 4), replicas=2, **options):
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph:
        q = popxl.variable(np.zeros(q_shape, np.float32))
        k = popxl.variable(np.zeros(k_shape, np.float32))
        return cp.context_parallel_attention(q, k, k, **options)


@pytest.mark.parametrize("kwargs,exc,fragment", [
    (dict(layout="ring"), ValueError, "layout must be one of"),
    (dict(kv_gather_steps=3), ValueError, "kv_gather_steps must divide"),
    (dict(kv_gather_steps=0), ValueError, "kv_gather_steps must be"),
    (dict(k_shape=(2, 6, 4)), ValueError, "same rows per replica"),
    (dict(q_shape=(2, 7, 4), k_shape=(2, 7, 4)), ValueError, "even number of rows"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(group="all"), TypeError, "group must be None or a popxl.ReplicaGrouping"),
    (dict(q_shape=(2, 8)), ValueError, "rank 3"),
    (dict(num_chunks_q=100), ValueError, "num_chunks_q must be in"),
    (dict(window=(-3, 0)), ValueError, "window"),
    (dict(scale="big"), TypeError, "scale"),
    (dict(k_shape=(3, 8, 4)), ValueError, "divides q's G=2"),
])
def test_bad_arguments(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        _build_cp(**kwargs)
    ir = popxl.Ir()  # validated before any name scope opened: nothing left pushed
    with ir.main_graph:
        assert popxl.constant(np.zeros(1, np.float32), name="t").id == "t"


def test_shard_refuses_indivisible_length():
    with pytest.raises(ValueError, match="divisible by 4"):
        cp.shard(np.zeros((1, 6, 2)), 2, "zigzag")


@pytest.mark.parametrize("R,layout,steps,causal,window", [
    (4, "zigzag", 1, True, None), (4, "contiguous", 2, True, None),
    (2, "zigzag", 4, False, (9, 2)), (4, "zigzag", 2, True, (20, -1))])
def test_explain_is_exact_per_replica(R, layout, steps, causal, window):
    """pf.context_parallel.explain: the executed FLOPs and the gathered bytes of every replica
    are the emulator's counts; the loop trip counts are equal on all replicas."""
    G, Gk, L, D = 2, 1, 128, 8
    q, k, v = random_qkv(np.random.default_rng(2), G, L, L, D, np.float32, kv_groups=Gk)
    _, _, session = run_cp(q, k, v, R, layout, kv_gather_steps=steps, causal=causal,
                           window=window)
    cost = cp.explain(L, R, head_dim=D, groups=G, kv_groups=Gk, dtype="float32",
                      causal=causal, window=window, layout=layout, kv_gather_steps=steps)
    reps = session.profile.replicas
    assert [p.matmul_flops for p in reps] == list(cost.flops)
    assert [p.collective_bytes for p in reps] == [cost.gathered_bytes] * R
    assert len({p.loop_iterations for p in reps}) == 1
    assert "replica" in cost.table()


@pytest.mark.parametrize("R,layout,steps", [(2, "contiguous", 1), (4, "zigzag", 2)])
def test_against_pytorch(R, layout, steps):
    """Forward and backward (through pf.autodiff of a layer) against PyTorch's SDPA on the
    whole sequence (float64 torch as the reference, float32 here)."""
    torch = pytest.importorskip("torch")
    G, Gk, L, D = 4, 2, 64, 8
    rng = np.random.default_rng(R)
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=Gk)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    tq, tk, tv = (torch.tensor(a.astype(np.float64), requires_grad=True) for a in (q, k, v))
    rep = G // Gk
    t_out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk.repeat_interleave(rep, 0), tv.repeat_interleave(rep, 0), is_causal=True)
    t_out.backward(torch.tensor(dout.astype(np.float64)))

    def build(do, q, k, v):
        def layer(q, k, v):
            return cp.context_parallel_attention(q, k, v, layout=layout, kv_gather_steps=steps)
        graph = popxl.gir().create_graph(layer, q, k, v)
        info = pf.autodiff(graph)
        call = ops.call_with_info(graph, q, k, v)
        out = call.outputs[0]  # autodiff adds the activations it stashes as outputs
        return (out + 0.0, *ops.call(info.graph, do, inputs_dict=info.inputs_dict(call)))
    (out, dq, dk, dv), _ = _run(build, dict(dout=dout, q=q, k=k, v=v), R, layout)
    np.testing.assert_allclose(out, t_out.detach().numpy(), atol=2e-6, rtol=0)
    for got, want in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fn", [cp.context_parallel_attention, cp.context_parallel_attention_grad,
                                cp.shard, cp.unshard, cp.positions, cp.explain,
                                cp.choose_gather_steps])
def test_docstrings_name_every_parameter(fn):
    import inspect
    import re
    doc = inspect.getdoc(fn)
    missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"\b{p}\b", doc)]
    assert not missing, f"{fn.__name__} docstring does not mention {missing}"


def test_replica_groups_hold_separate_sequences():
    """group=ir.replica_grouping(group_size=2) over 4 replicas: replicas {0, 1} hold one
    sequence, {2, 3} another (e.g. data parallelism over context-parallel pairs)."""
    R, size, layout = 4, 2, "zigzag"
    rng = np.random.default_rng(9)
    seqs = [random_qkv(rng, 2, 32, 32, 8, np.float32, kv_groups=1) for _ in range(R // size)]
    ir = popxl.Ir(replication=R)
    group = ir.replica_grouping(group_size=size)
    with ir.main_graph:
        streams = [popxl.h2d_stream((t.shape[0], 32 // size, 8), popxl.float32, name=n)
                   for n, t in zip("qkv", seqs[0])]
        out, lse = cp.context_parallel_attention(*(ops.host_load(s) for s in streams),
                                                 layout=layout, group=group, return_lse=True)
        d = popxl.d2h_stream(out.shape, out.dtype)
        ops.host_store(d, out)
    # replica r is rank r % 2 of group r // 2 (stride 1): stack the groups' shards
    feeds = {s: np.concatenate([cp.shard(seq[i], size, layout) for seq in seqs])
             for i, s in enumerate(streams)}
    with popxl.Session(ir, DEVICE) as session:
        res = session.run(feeds)[d]
    for g, (q, k, v) in enumerate(seqs):
        got = cp.unshard(res[g * size:(g + 1) * size], layout)
        ref, _ = pf.reference.attention(q, k, v, causal=True)
        np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)


# -- score modifiers ---------------------------------------------------------------------------
def _table_mod(score, g, q_idx, kv_idx, table, offset):
    """A learned relative-position bias ``table[q_idx - kv_idx + L - 1]`` (global positions)."""
    return score + ops.gather(table, q_idx - kv_idx + offset)


def _temperature_mod(score, g, q_idx, kv_idx, temps):
    """Per-head temperature: ``score * temps[g]``."""
    return score * ops.gather(temps, g)


def _modifier_case(name, rng, G, L):
    """``(shared host arrays, make(*tensors) -> modifier keywords)`` of one modifier set."""
    slopes = (2.0 ** (-8.0 * np.arange(1, G + 1) / G)).astype(np.float32)
    if name == "softcap":
        return {}, lambda: dict(softcap=1.5)
    if name == "alibi":
        return dict(slopes=slopes), lambda s: dict(alibi_slopes=s)
    if name == "softcap+alibi":
        return dict(slopes=slopes), lambda s: dict(softcap=2.0, alibi_slopes=s)
    if name == "table":
        table = rng.standard_normal(2 * L - 1).astype(np.float32)
        offset = np.array(L - 1, np.int32)
        return dict(table=table, offset=offset), lambda t, o: dict(
            score_mod=_table_mod, score_mod_inputs=(t, o))
    temps = rng.uniform(0.5, 2.0, G).astype(np.float32)
    return dict(temps=temps), lambda t: dict(score_mod=_temperature_mod, score_mod_inputs=(t,))


def run_cp_modified(q, k, v, dout, replicas, layout, shared, make, *, stash=True, **options):
    """out, lse, (dq, dk, dv) of context parallelism with score modifiers (unsharded)."""
    n = len(shared)

    def build(do, q, k, v, *xs):
        mods = make(*xs[:n])
        out, lse = cp.context_parallel_attention(q, k, v, layout=layout, return_lse=True,
                                                 **options, **mods)
        grads = cp.context_parallel_attention_grad(
            do, q, k, v, *((out, lse) if stash else (None, None)), layout=layout, **options,
            **mods)
        return (out, lse, *grads)
    res, session = _run(build, dict(dout=dout, q=q, k=k, v=v), replicas, layout, shared)
    return res[0], res[1], tuple(res[2:]), session


def run_flash_modified(q, k, v, dout, shared, make, **options):
    """The same on one replica with pf.flash_attention on the whole sequence."""
    from score_mod_utils import run_modified
    out, lse, grads, _ = run_modified(q, k, v, dout, list(shared.values()), make, options)
    return out, lse, grads


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("steps", [1, 2])
def test_softcap_and_alibi_equal_flash(R, layout, steps):
    """softcap and ALiBi (a runtime [G] slope tensor) on global positions: out, lse and
    gradients equal single-replica flash attention on the whole sequence (float32)."""
    rng = np.random.default_rng(R * 10 + steps)
    G, L, D = 4, 32, 8
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=2)
    q *= 2  # scores past the cap
    dout = rng.standard_normal(q.shape).astype(np.float32)
    shared, make = _modifier_case("softcap+alibi", rng, G, L)
    out, lse, grads, _ = run_cp_modified(q, k, v, dout, R, layout, shared, make,
                                         kv_gather_steps=steps, stash=bool(steps % 2))
    f_out, f_lse, f_grads = run_flash_modified(q, k, v, dout, shared, make, causal=True)
    np.testing.assert_allclose(out, f_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(lse, f_lse, atol=2e-6, rtol=0)
    for name, g, f in zip(("dq", "dk", "dv"), grads, f_grads):
        np.testing.assert_allclose(g, f, atol=2e-6 * max(1.0, np.abs(f).max()), rtol=0,
                                   err_msg=name)


@pytest.mark.parametrize("name,causal,window", [
    ("softcap", False, None), ("alibi", False, (5, 3)), ("table", True, None),
    ("temperature", False, (-1, 4)), ("table", False, (6, -1))])
def test_modifiers_with_masks_equal_flash(name, causal, window):
    """Each modifier (score_mod with a relative-bias table on global positions, per-head
    temperature) with causal and window masks: equal to single-replica flash (float32)."""
    R, layout, steps = 4, "zigzag", 2
    rng = np.random.default_rng(len(name))
    G, L, D = 2, 32, 8
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    shared, make = _modifier_case(name, rng, G, L)
    mask = dict(causal=causal, window=window)
    out, lse, grads, _ = run_cp_modified(q, k, v, dout, R, layout, shared, make,
                                         kv_gather_steps=steps, **mask)
    f_out, f_lse, f_grads = run_flash_modified(q, k, v, dout, shared, make, **mask)
    np.testing.assert_allclose(out, f_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(lse, f_lse, atol=2e-6, rtol=0)
    for n, g, f in zip(("dq", "dk", "dv"), grads, f_grads):
        np.testing.assert_allclose(g, f, atol=2e-6 * max(1.0, np.abs(f).max()), rtol=0,
                                   err_msg=n)


def _reference_modifiers(name, shared, L):
    """pf.reference keywords of a modifier case (float64 score_mod and its derivative)."""
    if name == "softcap+alibi":
        return dict(softcap=2.0, alibi_slopes=shared["slopes"])
    table = shared["table"].astype(np.float64)
    return dict(score_mod=lambda s, g, qi, kj: s + table[qi - kj + L - 1],
                score_mod_grad=lambda s, g, qi, kj: np.ones_like(s))


@pytest.mark.parametrize("name,R,layout,steps", [
    ("softcap+alibi", 2, "contiguous", 2), ("softcap+alibi", 4, "zigzag", 1),
    ("table", 4, "zigzag", 2)])
def test_modifiers_float16_in_rule(name, R, layout, steps):
    """float16 with modifiers: out and lse within 2x, gradients within 3x of the naive
    same-precision error against the float64 reference (popxl_flash/checks/tolerance.py)."""
    dtype = "float16"
    rng = np.random.default_rng(7)
    G, L, D = 4, 32, 8
    q, k, v = random_qkv(rng, G, L, L, D, dtype, kv_groups=2)
    dout = rng.standard_normal(q.shape).astype(dtype)
    shared, make = _modifier_case(name, rng, G, L)
    out, lse, grads, _ = run_cp_modified(q, k, v, dout, R, layout, shared, make,
                                         kv_gather_steps=steps)
    ref_kwargs = dict(causal=True, scale=None, window=None,
                      **_reference_modifiers(name, shared, L))
    check_rule(out, lse, grads, q, k, v, dout, ref_kwargs, dtype, steps)


def check_rule(out, lse, grads, q, k, v, dout, ref_kwargs, dtype, steps):
    """out and lse within 2x, gradients within 3x of the naive same-precision error against
    the float64 reference with ``ref_kwargs`` (mask, modifiers, dropout keep mask)."""
    G, L, D = q.shape
    fwd_kwargs = {n: a for n, a in ref_kwargs.items() if n != "score_mod_grad"}
    ref_out, ref_lse = pf.reference.attention(q, k, v, **fwd_kwargs)
    naive_out, _ = naive_attention(q, k, v, **fwd_kwargs)
    boost = 1.0 / (1.0 - ref_kwargs.get("dropout", 0.0))  # kept probabilities scaled up
    f_steps = steps * (L + 1) + L + D
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (out[empty] == 0).all() and np.isfinite(out).all()
    assert_within_rule("out", out, naive_out, ref_out, factor=2, dtype=dtype,
                       accum_steps=f_steps, magnitude=float(np.abs(v).max()) * boost)
    _, naive32_lse = naive_attention(*(a.astype(np.float32) for a in (q, k, v)), **fwd_kwargs)
    assert_within_rule("lse", lse, naive32_lse, ref_lse, factor=2, dtype="float32",
                       accum_steps=f_steps,
                       magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))
    for g in grads:
        assert g.dtype == np.dtype(dtype) and np.isfinite(g).all()
    assert_grads_within_rule(grads, dout, q, k, v, dtype=dtype,
                             steps=steps * (L + 1) + G * L + D, **ref_kwargs)


def test_modifiers_through_autodiff_of_a_layer_graph():
    """pf.autodiff of a layer graph whose context-parallel call has ALiBi slopes and a
    score_mod table as layer inputs: q, k, v gradients equal single-replica flash's."""
    R, layout = 4, "zigzag"
    rng = np.random.default_rng(11)
    G, L, D = 2, 32, 4
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    shared, _ = _modifier_case("table", rng, G, L)
    shared["slopes"] = (2.0 ** (-np.arange(1, G + 1))).astype(np.float32)

    def mods(t, o, s):
        return dict(softcap=3.0, alibi_slopes=s, score_mod=_table_mod, score_mod_inputs=(t, o))

    def build(do, q, k, v, t, o, s):
        def layer(q, k, v, t, o, s):
            return cp.context_parallel_attention(q, k, v, layout=layout, kv_gather_steps=2,
                                                 **mods(t, o, s)) * 2.0
        graph = popxl.gir().create_graph(layer, q, k, v, t, o, s)
        info = pf.autodiff(graph)
        call = ops.call_with_info(graph, q, k, v, t, o, s)
        return ops.call(info.graph, do, inputs_dict=info.inputs_dict(call))
    grads, _ = _run(build, dict(dout=dout, q=q, k=k, v=v), R, layout, shared)
    _, _, f_grads = run_flash_modified(q, k, v, 2 * dout, shared, mods, causal=True)
    for n, g, f in zip(("dq", "dk", "dv"), grads, f_grads):
        np.testing.assert_allclose(g, f, atol=2e-6 * max(1.0, np.abs(f).max()), rtol=0,
                                   err_msg=n)


@pytest.mark.parametrize("fn", ["forward", "grad"])
@pytest.mark.parametrize("name,value,fragment", [
    ("q_segment_ids", None, "segment ids.*not supported with context parallelism"),
    ("kv_segment_ids", None, "segment ids.*not supported with context parallelism"),
    ("dropout_p", 0.1, "calls it dropout="),
    ("return_attn_probs", True, "return_dropout_mask=True"),
    ("softmax_scale", 0.5, "calls it scale="),
])
def test_unsupported_flash_keywords_are_named(fn, name, value, fragment):
    """A flash_attention keyword context parallelism does not take: TypeError naming it and
    why (not Python's bare unexpected-keyword error); nothing is built."""
    if fn == "forward" or name != "softmax_scale":
        ir = popxl.Ir(replication=2)
        with ir.main_graph:
            q = popxl.variable(np.zeros((2, 8, 4), np.float32))
            call = (cp.context_parallel_attention if fn == "forward" else
                    lambda *ts, **kw: cp.context_parallel_attention_grad(q, *ts, **kw))
            with pytest.raises(TypeError, match=f"'{name}'.*{fragment}"):
                call(q, q, q, **{name: value})
            assert not ir.main_graph._pb_graph.getOps()


def test_bad_modifier_arguments():
    """Modifier errors name the argument, at build time, and leave no name scope pushed."""
    def bad_mod(score, g, q_idx, kv_idx):
        return score[0]
    cases = [(dict(softcap=-1.0), ValueError, "softcap must be in"),
             (dict(alibi_slopes="s"), TypeError, "alibi_slopes must be a popxl.Tensor"),
             (dict(alibi_slopes=(3,)), ValueError, r"alibi_slopes must be float32 \[G=2\]"),
             (dict(score_mod=bad_mod), ValueError, "score_mod must be elementwise"),
             (dict(score_mod_inputs=((1,),)), ValueError, "without a score_mod"),
             (dict(dropout=0.2), ValueError, "dropout=0.2 needs seed="),
             (dict(dropout=1.0), ValueError, "dropout must be in"),
             (dict(return_dropout_mask=True), ValueError, "needs dropout > 0")]
    for kwargs, exc, fragment in cases:
        ir = popxl.Ir(replication=2)
        with ir.main_graph:
            q = popxl.variable(np.zeros((2, 8, 4), np.float32))
            kwargs = {n: tuple(popxl.variable(np.zeros(x, np.float32)) for x in a)
                      if n == "score_mod_inputs" else
                      (popxl.variable(np.zeros(a, np.float32)) if isinstance(a, tuple) else a)
                      for n, a in kwargs.items()}
            with pytest.raises(exc, match=fragment):
                cp.context_parallel_attention(q, q, q, **kwargs)
            if "return_dropout_mask" not in kwargs:
                with pytest.raises(exc, match=fragment):
                    cp.context_parallel_attention_grad(q, q, q, q, **kwargs)
            assert popxl.constant(np.zeros(1, np.float32), name="probe").id == "probe"


# -- dropout -----------------------------------------------------------------------------------
SEED = np.array([1234, 5678], np.uint32)


def run_cp_dropout(q, k, v, dout, replicas, layout, p, *, seed=SEED, stash=True, **options):
    """out, lse, (dq, dk, dv) and the keep mask (unsharded, bool [G, L, L]) with dropout."""
    def build(do, q, k, v, s):
        out, lse, keep = cp.context_parallel_attention(
            q, k, v, layout=layout, return_lse=True, dropout=p, seed=s,
            return_dropout_mask=True, **options)
        grads = cp.context_parallel_attention_grad(
            do, q, k, v, *((out, lse) if stash else (None, None)), layout=layout, dropout=p,
            seed=s, **options)
        return (out, lse, *grads, keep)
    res, _ = _run(build, dict(dout=dout, q=q, k=k, v=v), replicas, layout, dict(seed=seed))
    return res[0], res[1], tuple(res[2:5]), res[5]


@pytest.mark.parametrize("R,layout,steps,dtype", [
    (2, "zigzag", 1, "float32"), (2, "contiguous", 2, "float32"),
    (4, "zigzag", 2, "float32"), (4, "contiguous", 1, "float32"),
    (4, "zigzag", 2, "float16"), (2, "contiguous", 1, "float16")])
def test_dropout_matches_reference_with_the_mask(R, layout, steps, dtype):
    """Out, lse and gradients equal the float64 reference computed with the returned keep
    mask (2x/3x rule): the forward drew that mask and the backward regenerated it."""
    rng = np.random.default_rng(R + steps)
    G, L, D = 4, 32, 8
    q, k, v = random_qkv(rng, G, L, L, D, dtype, kv_groups=2)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse, grads, keep = run_cp_dropout(q, k, v, dout, R, layout, 0.3, kv_gather_steps=steps,
                                           stash=bool(steps % 2))
    assert keep.dtype == np.bool_ and keep.shape == (G, L, L)
    check_rule(out, lse, grads, q, k, v, dout,
               dict(causal=True, scale=None, window=None, keep=keep, dropout=0.3), dtype,
               steps)


def test_dropout_with_modifiers_and_window():
    rng = np.random.default_rng(4)
    G, L, D = 2, 32, 8
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    slopes = np.array([0.5, 0.125], np.float32)
    mask = dict(causal=False, window=(6, 2))

    def build(do, q, k, v, s, sl):
        mods = dict(dropout=0.2, seed=s, softcap=2.0, alibi_slopes=sl, **mask)
        out, lse, keep = cp.context_parallel_attention(q, k, v, return_lse=True,
                                                       return_dropout_mask=True,
                                                       kv_gather_steps=2, **mods)
        return (out, lse, *cp.context_parallel_attention_grad(do, q, k, v, out, lse,
                                                              kv_gather_steps=2, **mods), keep)
    res, _ = _run(build, dict(dout=dout, q=q, k=k, v=v), 4, "zigzag",
                  dict(seed=SEED, slopes=slopes))
    check_rule(res[0], res[1], res[2:5], q, k, v, dout,
               dict(scale=None, keep=res[5], dropout=0.2, softcap=2.0, alibi_slopes=slopes,
                    **mask), "float32", 2)


def test_dropout_keep_fraction_and_distinct_blocks():
    """The keep fraction is within binomial bounds; the blocks of replica 0 and replica 1
    differ."""
    R, layout, p = 2, "contiguous", 0.5
    rng = np.random.default_rng(6)
    G, L, D = 2, 64, 4
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=2)
    dout = np.zeros_like(q)
    *_, keep = run_cp_dropout(q, k, v, dout, R, layout, p, kv_gather_steps=2, causal=False)
    assert abs(keep.mean() - (1 - p)) < 6 * np.sqrt(p * (1 - p) / keep.size)
    half = L // 2
    assert not np.array_equal(keep[:, :half, :half], keep[:, half:, half:])
    assert not np.array_equal(keep[:, :half, :half // 2], keep[:, :half, half // 2:half])


def test_dropout_deterministic_stash_equals_recompute_and_seed_changes_mask():
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 2, 32, 32, 8, np.float32, kv_groups=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    first = run_cp_dropout(q, k, v, dout, 4, "zigzag", 0.4, kv_gather_steps=2)
    again = run_cp_dropout(q, k, v, dout, 4, "zigzag", 0.4, kv_gather_steps=2, stash=False)
    for a, b in zip((first[0], first[1], *first[2], first[3]),
                    (again[0], again[1], *again[2], again[3])):
        np.testing.assert_array_equal(a, b)
    other = run_cp_dropout(q, k, v, dout, 4, "zigzag", 0.4, kv_gather_steps=2,
                           seed=np.array([1234, 5679], np.uint32))
    assert (other[3] != first[3]).mean() > 0.2
    assert not np.array_equal(other[0], first[0])


def test_dropout_one_replica_one_round_equals_flash_attention():
    """R = 1, one round, no mask: the round seed is the user's seed and the blocks are
    flash_attention's at equal chunk counts, so the keep mask and the output are flash's.
    (With causal or window masks flash's static schedule splits partly visible blocks into
    sub-blocks that draw their own masks; context parallelism's runtime positions do not.)"""
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 2, 32, 32, 8, np.float32, kv_groups=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    chunks = dict(num_chunks_q=2, num_chunks_kv=4)
    out, _, grads, keep = run_cp_dropout(q, k, v, dout, 1, "zigzag", 0.3, kv_gather_steps=1,
                                         causal=False, **chunks)
    from score_mod_utils import run_modified
    f_out, _, f_grads, f_keep = run_modified(q, k, v, dout, [SEED],
                                             lambda s: dict(dropout=0.3, seed=s),
                                             dict(causal=False, **chunks), mask=True)
    np.testing.assert_array_equal(keep, f_keep)
    np.testing.assert_allclose(out, f_out, atol=1e-6, rtol=0)
    for g, f in zip(grads, f_grads):
        np.testing.assert_allclose(g, f, atol=2e-6 * max(1.0, np.abs(f).max()), rtol=0)


def test_dropout_stash_from_other_rounds_accepted_other_options_refused():
    """Dropout's mask does not depend on the rounds (tests/test_seeds.py checks the
    gradients); other options are still refused."""
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        q = popxl.variable(np.zeros((2, 8, 4), np.float32))
        seed = popxl.variable(SEED)
        out, lse = cp.context_parallel_attention(q, q, q, return_lse=True, dropout=0.1,
                                                 seed=seed, kv_gather_steps=1)
        cp.context_parallel_attention_grad(q, q, q, q, out, lse, dropout=0.1, seed=seed,
                                           kv_gather_steps=2)
        with pytest.raises(ValueError, match="other options"):
            cp.context_parallel_attention_grad(q, q, q, q, out, lse, kv_gather_steps=1)
        cp.context_parallel_attention_grad(q, q, q, q, out, lse, dropout=0.1, seed=seed,
                                           kv_gather_steps=1)


def test_dropout_through_autodiff_of_a_layer_graph():
    """pf.autodiff of a layer with dropout (the seed a layer input): gradients equal the
    reference with the keep mask the same seed gives."""
    R, layout, p = 4, "zigzag", 0.25
    rng = np.random.default_rng(12)
    G, L, D = 2, 32, 4
    q, k, v = random_qkv(rng, G, L, L, D, np.float32, kv_groups=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)

    def build(do, q, k, v, s):
        def layer(q, k, v, s):
            return cp.context_parallel_attention(q, k, v, layout=layout, kv_gather_steps=2,
                                                 dropout=p, seed=s)
        graph = popxl.gir().create_graph(layer, q, k, v, s)
        info = pf.autodiff(graph)
        call = ops.call_with_info(graph, q, k, v, s)
        _, keep = cp.context_parallel_attention(q, k, v, layout=layout, kv_gather_steps=2,
                                                dropout=p, seed=s, return_dropout_mask=True)
        return (*ops.call(info.graph, do, inputs_dict=info.inputs_dict(call)), keep)
    res, _ = _run(build, dict(dout=dout, q=q, k=k, v=v), R, layout, dict(seed=SEED))
    refs = pf.reference.attention_grad(dout, q, k, v, causal=True, keep=res[3], dropout=p)
    for n, g, ref in zip(("dq", "dk", "dv"), res[:3], refs):
        np.testing.assert_allclose(g, ref, atol=2e-6 * max(1.0, np.abs(ref).max()), rtol=0,
                                   err_msg=n)


@settings(max_examples=40)
@given(cp_cases(max_dim=6), st.sampled_from([0.0, 0.7, 4.0]), st.booleans(),
       st.sampled_from([0.0, 0.3]))
def test_modifiers_over_cases(case, softcap, alibi, p):
    """softcap, ALiBi and dropout over replicas, layouts, rounds, GQA, masks and dtypes: the
    2x/3x rule against the float64 reference (with the returned keep mask)."""
    G, L, D = case["shape"]
    dtype, R, layout = case["dtype"], case["R"], case["layout"]
    rng = np.random.default_rng(case["seed"])
    q, k, v = random_qkv(rng, G, L, L, D, dtype, case["kv_groups"])
    dout = rng.standard_normal(q.shape).astype(dtype)
    slopes = rng.uniform(0.05, 1.0, G).astype(np.float32)
    shared = dict(seed=SEED, slopes=slopes)
    options = dict(_mask(case), kv_gather_steps=case["steps"])

    def build(do, q, k, v, s, sl):
        mods = dict(softcap=softcap, alibi_slopes=sl if alibi else None, dropout=p,
                    seed=s if p else None, **options)
        res = cp.context_parallel_attention(q, k, v, layout=layout, return_lse=True,
                                            return_dropout_mask=p > 0, **mods)
        grads = cp.context_parallel_attention_grad(do, q, k, v, res[0], res[1], layout=layout,
                                                   **mods)
        return (*res, *grads)
    res, _ = _run(build, dict(dout=dout, q=q, k=k, v=v), R, layout, shared)
    out, lse = res[0], res[1]
    keep = res[2] if p else None
    ref = dict(_mask(case), softcap=softcap, alibi_slopes=slopes if alibi else None)
    if p:
        ref.update(keep=keep, dropout=p)
    check_rule(out, lse, res[-3:], q, k, v, dout, ref, dtype, case["steps"])
