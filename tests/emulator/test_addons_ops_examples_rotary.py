"""The emulator's model of the rotary embedding C++ op that Graphcore's Dolly and Llama PopXL
examples ship (``popxl_flash/emulator/addons_ops/examples_rotary.py``): rotate-half forward,
the C++ grad op's interleaved inverse rotation, the lowering checks shared with popxl-addons'
op, and the cppimport stand-in recognising the op by its sources. Checked against numpy models
written from the C++ sources. Emulator only: on the SDK the binding is cppimport-compiled C++.
"""
import os
import shutil

import numpy as np
import pytest

import popxl_flash
from conftest import COMPILE_ERRORS, IR_ERRORS
from popxl_flash import popxl

if popxl_flash.BACKEND != "emulator":
    pytest.skip("the emulator's model of the examples' C++ op", allow_module_level=True)

from popxl_flash.emulator import addons_ops, standins  # noqa: E402
from popxl_flash.emulator.addons_ops import examples_rotary, rotary  # noqa: E402

ops = popxl.ops
EXAMPLES_OP = os.path.join("nlp", "dolly", "popxl", "modelling", "rotary_pos_embed")


def _build(cls, x, sin, cos, rotary_dim):
    """``cls.createOpInGraph`` in the current graph, as the examples' ``rotary_pos_embed``
    calls it. Returns: the rotated tensor."""
    ctx = popxl.context.get_current_context()
    g = ctx.graph
    op = cls.createOpInGraph(g._pb_graph, {0: x.id, 1: sin.id, 2: cos.id},
                             {0: g._create_tensor_id("t_rotated")}, rotary_dim,
                             ctx._get_op_settings("RotaryPosEmbedOp"))
    ctx._op_created(op)
    return popxl.Tensor._from_pb_tensor(op.outTensor(0))


def _tables(seq, rotary_dim, dtype=np.float32):
    theta = 10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    phi = np.outer(np.arange(seq), theta)
    return np.sin(phi).astype(dtype), np.cos(phi).astype(dtype)


def _rotate_half_numpy(x, sin, cos, rotary_dim):
    """Hugging Face's GPT-NeoX/Llama form: ``x cos + rotate_half(x) sin`` with the tables
    repeated over both halves, on the first ``rotary_dim`` features."""
    out = x.copy()
    part = x[..., :rotary_dim]
    h = rotary_dim // 2
    c = np.concatenate([cos, cos], -1)[:, :, None, :]
    s = np.concatenate([sin, sin], -1)[:, :, None, :]
    rot = np.concatenate([-part[..., h:], part[..., :h]], -1)
    out[..., :rotary_dim] = part * c + rot * s
    return out


def _interleaved_inverse_numpy(dy, sin, cos, rotary_dim):
    """The C++ grad op (``rotateGradTensor``): pairs (2i, 2i + 1) rotated by minus the angle."""
    out = dy.copy()
    s, c = sin[:, :, None, :], cos[:, :, None, :]
    re, im = dy[..., 0:rotary_dim:2], dy[..., 1:rotary_dim:2]
    out[..., 0:rotary_dim:2] = re * c + im * s
    out[..., 1:rotary_dim:2] = im * c - re * s
    return out


def _forward_and_gradient(x_np, dy_np, sin_np, cos_np, rotary_dim):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(x_np)
        sin, cos = popxl.constant(sin_np), popxl.constant(cos_np)
        g = ir.create_graph(
            lambda t, s, c: _build(examples_rotary.RotaryPosEmbedOp, t, s, c, rotary_dim),
            x, sin, cos)
        grad = popxl.transforms.autodiff(g, grads_required=g.inputs[:1])
        info = ops.call_with_info(g, x, sin, cos)
        (dx,) = ops.call(grad.graph, popxl.constant(dy_np), inputs_dict=grad.inputs_dict(info))
        streams = []
        for t in (info.outputs[0], dx):
            streams.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(streams[-1], t)
    with popxl.Session(ir, "ipu_model") as session:
        res = session.run()
    return [res[s] for s in streams]


@pytest.mark.parametrize("rotary_dim,table_batch", [(8, 1), (4, 1), (4, 2), (10, 1)])
def test_examples_rotary_forward_is_rotate_half_and_gradient_is_the_cpp_grad_op(
        rotary_dim, table_batch):
    """Forward: the two contiguous halves of the first ``rotary_dim`` features rotated (all
    features when ``rotary_dim`` is at least ``hh``: 10 >= 8 with a table of 4 columns,
    which is what the Opx rotates then); gradient: the interleaved inverse rotation the C++
    grad op computes. Tables of batch 1 or the input's batch."""
    rng = np.random.default_rng(0)
    b, seq, heads, hh = 2, 5, 3, 8
    x_np = rng.standard_normal((b, seq, heads, hh)).astype(np.float32)
    dy_np = rng.standard_normal((b, seq, heads, hh)).astype(np.float32)
    rotated = min(rotary_dim, hh)
    sin_np, cos_np = _tables(seq, rotated)
    sin_np = np.repeat(sin_np[None], table_batch, 0)
    cos_np = np.repeat(cos_np[None], table_batch, 0)
    y, gx = _forward_and_gradient(x_np, dy_np, sin_np, cos_np, rotary_dim)
    np.testing.assert_allclose(y, _rotate_half_numpy(x_np, sin_np, cos_np, rotated),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gx, _interleaved_inverse_numpy(dy_np, sin_np, cos_np, rotated),
                               rtol=1e-6, atol=1e-6)


def test_examples_rotary_differs_from_popxl_addons_op():
    """The same inputs through popxl-addons' model give the interleaved rotation: the two ops
    of one file name are two models."""
    rng = np.random.default_rng(1)
    x_np = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    sin_np, cos_np = (t[None] for t in _tables(4, 8))
    ir = popxl.Ir()
    with ir.main_graph:
        x, s, c = popxl.variable(x_np), popxl.constant(sin_np), popxl.constant(cos_np)
        outs = []
        for cls in (examples_rotary.RotaryPosEmbedOp, rotary.RotaryPosEmbedOp):
            t = _build(cls, x, s, c, 8)
            outs.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(outs[-1], t)
    with popxl.Session(ir, "ipu_model") as session:
        res = session.run()
    half, pairs = res[outs[0]], res[outs[1]]
    np.testing.assert_allclose(half, _rotate_half_numpy(x_np, sin_np, cos_np, 8), rtol=1e-6,
                               atol=1e-6)
    assert not np.allclose(half, pairs)


def test_examples_rotary_float16():
    """float16 in, float16 out, the same rotation within float16 rounding."""
    rng = np.random.default_rng(2)
    x_np = rng.standard_normal((1, 3, 2, 4)).astype(np.float16)
    sin_np, cos_np = (t[None] for t in _tables(3, 4, np.float16))
    y, _ = _forward_and_gradient(x_np, x_np, sin_np, cos_np, 4)
    assert y.dtype == np.float16
    ref = _rotate_half_numpy(x_np.astype(np.float32), sin_np.astype(np.float32),
                             cos_np.astype(np.float32), 4)
    np.testing.assert_allclose(y.astype(np.float32), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("cls", [examples_rotary.RotaryPosEmbedOp, rotary.RotaryPosEmbedOp],
                         ids=["examples", "popxl_addons"])
def test_rotary_setup_refusals(cls):
    """``RotaryPosEmbedOp``'s constructor and ``setup``: odd ``rotary_dim``, ranks 4 and 3."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((1, 2, 1, 4), np.float32))
        t3 = popxl.constant(np.zeros((1, 2, 2), np.float32))
        with pytest.raises(IR_ERRORS, match="multiple of 2"):
            _build(cls, x, t3, t3, 3)
        with pytest.raises(IR_ERRORS, match="rank 4"):
            _build(cls, popxl.constant(np.zeros((2, 4), np.float32)), t3, t3, 4)
        with pytest.raises(IR_ERRORS, match="rank 3"):
            _build(cls, x, popxl.constant(np.zeros((2, 2), np.float32)), t3, 4)


@pytest.mark.parametrize("cls", [examples_rotary.RotaryPosEmbedOp, rotary.RotaryPosEmbedOp],
                         ids=["examples", "popxl_addons"])
@pytest.mark.parametrize("case", ["dtype", "table_columns", "table_batch", "rotary_dim_beyond",
                                  "odd_hh"])
def test_rotary_lowering_refusals(cls, case):
    """What ``setup`` accepts and the Opx's slicing and ``popops::map`` refuse, when the
    Session compiles: tables of another dtype than ``x``, tables that do not broadcast to the
    rotated halves (columns, a batch the input does not have), ``rotary_dim`` beyond ``hh``
    (the Opx then rotates all ``hh`` features against tables of ``rotary_dim / 2`` columns),
    an odd number of features to rotate."""
    x_shape, table, rotary_dim, table_dtype = (2, 3, 1, 8), (1, 3, 4), 8, np.float32
    if case == "dtype":
        table_dtype = np.float16
    elif case == "table_columns":
        table = (1, 3, 3)
    elif case == "table_batch":
        x_shape, table = (1, 3, 1, 8), (2, 3, 4)
    elif case == "rotary_dim_beyond":
        table, rotary_dim = (1, 3, 5), 10
    else:
        x_shape, table, rotary_dim = (1, 3, 1, 5), (1, 3, 3), 6
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros(x_shape, np.float32))
        t = popxl.constant(np.zeros(table, table_dtype))
        y = _build(cls, x, t, t, rotary_dim)
        ops.host_store(popxl.d2h_stream(y.shape, y.dtype), y)
    with pytest.raises(COMPILE_ERRORS):
        popxl.Session(ir, "ipu_model")


# -- recognising the source --------------------------------------------------------------------
def test_same_named_source_of_another_package_is_not_popxl_addons_op(tmp_path):
    """A ``rotary_pos_embed_binding.cpp`` outside popxl-addons whose sources the emulator does
    not know imports as a module raising when used (neither of the two models)."""
    src = tmp_path / "rotary_pos_embed_binding.cpp"
    src.write_text("// cppimport\n// some other op\n")
    assert addons_ops.binding("modelling.rotary_pos_embed.rotary_pos_embed_binding") is None
    assert addons_ops.binding("modelling.rotary_pos_embed.rotary_pos_embed_binding",
                              str(src)) is None
    finder = standins.CppFinder()
    spec = finder.find_spec("pkg.rotary_pos_embed_binding", [str(tmp_path)])
    assert spec.origin == str(src)
    mod = finder.create_module(spec)
    with pytest.raises(NotImplementedError):
        mod.RotaryPosEmbedOp  # noqa: B018


def _examples_source():
    root = os.environ.get("GRAPHCORE_EXAMPLES_PATH", "")
    folder = os.path.join(root, EXAMPLES_OP)
    if not root or not os.path.isfile(os.path.join(folder, "rotary_pos_embed_binding.cpp")):
        pytest.skip("set GRAPHCORE_EXAMPLES_PATH (graphcore/examples sdk-release-3.4) to check "
                    "the examples' sources")
    return folder


def test_examples_sources_give_the_examples_model(tmp_path):
    """Dolly's sources (also Llama's: the same files) give the rotate-half model, whatever the
    package is called; a copy with one source edited gives no model."""
    folder = _examples_source()
    finder = standins.CppFinder()
    for model in ("dolly", "llama"):
        path = [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.dirname(folder)))), model, "popxl", "modelling", "rotary_pos_embed")]
        spec = finder.find_spec("modelling.rotary_pos_embed.rotary_pos_embed_binding", path)
        mod = finder.create_module(spec)
        assert mod.RotaryPosEmbedOp is examples_rotary.RotaryPosEmbedOp
    copy = tmp_path / "rotary_pos_embed"
    shutil.copytree(folder, copy)
    x_cpp = copy / "rotary_pos_embedx.cpp"
    x_cpp.write_text(x_cpp.read_text().replace("pe::_1 * pe::_4", "pe::_4 * pe::_1", 1))
    spec = finder.find_spec("modelling.rotary_pos_embed.rotary_pos_embed_binding", [str(copy)])
    with pytest.raises(NotImplementedError):
        finder.create_module(spec).RotaryPosEmbedOp  # noqa: B018
