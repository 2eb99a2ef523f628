"""Stand-ins for PopXL names the emulator does not implement (using one raises
``NotImplementedError`` naming it; never a silent fallback), and the builder of PopXL-shaped
namespaces that hold exactly PopXL's names."""
import types


def stub(qualname):
    """Args: qualname: e.g. "popxl.ops.gelu". Returns: a function raising NotImplementedError."""
    def unsupported(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is not implemented by the PopXL emulator")
    unsupported.__name__ = qualname.rsplit(".", 1)[-1]
    unsupported.__qualname__ = qualname
    return unsupported


class _StubModule(types.ModuleType):
    """A PopXL submodule the emulator does not provide: any attribute raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"{self.__name__}.{name} is not implemented by the PopXL "
                                  "emulator")


def stub_module(qualname):
    """Args: qualname: e.g. "popxl.utils". Returns: a module whose every attribute raises
    NotImplementedError."""
    return _StubModule(qualname)


def surface(qualname, names, impl=None, children=None, doc=None):
    """A module holding exactly ``names``: ``children[name]`` if given, else ``impl``'s
    attribute of that name, else a stub.

    Args:
        qualname: the PopXL module name ("popxl.ops"). names: its public names.
        impl: the emulator module implementing some of them (or None).
        children: {name: object} overriding ``impl`` (sub-namespaces).
        doc: module docstring.
    Returns:
        types.ModuleType.
    """
    mod = types.ModuleType(qualname, doc)
    children = children or {}
    for name in names:
        obj = children.get(name, getattr(impl, name, None) if impl is not None else None)
        setattr(mod, name, stub(f"{qualname}.{name}") if obj is None else obj)
    return mod
