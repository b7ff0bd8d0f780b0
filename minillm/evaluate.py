"""Perplexity of a long text under a KV-cache policy, and the text to measure it on.

``token_nll`` streams a text through the model with a given cache, the way a chatbot reads a
long conversation, and scores every next-token prediction. ``compare_policies`` runs the full
cache and the bounded caches of chapter 02 (sliding window, attention sinks, H2O) at a few
budgets. The text is prose from the Python reference manual that ships with the standard
library (``pydoc_data``), so it exists offline on every machine.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from .cache import Cache, H2OCache, KVCache, SinkCache, SlidingWindowCache
from .config import ModelConfig
from .model.transformer import Transformer

#: Reference-manual topics read in this order (missing ones are skipped, repeats dropped).
PROSE_TOPICS = ("execmodel", "types", "import", "compound", "exceptions", "naming", "calls")

POLICIES = ("full", "window", "sinks", "h2o")


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of running prose, each on one line: no headings, code or indented lists."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or any(line[0].isspace() for line in lines):
            continue  # code examples and indented material
        if len(lines) >= 2 and set(lines[-1].strip()) <= set("=-*~^"):
            continue  # a heading and its underline
        paragraph = " ".join(block.split())
        if len(paragraph) > 80 and paragraph[-1] in ".)":  # ":" would introduce removed code
            out.append(paragraph)
    return out


def sample_text(n_tokens: int, tok, topics: Sequence[str] = PROSE_TOPICS) -> str:
    """Whole paragraphs of English prose, at least ``n_tokens`` tokens long (deterministic).

    Taken from ``pydoc_data.topics`` (the Python reference manual in the standard library),
    so the exact text depends on the Python version only.
    """
    from pydoc_data.topics import topics as manual

    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    names = [t for t in topics if t in manual] + sorted(set(manual) - set(topics))
    seen: set[str] = set()
    chosen: list[str] = []
    count = 0
    for name in names:
        for paragraph in _prose_paragraphs(manual[name]):
            if paragraph in seen:
                continue
            seen.add(paragraph)
            chosen.append(paragraph)
            count += len(tok.encode(paragraph + "\n\n"))
            if count >= n_tokens:
                return "\n\n".join(chosen)
    raise ValueError(f"the reference manual has only about {count} tokens of prose; "
                     f"n_tokens must be at most that, got {n_tokens}")


def sample_ids(n_tokens: int, tok) -> list[int]:
    """Exactly ``n_tokens`` token ids of :func:`sample_text`."""
    return tok.encode(sample_text(n_tokens, tok))[:n_tokens]


def _eviction_free_prefix(cache: Cache, n: int) -> int:
    """How many tokens can go in the first pass with no eviction (so no change in results)."""
    if isinstance(cache, KVCache):
        return min(n, cache.max_len)
    return min(n, getattr(cache, "capacity", 1))


@torch.inference_mode()
def token_nll(model: Transformer, ids: Sequence[int] | torch.Tensor,
              cache_factory: Callable[[int], Cache] | None = None, chunk: int = 1,
              prefill: int | None = None) -> torch.Tensor:
    """Negative log-likelihood of each next token, [n - 1] float64, reading ids through a cache.

    ``cache_factory(n)`` builds the cache (default: a contiguous :class:`KVCache` of n slots).
    The first ``prefill`` tokens go in one forward pass (default: as many as the cache keeps
    without evicting, which changes nothing), then ``chunk`` tokens per pass. Bounded caches
    evict after each pass, so ``chunk=1`` is true streaming: every prediction sees exactly
    what the policy kept.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    n = ids.numel()
    if n < 2:
        raise ValueError(f"ids must hold at least 2 tokens, got {n}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    cache = cache_factory(n) if cache_factory else KVCache(model.cfg, 1, n, model.device,
                                                           model.dtype)
    first = _eviction_free_prefix(cache, n) if prefill is None else prefill
    if not 1 <= first <= n:
        raise ValueError(f"prefill must be in [1, {n}], got {first}")
    x = ids.to(model.device)[None]
    nll = torch.empty(n - 1, dtype=torch.float64)
    start = 0
    while start < n:
        end = min(n, start + (first if start == 0 else chunk))
        logits = model(x[:, start:end], cache=cache)[0]  # [end - start, vocab]
        targets = x[0, start + 1:end + 1]  # the last token of the text has no target
        logp = logits[: targets.numel()].double().log_softmax(dim=-1)
        nll[start:start + targets.numel()] = -logp.gather(1, targets[:, None])[:, 0].cpu()
        start = end
    return nll


def perplexity(model: Transformer, ids: Sequence[int] | torch.Tensor,
               cache_factory: Callable[[int], Cache] | None = None, chunk: int = 1,
               prefill: int | None = None) -> float:
    """exp(mean next-token NLL) of ids read through a cache (see :func:`token_nll`)."""
    return math.exp(token_nll(model, ids, cache_factory, chunk, prefill).mean().item())


def make_cache(policy: str, cfg: ModelConfig, budget: int, n_sink: int = 4,
               recent_frac: float = 0.5) -> Cache:
    """A bounded cache of ``budget`` tokens: "window", "sinks" or "h2o".

    H2O keeps ``round(recent_frac * budget)`` recent tokens (the paper splits evenly).
    """
    if policy == "window":
        return SlidingWindowCache(cfg, budget)
    if policy == "sinks":
        return SinkCache(cfg, budget, n_sink)
    if policy == "h2o":
        return H2OCache(cfg, budget, round(recent_frac * budget))
    raise ValueError(f"policy must be one of {POLICIES[1:]}, got {policy!r}")


def compare_policies(model: Transformer, ids: Sequence[int] | torch.Tensor,
                     budgets: Sequence[int], policies: Sequence[str] = POLICIES,
                     n_sink: int = 4, recent_frac: float = 0.5) -> list[dict]:
    """Perplexity of ids for each policy and budget, streamed one token at a time.

    Returns [{"policy", "budget", "ppl", "seconds"}]; "full" is measured once with
    budget = len(ids).
    """
    n = len(ids)
    rows = []
    for policy in policies:
        for budget in ([n] if policy == "full" else budgets):
            factory = None
            if policy != "full":
                def factory(_max_len, policy=policy, budget=budget):
                    return make_cache(policy, model.cfg, budget, n_sink, recent_frac)
            t0 = time.perf_counter()
            ppl = perplexity(model, ids, factory)
            rows.append({"policy": policy, "budget": budget, "ppl": ppl,
                         "seconds": time.perf_counter() - t0})
    return rows
