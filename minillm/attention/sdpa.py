"""Attention through PyTorch's fused ``scaled_dot_product_attention``.

GQA without copying K/V: the ``group`` query heads that share a KV head are folded into the
query-length axis, q [B, H, T, hd] -> [B, H_kv, group*T, hd], so each KV head is read once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import causal_mask


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, hd], k/v [B, H_kv, L, hd] -> [B, H, T, hd] (causal, queries last)."""
    b, h, t, hd = q.shape
    h_kv, l = k.shape[1], k.shape[2]
    group = h // h_kv
    if t == l:  # no cache: the plain causal case, the fused kernels handle it best
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    qg = q.reshape(b, h_kv, group * t, hd)
    mask = None
    if t > 1:  # every query sees the whole cache plus the new tokens up to itself
        mask = causal_mask(t, l, q.device).repeat(group, 1)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(b, h, t, hd)
