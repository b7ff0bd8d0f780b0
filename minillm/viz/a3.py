"""Figures of appendix C (inference runtimes). Each ``plot_*`` returns a Figure.

- :func:`plot_categories`: a decode step's time by kernel category
  (:meth:`minillm.runtime.DecodeProfile.by_category`).
- :func:`plot_runtime`: the runtime benchmark (``benchmarks/results/runtime.json``): batch-1
  decode tokens/s per config, and ms per step against the batch size where it was swept.
- :func:`plot_serving`: the serving benchmark (``serve.json``): :func:`minillm.viz.bench.
  plot_serve`'s TTFT, TPOT and throughput panels plus SLO attainment, for every server that
  ran (skipped ones named in the title).
- :func:`plot_serving_at`: every server at one request rate (the widget's static copy).
- :func:`plot_structured`: constrained decoding's costs (ms per step of the model and of each
  mask) and, token by token, how many tokens the grammar allowed at each step of one output.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from .bench import LEGEND_BELOW, MARKERS, log_ticks_between, plot_serve


def plot_categories(by_category: dict[str, float], title: str = "one decode step"):
    """Horizontal bars: ms per step in each category, with its share."""
    items = sorted(by_category.items(), key=lambda kv: kv[1])
    total = sum(v for _, v in items) or 1.0
    fig, ax = plt.subplots(figsize=(6.5, 0.45 * len(items) + 1.2))
    bars = ax.barh([k for k, _ in items], [v for _, v in items], color="C0")
    for bar, (_, v) in zip(bars, items):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {v:.2f} ms ({v / total:.0%})",
                va="center", fontsize=8)
    ax.set_xlabel("self time per step (ms)")
    ax.set_xlim(0, max(v for _, v in items) * 1.35 if items else 1)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def runtime_rows(report: dict) -> list[dict]:
    """The batch-1 rows of a runtime report (``bench runtime``), each with a ``name``: its
    config."""
    return [{**r, "name": r["config"]} for r in report["results"]]


def plot_runtime(report: dict):
    """Left: batch-1 decode tokens/s per config (llama.cpp grey, compiled orange, the engine
    green). Right: ms per decode step against the batch size per config (``batch_sweep``), or
    the ms per token of each config."""
    rows = runtime_rows(report)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    names = [r["name"] for r in rows]
    colours = ["grey" if "llama" in n else "C1" if "compile" in n or "graph" in n
               else "C2" if "engine" in n else "C0" for n in names]
    ax.barh(names, [r["decode_tok_s"] for r in rows], color=colours)
    for i, r in enumerate(rows):
        ax.text(r["decode_tok_s"], i, f" {r['decode_tok_s']:.1f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("batch-1 decode tokens / s")
    ax.set_title("decode speed per config", fontsize=10)
    sweep = report.get("batch_sweep") or []
    if sweep:
        for k, cfg in enumerate(dict.fromkeys(r["config"] for r in sweep)):
            pts = [r for r in sweep if r["config"] == cfg]
            ax2.plot([r["batch"] for r in pts], [r["step_ms"] for r in pts], marker="o",
                     color=f"C{k}", label=cfg)
        ax2.set_xlabel("batch size")
        ax2.set_ylabel("ms per decode step")
        ax2.legend(fontsize=7)
        ax2.set_title("decode step against batch size", fontsize=10)
    else:
        ax2.barh(names, [r["step_ms"] for r in rows], color=colours)
        ax2.invert_yaxis()
        ax2.set_xlabel("ms per token")
        ax2.set_title("time per decode step", fontsize=10)
    machine = report.get("device") or report.get("machine", {}).get("device", "")
    fig.suptitle(f"{report.get('model', '')} on {machine}", fontsize=10)
    fig.tight_layout()
    return fig


def ran_servers(report: dict) -> tuple[dict, dict[str, str]]:
    """(the report with only the servers that have runs, {skipped server: why}); a peer may be
    recorded as a string ("skipped: ..."), a dict with ``skipped`` or ``error``, or no runs."""
    ran, skipped = {}, {}
    for name, s in report.get("servers", {}).items():
        if isinstance(s, dict) and s.get("runs"):
            ran[name] = s
        else:
            skipped[name] = s if isinstance(s, str) else str(
                (s or {}).get("skipped") or (s or {}).get("error") or "no runs")
    for name, s in report.items():             # a peer left at the top level ("vllm": "...")
        if name not in ("servers", "machine", "workload", "slo", "rates", "model", "gguf",
                        "load_average") and isinstance(s, str) and s.startswith("skipped"):
            skipped.setdefault(name, s)
    return {**report, "servers": ran}, skipped


def plot_serving(report: dict):
    """``plot_serve``'s three panels (TTFT, TPOT p50/p99; output tokens/s) and a fourth: the
    fraction of requests meeting both SLOs, against the request rate, per server that ran."""
    ran, skipped = ran_servers(report)
    fig = plot_serve(ran)
    grid = fig.add_gridspec(1, 4)
    for i, ax in enumerate(fig.axes):
        ax.set_subplotspec(grid[0, i])
    ax = fig.add_subplot(grid[0, 3])
    for i, (name, s) in enumerate(ran["servers"].items()):
        ax.plot([r["rate"] for r in s["runs"]], [r["attainment"] for r in s["runs"]],
                marker=MARKERS[i % len(MARKERS)], color=f"C{i}", alpha=0.85, label=name)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("request rate (req/s)")
    ax.set_title("SLO attainment (both SLOs)")
    ax.grid(alpha=0.3)
    fig.set_size_inches(17, 4.1)
    if skipped:
        fig.suptitle(fig.get_suptitle() + " | not run: " +
                     "; ".join(f"{k} ({v})" for k, v in skipped.items()), fontsize=9)
    fig.tight_layout(rect=LEGEND_BELOW)
    return fig


def plot_serving_at(report: dict, rate: float):
    """Every server that ran, at the sweep rate closest to ``rate``: TTFT p50/p99, TPOT
    p50/p99 and SLO attainment side by side."""
    ran, _ = ran_servers(report)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    names = list(ran["servers"])
    for i, name in enumerate(names):
        runs = ran["servers"][name]["runs"]
        r = min(runs, key=lambda r: abs(r["rate"] - rate))
        for ax, what, scale in ((axes[0], "ttft", 1), (axes[1], "tpot", 1e3)):
            bars = ax.bar([i - 0.2, i + 0.2], [(r[f"{what}_p50"] or 0) * scale,
                                               (r[f"{what}_p99"] or 0) * scale],
                          width=0.38, color=f"C{i}", alpha=0.9, hatch=["", "//"],
                          edgecolor="white")
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        axes[2].bar_label(axes[2].bar(i, r["attainment"], color=f"C{i}"), fmt="%.2f",
                          fontsize=8)
    slo = report["slo"]
    for ax, title, limit in ((axes[0], "TTFT (s): p50, p99 hatched", slo["ttft_s"]),
                             (axes[1], "TPOT (ms): p50, p99 hatched", slo["tpot_s"] * 1e3),
                             (axes[2], "SLO attainment", None)):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title, fontsize=9)
        if limit is not None:
            ax.axhline(limit, color="grey", ls=":", lw=0.8, label="SLO")
            heights = [p.get_height() for p in ax.patches if p.get_height() > 0] + [limit]
            log_ticks_between(ax, min(heights), max(heights), "y")
            ax.legend(fontsize=8, loc="upper left")
    axes[2].set_ylim(0, 1.12)
    fig.suptitle(f"at {rate:g} req/s (nearest rate of the sweep per server)", fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["plot_categories", "plot_runtime", "plot_serving", "plot_serving_at", "ran_servers",
           "runtime_rows"]


def plot_structured(step_ms: dict[str, float], allowed: list[int], labels: list[str]):
    """Left: ms per step of each item of ``step_ms`` (log scale, the value printed on its bar).
    Right: ``allowed[i]``, how many tokens the grammar allowed before output token ``i``
    (``labels[i]``, its text); a step that allowed one token was forced."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6),
                                      gridspec_kw={"width_ratios": [1, 1.6]})
    names = list(step_ms)
    bars = left.barh(names, [step_ms[n] for n in names], color="C0")
    for bar, n in zip(bars, names):
        left.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                  f" {step_ms[n]:.3g} ms", va="center", fontsize=8)
    left.set_xscale("log")
    left.set_xlim(min(step_ms.values()) / 3, max(step_ms.values()) * 8)
    left.invert_yaxis()
    left.set_xlabel("ms per step (log scale)")
    left.set_title("what one decode step costs", fontsize=10)
    forced = [a == 1 for a in allowed]
    right.bar(range(len(allowed)), allowed, color=["C3" if f else "C0" for f in forced])
    right.set_yscale("log")
    right.set_xticks(range(len(labels)), [repr(t)[1:-1] for t in labels], rotation=90,
                     fontsize=7, family="monospace")
    right.set_ylabel("tokens the grammar allowed")
    right.set_title(f"one JSON output: {sum(forced)} of {len(allowed)} steps forced "
                    f"(red: one token allowed)", fontsize=10)
    fig.tight_layout()
    return fig
