"""Chapter 05 (I/O-aware kernels) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def plot_hbm_traffic(ns, series: dict, flops=None, title: str = "") -> plt.Figure:
    """HBM bytes of attention against sequence length N, log-log.

    series: {label: bytes per N}; flops: optional FLOPs per N, drawn on a second panel with
    the arithmetic intensity (FLOPs per byte) of each series.
    """
    fig, axes = plt.subplots(1, 2 if flops is not None else 1, figsize=(10 if flops else 5.5, 3.4),
                             squeeze=False)
    ax = axes[0, 0]
    for i, (label, values) in enumerate(series.items()):
        ax.loglog(ns, values, "o-", ms=3, color=f"C{i}", label=label)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("bytes moved to/from HBM")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    if flops is not None:
        ax2 = axes[0, 1]
        for i, (label, values) in enumerate(series.items()):
            ax2.loglog(ns, [f / b for f, b in zip(flops, values)], "o-", ms=3, color=f"C{i}",
                       label=label)
        ax2.set_xlabel("sequence length N")
        ax2.set_ylabel("FLOPs per HBM byte")
        ax2.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_online_softmax(scores, values, tile: int, states: list, step: int) -> plt.Figure:
    """One query's online softmax after ``step`` K/V tiles (1-based).

    scores [L], values [L, d]; states[i] is a dict with m, l and out (the running output
    acc / l) after tile i. Left: the scores, tiles seen so far in colour, the running max.
    Middle: m and l tile by tile. Right: the running output against the exact one.
    """

    s = np.asarray(scores, dtype=float)
    v = np.asarray(values, dtype=float)
    w = np.exp(s - s.max())
    exact = (w / w.sum()) @ v
    st = states[step - 1]
    fig, axes = plt.subplots(1, 3, figsize=(11, 2.9))
    seen = np.arange(len(s)) < step * tile
    axes[0].bar(np.arange(len(s)), s, color=np.where(seen, "C0", "lightgray"))
    for j in range(0, len(s) + 1, tile):
        axes[0].axvline(j - 0.5, color="k", lw=0.4, alpha=0.4)
    axes[0].axhline(st["m"], color="C3", ls="--", lw=1, label=f"running max m = {st['m']:.2f}")
    axes[0].set_xlabel("key position")
    axes[0].set_ylabel("score q.k / sqrt(d)")
    axes[0].legend(fontsize=7, loc="lower right")
    steps = np.arange(1, len(states) + 1)
    axes[1].plot(steps, [x["m"] for x in states], "o-", color="C3", ms=3, label="m (max)")
    axes[1].plot(steps, [x["l"] for x in states], "s-", color="C2", ms=3,
                 label="l (denominator)")
    axes[1].axvline(step, color="k", lw=0.8, ls=":")
    axes[1].set_xlabel("K/V tiles seen")
    axes[1].legend(fontsize=7)
    idx = np.arange(len(exact))
    axes[2].bar(idx - 0.2, exact, width=0.4, color="lightgray", label="exact softmax(s) v")
    axes[2].bar(idx + 0.2, np.asarray(st["out"], dtype=float), width=0.4, color="C0",
                label=f"acc / l after {step} tile(s)")
    axes[2].set_xlabel("output dimension")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_block_table(block_tables, seq_lens, block_size: int, num_blocks: int) -> plt.Figure:
    """A paged KV cache: each sequence's logical blocks (left) and where they live in the pool
    of physical blocks (right), coloured by sequence, with the filled slots shaded."""
    from matplotlib.patches import Rectangle

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.2 + 0.35 * len(seq_lens)),
                                      gridspec_kw={"width_ratios": [1, 1.4]})
    owner = {}
    for s, (row, n) in enumerate(zip(block_tables, seq_lens)):
        n_blocks = -(-int(n) // block_size)
        for i in range(n_blocks):
            fill = min(block_size, int(n) - i * block_size) / block_size
            y = len(seq_lens) - 1 - s
            left.add_patch(Rectangle((i, y + 0.1), 0.9, 0.8, fc=f"C{s}", alpha=0.25))
            left.add_patch(Rectangle((i, y + 0.1), 0.9 * fill, 0.8, fc=f"C{s}", alpha=0.8))
            left.text(i + 0.45, y + 0.5, f"-> {int(row[i])}", ha="center", va="center",
                      fontsize=7)
            owner[int(row[i])] = (s, i, fill)
    width = max(-(-int(n) // block_size) for n in seq_lens)
    left.set_xlim(-0.1, width)
    left.set_ylim(0, len(seq_lens))
    left.set_yticks([len(seq_lens) - 0.5 - s for s in range(len(seq_lens))],
                    [f"seq {s} ({int(n)} tok)" for s, n in enumerate(seq_lens)], fontsize=8)
    left.set_xticks([i + 0.45 for i in range(width)], range(width), fontsize=7)
    left.set_xlabel("logical block i (tokens i*block_size ...)")
    left.set_title("block table: logical block -> physical block", fontsize=9)
    cols = min(num_blocks, 8)
    for b in range(num_blocks):
        x, y = b % cols, -(b // cols)
        s, i, fill = owner.get(b, (None, None, 0))
        color = "lightgray" if s is None else f"C{s}"
        right.add_patch(Rectangle((x, y), 0.9, 0.8, fc=color, alpha=0.25))
        right.add_patch(Rectangle((x, y), 0.9 * fill, 0.8, fc=color, alpha=0.8))
        label = f"#{b}" if s is None else f"#{b}\ns{s}:{i}"
        right.text(x + 0.45, y + 0.4, label, ha="center", va="center", fontsize=7)
    rows = -(-num_blocks // cols)
    right.set_xlim(-0.1, cols)
    right.set_ylim(-rows + 0.9, 0.9)
    right.set_axis_off()
    right.set_title(f"physical pool: {num_blocks} blocks of {block_size} slots "
                    "(#id, seq:logical)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_bpt_memory(ts, peaks: dict, measured: dict | None = None, unit: int = 2**20,
                    unit_name: str = "MiB", title: str = "") -> plt.Figure:
    """Peak activation memory of one layer against sequence length: counted (lines, from
    :func:`minillm.course.ch05_io_model.layer_peak_bytes`) and the largest tensor measured
    (markers)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, (label, values) in enumerate(peaks.items()):
        ax.loglog(ts, [v / unit for v in values], "-", color=f"C{i}", label=f"{label} (counted)")
    for i, (label, (xs, values)) in enumerate((measured or {}).items()):
        ax.loglog(xs, [v / unit for v in values], "x", ms=7, color=f"C{i}",
                  label=f"{label}: largest tensor (measured)")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(f"activation memory ({unit_name})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or "one decoder layer: plain vs blockwise (BPT)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_kernel_roofline(points: dict, bandwidth: float, peak_flops: float | None = None,
                         peak_label: str = "compute peak", title: str = "") -> plt.Figure:
    """Roofline: attainable FLOP/s = min(peak, bandwidth x intensity), log-log.

    points: {label: (FLOPs per byte, achieved FLOP/s or None)}; None draws only a vertical
    marker at that intensity. bandwidth in bytes/s (the sloped roof), peak_flops in FLOP/s.
    """

    xs = [p[0] for p in points.values()]
    lo, hi = min(xs + [1.0]) / 2, max(xs + [1e3]) * 2
    grid = np.logspace(np.log10(lo), np.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(6.2, 3.8))
    roof = bandwidth * grid
    ax.loglog(grid, roof / 1e12 if peak_flops is None else np.minimum(roof, peak_flops) / 1e12,
              "k-", lw=1.2, label=f"roof: {bandwidth / 1e9:.0f} GB/s" +
              ("" if peak_flops is None else f", {peak_label}"))
    for i, (label, (x, y)) in enumerate(points.items()):
        if y is None:
            ax.axvline(x, color=f"C{i}", ls=":", lw=1.2, label=f"{label} (intensity only)")
        else:
            ax.loglog([x], [y / 1e12], "o", ms=7, color=f"C{i}", label=label)
    ax.set_xlabel("arithmetic intensity (FLOPs per HBM byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_kernel_benchmarks(flash_rows: list, decode_rows: list, split_rows: list,
                           copy_gbps: float, title: str = "") -> plt.Figure:
    """Three panels from ``benchmarks/kernels_bench.py`` results: FlashAttention vs SDPA
    TFLOP/s by N; paged decode GB/s by batch and context against the copy bandwidth; split-KV
    off vs on at batch 1."""

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    ax = axes[0]
    for i, (d, causal) in enumerate(sorted({(r["d"], r["causal"]) for r in flash_rows})):
        rows = sorted((r for r in flash_rows if r["d"] == d and r["causal"] == causal),
                      key=lambda r: r["N"])
        ns = [r["N"] for r in rows]
        tag = f"d={d}{', causal' if causal else ''}"
        ax.semilogx(ns, [r["triton_tflops"] for r in rows], "o-", color=f"C{i}", ms=3,
                    label=f"ours, {tag}", base=2)
        ax.semilogx(ns, [r["sdpa_tflops"] for r in rows], "x--", color=f"C{i}", ms=4,
                    label=f"SDPA, {tag}", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s (forward)")
    ax.set_title("FlashAttention: ours (Triton) vs SDPA", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    contexts = sorted({r["context"] for r in decode_rows})
    batches = sorted({r["batch"] for r in decode_rows})
    x = np.arange(len(contexts))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        gbps = [next(r["GBps"] for r in decode_rows if r["batch"] == b and r["context"] == c)
                for c in contexts]
        ax.bar(x + (i - (len(batches) - 1) / 2) * width, gbps, width, color=f"C{i}",
               label=f"batch {b}")
    ax.axhline(copy_gbps, color="k", ls="--", lw=1, label=f"copy {copy_gbps:.0f} GB/s")
    ax.set_xticks(x, [f"{c // 1024}k" for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GB/s (K/V + q + out)")
    ax.set_title("paged decode bandwidth", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    contexts = sorted({r["context"] for r in split_rows})
    x = np.arange(len(contexts))
    for i, mode in enumerate(("off", "on")):
        rows = [next(r for r in split_rows if r["mode"] == mode and r["context"] == c)
                for c in contexts]
        bars = ax.bar(x + (i - 0.5) * 0.4, [r["us_graph"] or r["us_eager"] for r in rows], 0.4,
                      color=f"C{i}", label=f"split-KV {mode}")
        ax.bar_label(bars, labels=[str(r["num_splits"]) for r in rows], fontsize=7)
    ax.set_xticks(x, [f"{c // 1024}k" for c in contexts])
    ax.set_xlabel("context (tokens), batch 1; bar labels: splits")
    ax.set_ylabel("microseconds per decode call")
    ax.set_title("split-KV (flash-decoding) at batch 1", fontsize=9)
    ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_attention_time(flash_rows: list, causal: bool = True, title: str = "") -> plt.Figure:
    """Milliseconds per FlashAttention forward against N (log-log), ours vs SDPA, one line per
    head dimension, from ``benchmarks/kernels_bench.py`` rows (CUDA-graph times when present)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, d in enumerate(sorted({r["d"] for r in flash_rows})):
        rows = sorted((r for r in flash_rows if r["d"] == d and r["causal"] == causal),
                      key=lambda r: r["N"])
        ns = [r["N"] for r in rows]
        for name, style in (("triton", "o-"), ("sdpa", "x--")):
            ms = [r[f"{name}_ms_graph"] or r[f"{name}_ms_eager"] for r in rows]
            ax.loglog(ns, ms, style, color=f"C{i}", ms=4, base=2,
                      label=f"{'ours' if name == 'triton' else 'SDPA'}, d={d}")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("ms per forward")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_attention_bytes(n: int = 4096, block_rows: int = 64, d: int = 64, heads: int = 9,
                         dtype_bytes: int = 2) -> plt.Figure:
    """HBM bytes of one attention layer, naive against FlashAttention, at sequence length ``n``
    and a FlashAttention tile of ``block_rows`` query rows (the counts of
    :mod:`minillm.course.ch05_io_model`).

    Left: the bytes of each transfer at this N (stacked bars). Right: total bytes against N for
    both, with this N marked.
    """
    from ..course import ch05_io_model as io

    naive = io.naive_attention_io(n, d, heads=heads, dtype_bytes=dtype_bytes)
    flash = io.flash_attention_io(n, d, heads=heads, dtype_bytes=dtype_bytes,
                                  block_rows=block_rows)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(dict.fromkeys([*naive, *flash]))
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    for x, parts in ((0, naive), (1, flash)):
        bottom = 0.0
        for name, b in parts.items():
            ax.bar(x, b / 1e6, bottom=bottom, color=colors[name], width=0.6,
                   label=name if x == 0 or name not in naive else None)
            bottom += b / 1e6
        ax.text(x, bottom, f"{bottom:,.0f} MB", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0, 1], ["naive (3 kernels)", f"flash, {block_rows}-row tiles"])
    ax.set_ylabel("MB moved to/from HBM")
    ax.set_title(f"N = {n}: flash moves {sum(naive.values()) / sum(flash.values()):.1f}x less",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ns = [2**k for k in range(8, 18)]
    ax2.loglog(ns, [io.naive_attention_bytes(x, d, heads=heads, dtype_bytes=dtype_bytes)
                    for x in ns], "o-", ms=3, label="naive")
    ax2.loglog(ns, [io.flash_attention_bytes(x, d, heads=heads, dtype_bytes=dtype_bytes,
                                             block_rows=block_rows) for x in ns], "o-", ms=3,
               label=f"flash, {block_rows}-row tiles")
    ax2.axvline(n, color="k", lw=0.8, ls="--")
    ax2.set_xlabel("sequence length N")
    ax2.set_ylabel("bytes")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(f"one attention layer, {heads} heads, d={d}, {dtype_bytes}-byte values",
                 fontsize=10)
    fig.tight_layout()
    return fig
