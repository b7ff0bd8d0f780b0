"""The simple generation loops of chapters 01 and 02 (one sequence at a time, no engine).

``generate_no_cache`` re-runs the whole sequence for every new token; ``generate`` runs the
prompt once (prefill) into a KV cache and then one token per step (decode).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .cache import Cache, KVCache
from .config import SamplingParams
from .model.transformer import Transformer
from .sampling import make_generator, sample


def _stop_ids(model: Transformer, params: SamplingParams) -> set[int]:
    return set() if params.ignore_eos else {model.cfg.eos_token_id}


@torch.inference_mode()
def stream(model: Transformer, prompt_ids: list[int], params: SamplingParams,
           cache_factory: Callable[[int], Cache] | None = None) -> Iterator[int]:
    """Yield new token ids one by one: prefill once, then decode with a KV cache.

    ``cache_factory(max_len)`` builds the cache (default: a contiguous :class:`KVCache`);
    bounded caches from chapter 02 plug in here. Stops at EOS, ``max_tokens`` or the window.
    """
    model.cfg.check_prompt(prompt_ids)
    n_new = min(params.max_tokens, model.cfg.max_seq_len - len(prompt_ids))
    max_len = len(prompt_ids) + n_new
    if cache_factory is None:
        cache = KVCache(model.cfg, 1, max_len, model.device, model.dtype)
    else:
        cache = cache_factory(max_len)
    gen = make_generator(params.seed, model.device)
    stop = _stop_ids(model, params)
    x = torch.tensor([prompt_ids], device=model.device)
    for _ in range(n_new):
        logits = model(x, cache=cache, last_only=True)[:, -1]
        nxt = int(sample(logits, params, gen))
        yield nxt
        if nxt in stop:
            return
        x = torch.tensor([[nxt]], device=model.device)


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams,
             cache_factory: Callable[[int], Cache] | None = None) -> list[int]:
    """New token ids after ``prompt_ids`` (KV-cached)."""
    return list(stream(model, prompt_ids, params, cache_factory))


@torch.inference_mode()
def generate_no_cache(model: Transformer, prompt_ids: list[int],
                      params: SamplingParams) -> list[int]:
    """The same loop without a cache: every step recomputes attention over the whole prefix."""
    model.cfg.check_prompt(prompt_ids)
    n_new = min(params.max_tokens, model.cfg.max_seq_len - len(prompt_ids))
    gen = make_generator(params.seed, model.device)
    stop = _stop_ids(model, params)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(n_new):
        logits = model(torch.tensor([ids], device=model.device), last_only=True)[:, -1]
        nxt = int(sample(logits, params, gen))
        out.append(nxt)
        ids.append(nxt)
        if nxt in stop:
            break
    return out
