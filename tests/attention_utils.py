"""Helpers for the attention tests: run the library on the backend, naive baselines, tolerances.

The tolerance rule (FlashAttention's: 2x / 3x the error of a naive same-precision attention plus
a reasoned floor) lives in :mod:`popxl_flash.checks.tolerance`, shared with ``python -m
popxl_flash.checks.selfcheck``; its docstring gives the reasoning.
"""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash.checks import harness
from popxl_flash import popxl
from popxl_flash.graph.segments import RT_FULL, RT_MASKED, RT_SKIP
from popxl_flash.checks.tolerance import (EPS32, max_err, naive_attention,  # noqa: F401 (re-exported)
                                   naive_attention_grad, rounding_floor, rule_bound)
from popxl_flash.checks.tolerance import grad_bounds, gradient_rounding_parity

ops = popxl.ops

DEVICE = "ipu_model"

#: Every flash run of the tests (property tests included) runs with the IPU's floating-point
#: traps on (``pf.enable_floating_point_checks``): on the emulator any overflow, division by
#: zero or invalid value in the library's graphs raises ``FloatingPointError``. On the SDK the
#: option only traps on ``ipu_hw``.
FP_CHECKS = True


def zeros_variable(shape, dtype=np.float32):
    """A zero ``popxl.variable`` of ``shape`` in the current (main) graph."""
    return popxl.variable(np.zeros(shape, dtype))


def build_only(fn):
    """Run ``fn`` inside a fresh main graph, without a session: for errors that must come at
    graph-build time."""
    ir = popxl.Ir()
    with ir.main_graph:
        return fn()


def run_graph(build, inputs, *, fp_checks=False):
    """Build a main graph from host arrays and run it once on :data:`DEVICE`.

    Args:
        fp_checks: run with floating-point exception traps on.

    Returns:
        ``(outputs, run)``: the output arrays and the :class:`popxl_flash.checks.harness.RunResult`, whose
        ``profile`` is the emulator's run profile.
    """
    result = harness.run_graph(lambda *ts: list(build(*ts)), list(inputs), device=DEVICE,
                               fp_checks=fp_checks)
    return result.outputs, result


def run_flash(q, k, v, **options):
    """``pf.flash_attention(..., return_lse=True)`` on host arrays -> ``out, lse, run``, with
    floating-point traps on (:data:`FP_CHECKS`)."""
    (out, lse), session = run_graph(
        lambda q, k, v: pf.flash_attention(q, k, v, return_lse=True, **options), [q, k, v],
        fp_checks=FP_CHECKS)
    return out, lse, session


def run_flash_grad(dout, q, k, v, *, stash=True, **options):
    """Gradients by ``pf.flash_attention_grad`` (stash or recompute mode) on host arrays, with
    floating-point traps on (:data:`FP_CHECKS`)."""
    def build(do, q, k, v):
        out, lse = (pf.flash_attention(q, k, v, return_lse=True, **options) if stash
                    else (None, None))
        return pf.flash_attention_grad(do, q, k, v, out, lse, **options)
    grads, session = run_graph(build, [dout, q, k, v], fp_checks=FP_CHECKS)
    return grads, session


def run_flash_attn_func(q, k, v, **options):
    """``pf.flash_attn_func(..., return_lse=True)`` on host arrays -> ``out, lse, run``."""
    (out, lse), session = run_graph(
        lambda q, k, v: pf.flash_attn_func(q, k, v, return_lse=True, **options), [q, k, v])
    return out, lse, session


def to_groups(x, layout="BLHD"):
    """Host-side ``[B, L, H, D]`` (or ``[B, H, L, D]``) -> ``[B*H, L, D]``, batch-major."""
    if layout == "BLHD":
        x = x.transpose(0, 2, 1, 3)
    B, H, L, D = x.shape
    return x.reshape(B * H, L, D)


def random_qkv(rng, G, Lq, Lkv, D, dtype, kv_groups=None):
    """Standard-normal q ``[G, Lq, D]``, k, v ``[Gk, Lkv, D]`` in ``dtype`` (``Gk = kv_groups``,
    default G)."""
    Gk = G if kv_groups is None else kv_groups
    q = rng.standard_normal((G, Lq, D)).astype(dtype)
    k = rng.standard_normal((Gk, Lkv, D)).astype(dtype)
    v = rng.standard_normal((Gk, Lkv, D)).astype(dtype)
    return q, k, v


def gradient_magnitude(refs, name):
    """The magnitude for the floor of gradient ``name`` in ``refs`` (``{name: float64 grad}``).

    A k projection's bias (a name ending in ``k.bias``) has an exact gradient of zero: a bias on
    every key shifts each row's scores by ``q . b``, which softmax ignores. Any implementation
    returns the rounding residue of a sum of per-token terms ``dK_t``, so its floor takes the
    size of such terms, not of the zero result: the matching q bias gradient sums the per-token
    ``dQ_t``, of the same scale. Every other gradient: its own largest magnitude.
    """
    magnitude = float(np.abs(refs[name]).max())
    if name.endswith("k.bias"):
        magnitude = max(magnitude, float(np.abs(refs[name[:-len("k.bias")] + "q.bias"]).max()))
    return magnitude


def assert_within_rule(name, x, naive, ref, *, factor, dtype, accum_steps, magnitude,
                       extra_floor=0.0, parity=0.0):
    """Assert ``max|x - ref| <= max(factor * max|naive - ref|, parity) + floor`` (see
    :mod:`popxl_flash.checks.tolerance`, whose arguments these are)."""
    err = max_err(x, ref)
    bound = rule_bound(naive, ref, factor=factor, dtype=dtype, accum_steps=accum_steps,
                       magnitude=magnitude, extra_floor=extra_floor, parity=parity)
    assert err <= bound, (f"{name}: max error {err:.3e} > bound {bound:.3e} "
                          f"({factor}x naive + floor)")


def assert_grads_within_rule(grads, dout, q, k, v, *, dtype, steps, refs=None, **ref_kwargs):
    """The backward's 3x rule on ``grads = (dq, dk, dv)`` (core layout ``[G, L, D]``): the
    naive same-precision baseline, the stash and accumulation floors of
    :func:`popxl_flash.checks.tolerance.grad_bounds` and the float16 rounding parity.

    Args:
        grads: the gradients under test. dout, q, k, v: the host inputs.
        dtype: the input dtype name. steps: ``accum_steps`` per gradient (three values) or one
            for all. refs: the float64 gradients if the caller has them. ref_kwargs: the mask,
            scale, segment and modifier options of :func:`pf.reference.attention_grad`.

    Returns:
        The float64 reference gradients.
    """
    if refs is None:
        refs = pf.reference.attention_grad(dout, q, k, v, **ref_kwargs)
    naives = naive_attention_grad(dout, q, k, v, **ref_kwargs)
    mags, stash_errors = grad_bounds(dout, q, k, v, dtype=dtype, **ref_kwargs)
    steps = tuple(steps) if np.ndim(steps) else (steps,) * 3
    for name, g, ref, naive, mag, err, n in zip(("dq", "dk", "dv"), grads, refs, naives, mags,
                                                stash_errors, steps):
        assert_within_rule(name, g, naive, ref, factor=3, dtype=dtype, accum_steps=n,
                           magnitude=mag, extra_floor=err,
                           parity=gradient_rounding_parity(mag, dtype))
    return refs


#: (Lq, Lkv) pairs of FlashAttention's own test suite (tests/test_flash_attn.py).
FLASH_ATTN_SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
                      (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]


def suite_case(Lq, Lkv, dtype, mask, seed, kv_groups=2):
    """A FlashAttention-suite case for ``check_forward``/``check_backward``: G = 2, D = 32,
    automatic chunking, default scale, the given mask options (``kv_groups=1``: multi-query)."""
    opts = dict(dict(num_chunks_q=None, num_chunks_kv=None, scale=None, window=None), **mask)
    return dict(shape=(2, Lq, Lkv, 32), kv_groups=kv_groups, options=opts, dtype=dtype,
                seed=seed)


def suite_parametrize(seqlens):
    """Parametrize a test over ``(Lq, Lkv)`` pairs x dtypes x (causal, full, window) masks."""
    def decorate(test):
        masks = pytest.mark.parametrize(
            "mask", [dict(causal=True), dict(causal=False), dict(causal=False, window=(48, 16))],
            ids=["causal", "full", "window"])
        dtypes = pytest.mark.parametrize("dtype", ["float16", "float32"])
        return pytest.mark.parametrize("Lq,Lkv", seqlens)(dtypes(masks(test)))
    return decorate


def host_block_classes(ids, chunk_q, chunk_kv):
    """Runtime classes of the blocks of one row of packed ids without positions, on the host
    (the rule of :func:`popxl_flash.graph.segments.classify_blocks` on the chunks' id ranges): skip
    when the ranges are disjoint, full when both chunks are one segment without padding."""
    def stats(chunk):
        x = ids.reshape(-1, chunk)
        real = x >= 0
        return (np.where(real, x, 2**30).min(1), np.where(real, x, -1).max(1),
                (~real).any(1))
    (q0, q1, q_pad), (k0, k1, k_pad) = stats(chunk_q), stats(chunk_kv)
    skip = (k0[None] > q1[:, None]) | (q0[:, None] > k1[None])
    full = ((q0 == q1)[:, None] & (k0 == k1)[None] & (q0[:, None] == k0[None])
            & ~q_pad[:, None] & ~k_pad[None] & ~skip)
    return np.where(skip, RT_SKIP, np.where(full, RT_FULL, RT_MASKED))


#: Kinds whose output elements are no op work in the op-counting planners' terms.
_NOT_COUNTED = {"matmul", "call", "repeat", "conditional", "host_load", "host_store",
                "reshape", "reshape_", "transpose", "transpose_", "slice", "slice_", "detach",
                "detach_"}


def output_elements(profile):
    """Output elements of the executed ops other than views, matmuls, subgraph ops and host
    IO: the element count :func:`popxl_flash.plan.kvcache.straight_counts` predicts."""
    return sum(n for kind, n in profile.elements_by_kind.items() if kind not in _NOT_COUNTED)
