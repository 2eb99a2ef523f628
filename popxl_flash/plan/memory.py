"""Memory of one attention call beyond its own inputs and outputs, and the default budget.

``memory_budget=`` (bytes) on every planning entry point bounds what a call may hold live
beyond its inputs and outputs: the emulator's ``peak_live_bytes`` minus the bytes of the
call's inputs and outputs (constants, such as the mask tables, count against the budget).
The functions here are upper bounds of that figure, held to the emulator's profile by
``tests/test_memory_budget.py`` and ``tests/test_memory_model.py`` (never below it).

Default budget (``memory_budget=None``): per pass, :data:`DEFAULT_IO_FACTOR` times the pass's
own inputs' and outputs' bytes plus :data:`DEFAULT_FIXED_BYTES`, at most an eighth of naive
attention's forward working set (where that is above 4 MiB) and a quarter of one IPU
(:func:`default_budget`): flash
attention's promise is that the L x L score matrix is never materialised, so by default a call's
temporaries stay O(L) at every shape; within that the choice takes the least modelled time, and
where no chunking meets it the least memory (a default never refuses). ``memory_budget=``
(bytes, both passes) is how a user spends more memory for speed; an explicit budget nothing
meets raises ``ValueError``.

The flash bound (:func:`flash_bytes`) walks the pass's graph (``popxl_flash/graph/forward.py``,
``backward.py``, ``lean.py``, every structure: one block, the forward's row passes, the
backward's row steps, the loops, and the loops' memory-lean structures) op by op, one line per tensor-sized op (``_forward_walk``,
``_backward_walk``), with the emulator's liveness (``popxl_flash/emulator/plan.py``): an op's
output is allocated before the storage whose last use it is is freed; ``_`` views (``slice_``,
``reshape_``, ``transpose_``, ``concat_``) allocate nothing and a view group is freed with its
last member (the scaled k, stacked with the input v, so lives to the end); a loop body's
inputs share the caller's storage, and its dynamic slices are copies. The peak less the
outputs' bytes, plus the constants (patterns, step tables) and :data:`LOOP_FIXED_BYTES` for
the scalars and few-row tensors the walk leaves out. Score modifiers and dropout (``mods=``)
add fitted blocks (:data:`MOD_BLOCKS`) and dropout's hash tables. ``tests/test_memory_model.py``
holds it within 1.2x + 1 MiB of the emulator's peak for every structure (over ~1,500 drawn
shapes and chunkings it is 0-62 KiB above the peak, the fixed allowance); when the graph code
changes, the walk must follow it.
"""
import math
import numbers

from popxl_flash.plan import ipu_time
from popxl_flash.plan import steps as _steps
from popxl_flash.plan.schedule import PARTIAL

_F32 = 4

#: Small tensors of any pass (scalars, counters, one-element constants): a fixed allowance.
FIXED_BYTES = 16384
#: Small tensors of a flash pass the walk leaves out (scalars, counters, step-table rows,
#: comparison masks of a few rows): a fixed allowance (without it the walk falls at most
#: ~4 KiB short of the emulator over the drawn shapes of ``tests/test_memory_model.py``).
LOOP_FIXED_BYTES = 65536
#: Bytes of the loop tables per step (first q row, first kv column, pattern id: int32).
TABLE_BYTES_PER_STEP = 12
#: Score modifiers and dropout (:class:`popxl_flash.plan.score_mods.ScoreMods`): float32
#: score blocks of the largest step each adds at its peak, by (modifier, backward): the least
#: upper bound over drawn shapes of every structure, rounded up to 0.25 (softcap: 0 forward,
#: 1 backward, its chain; ALiBi: the bias block; a ``score_mod``: measured with an elementwise
#: one, a user function that makes more block-sized temporaries holds more; dropout: the keep
#: mask's hash blocks, :data:`DROPOUT_LOOP_BLOCKS` in the forward's loops), plus dropout's
#: uint32 hash tables ``[2, G, Lq, 1]`` and ``[2, 1, 1, Lkv]`` and their slices
#: (:data:`DROPOUT_TABLE_BYTES` per padded q row of each group and per kv row).
MOD_BLOCKS = {("softcap", False): 0.0, ("softcap", True): 1.0,
              ("alibi", False): 1.0, ("alibi", True): 0.25,
              ("score_mod", False): 0.25, ("score_mod", True): 2.0,
              ("dropout", False): 2.25, ("dropout", True): 2.0}
DROPOUT_LOOP_BLOCKS = 3.0
DROPOUT_TABLE_BYTES = 16
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
#: ... at most this fraction of naive attention's forward working set (:func:`naive_bytes`,
#: unmasked) where that exceeds :data:`DEFAULT_FIXED_BYTES`: adopting flash attention gives
#: back at least 7/8 of what naive attention's scores would hold ...
DEFAULT_NAIVE_FRACTION = 1 / 8
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
    call's temporaries stay O(L), as flash attention promises (module docstring); at most
    :data:`DEFAULT_NAIVE_FRACTION` of naive attention's forward working set where that is
    above :data:`DEFAULT_FIXED_BYTES`; and at most :data:`DEFAULT_DEVICE_FRACTION` of one
    IPU's memory.

    Returns:
        int bytes.
    """
    io = io_bytes(groups=groups, kv_groups=kv_groups, q_len=q_len, kv_len=kv_len,
                  head_dim=head_dim, dtype=dtype, backward=backward)
    naive = naive_bytes(groups=groups, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                        dtype=dtype, backward=False, masked=False)
    naive_cap = DEFAULT_NAIVE_FRACTION * naive
    if naive_cap <= DEFAULT_FIXED_BYTES:  # short calls: naive's scores are small
        naive_cap = float("inf")
    device = ipu_time.current().device_bytes * DEFAULT_DEVICE_FRACTION
    return int(min(DEFAULT_IO_FACTOR * io + DEFAULT_FIXED_BYTES, naive_cap, device))


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


def flash_bytes(sched, *, groups, kv_groups, head_dim, dtype, backward, steps, scale=None,
                mods=None, lean=False):
    """Upper bound of one flash pass's live bytes beyond its inputs and outputs: the
    emulator's liveness walked op by op over the pass's graph (module docstring).

    Args:
        sched: the :class:`~popxl_flash.plan.schedule.BlockSchedule`.
        groups, kv_groups, head_dim: G, Gk, D; dtype: the input dtype name.
        backward: the stash-mode backward (else the forward).
        steps: the pass's loop steps (:func:`popxl_flash.plan.steps.loop_steps`; the step
            tables' bytes grow with them).
        scale: the softmax scale (``None``: ``1 / sqrt(D)``); whether it folds into k
            (:func:`popxl_flash.graph.blocks.scale_folds`) changes the temporaries.
        mods: ``None`` or the call's :class:`~popxl_flash.plan.score_mods.ScoreMods` (score
            modifiers and dropout: :data:`MOD_BLOCKS`).
        lean: the pass's memory-lean structure (looped passes only; ``docs/design.md``,
            "Memory-lean structures").

    Returns:
        int bytes.
    """
    G, Gk, D, item = groups, kv_groups, head_dim, _item(dtype)
    folds = _scale_folds(D, scale)
    single = _steps.single_block(sched)  # (no segment ids: the choice prices those loops apart)
    rows = not single and _steps.row_passes(sched)
    lean = lean and not (single or rows)
    walk = (_backward_walk if backward else _forward_walk)(sched, G, Gk, D, item, folds,
                                                           single, rows, lean)
    if not (single or rows):
        walk += TABLE_BYTES_PER_STEP * steps
    return int(walk + _mod_bytes(sched, G, backward, mods, single, rows) + LOOP_FIXED_BYTES)


def _scale_folds(head_dim, scale):
    """:func:`popxl_flash.graph.blocks.scale_folds` for ``scale`` (``None``: 1 / sqrt(D))."""
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    mantissa, _ = math.frexp(abs(scale))
    return mantissa == 0.5 and abs(scale) <= 1.0


def _mod_bytes(sched, G, backward, mods, single, rows):
    """What score modifiers and dropout add: :data:`MOD_BLOCKS` float32 blocks of the largest
    step, and dropout's hash tables."""
    if mods is None:
        return 0
    if single:
        block = sched.Lq * sched.Lkv
    elif rows:
        block = max((p.rows[1] - p.rows[0]) * (p.cols[1] - p.cols[0])
                    for p in _steps.row_pass_plan(sched))
    else:
        block = max(g.rows * g.cols for g in
                    _steps.step_groups(sched, "kv_major" if backward else "q_major"))
    dropout = getattr(mods, "dropout", 0) > 0
    used = [("softcap", getattr(mods, "softcap", 0) > 0), ("alibi", getattr(mods, "alibi", False)),
            ("score_mod", getattr(mods, "score_mod", None) is not None), ("dropout", dropout)]
    blocks = sum(MOD_BLOCKS[name, bool(backward)] for name, on in used if on)
    if dropout and not backward and not (single or rows):
        blocks += DROPOUT_LOOP_BLOCKS - MOD_BLOCKS["dropout", False]
    tables = 0
    if dropout:
        tables = DROPOUT_TABLE_BYTES * (G * sched.nq * sched.chunk_q + sched.nkv * sched.chunk_kv)
    return int(blocks * G * block * _F32 + tables)


class _Live:
    """Live bytes as the emulator counts them (``popxl_flash/emulator/plan.py``): an op
    allocates its output, then the storage whose last use it is is freed; views (``slice_``,
    ``reshape_``, ``transpose_``, ``concat_``) allocate nothing and a view group is freed with
    its last member; a loop body's inputs share the caller's storage (AliasZeroCopy), so a
    body adds only its own temporaries. Names are the graph's tensors (``held``)."""

    def __init__(self):
        self.live = self.peak = 0
        self.held = {}

    def op(self, nbytes=0, name=None, free=()):
        """One op: ``nbytes`` of output (held as ``name``), then ``free`` released."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        for n in free:
            self.live -= self.held.pop(n, 0)
        if name is not None:
            self.held[name] = self.held.get(name, 0) + nbytes

    def free(self, *names):
        self.op(0, None, names)


def _single_pass(sim, G, rows, cols, D, item, folds, visible, seen, k_free=()):
    """``forward.single_pass`` on ``rows x cols`` (the one-block forward, a row pass); leaves
    ``out`` and ``lse`` held. ``k_free``: freed at the scores' matmul (the scaled k's last
    use)."""
    S, R, Q32 = G * rows * cols * _F32, G * rows * _F32, G * rows * D * _F32
    sim.op(S, "s", k_free)  # q k^T, float32
    if not folds:
        sim.op(S, "s", ("s",))  # * scale
    if visible:
        sim.op(S, "s", ("s",))  # where(visible, s, INITIAL_MAX)
    sim.op(R, "m")  # max
    sim.op(S, "d", ("s",))  # s - m
    sim.op(S, "p", ("d",))  # exp
    sim.op(R, "l")  # sum
    if item == 2:
        sim.op(S // 2, "p", ("p",))  # cast
    sim.op(Q32, "pv", ("p",))  # P v
    sim.op(Q32, "out", ("pv",))  # / l
    if item == 2:
        sim.op(G * rows * D * item, "out", ("out",))  # cast
    sim.op(R, "lg", ("l",))  # log(l)
    sim.op(R, "lse", ("m", "lg"))  # m + log(l)
    if seen:  # where(seen, out, 0), where(seen, lse, -inf)
        sim.op(G * rows * D * item, "out", ("out",))
        sim.op(R, "lse", ("lse",))


def _pad(sim, nbytes, padded_bytes, name, free=()):
    """``blocks.pad_rows``: zeros, then the padded concat (nothing when not padded).

    Returns:
        Whether it padded (a copy held as ``name``)."""
    if padded_bytes <= nbytes:
        return False
    sim.op(padded_bytes - nbytes, "zeros")
    sim.op(padded_bytes, name, ("zeros",) + tuple(free))
    return True


def _loops(sim, groups, step):
    """The step groups in order: ``step(sim, group, loop)`` once per group (a loop body's
    peak is its first step's; an inline group's slices are views)."""
    for g in groups:
        step(sim, g, not _steps.runs_inline(g))
        sim.free("pat")


def _forward_walk(sched, G, Gk, D, item, folds, single, rows, lean=False):
    """``graph/forward.py`` ``FlashAttention.build``, op by op (module docstring): the peak
    less the outputs' bytes (out, lse), plus the constants (patterns, seen rows, the zero
    results of rows that see nothing). ``lean``: its memory-lean structure (looped)."""
    Lq, Lkv = sched.Lq, sched.Lkv
    Q, R = G * Lq * D * item, G * Lq * _F32
    sim = _Live()
    if folds and not lean:  # k * scale, once; with [k; v] stacked, held with v's storage
        sim.op(Gk * Lkv * D * item, "ks")
    if single:
        _single_pass(sim, G, Lq, Lkv, D, item, folds, sched.kind[0, 0] == PARTIAL,
                     bool(sched.num_empty_rows), ("ks",))
        seen = Lq if sched.num_empty_rows else 0
        return sim.peak - Q - R + sched.patterns_nbytes + seen
    if rows:  # one single_pass per q chunk; the results live until the concats
        plan = _steps.row_pass_plan(sched)
        last = max((n for n, p in enumerate(plan) if p.cols[1] > p.cols[0]), default=-1)
        results, constants = [], 0
        for n, p in enumerate(plan):
            r, c = p.rows[1] - p.rows[0], p.cols[1] - p.cols[0]
            constants += p.pattern_nbytes + p.seen_nbytes
            if not c:  # constants: out 0, lse -inf
                constants += G * r * (D * item + _F32)
                continue
            _single_pass(sim, G, r, c, D, item, folds, p.masked, not p.all_seen,
                         ("ks",) if n == last else ())
            sim.held[f"r{n}"] = sim.held.pop("out") + sim.held.pop("lse")
            results.append(f"r{n}")
        sim.op(Q, "out")
        sim.op(R, "lse", results)  # the concats
        return sim.peak - Q - R + constants
    lq, lkv = sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv
    _pad(sim, Q, G * lq * D * item, "q")  # q padded
    _pad(sim, 2 * Gk * Lkv * D * item, 2 * Gk * lkv * D * item, "kv")  # [k; v] padded
    state = G * lq * (D + 2) * _F32  # acc | l | m
    sim.op(state, "init")
    if not lean:  # lean: the m column added in place
        sim.op(state, "state", ("init",))  # where(is_m, INITIAL_MAX, 0)
    else:
        sim.held["state"] = sim.held.pop("init")

    def step(b, g, loop):  # online_softmax_update
        r, c = g.rows, g.cols
        S, Rb, Qb32, acc = G * r * c * _F32, G * r * _F32, G * r * D * _F32, G * r * (D + 1) * _F32
        if loop:  # dynamic slices (copies): the pattern, q_i, [k_j; v_j], the state's rows
            if g.masked and g.num_patterns > 1:
                b.op(r * c, "pat")
            b.op(G * r * D * item, "q_i")
            b.op(2 * Gk * c * D * item, "kv_j")
            b.op(G * r * (D + 2) * _F32, "st_i")
        if lean and folds:  # the step's k slice scaled
            b.op(Gk * c * D * item, "ks_j")
        softmax_block_walk(b, G, r, c, D, item, folds, g.masked)
        b.free("add", "m_new")  # written back in place

    _loops(sim, _steps.step_groups(sched, "q_major"), step)
    sim.free("q", "kv")
    if lean:
        _lean_finish(sim, sched, G, D, item)
        return sim.peak - Q - R + sched.patterns_nbytes
    if sched.num_empty_rows:  # greater(l, 0), where(seen, l, 1)
        sim.op(G * Lq, "seen")
        sim.op(R, "l")
    sim.op(G * Lq * D * _F32, "out", ("l",))  # acc / l
    if item == 2:
        sim.op(Q, "out", ("out",))
    sim.op(R, "lg")
    sim.op(R, "lse", ("lg", "state"))
    if sched.num_empty_rows:
        sim.op(R, "lse", ("lse", "seen"))
    return sim.peak - Q - R + sched.patterns_nbytes


def softmax_block_walk(b, G, rows, cols, D, item, folds, masked):
    """``forward.softmax_block`` on ``rows x cols``, op by op, from the scores (which free
    ``q_i`` and a lean step's ``ks_j``) to the updated ``acc | l`` (held as ``add``, with
    ``m_new``); ``masked``: the pattern (``pat``, freed at its second use) applies."""
    S, Rb = G * rows * cols * _F32, G * rows * _F32
    Qb32, acc = G * rows * D * _F32, G * rows * (D + 1) * _F32
    b.op(S, "s", ("q_i", "ks_j"))
    if not folds:
        b.op(S, "s", ("s",))
    if masked:
        b.op(S, "smax")  # where(visible, s, INITIAL_MAX)
    b.op(Rb, "mx", ("smax",))
    b.op(Rb, "m_new", ("mx",))  # maximum(m_i, .)
    b.op(S, "d", ("s",))
    if masked:
        b.op(S, "d", ("d", "pat"))
    b.op(S, "p", ("d",))
    b.op(Rb, "rowsum")
    if item == 2:
        b.op(S // 2, "p", ("p",))
    b.op(Qb32, "pv", ("p", "kv_j"))
    b.op(Rb, "a")  # m_i - m_new
    b.op(Rb, "alpha", ("a",))
    b.op(acc, "mul", ("alpha", "st_i"))  # alpha * acc_l
    b.op(acc, "add", ("mul", "pv", "rowsum"))  # + [pv | rowsum] (a concat_ view)


def _lean_finish(sim, sched, G, D, item):
    """The lean forward's finish: ``forward.normalise`` per q piece on views of the state
    (its results are the outputs' pieces, held), the state freed after the last piece."""
    empty = bool(sched.num_empty_rows)
    for n, (r0, r1) in enumerate(_steps.lean_piece_rows(sched.nq, sched.chunk_q, sched.Lq)):
        Rp = G * (r1 - r0) * _F32
        if empty:  # greater(l, 0), where(seen, l, 1)
            sim.op(G * (r1 - r0), "seen")
            sim.op(Rp, "lp")
        sim.op(G * (r1 - r0) * D * _F32, "o32", ("lp",))  # acc / l
        if item == 2:
            sim.op(G * (r1 - r0) * D * item, f"out{n}", ("o32",))
        sim.op(Rp, "lg")
        sim.op(Rp, f"lse{n}", ("lg",))
        if empty:
            sim.op(Rp, f"lse{n}", (f"lse{n}", "seen"))
    sim.free("state")


def _grad_block(sim, G, Gk, rows, cols, D, item, folds, visible, stacked, frees):
    """``backward.grad_block`` on ``rows x cols`` (and, ``stacked``, the accumulation of
    ``grad_block_update``: the ``[P; dS]`` path of the row steps and loops; else the one
    block's). ``frees``: {event: names} of the operands whose last use that op is."""
    S = G * rows * cols * _F32
    Qb32, KVb32 = G * rows * D * _F32, Gk * cols * D * _F32

    def f(event):
        return tuple(frees.get(event, ()))
    sim.op(S, "s", f("s"))  # q k^T
    if not folds:
        sim.op(S, "s", ("s",))
    sim.op(S, "arg", ("s",) + f("arg"))  # s - lse
    if visible:
        sim.op(S, "arg", ("arg",))
    sim.op(S, "p", ("arg",))  # exp
    sim.op(S, "dp")  # do v^T
    sim.op(S, "sub", ("dp",) + f("sub"))  # dP - Dvec
    sim.op(S, "ds", ("sub",))  # P * (...)
    if stacked:
        if item == 2:
            sim.op(S, "pds", ("p", "ds"))  # cast of the [P; dS] view
        else:
            sim.held["pds"] = sim.held.pop("p") + sim.held.pop("ds")
        sim.op(2 * KVb32, "dkdv_b", f("dkdv"))  # [P; dS]^T [do; q]
        sim.op(Qb32, "dq_b", ("pds",) + f("dq"))  # dS k
        sim.op(Qb32, "dq+", ("dq_b",) + f("dq+"))
        sim.op(2 * KVb32, "dkdv+", ("dkdv_b",) + f("dkdv+"))
        sim.free("dq+", "dkdv+")  # written back in place
        return
    if item == 2:
        sim.op(S // 2, "p", ("p",))
        sim.op(S // 2, "ds", ("ds",))
    sim.op(KVb32, "dv", ("p",))
    sim.op(KVb32, "dk")
    sim.op(Qb32, "dq", ("ds",) + f("dq"))


def _backward_walk(sched, G, Gk, D, item, folds, single, rows, lean=False):
    """``graph/backward.py`` ``FlashAttentionGrad.build``, op by op (module docstring): the
    peak less the outputs' bytes (dq, dk, dv), plus the constants (patterns). ``lean``: its
    memory-lean structure (looped; :func:`_lean_backward_loops`)."""
    Lq, Lkv = sched.Lq, sched.Lkv
    Q32, R = G * Lq * D * _F32, G * Lq * _F32
    sim = _Live()
    pieces = (_steps.lean_piece_rows(sched.nq, sched.chunk_q, Lq) if lean
              else [(0, Lq)])
    for r0, r1 in pieces:  # Dvec = rowsum(f32(dout) * f32(out)), per q piece when lean
        P32 = G * (r1 - r0) * D * _F32
        if item == 2:
            sim.op(P32, "c1")
            sim.op(P32, "c2")
        sim.op(P32, "mu", ("c1", "c2"))
        sim.op(G * (r1 - r0) * _F32, f"dvec{r0}", ("mu",))
    sim.held["dvec"] = sum(sim.held.pop(f"dvec{r0}") for r0, _ in pieces)  # joined: views
    if sched.num_empty_rows:  # where(lse > MASKED_SCORE, lse, 0)
        sim.op(G * Lq, "g")
        sim.op(R, "lse", ("g",))
    if folds and not lean:  # k * scale; with [k; v] stacked, held with v's storage
        sim.op(Gk * Lkv * D * item, "ks")
    outputs = (G * Lq + 2 * Gk * Lkv) * D * item
    if single:
        _grad_block(sim, G, Gk, Lq, Lkv, D, item, folds, sched.kind[0, 0] == PARTIAL, False,
                    {"arg": ("lse",), "sub": ("dvec",), "dq": ("ks",)})
        _finish(sim, G, Gk, Lq, Lkv, D, item, folds, ("dk", "dv"), (Lq, Lkv))
        return sim.peak - outputs + sched.patterns_nbytes
    lq, lkv = (Lq, Lkv) if rows else (sched.nq * sched.chunk_q, sched.nkv * sched.chunk_kv)
    _pad(sim, 2 * G * Lq * D * item, 2 * G * lq * D * item, "qdo")  # [do; q], a view unpadded
    sim.op(2 * R, "stats", ("lse", "dvec"))  # lse | Dvec
    _pad(sim, 2 * R, 2 * G * lq * _F32, "stats", ("stats",))
    _pad(sim, 2 * Gk * Lkv * D * item, 2 * Gk * lkv * D * item, "kv")  # [k; v]
    sim.op(G * lq * D * _F32, "dq")
    if lean:
        constants = _lean_backward_loops(sim, sched, G, Gk, D, item, folds)
        sim.free("qdo", "stats", "kv")
        _lean_finish_dq(sim, sched, G, D, item, folds)
        return sim.peak - outputs + constants
    sim.op(2 * Gk * lkv * D * _F32, "dkdv")
    if rows:  # inline steps on static slices (views)
        constants = 0
        for p in _steps.row_pass_plan(sched):
            r, c = p.rows[1] - p.rows[0], p.cols[1] - p.cols[0]
            if c:
                constants += p.pattern_nbytes
                _grad_block(sim, G, Gk, r, c, D, item, folds, p.masked, True, {})
    else:
        constants = sched.patterns_nbytes

        _loops(sim, _steps.step_groups(sched, "kv_major"), lambda b, g, loop:
               _backward_step(b, G, Gk, D, item, folds, g, loop))
    sim.free("qdo", "stats", "kv")
    _finish(sim, G, Gk, Lq, Lkv, D, item, folds, ("dkdv",), (lq, lkv))
    return sim.peak - outputs + constants


def _backward_step(b, G, Gk, D, item, folds, g, loop, lean=False):
    """``backward.grad_block_update`` on a step of group ``g`` (``loop``: in a loop body, whose
    slices are copies; inline: views). ``lean``: the step scales its k slice where the scale
    folds."""
    r, c = g.rows, g.cols
    frees = {}
    if loop:  # dynamic slices (copies) of the operands and the state
        if g.masked and g.num_patterns > 1:
            b.op(r * c, "pat")
        b.op(2 * G * r * D * item, "qdo_i")
        b.op(2 * G * r * _F32, "stats_i")
        b.op(2 * Gk * c * D * item, "kv_j")
        b.op(G * r * D * _F32, "dq_i")
        b.op(2 * Gk * c * D * _F32, "dkdv_j")
        frees = {"arg": ("pat",), "sub": ("stats_i",), "dkdv": ("qdo_i",),
                 "dq": ("kv_j",), "dq+": ("dq_i",), "dkdv+": ("dkdv_j",)}
    if lean and folds:  # k_j * scale, last read by dS k_j
        b.op(Gk * c * D * item, "ks_j")
        frees["dq"] = frees.get("dq", ()) + ("ks_j",)
    _grad_block(b, G, Gk, r, c, D, item, folds, g.masked, True, frees)


def _lean_backward_loops(sim, sched, G, Gk, D, item, folds):
    """The lean backward's kv pieces (``graph/lean.py``): per piece its ``[dv; dk]``
    accumulator, the steps of each group in the piece (a loop, or one step inline with its
    own pattern constant), and the flush (dv cast or copied, dk scaled and cast: the outputs'
    pieces, held).

    Returns:
        The constants' bytes (the groups' patterns, the inline steps' own patterns)."""
    constants = sched.patterns_nbytes
    groups = _steps.step_groups(sched, "kv_major")
    ranges = [_steps.lean_step_ranges(g, sched.nkv) for g in groups]
    kv_rows = _steps.lean_piece_rows(sched.nkv, sched.chunk_kv, sched.Lkv)
    c0, c1 = _steps.lean_pieces(sched.nkv)[0]
    acc = 2 * Gk * (c1 - c0) * sched.chunk_kv * D * _F32
    for n, (r0, r1) in enumerate(kv_rows):
        sim.op(acc, "dkdv")
        for g, r in zip(groups, ranges):
            start, stop = r[n]
            if stop > start:
                _backward_step(sim, G, Gk, D, item, folds, g, stop - start > 1, lean=True)
                sim.free("pat")
                if stop - start == 1 and g.masked:
                    constants += g.rows * g.cols
        P = Gk * (r1 - r0) * D
        sim.op(P * item, f"dv{n}")  # cast (float32: a copy)
        sim.op(P * _F32, "dk_s", ("dkdv",))  # dk * scale
        if item == 2:
            sim.op(P * item, f"dk{n}", ("dk_s",))
        else:
            sim.held[f"dk{n}"] = sim.held.pop("dk_s")
    return constants


def _lean_finish_dq(sim, sched, G, D, item, folds):
    """The lean backward's dq per q piece: scaled unless the scale folded, cast (views of the
    accumulator where neither applies)."""
    for n, (r0, r1) in enumerate(_steps.lean_piece_rows(sched.nq, sched.chunk_q, sched.Lq)):
        P = G * (r1 - r0) * D
        name = "dq"
        if not folds:
            sim.op(P * _F32, f"dqs{n}")
            name = f"dqs{n}"
        if item == 2:
            sim.op(P * item, f"dq{n}", (name,) if name != "dq" else ())
    if item == 2 or not folds:
        sim.free("dq")


def _finish(sim, G, Gk, Lq, Lkv, D, item, folds, dkdv, padded):
    """``backward._finish``: dq (times the scale unless it folded), dk times the scale, the
    casts of the unpadded views. ``dkdv``: the held names of dk and dv, or the one stacked
    ``[dv; dk]``; ``padded``: the state's lengths."""
    Q32, KV32 = G * padded[0] * D * _F32, Gk * padded[1] * D * _F32
    dq = "dq"
    if not folds:
        sim.op(Q32, "dq_s", ("dq",))
        dq = "dq_s"
    sim.op(KV32, "dk_s", dkdv[:1] if len(dkdv) == 2 else ())
    if item == 2:
        sim.op(G * Lq * D * item, "dq_o", (dq,))
        sim.op(Gk * Lkv * D * item, "dk_o", ("dk_s",))
        sim.op(Gk * Lkv * D * item, "dv_o", (dkdv[-1],))


def flash_lower_bound(*, groups, kv_groups, q_len, kv_len, chunk_q, chunk_kv, head_dim):
    """A cheap lower bound of :func:`flash_bytes`'s larger pass (no schedule needed), either
    dtype: the backward holds P, dP and ``dP - Dvec`` of its largest step at once (for a
    one-block pass less the float32 outputs' bytes; a looped step with its float32 state
    live, which outweighs the outputs: at least half a chunk's rows by a chunk's columns; one
    kv chunk may run as row passes, whose columns a window narrows: nothing counted). The
    choice skips candidates above the budget by it without planning them (a block as long as
    a 32K sequence would make the planner materialise its mask)."""
    if chunk_q >= q_len and chunk_kv >= kv_len:
        outputs = (groups * q_len + 2 * kv_groups * kv_len) * head_dim * _F32
        return max(0, 3 * groups * q_len * kv_len * _F32 - outputs)
    if chunk_kv >= kv_len:
        return 0
    return 3 * groups * (chunk_q // 2) * chunk_kv * _F32


def naive_bytes(*, groups, q_len, kv_len, head_dim, dtype, backward, masked):
    """Live bytes of naive attention (:mod:`popxl_flash.checks.naive`) beyond its inputs and
    outputs: the score-sized tensors, the mask, a few rows."""
    scores = groups * q_len * kv_len
    rows = groups * max(q_len, kv_len) * head_dim * _F32 * NAIVE_ROWS[bool(backward)]
    return int(NAIVE_BYTES_PER_SCORE[(dtype, bool(backward))] * scores
               + (q_len * kv_len if masked else 0) + rows + FIXED_BYTES)
