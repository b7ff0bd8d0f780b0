"""The engine tests' shared model: the tiny preset in float64 with sharpened q/k (engine_checks)."""
from __future__ import annotations

import pytest
from engine_checks import sharp_model


@pytest.fixture(scope="module")
def sharp():
    return sharp_model()
