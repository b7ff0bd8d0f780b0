"""Chapter 03 (sharding a model) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..parallel.pipeline import bubble_formula, simulate_pipeline


def plot_tp_cost(degrees: list[int], panels: dict, measured: dict | None = None) -> plt.Figure:
    """What one rank holds and sends against the tensor-parallel degree P.

    panels {y label: [value per degree]} gives one panel each (lines over ``degrees``);
    measured {y label: (P, value)} marks what a real run logged in that panel."""
    measured = measured or {}
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3), squeeze=False)
    for i, (ax, (label, values)) in enumerate(zip(axes[0], panels.items())):
        ax.plot(degrees, values, "o-", color=f"C{i}", label="from the shapes")
        if label in measured:
            p, value = measured[label]
            ax.plot([p], [value], "k*", ms=11, label=f"measured at P={p}")
        ax.set_xticks(degrees)
        ax.set_xlabel("tensor-parallel degree P")
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(0, max(values) * 1.15)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_gpipe(p: int = 2, m: int = 4) -> plt.Figure:
    """The GPipe forward schedule of p equal stages and m micro-batches (one time unit each):
    the Gantt chart, with the bubble (p-1)/(m+p-1) in the title."""
    timelines = simulate_pipeline([[1.0] * m for _ in range(p)])
    title = (f"p={p} stages, m={m} micro-batches: {m + p - 1} steps, bubble "
             f"(p-1)/(m+p-1) = {bubble_formula(p, m):.2f}")
    fig = plot_pipeline_gantt({title: timelines}, unit="s")
    fig.axes[0].set_xlabel("time (steps of one micro-batch on one stage)")
    fig.axes[0].set_xlim(0, 23)
    return fig


def plot_pipeline_gantt(schedules: dict, unit: str = "ms") -> plt.Figure:
    """One panel per run {title: aligned timelines [stage][(micro, start_s, end_s)]}: a bar per
    micro-batch on each stage's row, coloured by micro-batch."""
    height = sum(0.35 * len(t) + 0.6 for t in schedules.values())
    fig, axes = plt.subplots(len(schedules), 1, figsize=(8, height), squeeze=False)
    scale = 1e3 if unit == "ms" else 1.0
    for ax, (title, timelines) in zip(axes[:, 0], schedules.items()):
        for s, tl in enumerate(timelines):
            for m, start, end in tl:
                ax.barh(s, (end - start) * scale, left=start * scale, color=f"C{m % 10}",
                        edgecolor="k", lw=0.4)
                ax.text((start + end) / 2 * scale, s, str(m), ha="center", va="center",
                        fontsize=7)
        ax.set_yticks(range(len(timelines)), [f"stage {s}" for s in range(len(timelines))])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    fig.tight_layout()
    return fig


def plot_bubble(n_micro: list[int], measured: dict, formula: dict) -> plt.Figure:
    """Bubble fraction against micro-batches: measured {label: [..]} as points, the formula
    {label: [..]} as lines."""
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for i, (name, values) in enumerate(formula.items()):
        ax.plot(n_micro, values, "-", color=f"C{i}", label=f"{name}: (p-1)/(m+p-1)")
    for i, (name, values) in enumerate(measured.items()):
        ax.plot(n_micro[:len(values)], values, "o", color=f"C{i}", label=f"{name}: measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble: idle fraction")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_makespan(n_micro: list[int], runs: dict) -> plt.Figure:
    """Seconds for the whole batch against micro-batches m, one line per run {label: [s]}."""
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for i, (name, values) in enumerate(runs.items()):
        ax.plot(n_micro[:len(values)], values, "o-", color=f"C{i}", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(n_micro, [str(m) for m in n_micro])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("makespan: time for the batch (s)")
    ax.set_ylim(0, None)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_comm_per_layer(bars: dict, unit: float = 2**20, unit_name: str = "MiB") -> plt.Figure:
    """Bytes each rank sends per transformer layer, one bar per scheme {scheme: bytes}."""
    fig, ax = plt.subplots(figsize=(6.5, 0.45 * len(bars) + 1))
    names, values = list(bars), [v / unit for v in bars.values()]
    ax.barh(names, values, color=[f"C{i}" for i in range(len(names))])
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.3)
    ax.set_xlabel(f"sent per rank per layer ({unit_name})")
    fig.tight_layout()
    return fig


def plot_expert_stall(runs: dict, expert_load: dict) -> plt.Figure:
    """Left: token slots per expert {run: [E]}. Right: per rank, seconds computing and seconds
    waiting for the slowest rank {run: [(compute_s, wait_s) per rank]}."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    width = 0.8 / len(expert_load)
    for i, (name, load) in enumerate(expert_load.items()):
        load = np.asarray(load, dtype=float)
        left.bar(np.arange(len(load)) + i * width, load, width, color=f"C{i}", label=name)
    left.set_xlabel("expert")
    left.set_ylabel("token slots")
    left.legend(fontsize=7)
    labels, compute, wait = [], [], []
    for name, ranks in runs.items():
        for r, (c, w) in enumerate(ranks):
            labels.append(f"{name}\nrank {r}")
            compute.append(1e3 * c)
            wait.append(1e3 * w)
    y = np.arange(len(labels))
    right.barh(y, compute, color="C2", label="computing its experts")
    right.barh(y, wait, left=compute, color="C3", alpha=0.6, label="waiting in the return")
    right.set_yticks(y, labels, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("ms")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


