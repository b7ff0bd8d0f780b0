"""Chapter 06 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import ch06
from minillm.labs.solutions.ch06 import (
    greedy_accept,
    prompt_lookup,
    rejection_step,
    tree_mask,
)

# --- wrong solutions -----------------------------------------------------------------------


def greedy_count_matches(draft, target_argmax):
    """Counts every match, not the prefix up to the first mismatch."""
    a = sum(d == t for d, t in zip(draft, target_argmax))
    return a, target_argmax[a]


def rejection_resample_from_p(draft_token, q, p, u, generator):
    """Right accept rule, but a rejection redraws from p itself: biased toward tokens q likes."""
    if u * q[draft_token] < p[draft_token]:
        return True, draft_token
    return False, int(torch.multinomial(p, 1, generator=generator))


def lookup_oldest_first(tokens, k, max_n):
    """Takes the earliest occurrence instead of the most recent."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def mask_parent_only(parents):
    """Each node sees itself and its parent, not all its ancestors."""
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        mask[i, p] = True
    return mask


CHECKS = [
    (ch06.check_greedy_accept, greedy_accept, greedy_count_matches),
    (ch06.check_rejection_step, rejection_step, rejection_resample_from_p),
    (ch06.check_prompt_lookup, prompt_lookup, lookup_oldest_first),
    (ch06.check_tree_mask, tree_mask, mask_parent_only),
]
IDS = ["greedy_accept", "rejection_step", "prompt_lookup", "tree_mask"]
test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = checker_tests(CHECKS, IDS)


def rejection_masked_p(draft_token, q, p, u, generator):
    """Rejection draws from p restricted to the tokens where p > q: the right support, the
    wrong weights (p instead of p - q)."""
    if u * q[draft_token] < p[draft_token]:
        return True, draft_token
    masked = torch.where(p > q, p, torch.zeros_like(p))
    return False, int(torch.multinomial(masked / masked.sum(), 1, generator=generator))


def test_biased_sampler_fails():
    assert ch06.check_rejection_step(rejection_resample_from_p).passed is False


def test_only_the_distribution_test_catches_a_subtle_bias():
    """Every exact case passes (right accept rule, corrections where p > q); the distribution
    test catches it."""
    result = ch06.check_rejection_step(rejection_masked_p)
    assert result.passed is False and "total variation" in result.message


def test_tolerance_separates_right_and_biased():
    for p, q in ch06.DISTRIBUTIONS:
        tol = ch06.tv_tolerance(p, 20_000)
        p_t = torch.tensor(p, dtype=torch.float64)
        good = ch06.emitted_distribution(rejection_step, p, q, 20_000, seed=3)
        bad = ch06.emitted_distribution(rejection_resample_from_p, p, q, 20_000, seed=3)
        assert 0.5 * (good - p_t).abs().sum() < tol / 2
        assert 0.5 * (bad - p_t).abs().sum() > 2 * tol


def test_always_accepting_fails():
    result = ch06.check_rejection_step(lambda d, q, p, u, g: (True, d))
    assert result.passed is False
