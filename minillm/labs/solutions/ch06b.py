"""Chapter 06b's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import heapq

import torch

from minillm.labs import ch06b


def block_mask(t, anchors, s):
    # Context rows: themselves. A block: the context before its anchor, and its own rows.
    mask = torch.zeros(t + len(anchors) * s, t + len(anchors) * s, dtype=torch.bool)
    mask[range(t), range(t)] = True
    for b, a in enumerate(anchors):
        rows = slice(t + b * s, t + (b + 1) * s)
        mask[rows, :a] = True
        mask[rows, rows] = True
    return mask


def best_first_tree(logps, budget):
    # Pop the best prefix; push its children (every candidate of the next depth).
    parents, picks = [], []
    frontier = [(-logps[0][r], 0, (r,)) for r in range(len(logps[0]))] if logps else []
    heapq.heapify(frontier)
    while frontier and len(parents) < budget:
        neg, parent, path = heapq.heappop(frontier)
        parents.append(parent)
        picks.append((len(path) - 1, path[-1]))
        node, d = len(parents), len(path)
        if d < len(logps):
            for r, lp in enumerate(logps[d]):
                heapq.heappush(frontier, (neg - lp, node, path + (r,)))
    return parents, picks


def fill_budget(confidences, budget):
    # Every token's worth is its prefix probability; take the `budget` best (they form prefixes).
    worth = []
    for s, c in enumerate(confidences):
        p = 1.0
        for x in c:
            p *= x
            worth.append((-p, s))
    keep = [0] * len(confidences)
    for _, s in sorted(worth)[:budget]:
        keep[s] += 1
    return keep


KEY = [
    (ch06b.check_block_mask, block_mask),
    (ch06b.check_best_first_tree, best_first_tree),
    (ch06b.check_best_first_tree_in_engine, best_first_tree),
    (ch06b.check_fill_budget, fill_budget),
    (ch06b.check_fill_budget_in_engine, fill_budget),
]
