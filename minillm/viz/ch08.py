"""Plots of chapter 08 (KV cache management and offload). Each ``plot_*`` function returns a
matplotlib Figure; save it with :func:`minillm.viz.save`.

The radix pictures take a tree as the edge list of ``TokenRadixTree.dump`` (``(parent_path,
edge)``, a node named by its path from the root). :func:`radix_frames` replays requests through
a block manager over the engine's :class:`~minillm.cache.radix.RadixPrefixCache` and keeps, after
each event, that edge list with each node's state (for the stepper in
:func:`minillm.viz.widgets.radix_stepper`).
"""
from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt

from ..cache.block_manager import BlockManager
from ..cache.radix import RadixPrefixCache

STATE_COLOURS = {"in use": "#4c72b0", "evictable": "#dd8452", "cached": "#d9d9d9"}


def _layout(edges: Sequence[tuple[tuple, tuple]]) -> dict[tuple, tuple[float, float]]:
    """(depth, row) of every node: leaves on successive rows in dump order, a parent centred
    on its children."""
    children: dict[tuple, list[tuple]] = {(): []}
    for parent, edge in edges:
        children.setdefault(parent, []).append(parent + tuple(edge))
        children.setdefault(parent + tuple(edge), [])
    pos: dict[tuple, tuple[float, float]] = {}
    row = [0]

    def place(node: tuple, depth: int) -> float:
        kids = children[node]
        if kids:
            y = sum(place(k, depth + 1) for k in kids) / len(kids)
        else:
            y, row[0] = row[0], row[0] + 1
        pos[node] = (depth, y)
        return y

    place((), 0)
    return pos


def plot_radix_tree(edges: Sequence[tuple[tuple, tuple]], label: Callable | None = None,
                    state: dict[tuple, str] | None = None, title: str = "radix tree",
                    ax: plt.Axes | None = None, level_width: float = 2.0) -> plt.Figure:
    """Draw a radix tree from its edge list (root on the left). ``label(path, edge)`` gives a
    node's text (default: the edge's token count); ``state[path]`` a key of STATE_COLOURS;
    ``level_width``: inches per tree level (a new figure only)."""
    label = label or (lambda path, edge: f"{len(edge)} tok")
    state = state or {}
    pos = _layout(edges)
    depth = max((d for d, _ in pos.values()), default=0)
    rows = max((y for _, y in pos.values()), default=0) + 1
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(1.2 + level_width * (depth + 1), 1.4 + 0.6 * rows))
    else:
        fig = ax.figure
    for parent, edge in edges:
        (x0, y0), (x1, y1) = pos[parent], pos[parent + tuple(edge)]
        ax.plot([x0, x0 + 0.5, x1], [y0, y1, y1], color="0.55", lw=1, zorder=1)
    for path, (x, y) in pos.items():
        edge = next((e for p, e in edges if p + tuple(e) == path), ())
        text = "root" if not path else label(path, tuple(edge))
        colour = STATE_COLOURS.get(state.get(path), "white")
        ax.text(x, y, text, ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", fc=colour, ec="0.3", lw=0.6))
    ax.set_xlim(-0.6, depth + 0.6)
    ax.set_ylim(rows - 0.4, -0.6)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    used = sorted({s for s in state.values() if s in STATE_COLOURS}, key=list(STATE_COLOURS).index)
    for s in used:
        ax.scatter([], [], marker="s", color=STATE_COLOURS[s], label=s)
    if used:
        ax.legend(fontsize=8, loc="upper left", frameon=False, ncol=len(used),
                  bbox_to_anchor=(0, 0.0))
    if own:
        fig.tight_layout()
    return fig


# --- the stepper's frames: requests through the engine's radix cache ----------------------


def radix_state(cache: RadixPrefixCache) -> tuple[list, dict, dict, dict]:
    """(edges, state, block id, LRU rank) of every cached block's node. A node is "in use"
    while a sequence holds its block, "evictable" when it is an unreferenced leaf (rank 1 is
    evicted first), else "cached"."""
    edges, state, block, stamp = [], {}, {}, {}

    def walk(node, path: tuple) -> None:
        for key in sorted(node.children):
            child = node.children[key]
            edges.append((path, key))
            p = path + key
            block[p], stamp[p] = child.block, child.stamp
            state[p] = ("in use" if child.referenced else
                        "evictable" if child.pins == 0 and not child.children else "cached")
            walk(child, p)

    walk(cache._root, ())                   # the tree's own nodes: read, never changed here
    leaves = sorted((p for p, s in state.items() if s == "evictable"), key=stamp.get)
    return edges, state, block, {p: i + 1 for i, p in enumerate(leaves)}


def radix_frames(events: Sequence[tuple], num_blocks: int, block_size: int = 16) -> list[dict]:
    """Replay ``events`` through a :class:`BlockManager` over a :class:`RadixPrefixCache`:
    ``("add", name, token_ids)`` admits a request (its cached prefix is shared, the rest of
    its prompt computed and cached), ``("finish", name)`` frees it (its blocks stay cached,
    evictable). After each event a frame: the tree (:func:`radix_state`), the event's text,
    the prompt tokens found in the cache and the blocks evicted to make room."""
    cache = RadixPrefixCache(block_size)
    bm = BlockManager(num_blocks, block_size, watermark=0.0, prefix_cache=cache)
    seq_of: dict[str, int] = {}
    frames = []
    for event in events:
        before = {b for b in range(num_blocks) if b in cache}
        hit = 0
        if event[0] == "add":
            _, name, ids = event
            seq_of[name] = len(seq_of)
            hit = bm.allocate_cached(seq_of[name], list(ids), len(ids))
            bm.cache_computed(seq_of[name], list(ids), len(ids))
            text = f"{name} arrives: {len(ids)} prompt tokens, {hit} found in the cache"
        elif event[0] == "finish":
            bm.free(seq_of[event[1]])
            text = f"{event[1]} finishes: its blocks stay cached, unreferenced"
        else:
            raise ValueError(f"events: unknown kind {event[0]!r} (expected 'add' or 'finish')")
        evicted = sorted(before - {b for b in range(num_blocks) if b in cache})
        if evicted:
            text += f"; evicted blocks {evicted} (LRU unreferenced leaves)"
        edges, state, block, lru = radix_state(cache)
        frames.append({"event": text, "hit": hit, "evicted": evicted, "edges": edges,
                       "state": state, "block": block, "lru": lru,
                       "free": len(bm.device.free), "num_blocks": num_blocks})
    return frames


def plot_radix_frame(frame: dict, label: Callable | None = None,
                     ax: plt.Axes | None = None) -> plt.Figure:
    """One frame of :func:`radix_frames`: each node shows its block id and (for an evictable
    leaf) its place in the LRU order; ``label(path, edge)`` adds text."""
    def text(path, edge):
        rank = frame["lru"].get(path)
        extra = f"\n{label(path, edge)}" if label else ""
        return f"block {frame['block'][path]}" + (f" (LRU {rank})" if rank else "") + extra

    return plot_radix_tree(frame["edges"], text, frame["state"], ax=ax, level_width=1.6,
                           title=f"{textwrap.fill(frame['event'], 60)}\nfree blocks "
                                 f"{frame['free']} of {frame['num_blocks']}")


def plot_radix_steps(frames: Sequence[dict], cols: int = 2,
                     label: Callable | None = None) -> plt.Figure:
    """Every frame of :func:`radix_frames` side by side (the static view of the stepper)."""
    rows = -(-len(frames) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.0 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(frames):
            plot_radix_frame(frames[i], label, ax=ax)
            ax.set_title(f"step {i + 1}: " + ax.get_title(), fontsize=9)
        else:
            ax.axis("off")
    fig.tight_layout()
    return fig


# --- the committed benchmark -------------------------------------------------------------


def plot_cache_size(report: dict) -> plt.Figure:
    """From ``benchmarks/results/prefix.json``: hit rate and mean TTFT against the KV pool
    size (system prompts taking turns), the x axis also in system prompts' worth of blocks."""
    sizes = report["cache_size"]
    n = [int(k) for k in sizes]
    per_prompt = report["workload"]["system_blocks"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    axes[0].plot(n, [r["hit_rate"] for r in sizes.values()], "o-", color="#dd8452")
    axes[0].set_ylabel("prompt tokens found in the cache")
    axes[0].set_ylim(-0.05, 1.05)
    axes[1].plot(n, [r["ttft_mean"] * 1e3 for r in sizes.values()], "o-", color="#4c72b0")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("mean TTFT (ms)")
    for ax in axes:
        ax.set_xlabel(f"KV pool blocks (one system prompt = {per_prompt} blocks)")
        ax.grid(alpha=0.3)
        top = ax.secondary_xaxis("top", functions=(lambda x: x / per_prompt,
                                                   lambda x: x * per_prompt))
        top.set_xlabel("system prompts that fit", fontsize=8)
    fig.suptitle("hash prefix cache under pools of a few sizes (committed benchmark)", fontsize=10)
    fig.tight_layout()
    return fig
