"""Chapter 03's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import torch
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


def attention_partials(attn, x, cos, sin, world_size):
    b, t, _ = x.shape
    h, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    per, group = h // world_size, h // hkv
    parts = []
    for r in range(world_size):
        heads = range(r * per, (r + 1) * per)
        kv = sorted({i // group for i in heads})  # the KV heads my query heads read
        q_rows = slice(heads.start * hd, heads.stop * hd)
        kv_rows = slice(kv[0] * hd, (kv[-1] + 1) * hd)
        q = (x @ attn.wq.weight[q_rows].T).view(b, t, per, hd).transpose(1, 2)
        k = (x @ attn.wk.weight[kv_rows].T).view(b, t, len(kv), hd).transpose(1, 2)
        v = (x @ attn.wv.weight[kv_rows].T).view(b, t, len(kv), hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k = k.repeat_interleave(per // len(kv), dim=1)
        v = v.repeat_interleave(per // len(kv), dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        parts.append(out.transpose(1, 2).reshape(b, t, per * hd) @ attn.wo.weight[:, q_rows].T)
    return parts


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def mlp_on_rank(block, rank, world_size, all_reduce):
    ffn, f = block.ffn, block.ffn.w_gate.weight.shape[0]
    units = slice(rank * f // world_size, (rank + 1) * f // world_size)  # uneven: +-1 unit
    w_gate = ffn.w_gate.weight[units].clone()  # copies: a slice would keep the whole matrix
    w_up = ffn.w_up.weight[units].clone()
    w_down = ffn.w_down.weight[:, units].clone()
    norm = block.ffn_norm  # replicated: every rank normalises the same x

    def forward(x):
        h = norm(x)
        partial = (F.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
        return x + all_reduce(partial)  # the residual once, after the sum

    return forward


def attention_on_rank(block, rank, world_size, all_reduce):
    attn, norm = block.attn, block.attn_norm
    h, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    per, group = h // world_size, h // hkv
    heads = range(rank * per, (rank + 1) * per)
    kv = range(heads.start // group, (heads.stop - 1) // group + 1)  # the KV heads they read
    q_rows = slice(heads.start * hd, heads.stop * hd)
    kv_rows = slice(kv.start * hd, kv.stop * hd)
    wq, wo = attn.wq.weight[q_rows].clone(), attn.wo.weight[:, q_rows].clone()
    wk, wv = attn.wk.weight[kv_rows].clone(), attn.wv.weight[kv_rows].clone()

    def forward(x, cos, sin):
        b, t, _ = x.shape
        y = norm(x)
        q = (y @ wq.T).view(b, t, per, hd).transpose(1, 2)
        k = (y @ wk.T).view(b, t, len(kv), hd).transpose(1, 2)
        v = (y @ wv.T).view(b, t, len(kv), hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k = k.repeat_interleave(per // len(kv), dim=1)
        v = v.repeat_interleave(per // len(kv), dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + all_reduce(out.transpose(1, 2).reshape(b, t, per * hd) @ wo.T)

    return forward


def gpipe_slots(p, m):
    return [[s + i for i in range(m)] for s in range(p)]


def gpipe_times(costs):
    start = []
    for s, row in enumerate(costs):
        start.append([])
        for i in range(len(row)):
            stage_free = start[s][i - 1] + row[i - 1] if i else 0.0
            micro_ready = start[s - 1][i] + costs[s - 1][i] if s else 0.0
            start[s].append(max(stage_free, micro_ready))
    return start


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
    (ch03.check_mlp_on_ranks, mlp_on_rank),
    (ch03.check_attention_partials, attention_partials),
    (ch03.check_attention_on_ranks, attention_on_rank),
    (ch03.check_gpipe_slots, gpipe_slots),
    (ch03.check_gpipe_times, gpipe_times),
    (ch03.check_dispatch_counts, dispatch_counts),
    (ch03.check_kv_heads, kv_heads),
]
