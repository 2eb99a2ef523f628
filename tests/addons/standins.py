"""Stand-ins for the non-PopXL modules popxl-addons imports at top level (test fixture only).

popxl-addons 3.4 imports ``mpi4py.MPI`` and ``popdist`` (multi-process runs) and
``cppimport.import_hook`` (compiling its custom C++ ops) when its package is imported. None of
them is on this machine's PyPI-free test path, and none is PopXL, so the popxl-addons tests give
minimal stand-ins, only when the real module is missing:

* ``popdist``: a single, non-distributed instance (``isPopdistEnvSet() -> False``,
  ``getInstanceIndex() -> 0``, ``getNumInstances() -> 1``);
* ``mpi4py.MPI``: ``COMM_WORLD`` whose every method raises (only reached under popdist);
* ``cppimport.import_hook``: like the real one, importing it installs a finder for modules
  that exist as ``<name>.cpp`` source; instead of compiling, the finder gives a module whose
  every attribute raises ``NotImplementedError`` (custom C++ ops are out of the emulator's
  scope), so popxl-addons imports and a custom op fails when it is built.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types


def _popdist():
    mod = types.ModuleType("popdist", "Test stand-in: one non-distributed instance.")
    mod.isPopdistEnvSet = lambda: False
    mod.getInstanceIndex = lambda: 0
    mod.getNumInstances = lambda: 1
    mod.getReplicaIndexOffset = lambda: 0
    mod.getNumLocalReplicas = lambda: 1
    return mod


class _NoMpi:
    def __getattr__(self, name):
        raise RuntimeError(f"mpi4py stand-in: MPI.COMM_WORLD.{name} needs a real MPI run")


def _mpi4py():
    mod = types.ModuleType("mpi4py", "Test stand-in without MPI.")
    mod.MPI = types.ModuleType("mpi4py.MPI")
    mod.MPI.COMM_WORLD = _NoMpi()
    return {"mpi4py": mod, "mpi4py.MPI": mod.MPI}


class _CppBinding(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"{self.__name__}.{name}: custom C++ ops are not compiled "
                                  "in the emulator test fixture (cppimport stand-in)")


class _CppFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``<name>.cpp`` next to a package's modules, as cppimport's import hook does."""

    def find_spec(self, fullname, path, target=None):
        leaf = fullname.rpartition(".")[2]
        for folder in path or []:
            if os.path.isfile(os.path.join(folder, leaf + ".cpp")):
                return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _CppBinding(spec.name)

    def exec_module(self, module):
        pass


def _cppimport():
    mod = types.ModuleType("cppimport", "Test stand-in: no C++ compilation.")
    mod.__path__ = []
    mod.import_hook = types.ModuleType("cppimport.import_hook")
    if not any(isinstance(f, _CppFinder) for f in sys.meta_path):
        sys.meta_path.append(_CppFinder())
    return {"cppimport": mod, "cppimport.import_hook": mod.import_hook}


def install_standins():
    """Put the stand-ins into ``sys.modules`` for each module that is not importable.

    Returns:
        The names stood in for.
    """
    made = {}
    if importlib.util.find_spec("popdist") is None:
        made["popdist"] = _popdist()
    if importlib.util.find_spec("mpi4py") is None:
        made.update(_mpi4py())
    if importlib.util.find_spec("cppimport") is None:
        made.update(_cppimport())
    for name, mod in made.items():
        sys.modules.setdefault(name, mod)
    return sorted(made)
