"""Attention over a paged KV cache for a whole engine step (selective batching, chapter 04).

One step packs the new tokens of every scheduled sequence into one flat batch of N rows: the
token-wise work (linears, norms, FFN) runs on all N rows at once, and attention is done per
sequence through the metadata below (Orca's *selective batching*). Decode sequences (one new
token each) come first, then sequences with several new tokens (prefill, recompute, later
chunked prefill). The cache layout is the kernels' (``minillm.kernels.paged_attention``):
k_cache, v_cache [num_blocks, block_size, Hkv, D] per layer.

Backends take q [N, Hq, D], the new tokens' k, v [N, Hkv, D] (already written into the cache),
the layer's caches and the :class:`PagedMetadata`, and return [N, Hq, D]:

- ``sdpa``: decode rows gather their blocks into a padded [B, Hkv, L, D] batch (one masked SDPA
  call); each multi-token sequence runs causal SDPA over its own keys (no gather when it has no
  cached prefix). Runs anywhere; the CPU default.
- ``triton``: the paged kernels of chapter 05 read the blocks in place: split-KV decode when every
  sequence decodes, otherwise one paged prefill kernel over the mixed batch (Pensieve-style).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .sdpa import sdpa_attention

DECODE_GROUP = 16


@dataclass
class DecodeGroup:
    """Decode rows [start, end): ``blocks`` int64 [(end - start) * W] lists the W block ids of each
    sequence's table (padded with block 0); ``mask`` bool [end - start, 1, 1, W * block_size]
    marks the real keys among those blocks' slots."""

    start: int
    end: int
    blocks: torch.Tensor
    mask: torch.Tensor


@dataclass
class PagedMetadata:
    """Where each row of a step's flat batch lives. S sequences, N rows, the first
    ``num_decode`` sequences have one new token each.

    slot_mapping: int64 [N], cache slot (block * block_size + offset) of each new token.
    block_tables: int32 [S, max_blocks]; seq_lens: int32 [S], tokens in the cache after this step.
    cu_seqlens_q: int32 [S + 1], row ranges of each sequence; q_lens, ctx_lens: Python lists
    (new tokens, tokens cached before this step). ``decode_groups`` cut the decode rows into
    groups of up to ``DECODE_GROUP`` sequences (the runner sorts them by length, so a group pads
    to similar lengths): see :class:`DecodeGroup`.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    q_lens: list[int]
    ctx_lens: list[int]
    num_decode: int
    block_size: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)


def build_metadata(block_tables: list[list[int]], ctx_lens: list[int], q_lens: list[int],
                   num_decode: int, block_size: int, device: torch.device) -> PagedMetadata:
    """Metadata for S sequences from their block tables and token counts (Python lists)."""
    slots = []
    for table, start, n in zip(block_tables, ctx_lens, q_lens):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(start, start + n)]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in zip(ctx_lens, q_lens)], dtype=torch.int32)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    meta = PagedMetadata(torch.tensor(slots, dtype=torch.long, device=device),
                         tables.to(device), seq_lens.to(device), cu.to(device),
                         list(q_lens), list(ctx_lens), num_decode, block_size)
    for a in range(0, num_decode, DECODE_GROUP):
        b = min(a + DECODE_GROUP, num_decode)
        w = max(len(t) for t in block_tables[a:b])
        mask = torch.arange(w * block_size)[None] < seq_lens[a:b, None]
        meta.decode_groups.append(DecodeGroup(a, b, tables[a:b, :w].flatten().long().to(device),
                                              mask[:, None, None].to(device)))
    return meta


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' k, v [N, Hkv, D] at their slots of the [blocks, bs, Hkv, D] caches."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def sdpa_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: PagedMetadata) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D] (see the module docstring)."""
    out = torch.empty_like(q)
    nd = meta.num_decode
    for g in meta.decode_groups:
        out[g.start:g.end] = _decode(q[g.start:g.end], k_cache, v_cache, g)
    cu = meta.cu_seqlens_q.tolist()
    for i in range(nd, len(meta.q_lens)):
        rows = slice(cu[i], cu[i + 1])
        if meta.ctx_lens[i] == 0:
            ki, vi = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            ki, vi = (_gather(c, meta, i) for c in (k_cache, v_cache))
        out[rows] = sdpa_attention(q[rows].transpose(0, 1)[None], ki[None], vi[None])[0] \
            .transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, meta: PagedMetadata, i: int) -> torch.Tensor:
    """Sequence i's cached keys or values -> [Hkv, seq_len, D]."""
    n = meta.ctx_lens[i] + meta.q_lens[i]
    blocks = meta.block_tables[i, :-(-n // meta.block_size)].long()
    return cache[blocks].flatten(0, 1)[:n].transpose(0, 1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            group: DecodeGroup) -> torch.Tensor:
    """One query per sequence, q [B, Hq, D], over its padded, masked keys -> [B, Hq, D].
    Whole blocks are gathered (a few large copies, much faster than one per token); the query
    heads sharing a KV head are stacked on the query axis, so K/V are not copied per head."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    keys, values = (c.index_select(0, group.blocks).view(b, -1, hkv, d).transpose(1, 2)
                    for c in (k_cache, v_cache))                           # [B, Hkv, L, D]
    qg = q.view(b, hkv, hq // hkv, d)
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=group.mask) \
        .view(b, hq, d)


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedMetadata) -> torch.Tensor:
    """The same contract through the Triton paged kernels (compiled on CUDA, else interpreted)."""
    from ..device import setup_triton

    setup_triton()  # before the kernel module is first imported
    from ..kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    if meta.num_decode == len(meta.q_lens):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      check_values=False)[0]
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.seq_lens, max_seqlen_q=meta.max_q_len,
                                   check_values=False)[0]


PagedAttentionFn = Callable[..., torch.Tensor]
PAGED_BACKENDS: dict[str, PagedAttentionFn] = {"sdpa": sdpa_paged_attention,
                                               "triton": triton_paged_attention}


def get_paged_backend(name: str) -> PagedAttentionFn:
    """The paged attention function called ``name`` (sdpa or triton: the names the model's
    dense backends use, :data:`minillm.attention.BACKENDS`)."""
    try:
        return PAGED_BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention_backend must be one of {sorted(PAGED_BACKENDS)}, "
                         f"got {name!r}") from None
