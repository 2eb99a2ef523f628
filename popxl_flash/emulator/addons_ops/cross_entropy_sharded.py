"""popxl-addons' ``CrossEntropyShardedOp`` (``ops/cross_entropy_sharded_loss/
crossentropysharded{,x}.cpp``): cross entropy of logits whose class axis is sharded over the
replicas of a group (tensor parallelism).

Inputs ``logits [N, C / G]`` (this replica's classes), ``indices [N]`` (the true class, already
shifted into this shard's range: out-of-range values belong to another shard). ``setup``:
logits of rank 2, indices of rank 1, the same N. Outputs ``loss [N]`` and the sharded
``-log softmax [N, C / G]``, in the logits' dtype.

Forward (``CrossEntropyShardedOpx``), per group: the row maximum all-reduced (max), the
translated logits ``x - max`` and their exponentials, the row sums (float32 partials, rounded
to the dtype) all-reduced (add), ``nls = -(x - max - log(sum))``; each replica takes ``nls`` at
its in-range indices (0 elsewhere) and the group sums those partial losses (add).

Gradient (``CrossEntropyShardedGradOpx``; inputs the loss gradient, the loss, ``nls``, the
logits and the indices): ``exp(-nls) * dloss`` with ``-dloss`` added at each in-range index
(``popops::groupedMultiUpdateAdd``, which skips out-of-range indices), no collective.

Collectives as the emulator's (``ops/collectives.py``): float16 sums accumulate in float32 in
rank order and round once.
"""
import numpy as np

from .. import grads
from ..errors import PopartError
from ..ops import collectives as coll
from ..registry import COMPILE_CHECKS, PREPARE, emit, register
from ._binding import create, grouping_of

_KIND, _GRAD = "addons_cross_entropy_sharded", "addons_cross_entropy_sharded_grad"
_FLOATS = ("float16", "float32")
_INDICES = ("int32", "uint32")


def _rule(logits, indices, grouping, available_memory_proportion):
    if logits.rank != 2:
        raise PopartError("CrossEntropyShardedOp::setup logits must be of rank 2. e.g. "
                          "(n_samples, sharded_n_classes)")
    if indices.rank != 1:
        raise PopartError("CrossEntropyShardedOp::setup indices must be of rank 1. e.g. "
                          "(n_samples,)")
    if logits.shape[0] != indices.shape[0]:
        raise PopartError("CrossEntropyShardedOp::setup indices and logits must have the same "
                          "number of samples. shapes should be logits=(n_samples, "
                          "sharded_n_classes); indices=(n_samples,)")
    n, c = logits.shape
    return [((n,), logits.dtype), ((n, c), logits.dtype)]


def _grad_rule(dloss, loss, nls, logits, indices, grouping, available_memory_proportion):
    return [(logits.shape, logits.dtype)]


def _in_range(indices, classes):
    idx = np.asarray(indices).astype(np.int64)
    return idx, (idx >= 0) & (idx < classes)


def forward(members):
    """Args: members: [(logits, indices)] of one group in rank order. Returns: [(loss, nls)]."""
    dt = members[0][0].dtype
    row_max = coll._reduce([x.max(axis=1) for x, _ in members], "max")
    translated = [(x - row_max[:, None]).astype(dt) for x, _ in members]
    partial = [np.exp(t).astype(dt).sum(axis=1, dtype=np.float32).astype(dt)
               for t in translated]
    log_den = np.log(coll._reduce(partial, "add")).astype(dt)
    nls = [(-(t - log_den[:, None])).astype(dt) for t in translated]
    losses = []
    for (x, indices), s in zip(members, nls):
        idx, ok = _in_range(indices, x.shape[1])
        rows = np.arange(x.shape[0])
        losses.append(np.where(ok, s[rows, np.where(ok, idx, 0)], 0).astype(dt))
    loss = coll._reduce(losses, "add")
    return [(loss.copy(), s) for s in nls]


def backward(dloss, nls, indices):
    """The grad op on one replica's arrays. Returns: the logits' gradient."""
    dt = nls.dtype
    grad = (np.exp(-nls).astype(dt) * dloss[:, None]).astype(dt)
    idx, ok = _in_range(indices, nls.shape[1])
    rows = np.nonzero(ok)[0]
    grad[rows, idx[rows]] = (grad[rows, idx[rows]] + dloss[rows] * dt.type(-1)).astype(dt)
    return grad


def _run(rt, op, args):
    a = op.attrs
    if op.kind == _GRAD:
        dloss, _loss, nls, _logits, indices = args
        return [backward(dloss, nls, indices)]
    logits, indices = args

    def combine(values):
        out = [None] * len(values)
        for members in coll.groups_of(a["grouping"]):
            for r, res in zip(members, forward([values[r] for r in members])):
                out[r] = res
        return out

    loss, nls = rt.meet(op, (logits, indices), combine)
    size, n = a["grouping"][2], logits.shape[0]
    rt.collective_bytes += 3 * 2 * (size - 1) * n * logits.dtype.itemsize  # three all-reduces
    return [loss, nls]


def _check(op):
    """What the Opx's lowering refuses: logits of a non-float type (exp, log), indices of a
    non-integer type (cast to UNSIGNED_INT and compared as integers), a group that does not
    partition the replicas."""
    logits, indices = op.inputs[-2:] if op.kind == _GRAD else op.inputs
    if logits.dtype.name not in _FLOATS:
        raise PopartError(f"CrossEntropyShardedOp {logits.id}: logits must be float16 or "
                          f"float32, got {logits.dtype.name}")
    if indices.dtype.name not in _INDICES:
        raise PopartError(f"CrossEntropyShardedOp {indices.id}: indices must be int32 or "
                          f"uint32, got {indices.dtype.name}")
    n, stride, size = op.attrs["grouping"]
    if n != op.graph.ir.replication_factor or n % (stride * size):
        raise PopartError(f"CrossEntropyShardedOp {logits.id}: its group does not partition "
                          f"the {op.graph.ir.replication_factor} replicas")


register(_KIND, _rule, _run, runtime=True, multi=True)
register(_GRAD, _grad_rule, _run, runtime=True)
for _kind in (_KIND, _GRAD):
    PREPARE[_kind] = lambda op, plan_of: op
    COMPILE_CHECKS[_kind] = _check


def _grad(ctx, i):
    """CrossEntropyShardedGradOp: reads dE/dloss, the loss, nls, the logits and indices."""
    return emit(_GRAD, {"in0": ctx.dy(0), "in1": ctx.y(0), "in2": ctx.y(1), "in3": ctx.x(0),
                        "in4": ctx.x(1)}, dict(ctx.op.attrs),
                names=["cross_entropy_sharded_grad"])[0]


grads.RULES[_KIND] = (lambda op: (0,), _grad)


class CrossEntropyShardedOp:
    """``crossentropysharded_binding.CrossEntropyShardedOp``."""

    @staticmethod
    def createOpInGraph(graph, inputs, outputs, group, availableMemoryProportion,  # noqa: N802,N803
                        settings):
        """Returns: the created op (outputs: loss, -log softmax)."""
        return create(graph, _KIND, inputs, outputs,
                      {"grouping": grouping_of(group),
                       "available_memory_proportion": float(availableMemoryProportion)})
