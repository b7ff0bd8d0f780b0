"""Attention written out as the maths: scores, mask, softmax, weighted sum. The one reference
every other attention in the package (SDPA, the Triton kernels, the paged and sequence-parallel
paths) is tested against or built on."""
from __future__ import annotations

import math

import torch


def causal_mask(t: int, l: int, device=None) -> torch.Tensor:
    """[T, L] bool, True where query i (the (L-T+i)-th position) may attend to key j."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(l, device=device)[None, :]
    return j <= i + (l - t)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None, scale: float | None = None,
                       return_probs: bool = False):
    """softmax(q k^T * scale, hiding keys where ``mask`` is False) v, with its log-sum-exp.

    q [..., H, T, D], k and v [..., H_kv, L, D] with H a multiple of H_kv (GQA: K/V heads are
    repeated); mask bool, broadcastable to [..., H, T, L]; scale defaults to 1/sqrt(D).
    Returns (out [..., H, T, D] in q's dtype, lse [..., H, T]) and, with ``return_probs``, the
    probabilities [..., H, T, L]. Computed in float32 at least (float64 for float64 inputs: the
    high-precision reference of the tests). A row with no visible key gives out 0, lse -inf
    (the rule merges of partial results rely on).
    """
    group = q.shape[-3] // k.shape[-3]
    dt = torch.promote_types(q.dtype, torch.float32)
    k = k.repeat_interleave(group, dim=-3).to(dt)
    v = v.repeat_interleave(group, dim=-3).to(dt)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.to(dt) @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = (probs @ v).to(q.dtype)
    return (out, lse, probs) if return_probs else (out, lse)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        return_probs: bool = False):
    """The causal backend: q [B, H, T, hd], k/v [B, H_kv, L, hd], the T queries being the last T
    of the L positions -> out [B, H, T, hd] (and probs [B, H, T, L] in q's dtype)."""
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    out, _, probs = attention_with_lse(q, k, v, mask, return_probs=True)
    return (out, probs.to(q.dtype)) if return_probs else out
