"""pf.apply_rotary and pf.rotary_tables: against Hugging Face's Llama (half-split,
``rotate_half``) and GPT-J (interleaved, ``rotate_every_two``) rotary code, forward and gradient
(``popxl.transforms.autodiff`` of plain PopXL ops), with static and run-time positions and
partial rotary dims; build-time errors. The Hugging Face checks skip without ``transformers``
(the ``hf`` extra); a float64 host rotation checks the same cases everywhere.
"""
import re

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import build_only, zeros_variable
from popxl_flash import popxl
from popxl_flash.checks import harness
from test_kvcache_layouts import rotate_host

ops = popxl.ops

try:
    import torch
    from transformers.models.gptj import modeling_gptj
    from transformers.models.llama import modeling_llama
    HF_REASON = None
except ImportError as error:  # the hf extra is not installed
    HF_REASON = f"transformers is not installed ({error}); pip install -e '.[hf]'"
needs_hf = pytest.mark.skipif(HF_REASON is not None, reason=HF_REASON or "")


def run_rotary(x, cos, sin, dy, *, interleaved, positions=None):
    """``(y, dx)``: apply_rotary and the gradient of ``sum(y * dy)`` by PopXL's autodiff."""
    pos = [] if not isinstance(positions, np.ndarray) else [positions]

    def build(x_t, cos_t, sin_t, dy_t, *pos_t):
        ir = popxl.gcg().ir

        def fn(x_t, cos_t, sin_t, *pos_t):
            p = pos_t[0] if pos_t else positions
            return pf.apply_rotary(x_t, cos_t, sin_t, interleaved=interleaved, positions=p)
        graph = ir.create_graph(fn, x_t, cos_t, sin_t, *pos_t)
        info = popxl.transforms.autodiff(graph, grads_required=[graph.inputs[0]])
        call = ops.call_with_info(graph, x_t, cos_t, sin_t, *pos_t)
        y = call.outputs[0]  # autodiff appended the stashed values
        (dx,) = ops.call(info.graph, dy_t, inputs_dict=info.inputs_dict(call))
        return [y, dx]
    return harness.run_graph(lambda *ts: build(*ts), [x, cos, sin, dy] + pos).outputs


def inverse_host(dy, cos, sin, positions, interleaved):
    """The gradient of a rotation is the rotation by ``-angle``."""
    return rotate_host(dy, cos, -sin, positions, interleaved)


CASES = [dict(interleaved=False, rotary_dim=16), dict(interleaved=True, rotary_dim=16),
         dict(interleaved=False, rotary_dim=8), dict(interleaved=True, rotary_dim=4)]


@pytest.mark.parametrize("case", CASES, ids=["half", "interleaved", "half-partial",
                                             "interleaved-partial"])
@pytest.mark.parametrize("positions", [None, 3, "tensor"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_matches_host_rotation_forward_and_gradient(case, positions, dtype):
    B, L, H, D = 2, 6, 3, 16
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, H, D)).astype(dtype)
    dy = rng.standard_normal((B, L, H, D)).astype(dtype)
    cos, sin = pf.rotary_tables(12, case["rotary_dim"])
    if positions == "tensor":
        positions = rng.integers(0, 12, size=(B, L)).astype(np.int32)
        host_pos = positions
    else:
        host_pos = np.broadcast_to(np.arange(L) + (positions or 0), (B, L))
    y, dx = run_rotary(x, cos, sin, dy, interleaved=case["interleaved"], positions=positions)
    want = rotate_host(x, cos, sin, host_pos, case["interleaved"])
    dwant = inverse_host(dy, cos, sin, host_pos, case["interleaved"])
    assert y.dtype == np.dtype(dtype) and dx.dtype == np.dtype(dtype)
    # float32: one rotation in float32 (two products and a sum); float16: that, then one
    # rounding to float16 (half an ulp of values up to ~4).
    tol = 1e-6 if dtype == "float32" else 2.0 ** -8
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(dx, dwant, rtol=tol, atol=tol)


def hf_llama_tables(L, D):
    config = modeling_llama.LlamaConfig(hidden_size=D * 2, num_attention_heads=2,
                                        max_position_embeddings=64)
    rope = modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, L, D)
    cos, sin = rope(x, torch.arange(L)[None])
    return cos, sin  # [1, L, D]: the half table twice


@needs_hf
@pytest.mark.parametrize("positions", [None, 5])
def test_half_split_matches_hugging_face_llama(positions):
    """pf.rotary_tables(base=10000) equals LlamaRotaryEmbedding's cos/sin (first half of its
    duplicated table), and apply_rotary(interleaved=False) equals apply_rotary_pos_emb on q and
    k, forward and gradient (torch autograd), float32."""
    B, L, H, D = 2, 7, 2, 16
    offset = positions or 0
    cos_t, sin_t = hf_llama_tables(L + offset, D)
    cos, sin = pf.rotary_tables(L + offset, D)
    np.testing.assert_allclose(cos, cos_t[0, :, :D // 2].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sin, sin_t[0, :, :D // 2].numpy(), rtol=1e-6, atol=1e-6)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, L, H, D)).astype(np.float32)
    dy = rng.standard_normal((B, L, H, D)).astype(np.float32)
    xt = torch.tensor(x.transpose(0, 2, 1, 3), requires_grad=True)  # HF: [B, H, L, D]
    c, s = cos_t[:, offset:], sin_t[:, offset:]
    yt, _ = modeling_llama.apply_rotary_pos_emb(xt, xt.detach(), c, s)
    yt.backward(torch.tensor(dy.transpose(0, 2, 1, 3)))
    y, dx = run_rotary(x, cos, sin, dy, interleaved=False, positions=positions)
    np.testing.assert_allclose(y, yt.detach().numpy().transpose(0, 2, 1, 3), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(dx, xt.grad.numpy().transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-5)


@needs_hf
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_interleaved_matches_hugging_face_gptj(rotary_dim):
    """GPT-J's create_sinusoidal_positions table and apply_rotary_pos_emb (rotate_every_two on
    the first rotary_dim dims, as GPTJAttention does) against apply_rotary(interleaved=True),
    forward and gradient, float32, at run-time positions."""
    B, L, H, D = 2, 6, 2, 16
    table = modeling_gptj.create_sinusoidal_positions(32, rotary_dim)  # [32, R]: sin | cos
    sin_t, cos_t = torch.split(table, rotary_dim // 2, dim=-1)
    cos, sin = pf.rotary_tables(32, rotary_dim)
    np.testing.assert_allclose(cos, cos_t.numpy(), rtol=1e-6, atol=1e-6)
    rng = np.random.default_rng(3)
    positions = rng.integers(0, 32, size=(B, L)).astype(np.int32)
    x = rng.standard_normal((B, L, H, D)).astype(np.float32)
    dy = rng.standard_normal((B, L, H, D)).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    pos = torch.tensor(positions, dtype=torch.long)
    rot = modeling_gptj.apply_rotary_pos_emb(xt[..., :rotary_dim], sin_t[pos], cos_t[pos])
    yt = torch.cat([rot, xt[..., rotary_dim:]], dim=-1)
    yt.backward(torch.tensor(dy))
    y, dx = run_rotary(x, cos, sin, dy, interleaved=True, positions=positions)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-5, atol=1e-5)


BAD = [
    (dict(x=(2, 4, 8)), ValueError, "x must have rank 4 [B, L, H, D]"),
    (dict(x_dtype=np.int32), TypeError, "x must be float16 or float32, got dtype int32"),
    (dict(cos=(8,)), ValueError, "cos must have rank 2 [Lro, rotary_dim / 2], got shape (8,)"),
    (dict(cos=(8, 5), sin=(8, 5)), ValueError,
     "cos has 5 columns: rotary_dim = 10 must be at most the head dim D=8"),
    (dict(sin=(8, 3)), ValueError, "sin must have the shape of cos (8, 4), got sin shape (8, 3)"),
    (dict(positions=6), ValueError,
     "positions=6 with L=4 rows reads table rows up to 9, but cos/sin have Lro=8 rows"),
    (dict(positions=-1), ValueError, "positions must be >= 0, got positions=-1"),
    (dict(positions=((4, 2), np.int32)), ValueError,
     "positions must have shape [L=4] or [B=2, L=4], got shape (4, 2)"),
    (dict(positions=((4,), np.float32)), TypeError,
     "positions must be an int32 tensor [L=4] or [B=2, L=4], got dtype float32"),
    (dict(interleaved="no"), TypeError, "interleaved must be a bool"),
]


@pytest.mark.parametrize("override, exc, fragment", BAD)
def test_bad_input_is_a_build_time_error(override, exc, fragment):
    o = dict(override)

    def fn():
        x = zeros_variable(o.pop("x", (2, 4, 3, 8)), o.pop("x_dtype", np.float32))
        cos = zeros_variable(o.pop("cos", (8, 4)))
        sin = zeros_variable(o.pop("sin", (8, 4)))
        if isinstance(o.get("positions"), tuple):
            o["positions"] = zeros_variable(*o["positions"])
        return pf.apply_rotary(x, cos, sin, **o)
    with pytest.raises(exc, match=re.escape(fragment)):
        build_only(fn)
