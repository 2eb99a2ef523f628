"""popxl_flash: FlashAttention for Graphcore IPUs, written as PopXL graph code.

Public names only; see ``docs/`` for the user guide.
"""
from popxl_flash.backend import BACKEND, popxl

__all__ = ["BACKEND", "popxl"]
__version__ = "0.1.0"
