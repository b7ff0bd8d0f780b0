"""Chapter 02 (the KV cache) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def plot_prefill_decode(tokens, prefill_ms_per_token, decode_ms, prefill_intensity,
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


def plot_recompute_heatmap(n: int) -> plt.Figure:
    """How many times each score q_i . k_j is computed to read n tokens one pass per token,
    without a cache (the triangle is recomputed every step) and with one (once each)."""

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


def plot_cache_latency(contexts, cached_ms, uncached_ms, step_contexts=None,
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


def plot_kv_memory(contexts, kv_bytes: dict, weight_bytes: dict | None = None,
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


def plot_sink_attention(share_first, share_uniform, n_first: int) -> plt.Figure:
    """Per layer: attention mass the late queries put on the first ``n_first`` tokens, next to
    what uniform attention over the causal prefix would give them."""

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


def plot_policy_perplexity(rows, nll_curves: dict | None = None, budget: int | None = None,
                           smooth: int = 32) -> plt.Figure:
    """Left: perplexity per policy, grouped by cache budget (rows as from
    :func:`minillm.evaluate.compare_policies`; "full" drawn as a line). Right: running mean of
    the per-token loss along the text for each curve, with the budget marked."""

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


def plot_decode_step(phases: dict, op_groups: dict, floor_ms: float | None = None) -> plt.Figure:
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


def plot_policy_explorer(results: dict, policy: str, budget: int,
                         smooth: int = 32) -> plt.Figure:
    """One bounded-cache policy at one budget, drawn from precomputed ``results``:
    ``{"full_nll": [n - 1], "runs": {(policy, budget): {"ppl": float, "nll": [n - 1],
    "kept": [layers] lists of the positions kept after the text (KV head 0)}}}``.

    Left: perplexity of every policy at this budget (the chosen one highlighted, the full
    cache dashed). Middle: the positions kept after the whole text, per layer. Right: running
    mean of the extra per-token loss of this policy over the full cache."""
    runs = results["runs"]
    full_nll = np.asarray(results["full_nll"], dtype=float)
    full_ppl = float(np.exp(full_nll.mean()))
    fig, (bars, kept, loss) = plt.subplots(1, 3, figsize=(13, 3.6),
                                           gridspec_kw={"width_ratios": [1, 1.4, 1.4]})
    names = [p for p, b in runs if b == budget]
    shown = bars.bar(names, [runs[p, budget]["ppl"] for p in names],
                     color=["tab:orange" if p == policy else "tab:gray" for p in names])
    bars.bar_label(shown, fmt="%.1f", fontsize=8)
    bars.axhline(full_ppl, color="k", ls="--", lw=1, label=f"full cache ({full_ppl:.1f})")
    bars.set_ylabel("perplexity")
    bars.set_title(f"budget {budget} tokens", fontsize=10)
    bars.legend(fontsize=8)
    run = runs[policy, budget]
    for layer, positions in enumerate(run["kept"]):
        kept.plot(positions, [layer] * len(positions), "|", color="tab:orange", ms=5)
    kept.set_xlim(-5, len(full_nll) + 5)
    kept.set_xlabel("position in the text")
    kept.set_ylabel("layer")
    kept.invert_yaxis()
    kept.set_title(f"{policy}: positions kept after the text (KV head 0)", fontsize=10)
    extra = np.asarray(run["nll"], dtype=float) - full_nll
    loss.plot(np.arange(smooth, len(extra) + 1),
              np.convolve(extra, np.ones(smooth) / smooth, "valid"), color="tab:orange", lw=1.2,
              label=f"{policy} ({run['ppl']:.1f}) minus full cache")
    loss.axhline(0, color="k", lw=0.8)
    loss.axvline(budget, color="gray", ls=":", label="budget reached")
    loss.set_xlabel("position in the text")
    loss.set_ylabel(f"extra loss, mean of {smooth} tokens")
    loss.set_title("where the loss goes up (vs the full cache)", fontsize=10)
    loss.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_kv_bits(rows) -> plt.Figure:
    """Perplexity (log scale) against the bits each cached number is stored in: rows
    {"label", "bits", "ppl", "bytes_per_token"}, the most bits first (the reference)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bits = [r["bits"] for r in rows]
    ppl = [r["ppl"] for r in rows]
    ax.semilogy(bits, ppl, "o-")
    for i, r in enumerate(rows):                     # labels above and below in turn
        ax.annotate(f"{r['label']}\n{r['bytes_per_token'] / 1024:.1f} KiB/token",
                    (r["bits"], r["ppl"]), textcoords="offset points",
                    xytext=(0, 8 if i % 2 == 0 else -26), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(bits, [str(b) for b in bits])
    ax.axhline(rows[0]["ppl"], color="k", lw=0.8, ls="--",
               label=f"{rows[0]['label']} ({rows[0]['ppl']:.2f})")
    ax.set_xlabel("bits per cached number")
    ax.set_ylabel("perplexity")
    ax.set_title("the same text read back from a cache stored in fewer bits", fontsize=10)
    ax.set_ylim(rows[0]["ppl"] / 3, max(r["ppl"] for r in rows) * 3)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig
