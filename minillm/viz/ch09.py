"""Chapter 09 (sharding the input) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def plot_rank_work(work: dict) -> plt.Figure:
    """Per-rank causal attention work {split: [work per rank]} as grouped bars."""
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / len(work)
    for i, (name, values) in enumerate(work.items()):
        ax.bar(np.arange(len(values)) + i * width, values, width, color=f"C{i}", label=name)
    n = len(next(iter(work.values())))
    ax.set_xticks(np.arange(n) + 0.4 - width / 2, [f"rank {r}" for r in range(n)])
    ax.set_ylabel("(query, key) pairs computed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_traffic(worlds: list[int], measured: dict, formula: dict,
                 unit: float = 2**20, unit_name: str = "MiB") -> plt.Figure:
    """Bytes each rank sends for one attention layer against world size: measured {scheme:
    [..]} as points, formulas {scheme: [..]} as lines."""
    fig, ax = plt.subplots(figsize=(5.8, 3.4))
    for i, (name, values) in enumerate(formula.items()):
        ax.plot(worlds[:len(values)], np.asarray(values) / unit, "-", color=f"C{i}",
                label=f"{name} (formula)")
    for i, (name, values) in enumerate(measured.items()):
        ax.plot(worlds[:len(values)], np.asarray(values) / unit, "o", color=f"C{i}",
                label=f"{name} (measured)")
    ax.set_xlabel("ranks P")
    ax.set_ylabel(f"sent per rank ({unit_name})")
    ax.set_xticks(worlds)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_schedule_grid(grids: dict) -> plt.Figure:
    """Ring schedules {title: [step][rank] -> label or None}: which block each rank computes at
    each step (empty cells are idle)."""
    fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 3), squeeze=False)
    for ax, (title, grid) in zip(axes[0], grids.items()):
        steps, ranks = len(grid), len(grid[0])
        for t, row in enumerate(grid):
            for r, label in enumerate(row):
                busy = label is not None
                ax.add_patch(plt.Rectangle((t, r), 1, 1, color="C0" if busy else "0.92",
                                           ec="white"))
                if busy:
                    ax.text(t + 0.5, r + 0.5, label, ha="center", va="center", fontsize=6,
                            color="white")
        ax.set_xlim(0, steps)
        ax.set_ylim(ranks, 0)
        ax.set_xticks(np.arange(steps) + 0.5, range(steps))
        ax.set_yticks(np.arange(ranks) + 0.5, [f"rank {r}" for r in range(ranks)])
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
