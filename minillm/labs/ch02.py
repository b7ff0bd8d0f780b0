"""Checkers for the exercises of chapter 02 (inference and the KV cache).

Each ``check_*`` takes the student's function or class, compares it with the package on a few
cases, prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed``
is None while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import attention_with_lse, causal_mask
from ..cache import Cache, H2OCache, KVCache, SinkCache, SlidingWindowCache
from ..checkpoint.loader import random_model
from ..config import PRESETS
from ..course.ch02_kv_memory import TABLE_MODELS, MLASpec, kv_cache_bytes
from ..evaluate import visible_keys
from .common import Result, check


def check_kv_bytes(fn: Callable[..., int]) -> Result:
    """``fn(cfg, tokens, batch, bytes_per_elem)`` -> KV cache bytes, for a GQA/MQA/MHA
    :class:`~minillm.config.ModelConfig` and for an MLA
    :class:`~minillm.course.ch02_kv_memory.MLASpec`.

    Compared with :func:`minillm.course.ch02_kv_memory.kv_cache_bytes` on the calculator's
    models and a few made-up shapes.
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


def check_decode_attention(fn: Callable) -> Result:
    """``fn(q, k_new, v_new, k_cache, v_cache)`` -> (out, k_cache, v_cache): one decode step of
    one attention layer with a KV cache. q [B, H, 1, hd] is the new token's query, k_new/v_new
    [B, H_kv, 1, hd] its key and value, k_cache/v_cache [B, H_kv, L, hd] the L tokens before it
    (L may be 0). Append the new key/value after the cached ones, then attend the query over all
    L + 1 keys (scale 1/sqrt(hd); query head h reads KV head h // (H / H_kv)). out [B, H, 1, hd];
    the caches come back as [B, H_kv, L + 1, hd].

    Fed a sequence token by token from empty caches, the outputs must equal causal attention
    over the whole sequence at once (float64), and the caches must hold the keys in order.
    """
    shapes = ((1, 1, 1, 5, 4), (2, 4, 2, 7, 8), (1, 6, 1, 4, 16), (1, 9, 3, 1, 8))

    def attempt() -> None:
        gen = torch.Generator().manual_seed(2)
        for b, h, h_kv, t, hd in shapes:
            q = torch.randn(b, h, t, hd, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(b, h_kv, t, hd, generator=gen, dtype=torch.float64)
                    for _ in range(2))
            want, _ = attention_with_lse(q, k, v, causal_mask(t, t))
            k_cache, v_cache = k[:, :, :0], v[:, :, :0]
            case = f"B={b}, H={h}, H_kv={h_kv}, hd={hd}"
            for i in range(t):
                out, k_cache, v_cache = fn(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1],
                                           k_cache, v_cache)
                assert tuple(out.shape) == (b, h, 1, hd), (
                    f"{case}, step {i}: out has shape {tuple(out.shape)}, expected "
                    f"{(b, h, 1, hd)}")
                assert torch.equal(k_cache, k[:, :, :i + 1]) and torch.equal(
                    v_cache, v[:, :, :i + 1]), (
                    f"{case}, step {i}: the returned caches must be the old ones with the new "
                    "key/value appended at the end")
                err = (out - want[:, :, i:i + 1]).abs().max().item()
                assert err < 1e-10, (
                    f"{case}, step {i}: output differs from causal attention over the whole "
                    f"sequence by {err:.2e}")

    return check("decode_attention", attempt)


def _h2o_case(gen: torch.Generator, b: int, h_kv: int, length: int, t: int):
    """Scores and positions [B, H_kv, L] as an H2O cache holds them after reading t new tokens:
    each head's older tokens are a sorted subset of the past, the t newest are in every head."""
    end = length + 3 * t + 5
    pos = torch.empty(b, h_kv, length, dtype=torch.long)
    for i in range(b):
        for j in range(h_kv):
            old = torch.randperm(end - t, generator=gen)[:length - t].sort().values
            pos[i, j] = torch.cat([old, torch.arange(end - t, end)])
    score = torch.rand(b, h_kv, length, generator=gen) * 5
    return score, pos, end


def check_h2o_keep(fn: Callable) -> Result:
    """``fn(score, pos, end, budget, n_recent)`` -> indices [B, H_kv, budget] (long) into the
    last axis of score/pos [B, H_kv, L] (L > budget): the tokens one H2O eviction step keeps,
    in position order. ``end`` is the position after the newest token. Keep the ``n_recent``
    most recent tokens (pos >= end - n_recent) and fill the rest of the budget with the other
    tokens of highest accumulated attention score, per head.

    Compared with the package's :class:`~minillm.cache.H2OCache` on random caches, then used
    inside an H2O cache while a small random model reads a text: the same tokens must stay.
    """
    cases = ((1, 2, 10, 6, 3, 1), (2, 3, 12, 8, 0, 1), (1, 1, 9, 8, 8, 4), (1, 3, 20, 5, 2, 5),
             (2, 2, 7, 1, 1, 1))
    cfg = PRESETS["tiny"].with_(vocab_size=512)

    def attempt() -> None:
        gen = torch.Generator().manual_seed(3)
        for b, h_kv, length, budget, n_recent, t in cases:
            score, pos, end = _h2o_case(gen, b, h_kv, length, t)
            got = fn(score.clone(), pos.clone(), end, budget, n_recent)
            want = H2OCache(cfg, budget, n_recent)._keep(score, pos, end)
            case = f"L={length}, budget={budget}, n_recent={n_recent}, {t} new token(s)"
            assert tuple(got.shape) == tuple(want.shape), (
                f"{case}: got indices of shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            assert torch.equal(got.long(), want), (
                f"{case}: kept positions {pos.gather(2, got.long())[0, 0].tolist()} in head 0, "
                f"expected {pos.gather(2, want)[0, 0].tolist()}")

        class StudentH2O(H2OCache):
            def _keep(self, score, pos, end):
                return fn(score, pos, end, self.budget, self.n_recent).long()

        model = random_model(cfg, seed=4)
        ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=gen)
        chunks = [6] + [1] * 20 + [3, 5, 1, 4, 1]
        mine, ref = StudentH2O(cfg, 8, 3), H2OCache(cfg, 8, 3)
        with torch.inference_mode():
            for part in ids.split(chunks, dim=1):
                model(part, cache=mine)
                model(part, cache=ref)
                for layer in range(cfg.n_layers):
                    assert torch.equal(mine.kept_positions(layer), ref.kept_positions(layer)), (
                        f"a model reading 40 tokens: after {ref.seen} tokens, layer {layer} "
                        f"keeps {mine.kept_positions(layer)[0, 0].tolist()} (head 0), "
                        f"expected {ref.kept_positions(layer)[0, 0].tolist()}")

    return check("h2o_keep", attempt)


def check_visible_keys(fn: Callable[[int, int, int, int], torch.Tensor]) -> Result:
    """``fn(n, window, n_sink, chunk)`` -> [n, n] bool: True where query i sees key j while a
    window (``n_sink=0``) or sink cache of ``window`` tokens reads n tokens: the first
    ``window`` in one pass, then ``chunk`` per pass, evicting after each pass. Compared with
    :func:`minillm.evaluate.visible_keys`, which the chapter's perplexities use."""
    cases = [(n, w, s, c) for w, s in ((8, 0), (8, 4), (5, 1), (1, 0)) for c in (1, 3, 16)
             for n in (1, w, w + 1, 2 * w + 3, 30)]

    def attempt() -> None:
        for n, w, s, c in cases:
            got = torch.as_tensor(fn(n, w, s, c)).bool()
            want = visible_keys(n, w, s, c)
            case = f"n={n}, window={w}, n_sink={s}, chunk={c}"
            assert tuple(got.shape) == (n, n), (
                f"{case}: shape {tuple(got.shape)}, expected {(n, n)}")
            wrong = (got != want).any(dim=1).nonzero().flatten().tolist()
            i = wrong[0] if wrong else 0
            assert not wrong, (f"{case}: query {i} sees keys {got[i].nonzero().flatten().tolist()}"
                               f", expected {want[i].nonzero().flatten().tolist()}")

    return check("visible_keys", attempt)
