"""Plots of chapter 06b (block drafting: DFlash, DDTree, DSpark). Each function returns a
matplotlib Figure; save it with :func:`minillm.viz.save`. Trees reuse chapter 06's layout
(:func:`minillm.viz.ch06.tree_layout`).
"""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.ticker import NullFormatter

from .ch06 import ACCEPTED, _short, tree_layout


def plot_drafter_cost(ks: Sequence[int], ms: dict[str, Sequence[float]],
                      title: str = "drafter time per round") -> plt.Figure:
    """Drafter milliseconds per verification round against the lookahead k, one line per
    drafter (a sequential drafter runs k passes, a block drafter one)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, vals in ms.items():
        ax.plot(list(ks)[:len(vals)], vals, "o-", label=name)
    ax.set(xlabel="drafted tokens per round (k)", ylabel="drafter ms per round", title=title,
           ylim=(0, None))
    ax.set_xticks(list(ks))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_block_mask(mask, n_context: int, block_size: int,
                    title: str = "the block drafter's attention mask") -> plt.Figure:
    """A dense pass's mask [R, R] (True: row i sees row j): ``n_context`` context rows, then
    blocks of ``block_size`` rows; lines separate the context from the blocks and the blocks
    from each other."""
    m = np.asarray(mask, dtype=float)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"mask must be square [R, R], got shape {m.shape}")
    r = m.shape[0]
    fig, ax = plt.subplots(figsize=(5.6, 5.2))
    ax.imshow(m, cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest")
    for edge in range(n_context, r, block_size):
        ax.axhline(edge - 0.5, color="tab:orange", lw=0.8)
        ax.axvline(edge - 0.5, color="tab:orange", lw=0.8)
    ax.set(xlabel=f"key row j (0-{n_context - 1}: context, then the blocks)",
           ylabel="query row i", title=title)
    fig.tight_layout()
    return fig


def plot_ddtree(labels: Sequence[str], parents: Sequence[int], probs: Sequence[float],
                accepted: Sequence[int] = (), root_label: str = "root",
                title: str = "DDTree: best-first tree under a node budget") -> plt.Figure:
    """A best-first tree: node i + 1 shows ``labels[i]`` (its token's text), sits under
    ``parents[i]`` and is coloured by its path probability ``probs[i]``; ``accepted``: the
    nodes (1-based) the target accepted, drawn on a green path."""
    if not len(labels) == len(parents) == len(probs):
        raise ValueError(f"labels, parents and probs must have one entry per node, got "
                         f"{len(labels)}, {len(parents)}, {len(probs)}")
    x, depth = tree_layout(parents)
    path = set(accepted)
    leaves = max(x) + 1
    cmap = plt.get_cmap("viridis")
    shown = np.asarray(probs, dtype=float)
    norm = LogNorm(vmin=max(float(shown.min()), 1e-4), vmax=max(float(shown.max()), 2e-4))
    fig, ax = plt.subplots(figsize=(min(24, max(6, 0.8 * leaves)), 1.6 + 1.2 * max(depth)))
    for i, p in enumerate(parents, start=1):
        on = i in path and (p == 0 or p in path)
        ax.plot([x[p], x[i]], [-depth[p], -depth[i]], lw=2.4 if on else 0.8,
                color=ACCEPTED if on else "grey", zorder=1)
    ax.scatter([x[0]], [0], s=160, color="black", zorder=2)
    ax.annotate(root_label, (x[0], 0), xytext=(0, 9), textcoords="offset points", ha="center",
                fontsize=8)
    sc = ax.scatter([x[i] for i in range(1, len(x))], [-depth[i] for i in range(1, len(x))],
                    c=np.clip(shown, norm.vmin, None), cmap=cmap, norm=norm, s=70,
                    edgecolors=[ACCEPTED if i in path else "none" for i in range(1, len(x))],
                    linewidths=2.0, zorder=2)
    for i in range(1, len(x)):
        ax.annotate(f"{_short(labels[i - 1], 9)}\n{probs[i - 1]:.2g}", (x[i], -depth[i]),
                    xytext=(0, -7), textcoords="offset points", ha="center", va="top",
                    fontsize=7, zorder=3,
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.85))
    fig.colorbar(sc, ax=ax, fraction=0.03, pad=0.01, label="path probability (drafter, log scale)")
    ax.set_yticks([-d for d in range(max(depth) + 1)],
                  ["root"] + [f"depth {d}" for d in range(1, max(depth) + 1)])
    ax.set_xticks([])
    ax.set_ylim(-max(depth) - 1.3, 0.6)
    ax.set_xlim(-0.7, leaves - 0.3)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_reliability(series: dict[str, Sequence[Sequence[float]]],
                     title: str = "DSpark's confidence against acceptance") -> plt.Figure:
    """Reliability diagram: per series, bins [(mean confidence, observed acceptance, count)]
    as points sized by count on the left (a calibrated score lies on the diagonal), the counts
    per confidence bin on the right."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.9), gridspec_kw=dict(width_ratios=[1.3, 1]))
    ax = axes[0]
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=0.8, label="calibrated")
    for name, bins in series.items():
        b = np.asarray(bins, dtype=float).reshape(-1, 3)
        if len(b):
            size = 20 + 200 * b[:, 2] / b[:, 2].max()
            line = ax.plot(b[:, 0], b[:, 1], "-", lw=1, label=name)[0]
            ax.scatter(b[:, 0], b[:, 1], s=size, color=line.get_color(), alpha=0.7)
    ax.set(xlabel="predicted confidence", ylabel="observed acceptance", xlim=(0, 1),
           ylim=(0, 1.02), title=title)
    ax.legend(fontsize=8)
    ax = axes[1]
    names = list(series)
    width = 0.08 / max(1, len(names))
    for i, name in enumerate(names):
        b = np.asarray(series[name], dtype=float).reshape(-1, 3)
        if len(b):
            ax.bar(b[:, 0] + (i - (len(names) - 1) / 2) * width, b[:, 2] / b[:, 2].sum(),
                   width, label=name)
    ax.set(xlabel="predicted confidence", ylabel="share of drafted tokens", xlim=(0, 1),
           title="where the confidences fall")
    fig.tight_layout()
    return fig


def plot_budget(batches: Sequence[int], verified: dict[str, Sequence[float]],
                speedup: dict[str, Sequence[float]] | None = None, budget: int | None = None,
                k: int | None = None,
                title: str = "draft tokens verified per sequence per step") -> plt.Figure:
    """Left: draft tokens verified per sequence per step against the batch size, per method,
    with a shared budget's share, budget / B (at most k, if given), dashed. Right (optional):
    speedup over the plain engine at each batch."""
    b = np.asarray(batches, dtype=float)
    fig, axes = plt.subplots(1, 2 if speedup else 1, figsize=(11 if speedup else 6, 3.7),
                             squeeze=False)
    ax = axes[0, 0]
    for name, vals in verified.items():
        ax.plot(b[:len(vals)], vals, "o-", label=name)
    if budget:
        share = budget / b if k is None else np.minimum(budget / b, k)
        ax.plot(b, share, "--", color="grey", label=f"budget {budget} / batch"
                + (f" (at most k = {k})" if k is not None else ""))
    ax.set(xlabel="batch size", ylabel="tokens per sequence per step", xscale="log",
           title=title, ylim=(0, None))
    ax.set_xticks(list(batches), [str(x) for x in batches])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=8)
    if speedup:
        ax = axes[0, 1]
        for name, vals in speedup.items():
            ax.plot(b[:len(vals)], vals, "o-", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(xlabel="batch size", ylabel="speedup over plain decoding", xscale="log",
               title="speedup against batch size")
        ax.set_xticks(list(batches), [str(x) for x in batches])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_early_exit(thresholds: Sequence[float], verified: Sequence[float],
                    accepted: Sequence[float], rate: Sequence[float] | None = None,
                    title: str = "DSpark's early exit") -> plt.Figure:
    """Per confidence threshold: draft tokens verified and accepted (per decode step) on the
    left and, optionally, output tokens per second on the right."""
    t = np.asarray(thresholds, dtype=float)
    fig, axes = plt.subplots(1, 2 if rate is not None else 1,
                             figsize=(10 if rate is not None else 5.5, 3.6), squeeze=False)
    ax = axes[0, 0]
    ax.plot(t, verified, "o-", label="verified")
    ax.plot(t, accepted, "o-", label="accepted")
    ax.set(xlabel="confidence threshold", ylabel="draft tokens per step", title=title,
           ylim=(0, None))
    ax.legend(fontsize=8)
    if rate is not None:
        ax = axes[0, 1]
        ax.plot(t, rate, "o-", color="tab:green")
        ax.set(xlabel="confidence threshold", ylabel="output tokens / s",
               title="throughput (batch 1)", ylim=(0, None))
    fig.tight_layout()
    return fig


def plot_methods(rows: dict[str, dict[str, float]], highlight: Sequence[str] = (),
                 title: str = "every method at batch 1") -> plt.Figure:
    """Per method: tokens per round, speedup over plain decoding and drafter ms per round
    (keys ``tokens_per_round``, ``speedup``, ``draft_ms``), three bar panels; the methods in
    ``highlight`` in another colour."""
    names = list(rows)
    v = np.arange(len(names))
    colors = ["tab:orange" if n in highlight else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, key, label in zip(axes, ("tokens_per_round", "speedup", "draft_ms"),
                              ("tokens per round", "speedup at batch 1",
                               "drafter ms per round")):
        ax.bar(v, [rows[n][key] for n in names], color=colors)
        if key == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(v, names, rotation=30, ha="right")
        ax.set(ylabel=label, title=label)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


__all__ = ["plot_block_mask", "plot_budget", "plot_ddtree", "plot_drafter_cost",
           "plot_early_exit", "plot_methods", "plot_reliability"]
