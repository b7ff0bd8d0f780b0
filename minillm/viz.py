"""Plots for the chapters. Each function returns a matplotlib Figure; :func:`save` writes it.

Figures go into ``figures/`` at the repository root (PNG, modest dpi, so notebooks stay small).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

FIGURES = Path(__file__).resolve().parent.parent / "figures"


def save(fig: plt.Figure, name: str, dpi: int = 90) -> Path:
    """Write ``fig`` to figures/<name>.png and return the path."""
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


# --- chapter 01: transformers ---


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
            ax.text(j, i, counts[i, j], ha="center", va="center", fontsize=7, color="w")
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
    """Left: perplexity vs cache budget per policy (rows as from
    :func:`minillm.evaluate.compare_policies`; "full" drawn as a line). Right: running mean of
    the per-token loss along the text for each curve, with the budget marked."""
    import numpy as np

    ncols = 2 if nll_curves else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 3.8), squeeze=False)
    left = axes[0, 0]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["budget"], r["ppl"]) for r in rows if r["policy"] == policy)
        if policy == "full":
            left.axhline(pts[0][1], color="k", ls="--", lw=1, label=f"full cache ({pts[0][1]:.1f})")
        else:
            left.plot(*zip(*pts), "o-", label=policy)
    left.set_yscale("log")
    left.set_xlabel("cache budget (tokens kept)")
    left.set_ylabel("perplexity (log)")
    left.set_title("perplexity per policy", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
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


def decode_step_plot(phases: dict, op_groups: dict) -> plt.Figure:
    """One decode step as the CPU sees it. Left: the phases in order (ms). Right: the time
    of the operators run in one step, grouped by kind (ms)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.2),
                                      gridspec_kw={"width_ratios": [1.4, 1]})
    start = 0.0
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, ms) in enumerate(phases.items()):
        left.barh(0, ms, left=start, color=colors[i % len(colors)], label=f"{name}: {ms:.2f} ms")
        start += ms
    left.set_yticks([])
    left.set_xlabel("ms since the step began")
    left.set_title("one decode step, in order", fontsize=10)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    names = list(op_groups)
    right.barh(names, [op_groups[n] for n in names])
    right.invert_yaxis()
    right.set_xlabel("ms per step (self time)")
    right.set_title("operators by kind", fontsize=10)
    fig.tight_layout()
    return fig
