"""Helpers for the score-modifier and dropout tests: run forward and stashed backward with
modifiers on host arrays, and hold the results to the FlashAttention rule against the float64
reference (:mod:`popxl_flash.checks.tolerance`)."""
import numpy as np

import popxl_flash as pf
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.checks.tolerance import gradient_accum_steps

from attention_utils import (FP_CHECKS, assert_grads_within_rule, assert_within_rule,
                             naive_attention, run_graph)


def run_modified(q, k, v, dout, extras, make_modifiers, options, *, stash=True, mask=False):
    """Forward and backward of ``pf.flash_attention`` with score modifiers.

    Args:
        extras: host arrays that become graph inputs (slopes, tables, seed).
        make_modifiers: ``fn(*extra_tensors) -> dict`` of modifier keywords.
        options: the other keywords (chunks, mask, segment ids as tensors are not used here).
        stash: backward from the stashed out/lse (else recompute mode).
        mask: also return the dropout keep mask.

    Returns:
        ``(out, lse, (dq, dk, dv), keep or None)``.
    """
    def build(q, k, v, do, *xs):
        mods = make_modifiers(*xs)
        res = pf.flash_attention(q, k, v, return_lse=True, return_dropout_mask=mask, **options,
                                 **mods)
        out, lse = res[0], res[1]
        grads = pf.flash_attention_grad(do, q, k, v, *((out, lse) if stash else (None, None)),
                                        **options, **mods)
        return [out, lse, *grads] + ([res[2]] if mask else [])
    res, _ = run_graph(build, [q, k, v, dout, *extras], fp_checks=FP_CHECKS)
    return res[0], res[1], tuple(res[2:5]), (res[5] if mask else None)


def check_rule(out, lse, grads, q, k, v, dout, options, ref_kwargs, dtype, grad_options=None):
    """out and lse within 2x, dq, dk, dv within 3x of the naive same-precision error plus the
    floors, against ``pf.reference`` with ``ref_kwargs`` (mask and modifier keywords).
    ``options``: the forward's chunk counts; ``grad_options``: the backward's (default the
    forward's)."""
    ref_out, ref_lse = pf.reference.attention(q, k, v, **ref_kwargs)
    naive_out, _ = naive_attention(q, k, v, **ref_kwargs)
    chunks = {n: options.get(n) for n in ("num_chunks_q", "num_chunks_kv")}
    mask_opts = {n: ref_kwargs[n] for n in ("causal", "scale", "window")}
    cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3, **chunks,
                                      **mask_opts)
    D = q.shape[-1]
    steps = cfg.num_chunks_kv + cfg.chunk_kv + D
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert np.isfinite(out).all() and (out[empty] == 0).all()
    assert_within_rule("out", out, naive_out, ref_out, factor=2, dtype=dtype, accum_steps=steps,
                       magnitude=float(np.abs(v).max()) * _keep_boost(ref_kwargs))
    _, naive32_lse = naive_attention(*(a.astype(np.float32) for a in (q, k, v)), **ref_kwargs)
    assert_within_rule("lse", lse, naive32_lse, ref_lse, factor=2, dtype="float32",
                       accum_steps=steps,
                       magnitude=float(np.abs(ref_lse[~empty]).max(initial=1)))
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert np.isfinite(g).all(), f"{name} must be finite"
    if grad_options is not None:
        chunks = {n: grad_options.get(n) for n in ("num_chunks_q", "num_chunks_kv")}
        cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (dtype,) * 3, **chunks,
                                          **mask_opts)
    assert_grads_within_rule(grads, dout, q, k, v, dtype=dtype, steps=gradient_accum_steps(cfg),
                             **ref_kwargs)


def _keep_boost(ref_kwargs):
    """Kept probabilities are scaled by ``1 / (1 - p)``: so is the output's magnitude."""
    if ref_kwargs.get("keep") is None:
        return 1.0
    return 1.0 / (1.0 - ref_kwargs.get("dropout", 0.0))


def alibi_slopes(heads):
    """The ALiBi paper's geometric slopes ``2^(-8 h / H)``, float32 ``[H]``."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
