"""The library under the IPU's floating-point traps (``pf.enable_floating_point_checks``).

Rows that see nothing (causal with Lq > Lkv, windows), padded tail chunks, float16 and extreme
scales must run clean forward and backward: no log(0), no arithmetic on -inf, no overflow in
masked cells. (The property tests run every flash case with the traps on too; see
``attention_utils.FP_CHECKS``.) On the SDK the option traps only on ``ipu_hw``.
"""
import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import random_qkv, run_graph


def _fwd_bwd(dtype, Lq, Lkv, **options):
    rng = np.random.default_rng(Lq * Lkv)
    q, k, v = random_qkv(rng, 2, Lq, Lkv, 8, dtype)
    do = rng.standard_normal(q.shape).astype(dtype)

    def build(do, q, k, v):
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **options)
        return [out, lse, *pf.flash_attention_grad(do, q, k, v, out, lse, **options)]
    outputs, _ = run_graph(build, [do, q, k, v], fp_checks=True)
    return outputs


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_causal_lq_above_lkv_with_padded_tails_runs_clean(dtype):
    # Lq = 50, Lkv = 20: rows 0..29 see nothing; 3 chunks pad both lengths.
    out, lse, dq, dk, dv = _fwd_bwd(dtype, 50, 20, causal=True, num_chunks_q=3, num_chunks_kv=3)
    assert np.isneginf(lse[:, :30]).all() and np.isfinite(lse[:, 30:]).all()
    assert (out[:, :30] == 0).all() and (dq[:, :30] == 0).all()
    assert all(np.isfinite(g).all() for g in (out, dq, dk, dv))


def test_window_rows_that_see_nothing_run_clean():
    # Lq = 40, Lkv = 30, window (1, 0): row i sees i - 11 <= j <= i - 10; rows 0..9 see nothing.
    out, lse, *grads = _fwd_bwd("float32", 40, 30, causal=False, window=(1, 0),
                                num_chunks_q=4, num_chunks_kv=3)
    assert np.isneginf(lse[:, :10]).all() and np.isfinite(lse[:, 10:]).all()
    assert all(np.isfinite(g).all() for g in (out, *grads))


@pytest.mark.parametrize("scale", [1e30, -1e30])
def test_extreme_scales_run_clean(scale):
    out, lse, *grads = _fwd_bwd("float32", 64, 64, causal=True, scale=scale, num_chunks_q=4,
                                num_chunks_kv=4)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
