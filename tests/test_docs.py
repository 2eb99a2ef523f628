"""The docs are part of the feature: their complete code examples run, and every public
function's docstring names each of its parameters."""
import inspect
import pathlib
import re

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import (EPS32, assert_within_rule, naive_attention,
                             naive_attention_grad)
from popxl_flash import popxl
from popxl_flash.plan.config import AttentionConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "user-guide.md", ROOT / "docs" / "porting.md"]


MARKER = "<!-- runnable: tests/test_docs.py executes this block -->"


def complete_examples():
    """Python blocks marked runnable (whole programs; fragments and SDK-only sketches are not)."""
    for path in DOCS:
        blocks = re.findall(re.escape(MARKER) + r"\n```python\n(.*?)```", path.read_text(),
                            flags=re.S)
        for n, code in enumerate(blocks):
            yield pytest.param(code, id=f"{path.name}-{n}")


EXAMPLES = list(complete_examples())


def test_docs_have_runnable_examples():
    assert len(EXAMPLES) >= 3


def _forward_rule(name, out, q, k, v, *, chunks=None, **opts):
    """``out`` (from flash attention on host ``q, k, v [G, L, D]``) within the forward rule:
    2x the error of a naive same-precision attention against float64, plus the floor."""
    ref, _ = pf.reference.attention(q, k, v, **opts)
    segments = {n: t for n, t in opts.items() if n not in ("causal", "scale", "window")}
    naive, _ = naive_attention(q, k, v, causal=opts["causal"], scale=None, window=None,
                               **segments)
    if chunks is None:
        cfg = AttentionConfig.from_shapes(q.shape, k.shape, v.shape, (q.dtype.name,) * 3,
                                          causal=opts["causal"])
        chunks = (cfg.num_chunks_kv, cfg.chunk_kv)
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert_within_rule(name, out, naive, ref, factor=2, dtype=q.dtype.name,
                       accum_steps=sum(chunks) + q.shape[-1], magnitude=float(np.abs(v).max()))


def _host_qkv(ns):
    """The example's host q, k, v (the values of its ``data`` dict, in stream order)."""
    return list(ns["data"].values())


def check_usage(ns):
    """README usage: causal out [G, L, D] float16 from three host streams."""
    assert ns["result"].dtype == np.float16
    _forward_rule("out", ns["result"], *_host_qkv(ns), causal=True)


def check_flash_attn_func(ns):
    """flash_attn_func example: [B, L, H, D] out, causal, flash-attn's layout."""
    to_groups = ns["to_groups"]
    assert ns["result"].shape == ns["out"].shape == (ns["B"], ns["L"], ns["H"], ns["D"])
    _forward_rule("out", to_groups(ns["result"]), *(to_groups(x) for x in _host_qkv(ns)),
                  causal=True)


def check_training_loop(ns):
    """autodiff training example: it asserts its own loss falls; the losses are finite."""
    assert len(ns["losses"]) == 3 and np.isfinite(ns["losses"]).all()


def check_by_hand_step(ns):
    """The by-hand sketch: one run updates each weight by ``-lr`` times its gradient of
    ``sum(y * dy)``, within 3x the error of the same step with naive float32 attention against
    float64 (the floor adds the float32 rounding of the updated weight, divided by lr)."""
    B, L, E, H, D, G, lr = (ns[n] for n in ("B", "L", "E", "H", "D", "G", "lr"))
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((B, L, E)).astype(np.float32) for _ in range(2))
    with popxl.Session(ns["ir"], "ipu_model") as session:
        w0 = [session.get_tensor_data(ns[n]).copy() for n in ("w_qkv", "w_out")]
        y = session.run({ns["x_in"]: x, ns["dy_in"]: dy})[ns["y_out"]]
        w1 = [session.get_tensor_data(ns[n]) for n in ("w_qkv", "w_out")]
    got = [(a.astype(np.float64) - b) / lr for a, b in zip(w0, w1)]

    def heads(t, n):  # numpy to_heads
        return t.reshape(B, L, n, H, D).transpose(2, 0, 3, 1, 4).reshape(n, G, L, D)

    def unheads(t, n):
        return t.reshape(n, B, H, L, D).transpose(1, 3, 0, 2, 4).reshape(B, L, n * E)

    def step(dt, attention, attention_grad):
        xs, dys, (wq, wo) = x.astype(dt), dy.astype(dt), (w.astype(dt) for w in w0)
        qkv = heads(xs @ wq, 3)
        out, _ = attention(*qkv)
        h = unheads(out[None], 1)
        dout = heads(dys @ wo.T, 1)[0]
        dqkv = np.stack(attention_grad(dout, *qkv))
        return h @ wo, [(xs.transpose(0, 2, 1) @ unheads(dqkv, 3)).sum(0),
                        (h.transpose(0, 2, 1) @ dys).sum(0)]
    y_ref, ref = step(np.float64, lambda *t: pf.reference.attention(*t, causal=True),
                      lambda *t: pf.reference.attention_grad(*t, causal=True))
    opts = dict(causal=True, scale=None, window=None)
    y_naive, naive = step(np.float32, lambda *t: naive_attention(*t, **opts),
                          lambda *t: naive_attention_grad(*t, **opts))
    cfg = AttentionConfig.from_shapes((G, L, D), (G, L, D), (G, L, D), ("float32",) * 3,
                                      causal=True)
    steps = cfg.num_chunks_kv + cfg.chunk_kv + D
    assert_within_rule("y", y, y_naive, y_ref, factor=2, dtype="float32", accum_steps=steps + E,
                       magnitude=float(np.abs(y_ref).max()))
    for name, g, n, r, w in zip(("dw_qkv", "dw_out"), got, naive, ref, w0):
        assert_within_rule(name, g, n, r, factor=3, dtype="float32",
                           accum_steps=steps + B * L, magnitude=float(np.abs(r).max()),
                           extra_floor=2 * EPS32 * float(np.abs(w).max()) / lr)


def check_complete(ns):
    """Complete example: causal out [G, L, D] float16."""
    assert ns["result"].shape == (ns["G"], ns["L"], ns["D"])
    _forward_rule("out", ns["result"], *_host_qkv(ns), causal=True)


def check_explain(ns):
    """pf.explain example: it asserts the chosen chunking itself."""
    assert ns["choice"].chosen in ns["choice"].candidates


def check_varlen(ns):
    """varlen example: every sequence attends only to itself, padding rows are exactly 0."""
    cu, total = ns["cu"], ns["total"]
    q, k, v = (x.transpose(1, 0, 2) for x in _host_qkv(ns))  # [H, total, D]
    ids, pos = pf.reference.varlen_segments(cu, total)
    out = ns["result"].transpose(1, 0, 2)
    H, _, D = q.shape  # the automatic chunks: the packed choice for max_seqlen 40
    chosen = pf.explain(total, total, head_dim=D, groups=H, dtype=q.dtype.name, causal=True,
                        max_seqlen=40).chosen
    _forward_rule("out", out, q, k, v, chunks=(chosen.num_chunks_kv, chosen.chunk_kv), causal=True,
                  q_segment_ids=ids, kv_segment_ids=ids, q_positions=pos, kv_positions=pos)
    ref, _ = pf.reference.attention_varlen(q, k, v, cu, cu, causal=True)
    assert (out[:, cu[-1]:] == 0).all() and (ref[:, cu[-1]:] == 0).all()


def check_kvcache_decode(ns):
    """kv-cache decode step: one row appended per batch row (cache_seqlens + 1, k written at row
    cache_seqlens[b]); out of batch row b is attention of its query over the cache rows
    ``[0, cache_seqlens[b]]`` (zeros, then the new row), grouped-query, under the 2x rule."""
    B, Hq, Hkv, D = (ns[n] for n in ("B", "Hq", "Hkv", "D"))
    lens0 = np.array([10, 37])
    np.testing.assert_array_equal(ns["lens_after"], lens0 + 1)
    q, k, v = (ns["data"][s] for s in ns["streams"])  # [B, 1, H, D]
    for b in range(B):
        np.testing.assert_array_equal(ns["k_after"][b, lens0[b]], k[b, 0])
        kb, vb = (np.concatenate([np.zeros((lens0[b], Hkv, D), np.float16), x[b]])
                  .transpose(1, 0, 2) for x in (k, v))  # [Hkv, len + 1, D]
        qb = q[b].transpose(1, 0, 2)  # [Hq, 1, D]
        n = lens0[b] + 1
        _forward_rule("out", ns["result"][b].transpose(1, 0, 2), qb, kb, vb,
                      chunks=(1, n), causal=True)


def check_score_mods(ns):
    """Score-modifier example: out1 (relative-bias table) and out2 (temperature, softcap, ALiBi,
    dropout with the returned keep mask) under the 2x rule against the float64 reference."""
    q, k, v = _host_qkv(ns)
    L, table, t3 = ns["L"], ns["table_data"], ns["temps_data"].reshape(-1, 1, 1)
    _forward_rule("out1", ns["result"]["out1"], q, k, v, causal=True,
                  score_mod=lambda s, g, i, j: s + table[i - j + (L - 1)])
    keep = ns["result"]["keep"]
    assert keep.shape == (ns["G"], L, L) and abs(keep.mean() - 0.9) < 0.03
    _forward_rule("out2", ns["result"]["out2"], q, k, v, causal=True, softcap=30.0,
                  alibi_slopes=ns["slopes_data"], score_mod=lambda s, g, i, j: s * t3,
                  keep=keep, dropout=0.1)
    assert np.isfinite(ns["result"]["dq"]).all()


def check_context_parallel(ns):
    """Context-parallel example: the unsharded out over 4 replicas is causal attention on the
    whole sequence (grouped-query K/V, 4 gather rounds) under the 2x rule."""
    L, R = ns["L"], ns["R"]
    _forward_rule("out", ns["out_host"], ns["q_host"], ns["k_host"], ns["v_host"],
                  chunks=(4 * R * 2, L // (R * 2)), causal=True)


#: What each runnable example computes, checked after it ran (by example id, in file order).
CHECKS = {"README.md-0": check_usage, "user-guide.md-0": check_flash_attn_func,
          "user-guide.md-1": check_complete, "user-guide.md-2": check_training_loop,
          "user-guide.md-3": check_by_hand_step, "user-guide.md-4": check_explain,
          "user-guide.md-5": check_varlen, "user-guide.md-6": check_score_mods,
          "user-guide.md-7": check_kvcache_decode, "user-guide.md-8": check_context_parallel}


def test_every_runnable_example_has_a_check():
    assert sorted(p.id for p in EXAMPLES) == sorted(CHECKS)


@pytest.mark.parametrize("code", EXAMPLES)
def test_doc_example_runs(code, request):
    namespace = {"__name__": "doc_example"}
    exec(compile(code, "<doc example>", "exec"), namespace)
    CHECKS[request.node.callspec.id](namespace)


PUBLIC_FUNCTIONS = [pf.flash_attention, pf.flash_attention_qkv_packed, pf.flash_attention_grad,
                    pf.flash_attention_qkv_packed_grad, pf.flash_attn_func,
                    pf.flash_attn_func_grad, pf.reference.attention,
                    pf.reference.attention_grad, pf.plan, pf.called_graphs_grad_info,
                    pf.autodiff, pf.flash_attn_varlen_func, pf.reference.attention_varlen,
                    pf.reference.attention_varlen_grad, pf.reference.mask, pf.reachable_graphs,
                    pf.reference.is_packing,
                    pf.reference.varlen_segments]


@pytest.mark.parametrize("fn", PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_docstring_names_every_parameter(fn):
    doc = inspect.getdoc(fn)
    missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"\b{p}\b", doc)]
    assert not missing, f"{fn.__name__} docstring does not mention {missing}"


def _signature_blocks(text):
    """``{function name: the parameter names its user-guide signature block lists}`` (the first
    block that is one ``x = pf.name(...)`` call: the section's signature)."""
    blocks = {}
    for m in re.finditer(r"```python\n[^\n=`]+? = pf\.(\w+)\(((?:(?!```).)*?)\)\n```", text, re.S):
        names = re.findall(r"(?:^|,)\s*\**(\w+)", m.group(2).replace("\n", " "))
        blocks.setdefault(m.group(1), names)
    return blocks


SIGNATURE_FUNCTIONS = ["flash_attention", "flash_attention_qkv_packed", "flash_attention_grad",
                       "flash_attention_qkv_packed_grad", "flash_attn_func",
                       "flash_attn_func_grad", "flash_attn_varlen_func",
                       "flash_attn_with_kvcache"]


@pytest.mark.parametrize("name", SIGNATURE_FUNCTIONS)
def test_user_guide_signature_blocks_list_every_parameter(name):
    """Each signature block in docs/user-guide.md lists the function's parameters, in order
    (memory_budget= and deterministic= were once missing)."""
    blocks = _signature_blocks((ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8"))
    fn = inspect.unwrap(getattr(pf, name))
    assert blocks.get(name) == list(inspect.signature(fn).parameters), name


def test_install_commands_match_ci():
    """The README and the user guide install the extras .ci/run installs."""
    ci = re.search(r'pip install -e "(\.\[[^"]*\])"',
                   (ROOT / ".ci" / "run").read_text(encoding="utf-8")).group(1)
    for doc in (ROOT / "README.md", ROOT / "docs" / "user-guide.md"):
        installs = re.findall(r'pip install -e "(\.\[[^"]*\])" && python -m pytest',
                              doc.read_text(encoding="utf-8"))
        assert installs == [ci], doc.name
