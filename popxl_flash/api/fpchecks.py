"""IPU floating-point exception traps for a PopXL Ir, on the SDK and on the emulator."""
from popxl_flash.backend import popxl


def enable_floating_point_checks(ir):
    """Make ops that overflow, divide by zero or produce an invalid value stop the run.

    Call before ``popxl.Session(ir, ...)``. On the Poplar SDK it sets the session option
    ``enableFloatingPointChecks``: the IPU's tiles trap on invalid, divide-by-zero and overflow
    (hardware only; the IPU model and the CPU device just warn). On the emulator the same option
    makes every op check its operands and results and raise ``FloatingPointError`` naming the op
    (kind, graph, output), on every device, with the IPU's rules read conservatively: arithmetic
    with an infinite or NaN operand traps, ``where`` and other data movement never does (see the
    emulator README).

    Args:
        ir: a ``popxl.Ir`` not yet compiled by a Session.

    Returns:
        ``ir`` (for chaining).
    """
    if not isinstance(ir, popxl.Ir):
        raise TypeError(f"enable_floating_point_checks: ir must be a popxl.Ir, got {ir!r}")
    ir._pb_ir.getSessionOptions().enableFloatingPointChecks = True
    return ir
