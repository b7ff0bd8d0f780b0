"""Draft trees: Medusa's static sparse tree, EAGLE-2's dynamic one, DDTree's best-first one.

A tree is verified in one target pass (the tree-attention mask lets every node see only its
ancestors), and the longest path the target agrees with is kept, so a tree of N nodes can beat
a chain of N when the drafter is unsure which token comes next.

- :func:`medusa_tree`: Medusa (Cai et al. 2024) combines each head's top-k candidates into a
  Cartesian product and keeps the paths most likely to be accepted. A path picks rank r_i at
  head i; with the heads' measured top-k accuracies acc[i][r] (held-out data), its chance is
  estimated as the product of acc[i][r_i], and the ``budget`` best paths form the tree (every
  prefix of a kept path scores at least as high, so the set is a tree).
- :func:`top_nodes`: EAGLE-2 (Li et al. 2024) grows the tree per request: expand the top-k
  nodes of each level by *joint confidence* (the product of the drafter's probabilities along
  the path), then rerank every node grown and keep the ``budget`` best, parents first.
- :func:`best_first_tree`: DDTree (2026) builds the tree from a block drafter's per-position
  distributions (one forward gives them all, each independent of the tokens before it): a node
  is a prefix of ranks, its score the sum of its tokens' log-probabilities, and the node with
  the highest path probability on the frontier is expanded next, until ``budget`` nodes.
"""
from __future__ import annotations

import heapq

Path = tuple[int, ...]          # the rank chosen at each depth, from the root


def medusa_tree(acc: list[list[float]], budget: int) -> list[Path]:
    """The ``budget`` rank paths with the highest product of accuracies, parents first.
    acc[i][r]: how often head i's rank-r candidate was the right token."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    best: list[tuple[float, Path]] = []
    frontier = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(frontier)
    while frontier and len(best) < budget:
        neg, path = heapq.heappop(frontier)
        best.append((-neg, path))
        depth = len(path)
        if depth < len(acc):
            for r in range(len(acc[depth])):
                heapq.heappush(frontier, (neg * acc[depth][r], path + (r,)))
    return sorted((p for _, p in best), key=lambda p: (len(p), p))


def tree_parents(paths: list[Path]) -> list[int]:
    """Draft parents (0 = root, i + 1 = paths[i]) of rank paths listed parents first."""
    index = {p: i + 1 for i, p in enumerate(paths)}
    return [index[p[:-1]] if len(p) > 1 else 0 for p in paths]


def top_nodes(scores: list[float], parents: list[int], budget: int) -> list[int]:
    """EAGLE-2's rerank: the ``budget`` nodes (1-based, parents 0-based as in a Draft) with the
    highest joint log-confidence ``scores``, ancestors included, best first (a child's score is
    its parent's plus a log-probability, so a parent comes before its children; ties: the
    earlier node first): the first b of them are the best tree of b nodes."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        chain, node = [], i + 1
        while node and node not in keep:
            chain.append(node)
            node = parents[node - 1]
        if len(keep) + len(chain) <= budget:
            keep.update(chain)
    return sorted(keep, key=lambda n: (-scores[n - 1], n))


def best_first_tree(logps: list[list[float]], budget: int
                    ) -> tuple[list[int], list[tuple[int, int]]]:
    """logps[d]: depth d's candidate log-probabilities, best first (K per depth). Returns
    (parents: 0 = root, node i + 1's parent; picks: (depth, rank) of each node), the
    ``budget`` prefixes of highest path log-probability in the order they were popped (a
    parent before its children). The frontier holds each popped node's first child and next
    sibling, so every candidate is scored once: O(budget log budget)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    parents: list[int] = []
    picks: list[tuple[int, int]] = []
    if not logps or not logps[0]:
        return parents, picks
    frontier = [(-logps[0][0], 0, 0, 0)]          # (-score, parent node, depth, rank)
    while frontier and len(parents) < budget:
        neg, parent, d, r = heapq.heappop(frontier)
        parents.append(parent)
        picks.append((d, r))
        node = len(parents)
        if r + 1 < len(logps[d]):
            heapq.heappush(frontier, (neg + logps[d][r] - logps[d][r + 1], parent, d, r + 1))
        if d + 1 < len(logps) and logps[d + 1]:
            heapq.heappush(frontier, (neg - logps[d + 1][0], node, d + 1, 0))
    return parents, picks
