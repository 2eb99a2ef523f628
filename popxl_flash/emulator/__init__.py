"""A strict CPU emulator of the PopXL API subset (SDK 3.3/3.4).

The PopXL-shaped module is :mod:`popxl_flash.emulator.popxl` (``from popxl_flash.emulator
import popxl``; ``popxl_flash.popxl`` is that module when the SDK is absent). Whatever it
accepts, real PopXL accepts and computes the same; where PopXL raises, it raises. Unimplemented
PopXL names raise ``NotImplementedError``. Deliberate choices are listed in ``README.md`` here.

Emulator-only extras live here, never in the ``popxl`` module: ``Session.profile`` (a
:class:`RunProfile`), :func:`count_ops`, :class:`PopartError` (what PopART's
``popart_exception`` is raised as) and :func:`install` (make ``import popxl`` / ``import popart``
give the emulator, for third-party PopXL code such as popxl-addons).
"""
from . import popxl
from .errors import PopartError
from .installer import install
from .profile import RunProfile, count_ops

__all__ = ["PopartError", "RunProfile", "count_ops", "install", "popxl"]
