"""Lossless speculative sampling, measured through the engine (chapter 06).

The exact distribution of the first few tokens plain sampling draws after a prompt
(:func:`first_tokens_distribution`: the target's logits with the request's temperature, top-k
and top-p, enumerated prefix by prefix), empirical counts of the same tokens from many seeded
samples through an engine (:func:`sample_first_tokens`), and their total variation distance
against the noise that the number of samples explains (:func:`tv_tolerance`).
:func:`compare_sampling` runs one prompt through the plain engine and a speculative one with the
same sampling parameters: if the verification rule is lossless, both are within the noise of the
exact distribution at every position. The chapter's checkers (:mod:`minillm.labs.ch06`) reuse
these to put a student's rule in the engine.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..engine import EngineConfig, LLMEngine
from ..engine.sampler import SamplingBatch, filtered_probs
from ..model.transformer import Transformer
from ..spec_decode.speculator import build_speculator


def tv_tolerance(p, rounds: int, sigmas: float = 4.0) -> float:
    """About ``sigmas`` standard errors of the total variation distance between p and an
    empirical distribution of ``rounds`` samples from it: sigmas/2 * sum_i sqrt(p_i (1-p_i)/n)."""
    p = torch.as_tensor(p, dtype=torch.float64)
    return sigmas / 2 * float((p * (1 - p) / rounds).sqrt().sum())


@torch.inference_mode()
def first_tokens_distribution(model: Transformer, prompt: list[int], params: SamplingParams,
                              n: int) -> dict[tuple[int, ...], float]:
    """The exact distribution of the first ``n`` tokens plain sampling draws after ``prompt``:
    {(t_1, ..., t_n): probability}, from the target's logits with the request's temperature and
    filters (the engine's :func:`~minillm.engine.sampler.filtered_probs`), one forward per
    position over every prefix of nonzero probability (keep top_k small)."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        prefixes = list(dist)
        ids = torch.tensor([prompt + list(pre) for pre in prefixes], device=model.device)
        batch = SamplingBatch.from_params([params] * len(prefixes), [None] * len(prefixes),
                                          model.device)
        probs = filtered_probs(model(ids)[:, -1], batch).double().cpu()
        dist = {pre + (t,): dist[pre] * float(probs[i, t]) for i, pre in enumerate(prefixes)
                for t in probs[i].nonzero().flatten().tolist()}
    return dist


def total_variation(counts: Counter, exact: dict) -> float:
    """Total variation distance between the empirical distribution of ``counts`` and
    ``exact`` (both keyed by outcome)."""
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(x, 0) / n - exact.get(x, 0.0))
                     for x in set(counts) | set(exact))


def marginal(dist: dict[tuple, float], position: int) -> dict[int, float]:
    """One position's share of ``dist`` (probabilities or counts of token tuples)."""
    out: dict[int, float] = {}
    for key, prob in dist.items():
        out[key[position]] = out.get(key[position], 0.0) + prob
    return out


def sample_first_tokens(engine: LLMEngine, prompt: list[int], params: SamplingParams,
                        samples: int, positions: int, per_request: int = 25
                        ) -> tuple[Counter, float]:
    """``samples`` sampled continuations of ``prompt`` through ``engine``, as requests of
    ``per_request`` parallel samples (one prefill serves them all), request i seeded with i,
    as many at a time as ``max_num_seqs`` holds: the counts of their first ``positions``
    tokens (each sample generates one token more, so that a draft can reach the last counted
    position), and the seconds taken. AssertionError on a failed request or a KV block left
    in use."""
    t0 = time.perf_counter()
    sizes = [min(per_request, samples - start) for start in range(0, samples, per_request)]
    wave = max(1, engine.config.max_num_seqs // per_request)
    counts: Counter = Counter()
    for first in range(0, len(sizes), wave):
        ids = [engine.add_request(prompt, dataclasses.replace(
            params, n=n, seed=first + i, max_tokens=positions + 1, ignore_eos=True))
            for i, n in enumerate(sizes[first:first + wave])]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        failed = [done[i] for i in ids if done[i].error]
        assert not failed, f"request {failed[0].request_id} failed: {failed[0].error}"
        counts.update(tuple(c.token_ids[:positions]) for i in ids for c in done[i].outputs)
    assert engine.blocks.num_free == engine.blocks.num_blocks, "KV blocks left in use"
    return counts, time.perf_counter() - t0


def sampling_engine(model: Transformer, prompt_len: int, k: int, max_seqs: int = 128
                    ) -> LLMEngine:
    """An engine for many short sampled sequences of a ``prompt_len``-token prompt, drafts of
    up to ``k`` tokens (or tree nodes): ``max_seqs`` at once, KV blocks for all of them."""
    per_seq = -(-(prompt_len + 2 * k + 4) // 16) + 1
    return LLMEngine(model, None, EngineConfig(
        max_num_seqs=max_seqs, num_kv_blocks=max_seqs * per_seq + 8, block_size=16,
        max_num_batched_tokens=max(2048, max_seqs * (k + 1) + 4 * prompt_len)))


@dataclass
class SampledComparison:
    """The first ``positions`` tokens of ``samples`` sampled continuations, three ways: exactly
    (``exact``: {token tuple: probability}), through the plain engine and through the
    speculative one (``plain``, ``spec``: counts of token tuples)."""

    exact: dict[tuple[int, ...], float]
    plain: Counter
    spec: Counter
    samples: int
    positions: int
    acceptance: list[float]          # the speculative run's acceptance by draft position
    seconds: tuple[float, float]     # (plain, speculative) wall time

    def distance(self, counts: Counter, position: int | None = None) -> float:
        """Total variation from the exact distribution: of the whole tuples, or (0-based
        ``position``) of one position's tokens."""
        if position is None:
            return total_variation(counts, self.exact)
        return total_variation(Counter(marginal(counts, position)),
                               marginal(self.exact, position))

    def tolerance(self, position: int | None = None) -> float:
        """The distance sampling noise alone explains (about 4 standard errors)."""
        exact = self.exact if position is None else marginal(self.exact, position)
        return tv_tolerance(list(exact.values()), self.samples)


def compare_sampling(model: Transformer, prompt: list[int], params: SamplingParams,
                     speculative_config: dict, samples: int, positions: int = 3,
                     drafter: tuple | None = None) -> SampledComparison:
    """``samples`` continuations of ``prompt`` sampled with ``params`` (keep top_k small: the
    exact distribution is enumerated) by the plain engine and by one speculating with
    ``speculative_config`` (its packaged drafter weights, or ``drafter``), against the exact
    distribution of the first ``positions`` tokens."""
    width = max(int(speculative_config.get("num_speculative_tokens", 1)),
                int(speculative_config.get("tree_nodes", 0)))
    exact = first_tokens_distribution(model, prompt, params, positions)
    plain, plain_s = sample_first_tokens(sampling_engine(model, len(prompt), width), prompt,
                                         params, samples, positions)
    engine = sampling_engine(model, len(prompt), width)
    engine.use_speculator(build_speculator(speculative_config, engine, drafter=drafter))
    spec, spec_s = sample_first_tokens(engine, prompt, params, samples, positions)
    return SampledComparison(exact, plain, spec, samples, positions,
                             engine.speculator.stats.acceptance_by_position, (plain_s, spec_s))
