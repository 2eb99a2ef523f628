"""The package's layers import only downwards: checks -> entry points (the package root, ``api``)
-> graph -> plan, and the emulator imports nothing outside itself but the ground floor, which
every layer may read: PopART's lowering table (``lowering``) and the IPU time model priced by it
(``ipu_model``), which import only each other. Inside the emulator its modules import only
downwards through its own declared layers (``EMULATOR_LAYERS``) and form no cycle.

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


# -- the emulator's own layers -----------------------------------------------------------------
EMULATOR = PKG / "emulator"
#: The emulator's layers, bottom-up (``popxl_flash/emulator/README.md``, "Layers"): each module
#: or subpackage of the emulator and its layer. A module imports its own layer or lower ones,
#: never a higher one; ``popxl`` and the package's ``__init__`` are the top. Where a lower
#: layer needs what a higher one defines, the higher one fills a table of the lower one when
#: it is imported (``tensor.bind_ops``, ``_internal_ir.PRE_ALIAS_PATTERNS``,
#: ``installer.attach``, the op tables of ``registry``).
EMULATOR_LAYERS = {
    # 1: leaf utilities: errors, dtypes, the strict/choosing switch, stubs, PopXL's names
    "errors": 1, "dtypes": 1, "unspecified": 1, "unsupported": 1, "popxl_names": 1,
    "random_seed": 1,
    # 2: tensors and the IR: graph stack, tensors, graphs and op records, tile sets, replica
    # groupings, session options, the ``popart._internal.ir`` wrappers over them
    "context": 2, "tensor": 2, "ir": 2, "tiles": 2, "replica_grouping": 2, "popart": 2,
    "_internal_ir": 2,
    # 3: the op table and its rules: registry, op families, remote buffers and their ops,
    # gradient rules, popxl.utils helpers
    "registry": 3, "ops": 3, "remote": 3, "grads": 3, "utils": 3,
    # 4: compile and run: alias model, lowering copies, plans, the evaluator, replicas,
    # floating-point checks, the profile, Session
    "views": 4, "copies": 4, "plan": 4, "fpchecks": 4, "interpreter": 4, "replication": 4,
    "profile": 4, "session": 4,
    # 5: transforms (autodiff, merge_exchange)
    "transforms": 5,
    # 6: install and run third-party code: popxl-addons' op models, stand-ins, the installer,
    # the runner, the pytest plugin, the child processes' sitecustomize
    "addons_ops": 6, "standins": 6, "installer": 6, "run": 6, "pytest_plugin": 6,
    "_children": 6,
    # 7: the PopXL-shaped facade and the package root
    "popxl": 7, "__init__": 7,
}


def _emulator_module(path):
    """Returns: the dotted name of ``path`` under ``emulator`` ("ops.shape", "ops" for
    ``ops/__init__.py``, "" for the emulator's own ``__init__.py``)."""
    parts = list(path.relative_to(EMULATOR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


EMULATOR_FILES = sorted(EMULATOR.rglob("*.py"))
EMULATOR_MODULES = {_emulator_module(p) for p in EMULATOR_FILES}


def _emulator_layer(module):
    """Returns: the declared layer of an emulator module (None: not declared)."""
    return EMULATOR_LAYERS.get(module.split(".")[0] if module else "__init__")


def _known(name, modules):
    """Returns: ``name`` or its nearest enclosing module in ``modules``."""
    while name not in modules and name:
        name = name.rpartition(".")[0]
    return name


def _emulator_imports(tree, module, is_package, modules=EMULATOR_MODULES):
    """Yield every emulator module an import in ``tree`` (the source of emulator module
    ``module``; ``is_package``: it is an ``__init__.py``) runs, at any depth: the imported
    module (``from .x import y``: ``x.y`` when that is a module, else ``x``), and the
    ``__init__`` of each subpackage it sits in, unless ``module`` is inside that subpackage
    already (Python imports a package before its modules). The emulator's own ``__init__``
    runs before any of its modules, so it counts only when imported by name."""
    for node in ast.walk(tree):
        for name in _import_targets(node, module, is_package, modules):
            parts = name.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if module != package and not module.startswith(package + "."):
                    yield package
            yield name


def _import_targets(node, module, is_package, modules):
    """The emulator modules one import statement names (absolute or relative)."""
    prefix = "popxl_flash.emulator"
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if module else []
            base = base if is_package else base[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
            source = prefix + ("." + source if source else "")
        else:
            source = node.module
        names = [f"{source}.{a.name}" for a in node.names]
    else:
        return
    for name in names:
        if name == prefix or name.startswith(prefix + "."):
            yield _known(name[len(prefix) + 1:], modules)


def _emulator_graph():
    """Returns: {emulator module: set of the emulator modules its imports run}."""
    graph = {}
    for path in EMULATOR_FILES:
        module = _emulator_module(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = set(_emulator_imports(tree, module, path.name == "__init__.py")) - {
            module}
    return graph


def _cycle(graph):
    """Returns: one import cycle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_every_emulator_module_has_a_layer():
    tops = {m.split(".")[0] if m else "__init__" for m in EMULATOR_MODULES}
    assert sorted(tops - set(EMULATOR_LAYERS)) == [], "declare their layer in EMULATOR_LAYERS"
    assert sorted(set(EMULATOR_LAYERS) - tops) == [], "stale entries in EMULATOR_LAYERS"


@pytest.mark.parametrize("path", EMULATOR_FILES, ids=lambda p: str(p.relative_to(EMULATOR)))
def test_emulator_imports_go_down(path):
    module = _emulator_module(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    for target in _emulator_imports(tree, module, path.name == "__init__.py"):
        assert _emulator_layer(target) <= _emulator_layer(module), (
            f"emulator/{path.relative_to(EMULATOR)} (layer {_emulator_layer(module)}) imports "
            f"{target or '__init__'} (layer {_emulator_layer(target)})")


def test_emulator_imports_form_no_cycle():
    """Not even within a layer: the modules can be read in one bottom-up order."""
    assert _cycle(_emulator_graph()) is None


def test_the_emulator_check_sees_a_violation():
    """A lazy relative import of a higher layer (here the op table, from ``errors``), a
    ``from . import x`` of a module and an import of a package's module are all seen, and a
    cycle is found."""
    tree = ast.parse("def f():\n    from .ops import shape\n    from . import session\n")
    found = set(_emulator_imports(tree, "errors", False))
    assert found == {"ops", "ops.shape", "session"}
    assert max(map(_emulator_layer, found)) > _emulator_layer("errors")
    tree = ast.parse("from .. import popxl\nimport popxl_flash.emulator.ir\n")
    assert set(_emulator_imports(tree, "ops.shape", False)) == {"popxl", "ir"}
    assert set(_emulator_imports(ast.parse("from popxl_flash.emulator import install\n"),
                                 "run", False)) == {""}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
