"""The naive PopXL baseline (used by the demo, benchmarks and example) against the reference."""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash.checks.naive import naive_attention, naive_attention_grad

from attention_utils import random_qkv, run_graph


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, -1))])
def test_naive_graph_matches_reference(causal, window):
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 9, 12, 5, "float32")  # Lq <= Lkv: every row sees a key
    dout = rng.standard_normal(q.shape).astype(np.float32)
    opts = dict(causal=causal, scale=0.6, window=window)
    def build(do, q, k, v):
        out = naive_attention(q, k, v, **opts)
        return (out, *naive_attention_grad(do, q, k, v, **opts),
                *naive_attention_grad(do, q, k, v, out, **opts))
    (out, *grads), _ = run_graph(build, [dout, q, k, v])
    ref_out, _ = pf.reference.attention(q, k, v, **opts)
    # float32, one-pass sums over <= 12 terms of O(1) values: errors ~1e-6.
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    refs = pf.reference.attention_grad(dout, q, k, v, **opts)
    for g, ref in zip(grads, refs + refs):  # out recomputed, then out stashed
        np.testing.assert_allclose(g, ref, atol=1e-5)
