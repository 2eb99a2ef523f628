"""Dropout seeds never collide: every (sub-)block of one call, every (replica, round) of a
context-parallel call, and the calls at nearby user seeds draw their own keep masks; one seed
tensor given to two calls draws the same masks (documented), split_random_seed separates them.
"""
import itertools

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import DEVICE, random_qkv, run_graph
from popxl_flash import popxl
from popxl_flash.api import context_parallel as cp

ops = popxl.ops

G, L, D, P = 2, 32, 4, 0.5
CHUNKS = dict(num_chunks_q=4, num_chunks_kv=4)


def _flash_masks(seeds, **options):
    """The keep masks of one non-causal flash_attention call per host seed."""
    q, k, v = random_qkv(np.random.default_rng(0), G, L, L, D, np.float32)
    masks = []
    for seed in seeds:
        def build(q, k, v, s):
            return list(pf.flash_attention(q, k, v, causal=False, dropout=P, seed=s,
                                           return_dropout_mask=True, **CHUNKS, **options))
        (_, keep), _ = run_graph(build, [q, k, v, np.array(seed, np.uint32)])
        masks.append(keep)
    return masks


def _blocks(keep, n=4):
    """``{(i, j): keep block}`` of a ``[G, L, L]`` mask cut into n x n blocks."""
    c = keep.shape[1] // n
    return {(i, j): keep[:, i * c:(i + 1) * c, j * c:(j + 1) * c]
            for i in range(n) for j in range(n)}


def test_every_pair_of_distinct_blocks_draws_its_own_mask():
    """Blocks of one q chunk, of one kv chunk, and anywhere else: no two masks are equal."""
    blocks = _blocks(_flash_masks([[5, 9]])[0])
    for (a, x), (b, y) in itertools.combinations(blocks.items(), 2):
        assert not np.array_equal(x, y), (a, b)


@pytest.mark.parametrize("other", [[5, 10], [6, 9], [4, 9], [5, 8], [5, 9 + L // 4],
                                   [5, 9 + L], [5, 9 + L + L // 4]])
def test_a_nearby_seed_shares_no_block_mask(other):
    """No block of the call at a nearby seed equals any block of the call at [5, 9]: also not
    at the seeds one block offset away (the next kv chunk, ``+ chunk``; the next q chunk,
    ``+ Lkv``), which a block seed added to the user's seed itself would share."""
    first, second = (_blocks(m) for m in _flash_masks([[5, 9], other]))
    for x in first.values():
        for y in second.values():
            assert not np.array_equal(x, y)


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
    assert (c != d).mean() > 0.3


# -- context parallelism ------------------------------------------------------------------------
def _cp_masks(seed, R=2, steps=2, group_size=None, layout="contiguous"):
    """Per replica, its keep mask bool [G, L/R, L] (columns in whole-sequence order) of a
    non-causal context-parallel call."""
    q, k, v = random_qkv(np.random.default_rng(2), G, L, L, D, np.float32)
    ir = popxl.Ir(replication=R)
    group = None if group_size is None else ir.replica_grouping(group_size=group_size)
    size = R if group_size is None else group_size
    with ir.main_graph:
        streams = [popxl.h2d_stream((G, L // size, D), popxl.float32, name=n) for n in "qkv"]
        s = popxl.variable(np.array(seed, np.uint32))
        out, keep = cp.context_parallel_attention(
            *(ops.host_load(t) for t in streams), causal=False, layout=layout, group=group,
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


def _round_columns(R, steps):
    """Whole-sequence columns of each round (contiguous layout): round s gathers rows
    [s * piece, (s + 1) * piece) of every replica's shard."""
    per, piece = L // R, L // R // steps
    return [np.concatenate([np.arange(r * per + s * piece, r * per + (s + 1) * piece)
                            for r in range(R)]) for s in range(steps)]


def test_replica_and_round_masks_never_coincide():
    """Replica 1's round 0 and replica 0's round 1 (and every other pair of (replica, round))
    draw different masks: the (replica, round) index is added after a hash of the seed."""
    R, steps = 2, 2
    keep, _, _ = _cp_masks([5, 9], R, steps)
    cols = _round_columns(R, steps)
    parts = {(r, s): keep[r][:, :, cols[s]] for r in range(R) for s in range(steps)}
    for (a, x), (b, y) in itertools.combinations(parts.items(), 2):
        assert not np.array_equal(x, y), (a, b)


def test_replica_1_does_not_draw_replica_0s_masks_at_a_nearby_seed():
    """Adding the replica to the seed's first word gave replica 1 at [5, 9] replica 0's masks
    at [6, 9]; now no (replica, round) of the two calls share a mask."""
    R, steps = 2, 2
    cols = _round_columns(R, steps)
    calls = [_cp_masks(seed, R, steps)[0] for seed in ([5, 9], [6, 9], [5, 10])]
    parts = [[m[r][:, :, cols[s]] for r in range(R) for s in range(steps)] for m in calls]
    for x in parts[0]:
        for other in parts[1:]:
            for y in other:
                assert not np.array_equal(x, y)


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
