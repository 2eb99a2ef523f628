"""A strict CPU emulator of the PopXL API subset (SDK 3.3/3.4).

The PopXL-shaped module is :mod:`popxl_flash.emulator.popxl` (``from popxl_flash.emulator
import popxl``; ``popxl_flash.popxl`` is that module when the SDK is absent). Whatever it
accepts, real PopXL accepts and computes the same; where PopXL raises, it raises. Unimplemented
PopXL names raise ``NotImplementedError``. Deliberate choices are listed in ``README.md`` here.

Emulator-only extras live here, never in the ``popxl`` module: ``Session.profile`` (a
:class:`RunProfile`), :func:`count_ops`, :class:`PopartError` (what PopART's
``popart_exception`` is raised as), :func:`install` (make ``import popxl`` / ``import popart``
give the emulator, for third-party PopXL code such as popxl-addons) and :func:`set_strict`
(the one switch between raising on behaviour PopXL leaves unspecified, the default, and
taking a stated choice: ``unspecified.py``).

The modules import one way, bottom-up through the layers ``README.md`` lists (held by
``tests/test_architecture.py``): this package's ``__init__`` and ``popxl`` are the top, and
importing them imports the layers whose imports fill the tables below (the op table, the
gradient rules, the pre-alias patterns: ``addons_ops`` registers popxl-addons' op models).
"""
from . import popxl
from . import addons_ops  # noqa: F401 - registers popxl-addons' op models into the tables
from .errors import PopartError
from .installer import install
from .profile import RunProfile, count_ops
from .unspecified import UnspecifiedBehaviourWarning, is_strict, set_strict

__all__ = ["PopartError", "RunProfile", "UnspecifiedBehaviourWarning", "count_ops", "install",
           "is_strict", "popxl", "set_strict"]
