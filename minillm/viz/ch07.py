"""Plots of chapter 07 (prefill/decode scheduling and disaggregation). Each function returns a
matplotlib Figure; save it with :func:`minillm.viz.save`."""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

PREFILL, DECODE, MIXED = "tab:orange", "tab:blue", "tab:purple"


def plot_step_timeline(timelines: dict[str, Sequence[dict]],
                       title: str = "engine steps per policy") -> plt.Figure:
    """One row per policy; each step a bar from ``start`` to ``end`` (s), coloured by what it
    ran: prompt tokens only, decodes only, or both (``prefill``/``decode`` token counts)."""
    fig, ax = plt.subplots(figsize=(8, 0.7 + 0.6 * len(timelines)))
    for row, steps in enumerate(timelines.values()):
        for s in steps:
            c = MIXED if s["prefill"] and s["decode"] else PREFILL if s["prefill"] else DECODE
            ax.barh(row, s["end"] - s["start"], left=s["start"], color=c, height=0.6,
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(timelines)), list(timelines))
    ax.invert_yaxis()
    for c, name in ((PREFILL, "prompt only"), (DECODE, "decode only"), (MIXED, "mixed")):
        ax.barh(0, 0, color=c, label=name)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _cdf(ax, values, label):
    v = np.sort(np.asarray(values, dtype=float))
    if len(v):
        ax.step(v * 1e3, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def plot_latency_dists(per_policy: dict[str, dict[str, Sequence[float]]],
                       title: str = "latency per policy") -> plt.Figure:
    """CDFs of ``itl`` (inter-token latency of the running decodes) and ``ttft`` (of the new
    prompts), seconds, one line per policy."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for label, d in per_policy.items():
        _cdf(axes[0], d.get("itl", []), label)
        _cdf(axes[1], d.get("ttft", []), label)
    for ax, name in zip(axes, ("inter-token latency (ms)", "time to first token (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_transfers(rows: Sequence[dict], title: str = "KV transfer per request") -> plt.Figure:
    """Per request (``rid``): prefill up to ``kv_ready``, the transfer ``start``..``end``
    (s, one clock), and the part after ``kv_ready`` (exposed) hatched."""
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.45 * len(rows)))
    t0 = min(r["start"] for r in rows) if rows else 0.0
    for i, r in enumerate(rows):
        ready, s, e = r["kv_ready"] - t0, r["start"] - t0, r["end"] - t0
        ax.barh(i, max(e - s, 1e-5), left=s, color="tab:green", height=0.5,
                label="transfer" if i == 0 else None)
        if e > ready:
            ax.barh(i, e - max(ready, s), left=max(ready, s), color="none", hatch="///",
                    edgecolor="black", height=0.5, label="exposed" if i == 0 else None)
        ax.plot([ready, ready], [i - 0.35, i + 0.35], color=PREFILL, lw=2,
                label="prefill done (KV ready)" if i == 0 else None)
    ax.set_yticks(range(len(rows)), [r["rid"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the first transfer")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_cost_fit(costs, title: str = "measured step costs and the fit") -> plt.Figure:
    """A :class:`minillm.course.placement.CostModel`'s points and fitted curves: prefill time
    against prompt tokens, decode time against batch (one line per context length)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    if costs.prefill_points:
        n, t = zip(*costs.prefill_points)
        xs = np.linspace(min(n), max(n), 50)
        axes[0].plot(n, np.array(t) * 1e3, "o", label="measured")
        axes[0].plot(xs, [costs.prefill_time(int(x)) * 1e3 for x in xs], "-", label="fit")
    axes[0].set_xlabel("prompt tokens")
    axes[0].set_ylabel("ms per prefill step")
    ctxs = sorted({c for _, c, _ in costs.decode_points})
    for c in ctxs:
        pts = sorted((b, t) for b, cc, t in costs.decode_points if cc == c)
        b, t = zip(*pts)
        line, = axes[1].plot(b, np.array(t) * 1e3, "o", label=f"ctx {c}")
        axes[1].plot(b, [costs.decode_time(x, x * c) * 1e3 for x in b], "-",
                     color=line.get_color())
    axes[1].set_xlabel("decode batch")
    axes[1].set_ylabel("ms per decode step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_goodput(curves: dict[str, tuple[Sequence[float], Sequence[float]]],
                 attainment: float = 0.9, per_device: dict[str, int] | None = None,
                 title: str = "SLO attainment against request rate") -> plt.Figure:
    """One line per placement: (rates in requests/s, attainment); with ``per_device``
    (label -> devices) the rate axis is per device. The target attainment is dashed."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for label, (rates, att) in curves.items():
        k = (per_device or {}).get(label, 1)
        ax.plot(np.asarray(rates) / k, att, "o-", ms=3, label=label)
    ax.axhline(attainment, ls="--", color="gray", lw=1)
    ax.set_xlabel("requests/s" + (" per device" if per_device else ""))
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig
