"""Shared fixtures of the CPU kernel tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def use_build(monkeypatch):
    """``use_build(module, name, library)``: run the test on that build of ``module``'s C++ (a
    ``cpu_build.Library`` of its source with other flags, swapped in as ``module.LIBRARY``),
    skipped where it does not compile; returns ``name``."""
    def use(module, name: str, library):
        if library.get() is None:
            pytest.skip(f"{name} build failed: {library.reason()}")
        monkeypatch.setattr(module, "LIBRARY", library)
        return name
    return use
