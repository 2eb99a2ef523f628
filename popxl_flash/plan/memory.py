"""Memory of one attention call beyond its own inputs and outputs, and the default budget.

``memory_budget=`` (bytes) on every planning entry point bounds what a call may hold live
beyond its inputs and outputs: the emulator's ``peak_live_bytes`` minus the bytes of the
call's inputs and outputs (constants, such as the mask tables, count against the budget).
The functions here are upper bounds of that figure, held to the emulator's profile by
``tests/test_memory_budget.py`` and ``tests/test_memory_model.py`` (never below it).

Default budget (``memory_budget=None``): per pass, :data:`DEFAULT_IO_FACTOR` times the pass's
own inputs' and outputs' bytes plus :data:`DEFAULT_FIXED_BYTES`, at most a quarter of one IPU
(:func:`default_budget`): flash
attention's promise is that the L x L score matrix is never materialised, so by default a call's
temporaries stay O(L) at every shape; within that the choice takes the least modelled time, and
where no chunking meets it the least memory (a default never refuses). ``memory_budget=``
(bytes, both passes) is how a user spends more memory for speed; an explicit budget nothing
meets raises ``ValueError``.

The looped passes' and the backward's row steps' bound is a max over phases (setup, loops,
finish) of explicit sums of the live tensors of ``popxl_flash/graph/`` (one term per tensor,
commented), with fitted step temporaries (:data:`FORWARD_STEP`, :data:`BACKWARD_STEP`,
:data:`ROW_STEP`); ``tests/test_memory_model.py`` holds it within 1.2x + 1 MiB of the emulator's
peak. One-block passes and the forward's row passes keep fitted per-element terms (row passes:
an upper bound, up to ~2x loose).
"""
import numbers
from dataclasses import dataclass

from popxl_flash.plan import ipu_time
from popxl_flash.plan import steps as _steps

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
#: Small tensors of a flash pass (per-step scalars, slices of a few rows, row statistics of
#: short calls) beyond its terms: a fixed allowance, within the tests' 1 MiB floor.
LOOP_FIXED_BYTES = 65536
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
#: A proportional margin on the looped passes' and row passes' phases: on the _-view graphs
#: (views, not copies) the phases and step terms fitted to the earlier graphs fell up to
#: ~1% short at a few drawn shapes (grouped-query, short kv chunks); 3% until refitted.
REFIT_MARGIN = 1.03
#: Proportional margin of the one-block bound (its terms are fitted, not summed; 1.08: on the
#: _-view graphs the earlier fit fell up to ~2% short for grouped-query backward blocks, until it is
#: refitted).
SINGLE_MARGIN = 1.08
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


#: The default budget of a pass: this many times the bytes of its own inputs and outputs ...
DEFAULT_IO_FACTOR = 2
#: ... plus this many bytes (the small tensors of short calls, whose I/O is a few KiB) ...
DEFAULT_FIXED_BYTES = 4 * 2 ** 20
#: ... and at most this fraction of one IPU's memory (calls whose I/O nears the IPU's own
#: memory: attention is one part of a layer, whose weights, other activations and Poplar's
#: code share the IPU; ~224 MiB on a GC200).
DEFAULT_DEVICE_FRACTION = 1 / 4


def io_bytes(*, groups, kv_groups, q_len, kv_len, head_dim, dtype, backward):
    """Bytes of a pass's own inputs and outputs: forward q, k, v, out (input dtype) and lse
    (float32 ``[G, Lq]``); backward dout, q, k, v, out, lse, dq, dk, dv.

    Returns:
        int bytes.
    """
    item = _item(dtype)
    q = groups * q_len * head_dim * item
    kv = kv_groups * kv_len * head_dim * item
    lse = groups * q_len * _F32
    return (4 * q + 4 * kv + lse) if backward else (2 * q + 2 * kv + lse)


def default_budget(*, groups, kv_groups, q_len, kv_len, head_dim, dtype, backward) -> int:
    """The default ``memory_budget`` of one pass: :data:`DEFAULT_IO_FACTOR` times its
    :func:`io_bytes` plus :data:`DEFAULT_FIXED_BYTES`, so that with no ``memory_budget`` a
    call's temporaries stay O(L), as flash attention promises (module docstring), and at most
    :data:`DEFAULT_DEVICE_FRACTION` of one IPU's memory.

    Returns:
        int bytes.
    """
    io = io_bytes(groups=groups, kv_groups=kv_groups, q_len=q_len, kv_len=kv_len,
                  head_dim=head_dim, dtype=dtype, backward=backward)
    device = ipu_time.current().device_bytes * DEFAULT_DEVICE_FRACTION
    return int(min(DEFAULT_IO_FACTOR * io + DEFAULT_FIXED_BYTES, device))


def pass_budgets(memory_budget, *, groups, kv_groups, q_len, kv_len, head_dim, dtype):
    """The ``(forward, backward)`` budgets of a call: an explicit ``memory_budget`` (already
    checked, :func:`check_budget`) for both, else each pass's :func:`default_budget`.

    Returns:
        ``(int, int)`` bytes.
    """
    if memory_budget is not None:
        return int(memory_budget), int(memory_budget)
    call = dict(groups=groups, kv_groups=kv_groups, q_len=q_len, kv_len=kv_len,
                head_dim=head_dim, dtype=dtype)
    return tuple(default_budget(backward=b, **call) for b in (False, True))


def check_budget(memory_budget, name="memory_budget"):
    """``memory_budget`` as an int number of bytes, or ``None`` (the default: each pass's
    :func:`default_budget`, which depends on the call's shapes).

    Raises:
        TypeError: not an integer. ValueError: not positive.
    """
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral):
        raise TypeError(f"{name} must be an int number of bytes or None (the default: "
                        f"{DEFAULT_IO_FACTOR} x the call's own inputs' and outputs' bytes + "
                        f"{DEFAULT_FIXED_BYTES // 2 ** 20} MiB), got {name}={memory_budget!r} "
                        f"({type(memory_budget).__name__})")
    if memory_budget <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {name}="
                         f"{memory_budget}")
    return int(memory_budget)


def _item(dtype):
    return 2 if dtype == "float16" else 4


def flash_bytes(sched, *, groups, kv_groups, head_dim, dtype, backward, steps, lean=False):
    """Upper bound of one flash pass's live bytes beyond its inputs and outputs.

    Args:
        sched: the :class:`~popxl_flash.plan.schedule.BlockSchedule`.
        groups, kv_groups, head_dim: G, Gk, D; dtype: the input dtype name.
        backward: the stash-mode backward (else the forward).
        steps: the pass's loop steps (:func:`popxl_flash.plan.steps.loop_steps`; the step
            tables' bytes grow with them).
        lean: the pass's memory-lean structure (looped passes only: :func:`lean_bytes`).

    Returns:
        int bytes.
    """
    G, Gk, D = groups, kv_groups, head_dim
    if _steps.single_block(sched):  # (no segment ids: the choice prices those loops apart)
        terms = _single_terms(dtype, backward, G, Gk, sched.Lq, sched.Lkv, D)
        # the forward's out is not live at its peak (the softmax): its bytes are not held;
        # where rows see nothing, ``where(seen, out, 0)`` copies out while out is live
        out = 0 if backward else G * sched.Lq * D * _item(dtype)
        seen = out if sched.num_empty_rows else 0
        # ... but is at ``P v``, with P (float32) or its cast, the k/v terms, and the float32
        # ``P v`` and ``(P v) / l`` ([G, Lq, D] each: the softmax is written out, normalised
        # after the matmul)
        per_kv = SINGLE_BYTES[dtype, bool(backward)][2]
        pv = (_item(dtype) * G * sched.Lq * sched.Lkv + per_kv * Gk * sched.Lkv * D * _F32
              + 2 * G * sched.Lq * D * _F32)
        # (row statistics: 16 bytes per q row, four float32 [G, Lq, 1] tensors)
        return int(max(SINGLE_MARGIN * terms - out, seen, 0 if backward else pv)
                   + sched.patterns_nbytes + 16 * G * sched.Lq + LOOP_FIXED_BYTES)
    if not backward and _steps.row_passes(sched):
        return _row_pass_bytes(sched, G, Gk, D, dtype)
    shape = _LoopShape.of(sched, G, Gk, D, dtype, backward, steps)
    if lean and not shape.row_steps:
        return lean_bytes(sched, shape, G, Gk, D, backward)
    phases = _backward_phases(shape) if backward else _forward_phases(shape)
    return int(REFIT_MARGIN * max(phases.values()) + LOOP_FIXED_BYTES)


@dataclass(frozen=True)
class _LoopShape:
    """Byte sizes a looped pass (or the backward's inline row steps) is made of.

    Attributes:
        q, kv: bytes of one unpadded ``[G, Lq, D]`` / ``[Gk, Lkv, D]`` tensor in the input
            dtype; q_pad, kv_pad: the same padded to whole chunks (equal without padding;
            the row steps run unpadded).
        q32, kv32, q32_pad, kv32_pad: the same in float32.
        rows, rows_pad: bytes of a float32 ``[G, Lq, 1]`` (unpadded, padded).
        block: a float32 ``[G, rows, cols]`` score block of the largest step;
        step_q, step_kv: float32 ``[G, rows, D]``, ``[Gk, cols, D]`` of the longest rows and
            columns of any step.
        outputs: the pass's outputs (out and lse; dq, dk, dv), which are not live until
            its end.
        constants: the step tables and the static patterns.
        item: the input dtype's bytes; dtype: its name; gqa: ``Gk < G`` (the steps fold
            q's groups, with copies of the folded q rows); row_steps: the backward's inline
            row steps (static slices, no loop).
    """

    q: int
    kv: int
    q_pad: int
    kv_pad: int
    q32: int
    kv32: int
    q32_pad: int
    kv32_pad: int
    rows: int
    rows_pad: int
    block: int
    step_q: int
    step_kv: int
    outputs: int
    constants: int
    item: int
    dtype: str
    gqa: bool
    row_steps: bool = False

    @classmethod
    def of(cls, sched, G, Gk, D, dtype, backward, steps):
        item = _item(dtype)
        lq, lkv = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
        groups = _steps.step_groups(sched, "kv_major" if backward else "q_major")
        # the largest step's block, and the longest rows and columns of any step
        block = max(g.rows * g.cols for g in groups)
        cq, ckv = max(g.rows for g in groups), max(g.cols for g in groups)
        constants = sched.patterns_nbytes + TABLE_BYTES_PER_STEP * steps
        row_steps = backward and _steps.row_passes(sched)
        if row_steps:  # inline steps on the unpadded tensors
            plan = _steps.row_pass_plan(sched)
            lq, lkv = sched.Lq, sched.Lkv
            sizes = [(p.rows[1] - p.rows[0], p.cols[1] - p.cols[0]) for p in plan]
            block = max(r * c for r, c in sizes)
            cq, ckv = max(r for r, _ in sizes), max(c for _, c in sizes)
            constants = sum(p.pattern_nbytes for p in plan)
        Lq, Lkv = sched.Lq, sched.Lkv
        outputs = ((G * Lq + 2 * Gk * Lkv) * D * item if backward
                   else G * Lq * (D * item + _F32))
        return cls(q=G * Lq * D * item, kv=Gk * Lkv * D * item, q_pad=G * lq * D * item,
                   kv_pad=Gk * lkv * D * item, q32=G * Lq * D * _F32, kv32=Gk * Lkv * D * _F32,
                   q32_pad=G * lq * D * _F32, kv32_pad=Gk * lkv * D * _F32,
                   rows=G * Lq * _F32, rows_pad=G * lq * _F32, block=G * block * _F32,
                   step_q=G * cq * D * _F32, step_kv=Gk * ckv * D * _F32, outputs=outputs,
                   constants=constants, item=item, dtype=dtype, gqa=Gk < G,
                   row_steps=row_steps)


def _stack(one, padded):
    """Peak bytes of ``blocks.stack`` of two ``one``-byte tensors padded to ``padded`` each
    (``blocks.pad_rows``): each part's reshape copy and their concat (``4 one``), or with
    padding the concat, the zeros and the padded concat (``2 one + 2 (padded - one) + 2
    padded``): ``4 padded`` either way."""
    return 4 * padded if padded > one else 4 * one


def _forward_phases(s):
    """Bytes beyond the inputs at the forward's peaks, by phase (``graph/forward.py``
    ``FlashAttention.build``, looped branch, in op order; an op's output is allocated before
    its dead inputs are freed, as the emulator's liveness counts). The outputs are not live
    before their ops: every phase is counted less their bytes (at the finish, the live
    float32 out is counted in its terms)."""
    state = s.q32_pad + 2 * s.rows_pad  # acc | l | m, float32 [G, Lq_pad, D + 2]
    q_pad = s.q_pad if s.q_pad > s.q else 0  # blocks.pad_rows(q): a padded copy
    # the stacked [k; v], padded; a concat_ of views of k * scale (a copy) and v, so with
    # padding the scaled k stays live with v's storage (the emulator frees a view group with
    # its last member; v is an input)
    kv = 2 * s.kv_pad + (s.kv if s.kv_pad > s.kv else 0)
    phases = {
        # k * scale (a copy, where the scale folds) while q is padded: zeros and concat
        "pad q": s.kv + 2 * q_pad,
        # stack([k, v]): reshape copies and the concat (and its padding), q_pad held
        "stack kv": q_pad + _stack(s.kv, s.kv_pad),
        # state = where(is_m, INITIAL_MAX, init(0)): both full-length tensors at once
        "init state": q_pad + kv + 2 * state,
        # the loops: state, operands, one step's temporaries
        "loop": q_pad + kv + state + _forward_step(s),
        # finish: the state's m, l, acc sliced (copies) while it is live
        "finish state": 2 * state,
        # then, the state freed: acc's slice (or its unpadded copy) and acc / l (float32 out,
        # or cast to float16 out after acc is freed), m, l and the lse's terms
        # (6 row terms: m, l, l's where, log(l), m + log(l) and the lse's select)
        "finish": s.q32_pad + s.q32 + 6 * s.rows_pad,
    }
    phases = {k: v - s.outputs for k, v in phases.items()}
    # the constants (tables, patterns) live for the whole run
    return {k: v + s.constants for k, v in phases.items()}


#: A forward step's temporaries at its peak (``forward.softmax_block`` on the step's slices),
#: by (dtype, grouped-query): float32 score blocks (the scores and their shifted or masked
#: copy, the probabilities and their cast), float32 q rows ``[G, rows, D]`` (the state slice
#: ``acc | l | m``, its ``acc | l`` and ``m`` slices, ``p v``, the update and its concats, the
#: folded q copy) and k/v rows ``[Gk, cols, D]`` in float32 bytes (the ``[k_j; v_j]`` slice,
#: the copies of its parts, k_j's transpose): the least upper bound of the emulator's over the
#: drawn shapes of ``tests/test_memory_model.py``.
FORWARD_STEP = {("float16", False): (2.25, 3.0, 1.5), ("float16", True): (2.0, 2.75, 3.5),
                ("float32", False): (2.25, 2.5, 3.5), ("float32", True): (2.0, 3.0, 3.5)}


def _forward_step(s):
    """Upper bound of one forward step's temporaries (:data:`FORWARD_STEP`)."""
    blocks, q_rows, kv_rows = FORWARD_STEP[s.dtype, s.gqa]
    return blocks * s.block + q_rows * s.step_q + kv_rows * s.step_kv


def _backward_phases(s):
    """Bytes beyond the inputs at the backward's peaks, by phase (``graph/backward.py``
    ``FlashAttentionGrad.build``, looped and row-step branches, in op order). The outputs
    (dq, dk, dv) are not live before the finish's casts: every phase but the last is
    counted less their bytes."""
    f16 = s.item == 2
    q_pad = s.q_pad > s.q
    dvec = s.rows  # Dvec = rowsum(dout * out), float32 [G, Lq, 1]
    lse = 2 * s.rows  # lse reshaped (a copy), and its where where rows may see nothing
    stats = 2 * s.rows_pad + (2 * s.rows_pad if q_pad else 0)  # lse | Dvec (and padded)
    qdo = 2 * s.q_pad  # the stacked [do; q], padded
    # the stacked [k; v], padded; a concat_ of views of k * scale (a copy) and v, so with
    # padding the scaled k stays live with v's storage (the emulator frees a view group with
    # its last member; v is an input)
    kv = 2 * s.kv_pad + (s.kv if s.kv_pad > s.kv else 0)
    state = s.q32_pad + 2 * s.kv32_pad  # dq, [dv; dk] float32
    phases = {
        # float32 casts of dout and out (float16) and their product
        "dvec": (2 * f16 + 1) * s.q32 + dvec,
        # k * scale (a copy, where the scale folds), then stack([do, q]) (and its padding)
        "stack qdo": dvec + lse + s.kv + _stack(s.q, s.q_pad),
        # stack([k, v]) with [do; q] and lse | Dvec held
        "stack kv": qdo + stats + _stack(s.kv, s.kv_pad),
        # the loops (or row steps): operands, state, one step's temporaries
        "loop": qdo + stats + kv + state + _backward_step(s),
        # finish: [dv; dk] and the slice and reshape copies of its parts, dq held
        "split dkdv": state + 2 * s.kv32_pad,
    }
    phases = {k: v - s.outputs for k, v in phases.items()}
    # then dq, dk, dv, a scaled copy, an unpadded copy, and the casts (the outputs)
    phases["finish"] = state + max(s.q32_pad, s.kv32_pad) + max(s.q32, s.kv32) * (
        s.q_pad > s.q or s.kv_pad > s.kv)
    return {k: v + s.constants for k, v in phases.items()}


#: A backward step's temporaries at its peak (``backward.grad_block`` on the step's slices),
#: by (dtype, grouped-query): float32 score blocks (P, dP, dS, the stacked ``[P; dS]`` and the
#: reshape copies of its parts, its cast), float32 q rows ``[G, rows, D]`` (the ``[do; q]``
#: and ``dq`` slices, their parts, the folded copies, ``dS k_j``) and k/v rows ``[Gk, cols,
#: D]`` (the ``[k; v]`` and ``[dv; dk]`` slices, their parts, the ``[dv; dk]`` product and
#: sum): the least upper bound of the emulator's over the drawn shapes of
#: ``tests/test_memory_model.py``.
BACKWARD_STEP = {("float16", False): (3.75, 3.5, 6.0), ("float16", True): (4.25, 4.0, 5.5),
                 ("float32", False): (4.75, 6.5, 7.0), ("float32", True): (4.75, 6.0, 4.5)}


#: The same for the backward's inline row steps (``blocks.row_steps``: static slices of the
#: unpadded operands and state, every row pass's), fitted alike.
ROW_STEP = {("float16", False): (4.0, 0.5, 8.0), ("float16", True): (4.25, 9.5, 6.5),
            ("float32", False): (4.75, 0.0, 6.0), ("float32", True): (4.25, 4.0, 12.0)}


def _backward_step(s):
    """Upper bound of one backward step's temporaries (:data:`BACKWARD_STEP`,
    :data:`ROW_STEP`)."""
    blocks, q_rows, kv_rows = (ROW_STEP if s.row_steps else BACKWARD_STEP)[s.dtype, s.gqa]
    return blocks * s.block + q_rows * s.step_q + kv_rows * s.step_kv


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
    # out and lse of every pass, live until the concats, are at most the outputs' bytes, which
    # are not live before the concats: at the largest pass, the earlier passes' results are
    # within the outputs' bytes; at the concats, the results are the extra
    results = G * sched.Lq * (D * item + _F32)
    kv_rows = ROW_PASS_KV_ROWS[dtype] * Gk * sched.Lkv * D * _F32
    return int(REFIT_MARGIN * max(SINGLE_MARGIN * worst + kv_rows, results) + constants
               + 8 * G * sched.Lq + LOOP_FIXED_BYTES)


def flash_lower_bound(*, groups, kv_groups, q_len, kv_len, chunk_q, chunk_kv, head_dim,
                      lean=True):
    """A cheap lower bound of :func:`flash_bytes`'s larger pass (no schedule needed), either
    dtype: one block's score terms for a one-block pass; else the backward's float32 ``dq, dk,
    dv`` state (live in its loop phase together with at least the ``[do; q]`` and ``[k; v]``
    operands, which outweigh the outputs' bytes it is counted less) and the least step block
    term. The choice skips candidates above the budget by it without planning them (a block as
    long as a 32K sequence would make the planner materialise its mask)."""
    block = groups * chunk_q * chunk_kv * _F32
    single = min(SINGLE_BYTES[d, True][0] for d in ("float16", "float32")) / _F32
    if chunk_q >= q_len and chunk_kv >= kv_len:
        return int(single * block)
    state = groups * q_len * head_dim * _F32  # dq (the lean backward's floor)
    if not lean:  # and [dv; dk] for the whole kv length
        state += 2 * kv_groups * kv_len * head_dim * _F32
    steps = min(min(b for b, _, _ in BACKWARD_STEP.values()),
                min(b for b, _, _ in ROW_STEP.values()))
    return int(state + steps * block)


def naive_bytes(*, groups, q_len, kv_len, head_dim, dtype, backward, masked):
    """Live bytes of naive attention (:mod:`popxl_flash.checks.naive`) beyond its inputs and
    outputs: the score-sized tensors, the mask, a few rows."""
    scores = groups * q_len * kv_len
    rows = groups * max(q_len, kv_len) * head_dim * _F32 * NAIVE_ROWS[bool(backward)]
    return int(NAIVE_BYTES_PER_SCORE[(dtype, bool(backward))] * scores
               + (q_len * kv_len if masked else 0) + rows + FIXED_BYTES)


#: Float32 k/v-row elements ``[Gk, cols, D]`` a lean step holds besides the usual step's
#: (its scaled copy of the k slice, in the input dtype: at most one float32's bytes).
LEAN_STEP_KV_ROWS = 1.0


def lean_bytes(sched, s, G, Gk, D, backward):
    """Upper bound of a looped pass's live bytes beyond its inputs and outputs in its
    memory-lean structure (``graph/forward.py``, ``graph/backward.py`` and ``graph/lean.py``):
    the float32 state that structure needs, one step's temporaries, and one piece
    (:func:`popxl_flash.plan.steps.lean_pieces`) of the full-length float32 work.

    Args:
        sched: the schedule; s: its :class:`_LoopShape`; G, Gk, D: the groups and head dim.
        backward: the backward (else the forward).

    Returns:
        int bytes.
    """
    item = s.item
    q_piece = max(r1 - r0 for r0, r1 in _steps.lean_piece_rows(sched.nq, sched.chunk_q,
                                                                sched.Lq))
    q32_piece = G * q_piece * D * _F32  # float32 [G, piece rows, D]
    q_pad = s.q_pad if s.q_pad > s.q else 0  # the padded q (and dout) copies
    kv_pad = 2 * s.kv_pad if s.kv_pad > s.kv else 0  # the padded [k; v]
    step_kv = LEAN_STEP_KV_ROWS * s.step_kv
    if not backward:
        state = s.q32_pad + 2 * s.rows_pad  # acc | l | m
        phases = {
            "loop": 2 * q_pad + kv_pad + state + _forward_step(s) + step_kv - s.outputs,
            # a piece's acc / l (float32), its cast (an output's piece), m, l and lse terms
            "finish": state + q32_piece + 6 * G * q_piece * _F32,
        }
    else:
        kv_piece = (lambda p: (p[1] - p[0]) * sched.chunk_kv)(_steps.lean_pieces(sched.nkv)[0])
        acc = 2 * Gk * kv_piece * D * _F32  # one kv piece's [dv; dk]
        rows = 3 * s.rows + 2 * s.rows_pad  # Dvec, lse (and its where), lse | Dvec (padded)
        dq = s.q32_pad
        phases = {
            # a q piece's float32 casts of dout and out and their product
            "dvec": 3 * q32_piece + s.rows,
            # the loops: dq, the statistics, a piece's accumulator, one step; dq's output
            # is not live before the finish (dk's and dv's pieces so far are outputs)
            "loop": (2 * q_pad + kv_pad + dq + rows + acc + _backward_step(s) + step_kv
                     - G * sched.Lq * D * item),
            # a piece's flush: dk * scale (float32) and the casts (outputs)
            "flush": dq + rows + acc + Gk * kv_piece * D * _F32 - G * sched.Lq * D * item,
            # dq's finish: a piece's scaled copy and its cast (an output's piece)
            "finish": dq + rows + q32_piece,
        }
    constants = s.constants
    return int(REFIT_MARGIN * max(phases.values()) + constants + LOOP_FIXED_BYTES)
