"""Helpers for the attention tests: run the library on the backend, naive baselines, tolerances.

The tolerance rule (FlashAttention's: 2x / 3x the error of a naive same-precision attention plus
a reasoned floor) lives in :mod:`popxl_flash.tolerance`, shared with ``python -m
popxl_flash.selfcheck``; its docstring gives the reasoning.
"""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import harness, popxl
from popxl_flash.tolerance import (EPS32, max_err, naive_attention,  # noqa: F401 (re-exported)
                                   naive_attention_grad, rounding_floor, rule_bound)

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
        ``(outputs, run)``: the output arrays and the :class:`popxl_flash.harness.RunResult`, whose
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


def assert_within_rule(name, x, naive, ref, *, factor, dtype, accum_steps, magnitude,
                       extra_floor=0.0):
    """Assert ``max|x - ref| <= factor * max|naive - ref| + floor`` (see
    :mod:`popxl_flash.tolerance`, whose arguments these are)."""
    err = max_err(x, ref)
    bound = rule_bound(naive, ref, factor=factor, dtype=dtype, accum_steps=accum_steps,
                       magnitude=magnitude, extra_floor=extra_floor)
    assert err <= bound, (f"{name}: max error {err:.3e} > bound {bound:.3e} "
                          f"({factor}x naive + floor)")


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


def loop_copies_follow_alias_zero_copy():
    """Whether the backend's run profile follows PopART's AliasZeroCopy for repeat inputs: a
    micro-graph of two ``repeat`` loops that read one input (by value, unmodified) and update
    another by reference (``dynamic_update_``, nobody else reading it while they run). Under
    AliasZeroCopy neither is copied per step nor held twice. Emulator models that predate
    issue 16's copy model count both: the tests of copy and peak figures that depend on it run
    only once the profile follows the rule (the SDK measures the real program: always)."""
    if pf.BACKEND != "emulator":
        return True
    n = 1024
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((1, n), np.float32))

        def body(t, x, y: popxl.TensorByRef):
            ops.dynamic_update_(y, t, ops.dynamic_slice(x, t, axes=[1], sizes=[1],
                                                        no_overlap=True),
                                axes=[1], sizes=[1], no_overlap=True)
            return t + popxl.constant(np.array([1], np.int32))

        graph = ir.create_graph(body, popxl.TensorSpec((1,), popxl.int32), x.spec, x.spec)
        y = ops.init((1, n), popxl.float32, init_type="zero")
        with popxl.in_sequence():
            for _ in range(2):
                ops.repeat(graph, 4, popxl.constant(np.array([0], np.int32)), x, y)
    with popxl.Session(ir, "ipu_model") as session:
        session.run()
    return session.profile.bytes_copied < 4 * n
