"""Checkers for the exercises of chapter 06b (block drafting: DFlash, DDTree, DSpark).

Each ``check_*`` compares the student's function with the package's
(:func:`minillm.spec_decode.trees.best_first_tree`, :func:`minillm.spec_decode.blocks.fill_budget`)
and, for the budget, with a brute-force search; prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still raises
NotImplementedError).
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

from ..spec_decode.blocks import fill_budget
from ..spec_decode.trees import best_first_tree
from .common import Result, check

# --- DDTree: the best-first tree under a node budget -------------------------------------------


def rank_paths(parents, picks) -> list[tuple[int, ...]]:
    """The rank path (rank chosen at depth 0, 1, ...) of every node of a tree given as
    (parents, picks): node i + 1 sits under ``parents[i]`` (0: the root) and holds the candidate
    ``picks[i]`` = (depth, rank)."""
    paths: list[tuple[int, ...]] = []
    for p, (_, r) in zip(parents, picks):
        paths.append((paths[p - 1] if p else ()) + (int(r),))
    return paths


def path_logp(logps, path) -> float:
    """A node's score: the sum of its tokens' log-probabilities along the path."""
    return sum(logps[d][r] for d, r in enumerate(path))


def _random_logps(rng: random.Random, depth: int, k: int) -> list[list[float]]:
    """depth rows of k candidate log-probabilities, best first (the top-k of a random
    distribution, so a row sums to at most 1)."""
    rows = []
    for _ in range(depth):
        w = [rng.random() ** rng.choice([1, 3, 8]) for _ in range(k + rng.randint(0, 3))]
        total = sum(w)
        rows.append(sorted((math.log(x / total) for x in w), reverse=True)[:k])
    return rows


def _tree_cases() -> list[tuple[list[list[float]], int]]:
    sure = [math.log(0.9), math.log(0.05), math.log(0.03)]
    unsure = [math.log(0.55), math.log(0.4)]
    cases = [([sure] * 5, 5),                 # a confident drafter: the chain first, deep
             ([unsure] + [sure] * 4, 8),      # unsure at depth 0: both branches, deep
             ([sure, unsure, sure, sure], 7),
             ([unsure] * 3, 20),              # more budget than the 14 possible nodes
             ([sure] * 3, 1), ([[math.log(0.7)]], 3), ([], 4)]
    rng = random.Random(0)
    for _ in range(120):
        cases.append((_random_logps(rng, rng.randint(1, 7), rng.randint(1, 4)),
                      rng.randint(1, 24)))
    return cases


def check_best_first_tree(fn: Callable) -> Result:
    """``fn(logps, budget)`` -> (parents, picks): DDTree's tree. ``logps[d]`` holds depth d's
    candidate log-probabilities, best first; a node is a path of ranks from the root, scored
    by the sum of its log-probabilities; the tree is the ``budget`` nodes of highest score
    (fewer if there are fewer), each listed after its parent; ``parents[i]`` is node i + 1's
    parent (0: the root) and ``picks[i]`` its (depth, rank). Any parents-first order passes;
    the set of nodes must be the package's :func:`minillm.spec_decode.trees.best_first_tree`."""
    cases = _tree_cases()

    def attempt() -> None:
        for logps, budget in cases:
            want_parents, want_picks = best_first_tree(logps, budget)
            want = set(rank_paths(want_parents, want_picks))
            got_parents, got_picks = fn([list(r) for r in logps], budget)
            got_parents = [int(p) for p in got_parents]
            got_picks = [(int(d), int(r)) for d, r in got_picks]
            case = f"logps={[[round(x, 3) for x in r] for r in logps]}, budget={budget}"
            assert len(got_parents) == len(got_picks), (
                f"{case}: {len(got_parents)} parents but {len(got_picks)} picks")
            for i, (p, (d, r)) in enumerate(zip(got_parents, got_picks)):
                assert 0 <= p <= i, (f"{case}: node {i + 1}'s parent is {p}; a parent must "
                                     f"come before its child (0 <= parent <= {i})")
                pd = got_picks[p - 1][0] if p else -1
                assert d == pd + 1, (f"{case}: node {i + 1} is at depth {d} but its parent "
                                     f"{p} is at depth {pd}")
                assert 0 <= d < len(logps) and 0 <= r < len(logps[d]), (
                    f"{case}: node {i + 1} picks (depth {d}, rank {r}), no such candidate")
            paths = rank_paths(got_parents, got_picks)
            assert len(set(paths)) == len(paths), f"{case}: a node appears twice"
            assert len(paths) == len(want), (f"{case}: {len(paths)} nodes, expected "
                                             f"{len(want)}")
            extra = sorted(set(paths) - want, key=lambda q: -path_logp(logps, q))
            if extra:
                missing = sorted(want - set(paths), key=lambda q: -path_logp(logps, q))
                raise AssertionError(
                    f"{case}: node with ranks {extra[0]} (path log-prob "
                    f"{path_logp(logps, extra[0]):.3f}) is in your tree, but {missing[0]} "
                    f"({path_logp(logps, missing[0]):.3f}) scores higher and is not")

    return check("best_first_tree", attempt)


# --- DSpark: the shared verification budget -------------------------------------------------


def expected_accepted(confidences, lengths) -> float:
    """Expected accepted draft tokens when sequence s verifies its first ``lengths[s]`` tokens:
    the sum over kept tokens of their prefix probabilities prod_{j<=i} c[s][j]."""
    return sum(math.prod(c[:j + 1]) for c, n in zip(confidences, lengths) for j in range(n))


def best_fill(confidences, budget: int) -> float:
    """Brute force: the largest expected accepted count of any lengths within the budget."""
    best = 0.0
    for lens in itertools.product(*[range(len(c) + 1) for c in confidences]):
        if sum(lens) <= budget:
            best = max(best, expected_accepted(confidences, lens))
    return best


def _budget_cases() -> list[tuple[list[list[float]], int]]:
    cases = [([[0.9, 0.9, 0.9, 0.9], [0.1, 0.1, 0.1, 0.1]], 4),   # not an equal split
             ([[0.8, 0.8, 0.8], [0.6, 0.99, 0.99]], 3),        # prefix products, not raw
             ([[0.5, 0.99, 0.99, 0.99], [0.7, 0.3]], 4),
             ([[0.9, 0.2], [], [0.6]], 5),                        # more budget than tokens
             ([[0.9, 0.8]], 0), ([], 3), ([[0.3], [0.4], [0.5]], 2)]
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 4)
        conf = [[rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(rng.randint(0, 5))]
                for _ in range(n)]
        cases.append((conf, rng.randint(0, 12)))
    return cases


def check_fill_budget(fn: Callable) -> Result:
    """``fn(confidences, budget)`` -> how many leading draft tokens each sequence verifies.
    ``confidences[s][i]``: P(token i of sequence s is accepted | those before it were); a
    sequence's tokens are kept in order; at most ``budget`` in all, and all of them when there
    are fewer. Passing answers maximise the expected number of accepted tokens (checked by
    brute force and against :func:`minillm.spec_decode.blocks.fill_budget`)."""
    cases = _budget_cases()

    def attempt() -> None:
        for conf, budget in cases:
            case = f"confidences={[[round(x, 3) for x in c] for c in conf]}, budget={budget}"
            got = [int(n) for n in fn([list(c) for c in conf], budget)]
            assert len(got) == len(conf), (f"{case}: {len(got)} lengths for {len(conf)} "
                                           f"sequences")
            for s, (n, c) in enumerate(zip(got, conf)):
                assert 0 <= n <= len(c), (f"{case}: sequence {s} keeps {n} tokens, it has "
                                          f"{len(c)}")
            total = min(budget, sum(len(c) for c in conf))
            assert sum(got) == total, (f"{case}: got {got}, {sum(got)} tokens in all; the "
                                       f"budget allows {total} and every kept token adds to "
                                       f"the expected count")
            value, best = expected_accepted(conf, got), best_fill(conf, budget)
            want = fill_budget(conf, budget)
            assert value >= best - 1e-9, (
                f"{case}: got {got}, expected accepted tokens {value:.4f}; the best is "
                f"{best:.4f} (the package's fill_budget gives {want}, "
                f"{expected_accepted(conf, want):.4f})")

    return check("fill_budget", attempt)


__all__ = ["best_fill", "check_best_first_tree", "check_fill_budget", "expected_accepted",
           "path_logp", "rank_paths"]
