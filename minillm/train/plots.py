"""Figures for the post-training half of appendix A1 (each function returns a Figure)."""
from __future__ import annotations

import matplotlib.pyplot as plt


def plot_curves(panels: dict[str, dict[str, list[float]]], ncols: int = 3) -> plt.Figure:
    """One panel per title, one line per label: loss, accuracy, reward and KL per step."""
    n = len(panels)
    cols = min(ncols, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for label, ys in lines.items():
            ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=2.5, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if len(lines) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_lora_shapes(n: int, k: int, rank: int) -> plt.Figure:
    """W [N, K] next to its LoRA update B [N, r] @ A [r, K], drawn to scale."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    s = 2.6 / max(n, k)
    ax.add_patch(plt.Rectangle((0, 0), k * s, n * s, color="0.75"))
    ax.text(k * s / 2, n * s / 2, f"W (frozen)\n{n} x {k}\n{n * k:,} numbers", ha="center",
            va="center", fontsize=9)
    x0 = k * s + 0.6
    ax.add_patch(plt.Rectangle((x0, 0), max(rank * s, 0.04), n * s, color="C1"))
    ax.text(x0 + 0.1, n * s + 0.08, f"B {n} x {rank}", fontsize=8)
    x1 = x0 + max(rank * s, 0.04) + 0.3
    ax.add_patch(plt.Rectangle((x1, n * s - max(rank * s, 0.04)), k * s, max(rank * s, 0.04),
                               color="C0"))
    ax.text(x1, n * s + 0.08, f"A {rank} x {k}", fontsize=8)
    ax.text(x1 + k * s / 2, n * s / 2 - 0.2, f"trainable: r (N + K) = {rank * (n + k):,}\n"
            f"= {100 * rank * (n + k) / (n * k):.1f} % of W", ha="center", fontsize=9)
    ax.text(x0 - 0.33, n * s / 2, "+", fontsize=18, ha="center", va="center")
    ax.set_xlim(-0.1, x1 + k * s + 0.2)
    ax.set_ylim(-0.2, n * s + 0.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("LoRA: W x  +  (alpha / r) B A x", fontsize=10)
    return fig
