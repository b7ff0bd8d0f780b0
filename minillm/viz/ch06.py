"""Plots of chapter 06 (speculative decoding). Each function returns a matplotlib Figure; save
it with :func:`minillm.viz.save`. The benchmark's three-panel figure is
:func:`minillm.viz.bench.plot_spec`.
"""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..spec_decode.autotune import leviathan_speedup

KEPT, ACCEPTED, PRUNED = "tab:blue", "tab:green", "lightgrey"


def plot_forward_cost(tokens: Sequence[int], ms: Sequence[float],
                      title: str = "one forward pass with a KV-cached context") -> plt.Figure:
    """Time of one target forward against the number of new tokens in it, with the line a
    pass would follow if its cost grew in proportion to its tokens (from the 1-token time)."""
    tokens, ms = np.asarray(tokens), np.asarray(ms, dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    ax.plot(tokens, ms, "o-", label="measured")
    ax.plot(tokens, ms[0] * tokens / tokens[0], "--", color="grey",
            label="proportional to tokens")
    ax.set(xlabel="new tokens in the pass", ylabel="ms per forward", xscale="log", yscale="log",
           title=title)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar([str(t) for t in tokens], ms / tokens, color="tab:blue")
    ax.set(xlabel="new tokens in the pass", ylabel="ms per token", title="cost per token")
    fig.tight_layout()
    return fig


def plot_distribution_check(p: Sequence[float], empirical_good: Sequence[float],
                            empirical_biased: Sequence[float], q: Sequence[float] | None = None,
                            labels: tuple[str, str] = ("lossless rule", "biased: resample from p")
                            ) -> plt.Figure:
    """Bars per token: the target p, the drafter q (optional), and the emitted tokens'
    empirical distributions under the lossless rule and a biased one."""
    v = np.arange(len(p))
    series = [("target p", p, "black")] + ([("drafter q", q, "lightgrey")] if q is not None
                                           else [])
    series += [(labels[0], empirical_good, "tab:green"), (labels[1], empirical_biased, "tab:red")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, (name, vals, color) in enumerate(series):
        ax.bar(v + (i - (len(series) - 1) / 2) * width, np.asarray(vals, dtype=float), width,
               label=name, color=color)
    top = max(float(np.max(np.asarray(vals, dtype=float))) for _, vals, _ in series)
    ax.set(xlabel="token", ylabel="probability", xticks=v, ylim=(0, 1.3 * top),
           title="emitted tokens vs the target distribution")
    ax.legend(fontsize=8, ncol=len(series), loc="upper center")
    fig.tight_layout()
    return fig


def tree_layout(parents: Sequence[int]) -> tuple[list[float], list[int]]:
    """x and depth of every node of a draft tree (node 0 the root, node i + 1 under
    ``parents[i]``): leaves side by side in depth-first order, a parent centred over its
    children."""
    n = len(parents) + 1
    children: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    for i, p in enumerate(parents, start=1):
        children[p].append(i)
        depth[i] = depth[p] + 1
    x = [0.0] * n
    next_leaf = [0]

    def place(node: int) -> float:
        if not children[node]:
            x[node] = float(next_leaf[0])
            next_leaf[0] += 1
        else:
            xs = [place(c) for c in children[node]]
            x[node] = (xs[0] + xs[-1]) / 2
        return x[node]

    place(0)
    return x, depth


def plot_tree(tokens: Sequence[int], parents: Sequence[int], labels: Sequence[str],
              kept: Sequence[int] | None = None, accepted: Sequence[int] | None = None,
              root_label: str = "root", title: str = "draft tree") -> plt.Figure:
    """A draft tree level by level: node i + 1 holds ``tokens[i]``, shown as ``labels[i]``
    (its text), under ``parents[i]``. ``kept``: the nodes (1-based) that went to verification
    (others drawn grey: grown, then pruned); ``accepted``: the path the target accepted (green).
    """
    if not len(tokens) == len(parents) == len(labels):
        raise ValueError(f"tokens, parents and labels must have one entry per node, got "
                         f"{len(tokens)}, {len(parents)}, {len(labels)}")
    x, depth = tree_layout(parents)
    keep = set(kept) if kept is not None else set(range(1, len(tokens) + 1))
    path = set(accepted or ())
    leaves = max(x) + 1
    fig, ax = plt.subplots(figsize=(min(24, max(6, 0.5 * leaves)), 1.8 + 1.1 * max(depth)))
    for i, p in enumerate(parents, start=1):
        on_path = i in path and (p == 0 or p in path)
        ax.plot([x[p], x[i]], [-depth[p], -depth[i]], lw=2.2 if on_path else 0.8,
                color=ACCEPTED if on_path else ("grey" if i in keep else PRUNED), zorder=1)
    ax.scatter([x[0]], [0], s=160, color="black", zorder=2)
    ax.annotate(root_label, (x[0], 0), xytext=(0, 9), textcoords="offset points", ha="center",
                fontsize=8)
    for i in range(1, len(tokens) + 1):
        color = ACCEPTED if i in path else (KEPT if i in keep else PRUNED)
        ax.scatter([x[i]], [-depth[i]], s=60, color=color, zorder=2)
        ax.annotate(_short(labels[i - 1]), (x[i], -depth[i]), xytext=(0, -7),
                    textcoords="offset points", ha="center", va="top", rotation=90,
                    fontsize=7, color="black" if i in keep else "grey", zorder=3,
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.85))
    ax.set_yticks([-d for d in range(max(depth) + 1)],
                  ["root"] + [f"depth {d}" for d in range(1, max(depth) + 1)])
    ax.set_xticks([])
    ax.set_ylim(-max(depth) - 1.3, 0.6)
    ax.set_xlim(-0.7, leaves - 0.3)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=lab) for c, lab in
               [(KEPT, "verified"), (ACCEPTED, "accepted"), (PRUNED, "pruned")]
               if (c != PRUNED or kept is not None) and (c != ACCEPTED or accepted)]
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _short(text: str, width: int = 10) -> str:
    text = repr(text)[1:-1].replace(" ", "␣")   # newlines and spaces visible
    return text if len(text) <= width else text[:width - 1] + "…"


def plot_ttt_mask(mask, step: int, title: str | None = None) -> plt.Figure:
    """EAGLE-3's training-time test mask of one step, bool [T, step * T]: which keys (the rows
    of steps 1..step side by side, columns) each query position (rows) attends to."""
    mask = np.asarray(mask, dtype=bool)
    t = mask.shape[0]
    fig, ax = plt.subplots(figsize=(1.2 + 0.42 * mask.shape[1], 1.0 + 0.42 * t))
    ax.imshow(mask, cmap="Blues", vmin=0, vmax=1.4, aspect="equal")
    for i in range(1, step):
        ax.axvline(i * t - 0.5, color="black", lw=1.5)
    ax.set_xticks(range(mask.shape[1]), [str(c % t) for c in range(mask.shape[1])], fontsize=7)
    ax.set_yticks(range(t), [str(r) for r in range(t)], fontsize=7)
    for i in range(step):
        ax.text(i * t + (t - 1) / 2, -0.7, "step 1 (context)" if i == 0 else f"step {i + 1}",
                ha="center", va="bottom", fontsize=8)
    ax.set(xlabel="key position, per step", ylabel=f"step-{step} query position")
    fig.suptitle(title or f"training-time test: what a step-{step} row attends to")
    fig.tight_layout()
    return fig


def plot_acceptance(acceptance: dict[str, Sequence[float]],
                    title: str = "acceptance by draft position (batch 1)") -> plt.Figure:
    """Acceptance rate at each draft position (the fraction of drafts reaching that depth whose
    accepted path did too), one line per drafter."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, acc in acceptance.items():
        if len(acc):
            ax.plot(range(1, len(acc) + 1), acc, "o-", label=name)
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02), title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_speedups(rows: dict[str, tuple[float, float]],
                  title: str = "batch 1: measured vs expected speedup") -> plt.Figure:
    """Per drafter: (measured speedup, Leviathan's expected speedup) as paired bars."""
    names = list(rows)
    v = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.bar(v - 0.2, [rows[n][0] for n in names], 0.4, label="measured", color="tab:blue")
    ax.bar(v + 0.2, [rows[n][1] for n in names], 0.4, label="expected (Leviathan)",
           color="tab:orange")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xticks=v, ylabel="speedup over plain decoding", title=title)
    ax.set_xticklabels(names)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_leviathan(alpha: float, k: int, c: float,
                   measured: dict[str, tuple[int, float, float, float]] | None = None,
                   max_k: int = 12) -> plt.Figure:
    """Leviathan's expected speedup against the lookahead for acceptance ``alpha`` and drafter
    cost ``c`` (per drafted token, in target steps), lookahead ``k`` marked; left, the same
    curve for the neighbouring alphas; right, the speedup as c varies at this alpha and k.
    ``measured``: {name: (k, alpha solved from tokens per round, c, measured speedup)} drawn
    as points at their own k (left) and c (right)."""
    ks = np.arange(1, max_k + 1)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for a in sorted({round(alpha + d, 2) for d in (-0.2, -0.1, 0.1, 0.2)} - {alpha}):
        if 0 <= a < 1:
            ax.plot(ks, [leviathan_speedup(a, int(x), c) for x in ks], color="lightgrey",
                    lw=1)
            ax.annotate(f"a={a:.1f}", (ks[-1], leviathan_speedup(a, max_k, c)), fontsize=7,
                        color="grey", xytext=(3, 0), textcoords="offset points", va="center")
    ax.plot(ks, [leviathan_speedup(alpha, int(x), c) for x in ks], "-", color="tab:blue",
            label=f"a = {alpha:.2f}, c = {c:.2f}")
    ax.plot([k], [leviathan_speedup(alpha, k, c)], "o", color="tab:blue", ms=9)
    cs = np.linspace(0, max(0.6, 1.5 * c), 61)
    bx.plot(cs, [leviathan_speedup(alpha, k, float(x)) for x in cs], color="tab:blue",
            label=f"a = {alpha:.2f}, k = {k}")
    bx.plot([c], [leviathan_speedup(alpha, k, c)], "o", color="tab:blue", ms=9)
    for i, (name, (mk, ma, mc, ms)) in enumerate((measured or {}).items()):
        colour = plt.cm.tab10((i + 1) % 10)
        ax.plot([mk], [ms], "s", color=colour, label=f"{name}: a={ma:.2f}, c={mc:.2f}")
        bx.plot([mc], [ms], "s", color=colour)
    for a_ in (ax, bx):
        a_.axhline(1.0, color="grey", lw=0.8, ls="--")
        a_.set_ylabel("speedup over plain decoding")
    ax.set(xlabel="lookahead k", title="expected speedup against k (squares: measured)",
           xlim=(0.5, max_k + 1.5))
    ax.set_xticks(ks)
    bx.set(xlabel="drafter cost c per drafted token (target steps)",
           title="the same, against the drafter's cost")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    bx.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def plot_k_choice(predicted: dict[str, dict[int, float]], chosen: dict[str, int],
                  measured: dict[str, dict[int, float]] | None = None,
                  margin: float = 1.0) -> plt.Figure:
    """Per method, the calibration's predicted speedup at every lookahead (lines) and the k it
    chose (a ring); ``measured``: {method: {k: measured speedup}} as squares; ``margin``: the
    predicted speedup below which the engine does not draft (dotted)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (name, curve) in enumerate(predicted.items()):
        colour = plt.cm.tab10(i % 10)
        ks = sorted(curve)
        ax.plot(ks, [curve[k] for k in ks], "-", color=colour, label=f"{name} (predicted)")
        k = chosen[name]
        ax.plot([k], [curve[k]], "o", ms=11, mfc="none", mec=colour, mew=2)
        for mk, ms in (measured or {}).get(name, {}).items():
            ax.plot([mk], [ms], "s", color=colour)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if margin > 1:
        ax.axhline(margin, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="lookahead k", ylabel="speedup over plain decoding (batch 1)",
           title="k chosen from measurement (ring); squares: measured")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_sampled_positions(comparisons: dict, decode, top: int = 5) -> plt.Figure:
    """Per method (rows) and position (columns), the ``top`` most likely tokens' probability
    under the exact distribution (outline) and their share among the plain engine's and the
    speculative engine's samples (bars). ``comparisons``: {name:
    :class:`~minillm.course.ch06_sampling.SampledComparison`}; ``decode(token) -> str``."""
    from ..course.ch06_sampling import marginal

    names = list(comparisons)
    positions = comparisons[names[0]].positions
    fig, axes = plt.subplots(len(names), positions, figsize=(3.7 * positions, 2.9 * len(names)),
                             squeeze=False)
    for row, name in enumerate(names):
        comp = comparisons[name]
        for pos in range(positions):
            ax = axes[row][pos]
            exact = marginal(comp.exact, pos)
            tokens = sorted(exact, key=exact.get, reverse=True)[:top]
            x = np.arange(len(tokens))
            plain, spec = marginal(comp.plain, pos), marginal(comp.spec, pos)
            ax.bar(x - 0.2, [plain.get(t, 0) / comp.samples for t in tokens], 0.4,
                   color="tab:grey", label="plain engine")
            ax.bar(x + 0.2, [spec.get(t, 0) / comp.samples for t in tokens], 0.4,
                   color="tab:blue", label="speculative engine")
            ax.bar(x, [exact[t] for t in tokens], 0.8, fill=False, edgecolor="black", lw=1,
                   label="exact")
            ax.set_xticks(x, [_short(decode(t), 9) for t in tokens], fontsize=7, rotation=30)
            ax.set_title(f"{name}: token {pos + 1}", fontsize=9)
            if pos == 0:
                ax.set_ylabel("probability")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


__all__ = ["plot_acceptance", "plot_distribution_check", "plot_forward_cost",
           "plot_k_choice", "plot_leviathan", "plot_sampled_positions", "plot_speedups",
           "plot_tree", "tree_layout"]
