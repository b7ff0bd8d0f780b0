"""Appendix A1 (training and quantization) plots: each ``plot_*`` function returns a Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def plot_quant_bench(report: dict) -> plt.Figure:
    """Perplexity ratio and decode speed-up of each format against the float reference."""
    rows = report["results"]
    names = [r["name"] for r in rows]
    ref = names[0]
    colours = ["0.5" if r["method"] == "none" else ("C1" if r["method"].startswith("q") else "C0")
               for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = np.arange(len(rows))
    for ax, key, title in ((axes[0], "ppl_ratio", f"perplexity / {ref}"),
                           (axes[1], "decode_speedup", f"decode tokens/s / {ref}")):
        bars = ax.bar(x, [r[key] for r in rows], color=colours)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(x, names, rotation=60, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(title)
    axes[0].axhline(1.03, color="C3", ls="--", lw=1, label="target: within 3 %")
    axes[0].set_ylim(0.9, max(1.1, max(r["ppl_ratio"] for r in rows) * 1.08))
    axes[0].legend(fontsize=8)
    for level, lab in ((1.5, "int8 target 1.5x"), (2.0, "int4 target 2x")):
        axes[1].axhline(level, color="C3", ls="--", lw=1)
        axes[1].text(len(rows) - 0.5, level, lab, ha="right", va="bottom", fontsize=7, color="C3")
    ax = axes[2]
    for r, c in zip(rows, colours):
        ax.scatter(r["bits_per_weight"], r["ppl"], color=c)
        ax.annotate(r["name"], (r["bits_per_weight"], r["ppl"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("stored bits per block weight")
    ax.set_ylabel("perplexity")
    ax.set_title("quality against size")
    fig.suptitle(f"{report['model']} on {report['device']} ({report['threads']} threads): "
                 f"{report['eval_tokens']} held-out tokens, batch-1 decode", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bit_layouts() -> plt.Figure:
    """The byte layout of one block of each GGUF format and of our int4 group, bit by bit.
    Fields too narrow to hold their label are named below the bar, with a pointer."""
    layouts = {
        "Q8_0 (32 weights, 34 B)": [("d fp16", 16, "C3"), ("32 x int8 q", 256, "C0")],
        "Q4_1 (32 weights, 20 B)": [("d fp16", 16, "C3"), ("m fp16", 16, "C2"),
                                    ("16 B: q[j] low | q[j+16] high nibble", 128, "C0")],
        "Q4_K (256 weights, 144 B)": [("d fp16", 16, "C3"), ("dmin fp16", 16, "C2"),
                                      ("8 x 6-bit scales + 8 x 6-bit mins (12 B)", 96, "C4"),
                                      ("128 B of nibbles", 1024, "C0")],
        "int4 g32 (ours: 32 weights)": [("16 B codes", 128, "C0"), ("scale", 16, "C3"),
                                         ("min", 16, "C2")],
        "int8 per channel (one row of K)": [("K x int8", 256, "C0"), ("scale", 32, "C3")],
    }
    fig, axes = plt.subplots(len(layouts), 1, figsize=(12, 1.25 * len(layouts) + 0.4))
    for ax, (title, parts) in zip(axes, layouts.items()):
        total = sum(bits for _, bits, _ in parts)
        start, below = 0, 0
        for label, bits, colour in parts:
            left, width = start / total, bits / total
            ax.barh(0, width, left=left, height=0.8, color=colour, alpha=0.6, edgecolor="k")
            text = f"{label}\n{bits} bits"
            if width * 12 * 0.9 > 0.075 * max(len(t) for t in text.split("\n")):
                ax.text(left + width / 2, 0, text, ha="center", va="center", fontsize=7)
            else:  # too narrow: name it below, side by side, with a pointer
                ax.annotate(f"{label}: {bits} bits", (left + width / 2, -0.4),
                            xytext=(0.02 + 0.2 * below, -1.05), fontsize=7, va="center",
                            arrowprops={"arrowstyle": "-", "lw": 0.6})
                below += 1
            start += bits
        ax.set_xlim(0, 1)
        ax.set_ylim(-1.3 if below else -0.5, 0.5)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_frame_on(False)
        ax.set_title(f"{title}: {total} bits", fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def plot_weight_histogram(w, deq: dict, bins: int = 120) -> plt.Figure:
    """One row of a weight and its dequantized versions: where the levels fall."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    axes[0].hist(np.asarray(w, dtype=np.float64).ravel(), bins=bins, color="0.6",
                 label="original")
    for i, (name, d) in enumerate(deq.items()):
        vals = np.unique(np.asarray(d, dtype=np.float64).ravel())
        axes[0].vlines(vals, 0, axes[0].get_ylim()[1] * (0.3 + 0.15 * i), color=f"C{i}",
                       lw=0.6, label=f"{name}: {len(vals)} levels")
        err = np.asarray(d, dtype=np.float64).ravel() - np.asarray(w, dtype=np.float64).ravel()
        axes[1].hist(err, bins=bins, histtype="step", color=f"C{i}", label=name)
    axes[0].set_title("weights of one group row and the values each format can store")
    axes[0].legend(fontsize=7)
    axes[1].set_title("rounding error (dequantized - original)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


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
    """W [N, K] next to its LoRA update B [N, r] @ A [r, K], drawn to scale (a rank too thin
    to see is drawn at a minimum width)."""
    s = 3.0 / max(n, k)
    wk, wn, wr = k * s, n * s, max(rank * s, 0.06)
    x0 = wk + 0.7  # B
    x1 = x0 + wr + 0.25  # A
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.add_patch(plt.Rectangle((0, 0), wk, wn, color="0.75"))
    ax.text(wk / 2, wn / 2, f"W (frozen)\n{n} x {k}\n{n * k:,} numbers", ha="center",
            va="center", fontsize=9)
    ax.text(wk + 0.35, wn / 2, "+", fontsize=18, ha="center", va="center")
    ax.add_patch(plt.Rectangle((x0, 0), wr, wn, color="C1"))
    ax.text(x0 + wr / 2, -0.12, f"B  {n} x {rank}\n(zeros at start)", ha="center", va="top",
            fontsize=8)
    ax.add_patch(plt.Rectangle((x1, wn - wr), wk, wr, color="C0"))
    ax.text(x1 + wk / 2, wn + 0.1, f"A  {rank} x {k}", ha="center", va="bottom", fontsize=8)
    ax.text(x1 + wk / 2, wn / 2 - 0.2, f"trainable: r (N + K)\n= {rank * (n + k):,}\n"
            f"= {100 * rank * (n + k) / (n * k):.1f} % of W", ha="center", va="center",
            fontsize=9)
    ax.set_xlim(-0.1, x1 + wk + 0.1)
    ax.set_ylim(-0.6, wn + 0.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("LoRA: W x  +  (alpha / r) B A x", fontsize=10)
    fig.tight_layout()
    return fig


def plot_group_error(table: dict, group_size: int, bits: int, floor: float = 1e-7
                     ) -> plt.Figure:
    """Relative output error of group-wise quantization of one layer, for every (bits, group
    size) in ``table`` = {"layer": name, "errors": {bits: {group_size: error}}}; the chosen
    (group_size, bits) is marked, on the error curves and on the size / error trade-off (each
    group also stores an fp16 scale and an fp16 min: bits + 32 / G bits per weight). Errors
    below ``floor`` (a grid that reproduces the weights) are drawn at the floor, hollow."""
    errors = table["errors"]
    groups = sorted(next(iter(errors.values())))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for i, (b, by_g) in enumerate(sorted(errors.items())):
        ys = [max(by_g[g], floor) for g in groups]
        exact = [by_g[g] < floor for g in groups]
        axes[0].plot(groups, ys, marker="o", color=f"C{i}", label=f"{b} bits")
        axes[1].scatter([b + 32 / g for g in groups], ys, color=f"C{i}", label=f"{b} bits")
        for ax, xs in ((axes[0], groups), (axes[1], [b + 32 / g for g in groups])):
            ax.scatter([x for x, e in zip(xs, exact) if e], [floor] * sum(exact), s=60,
                       color="white", edgecolors=f"C{i}", zorder=4)
    err = errors[bits][group_size]
    bpw = bits + 32 / group_size
    for ax, x in ((axes[0], group_size), (axes[1], bpw)):
        ax.scatter([x], [max(err, floor)], s=180, facecolors="none", edgecolors="k", lw=2,
                   zorder=5)
        ax.axhline(floor, color="0.6", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_ylim(floor / 5, None)
        ax.grid(alpha=0.3, which="major")
        ax.text(0.99, 0.01, f"hollow: error < {floor:.0e} (a grid the weights already sit on)",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="0.4")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(groups, [str(g) for g in groups])
    axes[0].set_xlabel("group size G (weights sharing one scale and min)")
    axes[0].set_ylabel("relative output error on calibration inputs")
    axes[0].set_title(f"{table['layer']}: error against group size", fontsize=10)
    axes[1].set_xlabel("stored bits per weight (codes + fp16 scale and min per group)")
    axes[1].set_title(f"chosen: {bits} bits, G={group_size}: {bpw:.2f} bits/weight, "
                      f"error {err:.2e}", fontsize=10)
    fig.tight_layout()
    return fig
