"""Stand-ins for the non-PopXL modules that Graphcore's PopXL code imports next to ``popxl``:
``popdist`` (multi-process runs), ``mpi4py.MPI`` and ``cppimport`` (compiling popxl-addons'
custom C++ ops). ``popxl_flash.emulator.install(standins=True)`` applies them.

* ``popdist``: one non-distributed instance (``isPopdistEnvSet() -> False``,
  ``getInstanceIndex() -> 0``, ``getNumInstances() -> 1``), used when the real module is
  missing or fails to import;
* ``mpi4py.MPI``: ``COMM_WORLD`` whose every method raises (only reached under popdist), used
  when ``import mpi4py.MPI`` fails (missing, or PyPI's mpi4py without an MPI library, which
  raises at that import);
* ``cppimport.import_hook``: always stood in while the emulator is ``popxl`` (the real hook
  would compile the ops against PopART's headers, which the emulator does not have). Like the
  real one, importing it installs a finder for modules that exist as ``<name>.cpp`` source
  whose first line names cppimport.
  For the popxl-addons ops the emulator models (:mod:`popxl_flash.emulator.addons_ops`), and
  the other packages' C++ sources it recognises (Dolly's and Llama's rotary embedding), the
  finder gives that model; for any other C++ source, a module whose every attribute raises
  ``NotImplementedError``, so the package imports and the op fails when it is built.
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

from . import addons_ops


def _popdist():
    mod = types.ModuleType("popdist", "Emulator stand-in: one non-distributed instance.")
    mod.isPopdistEnvSet = lambda: False
    mod.getInstanceIndex = lambda: 0
    mod.getNumInstances = lambda: 1
    mod.getReplicaIndexOffset = lambda: 0
    mod.getNumLocalReplicas = lambda: 1
    mod.getNumTotalReplicas = lambda: 1
    return {"popdist": mod}


class _NoMpi:
    def __getattr__(self, name):
        raise RuntimeError(f"mpi4py stand-in: MPI.COMM_WORLD.{name} needs a real MPI run")


def _mpi4py():
    mod = types.ModuleType("mpi4py", "Emulator stand-in without MPI.")
    mod.__path__ = []
    mod.MPI = types.ModuleType("mpi4py.MPI")
    mod.MPI.COMM_WORLD = _NoMpi()
    return {"mpi4py": mod, "mpi4py.MPI": mod.MPI}


class _CppBinding(types.ModuleType):
    """A C++ source the emulator does not model: every attribute raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"{self.__name__}.{name}: this custom C++ op is not modelled "
                                  "by the PopXL emulator (cppimport stand-in)")


class CppFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``<name>.cpp`` next to a package's modules, as cppimport's import hook does, and
    loads the emulator's model of it (or a raising module)."""

    def find_spec(self, fullname, path, target=None):
        leaf = fullname.rpartition(".")[2]
        for folder in path or []:
            source = os.path.join(folder, leaf + ".cpp")
            if _is_cppimport_source(source):
                return importlib.machinery.ModuleSpec(fullname, self, origin=source)
        return None

    def create_module(self, spec):
        model = addons_ops.binding(spec.name, spec.origin)
        return model if model is not None else _CppBinding(spec.name)

    def exec_module(self, module):
        pass


def _is_cppimport_source(path):
    """cppimport takes a ``.cpp`` file as a module only when its first line holds the word
    ``cppimport``."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        return "cppimport" in f.readline()


def _no_build(name):
    def build(*args, **kwargs):
        raise NotImplementedError(f"cppimport stand-in: {name} would compile C++ (not possible "
                                  "on the emulator)")
    build.__name__ = name.rpartition(".")[2]
    return build


def _cppimport():
    """cppimport's modules as code next to PopXL imports them: ``import_hook`` (installs the
    finder), ``find._check_first_line_contains_cppimport``, ``settings``, and the build
    functions of ``importer``/``checksum``/``imp`` raising NotImplementedError when called."""
    mod = types.ModuleType("cppimport", "Emulator stand-in: no C++ compilation.")
    mod.__path__ = []
    mod.settings = {"force_rebuild": False, "lock_timeout": 600, "release_mode": False}
    subs = {"import_hook": {}, "find": {"_check_first_line_contains_cppimport":
                                        _is_cppimport_source},
            "importer": {n: _no_build(f"cppimport.importer.{n}") for n in (
                "build_safely", "is_build_needed", "setup_module_data", "load_module")},
            "checksum": {n: _no_build(f"cppimport.checksum.{n}") for n in (
                "_calc_cur_checksum", "is_checksum_valid")}}
    mod.imp = _no_build("cppimport.imp")
    made = {"cppimport": mod}
    for name, attrs in subs.items():
        sub = types.ModuleType(f"cppimport.{name}")
        for key, value in attrs.items():
            setattr(sub, key, value)
        setattr(mod, name, sub)
        made[f"cppimport.{name}"] = sub
    if not any(isinstance(f, CppFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CppFinder())
    return made


def _loads(name):
    """Whether ``import name`` works (a module that is present but raises at import, such as
    mpi4py.MPI without an MPI library, does not)."""
    if name in sys.modules and sys.modules[name] is not None:
        return True
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure to load means: stand in
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        return False
    return True


def install_standins():
    """Put the stand-ins into ``sys.modules``: popdist and mpi4py where the real module does
    not load, cppimport always (see the module docstring).

    Returns:
        The module names stood in for (sorted).
    """
    made = {}
    if not _loads("popdist"):
        made.update(_popdist())
    if not _loads("mpi4py.MPI"):
        made.update(_mpi4py())
    made.update(_cppimport())
    sys.modules.update(made)
    return sorted(made)
