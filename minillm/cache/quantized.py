"""A contiguous KV cache that stores keys and values narrower than the model computes (chapter
02): bfloat16 below a float32 model, or int8 with one float32 scale per token and KV head
(:mod:`minillm.attention.kv_quant`, the format the engine's ``kv_cache_dtype`` uses).

Every ``update`` stores the new k, v in that format and hands attention the whole kept cache
read back in the model's dtype, the new tokens included: so one forward pass through it, a
prefill, already sees exactly what later decode steps read, and its perplexity
(:func:`minillm.evaluate.perplexity`) is the storage format's accuracy cost.
Size: layers x B x H_kv x max_len x (hd x element bytes, + 4 for int8's scale) x 2.
"""
from __future__ import annotations

import torch

from ..attention.kv_quant import dequantize_int8, quantize_int8, resolve_kv_dtype
from ..config import ModelConfig
from .contiguous import KVCache


class QuantizedKVCache(KVCache):
    """:class:`KVCache` whose buffers hold ``kv_dtype`` ("int8", "bfloat16", ...); attention
    gets them back as ``dtype``."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 kv_dtype: str | torch.dtype = "int8") -> None:
        self.kv_dtype = resolve_kv_dtype(kv_dtype, dtype)
        super().__init__(cfg, batch_size, max_len, device, self.kv_dtype)
        self.dtype = dtype
        self.k_scale = self.v_scale = None
        if self.kv_dtype == torch.int8:
            self.k_scale, self.v_scale = (torch.zeros(self.k.shape[:-1], device=device)
                                          for _ in range(2))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, H_kv, T, hd] as ``kv_dtype``; return all kept, read back as
        ``dtype``, [B, H_kv, L, hd] each."""
        start, end = self.seen, self.seen + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.max_len}")
        if self.k_scale is None:
            self.k[layer, :, :, start:end] = k.to(self.kv_dtype)
            self.v[layer, :, :, start:end] = v.to(self.kv_dtype)
            return (self.k[layer, :, :, :end].to(self.dtype),
                    self.v[layer, :, :, :end].to(self.dtype))
        out = []
        for data, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            data[layer, :, :, start:end], scale[layer, :, :, start:end] = quantize_int8(x)
            out.append(dequantize_int8(data[layer, :, :, :end], scale[layer, :, :, :end],
                                       self.dtype))
        return out[0], out[1]

    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else 2 * self.k_scale.numel() * 4
        return super().nbytes() + scales
