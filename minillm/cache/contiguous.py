"""Preallocated contiguous KV cache: one [B, H_kv, max_len, hd] buffer per layer for K and V.

Appending writes in place (no reallocation, no concatenation); attention reads a view of the
first ``length`` slots. Size: 2 x layers x H_kv x max_len x hd x B x bytes per element.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .base import Cache


class KVCache(Cache):
    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.seen = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        start, end = self.seen, self.seen + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.max_len}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def __len__(self) -> int:
        return self.seen

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
