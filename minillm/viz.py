"""Plots for the chapters. Each function returns a matplotlib Figure; :func:`save` writes it.

Figures go into ``figures/`` at the repository root (PNG, modest dpi, so notebooks stay small).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

FIGURES = Path(__file__).resolve().parent.parent / "figures"


def save(fig: plt.Figure, name: str, dpi: int = 90) -> Path:
    """Write ``fig`` to figures/<name>.png and return the path."""
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


# --- chapter 01: transformers ---


# --- chapter 02: KV cache ---
