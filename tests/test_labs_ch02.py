"""Chapter 02 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import pytest
import torch

from minillm.cache import Cache
from minillm.course.ch02_kv_memory import MLASpec
from minillm.labs import ch02
from minillm.labs.solutions.ch02 import (
    GrowingCache,
    kept_positions,
    kv_bytes,
    score_entries,
)

# --- wrong solutions -----------------------------------------------------------------------


def kv_bytes_mla_as_mha(cfg, tokens, batch=1, bytes_per_elem=2):
    heads = cfg.n_heads if isinstance(cfg, MLASpec) else cfg.n_kv_heads  # MLA counted as MHA
    return 2 * cfg.n_layers * heads * cfg.head_dim * tokens * batch * bytes_per_elem


def kv_bytes_no_v(cfg, tokens, batch=1, bytes_per_elem=2):
    return kv_bytes(cfg, tokens, batch, bytes_per_elem) // 2  # forgot V (and halved MLA)


def score_entries_square(n):
    return n * (n + 1) // 2, sum(t * t for t in range(1, n + 1))  # full square, not causal


class ForgetfulCache(GrowingCache):
    """Returns only the new tokens: every query attends to its own chunk alone."""

    def update(self, layer, k, v):
        super().update(layer, k, v)
        return k, v


class NewestFirstCache(GrowingCache):
    """Puts new tokens in front: the right set of keys, in the wrong order."""

    def update(self, layer, k, v):
        if self.k[layer] is not None:
            k = torch.cat([k, self.k[layer]], dim=2)
            v = torch.cat([v, self.v[layer]], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


def kept_without_sinks(n_seen, window, n_sink=0):
    return list(range(max(0, n_seen - window), n_seen))  # ignores the sinks


def kept_off_by_one(n_seen, window, n_sink=0):
    recent = range(max(n_sink, n_seen - (window - n_sink) + 1), n_seen)
    return sorted(set(range(min(n_sink, n_seen))) | set(recent))


def stub(*args, **kwargs):
    raise NotImplementedError


class StubCache(Cache):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError


CHECKS = [
    (ch02.check_kv_bytes, kv_bytes, kv_bytes_no_v, stub),
    (ch02.check_kv_bytes, kv_bytes, kv_bytes_mla_as_mha, stub),
    (ch02.check_score_entries, score_entries, score_entries_square, stub),
    (ch02.check_cache_append, GrowingCache, ForgetfulCache, StubCache),
    (ch02.check_cache_append, GrowingCache, NewestFirstCache, StubCache),
    (ch02.check_sliding_window, kept_positions, kept_without_sinks, stub),
    (ch02.check_sliding_window, kept_positions, kept_off_by_one, stub),
]
IDS = ["kv_bytes", "kv_bytes_mla", "score_entries", "cache_forgetful", "cache_order",
       "window_sinks", "window_off_by_one"]


@pytest.mark.parametrize("checker,right,wrong,todo", CHECKS, ids=IDS)
def test_reference_passes(checker, right, wrong, todo):
    result = checker(right)
    assert result.passed is True, result.message


@pytest.mark.parametrize("checker,right,wrong,todo", CHECKS, ids=IDS)
def test_wrong_fails(checker, right, wrong, todo):
    result = checker(wrong)
    assert result.passed is False
    assert result.message


@pytest.mark.parametrize("checker,right,wrong,todo", CHECKS, ids=IDS)
def test_stub_is_not_attempted(checker, right, wrong, todo):
    assert checker(todo).passed is None


def test_package_kvcache_passes_its_own_checker():
    from minillm.cache import KVCache

    assert ch02.check_cache_append(KVCache).passed is True
