"""How the KV cache stores keys and values: the model's dtype, a narrower float, or int8.

A decode step reads every cached key and value of every sequence once per layer, so at long
contexts and large batches the KV bytes, not the weights, set the step's time and how many
sequences fit in memory. Storing them narrower than the model computes trades a little accuracy
for both:

- ``bfloat16`` beside a float32 model: half the bytes, each element rounded to 8
  significant bits;
- ``int8``: a quarter of float32's bytes plus one float32 scale per token and KV head. Each
  head's vector x [D] is stored as round(x / s) with s = max|x| / 127 (symmetric, "absmax"),
  and read back as q * s. Keys and values are quantized the same way (KIVI, Liu et al. 2024,
  quantizes keys per channel instead because of their outlier channels; a per-token scale is
  what vLLM's and LMDeploy's int8 caches use and needs no calibration).

An int8 paged cache is an :class:`Int8Blocks` (data and scales side by side); a float one is a
plain tensor. :func:`read_blocks` gathers blocks of either as floats, which is what the SDPA
paths do; the C++ kernel reads int8 blocks in place and widens them per block.

Shapes: a paged layer's cache is [num_blocks, block_size, Hkv, D]; its int8 scales
[num_blocks, block_size, Hkv].
"""
from __future__ import annotations

from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
SCALE_DTYPE = torch.float32


class Int8Blocks(NamedTuple):
    """One layer's int8 cache: data int8 [num_blocks, block_size, Hkv, D] and scale float32
    [num_blocks, block_size, Hkv] (element = data * scale)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def resolve_kv_dtype(kv_cache_dtype: str | torch.dtype | None, model_dtype: torch.dtype
                     ) -> torch.dtype:
    """The storage dtype for the option ``kv_cache_dtype`` ("auto"/None: the model's)."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return model_dtype
    name = str(kv_cache_dtype).removeprefix("torch.")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    return getattr(torch, name)


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int,
                       kv_dtype: torch.dtype) -> int:
    """Bytes one token keeps in the cache, all layers, K and V (int8: its scales included)."""
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    per_head = head_dim * elem + (SCALE_DTYPE.itemsize if kv_dtype == torch.int8 else 0)
    return 2 * n_layers * n_kv_heads * per_head


def quantize_absmax(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D] in [-qmax, qmax], float32 scale [...]) with qmax =
    2^(bits-1) - 1: symmetric per-vector absmax, scale = max|x| / qmax, q = round(x / scale)
    (ties to even). An all-zero vector gets scale 0 (and reads back as zeros)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in [2, 8], got {bits}")
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-1).to(SCALE_DTYPE) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x.to(SCALE_DTYPE) / safe[..., None]).round().clamp_(-qmax, qmax)
    return q.to(torch.int8), scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scale [...]): the 8-bit :func:`quantize_absmax`,
    the engine's int8 cache."""
    return quantize_absmax(x, 8)


def dequantize_int8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D] and scale [...] -> [..., D] in ``dtype``."""
    return (data.to(SCALE_DTYPE) * scale[..., None]).to(dtype)


def store(cache: torch.Tensor | Int8Blocks, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Write x [N, Hkv, D] (the model's dtype) at token ``slots`` [N] (block * block_size +
    offset) of a layer's cache, converted to its format."""
    if isinstance(cache, Int8Blocks):
        data, scale = quantize_int8(x)
        cache.data.view(-1, *cache.data.shape[2:]).index_copy_(0, slots, data)
        cache.scale.view(-1, cache.scale.shape[2]).index_copy_(0, slots, scale)
    else:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


def read_blocks(cache: torch.Tensor | Int8Blocks, blocks: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
    """Blocks ``blocks`` [M] of a layer's cache as [M, block_size, Hkv, D] in ``dtype``."""
    if isinstance(cache, Int8Blocks):
        return dequantize_int8(cache.data.index_select(0, blocks),
                               cache.scale.index_select(0, blocks), dtype)
    return cache.index_select(0, blocks).to(dtype)
