"""Chapter 02 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import math

import pytest
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


class DoublesOnceCache(key.DoublingCache):
    """Doubles once when an update overflows: enough for short chunks, not for a long prompt."""

    def update(self, layer, k, v):
        end = self.seen + k.shape[2]
        if end > self.k[layer].shape[2]:
            for buffers in (self.k, self.v):
                old = buffers[layer]
                buffers[layer] = torch.cat([old, torch.zeros_like(old)], dim=2)
        self.k[layer][:, :, self.seen:end] = k
        self.v[layer][:, :, self.seen:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Float32Cache(key.DoublingCache):
    """Ignores the dtype it is given: float32 buffers under a float64 model."""

    def __init__(self, cfg, batch_size, max_len, device="cpu", dtype=torch.float32):
        super().__init__(cfg, batch_size, max_len, device)


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


def decode_attention_last_8(q, k_new, v_new, k_cache, v_cache):
    """Attends over the 8 newest keys only (a window, not a cache): right on short sequences."""
    out, k_all, v_all = key.decode_attention(q, k_new, v_new, k_cache[:, :, -7:],
                                             v_cache[:, :, -7:])
    return out, torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)


def h2o_keep_no_recent(score, pos, end, budget, n_recent):
    return score.topk(budget, dim=-1).indices.sort(dim=-1).values  # recent tokens not protected


def h2o_keep_unsorted(score, pos, end, budget, n_recent):
    priority = score.masked_fill(pos >= end - n_recent, float("inf"))
    return priority.topk(budget, dim=-1).indices  # right tokens, in score order


def h2o_keep_marks_scores_in_place(score, pos, end, budget, n_recent):
    """Right indices, but the recent tokens' scores in the cache become inf for good."""
    score[pos >= end - n_recent] = float("inf")
    return score.topk(budget, dim=-1).indices.sort(dim=-1).values


def quantize_kv_over_128(x, bits):
    q, _ = key.quantize_kv(x, bits)                           # scale max|x| / 2^(bits-1): clips
    scale = x.abs().amax(-1).float() / 2 ** (bits - 1)
    return (x / torch.where(scale > 0, scale, 1)[..., None]).round().clamp(-127, 127) \
        .to(torch.int8), scale


def quantize_kv_per_tensor(x, bits):
    qmax = 2 ** (bits - 1) - 1
    scale = (x.abs().amax() / qmax).expand(x.shape[:-1]).float().contiguous()
    return (x / scale.clamp_min(1e-30)[..., None]).round().to(torch.int8), scale


def quantize_kv_truncates(x, bits):
    q, scale = key.quantize_kv(x, bits)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x.float() / safe[..., None]).to(torch.int8), scale   # int8 cast truncates


def quantize_kv_per_channel(x, bits):
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-2, keepdim=True).float() / qmax     # KIVI's keys: over tokens
    q = (x.float() / scale.clamp_min(1e-30)).round().clamp(-qmax, qmax).to(torch.int8)
    return q, scale.squeeze(-2)[..., :1].expand(x.shape[:-1]).contiguous()


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
    (ch02.check_cache_append, key.DoublingCache, ForgetfulCache),
    (ch02.check_cache_append, key.DoublingCache, NewestFirstCache),
    (ch02.check_cache_append, key.DoublingCache, DoublesOnceCache),  # fails in generate
    (ch02.check_cache_append, key.DoublingCache, Float32Cache),  # fails in generate
    (ch02.check_sliding_window, key.kept_positions, kept_without_sinks),
    (ch02.check_sliding_window, key.kept_positions, kept_off_by_one),
    (ch02.check_decode_attention, key.decode_attention, decode_attention_unscaled),
    (ch02.check_decode_attention, key.decode_attention, decode_attention_tiled_heads),
    (ch02.check_decode_attention, key.decode_attention, decode_attention_without_itself),
    (ch02.check_decode_attention, key.decode_attention, decode_attention_last_8),  # in generate
    (ch02.check_h2o_keep, key.h2o_keep, h2o_keep_no_recent),
    (ch02.check_h2o_keep, key.h2o_keep, h2o_keep_unsorted),
    (ch02.check_h2o_keep, key.h2o_keep, h2o_keep_marks_scores_in_place),  # in the model
    (ch02.check_quantize_kv, key.quantize_kv, quantize_kv_over_128),
    (ch02.check_quantize_kv, key.quantize_kv, quantize_kv_per_tensor),
    (ch02.check_quantize_kv, key.quantize_kv, quantize_kv_truncates),
    (ch02.check_quantize_kv, key.quantize_kv, quantize_kv_per_channel),
    (ch02.check_visible_keys, key.visible_keys, visible_keys_ignores_chunk),
    (ch02.check_visible_keys, key.visible_keys, visible_keys_window_includes_self),
]
IDS = ["kv_bytes", "kv_bytes_mla", "score_entries", "cache_forgetful", "cache_order",
       "cache_doubles_once", "cache_float32", "window_sinks", "window_off_by_one",
       "decode_unscaled", "decode_gqa_heads", "decode_without_itself", "decode_last_8",
       "h2o_no_recent", "h2o_unsorted", "h2o_scores_in_place", "quant_over_128",
       "quant_per_tensor", "quant_truncates", "quant_per_channel", "mask_ignores_chunk",
       "mask_window_includes_self"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_package_kvcache_passes_its_own_checker():
    assert ch02.check_cache_append(KVCache).passed is True


def test_concatenating_cache_passes_too():
    assert ch02.check_cache_append(key.GrowingCache).passed is True


@pytest.mark.parametrize("checker, wrong, says", [
    (ch02.check_cache_append, DoublesOnceCache, "0 + 31 tokens, layer 0: update raised"),
    (ch02.check_cache_append, Float32Cache, "inside the model"),
    (ch02.check_decode_attention, decode_attention_last_8, "request"),
    (ch02.check_h2o_keep, h2o_keep_marks_scores_in_place, "a model reading"),
], ids=["doubles_once", "float32", "last_8", "scores_in_place"])
def test_right_on_its_own_wrong_in_the_model(checker, wrong, says):
    """These pass every case of their own; only the model running on them shows the mistake."""
    result = checker(wrong)
    assert result.passed is False and says in result.message, result.message


class DigitsTokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_in_model_runs_print_both_times(capsys):
    tok = DigitsTokenizer()
    assert ch02.check_decode_attention(key.decode_attention, prompts=[[1, 2, 3]],
                                       output_lens=[4], tok=tok).passed is True
    assert ch02.check_cache_append(key.DoublingCache, prompts=[[1] * 20], output_lens=[3],
                                   tok=tok).passed is True
    out = capsys.readouterr().out
    assert "gave the package's 4 greedy tokens" in out and "gave the package's 3" in out
    assert "'1 2 3' -> '" in out


def test_function_h2o_cache_serves_the_perplexity_run():
    """The notebook's H2O perplexities come from FunctionH2OCache when exercise 6 passed: the
    same losses as the package's cache."""
    from minillm import evaluate
    from minillm.labs.in_engine import demo_model

    model = demo_model()
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0))
    ref = evaluate.token_nll(model, ids, chunk=4,
                             cache_factory=lambda _n: evaluate.make_cache("h2o", model.cfg, 12))
    mine = evaluate.token_nll(model, ids, chunk=4, cache_factory=lambda _n: ch02.FunctionH2OCache(
        model.cfg, 12, 6, key.h2o_keep))
    assert torch.equal(mine, ref)
