"""The paged KV pool on the model's device, a CPU swap pool, and the per-step cache view.

Pool tensors k, v: [n_layers, num_blocks, block_size, Hkv, D]; layer l's slice is the
[num_blocks, block_size, Hkv, D] layout of the paged kernels. They hold the model's dtype, or
what ``kv_dtype`` says (:mod:`minillm.attention.kv_quant`: a narrower float, or int8 with the
scales k_scale, v_scale [n_layers, num_blocks, block_size, Hkv] beside them); ``layer(l)``
gives the layer's cache in the form the attention backends read. Which block belongs to whom is
decided by :class:`minillm.cache.block_manager.BlockManager`; the pool only moves data:
copy-on-write copies, swap out (device -> CPU pool) and swap in, and slot copies that compact
kept tokens into place (speculative decoding's accepted tree nodes).

Ordering on CUDA: every copy is issued on the current stream, so the kernels that later read or
overwrite a block run after it. A swap-out's device-to-host copy lands in a pinned staging
buffer and the host waits on an event before writing the CPU pool (reading it any earlier would
see unfinished data); a swap-in copies from pinned memory without blocking the host.
"""
from __future__ import annotations

import torch

from ..attention.kv_quant import Int8Blocks, dequantize_int8, kv_bytes_per_token, store
from ..attention.paged import PagedAttentionFn, PagedMetadata, write_kv
from ..config import ModelConfig
from .base import Cache


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V, stored as ``dtype`` (int8: with its
    scales)."""
    return block_size * kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype)


class PagedKVPool:
    """K/V storage for ``num_blocks`` device blocks and ``num_cpu_blocks`` swap blocks, for a
    model computing in ``dtype``; stored as ``kv_dtype`` (default ``dtype``)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, num_cpu_blocks: int = 0,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        cpu_shape = (cfg.n_layers, num_cpu_blocks, *shape[2:])
        pin = device.type == "cuda"
        self.k, self.v = (torch.zeros(shape, device=device, dtype=self.kv_dtype)
                          for _ in range(2))
        self.cpu_k, self.cpu_v = (torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin)
                                  for _ in range(2))
        self.k_scale = self.v_scale = self.cpu_k_scale = self.cpu_v_scale = None
        if self.kv_dtype == torch.int8:
            self.k_scale, self.v_scale = (torch.zeros(shape[:-1], device=device)
                                          for _ in range(2))
            self.cpu_k_scale, self.cpu_v_scale = (torch.zeros(cpu_shape[:-1], pin_memory=pin)
                                                  for _ in range(2))
        self.block_size = block_size

    def planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (device tensor, CPU swap tensor) pair a block lives in, blocks on dim 1:
        K and V, and their scales for int8."""
        pairs = [(self.k, self.cpu_k), (self.v, self.cpu_v)]
        if self.k_scale is not None:
            pairs += [(self.k_scale, self.cpu_k_scale), (self.v_scale, self.cpu_v_scale)]
        return pairs

    def layer(self, layer: int) -> tuple[torch.Tensor | Int8Blocks, torch.Tensor | Int8Blocks]:
        """Layer ``layer``'s (k_cache, v_cache) [num_blocks, block_size, Hkv, D]: tensors, or
        :class:`~minillm.attention.kv_quant.Int8Blocks` for an int8 pool."""
        if self.k_scale is None:
            return self.k[layer], self.v[layer]
        return (Int8Blocks(self.k[layer], self.k_scale[layer]),
                Int8Blocks(self.v[layer], self.v_scale[layer]))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's contents (all layers)."""
        for dev, _ in self.planes():
            _copy(dev, dev, pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs: device -> CPU. Returns once the CPU pool holds them."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k.device)
        dst = torch.tensor([p[1] for p in pairs])
        planes = self.planes()
        staged = [torch.empty((x.shape[0], len(pairs), *x.shape[2:]), dtype=x.dtype,
                              pin_memory=self.k.device.type == "cuda") for x, _ in planes]
        for stage, (pool, _) in zip(staged, planes):
            stage.copy_(pool[:, src], non_blocking=True)
        if self.k.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()   # the host reads the staging buffers next
        for stage, (_, cpu) in zip(staged, planes):
            cpu[:, dst] = stage

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs: CPU -> device."""
        for dev, cpu in self.planes():
            _copy(cpu, dev, pairs)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Token slot ``src[i]`` -> slot ``dst[i]`` (slot = block * block_size + offset), every
        layer, K and V: keeps accepted tokens and drops the rest when a tree is verified."""
        if len(src) != len(dst):
            raise ValueError(f"src and dst must have the same length, got {len(src)}, {len(dst)}")
        if not src:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        for pool, _ in self.planes():
            flat = pool.view(pool.shape[0], -1, *pool.shape[3:])
            flat[:, d] = flat[:, s]          # gathered first, so overlapping moves are safe

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """The blocks' K and V gathered into one CPU staging tensor
        [2, n_layers, len(blocks) * block_size, Hkv, hd] in the model's dtype (an int8 or
        narrower cache read back; a copy: the pool may change after)."""
        idx = torch.tensor(blocks, device=self.k.device)
        parts = [self.k[:, idx], self.v[:, idx]]
        if self.k_scale is not None:
            parts = [dequantize_int8(x, s[:, idx], self.dtype)
                     for x, s in zip(parts, (self.k_scale, self.v_scale))]
        kv = torch.stack(parts).to(self.dtype).flatten(2, 3)
        return kv.cpu() if kv.device.type != "cpu" else kv

    def write_layer(self, layer: int, blocks: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Scatter k, v [len(blocks) * block_size, Hkv, hd] (the model's dtype) into layer
        ``layer`` of ``blocks`` (a LongTensor on the pool's device), in the pool's format."""
        slots = (blocks[:, None] * self.block_size +
                 torch.arange(self.block_size, device=blocks.device)).flatten()
        for cache, x in zip(self.layer(layer), (k, v)):
            store(cache, x.to(self.k.device, non_blocking=True), slots)

    def write_blocks(self, blocks: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter a staging tensor [2, n_layers, len(blocks) * block_size, Hkv, hd] into
        ``blocks``, every layer."""
        for layer in range(kv.shape[1]):
            self.write_layer(layer, blocks, kv[0, layer], kv[1, layer])

    def nbytes(self) -> int:
        """Bytes of the device pool (K, V and any scales)."""
        return sum(dev.numel() * dev.element_size() for dev, _ in self.planes())


def _copy(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    if not pairs:
        return
    s = torch.tensor([p[0] for p in pairs], device=src.device)
    d = torch.tensor([p[1] for p in pairs], device=dst.device)
    dst[:, d] = src[:, s].to(dst.device, non_blocking=True)


class PagedBatch(Cache):
    """The cache the model sees during one engine step: q, k, v of the flat batch arrive as
    [1, H, N, D]; k and v are written at ``meta.slot_mapping`` and attention runs through the
    paged backend. The layer's own dense attention function is not used."""

    def __init__(self, pool: PagedKVPool, meta: PagedMetadata, attn: PagedAttentionFn) -> None:
        self.pool, self.meta, self.attn = pool, meta, attn

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn=None) -> torch.Tensor:
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))    # [N, H, D]
        k_cache, v_cache = self.pool.layer(layer)
        write_kv(k_cache, v_cache, k, v, self.meta.slot_mapping)
        out = self.attn(q.contiguous(), k, v, k_cache, v_cache, self.meta)
        return out.transpose(0, 1)[None]                         # [1, Hq, N, D]

    def advance(self, t: int) -> None:
        """Positions are per sequence (the runner passes them); nothing to count here."""
