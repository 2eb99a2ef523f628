"""One graph per configuration and readable names (popxl.name_scope) in the functional API.

Graphs are counted with ``pf.reachable_graphs(ir.main_graph)`` (public ``Graph.called_graphs``,
transitively), so the counts hold on the real SDK too.
"""
import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import run_graph
from popxl_flash import popxl
from test_forward import emulator_only

ops = popxl.ops
G, L, D = 2, 12, 8
#: Chunks with loops (groups of more than one step): a pass of one block is a straight line in
#: the module graph alone, and a group of one step runs inline.
CHUNKS = dict(num_chunks_q=4, num_chunks_kv=4)


def count_graphs(build, n_calls):
    """Graphs reachable after calling ``build(q, k, v, layer)`` ``n_calls`` times."""
    ir = popxl.Ir()
    with ir.main_graph:
        q, k, v = (popxl.variable(np.zeros((G, L, D), np.float32)) for _ in range(3))
        for layer in range(n_calls):
            build(q, k, v, layer)
    return len(pf.reachable_graphs(ir.main_graph))


def forward(q, k, v, layer):
    pf.flash_attention(q, k, v, **CHUNKS)


def forward_backward(q, k, v, layer):
    out, lse = pf.flash_attention(q, k, v, **CHUNKS, return_lse=True)
    pf.flash_attention_grad(out, q, k, v, out, lse, **CHUNKS)


def recompute_backward(q, k, v, layer):
    pf.flash_attention_grad(q, q, k, v, **CHUNKS)


def packed(q, k, v, layer):
    qkv = ops.concat([t.reshape((1, G, L, D)) for t in (q, k, v)], axis=0)
    out, lse = pf.flash_attention_qkv_packed(qkv, return_lse=True)
    pf.flash_attention_qkv_packed_grad(out, qkv, out, lse)


def blhd(q, k, v, layer):
    x = q.reshape((1, L, G, D))
    pf.flash_attn_func(x, x, x, causal=True, **CHUNKS)


def grouped_query(q, k, v, layer):
    """Multi-query attention (k, v of one group) forward and backward."""
    k1, v1 = (ops.slice(t, start=[0], stop=[1], axis=[0]) for t in (k, v))  # [1, L, D]
    out, lse = pf.flash_attention(q, k1, v1, return_lse=True)
    pf.flash_attention_grad(out, q, k1, v1, out, lse)


def segments(q, k, v, layer):
    """Segment ids (new id tensors each call, equal specs) forward and backward."""
    ids = popxl.variable(np.zeros((1, L), np.int32))
    out, lse = pf.flash_attention(q, k, v, return_lse=True, q_segment_ids=ids,
                                  kv_segment_ids=ids)
    pf.flash_attention_grad(out, q, k, v, out, lse, q_segment_ids=ids, kv_segment_ids=ids)


def varlen(q, k, v, layer):
    """flash_attn_varlen_func on [L, G, D] views with its own cu_seqlens each call."""
    cu = popxl.variable(np.array([0, 5, L], np.int32))
    x = q.transpose((1, 0, 2))
    pf.flash_attn_varlen_func(x, x, x, cu, cu, L, L, causal=True)


def layer_graph(q, k, v, layer):
    """A model layer as its own graph (traced anew per layer) that calls flash attention."""
    def body(q, k, v):
        return pf.flash_attention(q, k, v)
    graph = popxl.gcg().ir.create_graph(body, q, k, v)
    ops.call(graph, q, k, v)


@pytest.mark.parametrize("build", [forward, forward_backward, recompute_backward, packed, blhd,
                                   grouped_query, segments, varlen, layer_graph],
                         ids=lambda f: f.__name__)
def test_twelve_calls_build_the_graphs_of_one(build):
    one = count_graphs(build, 1)
    assert one > 1
    twelve = count_graphs(build, 12)
    expected = one + (11 if build is layer_graph else 0)  # the user's 12 layer graphs
    assert twelve == expected


def test_twelve_calls_give_twelve_results():
    """Sharing the graph does not share results: each call site computes its own inputs."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((G, L, D)).astype(np.float32) for _ in range(3)]

    def build(q, k, v):
        outs, x = [], q
        for _ in range(12):
            x = pf.flash_attention(x, k, v, causal=False)
            outs.append(x)
        return outs
    outs, _ = run_graph(build, arrays)
    x = arrays[0]
    for out in outs:
        x, _ = pf.reference.attention(x, arrays[1], arrays[2], causal=False)
        np.testing.assert_allclose(out, x, atol=1e-5)


@pytest.mark.parametrize("other", [
    dict(causal=False), dict(scale=0.5), dict(window=(3, 0)), dict(num_chunks_q=3),
    dict(num_chunks_kv=2),
], ids=lambda o: next(iter(o)))
def test_new_configuration_new_graphs(other):
    def build(q, k, v, layer):
        pf.flash_attention(q, k, v, **{"num_chunks_q": 2, **(other if layer else {})})
    assert count_graphs(build, 2) > count_graphs(build, 1)


def test_equal_configuration_spelt_differently_shares_graphs():
    """Options are compared after validation: None vs the equal explicit chunk count, window
    None vs (-1, -1), scale None vs 1/sqrt(D), NumPy vs Python values."""
    spellings = [
        dict(),
        dict(num_chunks_q=1, num_chunks_kv=1, window=(-1, -1), scale=1 / np.sqrt(D)),
        dict(causal=np.True_, num_chunks_q=np.int64(1), window=np.array([-1, -1]),
             scale=np.float64(1 / np.sqrt(D))),
    ]

    def build(q, k, v, layer):
        pf.flash_attention(q, k, v, **spellings[layer])
    assert count_graphs(build, 3) == count_graphs(build, 1)


def test_new_shape_new_graphs():
    def build(q, k, v, layer):
        t = q if layer == 0 else q[:, : L - 1]
        pf.flash_attention(t, k, v)
    assert count_graphs(build, 2) > count_graphs(build, 1)


def test_graphs_are_per_ir():
    """A second Ir builds its own graphs (a graph belongs to one Ir)."""
    for _ in range(2):
        assert count_graphs(forward, 1) > 1


# --------------------------------------------------------------------------------------------
# Names


def _ir_with(fn):
    ir = popxl.Ir()
    with ir.main_graph:
        q, k, v = (popxl.variable(np.zeros((G, L, D), np.float32), name=n) for n in "qkv")
        return ir, fn(q, k, v)


@pytest.mark.parametrize("fn,scope", [
    (lambda q, k, v: pf.flash_attention(q, k, v, return_lse=True), "flash_attention/"),
    (lambda q, k, v: pf.flash_attention_grad(q, q, k, v), "flash_attention_grad/"),
    (lambda q, k, v: [pf.flash_attn_func(x, x, x, return_lse=True)
                      for x in [q.reshape((1, L, G, D))]][0], "flash_attn_func/"),
], ids=["forward", "grad", "flash_attn_func"])
def test_outputs_are_named_by_scope(fn, scope):
    ir, outs = _ir_with(fn)
    for t in outs:
        assert t.id.startswith(scope), t.id
    ours = ("flash_attention/", "flash_attention_grad/", "flash_attn_func/")
    for graph in pf.reachable_graphs(ir.main_graph):  # the traced graphs' tensors carry a scope too
        for t in graph.inputs:
            assert t.name.startswith(ours), (graph.name, t.name)


def test_graph_names_name_the_module():
    ir, _ = _ir_with(lambda q, k, v: pf.flash_attention_grad(q, q, k, v))
    names = [g.name for g in ir.main_graph.called_graphs]
    assert any("FlashAttentionGrad" in n for n in names), names
    assert any(n.startswith("FlashAttention") and "Grad" not in n
               for g in pf.reachable_graphs(ir.main_graph) for n in [g.name]), names


def test_user_scope_prefixes_ours():
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.variable(np.zeros((G, L, D), np.float32))
        with popxl.name_scope("layer0"):
            out = pf.flash_attention(q, q, q)
    assert out.id.startswith("layer0/flash_attention/"), out.id


def test_in_order_restores_in_sequence_on_an_exception(monkeypatch):
    """``blocks.in_order`` resumes PopXL's ``in_sequence`` context on an exception: PopXL's own
    context manager resets its global flag after ``yield`` without ``finally`` (modelled here by
    a stand-in with that shape), so a raise inside would leave every later op chained."""
    import contextlib

    from popxl_flash.graph import blocks

    flag = {"mode": None}

    @contextlib.contextmanager
    def in_sequence(mode=True):  # PopXL 3.4's shape: no try/finally around the yield
        previous = flag["mode"]
        flag["mode"] = mode
        yield mode
        flag["mode"] = previous

    monkeypatch.setattr(blocks.popxl, "in_sequence", in_sequence)
    with pytest.raises(ZeroDivisionError):
        with blocks.in_order():
            assert flag["mode"] is True
            1 / 0
    assert flag["mode"] is None
    with blocks.in_order(False):
        assert flag["mode"] is False
    assert flag["mode"] is None


@emulator_only
def test_only_the_loops_and_the_state_reads_are_ordered():
    """The module graphs order only the loops (in place updates of the state) and the reads of
    the state after them; the loop bodies and the ops before the loops carry no ``in_sequence``
    constraint (emulator IR: each op's ``after`` list)."""
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.variable(np.zeros((2, 100, 8), np.float16))
        out, lse = pf.flash_attention(q, q, q, num_chunks_q=4, num_chunks_kv=4, return_lse=True)
        pf.flash_attention_grad(q, q, q, q, out, lse, num_chunks_q=4, num_chunks_kv=4)
    for graph in ir._graphs:
        ordered = [op for op in graph._ops if op.after]
        if graph.name.startswith("FlashAttention"):
            first = min(k for k, op in enumerate(graph._ops) if op.kind == "repeat")
            assert ordered and all(op.index > first for op in ordered), graph.name
            assert all(not op.after for op in graph._ops[:first + 1]), graph.name
        else:
            assert not ordered, graph.name


def test_reachable_graphs_counts_what_a_call_added():
    """pf.reachable_graphs: each graph once (a shared graph is not counted twice), the caller
    excluded, and the count before/after a call is the graphs that call built."""
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.variable(np.zeros((G, L, D), np.float32))
        assert pf.reachable_graphs(ir.main_graph) == []
        pf.flash_attention(q, q, q, **CHUNKS)
        first = pf.reachable_graphs(ir.main_graph)
        (flash,) = ir.main_graph.called_graphs
        assert first[0] == flash and ir.main_graph not in first
        assert len({g.id for g in first}) == len(first) > 1
        assert pf.reachable_graphs(flash) == first[1:]
        pf.flash_attention(q, q, q, **CHUNKS)  # same configuration: nothing new
        assert len(pf.reachable_graphs(ir.main_graph)) == len(first)
        pf.flash_attention(q, q, q, num_chunks_q=3, num_chunks_kv=4)
        assert len(pf.reachable_graphs(ir.main_graph)) > len(first)
