"""popxl-addons' ``LayerNormDistributedOp`` (``ops/layer_norm_distributed/*.cpp``): layer norm
of ``x [N, H / G]`` whose hidden dimension is sharded over the G replicas of a group.

Forward (``LayerNormDistributedOpx``): the mean and inverse standard deviation of every row
over the whole hidden dimension (the group's shards together; biased variance,
``1 / sqrt(var + epsilon)``), then ``y = (x - mean) * inv_std * w + b`` on each shard with its
own ``w``, ``b`` ``[H / G]``. Outputs ``y``, ``mean [N]``, ``inv_std [N]`` (x's dtype).
Gradient (``LayerNormDistributedGradOpx``): with ``xhat = (x - mean) * inv_std`` and the
incoming ``dy``, ``dx = inv_std * (dy - mean_H(dy) - xhat * mean_H(dy * xhat))`` (means over
the whole hidden dimension, summed across the group), ``dw = sum_N(dy * xhat)``,
``db = sum_N(dy)``. The C++ op hands ``dy`` to ``distributedNormStatisticsGradients``
without multiplying it by ``w`` (it reads ``w`` and leaves it unused), so ``dx`` is the
gradient for ``w = 1``: the model keeps that.
"""
import numpy as np

from .. import grads
from ..errors import PopartError
from ..ops import collectives as coll
from ..registry import COMPILE_CHECKS, PREPARE, emit, register
from ._binding import create, grouping_of

_KIND, _GRAD = "addons_layer_norm_distributed", "addons_layer_norm_distributed_grad"


def _rule(x, w, b, epsilon, grouping):
    if x.rank != 2:
        raise PopartError(f"LayerNormDistributedOp: x {x.id} must be [N, H] (rank 2)")
    return [(x.shape, x.dtype), ((x.shape[0],), x.dtype), ((x.shape[0],), x.dtype)]


def _grad_rule(dy, x, w, mean, inv_std, epsilon, grouping):
    return [(x.shape, x.dtype), (w.shape, w.dtype), (w.shape, w.dtype)]


def _per_group(grouping, values, fn):
    """Apply ``fn(member values) -> member results`` to each group. Returns: per replica."""
    out = [None] * len(values)
    for members in coll.groups_of(grouping):
        for r, res in zip(members, fn([values[r] for r in members])):
            out[r] = res
    return out


def forward(shards, epsilon):
    """Args: shards: [(x, w, b)] of one group in rank order. Returns: [(y, mean, inv_std)]."""
    full = np.concatenate([x.astype(np.float32) for x, _, _ in shards], axis=1)
    mean = full.mean(axis=1)
    inv_std = 1.0 / np.sqrt(((full - mean[:, None]) ** 2).mean(axis=1) + np.float32(epsilon))
    out = []
    for x, w, b in shards:
        y = (x.astype(np.float32) - mean[:, None]) * inv_std[:, None] * w + b
        out.append((y.astype(x.dtype), mean.astype(x.dtype), inv_std.astype(x.dtype)))
    return out


def backward(shards):
    """Args: shards: [(dy, x, mean, inv_std)] of one group. Returns: [(dx, dw, db)]."""
    hidden = sum(x.shape[1] for _, x, _, _ in shards)
    parts = []
    for dy, x, mean, inv_std in shards:
        g = dy.astype(np.float32)
        xhat = (x.astype(np.float32) - mean.astype(np.float32)[:, None]) * \
            inv_std.astype(np.float32)[:, None]
        parts.append((g, xhat, inv_std.astype(np.float32)))
    s1 = sum(g.sum(axis=1) for g, _, _ in parts)[:, None] / hidden
    s2 = sum((g * xhat).sum(axis=1) for g, xhat, _ in parts)[:, None] / hidden
    out = []
    for (g, xhat, inv), (dy, x, _, _) in zip(parts, shards):
        dx = inv[:, None] * (g - s1 - xhat * s2)
        out.append((dx.astype(x.dtype), (g * xhat).sum(axis=0).astype(x.dtype),
                    g.sum(axis=0).astype(x.dtype)))
    return out


def _run(rt, op, args):
    a = op.attrs
    if op.kind == _KIND:
        x, w, b = args
        res = rt.meet(op, (x, w, b), lambda vals: _per_group(
            a["grouping"], vals, lambda sh: forward(sh, a["epsilon"])))
    else:
        dy, x, _w, mean, inv_std = args
        res = rt.meet(op, (dy, x, mean, inv_std),
                      lambda vals: _per_group(a["grouping"], vals, backward))
    rt.collective_bytes += 2 * (a["grouping"][2] - 1) * 2 * op.inputs[1 if op.kind == _GRAD
                                                                     else 0].shape[0] * 4
    return list(res)


def _check(op):
    n, stride, size = op.attrs["grouping"]
    if n != op.graph.ir.replication_factor or n % (stride * size):
        raise PopartError(f"LayerNormDistributedOp {op.inputs[0].id}: its group does not "
                          f"partition the {op.graph.ir.replication_factor} replicas")


register(_KIND, _rule, _run, runtime=True, multi=True)
register(_GRAD, _grad_rule, _run, runtime=True, multi=True)
for _kind in (_KIND, _GRAD):
    PREPARE[_kind] = lambda op, plan_of: op
    COMPILE_CHECKS[_kind] = _check


def _grad(ctx, i):
    """LayerNormDistributedGradOp: reads dy, x, w and the forward's mean and inv_std."""
    if _GRAD not in ctx.cache:
        a = ctx.op.attrs
        ctx.cache[_GRAD] = emit(_GRAD, {"in0": ctx.dy(0), "in1": ctx.x(0), "in2": ctx.x(1),
                                        "in3": ctx.y(1), "in4": ctx.y(2)}, dict(a),
                                names=["x_grad", "scale_grad", "b_grad"])
    return ctx.cache[_GRAD][i]


grads.RULES[_KIND] = (lambda op: (0, 1, 2), _grad)


class LayerNormDistributedOp:
    """``layer_norm_distributed_binding.LayerNormDistributedOp``."""

    @staticmethod
    def createOpInGraph(graph, inputs, outputs, epsilon, group, settings):  # noqa: N802
        """Returns: the created op (outputs: y, mean, inv_std)."""
        return create(graph, _KIND, inputs, outputs,
                      {"epsilon": float(epsilon), "grouping": grouping_of(group)})
