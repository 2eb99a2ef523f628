"""Provisional pass counts (replaced by the fitted model)."""
from dataclasses import dataclass

from popxl_flash.plan import costmodel, schedule as _schedule, steps as _steps


@dataclass(frozen=True)
class PassCounts:
    supersteps: int
    matmul_flops: int
    vector_elements: int
    bytes_copied: int
    iterations: int


def pass_counts(Lq, Lkv, chunk_q, chunk_kv, *, head_dim, groups, kv_groups, dtype, causal,
                window, backward):
    sched = _schedule.plan(Lq, Lkv, chunk_q, chunk_kv, causal=causal, window=window)
    order = "kv_major" if backward else "q_major"
    groups_ = _steps.step_groups(sched, order)
    w = (costmodel.OPS_BACKWARD if backward else costmodel.OPS_FORWARD)[dtype]
    ops = costmodel._ops(w, groups_)
    cells = sum(g.steps * g.rows * g.cols for g in groups_)
    rows = sum(g.steps * g.rows for g in groups_)
    vec = groups * (cells * (9 if backward else 8) + rows * head_dim * 4)
    flops = (sched.backward_flops if backward else sched.forward_flops)(head_dim, groups).executed
    copied = sum(costmodel.pass_copies(sched, groups=groups, head_dim=head_dim, dtype=dtype,
                                       backward=backward, kv_groups=kv_groups).values())
    return PassCounts(ops, flops, vec, copied, sum(g.steps for g in groups_))
