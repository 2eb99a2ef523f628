"""The emulator's policy for behaviour PopXL leaves unspecified (``unspecified.py``): strict
mode (the default) raises; the choosing mode of the runner (``install(standins=True)``) takes
the stated choice, counts it in ``RunProfile.unspecified_by_kind`` and warns once per kind.
Emulator-only: on the SDK these programs give whatever the device holds."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import popxl_flash
from popxl_flash import popxl

from conftest import load, store

ops = popxl.ops
f32 = popxl.float32
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(popxl_flash.BACKEND != "emulator",
                                reason="the emulator's policy for unspecified behaviour")


@pytest.fixture
def choosing():
    """Choosing mode with a fresh warn-once record; strict again afterwards."""
    from popxl_flash.emulator import set_strict, unspecified
    warned = set(unspecified._WARNED)
    unspecified._WARNED.clear()
    previous = set_strict(False)
    yield unspecified
    set_strict(previous)
    unspecified._WARNED.clear()
    unspecified._WARNED.update(warned)


def _remote_ir():
    """Loads entry 1 of a remote buffer before storing to it, twice per run (repeat)."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((3,), f32, entries=2)
        feeds = {}
        x = load(feeds, np.ones(3, np.float32))
        old = ops.remote_load(buf, 1)
        old2 = ops.remote_load(buf, 1)
        ops.remote_store(buf, 1, x)
        new = ops.remote_load(buf, 1)
        streams = [store(old), store(old2), store(new)]
    return ir, feeds, streams


def _argmax_run(data):
    ir = popxl.Ir()
    with ir.main_graph:
        s = store(ops.argmax(popxl.constant(np.asarray(data, np.float32)), 1))
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
        return out, session.profile


def test_strict_is_the_default_and_raises():
    from popxl_flash.emulator import is_strict
    assert is_strict()
    ir, feeds, _ = _remote_ir()
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.raises(RuntimeError, match="never written"):
            session.run(feeds)


def test_set_strict_takes_a_bool():
    from popxl_flash.emulator import set_strict
    with pytest.raises(TypeError, match="strict must be a bool, got 0"):
        set_strict(0)


def test_unwritten_remote_entry_reads_zeros_counted_and_warned_once(choosing):
    ir, feeds, (s_old, s_old2, s_new) = _remote_ir()
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.warns(choosing.UnspecifiedBehaviourWarning, match="reads zeros") as rec:
            out = session.run(feeds)
        assert len(rec) == 1  # two occurrences, one warning
        np.testing.assert_array_equal(out[s_old], np.zeros(3))
        np.testing.assert_array_equal(out[s_old2], np.zeros(3))
        np.testing.assert_array_equal(out[s_new], np.ones(3))
        assert session.profile.unspecified_by_kind == {"remote_unwritten": 2}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the entry is written now: nothing to warn
            session.run(feeds)
        assert session.profile.unspecified_by_kind == {}


def test_argmax_over_nan_and_ties_takes_the_stated_index(choosing):
    with pytest.warns(choosing.UnspecifiedBehaviourWarning, match="first NaN"):
        out, profile = _argmax_run([[1.0, np.nan, 5.0, np.nan], [0.0, 1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(out, [1, 3])
    assert profile.unspecified_by_kind == {"argmax_nan": 1}
    with pytest.warns(choosing.UnspecifiedBehaviourWarning, match="lowest tied index"):
        out, profile = _argmax_run([[1.0, 7.0, 7.0], [2.0, 2.0, 1.0]])
    np.testing.assert_array_equal(out, [1, 0])
    assert profile.unspecified_by_kind == {"argmax_tie": 1}


def test_dynamic_slice_out_of_range_clamps_the_start(choosing):
    ir = popxl.Ir()
    feeds = {}
    data = np.arange(8, dtype=np.float32)
    with ir.main_graph:
        idx = load(feeds, np.array([6], np.uint32))
        s = store(ops.dynamic_slice(popxl.constant(data), idx, [0], [4], False))
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.warns(choosing.UnspecifiedBehaviourWarning, match="clamps"):
            out = session.run(feeds)[s]
        assert session.profile.unspecified_by_kind == {"dynamic_out_of_range": 1}
    np.testing.assert_array_equal(out, data[4:8])


def test_replicas_count_their_own_occurrences(choosing):
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), f32, entries=1)
        s = store(ops.remote_load(buf, 0))
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.warns(choosing.UnspecifiedBehaviourWarning):
            out = session.run()[s]
        profile = session.profile
    np.testing.assert_array_equal(out, np.zeros((2, 2)))
    assert [p.unspecified_by_kind for p in profile.replicas] == [{"remote_unwritten": 1}] * 2
    assert profile.unspecified_by_kind == {"remote_unwritten": 2}


SCRIPT = """
import warnings
import numpy as np
import popxl
from popxl_flash.emulator import is_strict
ir = popxl.Ir()
with ir.main_graph:
    buf = popxl.remote_buffer((2,), popxl.float32, entries=1)
    s = popxl.d2h_stream((2,), popxl.float32)
    popxl.ops.host_store(s, popxl.ops.remote_load(buf, 0))
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
print("strict", is_strict(), "out", out.tolist(), "profile",
      session.profile.unspecified_by_kind, "warned", [type(w.message).__name__ for w in rec])
"""


def test_the_runner_chooses_and_plain_install_stays_strict(tmp_path):
    """``python -m popxl_flash.emulator.run`` (``install(standins=True)``) takes the choice;
    a process that only calls ``install()`` raises."""
    (tmp_path / "script.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "popxl_flash.emulator.run", "script.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert ("strict False out [0.0, 0.0] profile {'remote_unwritten': 1} warned "
            "['UnspecifiedBehaviourWarning']") in res.stdout
    plain = "from popxl_flash import emulator; emulator.install()\n" + SCRIPT
    res = subprocess.run([sys.executable, "-c", plain], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "was never written" in res.stderr, res.stderr


def test_fragment_reading_an_unwritten_device_value_reads_zeros(choosing):
    from popxl_flash.emulator import _internal_ir
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), f32)
        var = popxl.remote_variable(np.ones(2, np.float32), buf)
        y = popxl.variable(np.ones(2, np.float32)) * 3.0
        with popxl.context._execution_context(
                _internal_ir.ExecutionContext.WeightsToHostFragment):
            ops.remote_store(buf, 0, y)
    with popxl.Session(ir, "ipu_model", weights_to_host_on_exit=False) as session:
        with pytest.warns(choosing.UnspecifiedBehaviourWarning, match="reads zeros"):
            session.weights_to_host()
        np.testing.assert_array_equal(session.get_tensor_data(var), [0.0, 0.0])
        session.run()
        session.weights_to_host()
        np.testing.assert_array_equal(session.get_tensor_data(var), [3.0, 3.0])


def test_nll_label_out_of_range_is_treated_as_ignored(choosing):
    probs = np.array([[0.25, 0.75], [0.5, 0.5]], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        loss = ops.nll_loss(popxl.constant(probs), popxl.constant(np.array([1, 5], np.int32)),
                            reduction="sum")
        s = store(loss)
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.warns(choosing.UnspecifiedBehaviourWarning, match="as ignored"):
            out = session.run()[s]
        assert session.profile.unspecified_by_kind == {"nll_label_out_of_range": 1}
    np.testing.assert_allclose(out, -np.log(0.75), rtol=1e-6)


def test_merged_store_and_load_of_one_entry_run_in_creation_order(choosing):
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), f32, entries=1)
        ops.remote_store(buf, 0, popxl.variable(np.zeros(2, np.float32)))
        with popxl.transforms.merge_exchange(), popxl.in_sequence(True):
            ops.remote_store(buf, 0, popxl.variable(np.ones(2, np.float32)))
            s = store(ops.remote_load(buf, 0))
    with popxl.Session(ir, "ipu_model") as session:
        with pytest.warns(choosing.UnspecifiedBehaviourWarning, match="creation order"):
            out = session.run()[s]
        assert session.profile.unspecified_by_kind == {"merged_exchange_order": 1}
    np.testing.assert_array_equal(out, [1.0, 1.0])
