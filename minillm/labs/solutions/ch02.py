"""Chapter 02's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import math

import torch

from minillm.cache import Cache
from minillm.course.ch02_kv_memory import MLASpec
from minillm.labs import ch02


def kv_bytes(cfg, tokens, batch=1, bytes_per_elem=2):
    if isinstance(cfg, MLASpec):  # one latent plus one shared RoPE key per token and layer
        per_token = cfg.n_layers * (cfg.kv_lora_rank + cfg.rope_dim)
    else:
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    return per_token * tokens * batch * bytes_per_elem


def quantize_kv(x, bits):
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=-1).float() / qmax           # one scale per vector of D numbers
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x.float() / safe.unsqueeze(-1)).clamp(-qmax, qmax)
    return q.to(torch.int8), scale


def score_entries(n):
    return n * (n + 1) // 2, n * (n + 1) * (n + 2) // 6


class GrowingCache(Cache):
    """Concatenates new K/V onto the old ones (slower than preallocating, but correct)."""

    def __init__(self, cfg, batch_size, max_len, device="cpu", dtype=torch.float32):
        self.k = [None] * cfg.n_layers
        self.v = [None] * cfg.n_layers
        self.seen = 0

    def update(self, layer, k, v):
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def __len__(self):
        return self.seen


class DoublingCache(Cache):
    """The exercise's cache: per layer, buffers that start at 4 tokens and double until an
    update fits, the old contents copied across."""

    def __init__(self, cfg, batch_size, max_len, device="cpu", dtype=torch.float32):
        shape = (batch_size, cfg.n_kv_heads, 4, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.seen = 0

    def update(self, layer, k, v):
        end = self.seen + k.shape[2]
        capacity = self.k[layer].shape[2]
        while capacity < end:
            capacity *= 2
        if capacity > self.k[layer].shape[2]:
            for buffers in (self.k, self.v):
                old = buffers[layer]
                buffers[layer] = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
                buffers[layer][:, :, :self.seen] = old[:, :, :self.seen]
        self.k[layer][:, :, self.seen:end] = k
        self.v[layer][:, :, self.seen:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def __len__(self):
        return self.seen


def kept_positions(n_seen, window, n_sink=0):
    recent = range(max(n_sink, n_seen - (window - n_sink)), n_seen)
    return sorted(set(range(min(n_sink, n_seen))) | set(recent))


def decode_attention(q, k_new, v_new, k_cache, v_cache):
    k_cache = torch.cat([k_cache, k_new], dim=2)  # [B, H_kv, L + 1, hd], oldest first
    v_cache = torch.cat([v_cache, v_new], dim=2)
    b, h, _, hd = q.shape
    group = h // k_cache.shape[1]
    qg = q.reshape(b, k_cache.shape[1], group, hd)  # heads h = kv * group + g share KV head kv
    scores = qg @ k_cache.transpose(-1, -2) / math.sqrt(hd)  # [B, H_kv, group, L + 1]
    out = scores.softmax(dim=-1) @ v_cache  # the newest token may see everything cached
    return out.reshape(b, h, 1, hd), k_cache, v_cache


def h2o_keep(score, pos, end, budget, n_recent):
    keep = []
    for s_row, p_row in zip(score.reshape(-1, score.shape[-1]), pos.reshape(-1, pos.shape[-1])):
        recent = [i for i in range(len(p_row)) if p_row[i] >= end - n_recent]
        others = sorted((i for i in range(len(p_row)) if p_row[i] < end - n_recent),
                        key=lambda i: -float(s_row[i]))
        keep.append(sorted(recent + others[:budget - len(recent)]))
    return torch.tensor(keep, dtype=torch.long).reshape(*score.shape[:-1], budget)


def visible_keys(n, window, n_sink=0, chunk=1):
    allowed = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    while start < n:  # one forward pass: the first `window` tokens, then `chunk` at a time
        end = min(n, start + (window if start == 0 else chunk))
        kept = set(range(min(n_sink, start))) | set(range(max(0, start - (window - n_sink)),
                                                          start))
        for i in range(start, end):
            for j in kept | set(range(start, i + 1)):
                allowed[i, j] = True
        start = end
    return allowed


KEY = [
    (ch02.check_kv_bytes, kv_bytes),
    (ch02.check_score_entries, score_entries),
    (ch02.check_cache_append, DoublingCache),
    (ch02.check_sliding_window, kept_positions),
    (ch02.check_decode_attention, decode_attention),
    (ch02.check_quantize_kv, quantize_kv),
    (ch02.check_h2o_keep, h2o_keep),
    (ch02.check_visible_keys, visible_keys),
]
