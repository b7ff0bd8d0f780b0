"""Chapter 01's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import math

import torch

from minillm.labs import ch01


def rmsnorm(x, weight, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rmsnorm_float64(x, weight, eps):  # statistics in float64: also right
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.double() * normed).to(x.dtype)


def rope(x, positions, theta):
    """RoPE with complex numbers: the pair (x_i, x_{i+d/2}) is the number x_i + j x_{i+d/2}."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * freq
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * torch.polar(
        torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def causal_attention(q, k, v):
    """GQA without copying K/V: fold each group of query heads into one axis."""
    b, h, t, d = q.shape
    h_kv, l = k.shape[1], k.shape[2]
    qg = q.reshape(b, h_kv, h // h_kv * t, d)
    scores = qg @ k.transpose(-1, -2) / math.sqrt(d)  # [B, H_kv, group*T, L]
    i = torch.arange(t).repeat(h // h_kv)[:, None]
    j = torch.arange(l)[None, :]
    scores = scores.masked_fill(j > i + (l - t), float("-inf"))
    return (scores.softmax(-1) @ v).reshape(b, h, t, d)


def top_p(logits, p):
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    drop_sorted = probs.cumsum(-1) - probs >= p  # mass of the strictly more likely tokens
    if p >= 1:
        drop_sorted[:] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_p_shifted(logits, p):
    """Another correct way: drop tokens whose cumulative mass exceeds p, shifted by one so the
    token that crosses p stays."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop_sorted = sorted_logits.softmax(-1).cumsum(-1) > p
    drop_sorted = torch.cat([torch.zeros_like(drop_sorted[..., :1]), drop_sorted[..., :-1]], -1)
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def rope_real(x, positions, theta):
    """The same RoPE with cos/sin on real tensors."""
    d = x.shape[-1]
    angle = positions.float()[:, None] * theta ** (-torch.arange(0, d, 2).float() / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)


def causal_attention_repeat(q, k, v):
    """The same attention, copying each KV head for its group of query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t, l = q.shape[2], k.shape[2]
    future = torch.ones(t, l, dtype=torch.bool).triu(l - t + 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


KEY = [
    (ch01.check_rmsnorm, rmsnorm),
    (ch01.check_rope, rope),
    (ch01.check_causal_attention, causal_attention),
    (ch01.check_top_p, top_p),
]
