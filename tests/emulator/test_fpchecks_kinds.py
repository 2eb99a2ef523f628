"""The floating-point-check classes name only op kinds the emulator registers, so the lists
cannot drift from the op table (a misspelt or removed kind would silently trap as arithmetic)."""
from conftest import emulator_only

import popxl_flash  # noqa: F401 (registers the ops)


@emulator_only
def test_fp_check_classes_name_registered_plain_ops():
    from popxl_flash.emulator.fpchecks import COMPARE, MOVE
    from popxl_flash.emulator.registry import IMPLS, RUNTIME
    for kind in MOVE | COMPARE:
        assert kind in IMPLS and kind not in RUNTIME, kind
