"""The package's layers import only downwards: checks -> entry points (the package root, ``api``)
-> graph -> plan, and the emulator imports nothing outside itself but the ground floor, which
every layer may read: PopART's lowering table (``lowering``) and the IPU time model priced by it
(``ipu_model``), which import only each other.

Read from the source (every ``import`` and ``from ... import`` statement, at any depth, so a
lazy import inside a function counts too), not from ``sys.modules``.
"""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "popxl_flash"

#: What each layer may import from the package (besides itself). ``backend`` is the one door
#: to PopXL; ``_planner`` is the compiled planner; ``None`` is the package root (the public
#: names, ``import popxl_flash as pf``), which the checks exercise as users call them.
GROUND = {"lowering", "ipu_model"}
ALLOWED = {
    "plan": {"plan", "_planner"} | GROUND,
    "graph": {"graph", "plan", "backend"} | GROUND,
    "api": {"api", "graph", "plan", "backend", "emulator"} | GROUND,
    "checks": {"checks", None, "api", "graph", "plan", "backend", "emulator"} | GROUND,
    "emulator": {"emulator"} | GROUND,
    "backend": {"emulator"},
    "lowering": set(),
    "ipu_model": {"lowering"},
}
#: Third-party modules a layer must not import (PopXL and its relatives).
POPXL = {"popxl", "popart", "popxl_addons"}


def _layer(path):
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0][:-3]


def _imports(path):
    """Yield ``(top-level module, package layer or None)`` of every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside its own subpackage
                names = ["popxl_flash." + _layer(path)]
            elif node.module == "popxl_flash":
                names = ["popxl_flash." + a.name for a in node.names]
            else:
                names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            yield parts[0], (parts[1] if parts[0] == "popxl_flash" and len(parts) > 1 else None)


MODULES = sorted(p for p in PKG.rglob("*.py") if _layer(p) in ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_go_down(path):
    layer = _layer(path)
    for top, sub in _imports(path):
        if top == "popxl_flash":
            assert sub in ALLOWED[layer] | {layer}, (
                f"{path.relative_to(PKG)} ({layer}) imports popxl_flash.{sub}")
        elif layer in ("plan", "emulator", "lowering", "ipu_model"):
            assert top not in POPXL, f"{path.relative_to(PKG)} ({layer}) imports {top}"


def test_every_layer_is_checked():
    found = {_layer(p) for p in MODULES}
    assert {"plan", "graph", "api", "checks", "emulator", "backend"} | GROUND <= found


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from popxl_flash.graph import blocks\n")
    assert ("popxl_flash", "graph") in set(_imports(bad))
