"""popxl_flash.graph.segments: the device-side segment helpers against numpy, on the backend."""
import numpy as np
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from attention_utils import run_graph
from packings import packings
from popxl_flash.graph import segments

MASKS = [dict(causal=False, window=(-1, -1)), dict(causal=True, window=(-1, -1)),
         dict(causal=False, window=(3, 1)), dict(causal=True, window=(5, -1)),
         dict(causal=False, window=(-1, 0))]


@settings(max_examples=30)
@given(packing=packings(max_total=120))
def test_varlen_segments_match_host(packing):
    cu_q, _ = packing.cu_seqlens()
    (seg, pos), _ = run_graph(lambda cu: segments.varlen_segments(cu, packing.total_q), [cu_q])
    ref_seg, ref_pos = pf.reference.varlen_segments(cu_q, packing.total_q)
    assert seg.dtype == np.int32 and seg.shape == (1, packing.total_q)
    np.testing.assert_array_equal(seg, ref_seg)
    np.testing.assert_array_equal(pos, ref_pos)


def test_varlen_segments_rows_before_first_offset_are_padding():
    cu = np.array([2, 4, 4, 5], np.int32)
    (seg, pos), _ = run_graph(lambda c: segments.varlen_segments(c, 7), [cu])
    np.testing.assert_array_equal(seg, [[-1, -1, 0, 0, 2, -1, -1]])
    np.testing.assert_array_equal(pos, [[0, 0, -2, -1, -1, 0, 0]])


def host_stats(ids, pos, chunk):
    """numpy :func:`segments.chunk_stats`."""
    Gs, L = ids.shape
    rows = []
    for c in range(L // chunk):
        i, p = ids[:, c * chunk:(c + 1) * chunk], pos[:, c * chunk:(c + 1) * chunk]
        real = i >= 0
        if not real.any():
            rows.append([segments.BIG, -1, 1, segments.BIG, -segments.BIG])
            continue
        lo, hi = i[real].min(), i[real].max()
        rows.append([lo, hi, int((~real).any()), p[real & (i == lo)].min(),
                     p[real & (i == hi)].max()])
    return np.array(rows, np.int32)


def padded_ids(packing, chunk):
    """Host ``(ids, positions)`` of ``packing``'s q side, padded to whole chunks."""
    cu_q, _ = packing.cu_seqlens()
    ids, pos = pf.reference.varlen_segments(cu_q, packing.total_q)
    L = -(-packing.total_q // chunk) * chunk
    pad = L - packing.total_q
    ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1).astype(np.int32)
    return ids, np.pad(pos, ((0, 0), (0, pad))).astype(np.int32)


@settings(max_examples=30)
@given(packing=packings(max_total=100), chunk=st.integers(1, 40), positions=st.booleans())
def test_chunk_stats_match_host(packing, chunk, positions):
    ids, pos = padded_ids(packing, chunk)

    def build(i, p):
        padded = segments.pad_ids(i, i.shape[1], -1)
        return [segments.chunk_stats(padded, p if positions else None, chunk)]
    (stats,), _ = run_graph(build, [ids, pos])
    ref = host_stats(ids, pos, chunk)
    if not positions:
        ref[:, segments.POS_LO:] = 0
    np.testing.assert_array_equal(stats, ref)


def test_pad_ids_fills_tail():
    ids = np.array([[0, 0, 1]], np.int32)
    (out,), _ = run_graph(lambda i: [segments.pad_ids(i, 5, -1)], [ids])
    np.testing.assert_array_equal(out, [[0, 0, 1, -1, -1]])


def dense_mask(qi, ki, qp, kp, causal, window):
    return pf.reference.mask(qi.shape[1], ki.shape[1], causal=causal, window=window,
                             q_segment_ids=qi, kv_segment_ids=ki, q_positions=qp,
                             kv_positions=kp)


@settings(max_examples=50)
@given(packing=packings(max_total=60), chunk_q=st.integers(1, 12), chunk_kv=st.integers(1, 12),
       mask=st.sampled_from(MASKS), positions=st.booleans())
def test_classify_and_runtime_mask_are_exact_where_they_decide(packing, chunk_q, chunk_kv,
                                                               mask, positions):
    """skip => no pair visible; full => every pair visible; the runtime mask == the dense one.

    Exact at block granularity when neither chunk straddles a sequence boundary: then the block
    is skipped iff it holds no visible pair.
    """
    cu_q, cu_k = packing.cu_seqlens()
    qi, qp = pf.reference.varlen_segments(cu_q, packing.total_q)
    ki, kp = pf.reference.varlen_segments(cu_k, packing.total_k)
    Lq, Lk = (-(-n // c) * c for n, c in ((packing.total_q, chunk_q), (packing.total_k, chunk_kv)))
    qi, qp = (np.pad(a, ((0, 0), (0, Lq - a.shape[1])), constant_values=f).astype(np.int32)
              for a, f in ((qi, -1), (qp, 0)))
    ki, kp = (np.pad(a, ((0, 0), (0, Lk - a.shape[1])), constant_values=f).astype(np.int32)
              for a, f in ((ki, -1), (kp, 0)))
    nq, nk = Lq // chunk_q, Lk // chunk_kv
    opts = dict(positions=positions, **mask)

    def build(qi, qp, ki, kp):
        qs = segments.chunk_stats(qi, qp if positions else None, chunk_q)
        ks = segments.chunk_stats(ki, kp if positions else None, chunk_kv)
        classes = segments.classify_blocks(qs, ks, **opts)
        pos = (qp, kp) if positions else (None, None)
        return [classes, segments.step_classes(classes, steps_q, steps_kv),
                segments.runtime_mask(qi, ki, *pos, **mask)]
    steps_q, steps_kv = [0, nq - 1, nq // 2], [nk - 1, 0, nk // 2]
    (classes, per_step, visible), _ = run_graph(build, [qi, qp, ki, kp])
    dense = dense_mask(qi, ki, qp if positions else None, kp if positions else None, **mask)[0]
    if not positions:  # without positions the band is the static schedule's job
        dense = dense_mask(qi, ki, None, None, causal=False, window=None)[0]
    np.testing.assert_array_equal(visible[0], dense)
    assert classes.shape == (nq, nk)
    np.testing.assert_array_equal(per_step, classes[steps_q, steps_kv])
    for (i, j), cls in np.ndenumerate(classes):
        block = dense[i * chunk_q:(i + 1) * chunk_q, j * chunk_kv:(j + 1) * chunk_kv]
        skip = cls == segments.RT_SKIP
        if skip:
            assert not block.any(), (i, j)
        if cls == segments.RT_FULL:
            assert block.all(), (i, j)
        q_chunk, k_chunk = (ids[0, c * n:(c + 1) * n] for ids, c, n in
                            ((qi, i, chunk_q), (ki, j, chunk_kv)))
        if len(set(q_chunk[q_chunk >= 0])) <= 1 and len(set(k_chunk[k_chunk >= 0])) <= 1:
            assert bool(skip) == (not block.any()), (i, j)
