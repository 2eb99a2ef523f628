"""Optional cross-check of softcap, ALiBi, score_mod and dropout against PyTorch autograd (skipped
without torch), with FlashAttention's rule: flash's error against PyTorch in float64 is at most
2x (forward) / 3x (backward) PyTorch's own error in the input precision, plus the rounding and
accumulation floor."""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import popxl

from attention_utils import EPS32, random_qkv, rounding_floor, run_graph
from score_mod_utils import alibi_slopes

torch = pytest.importorskip("torch")
ops = popxl.ops


def torch_attention(q, k, v, *, causal, softcap, slopes, temps, keep, p_drop, upcast):
    """PyTorch attention on ``[G, L, D]`` with the modifiers, with autograd."""
    dt = torch.float64 if upcast else {"float16": torch.float16, "float32": torch.float32}[
        q.dtype.name]
    q, k, v = (torch.tensor(a.astype(np.float64)).to(dt).requires_grad_() for a in (q, k, v))
    G, Lq, Lkv = q.shape[0], q.shape[1], k.shape[1]
    k_rep, v_rep = (x.repeat_interleave(G // x.shape[0], dim=0) for x in (k, v))
    s = (q @ k_rep.transpose(1, 2)) * (1.0 / q.shape[-1] ** 0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        rel = torch.arange(Lq)[:, None] + (Lkv - Lq) - torch.arange(Lkv)[None, :]
        s = s - torch.tensor(slopes, dtype=torch.float64).to(dt)[:, None, None] * rel.abs().to(dt)
    if temps is not None:
        s = s * torch.tensor(temps, dtype=torch.float64).to(dt)[:, None, None]
    visible = torch.tensor(pf.reference.visibility(Lq, Lkv, causal=causal))
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s.float() if dt == torch.float16 else s, dim=-1).to(dt)
    p = torch.nan_to_num(p, nan=0.0)
    if keep is not None:
        p = p * torch.tensor(keep).to(dt) / (1 - p_drop)
    return p @ v_rep, (q, k, v)


def _temperature(score, g, q_idx, kv_idx, temps):
    return score * ops.gather(temps, g)


CASES = {"softcap": dict(softcap=5.0), "alibi": dict(alibi=True), "score_mod": dict(temps=True),
         "dropout": dict(dropout=0.2)}


@pytest.mark.parametrize("feature", list(CASES))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Lq,Lkv", [(45, 61), (61, 45)])
def test_modifiers_match_pytorch(feature, dtype, causal, Lq, Lkv):
    case = CASES[feature]
    rng = np.random.default_rng(Lq + 3 * Lkv)
    G, Gk, D = 4, 2, 16
    q, k, v = random_qkv(rng, G, Lq, Lkv, D, dtype, Gk)
    dout = rng.standard_normal(q.shape).astype(dtype)
    slopes = alibi_slopes(G) if case.get("alibi") else None
    temps = np.array([0.5, 1.0, 1.5, 2.0], np.float32) if case.get("temps") else None
    seed = np.array([9, 99], np.uint32)
    extras = [x for x in (slopes, temps) if x is not None] + [seed]

    def build(q, k, v, do, *xs):
        xs = list(xs)
        mods = dict(softcap=case.get("softcap", 0.0))
        if slopes is not None:
            mods["alibi_slopes"] = xs.pop(0)
        if temps is not None:
            mods.update(score_mod=_temperature, score_mod_inputs=(xs.pop(0),))
        if case.get("dropout"):
            mods.update(dropout=case["dropout"], seed=xs.pop(0))
        opts = dict(causal=causal, num_chunks_q=3, num_chunks_kv=2)
        res = pf.flash_attention(q, k, v, return_lse=True,
                                 return_dropout_mask=bool(case.get("dropout")), **opts, **mods)
        grads = pf.flash_attention_grad(do, q, k, v, res[0], res[1], **opts, **mods)
        return [res[0], *grads] + ([res[2]] if case.get("dropout") else [])
    res, _ = run_graph(build, [q, k, v, dout, *extras], fp_checks=True)
    keep = res[4] if case.get("dropout") else None
    kw = dict(causal=causal, softcap=case.get("softcap", 0.0), slopes=slopes, temps=temps,
              keep=keep, p_drop=case.get("dropout", 0.0))
    ref, ref_in = torch_attention(q, k, v, upcast=True, **kw)
    pt, pt_in = torch_attention(q, k, v, upcast=False, **kw)
    for o in (ref, pt):
        o.backward(torch.tensor(dout.astype(np.float64)).to(o.dtype))
    ref_np = ref.detach().numpy()
    steps = 4 * (Lkv + D)  # accumulation floor, as tests/test_against_torch.py
    boost = 1.0 / (1.0 - case.get("dropout", 0.0))
    floor = rounding_floor(ref_np, dtype) + steps * EPS32 * float(np.abs(v).max()) * boost
    pt_err = float(np.abs(pt.detach().double().numpy() - ref_np).max())
    assert np.abs(res[0].astype(np.float64) - ref_np).max() <= 2 * pt_err + floor
    for g, r, p in zip(res[1:4], ref_in, pt_in):
        r_np = r.grad.numpy()
        g_floor = rounding_floor(r_np, dtype) + steps * EPS32 * float(np.abs(r_np).max())
        p_err = float(np.abs(p.grad.double().numpy() - r_np).max())
        assert np.abs(g.astype(np.float64) - r_np).max() <= 3 * p_err + g_floor
