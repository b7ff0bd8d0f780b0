"""Verification rules of speculative decoding against exact distributions, and prompt lookup.

The lossless rules are checked by sampling: over many rounds the emitted tokens must follow the
target's distributions (total-variation distance within a few standard errors of 0), whatever
the drafter's distributions are, and a plausible wrong rule (accept with p/q, then draw from p
instead of the residual) must fail the same check.
"""
from __future__ import annotations

import pytest
import torch

from minillm.spec_decode import (
    greedy_accept,
    greedy_tree_accept,
    prompt_lookup,
    rejection_accept,
    residual,
    tree_accept,
)

V = 6
ROUNDS = 20_000


def dist(seed: int, sharp: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g, dtype=torch.float64) * sharp).softmax(-1)


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def wrong_accept(draft, q, p, generator=None):
    """Accept with p/q, but on a rejection draw from p itself: biased toward q's choices."""
    for i, d in enumerate(draft):
        if float(torch.rand((), generator=generator)) * q[i, d] < p[i, d]:
            continue
        return i, int(torch.multinomial(p[i], 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def first_tokens(rule, p: torch.Tensor, q: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """Counts of the first emitted token over ROUNDS rounds: draft k tokens from q (the same
    q and p at every position), verify with ``rule``."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, dtype=torch.float64)
    qs, ps = q.expand(k, V), p.expand(k + 1, V)
    for _ in range(ROUNDS):
        draft = torch.multinomial(q, k, replacement=True, generator=g).tolist()
        a, token = rule(draft, qs, ps, g)
        counts[draft[0] if a > 0 else token] += 1
    return counts


def test_greedy_keeps_the_agreeing_prefix():
    assert greedy_accept([4, 5, 6], [4, 5, 1, 9]) == (2, 1)
    assert greedy_accept([4, 5], [4, 5, 7]) == (2, 7)            # all kept + the bonus token
    assert greedy_accept([3], [4, 0]) == (0, 4)
    with pytest.raises(ValueError, match="target_argmax"):
        greedy_accept([1, 2], [1, 2])


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_is_lossless_and_a_biased_rule_is_not(k):
    """Target p, drafter q far from it: the first token follows p; the wrong rule does not.
    The standard error of the TV estimate at 20,000 rounds over 6 tokens is about 0.004."""
    p, q = dist(1), dist(2, sharp=3.0)
    assert tv(first_tokens(rejection_accept, p, q, k, seed=k), p) < 0.015
    assert tv(first_tokens(wrong_accept, p, q, k, seed=k), p) > 0.05


def test_accepted_count_matches_the_formula():
    """Per position, a draft from q survives with probability sum_x min(p, q) (Leviathan's
    alpha); the mean accepted length of a k-chain is (1 - alpha^(k+1)) / (1 - alpha) - 1."""
    p, q, k = dist(3), dist(4), 4
    alpha = float(torch.minimum(p, q).sum())
    g = torch.Generator().manual_seed(0)
    total = 0
    for _ in range(ROUNDS):
        draft = torch.multinomial(q, k, replacement=True, generator=g).tolist()
        total += rejection_accept(draft, q.expand(k, V), p.expand(k + 1, V), g)[0]
    want = (1 - alpha ** (k + 1)) / (1 - alpha) - 1
    assert abs(total / ROUNDS - want) < 0.05


def test_the_second_token_is_lossless_too():
    """Generate two tokens by rounds of a 2-token chain whose target changes with the first
    token (p2 depends on it): the joint distribution of the pair equals the target's."""
    p1 = dist(5)
    p2 = torch.stack([dist(10 + t) for t in range(V)])        # row t: after first token t
    q1, q2 = dist(6, 2.0), dist(7, 2.0)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(ROUNDS):
        d = [int(torch.multinomial(q1, 1, generator=g)), int(torch.multinomial(q2, 1,
                                                                              generator=g))]
        a, tok = rejection_accept(d, torch.stack([q1, q2]),
                                  torch.stack([p1, p2[d[0]], p2[d[1]]]), g)
        first = d[0] if a > 0 else tok
        second = d[1] if a > 1 else tok if a == 1 else int(torch.multinomial(
            p2[first], 1, generator=g))                        # the next round's first token
        counts[first, second] += 1
    joint = p1[:, None] * p2
    assert tv(counts.flatten(), joint.flatten()) < 0.03


def test_tree_verification_is_lossless():
    """Three children of the root drawn independently from q: the first emitted token follows
    p; a single child accepted without the residual update would not."""
    p, q = dist(8), dist(9, sharp=3.0)
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(ROUNDS):
        kids = torch.multinomial(q, 3, replacement=True, generator=g).tolist()
        tokens = [0] + kids
        path, tok = tree_accept({0: [1, 2, 3]}, tokens, torch.stack([q] * 4),
                                torch.stack([p] * 4), g)
        counts[tokens[path[0]] if path else tok] += 1
    assert tv(counts, p) < 0.015


def test_residual():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual(p, p), p)


def test_prompt_lookup_copies_the_continuation_of_the_latest_match():
    seq = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert prompt_lookup(seq, k=2) == [2, 3]                  # "5 6 7" last seen before "2 3"
    assert prompt_lookup(seq, k=5, max_n=1) == [2, 3, 5, 6, 7][:5]   # "7" last before "2"
    assert prompt_lookup([1, 2, 3, 4], k=3) == []
    with pytest.raises(ValueError, match="k must be"):
        prompt_lookup(seq, k=0)


# ---- the token after a fully accepted draft ------------------------------------------------
def one_hot(token: int) -> torch.Tensor:
    out = torch.zeros(V, dtype=torch.float64)
    out[token] = 1.0
    return out


def mirrored(row: torch.Tensor) -> torch.Tensor:
    """``row``'s probabilities in reverse token order, sharpened: a distribution far from it
    (the tests assert how far)."""
    r = row.flip(0).pow(4)
    return r / r.sum()


def test_the_bonus_token_after_a_whole_chain_comes_from_the_last_row():
    """One-hot target rows and q == p on the draft rows: the chain is always accepted and the
    bonus token is exactly p[k]'s token, for every chain length k (rows k - 1 and k differ)."""
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3, 5):
        want = [(2 * i + 1) % V for i in range(k + 1)]          # consecutive rows differ
        p = torch.stack([one_hot(t) for t in want])
        assert rejection_accept(want[:k], p[:k], p, g) == (k, want[k])
        assert greedy_accept(want[:k], want) == (k, want[k])


@pytest.mark.parametrize("k", [2, 4])
def test_the_bonus_token_follows_the_last_row_in_distribution(k):
    """q == p on the draft rows (always accepted); p[k] puts its mass where p[k - 1] has almost
    none: over 4,000 rounds the bonus tokens follow p[k] (TV within 0.05; standard error about
    0.01), and are far from p[k - 1]."""
    rows = [dist(20 + i, sharp=2.0) for i in range(k)]
    p = torch.stack(rows + [mirrored(rows[-1])])
    assert 0.5 * float((p[k] - p[k - 1]).abs().sum()) > 0.5
    g = torch.Generator().manual_seed(k)
    counts = torch.zeros(V, dtype=torch.float64)
    drafts = torch.multinomial(p[:k], 4000, replacement=True, generator=g).T.tolist()
    for draft in drafts:
        a, token = rejection_accept(draft, p[:k], p, g)
        assert a == k
        counts[token] += 1
    assert tv(counts, p[k]) < 0.05
    assert tv(counts, p[k - 1]) > 0.4


# A tree whose accepted path runs 0 -> 2 -> 5 -> 6: node ids are not depths, and every node on
# the way has a sibling that is not taken.
TREE = {0: [1, 2], 2: [3, 4, 5], 5: [6], 1: [7]}
TREE_TOKENS = [0, 1, 2, 3, 4, 5, 0, 3]           # token of each node


def test_tree_rules_take_the_bonus_token_from_the_last_accepted_node():
    """Target rows one-hot on the path's tokens (each node's row names its child on the path),
    and the leaf's row on a token no row before it names: both tree rules accept the whole
    path and emit the leaf's token."""
    follow = {0: 2, 2: 5, 5: 0, 6: 4}               # node -> the token the target wants next
    argmax = [follow.get(n, 1) for n in range(len(TREE_TOKENS))]
    path, token = [2, 5, 6], 4
    assert greedy_tree_accept(TREE, TREE_TOKENS, argmax) == (path, token)
    p = torch.stack([one_hot(t) for t in argmax])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert tree_accept(TREE, TREE_TOKENS, None, p, g) == (path, token)
        assert tree_accept(TREE, TREE_TOKENS, p, p, g) == (path, token)   # q == p as well


def test_tree_bonus_token_follows_the_leafs_row_in_distribution():
    """A chain tree 0 -> 1 -> 2 drafted from q == p (always accepted): over 4,000 rounds the
    token after the leaf follows p[2], far from its parent's row p[1]."""
    row = dist(30, sharp=2.0)
    p = torch.stack([one_hot(3), row, mirrored(row)])
    assert 0.5 * float((p[2] - p[1]).abs().sum()) > 0.5
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(V, dtype=torch.float64)
    for t1 in torch.multinomial(p[1], 4000, replacement=True, generator=g).tolist():
        path, token = tree_accept({0: [1], 1: [2]}, [0, 3, t1], p, p, g)
        assert path == [1, 2]
        counts[token] += 1
    assert tv(counts, p[2]) < 0.05
    assert tv(counts, p[1]) > 0.4
