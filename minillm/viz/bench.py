"""Plots of the benchmark reports (``python -m minillm bench ...``): each returns a Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt


def plot_decode(report: dict):
    """Bar charts of prefill and decode tokens/s, grouped by dtype, one colour per engine."""

    rows = report["results"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    colours = {e: f"C{i}" for i, e in enumerate(engines)}
    width = 0.8 / max(len(engines), 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("prefill_tok_s", "decode_tok_s"),
                              (f"prefill ({report['prompt_len']}-token prompt)",
                               f"decode (batch 1, {report['new_tokens']} tokens)")):
        for j, dt in enumerate(dtypes):
            group = [r for r in rows if r["dtype"] == dt]  # bars centred on their dtype
            for k, r in enumerate(group):
                x = j + (k - (len(group) - 1) / 2) * width
                bars = ax.bar([x], [r[key]], width, color=colours[r["engine"]],
                              label=r["engine"])
                ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(dtypes)), dtypes)
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0].legend(unique.values(), unique.keys())
    fig.suptitle(f"{report['model']} on {report['device']} (torch threads={report['threads']})",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_throughput(report: dict):
    """Bar chart of output tokens/s per engine."""

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([f"{r['engine']}\n({r['dtype']})" for r in rows],
                  [r["output_tok_s"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{report['num_requests']} requests on {report['device']} "
                 f"({report['threads']} threads)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_spec(report: dict):
    """Speculative decoding: acceptance by draft position, speedup vs lookahead k (batch 1)
    and speedup vs batch size, one colour per method."""
    runs = [r for r in report["runs"] if r["method"] != "none"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    default = report["config"]["default_k"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, m in enumerate(methods):
        c = f"C{i}"
        mixed = [r for r in runs if r["method"] == m and r["kind"] == "mixed"]
        best = max((r for r in mixed if r["batch"] == 1 and r["k"] == default[m]),
                   key=lambda r: r["rounds"], default=None)
        if best and best["acceptance"]:
            acc = best["acceptance"]
            axes[0].plot(range(1, len(acc) + 1), acc, "o-", color=c, label=f"{m} (k={best['k']})")
        sweep = sorted((r for r in mixed if r["batch"] == 1), key=lambda r: r["k"])
        axes[1].plot([r["k"] for r in sweep], [r["speedup"] for r in sweep], "o-", color=c,
                     label=m)
        by_batch = sorted((r for r in mixed if r["k"] == default[m]), key=lambda r: r["batch"])
        axes[2].plot([r["batch"] for r in by_batch], [r["speedup"] for r in by_batch], "o-",
                     color=c, label=m)
    axes[0].set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02),
                title="acceptance by position (batch 1)")
    axes[1].set(xlabel="lookahead k (tree depth)", ylabel="speedup over no speculation",
                title="speedup vs k (batch 1)")
    axes[2].set(xlabel="batch size", ylabel="speedup over no speculation", xscale="log",
                title="speedup vs batch size")
    for ax in axes[1:]:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
