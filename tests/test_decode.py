"""The straight-line decode pass (popxl_flash/graph/decode.py): its counted work equals the
emulator's profile exactly, a decode step costs at most 2x the ops and 1.5x the modelled
time of a naive cached attention (benchmarks.kvcache.naive_decode) on the same inputs with
results within the tolerance rule, and the structure choice keeps to ``memory_budget``.
"""
import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import output_elements
from attention_utils import run_graph
from benchmarks.kvcache import naive_decode
from popxl_flash import popxl
from popxl_flash.api import kvcache
from popxl_flash.plan import kvcache as kvcache_plan
from test_kvcache import check_case, geometric_slopes, make_case

ops = popxl.ops

emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator run profile")

_LAYOUT_AXES = {"BSHD": (0, 1, 2, 3), "BHSD": (0, 2, 1, 3), "BHDS": (0, 2, 3, 1)}


def _profile(build, arrays):
    """The run profile of ``build`` with the host transfers taken out, and the outputs."""
    outs, run = run_graph(build, arrays)
    p = run.profile
    io = {k: n for k, n in p.ops_by_kind.items() if k in ("host_load", "host_store")}
    return p, p.ops_excluding_views - sum(io.values()), outs


def _decode(case, *, tensor=True, slopes=None, k_layout="BSHD", v_layout="BSHD", **options):
    q, kc, vc, kn, vn, seqlens = case
    arrays = [q, kc.transpose(_LAYOUT_AXES[k_layout]), vc.transpose(_LAYOUT_AXES[v_layout])]
    arrays += [kn, vn] if kn is not None else []
    arrays += [seqlens] if tensor else []
    arrays += [slopes] if slopes is not None else []

    def build(q, kc, vc, *rest):
        rest = list(rest)
        alibi = rest.pop() if slopes is not None else None
        lens = rest.pop() if tensor else int(seqlens[0])
        new = rest if kn is not None else (None, None)
        res = pf.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=lens, alibi_slopes=alibi,
                                         k_cache_layout=k_layout, v_cache_layout=v_layout,
                                         **options)
        return list(res) if isinstance(res, tuple) else [res]
    return _profile(build, arrays)


COUNT_CASES = [
    # B, Lq, Lnew, Lc, Hq, Hkv, D, dtype, options
    (1, 1, 1, 256, 8, 2, 64, "float16", dict(causal=True)),
    (2, 1, 1, 300, 4, 4, 32, "float32", dict(causal=True, return_lse=True)),
    (2, 1, 0, 128, 4, 2, 16, "float16", dict(return_lse=True)),  # rows may see nothing
    (2, 4, 4, 200, 4, 1, 16, "float16", dict(causal=True, window_size=(7, -1))),
    (1, 3, 3, 96, 2, 2, 8, "float32", dict(window_size=(2, 1), return_lse=True)),
    (2, 1, 1, 160, 4, 2, 16, "float16", dict(causal=True, softcap=20.0, alibi=True,
                                             return_lse=True)),
    (1, 2, 2, 128, 4, 2, 16, "float16", dict(causal=True, int_seqlens=True, alibi=True)),
    (2, 1, 1, 128, 4, 2, 16, "float16", dict(causal=True, softmax_scale=0.25)),  # exact fold
]


@emulator_only
@pytest.mark.parametrize("B,Lq,Lnew,Lc,Hq,Hkv,D,dtype,options", COUNT_CASES)
def test_straight_counts_are_the_emulators(B, Lq, Lnew, Lc, Hq, Hkv, D, dtype, options):
    """kvcache.straight_counts: executed ops (other than views), matmul FLOPs and output
    elements exactly the emulator's (host transfers excluded), no lowering copies, no loop."""
    options = dict(options)
    tensor = not options.pop("int_seqlens", False)
    alibi = options.pop("alibi", False)
    case = make_case(1, B, Lq, Lc, Hq, Hkv, D, dtype, Lnew=Lnew, seqlens=[Lc // 3] * B)
    slopes = geometric_slopes(Hq) if alibi else None
    prof, steps, _ = _decode(case, tensor=tensor, slopes=slopes, **options)
    dims = kvcache.Dims(B, Lq, Lc, Lnew, Hq, Hkv, D)
    model = kvcache.straight_counts(
        dims, dtype, causal=options.get("causal", False),
        window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
        alibi=alibi, return_lse=options.get("return_lse", False), runtime_lengths=tensor,
        scale=options.get("softmax_scale"))
    assert prof.loop_iterations == 0 and prof.boundary_bytes_copied == 0
    assert model.ops == steps
    assert sum(model.matmul_flops.values()) == prof.matmul_flops
    assert model.vector_elements == output_elements(prof)


#: (B, Hq, Hkv, D, Lcache): MHA and GQA, 1024 to 4096 rows, D 64 to 128.
TARGET = [(1, 32, 32, 128, 4096), (2, 8, 2, 64, 1024), (1, 16, 4, 64, 2048),
          (2, 16, 16, 128, 2048)]


@emulator_only
@pytest.mark.parametrize("B,Hq,Hkv,D,Lc", TARGET)
def test_decode_step_is_within_2x_ops_and_1_5x_time_of_naive(B, Hq, Hkv, D, Lc):
    """One decode step (Lq = Lnew = 1, float16, causal, run-time lengths) of the automatic
    structure: the straight-line pass, at most 2x naive_decode's ops and 1.5x its
    modelled time on the same inputs (host transfers excluded), and its out equal to the
    float64 reference within the 2x rule (checked with lse, caches and floating-point traps by
    test_kvcache's check)."""
    case = make_case(2, B, 1, Lc, Hq, Hkv, D, "float16", seqlens=[Lc // 2 - 1, Lc // 5][:B])
    flash, flash_steps, _ = _decode(case, causal=True)
    naive, naive_steps, _ = _decode_naive(case)
    assert flash.loop_iterations == 0
    assert flash_steps <= 2 * naive_steps
    # modelled by PopART's lowering (host transfers are not priced)
    assert flash.modelled().seconds <= 1.5 * naive.modelled().seconds
    chosen = kvcache.decode_choice(B, 1, Lc, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                                   causal=True).chosen
    assert chosen.straight
    check_case(case, "float16", causal=True)


def _decode_naive(case):
    q, kc, vc, kn, vn, seqlens = case
    return _profile(lambda *t: [naive_decode(*t)], [q, kc, vc, kn, vn, seqlens])


@pytest.mark.parametrize("layouts", [("BHSD", "BHSD"), ("BHDS", "BHSD")])
def test_straight_pass_in_graphcore_layouts_matches_reference(layouts):
    """The straight-line pass reading BHSD/BHDS caches through views: the caches after the
    write and every row (one that sees nothing too) against the float64 reference."""
    from test_kvcache_layouts import run_layout
    from test_kvcache import check_rows, expected_caches
    case = make_case(4, 2, 1, 48, 4, 2, 8, "float16", Lnew=0, seqlens=[0, 40])
    out, lse, kc2, vc2, run = run_layout(case, *layouts, causal=True)
    assert run.profile.loop_iterations == 0
    k, v = expected_caches(*case[1:])
    np.testing.assert_array_equal(kc2, k)
    check_rows(out, lse, case[0], k, v, case[5], 0, causal=True, window=(None, None),
               dtype="float16")


@pytest.mark.parametrize("mods", [dict(softcap=15.0), dict(alibi="heads"),
                                  dict(alibi="rows", softcap=5.0)])
@pytest.mark.parametrize("Lq", [1, 3])
def test_straight_pass_modifiers_match_reference(mods, Lq):
    """softcap and ALiBi ([Hq] and [B, Hq] slopes) in the straight-line pass against the
    float64 reference (2x rule, traps on)."""
    mods = dict(mods)
    kind = mods.pop("alibi", None)
    B, Hq = 2, 4
    slopes = None if kind is None else (geometric_slopes(Hq) if kind == "heads" else
                                        np.stack([geometric_slopes(Hq), 2 * geometric_slopes(Hq)]))
    case = make_case(7, B, Lq, 40, Hq, 2, 8, "float16", seqlens=[3, 30])
    run = check_case(case, "float16", causal=True, slopes=slopes, **mods)
    assert run.profile.loop_iterations == 0


def test_memory_budget_picks_the_structure_and_refuses_the_impossible():
    """The straight-line pass's memory grows with the cache; a budget below it gives a kv
    loop (the least modelled time among the candidates that fit); an explicit budget nothing
    meets raises ValueError naming memory_budget; explain passes the budget through. The
    default (2 x the call's own inputs and outputs + 4 MiB) is below the straight pass here:
    a kv loop."""
    shape = dict(q_heads=32, kv_heads=4, head_dim=64)  # 16 query rows: a large score matrix
    default = pf.kvcache.explain(1, 16, 4096, **shape)
    assert not default.chosen.straight and default.chosen.fits
    auto = pf.kvcache.explain(1, 16, 4096, **shape, memory_budget=64 * 2 ** 20)
    assert auto.chosen.straight and auto.chosen.fits
    straight = auto.chosen.memory_bytes
    tight = pf.kvcache.explain(1, 16, 4096, **shape, memory_budget=straight - 1)
    assert not tight.chosen.straight and tight.chosen.fits
    fitting = [c for c in tight.candidates if c.fits]
    assert tight.chosen.seconds == min(c.seconds for c in fitting)
    assert tight.memory_budget == straight - 1
    with pytest.raises(ValueError, match="memory_budget=1,000 bytes"):
        pf.kvcache.explain(1, 1, 4096, **shape, memory_budget=1000)
    with pytest.raises(TypeError, match="memory_budget"):
        pf.kvcache.explain(1, 1, 4096, **shape, memory_budget=1.5)


@emulator_only
def test_memory_model_bounds_the_emulator_and_the_call_keeps_to_the_budget():
    """straight_bytes is an upper bound of the emulator's bytes beyond inputs and outputs (and
    within 2x of them); flash_attn_with_kvcache(memory_budget=) below it runs a kv loop, and an
    impossible one is a build-time ValueError."""
    B, Lq, Lc, Hq, Hkv, D = 1, 16, 1024, 16, 2, 32
    case = make_case(5, B, Lq, Lc, Hq, Hkv, D, "float16", seqlens=[500])
    prof, _, outs = _decode(case, causal=True, return_lse=True)
    assert prof.loop_iterations == 0
    arrays = [a for a in case if a is not None]
    extra = prof.peak_live_bytes - sum(a.nbytes for a in arrays) - sum(o.nbytes for o in outs)
    model = kvcache_plan.straight_bytes(kvcache.Dims(B, Lq, Lc, Lq, Hq, Hkv, D), "float16",
                                        causal=True, return_lse=True)
    assert extra <= model <= 2 * extra
    loop, _, _ = _decode(case, causal=True, return_lse=True, memory_budget=model - 1)
    assert loop.loop_iterations > 0
    with pytest.raises(ValueError, match="memory_budget"):
        _decode(case, causal=True, memory_budget=1000)
