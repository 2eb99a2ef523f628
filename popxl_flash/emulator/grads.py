"""Gradient rules of the emulator's autodiff: one per op kind, built from emulator ops.

A rule is ``(inputs, grad)``: ``inputs(op)`` gives the input positions PopART's grad ops
produce a gradient for, and ``grad(ctx, i)`` builds (in the gradient graph) the edge gradient
of input ``i`` from ``ctx.dy(j)`` (the gradient of output ``j``). Forward tensors a rule needs
are read through ``ctx.x(i)``/``ctx.y(j)``; every forward tensor PopART's grad op reads must be
read here too, even if unused, because those reads decide which forward tensors become
gradient-graph inputs (and forward outputs by stitching): mul/div/pow read both operands and the
output, logsumexp its input and output, matmul the other operand, exp/sqrt/tanh/relu/softmax the output, log/gelu/swish the input, gather the indices, group_norm
x, weight and the hidden mean/inv-std, where the condition, dynamic_slice the index, dropout the seed, the rest
nothing. Like PopART's, a rule needs the gradient of every output of a multi-output op (split):
one off the loss path raises "input is not optional".

``NO_GRAD`` kinds have no grad op in PopART (``Op::getGradOps`` returns none, e.g. the random
ops and ModifyRandomSeed): the gradient silently stops there. That includes the in-place views
``reshape_`` and ``transpose_`` (``ReshapeInplaceOp``/``TransposeInplaceOp`` do not override
``Op::getGradOps``, ``willow/src/op.cpp``) and ``detach_`` (``DetachOp::getGradOps`` returns
``{}``, ``willow/include/popart/op/detach.hpp``): a gradient through them is zero, or
"[Autodiff] Unable to provide required gradient output" when nothing else reaches a required
input. ``RAISES`` kinds throw when PopART grows their grad ops (``slice_``:
``SliceInplaceOp::getGradOps`` throws ``internal_error``, ``willow/src/op/slice.cpp``). Kinds
in no table raise ``NotImplementedError`` when a gradient is needed through them.
"""
from . import dtypes
from . import ops
from .errors import PopartError
from .registry import emit
from .tensor import constant

_FLOATS = (dtypes.float16, dtypes.float32)

NO_GRAD = frozenset((
    "detach", "init", "scaled_add", "increment_mod", "host_load", "greater", "equal",
    "logical_and", "logical_or", "logical_not", "isnan", "isinf", "isfinite", "floor", "ceil",
    "sign", "replicated_all_reduce", "random_uniform", "random_normal", "modify_random_seed",
    "io_tile_copy", "reshape_", "transpose_", "detach_",
))

#: kind -> message of the ``popart_internal_exception`` its ``getGradOps`` throws
RAISES = {
    "slice_": "[SliceInplaceOp::getGradOps] All gradients should be generated before any "
              "inplacing is performed. This for Op {op}",
}


def unbroadcast(g, shape):
    """Sum ``g`` over the axes numpy broadcasting added to reach its shape from ``shape``.

    Args:
        g: gradient tensor of the broadcast result. shape: the operand's shape.
    Returns:
        Tensor of ``shape``.
    """
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.rank - len(shape)
    axes = list(range(lead)) + [lead + i for i, d in enumerate(shape)
                                if d == 1 and g.shape[lead + i] != 1]
    if axes:
        g = ops.sum(g, axis=axes, keepdims=True)
    return g.reshape(shape)


def _const(value, dtype):
    return constant(value, dtype)


def _zeros(shape, dtype):
    return ops.init(tuple(shape), dtype, init_type="zero")


def _all(op):
    return range(len(op.inputs))


# -- elementwise -------------------------------------------------------------------------------
def _add(ctx, i):
    return unbroadcast(ctx.dy(0), ctx.op.inputs[i].shape)


def _sub(ctx, i):
    g = ctx.dy(0) if i == 0 else ops.negate(ctx.dy(0))
    return unbroadcast(g, ctx.op.inputs[i].shape)


def _like(g, t):
    return g if g.dtype == t.dtype else ops.cast(g, t.dtype)


def _mul(ctx, i):
    a, b = ctx.x(0), ctx.x(1)
    ctx.y(0)  # read by PopART's MulArg*GradOp too
    other = b if i == 0 else a
    g = ops.mul(ctx.dy(0), other)
    return _like(unbroadcast(g, ctx.op.inputs[i].shape), ctx.op.inputs[i])


def _div(ctx, i):
    ctx.x(0)  # read by PopART's DivArg*GradOp, like b and out
    b, out, dy = ctx.x(1), ctx.y(0), ctx.dy(0)
    g = dy / b if i == 0 else ops.negate(dy * out) / b  # d(a/b)/db = -(a/b)/b
    return unbroadcast(g, ctx.op.inputs[i].shape)


def _negate(ctx, i):
    return ops.negate(ctx.dy(0))


def _exp(ctx, i):
    return ctx.dy(0) * ctx.y(0)


def _log(ctx, i):
    return ctx.dy(0) / ctx.x(0)


def _sqrt(ctx, i):
    return ctx.dy(0) / (ctx.y(0) * _const(2.0, ctx.op.outputs[0].dtype))


def _tanh(ctx, i):
    y = ctx.y(0)
    return ctx.dy(0) * (_const(1.0, y.dtype) - y * y)


def _relu(ctx, i):
    y, dy = ctx.y(0), ctx.dy(0)
    zero = _const(0.0, y.dtype)
    return ops.where(ops.greater(y, zero), dy, zero)


def _pow(ctx, i):
    a, e, out, dy = ctx.x(0), ctx.x(1), ctx.y(0), ctx.dy(0)
    if out.dtype not in _FLOATS:
        raise NotImplementedError("autodiff: integer pow gradients are not implemented by the "
                                  "emulator")
    if i == 0:  # e * a^(e - 1)
        g = dy * e * ops.pow(a, e - _const(1.0, e.dtype))
    else:       # a^e * log(a)
        g = dy * out * ops.log(a)
    return unbroadcast(g, ctx.op.inputs[i].shape)


def _where(ctx, i):
    cond, dy = ctx.x(0), ctx.dy(0)
    zero = _const(0.0, dy.dtype)
    g = ops.where(cond, dy, zero) if i == 1 else ops.where(cond, zero, dy)
    return unbroadcast(g, ctx.op.inputs[i].shape)


def _cast(ctx, i):
    src = ctx.op.inputs[0]
    if src.dtype not in _FLOATS or ctx.op.outputs[0].dtype not in _FLOATS:
        raise NotImplementedError(f"autodiff: the gradient of a cast from {src.dtype.name} to "
                                  f"{ctx.op.outputs[0].dtype.name} is not implemented by the "
                                  "emulator (float16/float32 only)")
    return ops.cast(ctx.dy(0), src.dtype)


def _identity(ctx, i):
    return ctx.dy(0)


def _gelu(ctx, i):
    return emit("gelu_grad", {"dy": ctx.dy(0), "t": ctx.x(0)})[0]


def _swish(ctx, i):
    return emit("swish_grad", {"dy": ctx.dy(0), "t": ctx.x(0)})[0]


def _gather(ctx, i):
    """GatherGradOp: the incoming gradient scattered (added) into zeros of the input's shape
    at the gathered indices (out-of-range indices with ``zero_OOR`` contribute nothing)."""
    a = ctx.op.attrs
    return emit("gather_grad", {"dy": ctx.dy(0), "indices": ctx.x(1)},
                {"axis": a["axis"], "shape": ctx.op.inputs[0].shape})[0]


def _group_norm(ctx, i):
    if "group_norm" not in ctx.cache:
        x, w, mean, inv_std = ctx.x(0), ctx.x(1), ctx.y(1), ctx.y(2)
        ctx.cache["group_norm"] = emit(
            "group_norm_grad",
            {"dy": ctx.dy(0), "t": x, "weight": w, "mean": mean, "inv_std": inv_std},
            {"num_groups": ctx.op.attrs["num_groups"]})
    return ctx.cache["group_norm"][i]


# -- shape ----------------------------------------------------------------------------------
def _reshape(ctx, i):
    return ctx.dy(0).reshape(ctx.op.inputs[0].shape)


def _transpose(ctx, i):
    perm = ctx.op.attrs["permutation"]
    inverse = [0] * len(perm)
    for k, p in enumerate(perm):
        inverse[p] = k
    return ops.transpose(ctx.dy(0), inverse)


def _slice(ctx, i):
    g, src = ctx.dy(0), ctx.op.inputs[0]
    for ax, begin, end, flip in ctx.op.attrs["slices"]:
        if flip:
            g = ops.slice(g, start=[-1], stop=[-(g.shape[ax] + 1)], step=[-1], axis=[ax])
        parts = []
        for n in (begin, None, src.shape[ax] - end):
            if n is None:
                parts.append(g)
            elif n > 0:
                parts.append(_zeros(g.shape[:ax] + (n,) + g.shape[ax + 1:], g.dtype))
        g = ops.concat(parts, axis=ax) if len(parts) > 1 else g
    return g


def _concat(ctx, i):
    ax = ctx.op.attrs["axis"]
    ax = ax + ctx.op.outputs[0].rank if ax < 0 else ax
    start = sum(t.shape[ax] for t in ctx.op.inputs[:i])
    return ops.slice(ctx.dy(0), start=[start], stop=[start + ctx.op.inputs[i].shape[ax]],
                     axis=[ax])


def _split(ctx, i):
    """SplitGradOp: the concat of every output's gradient (all required, as in PopART)."""
    dys = [ctx.dy(j) for j in range(len(ctx.op.outputs))]
    return ops.concat(dys, axis=ctx.op.attrs["axis"])


def _expand_reduced(ctx):
    src, axes = ctx.op.inputs[0], ctx.op.attrs["axes"]
    kept = tuple(1 if a in axes else d for a, d in enumerate(src.shape))
    g = ctx.dy(0).reshape(kept) if kept else ctx.dy(0)
    return g + _zeros(src.shape, g.dtype)


def _sum(ctx, i):
    return _expand_reduced(ctx)


def _mean(ctx, i):
    src, axes = ctx.op.inputs[0], ctx.op.attrs["axes"]
    n = 1
    for a in axes:
        n *= src.shape[a]
    return _expand_reduced(ctx) * _const(1.0 / n, src.dtype)


def _logsumexp(ctx, i):
    # ReduceLogSumExpGradOp reads the forward input and output: dx = dy * exp(x - y).
    x, axes = ctx.x(0), ctx.op.attrs["axes"]
    kept = tuple(1 if a in axes else d for a, d in enumerate(x.shape))
    y = ctx.y(0).reshape(kept) if kept else ctx.y(0)
    return _expand_reduced(ctx) * ops.exp(x - y)


def _softmax(ctx, i):
    # ONNX-11 softmax normalises over every axis from ``axis`` on (PopART's coerceTo2D), and so
    # does its gradient (SoftmaxGradOp uses the same axis).
    y, dy, axis = ctx.y(0), ctx.dy(0), ctx.op.attrs["axis"]
    return y * (dy - ops.sum(dy * y, axis=list(range(axis, y.rank)), keepdims=True))


def _dynamic_slice(ctx, i):
    t, index = ctx.op.inputs[0], ctx.x(1)
    a = ctx.op.attrs
    return ops.dynamic_update(_zeros(t.shape, ctx.dy(0).dtype), index, ctx.dy(0), a["axes"],
                              a["sizes"], True)


# -- matmul -------------------------------------------------------------------------------
def _swap(t):
    perm = list(range(t.rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return ops.transpose(t, perm)


def _matmul(ctx, i):
    a_fwd, b_fwd = ctx.op.inputs
    other = ctx.x(1) if i == 0 else ctx.x(0)
    dy = ctx.dy(0)
    a_shape = (1,) + a_fwd.shape if a_fwd.rank == 1 else a_fwd.shape
    b_shape = b_fwd.shape + (1,) if b_fwd.rank == 1 else b_fwd.shape
    out_shape = dy.shape[:max(len(a_shape), len(b_shape)) - 2] + (a_shape[-2], b_shape[-1])
    g = dy.reshape(out_shape)
    other = other.reshape(b_shape if i == 0 else a_shape)
    if other.dtype != g.dtype:  # e.g. float16 operands with a float32 output_type
        other = ops.cast(other, g.dtype)
    if i == 0:
        grad = unbroadcast(ops.matmul(g, _swap(other)), a_shape)
    else:
        grad = unbroadcast(ops.matmul(_swap(other), g), b_shape)
    src = ctx.op.inputs[i]
    return _like(grad.reshape(src.shape), src)


# -- collectives -------------------------------------------------------------------------------
def _all_gather(ctx, i):
    """ReplicatedAllGatherOp's grad op: a Local reduce-scatter (each replica keeps its own
    slice of the incoming gradient; no sum over replicas)."""
    src = ctx.op.inputs[0]
    out = emit("replicated_reduce_scatter", {"t": ctx.dy(0)},
               {"grouping": ctx.op.attrs["grouping"], "op": "local"})[0]
    return out if out.shape == src.shape else out.reshape(src.shape)


def _reduce_scatter(ctx, i):
    """ReplicatedReduceScatterOp's grad op (Local only, else PopART throws): an all-gather."""
    if ctx.op.attrs["op"] != "local":
        raise PopartError("ReplicatedReduceScatterOp: grad op is only implemented when "
                          "CollectiveOperator==CollectiveOperator::Local")
    src, dy = ctx.op.inputs[0], ctx.dy(0)
    out = emit("replicated_all_gather", {"t": dy},
               {"grouping": ctx.op.attrs["grouping"],
                "shape": (ctx.op.attrs["grouping"][2] * dy.nelms,)})[0]
    return out if out.shape == src.shape else out.reshape(src.shape)


# -- loss ------------------------------------------------------------------------------------
def _nll_loss(ctx, i):
    """NllGradOp (``ops/loss.py``): reads the loss gradient, probs and labels; gives probs'
    gradient only."""
    a = ctx.op.attrs
    return emit("nll_grad", {"dy": ctx.dy(0), "probs": ctx.x(0), "labels": ctx.x(1)}, dict(a),
                names=["nll_grad_out"])[0]


# -- dropout -----------------------------------------------------------------------------------
def _dropout(ctx, i):
    """DropoutGradOp (willow/src/op/dropout.cpp): a DropoutOp on the incoming gradient with the
    forward's ratio, reading the forward's seed (same seed, same shape: the same mask)."""
    return emit("dropout", {"t": ctx.dy(0), "seed_tensor": ctx.x(1)},
                {"p": ctx.op.attrs["p"]}, names=["dropout_grad_out"])[0]


RULES = {
    "add": (_all, _add), "sub": (_all, _sub), "mul": (_all, _mul), "div": (_all, _div),
    "negate": (_all, _negate), "exp": (_all, _exp), "log": (_all, _log),
    "sqrt": (_all, _sqrt), "tanh": (_all, _tanh), "relu": (_all, _relu), "pow": (_all, _pow), "cast": (_all, _cast),
    "identity": (_all, _identity), "gelu": (_all, _gelu), "swish": (_all, _swish),
    "gather": (lambda op: (0,), _gather),
    "where": (lambda op: (1, 2), _where), "group_norm": (_all, _group_norm),
    "reshape": (_all, _reshape), "transpose": (_all, _transpose), "slice": (_all, _slice),
    "concat": (_all, _concat), "split": (_all, _split), "sum": (_all, _sum), "mean": (_all, _mean),
    "logsumexp": (_all, _logsumexp), "softmax": (_all, _softmax), "dynamic_slice": (lambda op: (0,), _dynamic_slice),
    "matmul": (_all, _matmul),
    "replicated_all_gather": (_all, _all_gather),
    "replicated_reduce_scatter": (_all, _reduce_scatter),
    "dropout": (lambda op: (0,), _dropout),
    "nll_loss": (lambda op: (0,), _nll_loss),
}
RULES["concat_"] = RULES["concat"]  # ConcatInplaceOp's grad ops are ConcatOp's
