"""Stand-ins for PopXL names the emulator does not implement: calling one raises
``NotImplementedError`` naming it (never a silent fallback)."""
import types


def stub(qualname):
    """Args: qualname: e.g. "popxl.ops.gelu". Returns: a function raising NotImplementedError."""
    def unsupported(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is not implemented by the PopXL emulator")
    unsupported.__name__ = qualname.rsplit(".", 1)[-1]
    unsupported.__qualname__ = qualname
    return unsupported


def namespace(qualname, names):
    """Returns: a module whose listed attributes are stubs."""
    mod = types.ModuleType(qualname)
    for n in names:
        setattr(mod, n, stub(f"{qualname}.{n}"))
    return mod
