"""Chapter 06 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm import SamplingParams
from minillm.labs import ch06
from minillm.labs.solutions.ch06 import (
    greedy_accept,
    prompt_lookup,
    rejection_step,
    tree_mask,
    ttt_mask,
)
from minillm.spec_decode.speculator import build_speculator

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


def lookup_matching_the_tail(tokens, k, max_n):
    """Searches from the end including the tail itself, which always matches and has nothing
    after it: it never proposes anything."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n, -1, -1):
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


def mask_causal(parents):
    """The chain's causal mask: every node sees all nodes before it, its siblings included."""
    n = len(parents) + 1
    return torch.ones(n, n, dtype=torch.bool).tril()


def ttt_causal_over_steps(step, t):
    """Every step's rows up to the query's position: later steps see the whole chain of the
    other drafts too, as a plain causal mask over the stacked steps would allow."""
    s = torch.arange(t)[None]
    q = torch.arange(t)[:, None]
    return torch.cat([s <= q - (step - 1)] + [s <= q - (step - i) for i in range(2, step + 1)], 1)


def ttt_unshifted_context(step, t):
    """The committed context not shifted back: a step-j row also sees step-1 rows the draft
    has not reached yet."""
    s = torch.arange(t)[None]
    q = torch.arange(t)[:, None]
    return torch.cat([s <= q] + [s == q - (step - i) for i in range(2, step + 1)], 1)


CHECKS = [
    (ch06.check_greedy_accept, greedy_accept, greedy_count_matches),
    (ch06.check_rejection_step, rejection_step, rejection_resample_from_p),
    (ch06.check_rejection_in_engine, rejection_step, rejection_resample_from_p),
    (ch06.check_prompt_lookup, prompt_lookup, lookup_oldest_first),
    (ch06.check_prompt_lookup_in_engine, prompt_lookup, lookup_matching_the_tail),
    (ch06.check_prompt_lookup_in_engine, prompt_lookup, lookup_oldest_first),
    (ch06.check_tree_mask, tree_mask, mask_parent_only),
    (ch06.check_tree_mask_in_engine, tree_mask, mask_parent_only),
    (ch06.check_tree_mask_in_engine, tree_mask, mask_causal),
    (ch06.check_ttt_mask, ttt_mask, ttt_causal_over_steps),
    (ch06.check_ttt_mask, ttt_mask, ttt_unshifted_context),
]
IDS = ["greedy_accept", "rejection_step", "engine_rejection_resamples_p", "prompt_lookup",
       "engine_lookup_matches_the_tail", "engine_lookup_oldest_first", "tree_mask",
       "engine_mask_parent_only", "engine_mask_causal", "ttt_causal_over_steps",
       "ttt_unshifted_context"]
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


def test_a_lookup_that_never_drafts_keeps_the_tokens_but_not_the_acceptance():
    result = ch06.check_prompt_lookup_in_engine(lookup_matching_the_tail)
    assert result.passed is False and "made 0 drafts" in result.message


def test_a_wrong_tree_mask_changes_the_engine_output():
    result = ch06.check_tree_mask_in_engine(mask_causal)
    assert result.passed is False and "request" in result.message


def test_the_engine_rule_draws_from_the_request_generator():
    """Seeded requests: the same rule gives the same tokens twice; exact distribution sums
    to 1 (float32 probabilities) over top_k ** positions outcomes at most."""
    model = ch06.sampling_model()
    prompt = list(range(5, 13))
    params = SamplingParams(temperature=1.0, top_k=2)
    exact = ch06.first_tokens_distribution(model, prompt, params, 2)
    assert abs(sum(exact.values()) - 1) < 1e-6 and len(exact) <= 4
    runs = []
    for _ in range(2):
        engine = ch06.sampling_engine(model, len(prompt), 2)
        base = build_speculator({"method": "draft_model", "num_speculative_tokens": 2}, engine,
                                drafter=ch06.first_layer_drafter(model))
        engine.use_speculator(ch06.StepVerify(rejection_step, base))
        runs.append(ch06.sample_first_tokens(engine, prompt, params, 40, 2)[0])
    assert runs[0] == runs[1] and sum(runs[0].values()) == 40


def test_a_rule_that_always_accepts_fails_in_the_engine():
    result = ch06.check_rejection_in_engine(lambda d, q, p, u, g: (True, d))
    assert result.passed is False and "total variation" in result.message
