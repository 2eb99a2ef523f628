"""Optional cross-check against PyTorch (skipped unless torch is installed: the project does not
depend on it). Mirrors FlashAttention's test rule: flash's error against a float64 reference is at
most 2x (forward) / 3x (backward) the error of PyTorch attention in the same precision, plus the
rounding floor of attention_utils."""
import numpy as np
import pytest

import popxl_flash as pf

from attention_utils import EPS32, random_qkv, rounding_floor, run_flash, run_flash_grad

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
