"""How many examples each property test draws, and with which seed.

CI loads the ``ci`` profile (conftest): a fixed seed, so a run is reproducible and a red run is
red every time. ``make soak`` loads ``soak``: random seeds and ``MINILLM_SOAK_FACTOR`` (default
10) times the examples, to find what the fixed seed does not reach.
"""
from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("soak", derandomize=False, deadline=None, print_blob=True)


def load_profile() -> str:
    """Load the profile named by ``MINILLM_HYPOTHESIS`` (default ``ci``); returns its name."""
    name = os.environ.get("MINILLM_HYPOTHESIS", "ci")
    settings.load_profile(name)
    return name


def examples(n: int) -> int:
    """``n`` examples in CI, ``n`` x the soak factor under the soak profile."""
    if os.environ.get("MINILLM_HYPOTHESIS") == "soak":
        return n * int(os.environ.get("MINILLM_SOAK_FACTOR", "10"))
    return n
