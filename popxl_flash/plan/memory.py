"""Memory of one attention call beyond its own inputs and outputs, and the default budget.

``memory_budget=`` (bytes) on every planning entry point bounds what a call may hold live
beyond its inputs and outputs: the emulator's ``peak_live_bytes`` minus the bytes of the
call's inputs and outputs (constants, such as the mask tables, count against the budget).
The functions here are upper bounds of that figure, held to the emulator's profile by
``tests/test_memory_budget.py`` (never below it; at most 2.5x above it for large blocks).

Default budget (:data:`DEFAULT_MEMORY_FRACTION` of one IPU's In-Processor-Memory, ~224 MiB on
a GC200): an assumption. Attention is one part of a layer: the same memory holds the layer's
weights (or their shards), its other activations, the optimiser state of a training step,
Poplar's code and exchange buffers; a quarter leaves the rest three quarters. It holds the
float32 gradient state of the backward (``dq, dk, dv``: ``4 (G Lq + 2 Gk Lkv) D`` bytes, which
no chunking avoids) at the per-IPU head counts of Graphcore's tensor-parallel model scripts.
Pass ``memory_budget=`` to trade memory for time either way; when no chunking fits, the
choice says so (``pf.explain``), and an explicit ``memory_budget`` raises ``ValueError``.
"""
import numbers

from popxl_flash.plan import ipu_time
from popxl_flash.plan import steps as _steps

#: Fraction of one IPU's memory a call may hold by default (assumption, see module docstring).
DEFAULT_MEMORY_FRACTION = 1 / 4

_F32 = 4

#: Float32 block-sized temporaries live at once at the peak of a step ``[G, cq, ckv]``
#: (forward: scores and probabilities; backward: P, dP, dS, the stacked ``[P; dS]`` and its
#: cast or transposed copy, by dtype), an upper bound of the emulator's liveness on this
#: version's graphs: at float32 blocks of 512 x 512 a backward step holds about 4 (measured
#: 3.5-4.0 over the margin), float16 about 3.
FORWARD_BLOCKS = 2.0
BACKWARD_BLOCKS = {"float16": 3.25, "float32": 4.25}
#: Added for the backward's row steps (inline, one per q chunk, on the unpadded tensors, so no
#: padded copies): blocks and float32 k/v-row elements ``[Gk, cols, D]`` (a step's ``[dv;
#: dk]`` product and sum), fitted to the emulator's peak over 600 drawn row-pass shapes.
ROW_STEP_BLOCKS, ROW_STEP_KV_ROWS = 0.25, 3.0
#: Float32 row-sized temporaries ``[G, cq, D]`` and ``[Gk, ckv, D]`` at once.
FORWARD_ROWS, BACKWARD_ROWS = 2.0, 2.0
#: Float32 q-row-sized tensors ``[G, Lq_pad, D]`` live at the peak besides the state (the
#: scaled q, casts of the stashed operands), an upper bound of the emulator's on this version's
#: graphs: forward, backward.
FORWARD_FULL_ROWS, BACKWARD_FULL_ROWS = 1.5, 3.0
#: The same for k/v-row-sized tensors ``[Gk, Lkv_pad, D]`` (k and v stacked once per call for
#: one slice per step), forward and backward.
FORWARD_FULL_KV_ROWS, BACKWARD_FULL_KV_ROWS = 1.0, 2.5
#: Proportional margin over the terms above: the emulator's liveness order varies with the
#: graph's op order, which small shapes show as a few tens of bytes over the terms.
MARGIN = 1.10
#: Small tensors of any pass (scalars, counters, one-element constants): a fixed allowance.
FIXED_BYTES = 16384
#: Bytes of the loop tables per step (first q row, first kv column, pattern id: int32).
TABLE_BYTES_PER_STEP = 12
#: A pass of one block (a straight line, no loop state): bytes per score element ``[G, Lq,
#: Lkv]``, per float32 q-row element ``[G, Lq, D]`` and per float32 k/v-row element ``[Gk,
#: Lkv, D]`` live at its peak, by (dtype, backward): the least upper bound of the emulator's
#: peak over 40 drawn shapes (G, Gk, Lq, Lkv, D), both masks, with :data:`SINGLE_MARGIN`.
#: Forward: the scores and the softmax (float32), the cast of P; backward: P, dP, dS and a
#: cast, plus the float32 gradients.
SINGLE_BYTES = {("float16", False): (8.0, 0.0, 0.5), ("float16", True): (12.0, 0.5, 2.0),
                ("float32", False): (8.0, 0.0, 1.5), ("float32", True): (12.0, 0.0, 1.0)}
#: Row passes: float32 k/v-row elements ``[Gk, Lkv, D]`` live across the passes (the scaled
#: k they slice, and a pass's copies of its k/v columns), by dtype: the least upper bound of
#: the emulator's peak over 950 drawn shapes and chunkings, rounded up.
ROW_PASS_KV_ROWS = {"float16": 1.75, "float32": 2.5}
#: Proportional margin of the one-block bound (its terms are fitted, not summed).
SINGLE_MARGIN = 1.02
#: Naive attention: bytes per score element ``[G, Lq, Lkv]`` live at its peak (float32 scores,
#: their scaled and masked copies, the softmax, its cast), the least upper bound of the
#: emulator's peak over score-dominated shapes (L 128-512), rounded up (float16: 7.06 forward,
#: 10.2 backward; float32: 6.69 and 9.45; the bound once used 6.5, 10, 5 and 7, up to 30%
#: below the peak in float32), plus the bool mask ``[Lq, Lkv]``.
NAIVE_BYTES_PER_SCORE = {("float16", False): 7.25, ("float16", True): 10.5,
                         ("float32", False): 7.0, ("float32", True): 9.75}
#: ... and float32 row elements ``[G, L, D]`` at its peak, forward and backward (fitted on the
#: same shapes and on row-dominated ones, D up to 128: 1.25 and 3.8 needed).
NAIVE_ROWS = {False: 1.5, True: 4.0}


def default_budget(constants=None) -> int:
    """The default ``memory_budget``: :data:`DEFAULT_MEMORY_FRACTION` of one IPU's memory."""
    c = constants or ipu_time.current()
    return int(c.device_bytes * DEFAULT_MEMORY_FRACTION)


def check_budget(memory_budget, name="memory_budget"):
    """``memory_budget`` as an int number of bytes (``None``: :func:`default_budget`).

    Raises:
        TypeError: not an integer. ValueError: not positive.
    """
    if memory_budget is None:
        return default_budget()
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral):
        raise TypeError(f"{name} must be an int number of bytes or None (the default: "
                        f"{default_budget():,} bytes), got {name}={memory_budget!r} "
                        f"({type(memory_budget).__name__})")
    if memory_budget <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {name}="
                         f"{memory_budget}")
    return int(memory_budget)


def _item(dtype):
    return 2 if dtype == "float16" else 4


def flash_bytes(sched, *, groups, kv_groups, head_dim, dtype, backward, steps):
    """Upper bound of one flash pass's live bytes beyond its inputs and outputs.

    Args:
        sched: the :class:`~popxl_flash.plan.schedule.BlockSchedule`.
        groups, kv_groups, head_dim: G, Gk, D; dtype: the input dtype name.
        backward: the stash-mode backward (else the forward).
        steps: the pass's loop steps (:func:`popxl_flash.plan.steps.loop_steps`).

    Returns:
        int bytes.
    """
    G, Gk, D, item = groups, kv_groups, head_dim, _item(dtype)
    if _steps.single_block(sched):  # (no segment ids: the choice prices those loops apart)
        terms = _single_terms(dtype, backward, G, Gk, sched.Lq, sched.Lkv, D)
        return int(SINGLE_MARGIN * terms + sched.patterns_nbytes + 8 * G * sched.Lq
                   + FIXED_BYTES)
    if not backward and _steps.row_passes(sched):
        return _row_pass_bytes(sched, G, Gk, D, dtype)
    lq, lkv = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    cq, ckv = sched.chunk_q, sched.chunk_kv
    tables = sched.patterns_nbytes + TABLE_BYTES_PER_STEP * steps
    rows = backward and _steps.row_passes(sched)
    if rows:  # inline steps on the unpadded tensors, the largest one's block
        plan = _steps.row_pass_plan(sched)
        lq, lkv = sched.Lq, sched.Lkv
        cq, ckv = max(((p.rows[1] - p.rows[0], p.cols[1] - p.cols[0]) for p in plan),
                      key=lambda rc: rc[0] * rc[1])
        tables = sum(p.pattern_nbytes for p in plan)
    pad_q, pad_kv = lq > sched.Lq, lkv > sched.Lkv
    block = G * cq * ckv * _F32
    if not backward:
        state = G * lq * (D + 2) * _F32  # m, l, acc
        padded = pad_q * G * lq * D * item + pad_kv * 2 * Gk * lkv * D * item
        temps = FORWARD_BLOCKS * block + FORWARD_ROWS * (G * cq + Gk * ckv) * D * _F32
        temps += (FORWARD_FULL_ROWS * G * lq + FORWARD_FULL_KV_ROWS * Gk * lkv) * D * _F32
    else:
        state = (G * lq * D + 2 * Gk * lkv * D + 2 * G * lq) * _F32  # dq, dk, dv; Dvec, lse
        padded = pad_q * 3 * G * lq * D * item + pad_kv * 2 * Gk * lkv * D * item
        temps = (BACKWARD_BLOCKS[dtype] + rows * ROW_STEP_BLOCKS) * block + (
            BACKWARD_ROWS * G * cq + (BACKWARD_ROWS + rows * ROW_STEP_KV_ROWS) * Gk * ckv) \
            * D * _F32
        temps += (BACKWARD_FULL_ROWS * G * lq + BACKWARD_FULL_KV_ROWS * Gk * lkv) * D * _F32
    return int(MARGIN * (state + padded + tables + temps) + FIXED_BYTES)


def _single_terms(dtype, backward, G, Gk, rows, cols, D):
    """The fitted terms of a one-block pass on ``rows x cols`` (:data:`SINGLE_BYTES`)."""
    per_score, per_q, per_kv = SINGLE_BYTES[dtype, bool(backward)]
    return per_score * G * rows * cols + (per_q * G * rows + per_kv * Gk * cols) * D * _F32


def _row_pass_bytes(sched, G, Gk, D, dtype):
    """Row passes (:func:`popxl_flash.plan.steps.row_passes`) run one after another: the
    largest pass's one-block bound, the scaled k they all slice, every pass's results until
    the concats, and the constants (patterns, selects, the results of rows that see nothing)."""
    item, worst, constants = _item(dtype), 0.0, 0
    for rp in _steps.row_pass_plan(sched):
        rows, cols = rp.rows[1] - rp.rows[0], rp.cols[1] - rp.cols[0]
        if not cols:
            constants += G * rows * (D * item + _F32)
            continue
        worst = max(worst, _single_terms(dtype, False, G, Gk, rows, cols, D))
        constants += rp.pattern_nbytes + rp.seen_nbytes
    results = G * sched.Lq * (D * item + _F32)  # out and lse of every pass
    kv_rows = ROW_PASS_KV_ROWS[dtype] * Gk * sched.Lkv * D * _F32
    return int(SINGLE_MARGIN * worst + kv_rows + results + constants + 8 * G * sched.Lq
               + FIXED_BYTES)


def flash_lower_bound(*, groups, kv_groups, q_len, kv_len, chunk_q, chunk_kv, head_dim):
    """A cheap lower bound of :func:`flash_bytes` (no schedule needed): the backward's float32
    gradient state and its block temporaries. The choice skips candidates above the budget by
    it without planning them (a block as long as a 32K sequence would make the planner
    materialise its mask)."""
    state = (groups * q_len * head_dim + 2 * kv_groups * kv_len * head_dim) * _F32
    # the least of any structure's block term, either dtype: one block's, or a step's
    blocks = min(min(BACKWARD_BLOCKS.values()),
                 min(SINGLE_BYTES[d, True][0] for d in ("float16", "float32")) / _F32)
    return int(state + blocks * groups * chunk_q * chunk_kv * _F32)


def naive_bytes(*, groups, q_len, kv_len, head_dim, dtype, backward, masked):
    """Live bytes of naive attention (:mod:`popxl_flash.checks.naive`) beyond its inputs and
    outputs: the score-sized tensors, the mask, a few rows."""
    scores = groups * q_len * kv_len
    rows = groups * max(q_len, kv_len) * head_dim * _F32 * NAIVE_ROWS[bool(backward)]
    return int(NAIVE_BYTES_PER_SCORE[(dtype, bool(backward))] * scores
               + (q_len * kv_len if masked else 0) + rows + FIXED_BYTES)
