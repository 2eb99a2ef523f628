"""The ``popart._internal.ir`` pieces popxl-addons calls, on the emulator's
stand-in (PopART sdk-release-3.4 ``python/popart._internal.ir/bindings/graph.cpp``, ``ir.cpp``,
``willow/src/graph.cpp``, ``willow/include/popart/ir.hpp``)."""
import numpy as np
import pytest

import popxl_flash
from popxl_flash import popxl

if popxl_flash.BACKEND != "emulator":
    pytest.skip("checks the emulator's stand-in", allow_module_level=True)

from popxl_flash.emulator import PopartError  # noqa: E402
from popxl_flash.emulator import _internal_ir as _ir  # noqa: E402


def _graph(ir):
    def fn(a, b):
        return a + b, a * b, a - b
    spec = popxl.TensorSpec((2,), popxl.float32)
    return ir.create_graph(fn, spec, spec)


def test_graph_io_lookups():
    ir = popxl.Ir()
    with ir.main_graph:
        g = _graph(ir)
    pb = g._pb_graph
    assert pb.getInputIds() == [t.id for t in g.inputs]
    assert pb.getInputIndex(g.inputs[1].id) == 1 and pb.getInputId(0) == g.inputs[0].id
    assert pb.getOutputIndex(g.outputs[2].id) == 2
    assert popxl.Tensor._from_pb_tensor(pb.getInputTensor(1)) is g.inputs[1]
    assert popxl.Tensor._from_pb_tensor(pb.getOutputTensor(0)) is g.outputs[0]
    assert g.outputs[0]._pb_tensor.getGraph() == pb
    assert g.outputs[0]._pb_tensor.hasProducer() and not g.inputs[0]._pb_tensor.hasProducer()
    assert g.outputs[1]._pb_tensor.getProducer().opType() == "Mul"
    assert g.outputs[0]._pb_tensor.info.shape() == [2]
    with pytest.raises(PopartError):
        pb.getInputIndex("no such tensor")
    with pytest.raises(TypeError):
        popxl.Tensor._from_pb_tensor(g.inputs[0])


def test_remove_output_by_index_and_id():
    """``Graph::removeOutput(index)`` erases unchecked: at or past the end libstdc++'s
    ``vector::erase`` drops the last output, which addons' ascending-index loop relies on."""
    ir = popxl.Ir()
    with ir.main_graph:
        g = _graph(ir)
    a, b, c = g.outputs
    g._pb_graph.removeOutput(0)
    assert g.outputs == (b, c)
    g._pb_graph.removeOutput(5)
    assert g.outputs == (b,)
    g._pb_graph.removeOutput(b.id)
    assert g.outputs == ()
    with pytest.raises(PopartError):
        g._pb_graph.removeOutput(a.id)


def test_remove_output_of_a_called_graph_is_refused():
    ir = popxl.Ir()
    with ir.main_graph:
        g = _graph(ir)
        x = popxl.constant(np.ones(2, np.float32))
        popxl.ops.call(g, x, x)
    with pytest.raises(NotImplementedError):
        g._pb_graph.removeOutput(0)


def test_op_ids_count_from_100_across_the_ir():
    """PopART's ``Ir::opsCounter`` starts at 100 and numbers every op of the Ir."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.ones((2, 2), np.float32))
        y = x @ x
        g = _graph(ir)
        z = x.T
    ids = [op.id for op in ir.main_graph._pb_graph.getOps()]
    sub_ids = [op.id for op in g._pb_graph.getOps()]
    assert ids == [100, 104] and sub_ids == [101, 102, 103]
    assert ir.main_graph._pb_graph.getOps()[0].opType() == "MatMul"
    assert isinstance(ir.main_graph._pb_graph.getOps()[0], _ir.op.MatMulOp)
    assert y.shape == z.shape == (2, 2)


def test_loop_and_call_ops_expose_their_graph():
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a: a + 1.0, popxl.TensorSpec((2,), popxl.float32))
        x = popxl.constant(np.ones(2, np.float32))
        popxl.ops.call(g, x)
        popxl.ops.repeat(g, 3, x)
    call, loop = ir.main_graph._pb_graph.getOps()
    assert isinstance(call, _ir.op.CallOp) and isinstance(loop, _ir.op.LoopOp)
    assert popxl.Graph._from_pb(call.getCalledGraph()) is g
    assert loop.getTripCountValue() == 3


def test_patterns_are_recorded_and_checked():
    ir = popxl.Ir()
    with ir.main_graph:
        g = _graph(ir)
    pb_ir = ir._pb_ir
    pb_ir.setPatterns(_ir.patterns.Patterns(_ir.patterns.PatternsLevel.Default))
    assert ir._patterns._level is _ir.patterns.PatternsLevel.Default  # emulator record
    assert not hasattr(pb_ir, "getPatterns")  # not bound (bindings/ir.cpp)
    pb_ir.applyPreAliasPatterns(g._pb_graph)
    pb_ir.applyInplacePattern(g._pb_graph)
    assert [p.id for p in pb_ir.getAllGraphs()] == [ir.main_graph.id, g.id]
    with pytest.raises(TypeError):
        pb_ir.setPatterns("default")
    with pytest.raises(TypeError):
        pb_ir.applyPreAliasPatterns(popxl.Ir().main_graph._pb_graph)
    assert pb_ir.getId() == ir.id
