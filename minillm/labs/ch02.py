"""Checkers for the exercises of chapter 02 (inference and the KV cache).

Each ``check_*`` takes the student's function or class, compares it with the package on a few
cases, prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed``
is None while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache import Cache, KVCache, SinkCache, SlidingWindowCache
from ..checkpoint.loader import random_model
from ..config import PRESETS
from ..course.ch02_kv_memory import TABLE_MODELS, MLASpec, kv_cache_bytes
from .common import Result, check


def check_kv_bytes(fn: Callable[..., int]) -> Result:
    """``fn(cfg, tokens, batch, bytes_per_elem)`` -> KV cache bytes, for a GQA/MQA/MHA
    :class:`~minillm.config.ModelConfig` and for an MLA
    :class:`~minillm.course.ch02_kv_memory.MLASpec`.

    Compared with :func:`minillm.course.ch02_kv_memory.kv_cache_bytes` on the calculator's models
    and a
    few made-up shapes.
    """
    made_up = ((3, 1, 4, 8), (5, 2, 1, 32))
    models = list(TABLE_MODELS) + [
        PRESETS["tiny"].with_(name=f"made-up {nl}x{kv}x{g}x{hd}", n_layers=nl, n_kv_heads=kv,
                              n_heads=kv * g, head_dim=hd) for nl, kv, g, hd in made_up]
    models.append(MLASpec("made-up MLA", n_layers=4, kv_lora_rank=96, rope_dim=0, n_heads=8,
                          head_dim=16))
    workloads = ((1, 1, 2), (8192, 1, 2), (4096, 16, 1), (1000, 3, 4), (0, 2, 2))

    def attempt() -> None:
        for cfg in models:
            for tokens, batch, bpe in workloads:
                got = fn(cfg, tokens=tokens, batch=batch, bytes_per_elem=bpe)
                want = kv_cache_bytes(cfg, tokens, batch, bpe)
                assert got == want, (f"{cfg.name}, tokens={tokens}, batch={batch}, "
                                     f"bytes_per_elem={bpe}: got {got}, expected {want}")

    return check("kv_bytes", attempt)


def _score_entries_reference(n: int) -> tuple[int, int]:
    """Count, step by step, the unmasked q.k products of one head in one layer."""
    with_cache = without_cache = 0
    for length in range(1, n + 1):
        with_cache += length  # one new query against every key so far
        without_cache += sum(i + 1 for i in range(length))  # the whole causal triangle again
    return with_cache, without_cache


def check_score_entries(fn: Callable[[int], tuple[int, int]]) -> Result:
    """``fn(n)`` -> (with_cache, without_cache): q.k products (one head, one layer, causal
    entries only) to read a sequence of n tokens one token per forward pass."""

    def attempt() -> None:
        for n in (1, 2, 3, 10, 257, 4096):
            got = fn(n)
            want = _score_entries_reference(n) if n < 300 else (
                n * (n + 1) // 2, n * (n + 1) * (n + 2) // 6)
            assert tuple(got) == want, f"n={n}: got {tuple(got)}, expected {want}"

    return check("score_entries", attempt)


def check_cache_append(cls: type) -> Result:
    """``cls(cfg, batch_size, max_len, device, dtype)``: a :class:`~minillm.cache.Cache`
    subclass whose ``update(layer, k, v)`` stores the new K/V and returns everything so far.

    Two tests: ``update`` returns the same tensors as the package's :class:`KVCache` when
    chunks of random K/V of several lengths arrive; and a small random model reading a sequence
    in chunks through the cache gives the logits it gives with no cache at all.
    """
    cfg = PRESETS["tiny"].with_(vocab_size=512)
    chunks = (5, 1, 1, 7, 1, 3)
    total, batch = sum(chunks), 2

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        mine = cls(cfg, batch, total, "cpu", torch.float32)
        assert isinstance(mine, Cache), f"{cls.__name__} must subclass minillm.cache.Cache"
        ref = KVCache(cfg, batch, total, "cpu", torch.float32)
        for t in chunks:
            for layer in range(cfg.n_layers):
                k, v = (torch.randn(batch, cfg.n_kv_heads, t, cfg.head_dim, generator=gen)
                        for _ in range(2))
                got_k, got_v = mine.update(layer, k, v)
                want_k, want_v = ref.update(layer, k, v)
                assert tuple(got_k.shape) == tuple(want_k.shape), (
                    f"after {ref.seen} + {t} tokens, layer {layer}: update returned keys of "
                    f"shape {tuple(got_k.shape)}, expected {tuple(want_k.shape)}")
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (
                    f"after {ref.seen} + {t} tokens, layer {layer}: the returned K/V differ from "
                    "the package's KVCache (order: oldest token first)")
            mine.advance(t)
            ref.advance(t)
            assert len(mine) == len(ref), f"len(cache) is {len(mine)}, expected {len(ref)}"

        model = random_model(cfg, seed=1)
        ids = torch.randint(0, cfg.vocab_size, (batch, total), generator=gen)
        with torch.inference_mode():
            want = model(ids)
            cache = cls(cfg, batch, total, "cpu", torch.float32)
            got = torch.cat([model(part, cache=cache) for part in ids.split(list(chunks), 1)], 1)
        err = (got - want).abs().max().item()
        assert err < 1e-4, (f"a model reading {total} tokens in chunks {chunks} through the cache "
                            f"differs from the uncached model by {err:.2e} (max |logit diff|)")

    return check("cache_append", attempt)


def _kept_reference(n_seen: int, window: int, n_sink: int, chunk: int = 3) -> list[int]:
    """Positions the package's sliding-window / sink cache keeps after n_seen tokens."""
    cfg = PRESETS["tiny"].with_(n_layers=1)
    cache = SinkCache(cfg, window, n_sink) if n_sink else SlidingWindowCache(cfg, window)
    shape = (1, cfg.n_kv_heads, 0, cfg.head_dim)
    for start in range(0, n_seen, chunk):
        t = min(chunk, n_seen - start)
        k = torch.zeros(shape[:2] + (t,) + shape[3:])
        cache.update(0, k, k)
        cache.advance(t)
    return cache.kept_positions(0)[0, 0].tolist()


def check_sliding_window(fn: Callable[[int, int, int], list[int]]) -> Result:
    """``fn(n_seen, window, n_sink)`` -> sorted positions a bounded cache keeps after reading
    n_seen tokens: the last ``window - n_sink`` tokens plus the first ``n_sink`` (attention
    sinks; ``n_sink=0`` is a plain sliding window). Compared with the package's caches."""
    cases = [(n, w, s) for w, s in ((8, 0), (8, 4), (5, 1), (1, 0))
             for n in (1, 3, w - 1, w, w + 1, 2 * w + 3, 40) if n >= 1]

    def attempt() -> None:
        for n, w, s in cases:
            got = [int(p) for p in fn(n, w, s)]
            want = _kept_reference(n, w, s)
            assert got == want, f"n_seen={n}, window={w}, n_sink={s}: got {got}, expected {want}"

    return check("sliding_window", attempt)
