"""Chapter 03 (sharding a model) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch


def plot_tp_split(cfg, world_size: int) -> plt.Figure:
    """Which rank owns which part of each matrix of one layer under tensor parallelism.

    Each bar is one matrix's split axis (query heads, KV heads, ffn_dim, vocabulary), scaled to
    the same length; colours are ranks. Hatched parts are KV heads replicated on several ranks.
    """
    p = world_size
    even = [(r / p, 1 / p, r, False) for r in range(p)]
    if cfg.n_kv_heads % p == 0:
        kv = even
    else:  # each KV head copied to `rep` ranks: draw the copies side by side inside the head
        rep = p // cfg.n_kv_heads
        kv = [((r // rep) / cfg.n_kv_heads + (r % rep) / (cfg.n_kv_heads * rep),
               1 / (cfg.n_kv_heads * rep), r, True) for r in range(p)]
    rows = [(f"wq: {cfg.n_heads} q heads (columns)", even),
            (f"wk, wv: {cfg.n_kv_heads} KV heads (columns)", kv),
            (f"wo: {cfg.n_heads} q heads (rows)", even),
            (f"w_gate, w_up: ffn {cfg.ffn_dim} (columns)", even),
            (f"w_down: ffn {cfg.ffn_dim} (rows)", even),
            (f"embedding, head: vocab {cfg.vocab_size}", even)]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for y, (_, segments) in enumerate(rows):
        for left, width, r, hatched in segments:
            ax.barh(y, width, left=left, color=f"C{r}", edgecolor="white",
                    hatch="//" if hatched else None)
    if cfg.n_kv_heads % p:  # head boundaries of the replicated KV heads
        for h in range(1, cfg.n_kv_heads):
            ax.plot([h / cfg.n_kv_heads] * 2, [0.6, 1.4], color="k", lw=1.5)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xticks([])
    ax.set_title(f"{cfg.name}: one layer over {p} tensor-parallel ranks", fontsize=9)
    ax.legend(handles=[Patch(color=f"C{r}", label=f"rank {r}") for r in range(p)], fontsize=7,
              ncol=p, loc="upper center", bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout()
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


