"""Shared test set-up: hypothesis profiles.

* ``ci`` (default; forced by ``CI=true``, ``1`` or ``yes``): fixed seed (derandomized), bounded
  examples, no deadline -- minutes, not hours.
* ``dev``: many more examples with random seeds, for local runs:
  ``HYPOTHESIS_PROFILE=dev python -m pytest``.
"""
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_in_ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
_profile = "ci" if _in_ci else os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(_profile)
