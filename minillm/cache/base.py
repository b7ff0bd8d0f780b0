"""The interface every KV cache implements, so the model never knows which one it has.

A forward pass over T new tokens calls ``attend(layer, q, k, v)`` once per layer with the new
tokens' q [B, H, T, hd] and k, v [B, H_kv, T, hd] (RoPE already applied) and the layer's
attention function, then ``advance(T)`` once at the end. ``attend`` stores k and v, attends
over everything kept with that function, and returns [B, H, T, hd].
"""
from __future__ import annotations

import torch

from ..attention import AttentionFn, sdpa_attention


class Cache:
    """Base class: subclasses implement ``update``; ``attend`` uses it with fused attention."""

    #: positions seen so far (RoPE position of the next token); may exceed what is kept
    seen: int = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the new k, v [B, H_kv, T, hd]; return all kept (k, v) [B, H_kv, L, hd]."""
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn: AttentionFn = sdpa_attention) -> torch.Tensor:
        k_all, v_all = self.update(layer, k, v)
        return attn_fn(q, k_all, v_all)

    def advance(self, t: int) -> None:
        """Called once after all layers processed T new tokens."""
        self.seen += t

    def __len__(self) -> int:
        """Tokens currently kept."""
        raise NotImplementedError
