"""The predicted pass work (popxl_flash.plan.counts.pass_counts) against the emulator's run
profile priced by PopART's lowering: compute sets, vector work per rate key and the views' and
ops' copies as fitted (``python -m popxl_flash.checks.fit_work``, on other shapes than these)
to within a relative 1e-6, matmul FLOPs, boundary copies and loop iterations exactly, for one
forward pass and one stash-mode backward pass over drawn shapes and chunkings (1 x 1 chunks,
chunk_q != chunk_kv, lengths that are no power of two, padded tails, windows, non-causal,
grouped-query, float32, scales that do and do not fold into k). The harness's host transfers
are not part of a pass (they have no compute sets); the backward's work is a forward +
backward run's minus the forward's."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash.checks import fit_work
from popxl_flash.lowering import RATE_KEYS
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.plan.counts import pass_counts

pytestmark = pytest.mark.skipif(pf.BACKEND != "emulator",
                                reason="profile counts are an emulator feature")


def _close(model, measured):
    return abs(model - measured) <= 1e-6 * max(abs(measured), 1.0)


def assert_counts_hold(G, Gk, Lq, Lkv, D, dtype, options):
    forward, backward = fit_work.measure(G, Gk, Lq, Lkv, D, dtype, options)
    shape, kv_shape = (G, Lq, D), (Gk, Lkv, D)
    cfg = AttentionConfig.from_shapes(shape, kv_shape, kv_shape, (dtype,) * 3, **options)
    for is_backward, measured in ((False, forward), (True, backward)):
        model = pass_counts(Lq, Lkv, cfg.chunk_q, cfg.chunk_kv, head_dim=D, groups=G,
                            kv_groups=Gk, dtype=dtype, causal=cfg.causal, window=cfg.window,
                            backward=is_backward, scale=options.get("scale"))
        w = model.work
        assert _close(w.compute_sets, measured["compute_sets"]), (is_backward, w, measured)
        for key in RATE_KEYS:
            assert _close(w.vector_work.get(key, 0), measured[key]), (key, is_backward, w)
        copied = measured["copied"] + measured["boundary"]
        assert _close(w.bytes_copied, copied), (is_backward, w, measured)
        assert w.ops == measured["ops"]  # executed ops other than re-indexing (fitted)
        assert sum(w.matmul_flops.values()) == measured["matmul_flops"]
        assert model.iterations == measured["iterations"]
    return forward, backward


@st.composite
def cases(draw):
    r = draw(st.sampled_from([1, 2, 3]))
    Gk = draw(st.integers(1, 2))
    G = Gk * r
    Lq = draw(st.integers(1, 70))
    Lkv = draw(st.integers(1, 70))
    D = draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from(["float16", "float32"]))
    nq = draw(st.integers(1, min(Lq, 5)))
    nkv = draw(st.integers(1, min(Lkv, 5)))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, (4, 0), (10, 3), (-1, 6)]))
    options = dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=causal, window=window)
    scale = draw(st.sampled_from([None, None, 0.5, 0.3]))
    if scale is not None:
        options["scale"] = scale
    return G, Gk, Lq, Lkv, D, dtype, options


@settings(max_examples=40)
@given(cases())
def test_pass_counts_equal_the_profile(case):
    assert_counts_hold(*case)


@pytest.mark.parametrize("G, Gk, Lq, Lkv, D, dtype, options", [
    (3, 3, 40, 40, 8, "float16", dict(num_chunks_q=1, num_chunks_kv=1, causal=True)),
    (2, 1, 97, 50, 8, "float16", dict(num_chunks_q=5, num_chunks_kv=3, causal=True)),
    (4, 2, 200, 150, 16, "float32", dict(num_chunks_q=3, num_chunks_kv=2, causal=False,
                                          window=(20, 7))),
    (2, 2, 256, 256, 16, "float16", dict(num_chunks_q=2, num_chunks_kv=4, causal=True)),
    # one kv chunk: the forward's row passes (a chunk of rows that see nothing: Lq > Lkv)
    (2, 1, 97, 50, 8, "float16", dict(num_chunks_q=4, num_chunks_kv=1, causal=True)),
    (2, 2, 60, 20, 8, "float16", dict(num_chunks_q=3, num_chunks_kv=1, causal=True)),
    (2, 2, 130, 64, 16, "float32", dict(num_chunks_q=3, num_chunks_kv=1, causal=False,
                                        window=(10, 3))),
    (1, 1, 64, 100, 3, "float16", dict(num_chunks_q=8, num_chunks_kv=1, causal=False)),
])
def test_pass_counts_named_cases(G, Gk, Lq, Lkv, D, dtype, options):
    assert_counts_hold(G, Gk, Lq, Lkv, D, dtype, options)
