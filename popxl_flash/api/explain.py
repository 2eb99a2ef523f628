"""``pf.explain``: the cost model's figures behind the automatic chunk choice of one call."""
from popxl_flash.api.functional import score_mod_input_tuple, score_mod_traced
from popxl_flash.backend import popxl
from popxl_flash.graph import score_mods
from popxl_flash.plan import costmodel, packed
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan import steps as _steps
from popxl_flash.plan.config import AttentionConfig, _check_int, check_bool, check_dtype_name
from popxl_flash.plan.segments import SegmentConfig
from popxl_flash.plan.memory import check_budget


def explain(Lq, Lkv, *, head_dim, groups=1, dtype="float16", causal=True, window=None,
            num_chunks_q=None, num_chunks_kv=None, kv_groups=None, score_mod=None,
            score_mod_inputs=(), memory_budget=None, segment_ids=False,
            max_seqlen=None) -> "costmodel.ChunkChoice":
    """The cost model's figures behind the automatic chunk choice of one attention call.

    Args:
        Lq, Lkv: query and key/value lengths.
        head_dim: D; groups: G = batch x heads.
        dtype: ``"float16"`` or ``"float32"``, or the NumPy or PopXL dtype.
        causal, window: the mask, as :func:`popxl_flash.flash_attention`.
        num_chunks_q, num_chunks_kv: as :func:`popxl_flash.flash_attention`; a given count
            fixes that axis's chunk length and only the other is chosen.
        kv_groups: Gk, the groups of k and v (``None``: ``groups``; grouped-query attention:
            a divisor of ``groups``).
        score_mod, score_mod_inputs: a ``score_mod`` function and the ``popxl.TensorSpec`` of
            its inputs: also count its ops and FLOPs at the chosen chunking (built in a scratch
            Ir; the chunk choice itself does not see it).
        memory_budget: bytes, as :func:`popxl_flash.flash_attention` (``None``: the default).
        segment_ids: a bool: explain a call with segment ids (packed sequences,
            :func:`popxl_flash.flash_attention`'s ``q_segment_ids``): the packed choice
            (:func:`popxl_flash.plan.packed.choose`) priced against one sequence over the whole
            row (every visited block runs).
        max_seqlen: explain :func:`popxl_flash.flash_attn_varlen_func` instead (``Lq``,
            ``Lkv`` = ``total_q``, ``total_k``; ``groups`` = Hq): an int or a ``(max_seqlen_q,
            max_seqlen_k)`` pair, priced against sequences of those lengths back to back,
            causal and window per sequence.

    Every argument is validated by the checks of the call explained (shared with it, not
    restated): a setting the call refuses raises the same ``ValueError``/``TypeError`` here,
    naming this function's argument (``Lq``, ``head_dim``, ``kv_groups``, ``max_seqlen``, ...).

    Returns:
        :class:`popxl_flash.plan.costmodel.ChunkChoice`: ``chosen`` (the chunking
        ``num_chunks_*=None`` uses), every ``candidates`` entry with its counted work per pass
        (compute sets, matmul FLOPs, vector work and bytes copied as PopART lowers the graph,
        :mod:`popxl_flash.lowering`), its memory beyond the inputs and outputs and its
        modelled time by term (:mod:`popxl_flash.ipu_model`), ``worst_ratio`` (the chosen
        one's largest ratio to the best over the corners of the constants' plausible box),
        the seed's 256-row rule (``seed``) and naive
        attention (``naive``, and whether it fits the budget) priced alike, and ``table()``
        to print them (times labelled modelled, with the constants used). With
        ``score_mod``, ``.score_mod`` holds its :class:`popxl_flash.graph.score_mods.ScoreModCost`
        and ``table()`` ends with its line.
    """
    Lq, Lkv, head_dim, groups = (_check_int(name, value, low=1) for name, value in (
        ("Lq", Lq), ("Lkv", Lkv), ("head_dim", head_dim), ("groups", groups)))
    kv_groups = groups if kv_groups is None else _check_int("kv_groups", kv_groups, low=1)
    if groups % kv_groups:
        raise ValueError(f"kv_groups must divide groups={groups}, got kv_groups={kv_groups} "
                         "(Gk = G for multi-head attention; Gk < G is grouped-query attention)")
    dtype = check_dtype_name(dtype)
    segment_ids = check_bool("segment_ids", segment_ids)
    inputs = score_mod_input_tuple(score_mod_inputs, (popxl.TensorSpec, popxl.Tensor),
                                   "popxl.TensorSpec")
    score_mods.options(score_mod=score_mod, num_mod_inputs=len(inputs))  # the call's check
    kv_shape = (kv_groups, Lkv, head_dim)
    if segment_ids or max_seqlen is not None:
        if score_mod is not None:
            raise ValueError("score_mod with segment_ids or max_seqlen: pf.explain prices a "
                             "score_mod only for a call without segments (its cost is counted "
                             "at the chosen chunking of one sequence)")
        return _explain_packed(Lq, Lkv, kv_shape, head_dim=head_dim, groups=groups, dtype=dtype,
                               causal=causal, window=window, num_chunks_q=num_chunks_q,
                               num_chunks_kv=num_chunks_kv, memory_budget=memory_budget,
                               max_seqlen=max_seqlen)
    cfg = AttentionConfig.from_shapes((groups, Lq, head_dim), kv_shape, kv_shape, (dtype,) * 3,
                                      num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                                      causal=causal, window=window)
    choice = costmodel.choose(Lq, Lkv, head_dim=head_dim, groups=groups, dtype=dtype,
                              causal=causal, window=cfg.window, kv_groups=cfg.kv_groups,
                              chunk_q=None if num_chunks_q is None else cfg.chunk_q,
                              chunk_kv=None if num_chunks_kv is None else cfg.chunk_kv,
                              memory_budget=check_budget(memory_budget))
    choice = _with_trade(choice, Lq, Lkv, head_dim=head_dim, groups=groups, dtype=dtype,
                         causal=causal, window=cfg.window, kv_groups=cfg.kv_groups,
                         chunk_q=None if num_chunks_q is None else cfg.chunk_q,
                         chunk_kv=None if num_chunks_kv is None else cfg.chunk_kv)
    if score_mod is None:
        return choice
    chosen = choice.chosen
    sched = _schedule.plan(Lq, Lkv, chosen.chunk_q, chosen.chunk_kv, causal=causal,
                           window=cfg.window)
    # every block step calls it once, looped or inline; the pass of one block once
    calls = 1 if _steps.single_block(sched) else sum(g.steps for g in _steps.step_groups(sched))
    mod_cost = score_mod_traced(score_mods.cost, score_mod, groups=groups,
                                chunk_q=chosen.chunk_q, chunk_kv=chosen.chunk_kv,
                                steps=calls, cells=_steps.executed_cells(sched),
                                input_specs=inputs)
    return score_mods.with_score_mod_cost(choice, mod_cost)


#: Multiples of the default budget the trade table prices (``pf.explain(...).table()``).
TRADE_MULTIPLES = (1, 4, 16)


def _with_trade(choice, Lq, Lkv, **call):
    """``choice`` with its :attr:`~popxl_flash.plan.costmodel.ChunkChoice.trade`: the choice at
    the default budget (each pass's :func:`popxl_flash.plan.memory.default_budget`) times
    :data:`TRADE_MULTIPLES` (the larger pass's default, for both passes; at most one IPU's
    memory), then the bytes naive attention needs: what ``memory_budget=`` buys."""
    from dataclasses import replace
    from popxl_flash.plan import ipu_time
    base = max(costmodel.choose(Lq, Lkv, **call).budget_backward, 1)
    device = int(ipu_time.current().device_bytes)
    rows = []
    for m in TRADE_MULTIPLES:
        label = "default" if m == 1 else f"{m}x default"
        budget = None if m == 1 else min(m * base, device)
        rows.append((label, budget, costmodel.choose(Lq, Lkv, memory_budget=budget, **call)))
    if choice.naive is not None:
        rows.append(("naive attention", choice.naive.memory_bytes, None))
    return replace(choice, trade=tuple(rows))


def _explain_packed(Lq, Lkv, kv_shape, *, head_dim, groups, dtype, causal, window, num_chunks_q,
                    num_chunks_kv, memory_budget, max_seqlen):
    """:func:`explain` for a packed call (segment ids, or varlen with ``max_seqlen``)."""
    cfg = AttentionConfig.from_shapes((groups, Lq, head_dim), kv_shape, kv_shape, (dtype,) * 3,
                                      num_chunks_q=num_chunks_q, num_chunks_kv=num_chunks_kv,
                                      causal=causal, window=window)
    if max_seqlen is None:
        segments, packing = SegmentConfig(1, 1, False), packed.ONE_SEQUENCE
    else:
        seqlens = check_max_seqlen(max_seqlen)
        segments, packing = SegmentConfig(1, 1, True), packed.max_seqlen(*seqlens)
    return packed.choose(Lq, Lkv, head_dim=head_dim, groups=groups, dtype=dtype,
                         causal=cfg.causal, window=cfg.window, segments=segments,
                         packing=packing, kv_groups=cfg.kv_groups,
                         chunk_q=None if num_chunks_q is None else cfg.chunk_q,
                         chunk_kv=None if num_chunks_kv is None else cfg.chunk_kv,
                         memory_budget=check_budget(memory_budget))


def check_max_seqlen(max_seqlen):
    """``max_seqlen``: an int (both sides) or a ``(max_seqlen_q, max_seqlen_k)`` pair of ints
    ``>= 1``, each checked as :func:`popxl_flash.flash_attn_varlen_func` checks its own.

    Returns:
        ``[max_seqlen_q, max_seqlen_k]``.
    """
    if isinstance(max_seqlen, (tuple, list)):
        if len(max_seqlen) != 2:
            raise ValueError(f"max_seqlen must be an int or a (max_seqlen_q, max_seqlen_k) pair, "
                             f"got max_seqlen={max_seqlen!r} ({len(max_seqlen)} entries)")
        pair = tuple(max_seqlen)
    else:
        pair = (max_seqlen,) * 2
    return [_check_int(name, n, low=1) for name, n in zip(("max_seqlen_q", "max_seqlen_k"),
                                                           pair)]
