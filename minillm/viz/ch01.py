"""Chapter 01 (transformers) plots: each ``plot_*`` function returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..config import SamplingParams
from ..sampling import probabilities


def _token_label(token: str) -> str:
    """A token as a short tick label: leading/trailing spaces shown as '·', newlines as '\\n'."""
    return token.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t") or "''"


def plot_next_token_distributions(tokens: list[str], dists: dict, base=None,
                                  title: str = "") -> plt.Figure:
    """One bar panel per sampling setting, over the same candidate tokens.

    tokens: the candidates' text (most likely first); dists: {setting: probabilities aligned with
    tokens}; base: the untouched (T = 1) probabilities, drawn as an outline in every panel.
    """

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


def plot_sampling_filter(logits, tokens: list[str], temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0) -> plt.Figure:
    """Bars of the most likely next tokens after temperature, top-k and top-p (vLLM's order).

    logits [V]: the model's next-token logits; tokens: the text of the len(tokens) most likely
    ones (most likely first). Blue bars are kept tokens' sampling probabilities, red crosses
    dropped ones; grey outlines are the untouched (T = 1) probabilities. The title counts the
    tokens kept over the whole vocabulary.
    """
    row = torch.as_tensor(logits, dtype=torch.float32).reshape(1, -1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = probabilities(row, params)[0]
    shown = row[0].topk(len(tokens)).indices
    kept = int((probs > 0).sum())
    base = row[0].softmax(-1)[shown].numpy()
    after = probs[shown].numpy()
    x = np.arange(len(tokens))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.bar(x, after, color="C0", alpha=0.85, label="kept: sampling probability")
    ax.bar(x, base, color="none", edgecolor="dimgray", lw=0.8, label="T = 1, no filter",
           zorder=3)
    ax.plot(x[after == 0], np.zeros((after == 0).sum()), "x", color="C3", ms=7, mew=2,
            label="dropped")
    ax.set_xticks(x, [_token_label(t) for t in tokens], rotation=90, fontsize=8)
    ax.set_ylabel("probability of the next token")
    ax.set_title(f"T = {temperature:g}, top-k = {top_k or 'off'}, top-p = {top_p:g}: "
                 f"{kept:,} of {row.shape[1]:,} tokens can be drawn", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
