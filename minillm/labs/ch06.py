"""Checkers for the exercises of chapter 06 (speculative decoding).

Each ``check_*`` compares the student's function with the package's
(:mod:`minillm.spec_decode`, the draft tree's
:meth:`~minillm.engine.sequence.Draft.tree_inputs`) or, for the sampling rule, with the target
distribution itself, prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still raises
NotImplementedError).
"""
from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ..engine.sequence import Draft
from ..spec_decode.ngram import prompt_lookup
from ..spec_decode.trees import medusa_tree, tree_parents
from ..spec_decode.verify import greedy_accept
from .common import Result, check


def check_greedy_accept(fn: Callable) -> Result:
    """``fn(draft, target_argmax)`` -> (accepted count a, next token): the longest prefix of
    ``draft`` (k tokens) that equals the target's argmax at the same rows, and the target's own
    token after it (``target_argmax`` has k + 1 entries). Compared with
    :func:`minillm.spec_decode.greedy_accept`."""
    rng = random.Random(0)
    cases = [([], [7]), ([5], [5, 9]), ([5], [4, 9]), ([1, 2, 3], [1, 2, 3, 4]),
             ([1, 2, 3], [1, 9, 3, 4]), ([1, 2, 3], [9, 2, 3, 4])]
    for _ in range(60):
        k = rng.randint(0, 7)
        target = [rng.randint(0, 4) for _ in range(k + 1)]
        draft = [t if rng.random() < 0.7 else rng.randint(0, 4) for t in target[:k]]
        cases.append((draft, target))

    def attempt() -> None:
        for draft, target in cases:
            got = fn(list(draft), list(target))
            want = greedy_accept(draft, target)
            assert tuple(int(x) for x in got) == want, (f"draft={draft}, target_argmax={target}: "
                                                        f"got {tuple(got)}, expected {want}")

    return check("greedy_accept", attempt)


# --- the lossless sampling step --------------------------------------------------------------

DISTRIBUTIONS = [      # (p, q): target and drafter over a 6-token vocabulary
    ([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], [0.05, 0.10, 0.15, 0.20, 0.20, 0.30]),
    ([0.50, 0.00, 0.20, 0.15, 0.15, 0.00], [0.20, 0.40, 0.00, 0.10, 0.10, 0.20]),
]


def emitted_distribution(step: Callable, p, q, rounds: int = 20_000, seed: int = 0
                         ) -> torch.Tensor:
    """Run ``step(d, q, p, u, generator)`` ``rounds`` times with d ~ q and u ~ U(0, 1); the
    empirical distribution [V] of the token it emits."""
    p = torch.as_tensor(p, dtype=torch.float64)
    q = torch.as_tensor(q, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, rounds, replacement=True, generator=g).tolist()
    us = torch.rand(rounds, generator=g, dtype=torch.float64).tolist()
    counts = torch.zeros(len(p), dtype=torch.float64)
    for d, u in zip(drafts, us):
        _, token = step(d, q, p, u, g)
        counts[int(token)] += 1
    return counts / rounds


def tv_tolerance(p, rounds: int, sigmas: float = 4.0) -> float:
    """About ``sigmas`` standard errors of the total variation distance between p and an
    empirical distribution of ``rounds`` samples from it: sigmas/2 * sum_i sqrt(p_i (1-p_i)/n)."""
    p = torch.as_tensor(p, dtype=torch.float64)
    return sigmas / 2 * float((p * (1 - p) / rounds).sqrt().sum())


def check_rejection_step(fn: Callable, rounds: int = 20_000) -> Result:
    """``fn(draft_token, q, p, u, generator)`` -> (accepted, token): one step of lossless
    speculative sampling. Keep the draft d (sampled from q) when u * q[d] < p[d] (u < p/q); else
    draw from the residual max(0, p - q), renormalised, with
    ``torch.multinomial(residual, 1, generator=generator)``.

    First exact cases (the accept decision, the token on acceptance, no residual token where
    p <= q), then the distribution test: the emitted token over ``rounds`` steps with d ~ q must
    be within about 4 standard errors (total variation) of p."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(1)
        p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
        q = torch.tensor([0.4, 0.4, 0.1, 0.1], dtype=torch.float64)
        for d, u in [(0, 0.2), (0, 0.3), (1, 0.45), (1, 0.55), (2, 0.99), (3, 0.0)]:
            want = bool(u * q[d] < p[d])
            accepted, token = fn(d, q.clone(), p.clone(), u, g)
            assert bool(accepted) == want, (f"p={p.tolist()}, q={q.tolist()}, draft {d}, "
                                            f"u={u}: accepted={bool(accepted)}, expected {want} "
                                            f"(p/q = {float(p[d] / q[d]):.3g})")
            if want:
                assert int(token) == d, (f"draft {d} accepted (u={u}) but the token emitted is "
                                         f"{int(token)}, not the draft")
            else:
                assert p[int(token)] > q[int(token)], (
                    f"draft {d} rejected (u={u}); the correction {int(token)} has p <= q there "
                    f"(p={float(p[int(token)]):.2f}, q={float(q[int(token)]):.2f}): it must "
                    f"come from the residual max(0, p - q)")
        for p, q in DISTRIBUTIONS:
            emp = emitted_distribution(fn, p, q, rounds)
            tv = 0.5 * float((emp - torch.tensor(p, dtype=torch.float64)).abs().sum())
            tol = tv_tolerance(p, rounds)
            assert tv <= tol, (f"p={p}, q={q}: over {rounds} steps the emitted tokens' "
                               f"distribution {[round(x, 3) for x in emp.tolist()]} is "
                               f"{tv:.3f} from p in total variation (tolerance {tol:.3f}): the "
                               f"output is not distributed as the target")

    return check("rejection_step", attempt)


def check_prompt_lookup(fn: Callable) -> Result:
    """``fn(tokens, k, max_n)`` -> up to k drafted tokens: the continuation of the most recent
    earlier occurrence of the last n tokens, for n = max_n down to 1; [] when none occurs.
    Compared with :func:`minillm.spec_decode.prompt_lookup` on crafted and random sequences."""
    rng = random.Random(0)
    cases = [([1], 3, 2), ([1, 2, 3, 4], 3, 2), ([1, 2, 3, 1, 2], 3, 2),
             ([1, 2, 3, 1, 2, 4, 1, 2], 3, 2),       # the most recent occurrence wins
             ([5, 1, 9, 7, 1, 2, 6, 6, 7, 1, 2], 4, 3),
             ([7, 1, 2, 8, 3, 1, 2, 4, 7, 1, 2], 2, 3),   # the longest n first, even far back
             ([3, 3, 3, 3], 5, 2)]                    # the continuation runs into the tail
    for _ in range(150):
        n = rng.randint(1, 30)
        vocab = rng.choice([2, 3, 5, 8])
        cases.append(([rng.randrange(vocab) for _ in range(n)], rng.randint(1, 6),
                      rng.randint(1, 4)))

    def attempt() -> None:
        for tokens, k, max_n in cases:
            got = [int(t) for t in fn(list(tokens), k, max_n)]
            want = prompt_lookup(tokens, k, max_n)
            assert got == want, (f"tokens={tokens}, k={k}, max_n={max_n}: got {got}, "
                                 f"expected {want}")

    return check("prompt_lookup", attempt)


def check_tree_mask(fn: Callable) -> Result:
    """``fn(parents)`` -> bool mask [N + 1, N + 1] of a draft tree (node 0 the root, node i + 1
    with parent ``parents[i]`` < i + 1): True where row i may attend to column j, i.e. j is i
    itself or one of its ancestors. Compared with
    :meth:`minillm.engine.sequence.Draft.tree_inputs`."""
    rng = random.Random(0)
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1], [0.2]]
    cases = [[], [0], [0, 1, 2, 3], [0, 0, 0], [0, 0, 1, 1, 2], tree_parents(medusa_tree(acc, 12))]
    for _ in range(30):
        n = rng.randint(1, 20)
        cases.append([rng.randint(max(0, i - 3), i) for i in range(n)])

    def attempt() -> None:
        for parents in cases:
            got = torch.as_tensor(fn(list(parents))).bool()
            want = torch.tensor(Draft([0] * len(parents), list(parents)).tree_inputs(0)[0])
            assert got.shape == want.shape, (f"parents={parents}: mask shape {tuple(got.shape)}, "
                                             f"expected {tuple(want.shape)}")
            bad = (got != want).nonzero().tolist()
            assert not bad, (f"parents={parents}: wrong at (row, column) {bad[0]}: got "
                             f"{bool(got[tuple(bad[0])])}, expected {bool(want[tuple(bad[0])])}")

    return check("tree_mask", attempt)


__all__ = ["check_greedy_accept", "check_prompt_lookup", "check_rejection_step",
           "check_tree_mask", "emitted_distribution", "tv_tolerance"]
