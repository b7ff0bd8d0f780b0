"""A static-shape KV cache: what graph capture and compilation need (appendix C).

The contiguous :class:`~minillm.cache.contiguous.KVCache` returns a view of the first
``length`` slots, so every decode step has a new shape; a captured CUDA graph or a compiled
step cannot follow that. Here every layer owns fixed buffers k, v [B, H_kv, max_len, hd]; a
step writes its new keys and values at explicit positions (a tensor, so nothing is read back
to Python) and attends over all ``max_len`` slots under a mask ``slot <= position``: the same
shapes at every step. Unwritten slots hold zeros and are masked out.

The caller owns the positions: :meth:`set_step` names the rows of the batch (a slice, the
same one per captured graph) and the positions [b, T] of the new tokens before each forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import AttentionFn
from ..config import ModelConfig
from .base import Cache


class StaticKVCache(Cache):
    """Fixed buffers ``k[layer], v[layer]`` [max_batch, H_kv, max_len, hd], one per layer
    (one tensor per layer keeps an in-place write of one layer from touching the others)."""

    def __init__(self, cfg: ModelConfig, max_batch: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len must be in [1, {cfg.max_seq_len}], got {max_len}")
        shape = (max_batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_batch, self.max_len = max_batch, max_len
        self.rows = slice(0, 1)
        self.positions = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(1, 1, 1, max_len, dtype=torch.bool, device=device)
        self.group = cfg.n_heads // cfg.n_kv_heads

    def set_step(self, rows: slice, positions: torch.Tensor) -> None:
        """The next forward runs the batch rows ``rows`` with new tokens at ``positions``
        [b, T] (b = the rows' count). Builds the mask [b, 1, group * T, max_len]: query row
        (g, t) of a KV head sees the slots up to its own position."""
        b, t = positions.shape
        if len(range(*rows.indices(self.max_batch))) != b:
            raise ValueError(f"rows {rows} do not match positions of batch {b}")
        self.rows, self.positions = rows, positions
        slots = torch.arange(self.max_len, device=positions.device)
        seen = slots[None, None, :] <= positions[:, :, None]               # [b, T, L]
        self.mask = seen[:, None, None].expand(b, 1, self.group, t, self.max_len) \
            .reshape(b, 1, self.group * t, self.max_len)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [b, H_kv, T, hd] at the step's positions; return the whole buffers
        [b, H_kv, max_len, hd] of the step's rows."""
        b, h = k.shape[:2]
        first, dev = self.rows.start or 0, k.device
        at = (torch.arange(first, first + b, device=dev)[:, None, None],
              torch.arange(h, device=dev)[None, :, None], self.positions[:, None, :])
        # index_put_ into the whole buffer (a write through a row slice would make a compiler
        # copy the whole buffer back every step)
        self.k[layer].index_put_(at, k)
        self.v[layer].index_put_(at, v)
        return self.k[layer][self.rows], self.v[layer][self.rows]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn: AttentionFn | None = None) -> torch.Tensor:
        """q [b, H, T, hd] -> [b, H, T, hd] over every slot, masked (``attn_fn`` is not used:
        the mask is what keeps the shapes static)."""
        kb, vb = self.update(layer, k, v)
        b, h, t, hd = q.shape
        qg = q.reshape(b, kb.shape[1], self.group * t, hd)
        out = F.scaled_dot_product_attention(qg, kb, vb, attn_mask=self.mask)
        return out.reshape(b, h, t, hd)

    def advance(self, t: int) -> None:
        """Nothing: positions are the caller's (a Python counter would defeat capture)."""

    def __len__(self) -> int:
        return self.max_len

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.k + self.v)
