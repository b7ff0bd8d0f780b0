"""Chapter 06b checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import heapq

import torch
from lab_checks import checker_tests

from minillm.labs import ch06b
from minillm.labs.solutions.ch06b import (
    best_first_tree,
    block_mask,
    fill_budget,
)

# --- wrong solutions -----------------------------------------------------------------------


def breadth_first_tree(logps, budget):
    """Level by level: every node of depth d (best first) before any of depth d + 1, as a tree
    of per-depth top-k expansions would; never goes deep when the drafter is sure."""
    parents, picks, level = [], [], [(0.0, 0, ())]
    for d, row in enumerate(logps):
        grown = sorted(((s + lp, node, path + (r,)) for s, node, path in level
                        for r, lp in enumerate(row)), key=lambda x: -x[0])
        level = []
        for s, parent, path in grown:
            if len(parents) == budget:
                return parents, picks
            parents.append(parent)
            picks.append((d, path[-1]))
            level.append((s, len(parents), path))
    return parents, picks


def local_score_tree(logps, budget):
    """Best-first, but a node is scored by its own token's log-probability, not the path's."""
    parents, picks = [], []
    frontier = [(-logps[0][r], 0, (r,)) for r in range(len(logps[0]))] if logps else []
    heapq.heapify(frontier)
    while frontier and len(parents) < budget:
        _, parent, path = heapq.heappop(frontier)
        parents.append(parent)
        picks.append((len(path) - 1, path[-1]))
        if len(path) < len(logps):
            for r, lp in enumerate(logps[len(path)]):
                heapq.heappush(frontier, (-lp, len(parents), path + (r,)))
    return parents, picks


def equal_split(confidences, budget):
    """The budget shared out evenly (round robin), whatever the confidences."""
    keep = [0] * len(confidences)
    while budget > 0 and any(k < len(c) for k, c in zip(keep, confidences)):
        for s, c in enumerate(confidences):
            if budget > 0 and keep[s] < len(c):
                keep[s] += 1
                budget -= 1
    return keep


def raw_confidence_fill(confidences, budget):
    """Greedy, in order, but by each token's own confidence instead of its prefix product."""
    keep = [0] * len(confidences)
    for _ in range(budget):
        open_ = [s for s, c in enumerate(confidences) if keep[s] < len(c)]
        if not open_:
            break
        s = max(open_, key=lambda s: confidences[s][keep[s]])
        keep[s] += 1
    return keep


def depth_first_tree(logps, budget):
    """Expands depth first (rank 0 all the way down, then backtracks), stopping at the
    budget."""
    parents, picks = [], []

    def grow(parent, d):
        for r in range(len(logps[d])):
            if len(parents) == budget:
                return
            parents.append(parent)
            picks.append((d, r))
            if d + 1 < len(logps):
                grow(len(parents), d + 1)

    if logps:
        grow(0, 0)
    return parents, picks


def budget_by_own_confidence(confidences, budget):
    """Every drafted token of the batch ranked by its own confidence, the top ``budget``
    kept, as if a token could be verified without the ones before it (a sequence then keeps
    as many leading tokens as it had picked)."""
    ranked = sorted(((c, s) for s, conf in enumerate(confidences) for c in conf),
                    reverse=True)[:budget]
    keep = [0] * len(confidences)
    for _, s in ranked:
        keep[s] += 1
    return keep


def block_mask_with_anchor_row(t, anchors, s):
    """A block also sees the context row at its anchor's own position (one row too many:
    serving has no such row yet)."""
    mask = block_mask(t, anchors, s)
    for b, a in enumerate(anchors):
        mask[t + b * s:t + (b + 1) * s, a] = True
    return mask


def block_mask_causal_blocks(t, anchors, s):
    """Blocks attend causally inside themselves instead of in both directions."""
    mask = block_mask(t, anchors, s)
    for b in range(len(anchors)):
        rows = slice(t + b * s, t + (b + 1) * s)
        mask[rows, rows] = torch.ones(s, s, dtype=torch.bool).tril()
    return mask


def block_mask_causal_context(t, anchors, s):
    """Context rows attend causally (harmless to the blocks' outputs, but not the rule)."""
    mask = block_mask(t, anchors, s)
    mask[:t, :t] = torch.ones(t, t, dtype=torch.bool).tril()
    return mask


CHECKS = [
    (ch06b.check_block_mask, block_mask, block_mask_with_anchor_row),
    (ch06b.check_block_mask, block_mask, block_mask_causal_blocks),
    (ch06b.check_block_mask, block_mask, block_mask_causal_context),
    (ch06b.check_best_first_tree, best_first_tree, breadth_first_tree),
    (ch06b.check_best_first_tree, best_first_tree, local_score_tree),
    (ch06b.check_best_first_tree_in_engine, best_first_tree, breadth_first_tree),
    (ch06b.check_best_first_tree_in_engine, best_first_tree, depth_first_tree),
    (ch06b.check_fill_budget, fill_budget, equal_split),
    (ch06b.check_fill_budget, fill_budget, raw_confidence_fill),
    (ch06b.check_fill_budget_in_engine, fill_budget, budget_by_own_confidence),
    (ch06b.check_fill_budget_in_engine, fill_budget, equal_split),
]
IDS = ["mask-anchor_row", "mask-causal_blocks", "mask-causal_context", "tree-breadth_first",
       "tree-local_score", "engine_tree-breadth_first", "engine_tree-depth_first",
       "budget-equal_split", "budget-raw_confidence", "engine_budget-own_confidence",
       "engine_budget-equal_split"]
test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = checker_tests(CHECKS, IDS)


def test_a_tree_in_another_parents_first_order_passes():
    """The checker compares node sets: listing the package's tree level by level passes."""
    def reordered(logps, budget):
        parents, picks = best_first_tree(logps, budget)
        order = sorted(range(len(picks)), key=lambda i: (picks[i][0], i))
        new = {old + 1: new + 1 for new, old in enumerate(order)}
        return [new.get(parents[i], 0) for i in order], [picks[i] for i in order]

    assert ch06b.check_best_first_tree(reordered).passed is True


def test_a_child_before_its_parent_fails():
    def reversed_tree(logps, budget):
        parents, picks = best_first_tree(logps, budget)
        n = len(parents)
        return [n + 1 - p if p else 0 for p in parents[::-1]], picks[::-1]

    result = ch06b.check_best_first_tree(reversed_tree)
    assert result.passed is False and "before its child" in result.message


def test_an_unspent_budget_fails():
    result = ch06b.check_fill_budget(lambda conf, budget: [min(1, len(c)) for c in conf])
    assert result.passed is False


def test_expected_accepted_is_the_sum_of_prefix_products():
    assert abs(ch06b.expected_accepted([[0.5, 0.5], [0.8]], [2, 1]) - (0.5 + 0.25 + 0.8)) < 1e-12
    assert ch06b.best_fill([[0.5, 0.5], [0.8]], 2) == 0.5 + 0.8


def test_an_overspent_budget_fails_in_the_engine():
    result = ch06b.check_fill_budget_in_engine(lambda conf, budget: [len(c) for c in conf])
    assert result.passed is False and "tokens at most in all" in result.message


def test_the_package_tree_passes_through_the_adapter_in_another_order():
    """Any parents-first order of the same nodes serves the same acceptance."""
    def level_order(logps, budget):
        parents, picks = best_first_tree(logps, budget)
        order = sorted(range(len(picks)), key=lambda i: (picks[i][0], i))
        new = {old + 1: new + 1 for new, old in enumerate(order)}
        return [new.get(parents[i], 0) for i in order], [picks[i] for i in order]

    assert ch06b.check_best_first_tree_in_engine(level_order).passed is True
