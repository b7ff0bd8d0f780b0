"""Chapter 03's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import torch.nn.functional as F

from minillm.labs import ch03


def ffn_partials(ffn, x, world_size):
    per = ffn.w_gate.weight.shape[0] // world_size
    parts = []
    for r in range(world_size):
        cols = slice(r * per, (r + 1) * per)
        h = F.silu(x @ ffn.w_gate.weight[cols].T) * (x @ ffn.w_up.weight[cols].T)
        parts.append(h @ ffn.w_down.weight[:, cols].T)
    return parts


def gpipe_slots(p, m):
    return [[s + i for i in range(m)] for s in range(p)]


def dispatch_counts(experts, n_experts, world_size):
    per = n_experts // world_size
    return [int(((experts // per) == r).sum()) for r in range(world_size)]


def kv_heads(cfg, rank, world_size):
    if cfg.n_heads % world_size:
        raise ValueError("query heads do not split")
    if cfg.n_kv_heads % world_size == 0:
        per = cfg.n_kv_heads // world_size
        return list(range(rank * per, (rank + 1) * per))
    if world_size % cfg.n_kv_heads == 0:
        return [rank * cfg.n_kv_heads // world_size]
    raise ValueError("KV heads do not split")


KEY = [
    (ch03.check_ffn_partials, ffn_partials),
    (ch03.check_gpipe_slots, gpipe_slots),
    (ch03.check_dispatch_counts, dispatch_counts),
    (ch03.check_kv_heads, kv_heads),
]
