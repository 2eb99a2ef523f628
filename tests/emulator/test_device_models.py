"""Devices: the full-size IPU model route, tile counts and memory, ``profile.fits_device``.

PopART: ``DevicexManager::createHostDevice`` accepts exactly ``numIPUs``, ``tilesPerIPU``,
``compileIPUCode``, ``ipuVersion`` for an IPU model (default ``tilesPerIPU`` = 4); a Mk2 tile has
624 KiB. The emulator's profile compares the run's peak live bytes with the device's memory.
"""
import numpy as np
import pytest

from conftest import emulator_only, store
from popxl_flash.checks import devices
from popxl_flash import popxl
from popxl_flash.emulator import popart
from popxl_flash.emulator.errors import PopartError

pytestmark = emulator_only

ops = popxl.ops
KiB = 1024


def _ir(n_floats):
    ir = popxl.Ir()
    with ir.main_graph:
        x = ops.init((n_floats,), popxl.float32, init_type="zero")
        store(x + 1.0)
    return ir


def _profile(ir, device):
    with popxl.Session(ir, device) as session:
        session.run()
        return session.profile


def test_full_size_model_has_1472_tiles_of_624_kib():
    dev = popart.DeviceManager().createIpuModelDevice(
        {"numIPUs": 1, "tilesPerIPU": 1472, "ipuVersion": "ipu2"})
    assert (dev.numIpus, dev.tilesPerIPU, dev.ipuVersion) == (1, 1472, "ipu2")
    assert dev.memory_bytes == 1472 * 624 * KiB


def test_model_defaults_to_four_tiles_as_popart():
    dev = popart.DeviceManager().createIpuModelDevice({})
    assert dev.tilesPerIPU == 4 and dev.memory_bytes == 4 * 624 * KiB


@pytest.mark.parametrize("key", ["tilesPerIpu", "syncPattern", "numIpus", "memory"])
def test_model_refuses_unknown_option_keys(key):
    with pytest.raises(PopartError, match="Invalid option"):
        popart.DeviceManager().createIpuModelDevice({"numIPUs": 1, key: 4})


def test_model_option_values_must_be_integers():
    with pytest.raises(PopartError, match="tilesPerIPU"):
        popart.DeviceManager().createIpuModelDevice({"tilesPerIPU": "many"})


@pytest.mark.parametrize("desc, tiles, memory", [
    ("ipu_model", 4, 4 * 624 * KiB), ("ipu_hw", 1472, 1472 * 624 * KiB), ("cpu", 1, None)])
def test_session_strings_name_devices_with_known_memory(desc, tiles, memory):
    session = popxl.Session(_ir(4), desc)
    assert session._device.tilesPerIPU == tiles  # PopXL keeps the DeviceInfo in `_device` too
    assert session._device.memory_bytes == memory


def test_session_accepts_a_device_info_and_profile_says_whether_it_fits():
    ir = _ir(300 * KiB // 4)  # x and x + 1: 600 KiB live at the peak
    small = popart.DeviceManager().createIpuModelDevice({"tilesPerIPU": 1})
    profile = _profile(ir, small)
    assert profile.device_bytes == 624 * KiB
    assert profile.peak_live_bytes > 600 * KiB and profile.fits_device is True
    big_ir = _ir(400 * KiB // 4)  # 800 KiB > one tile: the model runs anyway (no OOM check)
    profile = _profile(big_ir, popart.DeviceManager().createIpuModelDevice({"tilesPerIPU": 1}))
    assert profile.fits_device is False
    assert _profile(_ir(4), "cpu").fits_device is None


def test_harness_ipu_model_is_the_full_size_model():
    dev = devices.session_device("ipu_model")
    assert dev.tilesPerIPU == 1472 and dev.memory_bytes == 1472 * 624 * KiB
    assert devices.session_device("ipu_hw") == "ipu_hw"
    with pytest.raises(ValueError, match="device must be one of"):
        devices.session_device("ipu")


def test_default_device_is_the_model_on_the_emulator():
    assert devices.default_device() == "ipu_model"
