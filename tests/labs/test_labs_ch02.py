"""Chapter 02 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import math

import torch
from lab_checks import checker_tests

from minillm.cache import KVCache
from minillm.course.ch02_kv_memory import MLASpec
from minillm.labs import ch02
from minillm.labs.solutions import ch02 as key

# --- wrong solutions -----------------------------------------------------------------------


def kv_bytes_mla_as_mha(cfg, tokens, batch=1, bytes_per_elem=2):
    heads = cfg.n_heads if isinstance(cfg, MLASpec) else cfg.n_kv_heads  # MLA counted as MHA
    return 2 * cfg.n_layers * heads * cfg.head_dim * tokens * batch * bytes_per_elem


def kv_bytes_no_v(cfg, tokens, batch=1, bytes_per_elem=2):
    return key.kv_bytes(cfg, tokens, batch, bytes_per_elem) // 2  # forgot V (and halved MLA)


def score_entries_square(n):
    return n * (n + 1) // 2, sum(t * t for t in range(1, n + 1))  # full square, not causal


class ForgetfulCache(key.GrowingCache):
    """Returns only the new tokens: every query attends to its own chunk alone."""

    def update(self, layer, k, v):
        super().update(layer, k, v)
        return k, v


class NewestFirstCache(key.GrowingCache):
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


def decode_attention_unscaled(q, k_new, v_new, k_cache, v_cache):
    return key.decode_attention(q * math.sqrt(q.shape[-1]), k_new, v_new, k_cache, v_cache)[0], \
        torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)  # forgot 1/sqrt(hd)


def decode_attention_tiled_heads(q, k_new, v_new, k_cache, v_cache):
    """GQA with repeat (KV head h % H_kv) instead of repeat_interleave (h // group)."""
    k_all, v_all = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
    group = q.shape[1] // k_all.shape[1]
    k_rep, v_rep = k_all.repeat(1, group, 1, 1), v_all.repeat(1, group, 1, 1)
    p = (q @ k_rep.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    return p @ v_rep, k_all, v_all


def decode_attention_without_itself(q, k_new, v_new, k_cache, v_cache):
    """Attends over the old cache plus a zero key instead of the new token's key."""
    out, k_all, v_all = key.decode_attention(q, torch.zeros_like(k_new), v_new, k_cache, v_cache)
    return out, torch.cat([k_cache, k_new], 2), v_all


def h2o_keep_no_recent(score, pos, end, budget, n_recent):
    return score.topk(budget, dim=-1).indices.sort(dim=-1).values  # recent tokens not protected


def h2o_keep_unsorted(score, pos, end, budget, n_recent):
    priority = score.masked_fill(pos >= end - n_recent, float("inf"))
    return priority.topk(budget, dim=-1).indices  # right tokens, in score order


def visible_keys_ignores_chunk(n, window, n_sink=0, chunk=1):
    return key.visible_keys(n, window, n_sink, 1)  # evicts after every token


def visible_keys_window_includes_self(n, window, n_sink=0, chunk=1):
    allowed = key.visible_keys(n, window, n_sink, chunk)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return allowed & ((j < n_sink) | (j > i - window + n_sink))  # window counts the query too


CHECKS = [
    (ch02.check_kv_bytes, key.kv_bytes, kv_bytes_no_v),
    (ch02.check_kv_bytes, key.kv_bytes, kv_bytes_mla_as_mha),
    (ch02.check_score_entries, key.score_entries, score_entries_square),
    (ch02.check_cache_append, key.GrowingCache, ForgetfulCache),
    (ch02.check_cache_append, key.GrowingCache, NewestFirstCache),
    (ch02.check_sliding_window, key.kept_positions, kept_without_sinks),
    (ch02.check_sliding_window, key.kept_positions, kept_off_by_one),
    (ch02.check_decode_attention, key.decode_attention, decode_attention_unscaled),
    (ch02.check_decode_attention, key.decode_attention, decode_attention_tiled_heads),
    (ch02.check_decode_attention, key.decode_attention, decode_attention_without_itself),
    (ch02.check_h2o_keep, key.h2o_keep, h2o_keep_no_recent),
    (ch02.check_h2o_keep, key.h2o_keep, h2o_keep_unsorted),
    (ch02.check_visible_keys, key.visible_keys, visible_keys_ignores_chunk),
    (ch02.check_visible_keys, key.visible_keys, visible_keys_window_includes_self),
]
IDS = ["kv_bytes", "kv_bytes_mla", "score_entries", "cache_forgetful", "cache_order",
       "window_sinks", "window_off_by_one", "decode_unscaled", "decode_gqa_heads",
       "decode_without_itself", "h2o_no_recent", "h2o_unsorted", "mask_ignores_chunk",
       "mask_window_includes_self"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_package_kvcache_passes_its_own_checker():
    assert ch02.check_cache_append(KVCache).passed is True
