"""``popxl.transforms`` for the emulator: ``autodiff`` and its result types.

``decompose_sum``, ``merge_exchange`` and ``io_tile_exchange`` exist but raise
``NotImplementedError``.
"""
from ..unsupported import stub
from .autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo, autodiff

decompose_sum = stub("popxl.transforms.decompose_sum")
merge_exchange = stub("popxl.transforms.merge_exchange")
io_tile_exchange = stub("popxl.transforms.io_tile_exchange")

__all__ = ["ExpectedConnectionType", "ExpectedConnection", "GradGraphInfo", "autodiff",
           "merge_exchange", "io_tile_exchange", "decompose_sum"]
