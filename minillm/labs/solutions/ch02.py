"""Chapter 02's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

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


def kept_positions(n_seen, window, n_sink=0):
    recent = range(max(n_sink, n_seen - (window - n_sink)), n_seen)
    return sorted(set(range(min(n_sink, n_seen))) | set(recent))


KEY = [
    (ch02.check_kv_bytes, kv_bytes),
    (ch02.check_score_entries, score_entries),
    (ch02.check_cache_append, GrowingCache),
    (ch02.check_sliding_window, kept_positions),
]
