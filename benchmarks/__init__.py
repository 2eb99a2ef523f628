"""Micro-benchmarks of popxl_flash: ``python -m benchmarks.attention --help``."""
