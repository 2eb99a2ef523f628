"""Random ops (PopXL 3.4 ``ops/random.py``, ``ops/dropout.py``, ``ops/random_seed.py``).

What holds on the IPU too: the same seed and op give the same values; seeds from
``split_random_seed`` differ from each other; uniform samples lie in ``[low, high)``; dropout
keeps a fraction ``1 - p`` and scales kept elements by ``1 / (1 - p)``. Emulator-only: the values
are the documented function of the seed (``popxl_flash.emulator.ops.random``), checked here
against that model.
"""
import numpy as np
import pytest

from conftest import COMPILE_ERRORS, emulator_only, load, run
from popxl_flash import popxl

ops = popxl.ops


def _seed(feeds, value=(7, 11)):
    return load(feeds, np.array(value, np.uint32), name="seed")


def _build(fn, seed=(7, 11)):
    """Run ``fn(seed_tensor) -> tensor(s)`` in a fresh Ir; returns the arrays."""
    ir, feeds = popxl.Ir(), {}
    with ir.main_graph:
        out = fn(_seed(feeds, seed))
    return run(ir, feeds, list(out) if isinstance(out, (list, tuple)) else out)


def test_uniform_range_moments_and_determinism():
    shape = (64, 128)
    a = _build(lambda s: ops.random_uniform(s, shape, low=-2.0, high=3.0))
    b = _build(lambda s: ops.random_uniform(s, shape, low=-2.0, high=3.0))
    c = _build(lambda s: ops.random_uniform(s, shape, low=-2.0, high=3.0), seed=(7, 12))
    assert a.shape == shape and a.dtype == np.float32
    assert a.min() >= -2.0 and a.max() < 3.0
    n = a.size  # mean 0.5, variance 25/12: five standard errors
    assert abs(a.mean() - 0.5) < 5 * np.sqrt(25 / 12 / n)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.99


def test_normal_moments_and_float16():
    z = _build(lambda s: ops.random_normal(s, (4096,), mean=1.0, std=2.0, dtype=popxl.float16))
    assert z.dtype == np.float16
    assert abs(z.astype(np.float64).mean() - 1.0) < 5 * 2.0 / 64
    assert abs(z.astype(np.float64).std() - 2.0) < 0.15


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_fraction_and_scale(p):
    x = np.linspace(1.0, 2.0, 50 * 80, dtype=np.float32).reshape(50, 80)
    ir, feeds = popxl.Ir(), {}
    with ir.main_graph:
        out = ops.dropout(load(feeds, x), _seed(feeds), p)
    y = run(ir, feeds, out)
    keep = y != 0
    n = x.size  # binomial keep count: six standard deviations
    assert abs(keep.mean() - (1 - p)) < 6 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_allclose(y[keep], x[keep] / (1 - p), rtol=2e-7)


def test_dropout_zero_is_identity():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ir, feeds = popxl.Ir(), {}
    with ir.main_graph:
        out = ops.dropout(load(feeds, x), _seed(feeds), 0.0)
    np.testing.assert_array_equal(run(ir, feeds, out), x)


def test_split_random_seed_gives_distinct_seeds_keeping_the_first_word():
    seeds = _build(lambda s: ops.split_random_seed(s, 3))
    assert [s.dtype for s in seeds] == [np.uint32] * 3
    assert all(s[0] == 7 for s in seeds)  # ModifyRandomSeedOpx: [L, randint(R + i)]
    assert len({int(s[1]) for s in seeds}) == 3
    again = _build(lambda s: ops.split_random_seed(s, 3))
    np.testing.assert_array_equal(np.stack(seeds), np.stack(again))
    u = _build(lambda s: [ops.random_uniform(t, (16,)) for t in ops.split_random_seed(s, 2)])
    assert (u[0] != u[1]).all()


def test_split_random_seed_refuses_a_bad_seed():
    ir = popxl.Ir()
    with ir.main_graph:
        for bad in (np.array([1, 2], np.int32), np.array([1, 2, 3], np.uint32)):
            with pytest.raises(ValueError, match="shape=\\(2,\\) dtype=uint32"):
                ops.split_random_seed(popxl.constant(bad))


@pytest.mark.parametrize("bad", [np.array([1, 2], np.int32), np.array([1, 2, 3], np.uint32)])
def test_random_ops_refuse_a_bad_seed_at_compile(bad):
    for make in (lambda s: ops.random_uniform(s, (2,)),
                 lambda s: ops.dropout(popxl.constant(np.ones(2, np.float32)), s, 0.5)):
        ir = popxl.Ir()
        with ir.main_graph:
            out = make(popxl.constant(bad))  # op creation accepts it (RandomBaseOp: no check)
        with pytest.raises(COMPILE_ERRORS):
            run(ir, None, out)


@pytest.mark.parametrize("p", [1.0, -0.1])
def test_dropout_ratio_outside_unit_interval_refused(p):
    ir = popxl.Ir()
    with ir.main_graph:
        out = ops.dropout(popxl.constant(np.ones(4, np.float32)),
                          popxl.constant(np.array([1, 2], np.uint32)), p)
    with pytest.raises(COMPILE_ERRORS):
        run(ir, None, out)


@emulator_only
def test_values_follow_the_documented_model():
    from popxl_flash.emulator.ops.random import keep_mask, uniform_values
    seed = np.array([3, 5], np.uint32)
    u = _build(lambda s: ops.random_uniform(s, (6, 7), low=1.0, high=2.0), seed=tuple(seed))
    np.testing.assert_array_equal(u, (1.0 + uniform_values(seed, (6, 7))).astype(np.float32))
    x = np.full((6, 7), 3.0, np.float32)
    ir, feeds = popxl.Ir(), {}
    with ir.main_graph:
        out = ops.dropout(load(feeds, x), _seed(feeds, seed), 0.25)
    y = run(ir, feeds, out)
    np.testing.assert_array_equal(y != 0, keep_mask(seed, (6, 7), 0.25))


def test_no_create_random_seed_name_in_ops():
    """``ops/__init__.py`` imports only ``split_random_seed`` from ``random_seed.py``."""
    assert not hasattr(ops, "create_random_seed")