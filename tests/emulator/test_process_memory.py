"""The emulator process's own memory over a run stays close to the run profile's peak.

Users test long sequences on CPU, so the interpreter must not hold hidden copies: the traced
(``tracemalloc``) peak of one ``session.run_with_outputs`` -- host buffers allocated before,
as the harness does -- is at most 1.5x ``profile.peak_live_bytes`` for a flash forward, and a
naive attention's traced peak is at least 10x flash's at 16 x 16 chunks of 128 rows (float32,
G = 2, L = 2048, D = 64; the automatic choice may take longer chunks within its memory budget).
"""
import tracemalloc

import numpy as np
import pytest

import popxl_flash as pf
from conftest import emulator_only
from popxl_flash import popxl
from popxl_flash.checks.naive import naive_attention

pytestmark = emulator_only

ops = popxl.ops


def _traced_run(attention, G=2, L=2048, D=64):
    """Returns: (traced peak bytes of one run, the run's profile)."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((G, L, D)).astype(np.float32) for _ in range(3)]
    ir = popxl.Ir()
    with ir.main_graph:
        streams = [popxl.h2d_stream(a.shape, popxl.float32) for a in arrays]
        out = attention(*[ops.host_load(s) for s in streams])
        d2h = popxl.d2h_stream(out.shape, out.dtype)
        ops.host_store(d2h, out)
    session = popxl.Session(ir, "ipu_model")
    inputs, outputs = dict(zip(streams, arrays)), session.create_host_outputs()
    with session:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            session.run_with_outputs(inputs, outputs)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    return peak, session.profile


@pytest.fixture(scope="module")
def flash_run():
    return _traced_run(lambda q, k, v: pf.flash_attention(q, k, v, num_chunks_q=16,
                                                          num_chunks_kv=16))


def test_flash_traced_peak_within_1_5x_of_profile(flash_run):
    traced, profile = flash_run
    assert traced <= 1.5 * profile.peak_live_bytes, (traced, profile.peak_live_bytes)


def test_naive_traced_peak_at_least_10x_flash(flash_run):
    naive, _ = _traced_run(naive_attention)
    assert naive >= 10 * flash_run[0], (naive, flash_run[0])
