"""Perplexity of a long text under a KV-cache policy, and the text to measure it on.

``token_nll`` streams a text through the model with a given cache, the way a chatbot reads a
long conversation, and scores every next-token prediction. ``compare_policies`` runs the full
cache and the bounded caches of chapter 02 (sliding window, attention sinks, H2O) at a few
budgets. A window or sink cache is full attention with keys masked out, so its streamed result
is also what one forward pass under :func:`visible_keys` gives (:func:`masked_nll`): the same
numbers for the price of a prefill. The text is prose from the Python reference manual that
ships with the standard library (``pydoc_data``), so it exists offline on every machine.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .cache import Cache, H2OCache, KVCache, QuantizedKVCache, SinkCache, SlidingWindowCache
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
        nll[start:start + targets.numel()] = next_token_nll(logits[: targets.numel()], targets)
        start = end
    return nll


def next_token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [T, vocab], targets [T] -> -log p(target) per row, [T] float64 on the CPU."""
    logp = logits.double().log_softmax(dim=-1)
    return -logp.gather(1, targets[:, None])[:, 0].cpu()


def visible_keys(n: int, window: int, n_sink: int = 0, chunk: int = 1) -> torch.Tensor:
    """[n, n] bool: True where query i sees key j when a window (``n_sink=0``) or sink cache of
    ``window`` tokens reads n tokens as :func:`token_nll` does (the first ``window`` in one
    pass, then ``chunk`` per pass, evicting after each pass).

    A pass starting at s sees the kept tokens (the first ``n_sink`` and the last
    ``window - n_sink`` before s) plus its own tokens up to the query.
    """
    if not 0 <= n_sink < window:
        raise ValueError(f"n_sink must be in [0, window={window}), got {n_sink}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    start = torch.where(i < window, 0, window + (i - window) // chunk * chunk)  # [n, 1]
    return (j <= i) & ((j < n_sink) | (j >= start - (window - n_sink)))


class MaskedPass(Cache):
    """Not a cache: makes one forward pass over T tokens attend only where ``allowed`` [T, T]
    is True (nothing is stored). Query i of the pass is position i."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed
        self.seen = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn=None) -> torch.Tensor:
        """q [B, H, T, hd], k/v [B, H_kv, T, hd] -> [B, H, T, hd] under the mask."""
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed.to(q.device))

    def __len__(self) -> int:
        return 0


@torch.inference_mode()
def masked_nll(model: Transformer, ids: Sequence[int] | torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
    """Next-token NLL [n - 1] float64 from one forward pass in which query i sees the keys
    ``allowed[i]`` ([n, n] bool, e.g. :func:`visible_keys`)."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten().to(model.device)
    if tuple(allowed.shape) != (ids.numel(), ids.numel()):
        raise ValueError(f"allowed must be [{ids.numel()}, {ids.numel()}], got "
                         f"{list(allowed.shape)}")
    logits = model(ids[None], cache=MaskedPass(allowed))[0]
    return next_token_nll(logits[:-1], ids[1:])


def perplexity(model: Transformer, ids: Sequence[int] | torch.Tensor,
               cache_factory: Callable[[int], Cache] | None = None, chunk: int = 1,
               prefill: int | None = None) -> float:
    """exp(mean next-token NLL) of ids read through a cache (see :func:`token_nll`)."""
    return math.exp(token_nll(model, ids, cache_factory, chunk, prefill).mean().item())


def kv_dtype_perplexity(model: Transformer, ids: Sequence[int] | torch.Tensor,
                        kv_cache_dtype: str) -> float:
    """Perplexity of ids with the KV cache stored as ``kv_cache_dtype`` ("float32",
    "bfloat16", "int8": :class:`~minillm.cache.QuantizedKVCache`); every query reads the keys
    and values back from that storage, so one pass gives what decoding token by token would."""
    return perplexity(model, ids, lambda n: QuantizedKVCache(
        model.cfg, 1, n, model.device, model.dtype, kv_cache_dtype))


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


def policy_nll(model: Transformer, ids: Sequence[int] | torch.Tensor, policy: str,
               budget: int, n_sink: int = 4, recent_frac: float = 0.5,
               chunk: int = 1) -> torch.Tensor:
    """Next-token NLL [n - 1] of ids read under a policy, evicting every ``chunk`` tokens.

    "full" and the window/sink caches take one masked forward pass (exactly what streaming
    gives, see :func:`visible_keys`); H2O is streamed, since its choice depends on attention.
    """
    n = len(ids)
    if policy == "full":
        return masked_nll(model, ids, visible_keys(n, n))
    if policy in ("window", "sinks"):
        return masked_nll(model, ids,
                          visible_keys(n, budget, n_sink if policy == "sinks" else 0, chunk))
    return token_nll(model, ids, lambda _n: make_cache(policy, model.cfg, budget, n_sink,
                                                       recent_frac), chunk=chunk)


def compare_policies(model: Transformer, ids: Sequence[int] | torch.Tensor,
                     budgets: Sequence[int], policies: Sequence[str] = POLICIES,
                     n_sink: int = 4, recent_frac: float = 0.5, chunk: int = 1) -> list[dict]:
    """Perplexity of ids for each policy and budget, evicting every ``chunk`` tokens.

    Returns [{"policy", "budget", "ppl", "seconds", "nll"}] ("nll": the [n - 1] per-token
    losses); "full" is measured once with budget = len(ids).
    """
    n = len(ids)
    rows = []
    for policy in policies:
        for budget in ([n] if policy == "full" else budgets):
            t0 = time.perf_counter()
            nll = policy_nll(model, ids, policy, budget, n_sink, recent_frac, chunk)
            rows.append({"policy": policy, "budget": budget, "ppl": math.exp(nll.mean().item()),
                         "seconds": time.perf_counter() - t0, "nll": nll})
    return rows
