"""ALiBi with segment ids when the q and kv packings differ (Lq != Lkv): the distance is
FlashAttention-2's |i + Lkv - Lq - j| on the packed row and column indices, as the causal mask
aligns them, forward and backward against the float64 reference."""
import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import random_qkv, run_graph
from score_mod_utils import alibi_slopes, check_rule


@pytest.mark.parametrize("q_lens,kv_lens,causal", [
    ((7, 13), (10, 18), True), ((9, 3), (4, 20), False), ((20, 11), (6, 5), True)])
def test_packed_alibi_with_unequal_q_and_kv_packings(q_lens, kv_lens, causal):
    G, D = 2, 8
    rng = np.random.default_rng(sum(q_lens) + sum(kv_lens))
    Lq, Lkv = sum(q_lens), sum(kv_lens)
    q, k, v = random_qkv(rng, G, Lq, Lkv, D, "float32")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    q_ids, kv_ids = (np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(lens)])[None]
                     for lens in (q_lens, kv_lens))
    slopes = alibi_slopes(G)
    chunks = dict(num_chunks_q=3, num_chunks_kv=4)

    def build(q, k, v, do, i, j, s):
        opts = dict(causal=causal, q_segment_ids=i, kv_segment_ids=j, alibi_slopes=s, **chunks)
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **opts)
        return [out, lse, *pf.flash_attention_grad(do, q, k, v, out, lse, **opts)]
    res, _ = run_graph(build, [q, k, v, dout, q_ids, kv_ids, slopes], fp_checks=True)
    ref_kwargs = dict(causal=causal, scale=None, window=None, q_segment_ids=q_ids,
                      kv_segment_ids=kv_ids, alibi_slopes=slopes)
    check_rule(res[0], res[1], res[2:], q, k, v, dout, chunks, ref_kwargs, "float32")
