"""The paged KV pool on the model's device, a CPU swap pool, and the per-step cache view.

Pool tensors k, v: [n_layers, num_blocks, block_size, Hkv, D]; layer l's slice is the
[num_blocks, block_size, Hkv, D] layout of the paged kernels. Which block belongs to whom is
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

from ..attention.paged import PagedAttentionFn, PagedMetadata, write_kv
from ..config import ModelConfig
from .base import Cache


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * elem


class PagedKVPool:
    """K/V storage for ``num_blocks`` device blocks and ``num_cpu_blocks`` swap blocks."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, num_cpu_blocks: int = 0) -> None:
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        cpu_shape = (cfg.n_layers, num_cpu_blocks, *shape[2:])
        pin = device.type == "cuda"
        self.cpu_k = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self.cpu_v = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self.block_size = block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's contents (all layers)."""
        _copy(self.k, self.k, pairs)
        _copy(self.v, self.v, pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs: device -> CPU. Returns once the CPU pool holds them."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k.device)
        dst = torch.tensor([p[1] for p in pairs])
        staged = [torch.empty((x.shape[0], len(pairs), *x.shape[2:]), dtype=x.dtype,
                              pin_memory=self.k.device.type == "cuda") for x in (self.k, self.v)]
        for stage, pool in zip(staged, (self.k, self.v)):
            stage.copy_(pool[:, src], non_blocking=True)
        if self.k.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()   # the host reads the staging buffers next
        self.cpu_k[:, dst], self.cpu_v[:, dst] = staged

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs: CPU -> device."""
        _copy(self.cpu_k, self.k, pairs)
        _copy(self.cpu_v, self.v, pairs)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Token slot ``src[i]`` -> slot ``dst[i]`` (slot = block * block_size + offset), every
        layer, K and V: keeps accepted tokens and drops the rest when a tree is verified."""
        if len(src) != len(dst):
            raise ValueError(f"src and dst must have the same length, got {len(src)}, {len(dst)}")
        if not src:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        for pool in (self.k, self.v):
            flat = pool.view(pool.shape[0], -1, *pool.shape[3:])
            flat[:, d] = flat[:, s]          # gathered first, so overlapping moves are safe

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """The blocks' K and V gathered into one CPU staging tensor
        [2, n_layers, len(blocks) * block_size, Hkv, hd] (a copy: the pool may change after)."""
        idx = torch.tensor(blocks, device=self.k.device)
        kv = torch.stack([self.k[:, idx], self.v[:, idx]]).flatten(2, 3)
        return kv.cpu() if kv.device.type != "cpu" else kv

    def write_layer(self, layer: int, blocks: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Scatter k, v [len(blocks) * block_size, Hkv, hd] into layer ``layer`` of ``blocks``
        (a LongTensor on the pool's device)."""
        shape = (blocks.numel(), self.block_size, *k.shape[1:])
        self.k[layer, blocks] = k.view(shape).to(self.k.device, non_blocking=True)
        self.v[layer, blocks] = v.view(shape).to(self.v.device, non_blocking=True)

    def write_blocks(self, blocks: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter a staging tensor [2, n_layers, len(blocks) * block_size, Hkv, hd] into
        ``blocks``, every layer."""
        shape = (kv.shape[1], blocks.numel(), self.block_size, *kv.shape[3:])
        self.k[:, blocks] = kv[0].reshape(shape).to(self.k.device, non_blocking=True)
        self.v[:, blocks] = kv[1].reshape(shape).to(self.v.device, non_blocking=True)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


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
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        write_kv(k_cache, v_cache, k, v, self.meta.slot_mapping)
        out = self.attn(q.contiguous(), k, v, k_cache, v_cache, self.meta)
        return out.transpose(0, 1)[None]                         # [1, Hq, N, D]

    def advance(self, t: int) -> None:
        """Positions are per sequence (the runner passes them); nothing to count here."""
