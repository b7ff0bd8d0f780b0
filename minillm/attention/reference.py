"""Attention written out as the maths: scores, mask, softmax, weighted sum (for teaching/tests)."""
from __future__ import annotations

import math

import torch


def causal_mask(t: int, l: int, device=None) -> torch.Tensor:
    """[T, L] bool, True where query i (the (L-T+i)-th position) may attend to key j."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(l, device=device)[None, :]
    return j <= i + (l - t)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        return_probs: bool = False):
    """softmax(q k^T / sqrt(hd) + causal mask) v, with K/V heads repeated for GQA.

    q [B, H, T, hd], k/v [B, H_kv, L, hd] -> out [B, H, T, hd] (and probs [B, H, T, L]).
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = causal_mask(q.shape[2], k.shape[2], q.device)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = probs @ v
    return (out, probs) if return_probs else out
