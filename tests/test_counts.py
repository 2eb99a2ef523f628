"""The predicted pass counts (popxl_flash.plan.counts.pass_counts) against the emulator's run
profile: supersteps, matmul FLOPs, bytes copied and loop iterations exactly, vector elements
within 3%, for one forward pass and one stash-mode backward pass over drawn shapes and
chunkings (1 x 1 chunks, chunk_q != chunk_kv, lengths that are no power of two, padded tails,
windows, non-causal, grouped-query, float32). The harness's host transfers are not part of a
pass; the backward's counts are a forward + backward run's minus the forward's."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.plan.counts import pass_counts

from attention_utils import random_qkv, run_graph

pytestmark = pytest.mark.skipif(pf.BACKEND != "emulator",
                                reason="profile counts are an emulator feature")

HOST_IO = ("host_load", "host_store")
EXACT = ("supersteps", "matmul_flops", "bytes_copied", "iterations")


def _measured(profile):
    return dict(supersteps=profile.supersteps - sum(profile.ops_by_kind.get(k, 0)
                                                    for k in HOST_IO),
                matmul_flops=profile.matmul_flops, vector_elements=profile.vector_elements,
                bytes_copied=profile.bytes_copied, iterations=profile.loop_iterations)


def measured_passes(G, Gk, Lq, Lkv, D, dtype, options):
    """The emulator's counts of one forward pass and of one backward pass."""
    q, k, v = random_qkv(np.random.default_rng(0), G, Lq, Lkv, D, dtype, kv_groups=Gk)
    _, fwd = run_graph(lambda q, k, v: pf.flash_attention(q, k, v, return_lse=True, **options),
                       [q, k, v])

    def grads(do, q, k, v):
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **options)
        return pf.flash_attention_grad(do, q, k, v, out, lse, **options)

    _, both = run_graph(grads, [q, q, k, v])
    forward, total = _measured(fwd.profile), _measured(both.profile)
    return forward, {name: total[name] - forward[name] for name in total}


def assert_counts_hold(G, Gk, Lq, Lkv, D, dtype, options):
    forward, backward = measured_passes(G, Gk, Lq, Lkv, D, dtype, options)
    shape, kv_shape = (G, Lq, D), (Gk, Lkv, D)
    cfg = AttentionConfig.from_shapes(shape, kv_shape, kv_shape, (dtype,) * 3, **options)
    for is_backward, measured in ((False, forward), (True, backward)):
        model = pass_counts(Lq, Lkv, cfg.chunk_q, cfg.chunk_kv, head_dim=D, groups=G,
                            kv_groups=Gk, dtype=dtype, causal=cfg.causal, window=cfg.window,
                            backward=is_backward)
        for name in EXACT:
            assert getattr(model, name) == measured[name], (name, is_backward, model, measured)
        assert abs(model.vector_elements - measured["vector_elements"]) <= \
            0.03 * measured["vector_elements"], (is_backward, model, measured)
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
    return G, Gk, Lq, Lkv, D, dtype, dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=causal,
                                          window=window)


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
