"""Plots: one module per chapter (``ch01`` ... ``a2``, plus ``bench`` for the benchmark reports
and ``widgets``, the interactive views of the notebooks).

Every ``plot_*`` function takes plain data (numbers, dicts, lists) and returns a matplotlib
Figure without saving or showing it; :func:`save` writes one. Figures go into ``figures/`` at the
repository root (PNG, modest dpi, so notebooks stay small)::

    from minillm import viz
    from minillm.viz import ch04 as plots
    viz.save(plots.plot_batch_timeline(runs), "ch04_static_vs_continuous")
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from ..device import fast_mode

FIGURES = Path(__file__).resolve().parents[2] / "figures"


def save(fig: plt.Figure, name: str | Path, dpi: int = 90) -> Path:
    """Write ``fig`` as PNG and return the path. A bare ``name`` goes to figures/<name>.png, a
    path (with a folder or a .png suffix) goes where it says (folders created).

    With MINILLM_FAST=1 (CI's small sizes) bare names go to a temporary folder instead, so a
    test run never overwrites the committed full-size figures.
    """
    path = Path(name)
    if path.suffix != ".png" and path.parent == Path("."):
        folder = Path(tempfile.gettempdir()) / "minillm-figures" if fast_mode() else FIGURES
        path = folder / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path
