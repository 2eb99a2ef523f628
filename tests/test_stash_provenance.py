"""A stash-mode backward refuses other run-time tensors than its forward's (ALiBi slopes, dropout
seed, score_mod_inputs, segment ids) in every _grad entry point, naming the argument in the
called API's names; score_mod tracing errors say how tensors reach a score_mod.
"""
import re

import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import build_only, run_graph
from popxl_flash import popxl
from popxl_flash.api import context_parallel as cp

ops = popxl.ops


def _var(shape, dtype=np.float32, value=0):
    return popxl.variable(np.full(shape, value, dtype))


def _table_mod(score, g, q_idx, kv_idx, table):
    return score + ops.gather(table, g)


def _kv_bias(score, g, q_idx, kv_idx, table):
    return score + ops.gather(table, kv_idx, zero_OOR=True)


def _modifiers(name, first):
    """Modifier keywords of the core API whose run-time tensor is new each call."""
    if name == "alibi_slopes":
        return dict(alibi_slopes=_var((2,), value=0.5))
    if name == "seed":
        return dict(dropout=0.2, seed=_var((2,), np.uint32, 7))
    if name == "score_mod_inputs[0]":
        return dict(score_mod=_table_mod, score_mod_inputs=(_var((2,)),))
    return dict(q_segment_ids=_var((1, 8), np.int32), kv_segment_ids=_var((1, 8), np.int32))


ARGS = ["alibi_slopes", "seed", "score_mod_inputs[0]", "q_segment_ids"]


@pytest.mark.parametrize("arg", ARGS)
def test_flash_attention_grad_refuses_other_runtime_tensors(arg):
    def fn():
        q = _var((2, 8, 4))
        fwd, bwd = _modifiers(arg, True), _modifiers(arg, False)
        out, lse = pf.flash_attention(q, q, q, return_lse=True, **fwd)
        pf.flash_attention_grad(q, q, q, q, out, lse, **fwd)  # its own tensors: accepted
        pf.flash_attention_grad(q, q, q, q, out, lse, **bwd)
    with pytest.raises(ValueError, match=re.escape(f"{arg}=") + ".* is not the tensor out was "
                       "computed with: flash_attention was given"):
        build_only(fn)


def test_flash_attention_grad_refuses_a_missing_runtime_tensor():
    """A score_mod with one input in the forward, none given to the backward: the options
    differ already (score_mod_inputs count); with dropout the seed is named."""
    def fn():
        q = _var((2, 8, 4))
        seed = _var((2,), np.uint32, 7)
        out, lse = pf.flash_attention(q, q, q, return_lse=True, dropout=0.2, seed=seed,
                                      alibi_slopes=_var((2,)))
        pf.flash_attention_grad(q, q, q, q, out, lse, dropout=0.2, seed=seed,
                                alibi_slopes=_var((2,)))
    with pytest.raises(ValueError, match=r"alibi_slopes=\S+ is not the tensor"):
        build_only(fn)


@pytest.mark.parametrize("arg", ["alibi_slopes", "seed", "score_mod_inputs[0]"])
def test_qkv_packed_grad_refuses_other_runtime_tensors(arg):
    def fn():
        qkv = _var((3, 2, 8, 4))
        fwd, bwd = _modifiers(arg, True), _modifiers(arg, False)
        out, lse = pf.flash_attention_qkv_packed(qkv, return_lse=True, **fwd)
        pf.flash_attention_qkv_packed_grad(out, qkv, out, lse, **fwd)
        pf.flash_attention_qkv_packed_grad(out, qkv, out, lse, **bwd)
    with pytest.raises(ValueError, match=re.escape(f"{arg}=") + ".*flash_attention_qkv_packed "
                       "was given.*pass flash_attention_qkv_packed_grad"):
        build_only(fn)


def _attn_modifiers(name):
    if name == "alibi_slopes":
        return dict(alibi_slopes=_var((2,), value=0.5))  # [Hq]: laid out per group inside
    if name == "seed":
        return dict(dropout_p=0.2, seed=_var((2,), np.uint32, 7))
    return dict(score_mod=_table_mod, score_mod_inputs=(_var((2,)),))


@pytest.mark.parametrize("arg", ["alibi_slopes", "seed", "score_mod_inputs[0]"])
def test_flash_attn_func_grad_refuses_other_runtime_tensors(arg):
    def fn():
        q = _var((1, 8, 2, 4))
        fwd, bwd = _attn_modifiers(arg), _attn_modifiers(arg)
        out, lse = pf.flash_attn_func(q, q, q, return_lse=True, **fwd)
        pf.flash_attn_func_grad(q, q, q, q, out, lse, **fwd)  # the user's own slopes: accepted
        pf.flash_attn_func_grad(q, q, q, q, out, lse, **bwd)
    with pytest.raises(ValueError, match=re.escape(f"{arg}=") + ".*flash_attn_func was given"):
        build_only(fn)


def test_flash_attn_func_grad_option_mismatch_speaks_flash_attn_names():
    def fn():
        q = _var((1, 8, 2, 4))
        seed = _var((2,), np.uint32)
        out, lse = pf.flash_attn_func(q, q, q, return_lse=True, softmax_scale=0.25,
                                      window_size=(3, 0), dropout_p=0.1, seed=seed)
        pf.flash_attn_func_grad(q, q, q, q, out, lse, dropout_p=0.1, seed=seed)
    with pytest.raises(ValueError) as err:
        build_only(fn)
    message = str(err.value)
    assert "produced by flash_attn_func" in message
    assert "softmax_scale=0.25" in message and "window_size=(3, 0)" in message
    assert "dropout_p=0.1" in message
    assert not re.search(r"\bscale=|\bwindow=|\bdropout=|ScoreMods\(", message), message


def test_varlen_stash_given_to_flash_attention_grad_is_refused():
    def fn():
        q = _var((8, 2, 4))
        cu = popxl.variable(np.array([0, 3, 8], np.int32))
        out, lse = pf.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, return_lse=True)
        g = _var((2, 8, 4))
        ids = dict(q_segment_ids=_var((1, 8), np.int32), kv_segment_ids=_var((1, 8), np.int32))
        pf.flash_attention_grad(g, g, g, g, g, lse, causal=False, **ids)
    with pytest.raises(ValueError, match="lse was computed by flash_attn_varlen_func with "
                                         "cu_seqlens_q="):
        build_only(fn)


@pytest.mark.parametrize("arg", ["alibi_slopes", "seed", "score_mod_inputs[0]"])
def test_context_parallel_grad_refuses_other_runtime_tensors(arg):
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        q = _var((2, 8, 4))
        fwd, bwd = _modifiers(arg, True), _modifiers(arg, False)
        out, lse = cp.context_parallel_attention(q, q, q, return_lse=True, **fwd)
        cp.context_parallel_attention_grad(q, q, q, q, out, lse, **fwd)
        with pytest.raises(ValueError, match=re.escape(f"{arg}=") + ".*is not the tensor out "
                           "was computed with: context_parallel_attention was given"):
            cp.context_parallel_attention_grad(q, q, q, q, out, lse, **bwd)


@pytest.mark.parametrize("arg", ["alibi_slopes", "seed", "score_mod_inputs[0]"])
def test_refused_tensors_would_have_given_wrong_gradients(arg):
    """What the refusal prevents: the backward with the other tensor's values is far from the
    one with the forward's (so accepting it would have been a silently wrong result)."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((2, 8, 4)).astype(np.float32) for _ in range(4))
    host = {"alibi_slopes": [np.array([0.5, 0.25], np.float32), np.array([2.0, 1.0], np.float32)],
            "seed": [np.array([1, 2], np.uint32), np.array([3, 4], np.uint32)],
            "score_mod_inputs[0]": [rng.standard_normal(8).astype(np.float32),
                                    rng.standard_normal(8).astype(np.float32)]}[arg]

    def mods(t):
        return {"alibi_slopes": dict(alibi_slopes=t), "seed": dict(dropout=0.3, seed=t),
                "score_mod_inputs[0]": dict(score_mod=_kv_bias, score_mod_inputs=(t,))}[arg]

    def build(q, k, v, do, a, b):
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **mods(a))
        right = pf.flash_attention_grad(do, q, k, v, **mods(a))  # recompute: its own tensors
        wrong = pf.flash_attention_grad(do, q, k, v, **mods(b))
        return [*right, *wrong]
    grads, _ = run_graph(build, [q, k, v, dout, *host])
    for r, w in zip(grads[:3], grads[3:]):
        assert np.abs(r - w).max() > 0.05 * np.abs(r).max()


# -- score_mod tracing errors -----------------------------------------------------------------
def test_score_mod_closure_over_an_outer_tensor_names_score_mod_inputs():
    def fn():
        q = _var((2, 8, 4))
        bias = _var((1,))

        def mod(score, g, q_idx, kv_idx):
            return score + bias
        pf.flash_attention(q, q, q, score_mod=mod)
    with pytest.raises(ValueError, match="score_mod failed while its graph was traced.*pass "
                                         "every tensor it uses through score_mod_inputs") as err:
        build_only(fn)
    assert "is not in the current Graph" in str(err.value.__cause__)


@pytest.mark.parametrize("entry", ["flash_attn_func", "explain", "context_parallel"])
def test_any_score_mod_failure_is_a_value_error_naming_score_mod_inputs(entry):
    def broken(score, g, q_idx, kv_idx):
        raise KeyError("no such table")

    def fn():
        if entry == "flash_attn_func":
            q = _var((1, 8, 2, 4))
            pf.flash_attn_func(q, q, q, score_mod=broken)
        elif entry == "explain":
            pf.explain(8, 8, head_dim=4, groups=2, score_mod=broken)
        else:
            q = _var((2, 8, 4))
            cp.context_parallel_attention(q, q, q, score_mod=broken)
    with pytest.raises(ValueError, match="score_mod_inputs") as err:
        if entry == "context_parallel":
            ir = popxl.Ir(replication=2)
            with ir.main_graph:
                fn()
        elif entry == "explain":
            fn()
        else:
            build_only(fn)
    assert isinstance(err.value.__cause__, KeyError)


def test_score_mod_inputs_as_a_list_equals_a_tuple_and_other_types_are_refused():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 8, 4)).astype(np.float32)
    table = np.array([0.5, -1.0], np.float32)

    def build(q, t):
        return [pf.flash_attention(q, q, q, score_mod=_table_mod, score_mod_inputs=[t]),
                pf.flash_attention(q, q, q, score_mod=_table_mod, score_mod_inputs=(t,))]
    (a, b), _ = run_graph(build, [q, table])
    np.testing.assert_array_equal(a, b)
    for bad in ({"t": 1}, "table", 3):
        def fn():
            x = _var((2, 8, 4))
            pf.flash_attention(x, x, x, score_mod=_table_mod, score_mod_inputs=bad)
        with pytest.raises(TypeError, match="score_mod_inputs must be a tuple"):
            build_only(fn)
