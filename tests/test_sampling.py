"""Sampling filters against straightforward float64 loops, seeding, and parameter errors."""
from __future__ import annotations

import math

import pytest
import torch

from minillm import SamplingParams
from minillm.sampling import apply_top_k, apply_top_p, probabilities, sample


def ref_filter(row: list[float], k: int, p: float) -> set[int]:
    """Indices kept by top-k then top-p, written as the definitions read."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if k > 0:
        order = order[:k]
    z = [math.exp(row[i] - row[order[0]]) for i in order]
    probs = [x / sum(z) for x in z]
    kept, mass = [], 0.0
    for i, pr in zip(order, probs):
        kept.append(i)
        mass += pr
        if mass >= p:
            break
    return set(kept)


@pytest.mark.parametrize("k,p", [(0, 0.5), (5, 1.0), (10, 0.9), (0, 0.05), (3, 0.99)])
def test_filters_match_reference(k, p):
    torch.manual_seed(k)
    logits = torch.randn(4, 50, dtype=torch.float64) * 3
    kept = apply_top_p(apply_top_k(logits, k), p)
    for row, out in zip(logits, kept):
        assert set(torch.nonzero(out > float("-inf")).flatten().tolist()) == \
            ref_filter(row.tolist(), k, p)


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    assert (apply_top_p(logits, 1e-6) > float("-inf")).tolist() == [[True, False, False]]


def test_greedy_is_argmax_and_temperature_sharpens():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert sample(logits, SamplingParams(temperature=0)).item() == 1
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    cold = probabilities(logits, SamplingParams(temperature=0.5))
    assert cold[0, 1] > hot[0, 1]
    torch.testing.assert_close(hot, torch.softmax(logits / 2.0, -1))


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    params = SamplingParams(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, params, gen) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [sample(logits, params, g1).item() for _ in range(20)] == \
        [sample(logits, params, g2).item() for _ in range(20)]


@pytest.mark.parametrize("kwargs,name", [({"temperature": -0.1}, "temperature"),
                                         ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                         ({"top_k": -2}, "top_k"),
                                         ({"max_tokens": 0}, "max_tokens"),
                                         ({"temperature": float("nan")}, "temperature"),
                                         ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed")])
def test_bad_sampling_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
