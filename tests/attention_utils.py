"""Helpers for the attention tests: run the library on the backend, naive baselines, tolerances.

Tolerance rule (FlashAttention's test rule). For an output ``x`` with float64 reference ``ref``:

    max|x - ref| <= factor * max|naive - ref| + floor

where ``naive`` is a plain attention in the SAME precision as the inputs (float16 inputs give
float16 scores and probabilities; float32 gives float32), ``factor`` is 2 for the forward and 3 for
the backward, and ``floor`` is the sum of two small terms:

* the rounding error of representing ``ref`` in the input dtype
  (``2 * max|fl(ref + 0.3) - 0.3 - ref|``, the floor FlashAttention's tests use): below that no
  implementation in that dtype can go, and the naive error can be 0 by luck on tiny problems;
* the float32 accumulation error of the chunked algorithm: each of the ``n`` chunk steps
  rescales and adds into a float32 accumulator (about 4 roundings per step, relative to the
  accumulator's magnitude), and each block matmul sums ``c + D`` products, so the error is at
  most ``4 * (n + c + D) * eps32 * magnitude``. For float32 inputs this term is what makes the
  bound meaningful: a naive float32 attention sums in one pass and can be far more accurate
  than any chunked order when there are hundreds of chunks. For float16 it is negligible next
  to the float16 naive error.

Flash keeps scores, statistics and accumulators in float32 even for float16 inputs, so it is
usually far inside the bound.
"""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import harness, popxl

ops = popxl.ops

DEVICE = "ipu_model"

#: Every flash run of the tests (property tests included) runs with the IPU's floating-point
#: traps on (``pf.enable_floating_point_checks``): on the emulator any overflow, division by
#: zero or invalid value in the library's graphs raises ``FloatingPointError``. On the SDK the
#: option only traps on ``ipu_hw``.
FP_CHECKS = True


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


def random_qkv(rng, G, Lq, Lkv, D, dtype):
    """Standard-normal q ``[G, Lq, D]``, k, v ``[G, Lkv, D]`` in ``dtype``."""
    q = rng.standard_normal((G, Lq, D)).astype(dtype)
    k = rng.standard_normal((G, Lkv, D)).astype(dtype)
    v = rng.standard_normal((G, Lkv, D)).astype(dtype)
    return q, k, v


def naive_attention(q, k, v, *, causal, scale, window):
    """Plain attention in the inputs' precision (float16 scores and probabilities for float16).

    Matmuls accumulate in float32 and round to the input dtype, as a float16 IPU matmul does.
    Returns ``(out, lse)`` in the input dtype.
    """
    dt = q.dtype
    D = q.shape[-1]
    scale = dt.type(1.0 / np.sqrt(D) if scale is None else scale)
    visible = pf.reference.visibility(q.shape[1], k.shape[1], causal=causal, window=window)
    s = (q.astype(np.float32) @ k.astype(np.float32).transpose(0, 2, 1)).astype(dt) * scale
    s = np.where(visible, s, dt.type(-np.inf))
    with np.errstate(invalid="ignore", divide="ignore"):
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, dt.type(0))
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True, dtype=dt)
        lse = (m + np.log(l))[..., 0]
        p = p / np.where(l > 0, l, dt.type(1))
    out = (p.astype(np.float32) @ v.astype(np.float32)).astype(dt)
    return out, lse


def naive_attention_grad(dout, q, k, v, *, causal, scale, window):
    """Plain backward in the inputs' precision (float16 P and dS for float16 inputs)."""
    dt = q.dtype
    f32 = np.float32
    scale = dt.type(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    out, lse = naive_attention(q, k, v, causal=causal, scale=scale, window=window)
    visible = pf.reference.visibility(q.shape[1], k.shape[1], causal=causal, window=window)
    s = (q.astype(f32) @ k.astype(f32).transpose(0, 2, 1)).astype(dt) * scale
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.where(visible, np.exp(s - lse[..., None]), dt.type(0)).astype(dt)
    p = np.where(np.isfinite(lse)[..., None], p, dt.type(0))

    def mm(a, b):
        return (a.astype(f32) @ b.astype(f32)).astype(dt)
    dv = mm(p.transpose(0, 2, 1), dout)
    dp = mm(dout, v.transpose(0, 2, 1))
    dvec = (dout.astype(f32) * out.astype(f32)).sum(-1, keepdims=True).astype(dt)
    ds = (p * (dp - dvec)).astype(dt)
    return mm(ds, k) * scale, mm(ds.transpose(0, 2, 1), q) * scale, dv


def rounding_floor(ref, dtype):
    """FlashAttention's floor: twice the rounding error of ``ref`` in ``dtype``."""
    dt = np.dtype(dtype).type
    ref = np.where(np.isfinite(ref), ref, 0.0)
    rounded = (ref.astype(dt) + dt(0.3) - dt(0.3)).astype(np.float64)
    return 2.0 * float(np.max(np.abs(rounded - ref), initial=0.0))


def max_err(x, ref):
    """max |x - ref| over finite reference entries (infinite ones are checked separately)."""
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(x.astype(np.float64)[finite] - ref[finite])))


EPS32 = float(np.finfo(np.float32).eps)


def assert_within_rule(name, x, naive, ref, *, factor, dtype, accum_steps, magnitude,
                       extra_floor=0.0):
    """Assert ``max|x - ref| <= factor * max|naive - ref| + floor`` (see module docstring).

    Args:
        accum_steps: ``n + c + D`` of the accumulation-error floor.
        magnitude: bound on the accumulated values (e.g. ``max|v|`` for the output).
        extra_floor: a further error bound the caller derives (the backward's stashed-output
            rounding, see test_backward.grad_bounds).
    """
    err = max_err(x, ref)
    floor = rounding_floor(ref, dtype) + 4 * accum_steps * EPS32 * magnitude + extra_floor
    bound = factor * max_err(naive, ref) + floor
    assert err <= bound, (f"{name}: max error {err:.3e} > bound {bound:.3e} "
                          f"({factor}x naive + floor)")


#: (Lq, Lkv) pairs of FlashAttention's own test suite (tests/test_flash_attn.py).
FLASH_ATTN_SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
                      (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]


def suite_case(Lq, Lkv, dtype, mask, seed):
    """A FlashAttention-suite case for ``check_forward``/``check_backward``: G = 2, D = 32,
    automatic chunking, default scale, the given mask options."""
    opts = dict(dict(num_chunks_q=None, num_chunks_kv=None, scale=None, window=None), **mask)
    return dict(shape=(2, Lq, Lkv, 32), options=opts, dtype=dtype, seed=seed)


def suite_parametrize(seqlens):
    """Parametrize a test over ``(Lq, Lkv)`` pairs x dtypes x (causal, full, window) masks."""
    def decorate(test):
        masks = pytest.mark.parametrize(
            "mask", [dict(causal=True), dict(causal=False), dict(causal=False, window=(48, 16))],
            ids=["causal", "full", "window"])
        dtypes = pytest.mark.parametrize("dtype", ["float16", "float32"])
        return pytest.mark.parametrize("Lq,Lkv", seqlens)(dtypes(masks(test)))
    return decorate
