"""The harness: device names from ``popxl_flash.checks.devices``, timed runs with ``run_with_outputs``
into host buffers allocated once (never ``session.run``, which allocates them every call)."""
import numpy as np
import pytest

from popxl_flash.checks import harness

from popxl_flash import popxl


def test_timed_runs_use_run_with_outputs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("session.run allocates host outputs on every call")
    monkeypatch.setattr(popxl.Session, "run", refuse)
    calls = []
    create = popxl.Session.create_host_outputs
    monkeypatch.setattr(popxl.Session, "create_host_outputs",
                        lambda self: calls.append(1) or create(self))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = harness.run_graph(lambda t: [t + 1.0], [x], warmup=2, repeats=3)
    np.testing.assert_array_equal(result.outputs[0], x + 1)
    assert len(result.run_seconds) == 3 and len(calls) == 1


def test_unknown_device_name_is_refused():
    with pytest.raises(ValueError, match="device must be one of"):
        harness.run_graph(lambda t: [t], [np.zeros(2, np.float32)], device="ipu_model_4")
