"""Plots of engine runs (chapter 04). Each function returns a matplotlib Figure; save it with
:func:`minillm.viz.save`. Inputs are :class:`~minillm.course.ch04_workload.RecordedRun` s and
:class:`~minillm.course.ch04_workload.MemorySnapshot` s recorded by
:func:`~minillm.course.ch04_workload.record_run`.

Time axes are the *engine clock*: the steps' measured durations laid end to end (idle gaps
between arrivals skipped), the clock :func:`~minillm.course.ch04_workload.record_run` reports
latencies on.
"""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

if TYPE_CHECKING:  # plots take the recorded data; they never run the workload
    from ..course.ch04_workload import LoadPoint, MemorySnapshot, RecordedRun

PREFILL, DECODE = "tab:orange", "tab:blue"


def _color(rid: str) -> str:
    return f"C{int(rid) % 10}" if rid.isdigit() else "gray"


def step_times(run: RecordedRun) -> tuple[np.ndarray, np.ndarray]:
    """Start and duration of each step on the engine clock."""
    dur = np.array([r.end - r.start for r in run.trace])
    return np.concatenate([[0.0], np.cumsum(dur)[:-1]]), dur


def plot_batch_timeline(runs: dict[str, RecordedRun], slots: int | None = None) -> plt.Figure:
    """Gantt chart per run: a row per request, a bar per step it took part in (orange: its
    prompt was computed in that step, blue: one decode token); grey: waiting since arrival.
    The bottom strip counts the requests in each step (``slots``: the batch limit)."""
    n_req = max(len(r.records) for r in runs.values())
    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(11, 1.2 + len(runs) * (0.22 * n_req + 1.4)),
                             sharex=True, gridspec_kw={"height_ratios": [n_req, 5] * len(runs)})
    for k, (name, run) in enumerate(runs.items()):
        ax, strip = axes[2 * k], axes[2 * k + 1]
        start, dur = step_times(run)
        first = {}
        for s, (rec, plan) in enumerate(zip(run.trace, run.recorder.plans)):
            for rid in rec.request_ids:
                y = int(rid)
                first.setdefault(rid, start[s])
                color = PREFILL if plan.new_tokens.get(rid, 1) > 1 else DECODE
                ax.add_patch(Rectangle((start[s], y - 0.38), dur[s], 0.76, fc=color, lw=0))
        for r in run.records:
            y = int(r.request_id)
            ax.plot([r.arrival, first.get(r.request_id, r.arrival)], [y, y], color="0.6", lw=1.5)
        ax.set_ylim(n_req - 0.5, -0.5)
        ax.set_ylabel("request")
        ax.set_title(f"{name}: {run.output_tokens} tokens in {run.makespan:.1f} s "
                     f"({run.throughput:.1f} tok/s), mean latency {run.mean('e2e'):.1f} s",
                     fontsize=9, loc="left")
        strip.step(start + dur, [len(r.request_ids) for r in run.trace], where="pre",
                   color="k", lw=1)
        if slots:
            strip.axhline(slots, color="r", lw=0.8, ls=":")
        strip.set_ylabel("batch", fontsize=8)
        strip.set_ylim(0, (slots or n_req) + 1)
    axes[-1].set_xlabel("engine clock (s)")
    axes[0].set_xlim(0, max(r.makespan for r in runs.values()))
    handles = [Rectangle((0, 0), 1, 1, fc=c) for c in (PREFILL, DECODE, "0.6")]
    axes[0].legend(handles, ["prefill", "decode", "waiting"], loc="lower right", fontsize=8,
                   ncol=3, bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_padding(plans, title: str = "") -> plt.Figure:
    """Per step: tokens in the flat batch vs slots of a padded [requests x longest] batch."""
    flat = [sum(p.new_tokens.values()) for p in plans]
    padded = [len(p.new_tokens) * max(p.new_tokens.values()) for p in plans]
    x = np.arange(len(plans))
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.bar(x, padded, color="0.8", label="padded batch (requests x longest)")
    ax.bar(x, flat, color=DECODE, label="flat batch (selective batching)")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("engine step")
    ax.set_ylabel("token rows")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_kv_usage(runs: dict[str, RecordedRun]) -> plt.Figure:
    """Per run, the KV pool over the engine clock: slots allocated vs slots holding K/V; and
    the requests running per step."""
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4 * (len(runs) + 1), 3))
    for ax, (name, run) in zip(axes, runs.items()):
        start, dur = step_times(run)
        t = start + dur
        alloc = [r.blocks_used * run.block_size for r in run.trace]
        used = [r.slots_used for r in run.trace]
        ax.fill_between(t, alloc, step="pre", color="tab:red", alpha=0.3,
                        label="allocated, empty")
        ax.fill_between(t, used, step="pre", color="tab:green", alpha=0.8, label="holding K/V")
        ax.axhline(run.num_blocks * run.block_size, color="k", lw=0.8, ls=":")
        ax.set_title(f"{name}\n{100 * run.kv_waste:.0f}% of allocated slots empty", fontsize=9)
        ax.set_xlabel("engine clock (s)")
        ax.set_ylabel("KV token slots")
        ax.legend(fontsize=7, loc="lower right")
    bars = axes[-1].bar([textwrap.fill(n, 18) for n in runs],
                        [r.mean_running for r in runs.values()],
                        color=[f"C{i}" for i in range(len(runs))])
    axes[-1].bar_label(bars, fmt="%.1f")
    axes[-1].set_title("requests per step (mean)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_memory_map(snap: MemorySnapshot, cols: int = 16, ax=None, title: str | None = None):
    """The physical blocks after one step: colour = owning request, the shaded part = slots
    holding K/V, ``xN`` = reference count of a block shared by N sequences (hatched)."""
    rows = -(-snap.num_blocks // cols)
    if ax is None:
        fig, ax = plt.subplots(figsize=(0.62 * cols, 0.55 * rows + 0.6))
    else:
        fig = ax.figure
    for b in range(snap.num_blocks):
        x, y = b % cols, -(b // cols)
        owners = snap.owners[b]
        color = _color(owners[0]) if owners else "white"
        shared = snap.ref[b] > 1
        ax.add_patch(Rectangle((x, y), 0.92, 0.85, fc=color, alpha=0.25, ec="0.5", lw=0.5,
                               hatch="///" if shared else None))
        ax.add_patch(Rectangle((x, y), 0.92 * snap.fill[b] / snap.block_size, 0.85, fc=color,
                               alpha=0.85, lw=0))
        if owners:
            label = f"r{owners[0]}" + (f"\nx{snap.ref[b]}" if shared else "")
            ax.text(x + 0.46, y + 0.42, label, ha="center", va="center", fontsize=6.5)
    ax.set_xlim(-0.1, cols)
    ax.set_ylim(-rows + 0.9, 0.95)
    ax.set_axis_off()
    ax.set_title(title or f"after step {snap.step}: {snap.blocks_used}/{snap.num_blocks} blocks "
                 f"in use, {sum(snap.fill)} of {snap.blocks_used * snap.block_size} slots filled",
                 fontsize=9)
    return fig


def plot_memory_timeline(snaps: list[MemorySnapshot], title: str = "") -> plt.Figure:
    """Which request owns each physical block (rows) after each step (columns); black dots:
    blocks shared by several sequences."""
    nb = snaps[0].num_blocks
    grid = np.full((nb, len(snaps)), -1)
    shared = []
    for j, s in enumerate(snaps):
        for b in range(nb):
            if s.owners[b]:
                o = s.owners[b][0]
                grid[b, j] = int(o) % 10 if o.isdigit() else 10
                if s.ref[b] > 1:
                    shared.append((j, b))
    cmap = ListedColormap(["white"] + [f"C{i}" for i in range(10)] + ["gray"])
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.045 * nb))
    ax.imshow(grid + 1, aspect="auto", cmap=cmap, vmin=0, vmax=11, interpolation="nearest")
    if shared:
        xs, ys = zip(*shared)
        ax.scatter(xs, ys, s=3, c="k", marker=".")
    ax.set_xlabel("engine step")
    ax.set_ylabel("physical block")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def _by_factor(points: list[LoadPoint], value) -> tuple[np.ndarray, ...]:
    """Per target factor: mean and spread (std over seeds) of the offered rate and of
    ``value(point)``."""
    factors = sorted({p.factor for p in points})
    groups = [[p for p in points if p.factor == f] for f in factors]
    x = [np.array([p.offered for p in g]) for g in groups]
    y = [np.array([value(p) for p in g]) for g in groups]
    return (np.array([v.mean() for v in x]), np.array([v.std() for v in x]),
            np.array([v.mean() for v in y]), np.array([v.std() for v in y]))


def plot_load_sweep(points: list[LoadPoint], saturated: float | None = None,
                    latency: str = "e2e", quantile: float = 0.5) -> plt.Figure:
    """Throughput and a latency quantile against the offered load (requests/s measured from
    the arrivals): each seed a faint dot, the mean over seeds with its standard deviation.
    ``latency``: "e2e" or "ttft"; ``saturated``: output tok/s with every request at once."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, value, label in ((a, lambda p: p.throughput, "output tokens / s"),
                             (b, lambda p: p.quantile(latency, quantile), "seconds")):
        ax.plot([p.offered for p in points], [value(p) for p in points], ".", color="C0",
                alpha=0.35, label="one seed")
        x, dx, y, dy = _by_factor(points, value)
        ax.errorbar(x, y, xerr=dx, yerr=dy, fmt="o-", color="C0", capsize=3,
                    label="mean over seeds, +- std")
        ax.set_xlabel("offered load (requests / s, measured)")
        ax.set_ylabel(label)
    if saturated is not None:
        a.axhline(saturated, color="gray", ls="--", label="all requests at once")
    name = {"e2e": "latency (arrival to last token)", "ttft": "time to first token"}[latency]
    a.set_title("throughput", fontsize=9)
    b.set_title(f"p{round(100 * quantile)} {name}", fontsize=9)
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_preemption(rows: list[dict]) -> plt.Figure:
    """Swap vs recompute by block size. rows: dicts with block_size, mode ("swap" or
    "recompute"), moved_tokens (swapped out + in, in token slots), recomputed (tokens),
    extra_seconds (copy time or recompute time) and seconds (the run)."""
    sizes = sorted({r["block_size"] for r in rows})
    x = np.arange(len(sizes))
    get = {(r["mode"], r["block_size"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    panels = (("tokens of KV moved or recomputed", lambda r: r["moved_tokens"] or r["recomputed"]),
              ("seconds spent on it", lambda r: r["extra_seconds"]),
              ("whole run (s)", lambda r: r["seconds"]))
    for ax, (title, f) in zip(axes, panels):
        for k, mode in enumerate(("swap", "recompute")):
            vals = [f(get[(mode, s)]) if (mode, s) in get else 0 for s in sizes]
            ax.bar(x + (k - 0.5) * 0.38, vals, 0.38, label=mode, color=f"C{k + 2}")
        ax.set_xticks(x, [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_sharing(cases: dict[str, tuple[int, int]]) -> plt.Figure:
    """Peak KV blocks per case: (with sharing, without sharing)."""
    names = list(cases)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6, 3))
    b1 = ax.bar(x - 0.2, [cases[n][1] for n in names], 0.4, color="0.7", label="no sharing")
    b2 = ax.bar(x + 0.2, [cases[n][0] for n in names], 0.4, color="tab:green",
                label="shared blocks (refcounts)")
    ax.bar_label(b1)
    ax.bar_label(b2)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("KV blocks at the peak")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["plot_batch_timeline", "plot_kv_usage", "plot_load_sweep", "plot_memory_map",
           "plot_memory_timeline", "plot_padding", "plot_preemption", "plot_sharing",
           "step_times"]
