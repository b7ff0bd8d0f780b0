"""Running a student's component inside the real engine: the shared pieces of the in-engine
checks (``check_*_in_engine`` in the chapter modules).

A chapter's adapter turns the student's function or class into one of the engine's seams (a
step policy, an attention backend, a prefix cache, a verification rule, ...; see
``minillm.engine.EngineConfig``); :func:`serve_greedy` then runs a workload through an engine
built with it and one built without it, and :func:`assert_same_tokens` compares the two.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from ..cache import Cache
from ..checkpoint import random_model
from ..checkpoint.tokenizer import Tokenizer
from ..config import SamplingParams, get_preset
from ..engine import LLMEngine
from ..generate import generate
from ..model.transformer import Transformer


def demo_model() -> Transformer:
    """The tiny preset with seeded random weights in float64: the in-engine checks' default
    model (float64, so that a different batching never flips a greedy token)."""
    return random_model(get_preset("tiny"), seed=1).double()


def demo_prompts(n: int = 12) -> tuple[list[list[int]], list[int]]:
    """``n`` seeded random prompts of 5-39 tokens and output lengths of 4-23 tokens."""
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(5, 40, (n,), generator=g).tolist()
    return ([torch.randint(5, 2000, (m,), generator=g).tolist() for m in lens],
            torch.randint(4, 24, (n,), generator=g).tolist())


def finish_all(engine: LLMEngine, ids: list[str]) -> dict:
    """Step ``engine`` until it has nothing left: the tokens of its requests ``ids`` and the
    steps taken; AssertionError on a failed request or a KV block left in use."""
    done, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
    failed = [o for o in done.values() if o.outputs[0].finish_reason == "error"]
    assert not failed, f"request {failed[0].request_id} failed: {failed[0].error}"
    free, total = engine.blocks.num_free, engine.blocks.num_blocks
    assert free == total, f"{total - free} KV blocks still in use after every request finished"
    return {"tokens": [done[i].token_ids for i in ids], "steps": steps,
            "preemptions": sum(done[i].metrics.num_preemptions for i in ids)}


def serve_greedy(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Every prompt through ``engine`` at once, greedy (:func:`finish_all`): tokens per request,
    steps, seconds, preemptions."""
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
           for p, m in zip(prompts, output_lens)]
    t0 = time.perf_counter()
    run = finish_all(engine, ids)
    return {**run, "seconds": time.perf_counter() - t0}


@contextmanager
def attention_set(model: Transformer, fn: Callable[..., torch.Tensor]) -> Iterator[int]:
    """Inside the ``with`` block ``fn`` is every layer's attention function
    (``layer.attn.backend``, the seam ``Transformer.set_attention_backend`` uses); the layers'
    own functions are put back on exit. Yields the number of layers."""
    saved = [layer.attn.backend for layer in model.layers]
    for layer in model.layers:
        layer.attn.backend = fn
    try:
        yield len(saved)
    finally:
        for layer, backend in zip(model.layers, saved):
            layer.attn.backend = backend


def assert_same_tokens(mine: dict, ref: dict) -> None:
    """AssertionError naming the first request and token where two :func:`serve_greedy` runs
    differ."""
    for i, (a, b) in enumerate(zip(mine["tokens"], ref["tokens"])):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, (f"request {i}: token {first} is {a[first:first + 1]}, the package "
                        f"gives {b[first:first + 1]} ({len(a)} vs {len(b)} tokens)")


def full_precision(model: Transformer) -> Transformer:
    """``model`` itself when it computes in float32 or float64, else a float32 copy of it (the
    in-model checks run on it): in a 16-bit format two right implementations may round a near
    tie differently and pick different greedy tokens."""
    if model.dtype in (torch.float32, torch.float64):
        return model
    return copy.deepcopy(model).float()


def generate_greedy(model: Transformer, prompts: list[list[int]], output_lens: list[int],
                    cache_factory: Callable[[int], Cache] | None = None) -> dict:
    """Each prompt's greedy continuation of ``output_lens`` tokens by
    :func:`minillm.generate.generate` (a prefill into a KV cache made by ``cache_factory``,
    default the package's :class:`~minillm.cache.KVCache`, then one token per forward pass),
    and the seconds they took in all: {"tokens": [[int]], "seconds": float}, the shape
    :func:`~minillm.labs.in_engine.assert_same_tokens` compares."""
    t0 = time.perf_counter()
    tokens = [generate(model, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       cache_factory) for p, n in zip(prompts, output_lens)]
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


def serve_in_turn(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Each prompt through ``engine`` once the previous one has finished (a quiet service:
    each request finds what the earlier ones left cached), greedy: per request its tokens,
    their log-probabilities and its TTFT (s); the prefix hit rate (prompt tokens found cached
    over those looked up); seconds. AssertionError unless every request finished and every KV
    block is free at the end (idle cached blocks count as free)."""
    tokens, logprobs, ttft, t0 = [], [], [], time.perf_counter()
    params = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=1)
    for i, (p, m) in enumerate(zip(prompts, output_lens)):
        engine.add_request(p, dataclasses.replace(params, max_tokens=m))
        done = []
        while engine.has_unfinished():
            done += [o for o in engine.step() if o.finished]
        out = done[0].outputs[0]
        assert out.finish_reason != "error", f"request {i} failed: {done[0].error}"
        tokens.append(out.token_ids)
        logprobs.append([lp[t] for t, lp in zip(out.token_ids, out.logprobs)])
        ttft.append(done[0].ttft)
    seconds = time.perf_counter() - t0
    b = engine.blocks
    assert b.num_free == b.num_blocks, (f"{b.num_blocks - b.num_free} KV blocks still in use "
                                        f"after every request finished")
    return {"tokens": tokens, "logprobs": logprobs, "ttft": ttft, "seconds": seconds,
            "hit_rate": b.prefix_hit / b.prefix_queried if b.prefix_queried else 0.0}


def assert_same_outputs(mine: dict, ref: dict, dtype: torch.dtype) -> None:
    """AssertionError naming the first request and token where two :func:`serve_in_turn` runs
    differ in the token or its log-probability (beyond the rounding of ``dtype``): reused KV
    that is not the KV of the request's own prefix shows in the log-probabilities even where
    the greedy token survives it."""
    assert_same_tokens(mine, ref)
    tol = {torch.float64: 1e-8, torch.float32: 1e-3}.get(dtype, 5e-2)
    for i, (a, b) in enumerate(zip(mine["logprobs"], ref["logprobs"])):
        bad = next((j for j, (x, y) in enumerate(zip(a, b)) if abs(x - y) > tol), None)
        assert bad is None, (f"request {i}: token {bad} has log-probability {a[bad]:.6f}, "
                             f"{b[bad]:.6f} without a prefix cache: the KV it reused is not "
                             f"the KV of its own prefix")


# Largest |logit difference| allowed, relative to the largest |logit|, by the model's dtype
LOGIT_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3}


@torch.inference_mode()
def _uncached_logits(model: Transformer, prompts: list[list[int]],
                     continuations: list[list[int]]) -> list[torch.Tensor]:
    """Logits [T, vocab] of one forward pass without a cache over each prompt + continuation."""
    return [model(torch.tensor([p + c], device=model.device))[0]
            for p, c in zip(prompts, continuations)]


def assert_runs_in_model(model: Transformer, prompts: list[list[int]], output_lens: list[int],
                         replaced: Callable[[], AbstractContextManager[int]], what: str,
                         tok: Tokenizer | None = None) -> None:
    """Raise AssertionError unless ``model`` with the student's part in place (inside the
    ``with replaced()`` block) generates the same greedy tokens as without it, and gives the
    same logits (within :data:`LOGIT_RTOL`) in one uncached pass over each prompt and the
    package's continuation. Prints both runs' seconds, and with ``tok`` the first prompt's
    continuation."""
    ref = generate_greedy(model, prompts, output_lens)
    want = _uncached_logits(model, prompts, ref["tokens"])
    with replaced() as places:
        mine = generate_greedy(model, prompts, output_lens)
        got = _uncached_logits(model, prompts, ref["tokens"])
    assert_same_tokens(mine, ref)
    err = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, torch.Tensor) and g.shape == w.shape and not g.isnan().any(), (
            f"prompt {i}: the model's logits with your {what} are not a tensor of shape "
            f"{tuple(w.shape)} without NaN")
        rel = ((g.double() - w.double()).abs().max() / w.double().abs().max()).item()
        err = max(err, rel)
        assert rel <= LOGIT_RTOL.get(model.dtype, 5e-2), (
            f"prompt {i}: the same greedy tokens, but the logits of an uncached pass differ by "
            f"{rel:.1e} of their largest value")
    text = (f": {tok.decode(prompts[0])!r} -> {tok.decode(mine['tokens'][0])!r}"
            if tok is not None else "")
    print(f"the model with your {what} in {places} places generated the package's "
          f"{sum(map(len, mine['tokens']))} greedy tokens in {mine['seconds']:.2f} s (unmodified: "
          f"{ref['seconds']:.2f} s), logits off by at most {err:.1g} of the largest{text}")


__all__ = ["LOGIT_RTOL", "assert_runs_in_model", "assert_same_outputs", "assert_same_tokens",
           "attention_set", "demo_model",
           "demo_prompts", "finish_all", "full_precision", "generate_greedy", "serve_greedy",
           "serve_in_turn"]
