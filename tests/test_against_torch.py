"""Optional cross-check against PyTorch (skipped unless torch is installed: the project does not
depend on it). Mirrors FlashAttention's test rule: flash's error against a float64 reference is at
most 2x (forward) / 3x (backward) the error of PyTorch attention in the same precision, plus the
rounding floor of attention_utils."""
import numpy as np
import pytest

import popxl_flash as pf

from popxl_flash import popxl

from attention_utils import (EPS32, random_qkv, rounding_floor, run_flash, run_flash_grad,
                             run_graph)

torch = pytest.importorskip("torch")

SEQLENS = [(113, 203), (128, 217), (108, 256), (512, 256), (1023, 1024)]


def torch_attention(q, k, v, *, causal, window, upcast):
    """PyTorch attention with autograd; ``upcast`` computes in float64 (the reference)."""
    dt = torch.float64 if upcast else {"float16": torch.float16, "float32": torch.float32}[
        q.dtype.name]
    q, k, v = (torch.tensor(a.astype(np.float64)).to(dt).requires_grad_() for a in (q, k, v))
    visible = torch.tensor(pf.reference.visibility(q.shape[1], k.shape[1], causal=causal,
                                                   window=window))
    s = (q @ k.transpose(1, 2)) * (1.0 / q.shape[-1] ** 0.5)
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s.float() if dt == torch.float16 else s, dim=-1).to(dt)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see nothing: 0, as FlashAttention's reference
    return p @ v, (q, k, v)


@pytest.mark.parametrize("Lq,Lkv", SEQLENS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("mask", [dict(causal=True, window=None),
                                  dict(causal=False, window=None),
                                  dict(causal=False, window=(48, 16))],
                         ids=["causal", "full", "window"])
def test_matches_pytorch(Lq, Lkv, dtype, mask):
    rng = np.random.default_rng(Lq + 7 * Lkv)
    q, k, v = random_qkv(rng, 2, Lq, Lkv, 32, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, _, _ = run_flash(q, k, v, **mask)
    grads, _ = run_flash_grad(dout, q, k, v, **mask)
    ref, ref_in = torch_attention(q, k, v, upcast=True, **mask)
    pt, pt_in = torch_attention(q, k, v, upcast=False, **mask)
    for o in (ref, pt):
        o.backward(torch.tensor(dout.astype(np.float64)).to(o.dtype))
    ref_np = ref.detach().numpy()
    steps = 4 * (Lkv + 32)  # accumulation floor, see attention_utils
    floor = rounding_floor(ref_np, dtype) + steps * EPS32 * float(np.abs(v).max())
    pt_err = float(np.abs(pt.detach().double().numpy() - ref_np).max())
    assert np.abs(out.astype(np.float64) - ref_np).max() <= 2 * pt_err + floor
    for g, r, p in zip(grads, ref_in, pt_in):
        r_np = r.grad.numpy()
        g_floor = rounding_floor(r_np, dtype) + steps * EPS32 * float(np.abs(r_np).max())
        p_err = float(np.abs(p.grad.double().numpy() - r_np).max())
        assert np.abs(g.astype(np.float64) - r_np).max() <= 3 * p_err + g_floor


def _sdpa(q, k, v, dout, *, causal, dtype):
    """PyTorch ``scaled_dot_product_attention`` with ``enable_gqa`` on ``[B, L, H, D]`` arrays,
    bottom-right causal (flash-attn's alignment, as an explicit mask); returns
    ``[out, dq, dk, dv]`` in float64, computed in ``dtype``."""
    tq, tk, tv = (torch.tensor(a.astype(np.float64)).to(dtype).transpose(1, 2).requires_grad_()
                  for a in (q, k, v))
    Lq, Lkv = q.shape[1], k.shape[1]
    mask = None
    if causal:
        mask = torch.arange(Lkv)[None, :] <= torch.arange(Lq)[:, None] + (Lkv - Lq)
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                         enable_gqa=True)
    o.backward(torch.tensor(dout.astype(np.float64)).to(dtype).transpose(1, 2))
    return [o.transpose(1, 2).detach().double().numpy()] + [
        t.grad.transpose(1, 2).double().numpy() for t in (tq, tk, tv)]


@pytest.mark.parametrize("B,Lq,Lkv,Hq,Hkv,D,causal,dtype", [
    (2, 64, 64, 8, 2, 32, True, "float32"), (1, 50, 90, 4, 1, 16, False, "float32"),
    (3, 40, 40, 8, 8, 16, True, "float16"), (2, 77, 77, 8, 1, 64, True, "float16"),
    (1, 33, 65, 4, 4, 32, False, "float16")])
def test_flash_attn_func_autodiff_matches_sdpa(B, Lq, Lkv, Hq, Hkv, D, causal, dtype):
    """``pf.flash_attn_func`` (GQA/MQA included) differentiated by ``pf.autodiff`` against SDPA
    with ``enable_gqa``: 2x (out) / 3x (gradients) the error of SDPA in the same precision,
    plus the rounding floor and a float32 accumulation floor (see attention_utils)."""
    rng = np.random.default_rng(B + Lq + Hkv)
    q = rng.standard_normal((B, Lq, Hq, D)).astype(dtype)
    k, v = (rng.standard_normal((B, Lkv, Hkv, D)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)

    def build(q, k, v, do):
        graph = popxl.gcg().ir.create_graph(
            lambda q, k, v: pf.flash_attn_func(q, k, v, causal=causal), q, k, v)
        info = pf.autodiff(graph)
        call = popxl.ops.call_with_info(graph, q, k, v)
        grads = popxl.ops.call(info.graph, do, inputs_dict=info.inputs_dict(call))
        return [call.outputs[0], *grads]
    flash, _ = run_graph(build, [q, k, v, dout])
    ref = _sdpa(q, k, v, dout, causal=causal, dtype=torch.float64)
    same = _sdpa(q, k, v, dout, causal=causal,
                 dtype=torch.float16 if dtype == "float16" else torch.float32)
    steps = 4 * (Lkv + D + (Hq // Hkv) * Lq)  # accumulation over keys, D, folded q rows
    for name, x, r, s, factor in zip(("out", "dq", "dk", "dv"), flash, ref, same, (2, 3, 3, 3)):
        floor = rounding_floor(r, dtype) + steps * EPS32 * float(np.abs(r).max())
        bound = factor * float(np.abs(s - r).max()) + floor
        assert np.abs(x.astype(np.float64) - r).max() <= bound, name


@pytest.mark.parametrize("causal,dtype,Hq,Hkv", [(True, "float16", 4, 2), (False, "float32", 2, 2),
                                                 (True, "float32", 4, 1)])
def test_varlen_matches_sdpa_per_sequence(causal, dtype, Hq, Hkv):
    """``pf.flash_attn_varlen_func`` on a packed batch (different q and kv packings, padding
    rows, an empty sequence) differentiated by ``pf.autodiff``, against SDPA run on each sequence
    alone (bottom-right causal, as flash-attn's varlen): 2x / 3x the same-precision SDPA error
    plus the floors; padding rows are exactly 0."""
    lq, lk = [37, 5, 0, 61], [20, 44, 0, 61]
    cu_q, cu_k = np.cumsum([0] + lq).astype(np.int32), np.cumsum([0] + lk).astype(np.int32)
    total_q, total_k, D = cu_q[-1] + 7, cu_k[-1] + 3, 32  # trailing padding rows
    rng = np.random.default_rng(11)
    q = rng.standard_normal((total_q, Hq, D)).astype(dtype)
    k, v = (rng.standard_normal((total_k, Hkv, D)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)

    def build(q, k, v, do, cq, ck):
        graph = popxl.gcg().ir.create_graph(
            lambda q, k, v, cq, ck: pf.flash_attn_varlen_func(
                q, k, v, cq, ck, max(lq), max(lk), causal=causal), q, k, v, cq, ck)
        info = pf.autodiff(graph)
        call = popxl.ops.call_with_info(graph, q, k, v, cq, ck)
        grads = popxl.ops.call(info.graph, do, inputs_dict=info.inputs_dict(call))
        return [call.outputs[0], *grads]
    (out, dq, dk, dv), _ = run_graph(build, [q, k, v, dout, cu_q, cu_k])
    assert (out[cu_q[-1]:] == 0).all() and (dq[cu_q[-1]:] == 0).all()
    assert (dk[cu_k[-1]:] == 0).all() and (dv[cu_k[-1]:] == 0).all()
    low = torch.float16 if dtype == "float16" else torch.float32
    for s in range(len(lq)):
        if lq[s] == 0 or lk[s] == 0:
            continue
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        args = [a[None] for a in (q[rq], k[rk], v[rk], dout[rq])]
        ref = _sdpa(*args, causal=causal, dtype=torch.float64)
        same = _sdpa(*args, causal=causal, dtype=low)
        steps = 4 * (lk[s] + D + (Hq // Hkv) * lq[s])
        got = (out[rq], dq[rq], dk[rk], dv[rk])
        for name, x, r, p, factor in zip(("out", "dq", "dk", "dv"), got, ref, same, (2, 3, 3, 3)):
            r, p = r[0], p[0]
            floor = rounding_floor(r, dtype) + steps * EPS32 * float(np.abs(r).max())
            bound = factor * float(np.abs(p - r).max()) + floor
            assert np.abs(x.astype(np.float64) - r).max() <= bound, (s, name)
