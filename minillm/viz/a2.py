"""Appendix A2 (GPU hardware) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def _flops_unit(peak: float) -> tuple[float, str]:
    """(scale, name) to show FLOP/s in TFLOP/s on a GPU and GFLOP/s on a CPU."""
    return (1e12, "TFLOP/s") if peak >= 1e12 else (1e9, "GFLOP/s")


def plot_roofline(bandwidth: float, peak_flops: float, points=(), name: str = "",
                  ceilings: dict | None = None, bandwidths: dict | None = None,
                  other_roofs: dict | None = None, title: str = "",
                  annotate: bool = False) -> plt.Figure:
    """Roofline (log-log): attainable FLOP/s = min(bandwidth x intensity, peak) and kernels on it.

    bandwidth (bytes/s) and peak_flops (FLOP/s) draw the main roof, labelled ``name``;
    points: :class:`minillm.course.a2_roofline.KernelPoint` (one marker per ``group``);
    ceilings: {label: FLOP/s} lower compute roofs (e.g. fp32 without tensor cores);
    bandwidths: {label: bytes/s} other memory roofs (e.g. a measured copy);
    other_roofs: {label: (bytes/s, FLOP/s)} other machines, drawn faintly.
    """

    points = list(points)
    scale, unit = _flops_unit(peak_flops)
    intensities = [p.intensity for p in points] + [peak_flops / bandwidth]
    lo = min(0.05, min(intensities) / 3)
    hi = max(2e4, max(intensities) * 3)
    x = np.logspace(np.log10(lo), np.log10(hi), 300)
    fig, ax = plt.subplots(figsize=(9.6, 4.6))
    for i, (label, (bw, pk)) in enumerate((other_roofs or {}).items()):
        ax.loglog(x, np.minimum(bw * x, pk) / scale, color="0.6", lw=0.9, ls=(0, (1, 1 + i)),
                  label=label)
    ridge = peak_flops / bandwidth
    ax.loglog(x, np.minimum(bandwidth * x, peak_flops) / scale, color="k", lw=2,
              label=f"{name} roof (ridge {ridge:.0f} FLOP/B)" if ridge >= 10
              else f"{name} roof (ridge {ridge:.1f} FLOP/B)")
    for i, (label, bw) in enumerate((bandwidths or {}).items()):
        ax.loglog(x, np.minimum(bw * x, peak_flops) / scale, color=f"C{7 + i}", ls="--", lw=1.2,
                  label=label)
    for i, (label, pk) in enumerate((ceilings or {}).items()):
        ax.loglog(x, np.minimum(bandwidth * x, pk) / scale, color=f"C{5 + i}", ls="-.", lw=1.2,
                  label=label)
    groups = list(dict.fromkeys(p.group for p in points))
    markers = "os^vDP*Xh<>"
    for g_i, group in enumerate(groups):
        mine = [p for p in points if p.group == group]
        ax.loglog([p.intensity for p in mine], [p.rate / scale for p in mine],
                  markers[g_i % len(markers)], color=f"C{g_i}", ms=6, alpha=0.85,
                  label=group or None, ls="none")
        if annotate:
            for p in mine:
                ax.annotate(p.name, (p.intensity, p.rate / scale), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel(f"attainable / achieved {unit}")
    ax.set_title(title or f"roofline: {name}", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_occupancy(register_curves: dict, smem_curves: dict | None = None,
                   marks: dict | None = None) -> plt.Figure:
    """Occupancy (active warps / max warps per SM) against a kernel's resource use.

    register_curves: {label: (registers per thread, occupancy)}; smem_curves: {label: (shared
    memory KB per block, occupancy)}; marks: {label: (registers, occupancy)} single kernels to
    place on the left panel.
    """
    ncols = 2 if smem_curves else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.0 * ncols, 3.5), squeeze=False)
    left = axes[0, 0]
    for label, (regs, occ) in register_curves.items():
        left.step(regs, occ, where="post", label=label)
    for i, (label, (r, o)) in enumerate((marks or {}).items()):
        left.plot([r], [o], "*", ms=11, color=f"C{6 + i}", label=label)
    left.set_xlabel("registers per thread")
    left.set_ylabel("occupancy")
    left.set_ylim(0, 1.05)
    left.set_title("registers", fontsize=10)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    if smem_curves:
        right = axes[0, 1]
        for label, (kb, occ) in smem_curves.items():
            right.step(kb, occ, where="post", label=label)
        right.set_xlabel("shared memory per block (KB)")
        right.set_ylim(0, 1.05)
        right.set_title("shared memory", fontsize=10)
        right.grid(True, alpha=0.3)
        right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_divergence(fractions, times: dict, title: str = "", ylabel: str = "time (ms)",
                    model: dict | None = None, points: dict | None = None) -> plt.Figure:
    """Time of the two branch styles against the fraction of lanes that take the slow path.

    times: {label: values aligned with fractions}; model: {label: values} drawn dashed (e.g.
    the share of warps holding at least one slow lane, scaled to a time); points: {label:
    (fractions, values)} extra measurements drawn as large markers (e.g. sorted data).
    """
    fig, ax = plt.subplots(figsize=(6.6, 3.8))
    xs = [max(f, 1e-4) for f in fractions]
    for i, (label, ys) in enumerate(times.items()):
        ax.semilogx(xs, ys, "o-", color=f"C{i}", label=label)
    for i, (label, ys) in enumerate((model or {}).items()):
        ax.semilogx(xs, ys, "--", color=f"C{len(times) + i}", label=label)
    for i, (label, (px, py)) in enumerate((points or {}).items()):
        ax.semilogx(px, py, "D", ms=8, color=f"C{len(times) + len(model or {}) + i}",
                    label=label, ls="none")
    ax.set_xlabel("fraction of elements on the slow path (0 drawn at 1e-4)")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "branch divergence", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_bandwidth_by_size(sizes_bytes, gbps: dict, caches: dict | None = None,
                           title: str = "") -> plt.Figure:
    """Copy bandwidth (GB/s) against the size of the copied buffer, with cache sizes marked.

    gbps: {label: values aligned with sizes_bytes}; caches: {label: bytes} vertical lines.
    """
    fig, ax = plt.subplots(figsize=(6.6, 3.8))
    for i, (label, ys) in enumerate(gbps.items()):
        ax.semilogx([s / 2**20 for s in sizes_bytes], ys, "o-", color=f"C{i}", label=label)
    for i, (label, nbytes) in enumerate((caches or {}).items()):
        ax.axvline(nbytes / 2**20, color=f"C{3 + i}", ls=":", lw=1.2, label=label)
    ax.set_xlabel("buffer size (MiB; the copy reads one and writes one)")
    ax.set_ylabel("GB/s (read + written)")
    ax.set_title(title or "copy bandwidth by working-set size", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_matmul_rates(rates: dict, peaks: dict | None = None, title: str = "") -> plt.Figure:
    """Bars of matrix-product TFLOP/s per machine and number format.

    rates: {machine: {format: TFLOP/s}} measured; peaks: {machine: {format: TFLOP/s}} vendor
    peaks drawn as black ticks over the bars.
    """

    machines = list(rates)
    fig, axes = plt.subplots(1, len(machines), figsize=(4.2 * len(machines), 3.4),
                             squeeze=False)
    for ax, machine in zip(axes[0], machines):
        fmts = list(rates[machine])
        x = np.arange(len(fmts))
        bars = ax.bar(x, [rates[machine][f] for f in fmts], color=[f"C{i}" for i in x])
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        for i, f in enumerate(fmts):
            peak = (peaks or {}).get(machine, {}).get(f)
            if peak:
                ax.plot([i - 0.4, i + 0.4], [peak, peak], "k-", lw=1.5)
        ax.set_xticks(x, fmts, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(machine, fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0, 0].set_ylabel("TFLOP/s (log)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_tile_choice(block_m: int = 128, block_n: int = 128, block_k: int = 64, stages: int = 3,
                     size: int = 4096, bytes_per_elem: int = 2, bandwidth: float = 4.8e12,
                     peak_flops: float = 989e12) -> plt.Figure:
    """What a matmul tile buys: a ``size``-cubed product by a kernel with ``block_m x block_n``
    output tiles, its K loop pipelined ``stages`` deep in ``block_k`` steps.

    Left: the roofline (``bandwidth`` bytes/s, ``peak_flops`` FLOP/s; default the H200's
    datasheet) with the kernel's intensity when every program re-reads its strips of A and B
    from HBM (:func:`minillm.course.a2_roofline.tiled_matmul_bytes`), next to the ideal of
    reading each input once. Right: the shared memory those pipelined tiles need per block and
    how many such blocks fit on a Hopper SM by shared memory alone.
    """
    from ..course import a2_roofline as rl

    flops, ideal = rl.matmul_cost(size, size, size, bytes_per_elem)
    tiled = rl.tiled_matmul_bytes(size, size, size, block_m, block_n, bytes_per_elem)
    smem = rl.pipelined_tile_smem(block_m, block_n, block_k, stages, bytes_per_elem)
    limit = rl.HOPPER_SM.max_smem_per_block
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), width_ratios=[1.6, 1])
    x = np.logspace(0, 4, 200)
    ax.loglog(x, np.minimum(bandwidth * x, peak_flops) / 1e12, "k", lw=2, label="roof")
    for label, nbytes, marker in ((f"tiles {block_m}x{block_n}, no cache reuse", tiled, "o"),
                                  ("each input read once (ideal)", ideal, "s")):
        i = flops / nbytes
        ax.loglog([i], [rl.attainable(i, bandwidth, peak_flops) / 1e12], marker, ms=9,
                  label=f"{label}: {i:,.0f} FLOP/B")
    ax.axvline(peak_flops / bandwidth, color="0.5", ls=":", lw=1,
               label=f"ridge {peak_flops / bandwidth:.0f} FLOP/B")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"{size}^3 matmul, {bytes_per_elem}-byte values", fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    fits = smem <= limit
    blocks = rl.occupancy(256, 0, smem)["blocks_per_sm"] if fits else 0
    ax2.bar([0], [smem / 1024], color="C0" if fits else "C3", width=0.5)
    ax2.axhline(limit / 1024, color="k", ls="--", lw=1,
                label=f"max per block ({limit // 1024} KB)")
    ax2.set_xticks([0], [f"{stages} stages x ({block_m}x{block_k} + {block_k}x{block_n})"],
                    fontsize=7)
    ax2.set_ylabel("shared memory per block (KB)")
    ax2.set_title(f"{blocks} block(s) per SM by shared memory" if fits
                  else "does not fit in shared memory", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
