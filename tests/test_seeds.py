"""Dropout's keep mask is a function of (seed, g, row, column) alone.

Checked on the emulator: the uint32 arithmetic the hash is built from wraps as the IPU's C
unsigned codelets do; the returned mask is :func:`popxl_flash.plan.score_mods.keep_mask` (the
numpy hash) in every structure and chunking; distinct blocks and nearby seeds give unrelated
masks; one seed tensor given to two calls gives the same masks, ``split_random_seed``
separates them; context parallelism returns single-replica flash's mask for every replica
count, layout and ``kv_gather_steps``, and its backward with other ``kv_gather_steps`` than
the forward differentiates that mask.
"""
import itertools

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import DEVICE, random_qkv, run_graph
from popxl_flash import popxl
from popxl_flash.api import context_parallel as cp
from popxl_flash.plan.score_mods import keep_mask
from test_context_parallel import _run as run_replicated, check_rule as cp_check_rule

ops = popxl.ops

G, L, D, P = 2, 32, 4, 0.5
CHUNKS = dict(num_chunks_q=4, num_chunks_kv=4)


def test_uint32_arithmetic_wraps_as_c_unsigned():
    """``*``, ``+``, ``/`` and ``greater`` on uint32 compute C's unsigned results (modulo
    2**32, truncating division): Python integers give the expected values."""
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    b[b == 0] = 1

    def build(x, y):
        return [x * y, x + y, x / popxl.constant(np.uint32(1 << 16)), x / y,
                ops.greater(x, y)]
    (mul, add, shift, div, gt), _ = run_graph(build, [a, b])
    ai, bi = a.astype(object), b.astype(object)
    np.testing.assert_array_equal(mul, ((ai * bi) % 2 ** 32).astype(np.uint32))
    np.testing.assert_array_equal(add, ((ai + bi) % 2 ** 32).astype(np.uint32))
    np.testing.assert_array_equal(shift, (ai // 2 ** 16).astype(np.uint32))
    np.testing.assert_array_equal(div, (ai // bi).astype(np.uint32))
    np.testing.assert_array_equal(gt, a > b)


def _flash_masks(seeds, **options):
    """The keep masks of one non-causal flash_attention call per host seed."""
    q, k, v = random_qkv(np.random.default_rng(0), G, L, L, D, np.float32)
    options = {**CHUNKS, **options}
    masks = []
    for seed in seeds:
        def build(q, k, v, s):
            return list(pf.flash_attention(q, k, v, causal=False, dropout=P, seed=s,
                                           return_dropout_mask=True, **options))
        (_, keep), _ = run_graph(build, [q, k, v, np.array(seed, np.uint32)])
        masks.append(keep)
    return masks


def _blocks(keep, n=4):
    """``{(i, j): keep block}`` of a ``[G, L, L]`` mask cut into n x n blocks."""
    c = keep.shape[1] // n
    return {(i, j): keep[:, i * c:(i + 1) * c, j * c:(j + 1) * c]
            for i in range(n) for j in range(n)}


def _unrelated(x, y, p=P):
    """``x`` and ``y`` agree about as often as two independent masks do (``p^2 + (1-p)^2``,
    within six binomial standard deviations)."""
    q = p * p + (1 - p) * (1 - p)
    return abs((x == y).mean() - q) < 6 * np.sqrt(q * (1 - q) / x.size)


@pytest.mark.parametrize("chunks", [dict(num_chunks_q=1, num_chunks_kv=1),
                                    dict(num_chunks_q=4, num_chunks_kv=1),
                                    dict(num_chunks_q=3, num_chunks_kv=5)],
                         ids=["one-block", "row-passes", "loops"])
def test_the_returned_mask_is_the_numpy_hash(chunks):
    """The emulator computes :func:`keep_mask` bit for bit, whatever the chunks."""
    seed = [5, 9]
    (keep,) = _flash_masks([seed], **chunks)
    np.testing.assert_array_equal(keep, keep_mask(np.array(seed, np.uint32), G, np.arange(L),
                                                  np.arange(L), P))


def test_every_pair_of_distinct_blocks_is_unrelated():
    """Blocks of one q chunk, of one kv chunk, and anywhere else: no two agree more than
    independent masks do."""
    blocks = _blocks(_flash_masks([[5, 9]])[0])
    for (a, x), (b, y) in itertools.combinations(blocks.items(), 2):
        assert _unrelated(x, y), (a, b)


@pytest.mark.parametrize("other", [[5, 10], [6, 9], [4, 9], [5, 8], [9, 5], [5, 9 + L]])
def test_a_nearby_seed_gives_an_unrelated_mask(other):
    """The call at a nearby seed (one word one apart, the words swapped, a block offset
    away) shares no block with the call at [5, 9] and agrees with it like an independent
    mask, block by block and shifted by a row, a column or a group."""
    first, second = _flash_masks([[5, 9], other])
    for x in _blocks(first).values():
        for y in _blocks(second).values():
            assert not np.array_equal(x, y)
    assert _unrelated(first, second)
    for shift in ((slice(None), slice(1, None)), (slice(None), slice(None), slice(1, None))):
        back = tuple(slice(None, -1) if s.start == 1 else s for s in shift)
        assert _unrelated(first[shift], second[back])
    assert _unrelated(first[1:], second[:-1])


def test_one_seed_two_calls_same_masks_split_seeds_differ():
    """The user guide's "One seed, two calls": the same seed tensor gives two calls the same
    masks; ops.split_random_seed(seed, 2) gives each its own."""
    q, k, v = random_qkv(np.random.default_rng(1), G, L, L, D, np.float32)

    def build(q, k, v, s):
        opts = dict(causal=False, dropout=P, return_dropout_mask=True, **CHUNKS)
        s1, s2 = ops.split_random_seed(s, 2)
        same = [pf.flash_attention(q, k, v, seed=s, **opts)[1] for _ in range(2)]
        split = [pf.flash_attention(q, k, v, seed=t, **opts)[1] for t in (s1, s2)]
        return same + split
    (a, b, c, d), _ = run_graph(build, [q, k, v, np.array([5, 9], np.uint32)])
    np.testing.assert_array_equal(a, b)
    assert _unrelated(c, d)


# -- context parallelism ------------------------------------------------------------------------
def _cp_masks(seed, R=2, steps=2, group_size=None, layout="contiguous", causal=False):
    """Per replica, its keep mask bool [G, L/R, L] (columns in whole-sequence order) and out
    of a context-parallel call, and the host q, k, v."""
    q, k, v = random_qkv(np.random.default_rng(2), G, L, L, D, np.float32)
    ir = popxl.Ir(replication=R)
    group = None if group_size is None else ir.replica_grouping(group_size=group_size)
    size = R if group_size is None else group_size
    with ir.main_graph:
        streams = [popxl.h2d_stream((G, L // size, D), popxl.float32, name=n) for n in "qkv"]
        s = popxl.variable(np.array(seed, np.uint32))
        out, keep = cp.context_parallel_attention(
            *(ops.host_load(t) for t in streams), causal=causal, layout=layout, group=group,
            kv_gather_steps=steps, dropout=P, seed=s, return_dropout_mask=True)
        d = popxl.d2h_stream(keep.shape, keep.dtype)
        ops.host_store(d, keep)
        o = popxl.d2h_stream(out.shape, out.dtype)
        ops.host_store(o, out)
    feeds = {t: np.concatenate([cp.shard(x, size, layout)] * (R // size))
             for t, x in zip(streams, (q, k, v))}
    with popxl.Session(ir, DEVICE) as session:
        res = session.run(feeds)
    return res[d], res[o], (q, k, v)


@pytest.mark.parametrize("R,steps,layout", [(2, 1, "contiguous"), (2, 2, "contiguous"),
                                            (4, 2, "zigzag"), (4, 1, "zigzag")])
def test_context_parallel_mask_is_single_replica_flashs(R, steps, layout):
    """Every replica count, layout and kv_gather_steps returns the rows of flash_attention's
    mask at the same seed, and out is the reference's with that mask (the rounds' calls used
    it)."""
    keep, out, (q, k, v) = _cp_masks([5, 9], R, steps, layout=layout)
    mask = cp.unshard(keep, layout)
    (flash,) = _flash_masks([[5, 9]])
    np.testing.assert_array_equal(mask, flash)
    ref, _ = pf.reference.attention(q, k, v, causal=False, keep=mask, dropout=P)
    np.testing.assert_allclose(cp.unshard(out, layout), ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("stash", [True, False], ids=["stash", "recompute"])
@pytest.mark.parametrize("fwd_steps,bwd_steps,layout", [(2, 1, "zigzag"), (1, 2, "contiguous")])
def test_context_parallel_backward_with_other_gather_steps(fwd_steps, bwd_steps, layout, stash):
    """A forward with ``kv_gather_steps=fwd_steps`` then its backward with ``bwd_steps``
    (stashed out/lse or recomputed): gradients within the 3x rule of the float64 reference
    with the forward's returned mask (was: off by ~1 with no error)."""
    rng = np.random.default_rng(fwd_steps)
    G4, L4, D4, p = 4, 32, 8, 0.3
    q, k, v = random_qkv(rng, G4, L4, L4, D4, np.float32, kv_groups=2)
    dout = rng.standard_normal(q.shape).astype(np.float32)

    def build(do, q, k, v, s):
        out, lse, keep = cp.context_parallel_attention(
            q, k, v, layout=layout, return_lse=True, dropout=p, seed=s,
            return_dropout_mask=True, kv_gather_steps=fwd_steps)
        grads = cp.context_parallel_attention_grad(
            do, q, k, v, *((out, lse) if stash else (None, None)), layout=layout, dropout=p,
            seed=s, kv_gather_steps=bwd_steps)
        return (out, lse, *grads, keep)
    res, _ = run_replicated(build, dict(dout=dout, q=q, k=k, v=v), 2, layout,
                            dict(seed=np.array([1234, 5678], np.uint32)))
    keep = res[5]
    np.testing.assert_array_equal(keep, keep_mask(np.array([1234, 5678], np.uint32), G4,
                                                  np.arange(L4), np.arange(L4), p))
    cp_check_rule(res[0], res[1], tuple(res[2:5]), q, k, v, dout,
                  dict(causal=True, scale=None, window=None, keep=keep, dropout=p), "float32",
                  max(fwd_steps, bwd_steps))


def test_grouped_context_parallel_with_dropout():
    """group= with dropout: each group of 2 replicas holds one sequence; out equals the
    reference with the returned keep mask, and the two groups (same data, same seed) agree."""
    keep, out, (q, k, v) = _cp_masks([3, 4], R=4, steps=2, group_size=2)
    for g in range(2):
        mask = cp.unshard(keep[2 * g:2 * g + 2], "contiguous")
        got = cp.unshard(out[2 * g:2 * g + 2], "contiguous")
        ref, _ = pf.reference.attention(q, k, v, causal=False, keep=mask, dropout=P)
        np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(keep[:2], keep[2:])
