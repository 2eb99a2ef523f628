"""Test stand-in for ``torchvision`` (not installed here; MNIST cannot be downloaded without a
network): ``datasets.MNIST`` gives a synthetic, learnable MNIST-shaped data set, and
``transforms`` the three transforms Graphcore's PopXL tutorials use. Only the tutorial tests of
``tests/graphcore`` put it on ``sys.path``; accuracies they report are on this data set."""
from . import datasets, transforms  # noqa: F401
