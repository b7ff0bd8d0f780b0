"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded."""
from __future__ import annotations

import torch

from .config import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row [B, V]; the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches p (Holtzman et al. 2020).

    A token is dropped when the mass of the tokens strictly more likely than it already
    reaches p; the most likely token is always kept.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] logits -> [B, V] the distribution the sampler draws from (temperature > 0)."""
    logits = logits.float() / params.temperature
    logits = apply_top_p(apply_top_k(logits, params.top_k), params.top_p)
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] logits -> [B] next token ids. temperature 0 is argmax."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A torch.Generator seeded with ``seed`` (None: use the global RNG)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)
