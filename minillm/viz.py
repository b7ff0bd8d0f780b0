"""Plots for the chapters. Each function returns a matplotlib Figure; :func:`save` writes it.

Figures go into ``figures/`` at the repository root (PNG, modest dpi, so notebooks stay small).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from .device import fast_mode

FIGURES = Path(__file__).resolve().parent.parent / "figures"


def save(fig: plt.Figure, name: str, dpi: int = 90) -> Path:
    """Write ``fig`` to figures/<name>.png and return the path.

    With MINILLM_FAST=1 (CI's small sizes) the PNG goes to a temporary folder instead, so a
    test run never overwrites the committed full-size figures.
    """
    folder = Path(tempfile.gettempdir()) / "minillm-figures" if fast_mode() else FIGURES
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


# --- chapter 01: transformers ---


def _token_label(token: str) -> str:
    """A token as a short tick label: leading/trailing spaces shown as '·', newlines as '\\n'."""
    return token.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t") or "''"


def plot_next_token_distributions(tokens: list[str], dists: dict, base=None,
                                  title: str = "") -> plt.Figure:
    """One bar panel per sampling setting, over the same candidate tokens.

    tokens: the candidates' text (most likely first); dists: {setting: probabilities aligned with
    tokens}; base: the untouched (T = 1) probabilities, drawn as an outline in every panel.
    """
    import numpy as np

    n = len(dists)
    fig, axes = plt.subplots(1, n, figsize=(2.3 * n, 3.0), sharey=True)
    axes = np.atleast_1d(axes)
    x = np.arange(len(tokens))
    for ax, (name, probs) in zip(axes, dists.items()):
        probs = np.asarray(probs, dtype=float)
        if base is not None:
            ax.bar(x, np.asarray(base, dtype=float), color="none", edgecolor="gray", lw=0.6)
        ax.bar(x, probs, color=["C0" if v > 0 else "C3" for v in probs], alpha=0.85)
        ax.plot(x[probs == 0], np.zeros((probs == 0).sum()), "x", color="C3", ms=4)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(x, [_token_label(t) for t in tokens], rotation=90, fontsize=7)
    axes[0].set_ylabel("probability of the next token")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_top_p(sorted_probs, ps: list[float]) -> plt.Figure:
    """Cumulative probability of the tokens, most likely first, with the top-p cut for each p."""
    import numpy as np

    cum = np.cumsum(np.asarray(sorted_probs, dtype=float))
    ranks = np.arange(1, len(cum) + 1)
    fig, ax = plt.subplots(figsize=(5.5, 3.0))
    ax.semilogx(ranks, cum, color="C0")
    for i, p in enumerate(ps):
        kept = int(np.searchsorted(cum - np.asarray(sorted_probs, dtype=float), p)) or 1
        ax.axhline(p, color=f"C{i + 1}", ls=":", lw=1)
        ax.axvline(kept, color=f"C{i + 1}", ls="--", lw=1, label=f"top-p {p}: {kept} tokens kept")
    ax.set_xlabel("tokens, most likely first (log scale)")
    ax.set_ylabel("cumulative probability")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_residual_stream(rms_first, rms_rest, lens_prob, lens_rank, answer: str) -> plt.Figure:
    """Left: RMS of the residual stream after each layer (first token vs the others). Right: the
    logit lens, the final norm and tied head applied to each layer's stream at the last token:
    probability and rank of the model's final answer. Index 0 is the embedding."""
    import numpy as np

    layers = np.arange(len(rms_rest))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    left.semilogy(layers, rms_first, "o-", ms=3, label="first token")
    left.semilogy(layers, rms_rest, "s-", ms=3, label="other tokens (mean)")
    left.set_xlabel("layer (0 = embeddings)")
    left.set_ylabel("RMS of the residual stream")
    left.legend(fontsize=8)
    right.plot(layers, lens_prob, "o-", ms=3, color="C2")
    right.set_xlabel("layer (0 = embeddings)")
    right.set_ylabel(f"p({_token_label(answer)})", color="C2")
    twin = right.twinx()
    twin.semilogy(layers, lens_rank, "s--", ms=3, color="C4")
    twin.set_ylabel("rank of that token", color="C4")
    twin.invert_yaxis()
    right.set_title("logit lens", fontsize=9)
    fig.tight_layout()
    return fig


def plot_attention_maps(maps: dict, tokens: list[str], ncols: int = 3) -> plt.Figure:
    """A grid of attention maps {title: [T, T] probabilities}, queries down, keys across."""
    import numpy as np

    n = len(maps)
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.6 * nrows))
    axes = np.atleast_1d(axes).ravel()
    labels = [_token_label(t) for t in tokens]
    for ax, (title, probs) in zip(axes, maps.items()):
        ax.imshow(np.asarray(probs, dtype=float), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=5)
        ax.set_yticks(range(len(labels)), labels, fontsize=5)
    for ax in axes[n:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_kv_bytes(groups: dict, unit: int = 1024, unit_name: str = "KiB") -> plt.Figure:
    """KV cache bytes per token, one panel per group {group: {variant: bytes}}."""
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 2.8))
    axes = [axes] if len(groups) == 1 else list(axes)
    for ax, (title, bars) in zip(axes, groups.items()):
        names, values = list(bars), [v / unit for v in bars.values()]
        ax.barh(names, values, color=[f"C{i}" for i in range(len(names))])
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:,.1f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.3)
        ax.set_xlabel(f"KV cache per token, all layers ({unit_name}, 16-bit)")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_kv_compression(curves: dict, ppl: dict, reference: str) -> plt.Figure:
    """Cache size against damage. curves {method: (numbers cached per token and layer, mean
    relative error of the layer's attention output)}, each a number or a list of them;
    ppl {method: perplexity}, where ``reference`` names the unmodified model."""
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (name, (x, err)) in enumerate(curves.items()):
        left.plot(np.atleast_1d(x), np.atleast_1d(err), "o-", color=f"C{i}", label=name)
    left.set_xlabel("numbers cached per token per layer")
    left.set_ylabel("relative error of attention output")
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    names = list(ppl)
    right.barh(names, list(ppl.values()), color=["gray" if n == reference else "C0"
                                                  for n in names])
    right.set_xscale("log")
    right.axvline(ppl[reference], color="gray", ls="--", lw=1)
    right.invert_yaxis()
    right.set_xlabel("perplexity on held-out text (log scale)")
    fig.tight_layout()
    return fig


def plot_expert_load(final: dict, history: dict) -> plt.Figure:
    """Left: token slots per expert after training, one bar group per run {run: [E]}.
    Right: max/mean expert load at each step {run: [steps]} (1 is perfectly balanced)."""
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    width = 0.8 / len(final)
    for i, (name, load) in enumerate(final.items()):
        load = np.asarray(load, dtype=float)
        left.bar(np.arange(len(load)) + i * width, load, width, label=name, color=f"C{i}")
    ideal = float(np.mean(np.asarray(next(iter(final.values())), dtype=float)))
    left.axhline(ideal, color="gray", ls="--", lw=1, label="perfect balance")
    left.set_xlabel("expert")
    left.set_ylabel("token slots routed")
    left.legend(fontsize=8)
    for i, (name, ratio) in enumerate(history.items()):
        right.plot(np.arange(1, len(ratio) + 1), ratio, color=f"C{i}", label=name)
    right.axhline(1, color="gray", ls="--", lw=1)
    right.set_xlabel("training step")
    right.set_ylabel("max / mean expert load")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- chapter 02: KV cache ---


def prefill_decode_plot(tokens, prefill_ms_per_token, decode_ms, prefill_intensity,
                        decode_intensity, ridge: float | None = None) -> plt.Figure:
    """Prefill of N tokens vs one decode step with N tokens already cached.

    Left: milliseconds per token. Right: arithmetic intensity (FLOPs per byte moved) of each,
    with the machine's ridge point (peak FLOP/s / bandwidth): above it a pass is compute-bound,
    below it memory-bound.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.loglog(tokens, prefill_ms_per_token, "o-", label="prefill: time of N tokens / N")
    left.loglog(tokens, decode_ms, "s-", label="decode: one token after N")
    left.set_xlabel("N (tokens)")
    left.set_ylabel("ms per token")
    left.set_title("time per token")
    right.loglog(tokens, prefill_intensity, "o-", label="prefill of N tokens")
    right.loglog(tokens, decode_intensity, "s-", label="decode step after N")
    if ridge is not None:
        right.axhline(ridge, color="k", ls="--", lw=1, label=f"this machine's ridge ({ridge:.1f})")
    right.set_xlabel("N (tokens)")
    right.set_ylabel("FLOPs per byte")
    right.set_title("arithmetic intensity")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def recompute_heatmap(n: int) -> plt.Figure:
    """How many times each score q_i . k_j is computed to read n tokens one pass per token,
    without a cache (the triangle is recomputed every step) and with one (once each)."""
    import numpy as np

    without = np.zeros((n, n), dtype=int)
    for length in range(1, n + 1):
        without[:length, :length] += np.tril(np.ones((length, length), dtype=int))
    with_cache = np.tril(np.ones((n, n), dtype=int))
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.8))
    for ax, counts, title in ((axes[0], without, f"no cache: {without.sum()} products"),
                              (axes[1], with_cache, f"KV cache: {with_cache.sum()} products")):
        shown = np.where(counts > 0, counts, np.nan)
        im = ax.imshow(shown, cmap="viridis", vmin=0, vmax=n)
        for i, j in zip(*np.nonzero(counts)):
            ax.text(j, i, counts[i, j], ha="center", va="center", fontsize=7,
                    color="k" if counts[i, j] > 0.6 * n else "w")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
    fig.colorbar(im, ax=axes, shrink=0.8, label="times computed")
    return fig


def cache_latency_plot(contexts, cached_ms, uncached_ms, step_contexts=None,
                       step_ms=None) -> plt.Figure:
    """Latency of producing one token at context length L, with and without a KV cache.

    ``step_contexts``/``step_ms``: optional per-step timings of a real generate() run.
    """
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.loglog(contexts, uncached_ms, "o-", label="no cache: forward over all L tokens")
    ax.loglog(contexts, cached_ms, "s-", label="KV cache: forward over 1 token")
    if step_contexts is not None:
        ax.plot(step_contexts, step_ms, ".", ms=3, alpha=0.5, label="KV cache: steps of generate()")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("ms per generated token")
    ax.set_title("cached vs uncached decoding")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def kv_memory_plot(contexts, kv_bytes: dict, weight_bytes: dict | None = None,
                   batch: int = 1) -> plt.Figure:
    """KV cache GiB vs context length per model (log-log); dashed: the model's weights."""
    fig, ax = plt.subplots(figsize=(6.8, 4.0))
    for name, values in kv_bytes.items():
        (line,) = ax.loglog(contexts, [v / 2**30 for v in values], "o-", ms=3, label=name)
        if weight_bytes and name in weight_bytes:
            ax.axhline(weight_bytes[name] / 2**30, color=line.get_color(), ls="--", lw=1)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache (GiB)")
    title = f"KV cache per {'sequence' if batch == 1 else f'batch of {batch}'}, 16-bit values"
    ax.set_title(title + ("\n(dashed: the weights, 16-bit)" if weight_bytes else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def sink_attention_plot(share_first, share_uniform, n_first: int) -> plt.Figure:
    """Per layer: attention mass the late queries put on the first ``n_first`` tokens, next to
    what uniform attention over the causal prefix would give them."""
    import numpy as np

    x = np.arange(len(share_first))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.bar(x, share_first, label=f"measured: attention on the first {n_first} tokens")
    ax.plot(x, share_uniform, "k_", ms=12, mew=2, label="if attention were uniform")
    ax.set_xlabel("layer")
    ax.set_ylabel("share of attention")
    ax.set_ylim(0, 1)
    ax.set_title("attention sinks in SmolLM2", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def policy_perplexity_plot(rows, nll_curves: dict | None = None, budget: int | None = None,
                           smooth: int = 32) -> plt.Figure:
    """Left: perplexity per policy, grouped by cache budget (rows as from
    :func:`minillm.evaluate.compare_policies`; "full" drawn as a line). Right: running mean of
    the per-token loss along the text for each curve, with the budget marked."""
    import numpy as np

    ncols = 2 if nll_curves else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 3.8), squeeze=False)
    left = axes[0, 0]
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    budgets = sorted({r["budget"] for r in rows if r["policy"] != "full"})
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        ppl = {r["budget"]: r["ppl"] for r in rows if r["policy"] == policy}
        xs = [j + (i - (len(policies) - 1) / 2) * width for j, b in enumerate(budgets) if b in ppl]
        bars = left.bar(xs, [ppl[b] for b in budgets if b in ppl], width, label=policy)
        left.bar_label(bars, fmt="%.1f", fontsize=7)
    for r in rows:
        if r["policy"] == "full":
            left.axhline(r["ppl"], color="k", ls="--", lw=1, label=f"full cache ({r['ppl']:.1f})")
    left.set_xticks(range(len(budgets)), [f"{b} tokens" for b in budgets])
    left.set_yscale("log")
    left.set_xlabel("cache budget (tokens kept)")
    left.set_ylabel("perplexity (log)")
    left.set_title("perplexity per policy", fontsize=10)
    left.grid(True, axis="y", which="both", alpha=0.3)
    left.legend(fontsize=8)
    if nll_curves:
        right = axes[0, 1]
        kernel = np.ones(smooth) / smooth
        for label, nll in nll_curves.items():
            nll = np.asarray(nll, dtype=float)
            right.plot(np.arange(smooth, len(nll) + 1), np.convolve(nll, kernel, "valid"),
                       label=label, lw=1.2)
        if budget is not None:
            right.axvline(budget, color="gray", ls=":", label=f"budget ({budget}) reached")
        right.set_xlabel("position in the text")
        right.set_ylabel(f"loss, mean of {smooth} tokens (nats)")
        right.set_title("where the loss goes up", fontsize=10)
        right.grid(True, alpha=0.3)
        right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def decode_step_plot(phases: dict, op_groups: dict, floor_ms: float | None = None) -> plt.Figure:
    """One decode step as the CPU sees it. Left: its phases, top to bottom in the order they
    run (ms, log scale), with ``floor_ms`` (the step of a model with no arithmetic) marked.
    Right: the self time of the operators run in one step, grouped by kind (ms)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.4))
    names = list(phases)
    bars = left.barh(names, [phases[n] for n in names], color="tab:blue")
    left.bar_label(bars, fmt="%.3g ms", fontsize=8, padding=2)
    if floor_ms is not None:
        left.axvline(floor_ms, color="tab:red", ls="--", lw=1,
                     label=f"whole step, no arithmetic ({floor_ms:.3g} ms)")
        left.legend(fontsize=8, loc="lower right")
    left.set_xscale("log")
    left.set_xlim(right=max(phases.values()) * 20)
    left.invert_yaxis()
    left.set_xlabel("ms (log)")
    left.set_title("one decode step, phase by phase", fontsize=10)
    names = list(op_groups)
    right.barh(names, [op_groups[n] for n in names])
    right.invert_yaxis()
    right.set_xlabel("CPU ms per step (operators' self time)")
    right.set_title("operators by kind", fontsize=10)
    fig.tight_layout()
    return fig


# --- appendix A2: GPU hardware ---


def _flops_unit(peak: float) -> tuple[float, str]:
    """(scale, name) to show FLOP/s in TFLOP/s on a GPU and GFLOP/s on a CPU."""
    return (1e12, "TFLOP/s") if peak >= 1e12 else (1e9, "GFLOP/s")


def roofline_plot(bandwidth: float, peak_flops: float, points=(), name: str = "",
                  ceilings: dict | None = None, bandwidths: dict | None = None,
                  other_roofs: dict | None = None, title: str = "",
                  annotate: bool = False) -> plt.Figure:
    """Roofline (log-log): attainable FLOP/s = min(bandwidth x intensity, peak) and kernels on it.

    bandwidth (bytes/s) and peak_flops (FLOP/s) draw the main roof, labelled ``name``;
    points: :class:`minillm.roofline.KernelPoint` (one marker per ``group``);
    ceilings: {label: FLOP/s} lower compute roofs (e.g. fp32 without tensor cores);
    bandwidths: {label: bytes/s} other memory roofs (e.g. a measured copy);
    other_roofs: {label: (bytes/s, FLOP/s)} other machines, drawn faintly.
    """
    import numpy as np

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


def occupancy_plot(register_curves: dict, smem_curves: dict | None = None,
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


def divergence_plot(fractions, times: dict, title: str = "", ylabel: str = "time (ms)",
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


def bandwidth_by_size_plot(sizes_bytes, gbps: dict, caches: dict | None = None,
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


def matmul_rates_plot(rates: dict, peaks: dict | None = None, title: str = "") -> plt.Figure:
    """Bars of matrix-product TFLOP/s per machine and number format.

    rates: {machine: {format: TFLOP/s}} measured; peaks: {machine: {format: TFLOP/s}} vendor
    peaks drawn as black ticks over the bars.
    """
    import numpy as np

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


# --- chapter 05: I/O-aware kernels ---


def hbm_traffic_plot(ns, series: dict, flops=None, title: str = "") -> plt.Figure:
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


def online_softmax_plot(scores, values, tile: int, states: list, step: int) -> plt.Figure:
    """One query's online softmax after ``step`` K/V tiles (1-based).

    scores [L], values [L, d]; states[i] is a dict with m, l and out (the running output
    acc / l) after tile i. Left: the scores, tiles seen so far in colour, the running max.
    Middle: m and l tile by tile. Right: the running output against the exact one.
    """
    import numpy as np

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


def block_table_plot(block_tables, seq_lens, block_size: int, num_blocks: int) -> plt.Figure:
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


def bpt_memory_plot(ts, peaks: dict, measured: dict | None = None, unit: int = 2**20,
                    unit_name: str = "MiB", title: str = "") -> plt.Figure:
    """Peak activation memory of one layer against sequence length: counted (lines, from
    :func:`minillm.io_model.layer_peak_bytes`) and the largest tensor measured (markers)."""
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


def kernel_roofline_plot(points: dict, bandwidth: float, peak_flops: float | None = None,
                         peak_label: str = "compute peak", title: str = "") -> plt.Figure:
    """Roofline: attainable FLOP/s = min(peak, bandwidth x intensity), log-log.

    points: {label: (FLOPs per byte, achieved FLOP/s or None)}; None draws only a vertical
    marker at that intensity. bandwidth in bytes/s (the sloped roof), peak_flops in FLOP/s.
    """
    import numpy as np

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


def kernel_benchmarks_plot(flash_rows: list, decode_rows: list, split_rows: list,
                           copy_gbps: float, title: str = "") -> plt.Figure:
    """Three panels from ``benchmarks/kernels_bench.py`` results: FlashAttention vs SDPA
    TFLOP/s by N; paged decode GB/s by batch and context against the copy bandwidth; split-KV
    off vs on at batch 1."""
    import numpy as np

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


def attention_time_plot(flash_rows: list, causal: bool = True, title: str = "") -> plt.Figure:
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
