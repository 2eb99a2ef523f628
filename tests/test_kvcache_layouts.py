"""flash_attn_with_kvcache with the caches in other layouts (``k_cache_layout``,
``v_cache_layout``: Graphcore's Llama keeps k as ``[B, Hkv, D, S]``, v as ``[B, Hkv, S, D]``) and
with flash-attn's rotary arguments.

Layouts: the same results as flash-attn's ``[B, S, H, D]`` caches bit for bit, the new rows
written in place in the caches' own layout, and (emulator graph and profile) no op copying or
transposing a whole cache: only views of it reach the attention. Rotary: q and the new keys
rotated at their cache positions before the write (flash-attn's semantics) against a float64
host rotation.
"""
import numpy as np
import pytest

import popxl_flash as pf
from attention_utils import FP_CHECKS, build_only, run_graph, zeros_variable
from popxl_flash import popxl
from test_kvcache import check_rows, expected_caches, make_case

ops = popxl.ops

emulator_only = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator graph and profile")

#: [B, S, H, D] -> each layout.
PERM = {"BSHD": (0, 1, 2, 3), "BHSD": (0, 2, 1, 3), "BHDS": (0, 2, 3, 1)}
PAIRS = [("BSHD", "BSHD"), ("BHSD", "BHSD"), ("BHDS", "BHSD"), ("BHDS", "BSHD"),
         ("BSHD", "BHSD")]


def to_layout(cache, layout):
    return np.ascontiguousarray(cache.transpose(PERM[layout]))


def from_layout(cache, layout):
    return np.ascontiguousarray(cache.transpose(np.argsort(PERM[layout])))


def run_layout(case, k_layout, v_layout, *, int_seqlens=False, readback=True, irs=None,
               **options):
    """Run one call with the caches in their layouts; returns ``(out, lse, k_cache, v_cache,
    run)`` with the caches read back (after the call) and turned into ``[B, S, H, D]``."""
    q, kc, vc, kn, vn, seqlens = case
    arrays = [q, to_layout(kc, k_layout), to_layout(vc, v_layout)]
    arrays += [kn, vn] if kn is not None else []
    arrays += [] if int_seqlens else [seqlens]

    def build(q, kc, vc, *rest):
        if irs is not None:
            irs.append(popxl.gcg().ir)
        new = rest[:2] if kn is not None else (None, None)
        lens = int(seqlens[0]) if int_seqlens else rest[-1]
        with popxl.in_sequence():
            out, lse = pf.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=lens,
                                                  return_lse=True, k_cache_layout=k_layout,
                                                  v_cache_layout=v_layout, **options)
            return [out, lse] + ([ops.identity(kc), ops.identity(vc)] if readback else [])
    outs, run = run_graph(build, arrays, fp_checks=FP_CHECKS)
    if not readback:
        return outs[0], outs[1], None, None, run
    return (outs[0], outs[1], from_layout(outs[2], k_layout), from_layout(outs[3], v_layout),
            run)


@pytest.mark.parametrize("k_layout,v_layout", PAIRS)
@pytest.mark.parametrize("Lq,splits,int_seqlens", [(1, None, False), (1, 2, False),
                                                   (5, None, True), (7, 1, False)],
                         ids=["decode", "decode-split", "prefill-int", "prefill"])
def test_layouts_match_bshd_bit_for_bit(k_layout, v_layout, Lq, splits, int_seqlens):
    """Every layout pair gives the [B, S, H, D] call's out and lse exactly, the caches hold the
    new rows at each batch row's length (in their own layout) and nothing else changed; the
    BSHD call itself is checked against the float64 reference on each row's prefix."""
    B, Lc, Hq, Hkv, D = 2, 40, 4, 2, 8
    seqlens = [3, 3] if int_seqlens else [3, 40 - Lq]
    case = make_case(11, B, Lq, Lc, Hq, Hkv, D, "float16", seqlens=seqlens)
    options = dict(causal=True, num_splits=splits, int_seqlens=int_seqlens)
    out, lse, kc2, vc2, _ = run_layout(case, k_layout, v_layout, **options)
    ref_out, ref_lse, *_ = run_layout(case, "BSHD", "BSHD", **options)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)
    q, kc, vc, kn, vn, lens = case
    k, v = expected_caches(kc, vc, kn, vn, lens)
    np.testing.assert_array_equal(kc2, k)
    np.testing.assert_array_equal(vc2, v)
    if (k_layout, v_layout) == ("BSHD", "BSHD"):
        check_rows(out, lse, q, k, v, lens, Lq, causal=True, window=(None, None),
                   dtype="float16")


def _whole_cache_copies(ir, cache_elements):
    """Ops (other than host loads and aliasing ones: views and in-place writes) whose output
    has a whole cache's elements: the transposes and copies of a cache."""
    return [(g.name, op.kind) for g in ir._graphs for op in g._ops
            if op.kind != "host_load" and op.alias is None
            and any(t.nelms >= cache_elements for t in op.outputs)]


@emulator_only
@pytest.mark.parametrize("k_layout,v_layout", [("BHDS", "BHSD"), ("BHSD", "BHSD")])
@pytest.mark.parametrize("Lq", [1, 16], ids=["decode", "prefill"])
def test_graphcore_layouts_read_the_cache_in_place(k_layout, v_layout, Lq):
    """A decode step (and a prefill) over a 1024-row cache in Graphcore's layouts with one kv
    loop: no op outside the core call's once-per-call operand preparation makes a cache-sized
    tensor (the BSHD call adds one transpose copy per cache; its reshapes are views), the same lowering
    copies and matmul FLOPs as BSHD, and at most one op more (BHDS's transpose_ view). The automatic structure
    (the straight-line pass) reads every layout, BSHD too, through views."""
    B, Lc, Hq, Hkv, D = 2, 1024, 4, 2, 64
    case = make_case(3, B, Lq, Lc, Hq, Hkv, D, "float16", seqlens=[100, 300])
    cache_elements = B * Lc * Hkv * D
    profiles, copies = {}, {}
    for pair in [(k_layout, v_layout), ("BSHD", "BSHD")]:
        irs = []
        *_, run = run_layout(case, *pair, readback=False, irs=irs, causal=True, num_splits=1)
        profiles[pair], copies[pair] = run.profile, _whole_cache_copies(irs[0], cache_elements)
        irs = []
        *_, straight = run_layout(case, *pair, readback=False, irs=irs, causal=True)
        assert straight.profile.loop_iterations == 0  # the straight-line pass
        assert _whole_cache_copies(irs[0], cache_elements) == []
    new, base = profiles[(k_layout, v_layout)], profiles[("BSHD", "BSHD")]
    # The kv loop's core call prepares its operands once per call (the scale folded into k,
    # k and v stacked for one slice per step): the same copies whatever the layout; BSHD adds
    # its regrouping (the check can see a copy).
    extra = list(copies[("BSHD", "BSHD")])
    for entry in copies[(k_layout, v_layout)]:
        extra.remove(entry)
    assert sorted(kind for _, kind in extra) == ["transpose", "transpose"]
    assert all(name.startswith("FlashAttention") and kind != "transpose"
               for name, kind in copies[(k_layout, v_layout)])
    assert new.boundary_bytes_copied == base.boundary_bytes_copied
    assert new.bytes_copied < base.bytes_copied  # BSHD's regrouping is Copy programs
    assert new.matmul_flops == base.matmul_flops
    assert base.ops_executed - 1 <= new.ops_executed <= base.ops_executed + 1
    assert new.peak_live_bytes <= base.peak_live_bytes


def test_automatic_structure_is_one_loop_for_other_layouts():
    """``num_splits=None`` with a BHDS/BHSD cache is one kv loop (the view path: no
    cache-sized copy); an explicit ``num_splits=2`` is honoured, and regroups the cache."""
    B, Lc, Hq, Hkv, D = 1, 1024, 2, 1, 8
    case = make_case(5, B, 1, Lc, Hq, Hkv, D, "float32", seqlens=[700])
    found = []
    for splits in (None, 2):
        irs = []
        run_layout(case, "BHDS", "BHSD", readback=False, irs=irs, causal=True,
                   num_splits=splits)
        found.append(_whole_cache_copies(irs[0], B * Lc * Hkv * D))
    assert found[0] == [] and found[1] != []


# -- rotary ------------------------------------------------------------------------------------
def rotate_host(x, cos, sin, positions, interleaved):
    """float64 rotation of ``x [B, L, H, D]`` at int ``positions [B, L]`` (flash-attn's
    ``apply_rotary_emb`` semantics: the last ``D - R`` dims pass through)."""
    x = x.astype(np.float64)
    half = cos.shape[1]
    c = cos.astype(np.float64)[positions][:, :, None, :]  # [B, L, 1, R/2]
    s = sin.astype(np.float64)[positions][:, :, None, :]
    out = x.copy()
    if interleaved:
        e, o = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = e * c - o * s, o * c + e * s
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half], out[..., half:2 * half] = a * c - b * s, b * c + a * s
    return out


def rotary_case(seed, B, Lq, Lc, Hq, Hkv, D, dtype, rotary_dim, seqlens):
    case = make_case(seed, B, Lq, Lc, Hq, Hkv, D, dtype, seqlens=seqlens)
    cos, sin = pf.rotary_tables(Lc, rotary_dim)
    return case, cos, sin


def run_rotary(case, cos, sin, *, k_layout="BSHD", v_layout="BSHD", **options):
    q, kc, vc, kn, vn, seqlens = case
    arrays = [q, to_layout(kc, k_layout), to_layout(vc, v_layout), kn, vn, seqlens, cos, sin]

    def build(q, kc, vc, kn, vn, lens, cos, sin):
        with popxl.in_sequence():
            out, lse = pf.flash_attn_with_kvcache(
                q, kc, vc, kn, vn, cache_seqlens=lens, return_softmax_lse=True,
                rotary_cos=cos, rotary_sin=sin, k_cache_layout=k_layout,
                v_cache_layout=v_layout, **options)
            return [out, lse, ops.identity(kc), ops.identity(vc)]
    (out, lse, kc2, vc2), _ = run_graph(build, arrays, fp_checks=FP_CHECKS)
    return out, lse, from_layout(kc2, k_layout), from_layout(vc2, v_layout)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("Lq,causal,rotary_dim", [(1, True, 8), (4, True, 4), (3, False, 8)],
                         ids=["decode", "prefill-partial-dims", "non-causal"])
@pytest.mark.parametrize("layouts", [("BSHD", "BSHD"), ("BHDS", "BHSD")], ids=["bshd", "llama"])
def test_rotary_matches_host_rotation(interleaved, Lq, causal, rotary_dim, layouts):
    """The caches hold the new keys rotated at ``cache_seqlens[b] + i`` (float32 rotation,
    within float32 rounding of the float64 one) and v unrotated; out and lse are the reference
    attention of the host-rotated q (at its cache positions when causal, at
    ``cache_seqlens[b]`` otherwise: flash-attn's rule) against the rotated cache."""
    B, Lc, Hq, Hkv, D = 2, 24, 4, 2, 8
    seqlens = np.array([2, 24 - Lq], np.int32)
    case, cos, sin = rotary_case(7, B, Lq, Lc, Hq, Hkv, D, "float32", rotary_dim, seqlens)
    q, kc, vc, kn, vn, _ = case
    out, lse, kc2, vc2 = run_rotary(case, cos, sin, causal=causal,
                                    rotary_interleaved=interleaved, k_layout=layouts[0],
                                    v_layout=layouts[1])
    k_pos = seqlens[:, None] + np.arange(Lq)[None, :]
    q_pos = k_pos if causal else np.repeat(seqlens[:, None], Lq, axis=1)
    k_rot = rotate_host(kn, cos, sin, k_pos, interleaved)
    q_rot = rotate_host(q, cos, sin, q_pos, interleaved)
    k_exp, v_exp = expected_caches(kc, vc, k_rot.astype(np.float32), vn, seqlens)
    np.testing.assert_allclose(kc2, k_exp, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(vc2, v_exp)
    if rotary_dim < D:  # the pass-through dims are untouched
        for b in range(B):
            rows = slice(seqlens[b], seqlens[b] + Lq)
            np.testing.assert_array_equal(kc2[b, rows, :, rotary_dim:], kn[b, :, :, rotary_dim:])
    check_rows(out, lse, q_rot.astype(np.float32), kc2, vc2, seqlens, Lq, causal=causal,
               window=(None, None), dtype="float32")


def test_rotary_float16_and_int_seqlens():
    """float16 q/k with float32 tables and an int ``cache_seqlens``: the written keys are the
    float64 rotation rounded to float16 (within one float16 ulp: the float32 rotation is
    rounded once)."""
    B, Lc, Hq, Hkv, D = 1, 16, 2, 1, 8
    case = make_case(9, B, 1, Lc, Hq, Hkv, D, "float16", seqlens=[5])
    q, kc, vc, kn, vn, seqlens = case
    cos, sin = pf.rotary_tables(Lc, D)

    def build(q, kc, vc, kn, vn, cos, sin):
        with popxl.in_sequence():
            out = pf.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5, causal=True,
                                             rotary_cos=cos, rotary_sin=sin,
                                             rotary_interleaved=False)
            return [out, ops.identity(kc)]
    (out, kc2), _ = run_graph(build, [q, kc, vc, kn, vn, cos, sin])
    k_rot = rotate_host(kn, cos, sin, np.array([[5]]), False)
    np.testing.assert_allclose(kc2[0, 5].astype(np.float64), k_rot[0, 0], rtol=2 ** -10,
                               atol=2 ** -14)
    assert out.dtype == np.float16


ROTARY_BAD = [
    (dict(rotary_cos=(16, 4)), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=(16, 4), rotary_sin=(16, 3)), ValueError,
     "rotary_sin must have the shape of rotary_cos (16, 4), got rotary_sin shape (16, 3)"),
    (dict(rotary_cos=(16, 5), rotary_sin=(16, 5)), ValueError,
     "rotary_cos has 5 columns: rotary_dim = 10 must be at most the head dim D=8"),
    (dict(rotary_cos=(8, 4), rotary_sin=(8, 4)), ValueError,
     "rotary_cos must have at least Lcache=16 rows"),
    (dict(rotary_cos=(16, 4), rotary_sin=(16, 4), q_len=3), ValueError,
     "rotary_cos must have at least Lcache=16 + Lq - Lnew = 18 rows"),
    (dict(rotary_cos=(16, 4), rotary_sin=(16, 4), new=False), ValueError,
     "they need the new rows k and v"),
    (dict(rotary_cos=(16, 4), rotary_sin=(16, 4), rotary_interleaved=1), TypeError,
     "rotary_interleaved must be a bool"),
    (dict(rotary_cos=(16, 4), rotary_sin=(16, 4), table_dtype=np.int32), TypeError,
     "rotary_cos must be float16 or float32, got dtype int32"),
]


@pytest.mark.parametrize("override, exc, fragment", ROTARY_BAD)
def test_rotary_bad_input_is_a_build_time_error(override, exc, fragment):
    override = dict(override)
    dtype = override.pop("table_dtype", np.float32)
    new = override.pop("new", True)
    q_len = override.pop("q_len", 1)

    def fn():
        q = zeros_variable((2, q_len, 4, 8))
        kc, vc = zeros_variable((2, 16, 2, 8)), zeros_variable((2, 16, 2, 8))
        kn, vn = (zeros_variable((2, 1, 2, 8)) if new else None for _ in range(2))
        tables = {n: zeros_variable(override.pop(n), dtype) for n in ("rotary_cos", "rotary_sin")
                  if n in override}
        return pf.flash_attn_with_kvcache(q, kc, vc, kn, vn, 0 if new else None, **tables,
                                          **override)
    with pytest.raises(exc, match=re_escape(fragment)):
        build_only(fn)


def re_escape(fragment):
    import re
    return re.escape(fragment)
