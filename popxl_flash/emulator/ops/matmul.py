"""Matrix multiplication with numpy ``matmul`` shape rules.

float16 inputs with float32 partials (the default) compute in float32 and round once to the
output dtype; float16 partials compute with numpy's float16 matmul; float32 inputs compute in
float32.

``MatMulOp::setup`` (``willow/src/op/matmul.cpp``) checks only ranks and the contracting
dimension; it takes the output dtype from ``output_type`` or the lhs and never compares the
operand dtypes. Mixed or non-float operand dtypes and non-float ``output_type`` are therefore
refused when the Session compiles (Poplar's matmul takes float16/float32 of one type), not when
the op is created.
"""
import numpy as np

from .. import dtypes
from ..errors import PopartError
from ..registry import COMPILE_CHECKS, FLOPS, emit, register
from ._common import FLOATS, np_out


def _padded(a, b):
    sa = (1,) + a.shape if a.rank == 1 else a.shape
    sb = b.shape + (1,) if b.rank == 1 else b.shape
    return sa, sb


def _matmul_rule(a, b, output_type, partials_f32):
    if a.rank == 0 or b.rank == 0:
        raise PopartError(f"matmul: operands must have rank >= 1 ({a.id} {a.shape}, "
                          f"{b.id} {b.shape})")
    sa, sb = _padded(a, b)
    # MatMulOp::npMatMulOut (op/matmul.cpp): a rank-2 operand gets a group dim of 1, then
    # npOut of the group dims (a zero group dim both have raises), then the contracting check
    batch = np_out("matmul", sa[:-2] or (1,), sb[:-2] or (1,))
    if sa[-1] != sb[-2]:
        raise PopartError(f"matmul: contracting dims differ: lhs {a.shape} rhs {b.shape}")
    if len(sa) == 2 and len(sb) == 2:
        batch = ()  # both group dims were prepended: squeezed off again
    out = batch + ((sa[-2],) if a.rank > 1 else ()) + ((sb[-1],) if b.rank > 1 else ())
    return [(out, output_type or a.dtype)]


def _check_matmul_dtypes(op):
    a, b = op.inputs
    out = op.outputs[0].dtype
    if a.dtype != b.dtype:
        raise PopartError(f"matmul: lhs {a.id} ({a.dtype.name}) and rhs {b.id} "
                          f"({b.dtype.name}) must have the same dtype (Poplar matmul)")
    if a.dtype not in FLOATS or out not in FLOATS:
        raise PopartError(f"matmul: operands {a.dtype.name} -> output {out.name}: Poplar's "
                          "matmul takes float16/float32 only")


def _matmul(a, b, output_type, partials_f32):
    if partials_f32 and a.dtype != np.float32:
        r = np.matmul(a.astype(np.float32), b.astype(np.float32))
    else:
        r = np.matmul(a, b)
    return r.astype(output_type.as_numpy() if output_type else a.dtype, copy=False)


def _matmul_flops(op):
    a, b = op.inputs
    sa, sb = _padded(a, b)
    batch = int(np.prod(np.broadcast_shapes(sa[:-2], sb[:-2]), dtype=np.int64))
    return 2 * sa[-2] * sa[-1] * sb[-1] * batch


register("matmul", _matmul_rule, _matmul)
COMPILE_CHECKS["matmul"] = _check_matmul_dtypes
FLOPS["matmul"] = _matmul_flops


def matmul(lhs, rhs, available_memory_proportion=None, output_type=None, partials_type=None):
    """Args: lhs, rhs: float16/float32 tensors of one dtype. output_type: result dtype
    (default lhs dtype). partials_type: float16 or float32 (default float32).
    Returns: lhs @ rhs."""
    if partials_type is None:
        partials_f32 = True
    elif partials_type in (dtypes.float16, dtypes.float32):
        partials_f32 = partials_type == dtypes.float32
    else:
        raise ValueError(f"dtype {partials_type} is not valid, must be float16 or float32")
    if output_type is not None and not isinstance(output_type, dtypes.dtype):
        # PopXL reads ``output_type._pb_dtype``
        raise AttributeError(f"'{type(output_type).__name__}' object has no attribute "
                             "'_pb_dtype' (matmul output_type must be a popxl dtype)")
    return emit("matmul", {"lhs": lhs, "rhs": rhs},
                {"output_type": output_type, "partials_f32": partials_f32})[0]
