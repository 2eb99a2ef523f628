"""Put on ``PYTHONPATH`` by ``popxl_flash.emulator.run`` and the pytest plugin, so Python
processes a PopXL script or test starts (``subprocess.run(["python3", "train.py"])``) run on
the emulator too: when ``POPXL_FLASH_EMULATOR`` is "1", ``install(standins=True)`` at start-up.
"""
import os

if os.environ.get("POPXL_FLASH_EMULATOR") == "1":
    try:
        from popxl_flash.emulator.installer import install
    except ImportError:  # popxl_flash not importable in this interpreter: leave it alone
        pass
    else:
        install(standins=True)
