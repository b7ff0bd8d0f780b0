"""Chapter 09 (sharding the input) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..parallel.sequence import pairs, shard_positions


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


def plot_ring_step(world_size: int = 4, step: int = 1, layout: str = "contiguous",
                   seq_len: int = 64) -> plt.Figure:
    """Ring attention at one step: rows are ranks, columns the K/V blocks (block j started on
    rank j). The block each rank holds at ``step`` is dark, the ones it has already merged are
    light blue (grey when the mask left nothing in them to merge); each cell gives the causal
    (query, key) pairs of that rank's queries against that block, and "skip" marks blocks
    entirely in the future of the mask. A step past the last (P-1) shows the finished ring."""
    p = world_size
    s = min(step, p - 1)
    pos = shard_positions(seq_len, p, layout)
    fig, ax = plt.subplots(figsize=(0.8 * p + 2.2, 0.45 * p + 1.4))
    for r in range(p):
        for j in range(p):
            age = (r - j) % p  # the step at which rank r holds block j
            work = pairs(pos[r], pos[j], True)
            past = "#9ecae1" if work else "0.75"  # merged, or passed on unused (skipped)
            colour = "C0" if age == s else (past if age < s else "0.95")
            ax.add_patch(plt.Rectangle((j, r), 1, 1, color=colour, ec="white", lw=2))
            ax.text(j + 0.5, r + 0.5, f"{work}" if work else "skip", ha="center", va="center",
                    fontsize=7, color="white" if age == s else "k")
    ax.set_xlim(0, p)
    ax.set_ylim(p, 0)
    ax.set_xticks(np.arange(p) + 0.5, [f"K/V {j}" for j in range(p)], fontsize=7)
    ax.set_yticks(np.arange(p) + 0.5, [f"rank {r}" for r in range(p)], fontsize=7)
    done = " (the ring is done after P steps)" if step > p - 1 else ""
    ax.set_title(f"{layout}, T={seq_len}, P={p}: step {s}{done}\ndark: held now, blue: "
                 f"merged, grey: skipped, number: causal pairs", fontsize=8)
    fig.tight_layout()
    return fig
