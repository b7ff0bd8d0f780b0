"""Plots of chapter 07 (prefill/decode scheduling and disaggregation). Each function returns a
matplotlib Figure; save it with :func:`minillm.viz.save`."""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from .bench import log_ticks_between

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
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False,
              title="a step ran")
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
    """Left: the CDF of ``itl`` (inter-token latency of the running decodes, s; log scale), one
    line per policy. Right: each new prompt's ``ttft`` (s) as a dot, one row per policy (a
    handful of prompts: their values, not a distribution)."""
    fig, (itl, ttft) = plt.subplots(1, 2, figsize=(10, 3.4))
    for row, (label, d) in enumerate(per_policy.items()):
        _cdf(itl, d.get("itl", []), label)
        ttft.plot(np.asarray(d.get("ttft", []), dtype=float) * 1e3,
                  np.full(len(d.get("ttft", [])), row), "o", color=f"C{row}", alpha=0.8)
    itl.set(xlabel="inter-token latency (ms)", ylabel="fraction of gaps")
    gaps = [1e3 * v for d in per_policy.values() for v in d.get("itl", [])]
    if gaps:
        log_ticks_between(itl, min(gaps), max(gaps))
    itl.legend(fontsize=8)
    ttft.set_yticks(range(len(per_policy)), list(per_policy))
    ttft.invert_yaxis()
    ttft.set_xlim(left=0)
    ttft.set_xlabel("time to first token of each long prompt (ms)")
    for ax in (itl, ttft):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_request_timelines(runs: dict[str, Sequence[dict]],
                           title: str = "each request from arrival to its first decode"
                           ) -> plt.Figure:
    """One panel per run (e.g. layerwise, whole); one row per request (``rid``), in seconds
    from its ``arrival``: the prefill up to ``kv_ready`` (queueing included), the KV transfer
    ``start``..``end`` drawn thinner over it, and ``first_decode`` (the decode worker's first
    token) as a dot, labelled with its delay after ``kv_ready`` (what disaggregation adds)."""
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(8, 0.9 + sum(0.35 * len(r) + 0.5 for r in runs.values())))
    for ax, (name, rows) in zip(axes[:, 0], runs.items()):
        for i, r in enumerate(rows):
            t0 = r["arrival"]
            ax.barh(i, r["kv_ready"] - t0, color=PREFILL, height=0.6,
                    label="prefill (queue + compute)" if i == 0 else None)
            ax.barh(i, max(r["end"] - r["start"], 1e-4), left=r["start"] - t0, height=0.25,
                    color="tab:green", label="KV transfer" if i == 0 else None)
            ax.plot(r["first_decode"] - t0, i, "o", color=DECODE,
                    label="first decode token" if i == 0 else None)
            ax.annotate(f"+{(r['first_decode'] - r['kv_ready']) * 1e3:.0f} ms",
                        (r["first_decode"] - t0, i), xytext=(6, -3),
                        textcoords="offset points", fontsize=8)
        ax.set_yticks(range(len(rows)), [r["rid"] for r in rows])
        ax.invert_yaxis()
        ax.set_ylabel(name)
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=3,
                      frameon=False)
    axes[-1, 0].set_xlabel("seconds since the request arrived "
                           "(+ms: first decode token after the prompt's KV was ready)")
    fig.suptitle(title)
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
