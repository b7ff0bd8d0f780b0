"""Workloads: what requests a run sends, and when.

- :class:`Workload`: prompts (token ids) and the output length of each request;
- :func:`make_workload`: seeded uniform prompt and output lengths over prose (the throughput
  benchmark's 64-request workload);
- :func:`sharegpt_like_workload`: seeded lognormal lengths (a *synthetic* stand-in for
  ShareGPT's long-tailed conversation lengths) over prose;
- :func:`shared_prompt_workload`: chat requests that share system prompts (prefix caching);
- :func:`poisson_arrivals`: arrival times of a Poisson process; :func:`offered_rate`, the rate
  a list of arrivals actually offers.

:func:`minillm.driver.drive` runs a workload; :mod:`minillm.serving_metrics` measures the run.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .evaluate import sample_ids, sample_text


@dataclass(frozen=True)
class Workload:
    """``prompts[i]``: request i's prompt token ids; ``output_lens[i]``: the tokens it asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(tok, num_requests: int = 64, prompt_range=(32, 512), output_range=(32, 256),
                  seed: int = 0) -> Workload:
    """Seeded prompt and output lengths, uniform in the given ranges (inclusive). Prompts are
    prose; with ``tok`` None (random-weight runs on a GPU) they are seeded random ids."""
    rng = random.Random(seed)
    if tok is None:
        text = [rng.randrange(10, 49152) for _ in range(prompt_range[1] * 4)]
    else:
        text = sample_ids(prompt_range[1] * 4, tok)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        start = rng.randrange(0, len(text) - n)
        prompts.append(text[start:start + n])
        outs.append(rng.randint(*output_range))
    return Workload(prompts, outs)


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int,
                      rng: random.Random) -> list[int]:
    """``n`` integers from a lognormal with the given median and log-space sigma, clipped."""
    mu = math.log(median)
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def sharegpt_like_workload(tok, num_requests: int, prompt_median: float = 64,
                           output_median: float = 48, sigma: float = 0.8,
                           prompt_max: int = 256, output_max: int = 192,
                           seed: int = 0) -> Workload:
    """Synthetic long-tailed lengths (lognormal, like ShareGPT's), seeded; prompts are
    windows of English prose from :func:`minillm.evaluate.sample_ids`."""
    rng = random.Random(seed)
    p_lens = lognormal_lengths(num_requests, prompt_median, sigma, 4, prompt_max, rng)
    o_lens = lognormal_lengths(num_requests, output_median, sigma, 2, output_max, rng)
    text = sample_ids(4 * prompt_max, tok)
    starts = [rng.randrange(0, len(text) - n) for n in p_lens]
    return Workload([text[s:s + n] for s, n in zip(starts, p_lens)], o_lens)


QUESTIONS = ["What is the main idea?", "Summarise the second sentence.", "Who is speaking?",
             "List three keywords.", "What happens next?", "Is the tone formal?",
             "Translate the first line into French.", "What would you ask the author?"]


def shared_prompt_workload(tok, num_requests: int, system_tokens: int, seed: int = 0,
                           num_systems: int = 1) -> Workload:
    """System prompts of about ``system_tokens`` tokens (request i gets number
    i % num_systems), a different question each, 16 output tokens."""
    text = tok.encode(sample_text(num_systems * system_tokens + 64, tok))
    systems = [tok.decode(text[j * system_tokens:(j + 1) * system_tokens])
               for j in range(num_systems)]
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        q = f"Question {i}: {rng.choice(QUESTIONS)}"
        prompts.append(tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": systems[i % num_systems]},
             {"role": "user", "content": q}], add_generation_prompt=True)))
    return Workload(prompts, [16] * num_requests)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` requests/s; rate inf: all at 0."""
    if rate == math.inf:
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def offered_rate(arrivals: list[float]) -> float:
    """Requests/s a list of arrival times offers: (n - 1) gaps over the span they cover."""
    span = max(arrivals) - min(arrivals)
    return (len(arrivals) - 1) / span if span > 0 else math.inf


__all__ = ["QUESTIONS", "Workload", "lognormal_lengths", "make_workload", "offered_rate",
           "poisson_arrivals", "shared_prompt_workload", "sharegpt_like_workload"]
